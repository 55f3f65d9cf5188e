"""Tensor and data parallel through the real server on CPU: greedy tokens equal transformers'."""

from __future__ import annotations

import re

import httpx
import pytest

from support.greedy import assert_equal_to_transformers, client, greedy_completions
from support.oracle import hf_tokenizer
from support.server import Server, pagedserve_processes, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. A paged attention engine keeps",
    "def main():\n    return 42\n" * 3,
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]
SERVER_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "256",
               "--debug-invariants"]


def replica_generation_tokens(srv: Server) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^pagedserve_replica_generation_tokens_total\{model_name="[^"]*",replica="(\d+)"\} (\S+)$', text, re.M)}


def test_two_tensor_parallel_workers_serve_transformers_greedy_tokens_and_stop_cleanly(model_factory, tmp_path):
    model = model_factory("qwen2")  # 4 query heads, 2 KV heads: one KV head per rank
    srv = Server(model, [*SERVER_ARGS, "--tensor-parallel-size", "2"]).start(tmp_path)
    try:
        workers = [p for p in pagedserve_processes(srv.run_dir_parent) if "worker_proc" in " ".join(p.cmdline())]
        assert len(workers) == 2
        tok = hf_tokenizer(model)
        prompts = [tok(p).input_ids for p in PROMPTS]
        assert_equal_to_transformers(model, prompts, greedy_completions(srv, prompts, 12), 12)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert wait_until(lambda: not pagedserve_processes(srv.run_dir_parent), 10)
    log = srv.log()
    for crash in ("terminate called", "Traceback", "core dumped", "Aborted"):
        assert crash not in log, log


def test_two_data_parallel_replicas_share_many_concurrent_requests_and_answer_correctly(model_factory, tmp_path):
    model = model_factory("llama")
    srv = Server(model, [*SERVER_ARGS, "--data-parallel-size", "2"]).start(tmp_path)
    try:
        # /health is 200 as soon as one replica is up; routing needs both.
        assert wait_until(lambda: all(r["live"] for r in httpx.get(srv.url + "/health").json()["replicas"]), 60)
        tok = hf_tokenizer(model)
        prompts = [tok(f"{PROMPTS[i % len(PROMPTS)]} #{i}").input_ids for i in range(24)]
        results = greedy_completions(srv, prompts, 8)
        assert_equal_to_transformers(model, prompts, results, 8)
        # Counters arrive with the next stats heartbeat (every 0.5 s).
        assert wait_until(lambda: sum(replica_generation_tokens(srv).values()) == 24 * 8, 10)
        per_replica = replica_generation_tokens(srv)
        assert set(per_replica) == {"0", "1"}
        assert min(per_replica.values()) >= 8 * 4, per_replica  # both served a real share, not one stray
        # Streams and aborts follow the request to its replica: one stream per replica,
        # each dropped after a few chunks, stops generating there.
        c, name = client(srv), client(srv).models.list().data[0].id
        streams = [c.completions.create(model=name, prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}) for _ in range(2)]
        for stream in streams:
            for _, _chunk in zip(range(3), stream):
                pass
            stream.close()
        replicas = lambda: httpx.get(srv.url + "/health").json()["replicas"]  # noqa: E731
        assert wait_until(lambda: all(r["num_running"] == 0 and r["in_flight"] == 0 for r in replicas()), 60)
        assert wait_until(lambda: all(replica_generation_tokens(srv)[r] > per_replica[r] for r in "01"), 10)
        extra = {r: n - per_replica[r] for r, n in replica_generation_tokens(srv).items()}
        assert all(0 < n < 400 for n in extra.values()), extra  # each stream was cut short on its replica
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
