"""Decode steps through DecodeGraphs' static, padded buffers give transformers' tokens.

On CPU the same buffer path runs eagerly (capture=False), through the attention the graphs
would capture (the whole-batch kernel, not the CPU's batched-decode plan); with
PAGEDSERVE_TEST_DEVICE=cuda (tests/support/kernel_device.py) the graphs are captured and replayed.
Checked: padding rows, stale rows turned back into padding as the batch shrinks, and a
NaN-poisoned cache that padding rows read.
"""

from support.kernel_device import DEVICE, MARKS  # first: it decides TRITON_INTERPRET

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.cuda_graphs import DecodeGraphs
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts

pytestmark = MARKS
CAPTURE = DEVICE.type == "cuda"


def runner_for(model_dir: str) -> ModelRunner:
    return ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=False)  # the tests build their own


def test_decodes_padded_to_a_captured_size_give_transformers_tokens_over_a_poisoned_cache(tmp_path):
    model_dir = str(build_model_dir(tmp_path / "m", "qwen2", num_layers=2))
    runner = runner_for(model_dir)
    scheduler = TrivialScheduler(runner, block_size=4, max_model_len=256)
    runner.poison_cache()  # padding rows attend over whatever block 0 holds: NaN here
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.ops, block_size=4, max_model_len=256,
                          capture=CAPTURE)
    graphs.capture()
    runner.decode_graphs = graphs
    prompts = random_prompts([5, 9, 3, 14, 7], vocab_size=512, seed=4)
    # Five decoding rows shrink to one. When r2 (a middle row) ends, the last row's request
    # moves up and its old row becomes padding: left as it was, it would write over that
    # request's KV with a wrong context.
    lengths = [12, 3, 5, 9, 8]
    for i, (prompt, new_tokens) in enumerate(zip(prompts, lengths)):
        scheduler.add(f"r{i}", prompt, new_tokens)

    outputs = scheduler.run()

    for i, (prompt, new_tokens) in enumerate(zip(prompts, lengths)):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, [prompt], new_tokens)[0], f"r{i}"
    assert set(graphs.replays) == {8, 4, 2, 1}  # 5 -> 8, 4 and 3 -> 4, 2, 1 rows


def test_steps_that_are_not_one_token_per_request_or_too_wide_run_without_graphs(tmp_path):
    model_dir = str(build_model_dir(tmp_path / "m", "llama", num_layers=1))
    runner = runner_for(model_dir)
    TrivialScheduler(runner, block_size=4, max_model_len=64)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.ops, block_size=4, max_model_len=64,
                          max_batch=4, capture=False)
    assert graphs.sizes == [1, 2, 4]

    def batch(tokens: int, rows: int, width: int):
        from types import SimpleNamespace

        import torch

        return SimpleNamespace(input_ids=torch.zeros(tokens), seq_lens=torch.zeros(rows),
                               block_tables=torch.zeros(rows, width))

    assert graphs.size_for(batch(3, 3, 16)) == 4
    assert graphs.size_for(batch(1, 1, 1)) == 1
    assert graphs.size_for(batch(7, 3, 2)) is None  # a prefill chunk among them
    assert graphs.size_for(batch(5, 5, 2)) is None  # more rows than the largest graph
    assert graphs.size_for(batch(2, 2, 17)) is None  # wider than max_model_len allows


def _decode_batch(rows: list[tuple[int, int, int]], block_size: int):
    """One token per (block id, position, token id) row, each request in its own block."""
    import torch

    from pagedserve.worker_proc.input_batch import ForwardBatch

    blocks, positions, tokens = (torch.tensor(column, device=DEVICE) for column in zip(*rows))
    return ForwardBatch(
        input_ids=tokens, positions=positions, slot_mapping=blocks * block_size + positions,
        block_tables=blocks.to(torch.int32)[:, None],
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=(positions + 1).to(torch.int32), sample_indices=torch.arange(len(rows), device=DEVICE), sampled_requests=[],
        position_range=(0, int(positions.max())), attention_plan=None)


def test_padding_rows_write_no_kv_even_where_a_larger_step_left_its_rows(tmp_path):
    import torch

    from pagedserve.protocol.messages import WorkerInit

    runner = runner_for(str(build_model_dir(tmp_path / "m", "qwen2", num_layers=2)))
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, max_model_len=16, seed=0))
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.ops, block_size=4, max_model_len=16,
                          capture=CAPTURE)
    graphs.capture()
    with torch.inference_mode():
        graphs.forward(_decode_batch([(b, 2, 10 + b) for b in range(1, 6)], 4), 8)  # rows 0-4 of 8
        before = runner.kv_cache.clone()
        graphs.forward(_decode_batch([(b, 3, 20 + b) for b in range(1, 4)], 4), 4)  # rows 0-2 of 4

    changed = (runner.kv_cache != before).any(dim=(0, 1, 4, 5)).nonzero().tolist()  # [block, slot]
    assert changed == [[1, 3], [2, 3], [3, 3]]  # row 3 of the last step was padding: it wrote nothing
