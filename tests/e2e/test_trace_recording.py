"""Recording through a real server, as the golden generator does, gives a trace that
replays exactly today: the goldens can always be regenerated from this code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder
from pagedserve.tools.replay import replay_workers
from pagedserve.tools.trace_show import summarize_trace
from pagedserve.protocol.trace import read_trace
from pagedserve.scheduler_proc.replay import replay_scheduler

pytestmark = pytest.mark.slow

GENERATOR = Path(__file__).parents[1] / "fixtures" / "make_golden_traces.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_golden_traces", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_trace_recorded_through_the_server_replays_exactly_both_ways(model_factory, tmp_path):
    gen = load_generator()
    entry = gen.make_golden(tmp_path, "fresh")
    path = str(tmp_path / entry["file"])
    trace = read_trace(path)
    assert trace.torn_tail is None
    assert trace.meta["config"]["enable_prefix_caching"] is True
    assert summarize_trace(trace).steps > 0
    report = replay_scheduler(path)
    assert report.ok, report.mismatch
    model = model_factory(gen.GOLDEN_MODEL["arch"], seed=gen.GOLDEN_MODEL["seed"])
    steps, tokens = replay_workers(path, model, "cpu", num_threads=1)
    assert steps == report.steps and tokens > 0


def test_a_tensor_parallel_trace_with_a_lost_worker_replays_exactly_both_ways(model_factory, tmp_path):
    import threading

    import httpx
    import psutil

    from support.server import Server, wait_until

    model = model_factory("qwen2")
    path = tmp_path / "tp.trace"
    srv = Server(model, ["--tensor-parallel-size", "2", "--num-gpu-blocks", "64", "--num-threads", "1",
                         "--record-trace", str(path)]).start(tmp_path)
    try:
        body = {"model": Path(model).name, "prompt": "Hello, world!", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
        long_done, decoding = threading.Event(), threading.Event()
        failure: list[str] = []

        def long_stream():
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                                  json={**body, "max_tokens": 1000, "stream": True}) as r:
                    if r.status_code != 200:
                        failure.append(f"{r.status_code}: {r.read()!r}")
                    for events, _ in enumerate(line for line in r.iter_lines() if line.startswith("data:")):
                        if events == 20:
                            decoding.set()
            except httpx.HTTPError as exc:
                failure.append(repr(exc))
            long_done.set()

        threading.Thread(target=long_stream, daemon=True).start()
        rank1 = [p for p in psutil.process_iter(["cmdline"])
                 if "pagedserve.worker_proc" in " ".join(p.info["cmdline"] or [])
                 and srv.run_dir_parent in " ".join(p.info["cmdline"])
                 and "--rank 1" in " ".join(p.info["cmdline"])]
        assert len(rank1) == 1
        assert decoding.wait(120), f"the long request never streamed 20 tokens: {failure}"
        rank1[0].kill()
        assert long_done.wait(60)
        assert wait_until(lambda: httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
                          .status_code == 200, 60)
    finally:
        srv.stop()
    summary = summarize_trace(read_trace(str(path)))
    assert summary.worker_failures == 1 and read_trace(str(path)).meta["config"]["tensor_parallel_size"] == 2
    report = replay_scheduler(str(path))
    assert report.ok, report.mismatch
    steps, tokens = replay_workers(str(path), model, "cpu", num_threads=1)
    assert steps == report.steps and tokens > 0


def test_a_bf16_draft_model_trace_replays_as_recorded_from_another_directory(model_factory, tmp_path, monkeypatch):
    """A replay computes as the recorded workers did: their dtype (auto would pick float32 for this
    float32 checkpoint, and the tokens would differ), their draft model (its proposals are compared
    too), and the weights are found from another directory than the one the server ran in."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.tools.replay import TraceError

    model = Path(model_factory("qwen2"))
    monkeypatch.chdir(model.parent)
    path = tmp_path / "bf16.trace"
    spec = {"method": "draft_model", "model": model.name, "num_speculative_tokens": 3}
    with LLM(model.name, dtype="bfloat16", speculative_config=spec, record_trace=str(path), num_threads=1,
             max_model_len=256) as llm:
        llm.generate(["Hello there, how are you", "Once upon a time"], SamplingParams(max_tokens=16, temperature=0))
    monkeypatch.chdir(tmp_path)
    trace = read_trace(str(path))
    assert trace.meta["config"]["model"] == str(model)
    results = [Decoder(m.WorkerToScheduler).decode(payload) for direction, payload in trace.records
               if direction == "from_worker"]
    assert any(isinstance(r, m.StepResult) and r.draft_token_ids for r in results)  # proposals to compare
    steps, tokens = replay_workers(str(path), None, None, num_threads=1)
    assert steps > 0 and tokens > 0
    with pytest.raises(TraceError, match="did not start on cuda"):  # no GPU here: unusable, not "differs"
        if __import__("torch").cuda.is_available():
            pytest.skip("this machine has CUDA")
        replay_workers(str(path), None, "cuda", num_threads=1)
