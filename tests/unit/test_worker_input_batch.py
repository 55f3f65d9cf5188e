"""The step's flattened batch (worker_proc/input_batch.py) against one written token by token."""

from array import array

import pytest
import torch

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.input_batch import BatchError, _as_tensor, build_forward_batch
from pagedserve.worker_proc.spec_verify import DraftRow

BLOCK = 16
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def held(req_id, num_tokens, computed, scheduled, blocks, samples=True):
    return HeldRequest(req_id, list(range(100, 100 + num_tokens)), min(num_tokens, 40), list(blocks), computed,
                       scheduled, GREEDY, seed=1, samples=samples)


def reference(requests, drafts):
    """Every field of the batch, one token at a time."""
    ids, positions, slots, starts, lens, rows, tables = [], [], [0], [], [], [], []
    for req in requests:
        proposed = drafts.get(req.req_id, [])
        tokens = req.token_ids[req.num_computed_tokens:req.num_computed_tokens + req.num_scheduled_tokens] + proposed
        for i, token in enumerate(tokens):
            position = req.num_computed_tokens + i
            ids.append(token)
            positions.append(position)
            starts.append(req.block_ids[position // BLOCK] * BLOCK + position % BLOCK)
        slots.append(slots[-1] + len(tokens))
        end = req.num_computed_tokens + len(tokens)
        lens.append(end)
        tables.append(req.block_ids[:-(-end // BLOCK)])
        if proposed:
            rows += range(slots[-1] - len(proposed) - 1, slots[-1])
        elif req.samples:
            rows.append(slots[-1] - 1)
    width = max(len(t) for t in tables)
    return dict(input_ids=ids, positions=positions, slot_mapping=starts, query_start_loc=slots, seq_lens=lens,
                sample_indices=rows, block_tables=[t + [0] * (width - len(t)) for t in tables])


def mixed_step():
    return [
        held("chunk", 60, 5, 35, [7, 3, 11]),  # positions 5..39 cross two block edges; samples nothing
        held("fresh", 3, 0, 3, [4]),
        held("speculating", 30, 29, 1, [9, 2, 12]),  # proposals run into its third block
        held("edge", 17, 16, 1, [5, 8]),  # a decode at the first slot of a new block
        held("decode", 40, 39, 1, [1, 6, 10, 13]),  # its table holds a block beyond this step's
    ]


@pytest.mark.parametrize("batched_decodes", [False, True])
def test_mixed_step_matches_the_token_by_token_batch(batched_decodes):
    requests = mixed_step()
    requests[0].samples = False
    drafts = {"speculating": [501, 502, 503]}
    batch = build_forward_batch(requests, BLOCK, torch.device("cpu"), batched_decodes=batched_decodes, drafts=drafts)
    want = reference(requests, drafts)
    for name, values in want.items():
        assert getattr(batch, name).tolist() == values, name
    assert batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype == torch.long
    assert batch.block_tables.dtype == batch.seq_lens.dtype == batch.query_start_loc.dtype == torch.int32
    assert batch.position_range == (0, 39)
    kinds = [(r.req_id, r.j) if isinstance(r, DraftRow) else r.req_id for r in batch.sampled_requests]
    assert kinds == ["fresh", ("speculating", 0), ("speculating", 1), ("speculating", 2), ("speculating", 3),
                     "edge", "decode"]
    if batched_decodes:
        assert batch.attention_plan.decode_rows.tolist() == [42, 43]
        assert batch.attention_plan.decode_seq_lens.tolist() == [17, 40]
        assert [(c.start, c.end) for c in batch.attention_plan.chunks] == [(0, 35), (35, 38), (38, 42)]


def test_a_step_with_nothing_to_sample_and_equal_tables():
    requests = [held("a", 40, 0, 20, [3, 4]), held("b", 40, 8, 20, [6, 5])]
    for r in requests:
        r.samples = False
    batch = build_forward_batch(requests, BLOCK, torch.device("cpu"), batched_decodes=False)
    assert batch.sample_indices.tolist() == [] and batch.sampled_requests == []
    assert batch.block_tables.tolist() == [[3, 4], [6, 5]]
    assert batch.slot_mapping.tolist() == reference(requests, {})["slot_mapping"]


def test_a_table_shorter_than_the_step_is_refused():
    with pytest.raises(BatchError, match="need 3 blocks"):
        build_forward_batch([held("short", 40, 20, 13, [1, 2])], BLOCK, torch.device("cpu"), batched_decodes=False)


def test_an_array_under_a_batch_tensor_cannot_grow_while_the_tensor_lives():
    # growing would move the array's memory and leave the tensor (on a CPU, the forward's input)
    # reading freed memory; the tensor holds the array's buffer instead
    values = array("q", [4, 5, 6])
    tensor = _as_tensor(values, torch.int64)
    with pytest.raises(BufferError):
        values.extend(range(1000))
    assert tensor.tolist() == [4, 5, 6]
    del tensor
    values.append(7)
