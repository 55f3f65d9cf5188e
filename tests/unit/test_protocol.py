"""The wire protocol: every message round-trips; every bad frame is one clear error."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import PROTOCOL_VERSION, Decoder, ProtocolError, encode
from pagedserve.protocol.rate_limited_log import RateLimitedLog
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir, wait_readable

SP = m.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=7, n=2,
                      stop_token_ids=[3], ignore_eos=True, min_tokens=1, logprobs=True)

NO_DECODES = m.DecodeBatch([], [], [], [])
ADAPTER = m.LoRAAdapter("sql", 3, "/adapters/sql", "ab" * 32)

SAMPLES = {
    m.FrontendToScheduler: [
        m.AddRequest("r1", [1, 2, 3], SP, eos_token_ids=[0]),
        m.AbortRequest(["r1", "r2"]),
        m.Drain(),
        m.FrontendStarted(),
        m.AddRequest("r2", [4], SP, lora_name="sql"),
        m.LoadLoRA(ADAPTER),
        m.UnloadLoRA("sql"),
    ],
    m.SchedulerToFrontend: [
        m.RequestOutputs(0, 3, [m.RequestDelta("r1", 1, [4, 5], "stop", None, None, 3, 1, [-0.5, -0.1], 5)]),
        m.RequestOutputs(0, 4, [], token_request_ids=["r2", "r3", "r3"], token_indices=[0, 0, 1],
                         token_ids=[6, 7, 8]),
        m.SchedulerStats(replica=1, state="ready", num_running=2, kv_cache_usage=0.25, pid=41,
                         cache_events_sent=3),
        m.PrefixCacheEvents(1, 41, 3, reset=True, stored=[-(1 << 62), 5], removed=[(1 << 63) - 1]),
        m.ProcessTable(supervisor_pid=40, processes=[m.ProcessInfo("scheduler", 1, 0, 41, True),
                                                     m.ProcessInfo("frontend", -1, 0, 44, False)],
                       replica_restarts=[0, 2], failed_replicas=[1]),
    ],
    m.SchedulerToWorker: [
        m.WorkerInit(16, 100, 10, 256, 0),
        m.SchedulerOutput(
            step=4,
            new_requests=[m.NewRequestData("a", [1, 2], 2, [7], 0, 2, SP, True)],
            cached_requests=[m.CachedRequestData("b", [9], [8], 17, 1, True)],
            decodes=m.DecodeBatch(["d", "e"], [30, 5], [11, 12], [(1, 9)]),
            finished_req_ids=["c"], blocks_to_swap_out=[(1, 2)], blocks_to_swap_in=[(2, 3)],
            blocks_to_copy=[(4, 5)], new_block_ids_to_zero=[7, 8], total_num_scheduled_tokens=3),
        m.GroupedSchedulerOutput(
            step=5, new_requests=[m.NewRequestData("a", [1, 2], 2, [7], 0, 2, SP, True)], cached_requests=[],
            decodes=m.DecodeBatch([], [], [], []), finished_req_ids=[], blocks_to_swap_out=[], blocks_to_swap_in=[],
            blocks_to_copy=[], new_block_ids_to_zero=[7, 9], total_num_scheduled_tokens=2,
            window_block_ids={"a": [[9]]}),
        m.LoRAStep(4, loads=[m.LoRASlot(1, ADAPTER)], prefetch=[ADAPTER], forget=["old"], request_slots={"a": 1}),
    ],
    m.WorkerToScheduler: [
        m.WorkerHello(0, 123, "cpu", "Qwen2ForCausalLM:abcd", 2, 4096, 1000, "node-1"),
        m.GroupedWorkerHello(0, 123, "cpu", "Gemma3ForCausalLM:abcd", 4, 4096, 1000, "node-1",
                             layer_windows=[8, 0, 8, 0]),
        m.WorkerReady(0, 100, 10),
        m.StepResult(4, 0, ["a"], [11], [-0.25], None, 0.01, 0.001),
    ],
    m.ToSupervisor: [
        m.ProcessReady("worker", 0, 1, 99),
        m.RestartWorkers(0, "hung"),
        m.Heartbeat("scheduler", 0, 99),
    ],
}


@pytest.mark.parametrize("union", list(SAMPLES), ids=lambda u: "|".join(a.__name__ for a in u.__args__))
def test_every_message_type_round_trips_on_its_channel(union):
    decoder = Decoder(union)
    for msg in SAMPLES[union]:
        assert decoder.decode(encode(msg)) == msg


def test_every_message_class_is_covered_by_a_sample():
    covered = {type(msg) for msgs in SAMPLES.values() for msg in msgs}
    declared = {cls for union in SAMPLES for cls in union.__args__}
    assert covered == declared


def test_empty_cache_op_lists_are_still_on_the_wire():
    out = m.SchedulerOutput(1, [], [], NO_DECODES, [], [], [], [], [], 0)
    raw = msgspec.msgpack.decode(encode(out))
    body = raw[1]
    for key in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "new_block_ids_to_zero"):
        assert body[key] == []
    assert body["decodes"] == {"type": "DecodeBatch", "req_ids": [], "num_computed_tokens": [], "token_ids": [],
                               "new_blocks": []}


def test_a_decode_batch_round_trips_with_its_block_pairs_as_tuples():
    decodes = m.DecodeBatch(["a", "b", "c"], [7, 0, 12], [1, 2, 3], [(0, 4), (2, 5)])
    out = m.SchedulerOutput(9, [], [], decodes, [], [], [], [], [], 3)
    back = Decoder(m.SchedulerToWorker).decode(encode(out))
    assert back == out and back.decodes.new_blocks == [(0, 4), (2, 5)]


def test_a_decode_batch_with_a_malformed_block_pair_is_refused():
    body = {"type": "DecodeBatch", "req_ids": ["a"], "num_computed_tokens": [1], "token_ids": [2],
            "new_blocks": [[0, 4, 5]]}
    out = msgspec.to_builtins(m.SchedulerOutput(1, [], [], NO_DECODES, [], [], [], [], [], 1))
    out["decodes"] = body
    with pytest.raises(ProtocolError):
        Decoder(m.SchedulerToWorker).decode(msgspec.msgpack.encode([PROTOCOL_VERSION, out]))


def test_request_outputs_token_lists_default_to_empty_and_round_trip():
    plain = m.RequestOutputs(0, 1, [m.RequestDelta("r", 0, [], "abort")])
    assert (plain.token_request_ids, plain.token_indices, plain.token_ids) == ([], [], [])
    both = m.RequestOutputs(1, 2, [m.RequestDelta("r", 0, [9], "stop")], ["s"], [1], [4])
    assert Decoder(m.SchedulerToFrontend).decode(encode(both)) == both


def test_iter_deltas_applies_the_token_lists_before_the_deltas():
    end = m.RequestDelta("a", 0, [3], "stop", stop_token_id=3)
    logprob = m.RequestDelta("b", 0, [4], logprobs=[-0.5])
    outputs = m.RequestOutputs(0, 7, [end, logprob], token_request_ids=["a", "c", "a"],
                               token_indices=[0, 0, 1], token_ids=[1, 2, 5])
    assert list(m.iter_deltas(outputs)) == [
        m.RequestDelta("a", 0, [1]), m.RequestDelta("c", 0, [2]), m.RequestDelta("a", 1, [5]), end, logprob,
    ]
    assert list(m.iter_deltas(m.RequestOutputs(0, 8, []))) == []


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"garbage that is not msgpack", b"\x92\x01",
                                   msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "Nope"}]),
                                   msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "AbortRequest",
                                                                              "request_ids": [1]}]),
                                   msgspec.msgpack.encode({"a": 1})])
def test_garbage_and_malformed_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        Decoder(m.FrontendToScheduler).decode(frame)


def test_truncated_frames_raise_protocol_error():
    frame = encode(SAMPLES[m.SchedulerToWorker][1])
    decoder = Decoder(m.SchedulerToWorker)
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            decoder.decode(frame[:cut])


def test_wrong_version_is_refused_with_both_versions_named():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, m.AbortRequest(["x"])])
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1}.*speaks {PROTOCOL_VERSION}"):
        Decoder(m.FrontendToScheduler).decode(frame)


def test_a_message_of_another_channel_is_refused():
    with pytest.raises(ProtocolError):
        Decoder(m.SchedulerToWorker).decode(encode(m.AbortRequest(["x"])))


def test_oversized_frames_are_refused_before_decoding():
    decoder = Decoder(m.FrontendToScheduler, max_frame_bytes=64)
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.decode(encode(m.AbortRequest(["x" * 100])))


def test_unknown_fields_are_refused():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "AbortRequest", "request_ids": [], "extra": 1}])
    with pytest.raises(ProtocolError):
        Decoder(m.FrontendToScheduler).decode(frame)


def test_run_dir_is_private():
    path = make_run_dir()
    try:
        assert (path.stat().st_mode & 0o777) == 0o700
    finally:
        path.rmdir()


def test_receiver_skips_bad_frames_and_keeps_receiving(tmp_path):
    ctx = zmq.Context()
    ep = Endpoints(tmp_path).scheduler_inputs(0)
    rx = Receiver(ctx, ep, m.FrontendToScheduler)
    tx = Sender(ctx, ep)
    try:
        tx.send_bytes(b"\x00garbage")
        tx.send_bytes(msgspec.msgpack.encode([99, m.Drain()]))
        tx.send(m.AbortRequest(["ok"]))
        assert rx.recv(timeout_ms=5000) == m.AbortRequest(["ok"])
        assert rx.num_rejected == 2
    finally:
        rx.close()
        tx.close()
        ctx.term()


def test_invalid_utf8_in_a_string_field_is_a_protocol_error_not_a_crash():
    frame = encode(m.AbortRequest(["abcd"])).replace(b"abcd", b"ab\xf4d")
    with pytest.raises(ProtocolError):
        Decoder(m.FrontendToScheduler).decode(frame)


def test_deeply_nested_garbage_is_a_protocol_error():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "AbortRequest", "request_ids": []}])
    nested = b"\x92\x01" + b"\x91" * 100_000 + b"\x00"
    for bad in (nested, frame[:2] + b"\x91" * 100_000):
        with pytest.raises(ProtocolError):
            Decoder(m.FrontendToScheduler).decode(bad)


class _PollCountingSocket(zmq.Socket):
    """A real socket that counts its polls: how often a waiting loop woke up."""
    polls = 0

    def poll(self, timeout=None, flags=zmq.POLLIN):
        self.polls += 1
        return super().poll(timeout, flags)


def test_a_receive_with_a_timeout_sleeps_until_it_passes_instead_of_spinning(tmp_path):
    # Every process waits this way (the supervisor 10 times a second, the scheduler while a step
    # runs): the last millisecond of each wait polled with timeout 0 in a loop, ~80 times, on
    # cores the forward pass needs.
    ctx = zmq.Context()
    sock = _PollCountingSocket(ctx, zmq.PULL)
    sock.bind(Endpoints(tmp_path).scheduler_inputs(0))
    try:
        for _ in range(5):
            assert not wait_readable(sock, time.monotonic() + 0.02, RateLimitedLog(logging.getLogger(__name__)))
        assert sock.polls <= 5 * 2
    finally:
        sock.close(linger=0)
        ctx.term()
