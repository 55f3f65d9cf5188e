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


def test_a_stop_string_inside_one_delta_of_several_tokens_ends_the_sample_at_its_last_token(tokenizer):
    """A speculative step delivers its accepted tokens in one delta: the sample ends, and its
    tokens are counted and returned, as if they had come one at a time (usage would bill the
    accepted tokens after the stop string otherwise)."""
    ids = tokenizer.encode("one two three four five six")
    ends_stop = next(j for j in range(1, len(ids) + 1) if "three" in tokenizer.decode(ids[:j]))
    assert ends_stop < len(ids)  # tokens follow the stop string inside the delta
    sample = SampleText(TextDecoder(tokenizer), ["three"])
    update = sample.apply(RequestDelta("r", 0, ids, None, logprobs=[-0.5] * len(ids),
                                       top_logprobs=[[(i, -0.5)] for i in ids]))
    assert update.finish_reason == "stop" and update.text == tokenizer.decode(ids[:ends_stop]).split("three")[0]
    assert update.consumed == ends_stop and update.token_ids == ids[:ends_stop]
    assert len(update.logprobs) == len(update.top_logprobs) == ends_stop
    # without stop strings, or when the string never comes, every token counts
    whole = SampleText(TextDecoder(tokenizer), ["seven"]).apply(RequestDelta("r", 0, ids, None))
    assert whole.consumed == len(ids) and whole.finish_reason is None


def test_min_tokens_holds_stop_strings_back_as_vllm_does(tokenizer):
    """vLLM's min_tokens: no stop string ends the sample within its first min_tokens tokens, and
    text from there is never searched; a later occurrence ends it."""
    ids = tokenizer.encode("one two three two four")
    within = next(j for j in range(1, len(ids)) if "two" in tokenizer.decode(ids[:j]))
    for min_tokens, ends in ((0, True), (within, True), (len(ids), False)):
        for deltas in ([[t] for t in ids], [ids]):  # a plain decode's deltas, or one speculative step's
            sample = SampleText(TextDecoder(tokenizer), ["two"], min_tokens=min_tokens)
            text = "".join(sample.apply(RequestDelta("r", 0, d, None)).text for d in deltas)
            text += sample.apply(RequestDelta("r", 0, [], "length")).text if sample.finish_reason is None else ""
            if not ends:
                assert sample.finish_reason == "length" and text == tokenizer.decode(ids)
            elif min_tokens == 0:
                assert sample.finish_reason == "stop" and text == "one "
            else:  # the first "two" came within min_tokens: the second one ends it
                assert sample.finish_reason == "stop" and text == "one two three "
