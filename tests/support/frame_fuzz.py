"""Helpers (no tests): hostile frames for the internal sockets, reproducible from a seed.

Every frame built here must be rejected by the receiving socket's decoder. Random
bytes and random msgpack values are never a valid message; valid messages are cut
short, given trailing junk, a wrong protocol version or a wrong envelope, sent to the
wrong channel, or bit-flipped. Bit flips can produce another *valid* message, so only
samples whose every one-bit variant is harmless are flipped (unknown request ids,
replica numbers that do not exist, steps far from any real one): see ``FLIPPABLE``.
"""

from __future__ import annotations

import random

import msgspec

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import MAX_FRAME_BYTES, PROTOCOL_VERSION, encode

SP = m.SamplingParams(max_tokens=4, temperature=0.0)
FAR_STEP = 3 << 40  # no real step is near this, whatever single bit is flipped

SAMPLES = {  # channel -> valid messages (cut, padded, re-versioned: never flipped)
    "scheduler_inputs": [m.AddRequest("fuzz-add", [1, 2, 3], SP), m.AbortRequest(["fuzz-x"]), m.Drain()],
    "worker_results": [m.WorkerHello(0, 1, "cpu", "x", 2, 4096, 10), m.WorkerReady(0, 10, 10),
                       m.StepResult(FAR_STEP, 0, ["fuzz-x"], [5], None, "boom")],
    "frontend_outputs": [m.RequestOutputs(0, 1, [m.RequestDelta("fuzz-x", 0, [5], "error", "boom")]),
                         m.RequestOutputs(0, 2, [], ["fuzz-x"], [0], [5]),
                         m.SchedulerStats(replica=7, state="failed")],
    "supervisor": [m.ProcessReady("worker", 9, 0, 1), m.RestartWorkers(9, "fuzz")],
    "worker_inputs": [m.WorkerInit(16, 8, 8, 64, 0),
                      m.SchedulerOutput(1, [m.NewRequestData("fuzz", [1, 2], 2, [0], 0, 2, SP, True)], [],
                                        m.DecodeBatch(["fuzz-d"], [4], [7], [(0, 1)]), [], [], [], [], [0], 3)],
}
FLIPPABLE = {
    "scheduler_inputs": [m.AbortRequest(["fuzz-abort-unknown-id"])],
    "worker_results": [m.StepResult(FAR_STEP, 0, ["fuzz-x"], [5], None, "boom"),
                       m.WorkerHello(0, 1, "cpu", "x", 2, 4096, 10), m.WorkerReady(0, 10, 10)],
    # replica 7 / 9: no single flip of 7 or 9 gives 0, the only replica of the fuzzed server
    "frontend_outputs": [m.RequestOutputs(0, 1, [m.RequestDelta("fuzz-x", 0, [5], "error", "boom")]),
                         m.RequestOutputs(0, 2, [], ["fuzz-x"], [0], [5]),
                         m.SchedulerStats(replica=7, state="ready")],
    "supervisor": [m.ProcessReady("worker", 9, 0, 1), m.RestartWorkers(9, "fuzz")],
    # Any valid variant of a worker's input would be obeyed (it trusts its scheduler): no flips.
    "worker_inputs": [],
}
# Valid messages of a channel other than the one fuzzed.
_NOT_FOR_WORKERS = [m.WorkerInit(16, 8, 8, 64, 0)]
OTHER_CHANNEL = {channel: _NOT_FOR_WORKERS for channel in SAMPLES}
OTHER_CHANNEL["worker_inputs"] = [m.AbortRequest(["x"]), m.StepResult(1, 0, [], [])]


def _random_msgpack(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randrange(-(1 << 63), 1 << 63)
    if kind == 1:
        return rng.random()
    if kind == 2:
        return "".join(rng.choice("abcAddRequesttype") for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([None, True, False, b"\x00\x01"])
    if kind == 4:
        return [_random_msgpack(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return {"type": rng.choice(["AddRequest", "StepResult", "Nope", 1])}
    return {str(_random_msgpack(rng, 3)): _random_msgpack(rng, depth + 1) for _ in range(rng.randrange(3))}


def _flip(frame: bytes, rng: random.Random) -> bytes:
    buf = bytearray(frame)
    i = rng.randrange(len(buf))
    buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def hostile_frames(channel: str, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    samples = [encode(s) for s in SAMPLES[channel]]
    flippable = [encode(s) for s in FLIPPABLE[channel]]
    out = []
    for _ in range(count):
        kind = rng.randrange(8)
        frame = rng.choice(samples)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(64)))
        elif kind == 1:
            out.append(msgspec.msgpack.encode([PROTOCOL_VERSION, _random_msgpack(rng)]))
        elif kind == 2:
            out.append(frame[:rng.randrange(len(frame))])
        elif kind == 3:
            out.append(frame + rng.randbytes(rng.randrange(1, 16)))
        elif kind == 4:
            body = msgspec.msgpack.decode(frame)[1]
            version = rng.choice([0, PROTOCOL_VERSION + 1, -1, 1 << 40, "1", None])
            out.append(msgspec.msgpack.encode([version, body]))
        elif kind == 5:
            body = msgspec.msgpack.decode(frame)[1]
            out.append(msgspec.msgpack.encode(rng.choice([body, {"v": PROTOCOL_VERSION, "m": body},
                                                          [PROTOCOL_VERSION, body, 0]])))
        elif kind == 6:
            out.append(encode(rng.choice(OTHER_CHANNEL[channel])))
        elif flippable:
            out.append(_flip(rng.choice(flippable), rng))
        else:
            out.append(rng.randbytes(rng.randrange(64, 4096)))
    return out


def oversized_frame() -> bytes:
    return b"\x92\x01" + b"\x00" * MAX_FRAME_BYTES  # one byte past the limit
