"""Unit tests of the frontend's text pipeline and routing policy (no processes, no sockets)."""

from __future__ import annotations

import random

import pytest

from pagedserve.tools.demo_model import build_tokenizer
from pagedserve.frontend_proc.request_stream import ChoiceState
from pagedserve.client.router import Router
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.client.detokenizer import REPLACEMENT_CHAR, StreamDetokenizer, WindowDetokenizer
from pagedserve.client.stop_strings import StopStringMatcher
from pagedserve.protocol.messages import SchedulerStats

MULTILINGUAL = "Émile ate crème brûlée in Zürich; 東京は大きい。 🙂🚀 🎉€ ∑ π done"


class _Decoder:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    def decode(self, ids):
        return self.hf.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


@pytest.fixture(params=["stream", "window"])
def new_detokenizer(request, tokenizer):
    """Both implementations must keep the same contract."""
    if request.param == "stream":
        return lambda: StreamDetokenizer(tokenizer.backend_tokenizer, _Decoder(tokenizer))
    return lambda: WindowDetokenizer(_Decoder(tokenizer))


def test_streamed_pieces_never_contain_half_characters_and_join_to_full_decode(tokenizer, new_detokenizer):
    ids = tokenizer.encode(MULTILINGUAL)
    detok = new_detokenizer()
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == MULTILINGUAL


def test_random_token_sequences_stream_to_the_full_decode(tokenizer, new_detokenizer):
    """Random ids (byte tokens that split characters, invalid byte runs, special tokens)
    arriving one or several per step join to exactly what decoding the whole list gives."""
    rng = random.Random(7)
    words = [tokenizer.encode(w) for w in MULTILINGUAL.split()]
    for _ in range(300):
        ids: list[int] = []
        while len(ids) < rng.randrange(1, 40):
            if rng.random() < 0.5:
                ids += rng.choice(words)
            else:
                ids.append(rng.randrange(len(tokenizer)))
        detok, pieces, i = new_detokenizer(), [], 0
        while i < len(ids):
            n = rng.choice([1, 1, 1, 2, 5])
            pieces.append(detok.add(ids[i:i + n]))
            i += n
        assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_character_split_over_byte_tokens_is_emitted_only_when_complete(tokenizer, new_detokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the test needs a character that spans several tokens"
    detok = new_detokenizer()
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"


def test_special_tokens_are_not_rendered(tokenizer, new_detokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hello") + [eos] + tokenizer.encode(" world")
    detok = new_detokenizer()
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == "Hello world"


def test_flush_emits_an_unfinished_byte_sequence_at_the_end(tokenizer, new_detokenizer):
    partial = tokenizer.encode("🎉")[:-1]
    detok = new_detokenizer()
    assert detok.add(partial) == ""
    assert detok.flush() == tokenizer.decode(partial)


def test_the_frontend_streams_with_decodestream_for_a_fast_tokenizer(tmp_path):
    build_tokenizer(512).save_pretrained(tmp_path)
    choice = ChoiceState(0, PromptTokenizer(tmp_path), stop_strings=[])
    assert isinstance(choice.text.detokenizer, StreamDetokenizer)


def test_stop_string_truncates_before_the_earliest_match():
    matcher = StopStringMatcher(["today", "world"])
    check = matcher.feed("Hello, world! How are you today?")
    assert (check.text, check.matched) == ("Hello, ", "world")
    assert matcher.feed("more").text == "" and matcher.flush() == ""


def test_stop_string_split_across_pieces_is_never_partially_emitted():
    matcher = StopStringMatcher(["world"])
    emitted = []
    for piece in ["Hel", "lo w", "or", "l", "d and more"]:
        check = matcher.feed(piece)
        emitted.append(check.text)
        assert "w" not in "".join(emitted)
    assert "".join(emitted) == "Hello " and matcher.matched == "world"


def test_held_back_tail_is_released_when_no_stop_string_matches():
    matcher = StopStringMatcher(["xyz"])
    assert matcher.feed("abcxy").text == "abc"
    assert matcher.flush() == "xy"


def test_without_stop_strings_text_passes_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").text == "abc" and matcher.flush() == ""


def _stats(replica, **fields):
    return SchedulerStats(replica=replica, state=fields.pop("state", "ready"), **fields)


def test_router_picks_the_least_loaded_live_replica():
    router = Router(2, timeout_s=1.0)
    router.update(_stats(0, num_running=8, num_waiting=4), now=10.0)
    router.update(_stats(1, num_running=2), now=10.0)
    assert router.pick(now=10.5) == 1


def test_router_counts_its_own_in_flight_requests_that_stats_do_not_show_yet():
    router = Router(2, timeout_s=1.0)
    router.update(_stats(0), now=10.0)
    router.update(_stats(1), now=10.0)
    router.assign(0, "a", 1)
    assert router.pick(now=10.1) == 1
    router.assign(1, "b", 2)
    assert router.pick(now=10.1) == 0


def test_router_skips_stale_and_not_ready_replicas_and_reports_failed_ones():
    router = Router(2, timeout_s=1.0)
    router.update(_stats(0), now=10.0)
    router.update(_stats(1, state="recovering"), now=10.9)
    router.assign(0, "a", 1)
    router.assign(1, "b", 1)
    assert router.pick(now=10.5) == 0
    assert router.pick(now=11.5) is None
    assert [r.replica for r in router.failed_replicas(now=10.5)] == [1]
    assert [r.replica for r in router.failed_replicas(now=11.5)] == [0, 1]
