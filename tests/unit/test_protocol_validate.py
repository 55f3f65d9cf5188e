"""Request ranges as pure objects: the protocol's types refuse out-of-range values when decoding,
``check_request`` refuses them (naming the field) before encoding, a rejected AddRequest frame
keeps its request id for an answer, and a scheduler refuses what its workers cannot look up."""

from __future__ import annotations

import math

import msgspec
import pytest

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import PROTOCOL_VERSION, ProtocolError, encode
from pagedserve.protocol.validate import InvalidField, RequestFrameDecoder, check_request, rejection_delta
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler


def add(prompt=(5, 6, 7), **sampling) -> m.AddRequest:
    return m.AddRequest("r", list(prompt), m.SamplingParams(**sampling), eos_token_ids=[2])


@pytest.mark.parametrize("field,value", [
    ("seed", 2**63), ("seed", 2**70), ("seed", -(2**63) - 1), ("stop_token_ids", [2**63]),
    ("stop_token_ids", [-1]), ("max_tokens", 0), ("max_tokens", 10**30), ("temperature", math.nan),
    ("temperature", math.inf), ("top_p", 0.0), ("top_p", math.nan), ("top_k", -2), ("n", 0),
    ("n", m.MAX_N + 1), ("min_tokens", -1), ("temperature", "x"), ("logprobs", 5)])
def test_an_out_of_range_sampling_field_is_refused_by_name_built_or_decoded(field, value):
    msg = add(**{field: value})
    with pytest.raises(InvalidField) as info:
        check_request(msg)
    assert info.value.field == field
    try:
        frame = msgspec.msgpack.encode((PROTOCOL_VERSION, msgspec.to_builtins(msg)))
    except OverflowError:
        return  # msgpack cannot carry it at all: only the check before encoding can catch it
    with pytest.raises(ProtocolError, match=field):
        RequestFrameDecoder().decode(frame)


def test_values_at_the_edges_of_their_ranges_are_accepted():
    check_request(add(seed=-(2**63), top_k=-1, temperature=0.0, top_p=1.0, n=m.MAX_N, min_tokens=3, max_tokens=3))
    check_request(add(seed=2**63 - 1, stop_token_ids=[511]), vocab_size=512)


def test_token_ids_outside_the_vocabulary_are_refused_only_when_the_vocabulary_is_known():
    check_request(add(prompt=[600]))
    for msg, field in [(add(prompt=[1, 512]), "prompt_token_ids"), (add(stop_token_ids=[512]), "stop_token_ids")]:
        with pytest.raises(InvalidField) as info:
            check_request(msg, vocab_size=512)
        assert info.value.field == field and "vocabulary" in str(info.value)


def test_a_rejected_add_request_frame_keeps_its_request_id_for_the_answer():
    decoder = RequestFrameDecoder()
    bad = msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "AddRequest", "request_id": "abc",
                                                     "prompt_token_ids": [1], "sampling": {"n": -5}}))
    for frame in (bad, b"\x93garbage", encode(m.AbortRequest(["x"]))[:-1]):
        with pytest.raises(ProtocolError):
            decoder.decode(frame)
    assert [rid for rid, _ in decoder.take_rejected()] == ["abc"]
    assert decoder.take_rejected() == []
    assert isinstance(decoder.decode(encode(add())), m.AddRequest)


def _frame_to_scheduler(sched: Scheduler, decoder: RequestFrameDecoder, msg: m.AddRequest) -> list[m.RequestDelta]:
    """What the scheduler's engine does with one frame: decode (the ranges), then add (the rest)."""
    try:
        decoded = decoder.decode(encode(msg))
    except ProtocolError:
        return [rejection_delta(rid, reason) for rid, reason in decoder.take_rejected()]
    return sched.add_request(decoded)


def test_a_scheduler_refuses_ids_its_workers_cannot_look_up_with_one_error_and_runs_on():
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=64, vocab_size=512))
    decoder = RequestFrameDecoder()
    for msg, field in [(add(prompt=[3, 512]), "prompt_token_ids"), (add(stop_token_ids=[2**63]), "stop_token_ids"),
                       (add(stop_token_ids=[512]), "stop_token_ids"), (add(seed=2**64 - 1), "seed"),
                       (add(min_tokens=5, max_tokens=4), "min_tokens")]:
        (delta,) = _frame_to_scheduler(sched, decoder, msg)
        assert delta.finish_reason == "error" and delta.error_kind == "invalid_request" and field in delta.error
    assert _frame_to_scheduler(sched, decoder, add(stop_token_ids=[511])) == [] and sched.has_unfinished()

