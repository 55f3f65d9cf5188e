"""The workers' half of structured output: a step's packed bitmask rows restrict exactly the
rows of the requests they name, whatever the sampling settings, and a malformed one is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, ProtocolError, encode
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.grammar_mask import apply_grammar_bitmask, unpack_bitmask
from pagedserve.worker_proc.input_batch import BatchError
from pagedserve.worker_proc.sampler import sample

VOCAB = 70  # not a multiple of 32: the last word is partly unused


def held(req_id: str, **sampling) -> HeldRequest:
    params = m.SamplingParams(**sampling)
    return HeldRequest(req_id, [1, 2, 3], 3, [0], 0, 1, params, seed=7)


def bitmask(rows: dict[str, list[int]]) -> m.GrammarBitmask:
    words = (VOCAB + 31) // 32
    packed = np.zeros((len(rows), words), dtype=np.uint32)
    for row, allowed in enumerate(rows.values()):
        for token in allowed:
            packed[row, token // 32] |= np.uint32(1 << (token % 32))
    return m.GrammarBitmask(list(rows), words, packed.astype("<u4").tobytes())


def test_masked_rows_only_ever_sample_allowed_tokens_and_the_others_are_untouched():
    requests = [held("free", temperature=1.0), held("json", temperature=1.0, top_k=5),
                held("choice", temperature=0.0), held("hot", temperature=2.0, top_p=0.5)]
    allowed = {"json": [3, 40, 69], "choice": [33], "hot": [0, 31, 32, 64]}
    grammar = bitmask(allowed)
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        logits = torch.randn(len(requests), VOCAB, generator=generator) * 4
        masked = apply_grammar_bitmask(logits, requests, grammar, step=1)
        assert torch.equal(masked[0], logits[0])
        tokens = sample(masked, requests).token_ids
        for req, token in zip(requests[1:], tokens[1:]):
            assert token in allowed[req.req_id]
        for req in requests:  # each request samples its next output index next time
            req.token_ids.append(0)


def test_a_row_wider_than_the_vocabulary_unpacks_to_exactly_the_vocabulary():
    grammar = bitmask({"a": [0, 69]})
    allowed = unpack_bitmask(grammar, VOCAB)
    assert allowed.shape == (1, VOCAB)
    assert allowed[0].nonzero().flatten().tolist() == [0, 69]


def test_a_bitmask_naming_a_request_that_does_not_sample_is_a_batch_error():
    with pytest.raises(BatchError, match="ghost"):
        apply_grammar_bitmask(torch.zeros(1, VOCAB), [held("real")], bitmask({"ghost": [1]}), step=3)


def test_a_bitmask_whose_size_does_not_fit_its_rows_is_refused_on_decode():
    good = bitmask({"a": [1], "b": [2]})
    out = m.SchedulerOutput(1, [], [], m.DecodeBatch([], [], [], []), [], [], [], [], [], 0, good)
    decoder = Decoder(m.SchedulerToWorker)
    assert decoder.decode(encode(out)).grammar == good
    good.words_per_row = 5  # changed after its check, as a bad peer's encoder could send it
    with pytest.raises(ProtocolError, match="grammar bitmask"):
        decoder.decode(encode(out))
