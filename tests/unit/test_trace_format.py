"""The trace file format: what a crash, a bit flip or another version does to a reader."""

from __future__ import annotations

import os

import msgspec
import pytest

from pagedserve.tools.trace_show import summarize_trace
from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import PROTOCOL_VERSION, Decoder, encode
from pagedserve.protocol.trace import (
    HEADER_BYTES, TRACE_MAGIC, TraceError, TraceWriter, frame_record, read_trace, weights_fingerprint,
)

HELLO = m.WorkerHello(rank=0, pid=1, device="cpu", model_id="Qwen2ForCausalLM:abc", num_layers=2,
                      block_bytes=4096, max_gpu_blocks=100)
INIT = m.WorkerInit(block_size=8, num_gpu_blocks=24, num_cpu_blocks=4,
                    max_model_len=64, seed=3)


def write_trace(path, num_steps: int = 5) -> list[bytes]:
    writer = TraceWriter(str(path))
    writer.write_header(HELLO, INIT, {"block_size": 8, "seed": 3})
    frames = [encode(INIT)]
    writer.append("to_worker", frames[0])
    for step in range(1, num_steps + 1):
        out = m.SchedulerOutput(step=step, new_requests=[], cached_requests=[],
                                decodes=m.DecodeBatch([], [], [], []), finished_req_ids=[],
                                blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
                                new_block_ids_to_zero=[step], total_num_scheduled_tokens=1)
        frames.append(encode(out))
        writer.append("to_worker", frames[-1])
    writer.close()
    return frames


def test_a_trace_reads_back_every_record_in_order_with_its_header(tmp_path):
    frames = write_trace(tmp_path / "t.trace")
    trace = read_trace(str(tmp_path / "t.trace"))
    assert [p for _, p in trace.records] == frames
    assert trace.meta["protocol_version"] == PROTOCOL_VERSION
    assert trace.meta["model_id"] == HELLO.model_id
    assert trace.meta["init"]["num_gpu_blocks"] == 24 and trace.meta["config"]["seed"] == 3
    assert Decoder(m.WorkerToScheduler).decode(trace.hello_frame) == HELLO and trace.torn_tail is None


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEADER_BYTES + 3])
def test_a_torn_last_record_is_reported_and_everything_before_it_is_kept(tmp_path, cut):
    path = tmp_path / "t.trace"
    frames = write_trace(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - len(frame_record("to_worker", frames[-1])) + cut])
    trace = read_trace(str(path))
    assert [p for _, p in trace.records] == frames[:-1]
    assert "torn record 7" in trace.torn_tail


def test_a_zero_filled_tail_is_a_torn_tail_not_corruption(tmp_path):
    path = tmp_path / "t.trace"
    frames = write_trace(path)
    path.write_bytes(path.read_bytes() + b"\0" * 100)
    trace = read_trace(str(path))
    assert len(trace.records) == len(frames) and "zero bytes" in trace.torn_tail


def test_a_bit_flip_in_a_middle_record_is_refused_as_a_checksum_error(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="corrupt .*checksum mismatch"):
        read_trace(str(path))


def test_a_bit_flip_in_a_record_length_is_corruption_not_a_torn_tail(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path)
    data = bytearray(path.read_bytes())
    second_record = len(TRACE_MAGIC) + HEADER_BYTES + int.from_bytes(data[len(TRACE_MAGIC):][:4], "little")
    data[second_record + 2] ^= 0x01  # its length grows by 64 KiB: past the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="record 1 .*header checksum mismatch"):
        read_trace(str(path))


def test_a_trace_of_another_protocol_version_is_refused_with_both_versions_named(tmp_path):
    path = tmp_path / "t.trace"
    meta = {"protocol_version": PROTOCOL_VERSION + 1, "model_id": "x", "config": {}}
    path.write_bytes(TRACE_MAGIC + frame_record("meta", msgspec.msgpack.encode(meta))
                     + frame_record("hello", encode(HELLO)))
    with pytest.raises(TraceError, match=f"protocol version {PROTOCOL_VERSION + 1}.*speaks {PROTOCOL_VERSION}"):
        read_trace(str(path))


def test_other_files_and_other_trace_formats_are_refused_by_name(tmp_path):
    (tmp_path / "a").write_bytes(b"hello world")
    (tmp_path / "b").write_bytes(b"PAGEDSERVE-TRACE v9\n....")
    with pytest.raises(TraceError, match="not a pagedserve trace"):
        read_trace(str(tmp_path / "a"))
    with pytest.raises(TraceError, match="another format .*v9"):
        read_trace(str(tmp_path / "b"))
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(str(tmp_path / "missing"))


def test_a_trace_cut_inside_its_header_says_nothing_was_recorded(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path)
    path.write_bytes(path.read_bytes()[:len(TRACE_MAGIC) + 10])
    with pytest.raises(TraceError, match="no header"):
        read_trace(str(path))


def test_the_weights_fingerprint_tells_apart_models_that_share_a_config(model_factory):
    a, same, other = model_factory("qwen2", seed=1), model_factory("qwen2", seed=1, hidden_size=64), \
        model_factory("qwen2", seed=2)
    assert weights_fingerprint(a) == weights_fingerprint(same)  # the same bytes, built twice
    assert weights_fingerprint(a) != weights_fingerprint(other)
    assert weights_fingerprint("/nonexistent") is None


def test_a_write_error_stops_recording_instead_of_crashing_the_scheduler(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with pytest.raises(TraceError, match="cannot record a trace to /dev/full"):
        TraceWriter("/dev/full")  # at start: a clear error
    writer = TraceWriter(str(tmp_path / "t.trace"))
    writer.file.close()
    writer.file = open("/dev/full", "wb")  # the disk fills up while serving
    writer.append("to_worker", b"x" * 10_000)
    assert writer.broken and "space" in writer.broken
    writer.append("to_worker", b"y")  # a no-op now
    writer.close()


def write_steps(path, steps: list[m.SchedulerOutput]) -> None:
    writer = TraceWriter(str(path))
    writer.write_header(HELLO, INIT, {"block_size": 8, "seed": 3})
    for out in steps:
        writer.append("to_worker", encode(out))
    writer.close()


def test_trace_show_counts_decode_batches_as_decodes_and_follows_their_new_blocks(tmp_path):
    sp = m.SamplingParams(temperature=0.0)
    none = m.DecodeBatch([], [], [], [])
    new = [m.NewRequestData(r, list(range(8)), 8, [i], 0, 8, sp, True) for i, r in enumerate("ab")]
    decode = m.DecodeBatch(["a", "b"], [8, 8], [5, 6], [(1, 7)])  # "b" gets block 7
    # Then "b" is swapped out while "a" goes on, and resent with its blocks swapped back in.
    resend = m.NewRequestData("b", list(range(8)) + [6, 1], 8, [1, 7], 10, 0, sp, False)
    write_steps(tmp_path / "t.trace", [
        m.SchedulerOutput(1, new, [], none, [], [], [], [], [], 16),
        m.SchedulerOutput(2, [], [], decode, [], [], [], [], [7], 2),
        m.SchedulerOutput(3, [], [m.CachedRequestData("a", [1], [], 9, 1, True)], none, ["b"], [(7, 0)], [], [], [], 1),
        m.SchedulerOutput(4, [resend], [], m.DecodeBatch(["a"], [10], [2], []), [], [], [(0, 7)], [], [], 1),
    ])
    s = summarize_trace(read_trace(str(tmp_path / "t.trace")), per_step=True)
    assert (s.prefill_tokens, s.decode_tokens, s.preemptions_swap) == (16, 4, 1)
    assert "cached    0 decodes    2 tokens     2" in s.step_lines[1]


def test_trace_show_refuses_a_decode_of_an_unknown_sequence_or_block_index(tmp_path):
    new = m.NewRequestData("a", [1, 2], 2, [0], 0, 2, m.SamplingParams(), True)
    for decodes, refusal in ((m.DecodeBatch(["ghost"], [2], [5], []), "decode request 'ghost' is unknown"),
                             (m.DecodeBatch(["a"], [2], [5], [(1, 3)]), "new block 3 names decode 1, but the step has 1 decodes")):
        write_steps(tmp_path / "t.trace", [m.SchedulerOutput(1, [new], [], decodes, [], [], [], [], [], 3)])
        with pytest.raises(TraceError, match=refusal):
            summarize_trace(read_trace(str(tmp_path / "t.trace")))


def test_a_replayed_pooled_chunk_passes_within_float_rounding_and_fails_past_it():
    """A golden recorded on AVX-512 replays on AVX2: the pooled sums' last bits may move, nothing else."""
    import numpy as np

    from pagedserve.protocol.pooling import PooledChunk
    from pagedserve.tools.replay import pooled_difference

    values = np.random.default_rng(0).standard_normal(64).astype("<f4")
    recorded = PooledChunk(0, 5, values.tobytes())
    rounded = PooledChunk(0, 5, np.nextafter(values, np.float32(np.inf)).astype("<f4").tobytes())
    assert pooled_difference(recorded, recorded) is None
    assert pooled_difference(recorded, rounded) is None
    moved = values.copy()
    moved[3] += 1e-2
    assert "largest difference 0.01" in pooled_difference(recorded, PooledChunk(0, 5, moved.tobytes()))
    assert "positions 0+5, replayed 1+4" in pooled_difference(recorded, PooledChunk(1, 4, values.tobytes()))
    assert "replayed none" in pooled_difference(recorded, None)
