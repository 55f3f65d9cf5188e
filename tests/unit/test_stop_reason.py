"""vLLM's stop_reason of one sample (client/sample_text.py): the stop string or requested
stop token that ended it, else None. Pure objects."""

from __future__ import annotations

import pytest

from pagedserve.tools.demo_model import build_tokenizer
from pagedserve.client.detokenizer import TextDecoder
from pagedserve.protocol.messages import RequestDelta
from pagedserve.client.sample_text import SampleText


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def _run(tokenizer, stop_strings, deltas):
    sample = SampleText(TextDecoder(tokenizer), stop_strings)
    for delta in deltas:
        sample.apply(delta)
    return sample


def test_a_requested_stop_token_is_the_stop_reason_and_eos_is_none(tokenizer):
    ids = tokenizer.encode("Hello there")
    stop_id, eos_id = 7, 3
    by_stop_id = _run(tokenizer, [], [RequestDelta("r", 0, [*ids, stop_id], "stop", stop_token_id=stop_id)])
    assert by_stop_id.stop_reason({stop_id}) == stop_id
    by_eos = _run(tokenizer, [], [RequestDelta("r", 0, [*ids, eos_id], "stop", stop_token_id=eos_id)])
    assert by_eos.stop_reason({stop_id}) is None
    by_length = _run(tokenizer, [], [RequestDelta("r", 0, ids, "length")])
    assert by_length.finish_reason == "length" and by_length.stop_reason({stop_id}) is None


def test_a_stop_string_is_the_stop_reason_even_when_a_stop_token_follows(tokenizer):
    ids = tokenizer.encode("Hello there world")
    sample = _run(tokenizer, ["there"], [RequestDelta("r", 0, ids[:-1], None),
                                       RequestDelta("r", 0, [ids[-1], 7], "stop", stop_token_id=7)])
    assert sample.finish_reason == "stop" and sample.stop_reason({7}) == "there"
