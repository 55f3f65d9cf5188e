"""Cache-aware routing end to end: two replicas keep a multi-turn workload's prefix hits and its tokens."""

from __future__ import annotations

import argparse
import asyncio
import random
import re

import httpx
import pytest
from transformers import AutoTokenizer

from pagedserve.bench import multi_turn as bench_multi_turn
from support.server import Server, wait_until

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--enable-prefix-caching", "--num-gpu-blocks", "512", "--max-model-len", "2048",
               "--max-num-batched-tokens", "512", "--num-threads", "1"]


def _workload(model: str) -> argparse.Namespace:
    """16 conversations x 6 turns sharing a system prompt of at least 256 tokens."""
    tok = AutoTokenizer.from_pretrained(model)
    words = next(n for n in range(64, 1024, 8)
                 if len(tok(bench_multi_turn._words(random.Random(0), n)).input_ids) >= 256)
    return argparse.Namespace(num_conversations=16, num_turns=6, system_prompt_len=words, turn_len=16,
                              think_time=0.0,
                              output_len=4, seed=0)


def _actual_hit_tokens(srv: Server) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(v) for v in re.findall(r'^pagedserve_router_actual_hit_tokens_total\{[^}]*\} (\S+)$',
                                            text, re.M))


def _converse(srv: Server, ns: argparse.Namespace) -> tuple[dict[int, str], float]:
    """Every turn's answer by record index, and the share of prompt tokens that hit the cache."""
    answers: dict[int, str] = {}
    prompt_tokens = 0

    async def run() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]

            async def send(rec, prompt, max_tokens):
                nonlocal prompt_tokens
                resp = await http.post("/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                prompt_tokens += body["usage"]["prompt_tokens"]
                answers[rec.index] = body["choices"][0]["text"]
                return answers[rec.index]

            await bench_multi_turn.run_conversations(ns, bench_multi_turn.conversation_records(ns), send)

    asyncio.run(run())
    assert len(answers) == ns.num_conversations * ns.num_turns
    return answers, _actual_hit_tokens(srv) / prompt_tokens


def test_two_replicas_hit_the_cache_almost_as_often_as_one_and_answer_the_same(model_factory, tmp_path):
    """Two cache-aware replicas: prefix hit rate >= 90% of one replica's, identical greedy answers."""
    model = model_factory("qwen2")
    ns = _workload(model)
    one = Server(model, SERVER_ARGS).start(tmp_path)
    try:
        answers_one, hit_rate_one = _converse(one, ns)
    finally:
        one.stop()
    two = Server(model, [*SERVER_ARGS, "--data-parallel-size", "2"]).start(tmp_path)
    try:
        assert wait_until(lambda: all(r["live"] for r in httpx.get(two.url + "/health").json()["replicas"]), 60)
        answers_two, hit_rate_two = _converse(two, ns)
        metrics = httpx.get(two.url + "/metrics").text
    finally:
        two.stop()
    assert answers_two == answers_one  # routing never changes a token
    assert hit_rate_one > 0.5, hit_rate_one
    assert hit_rate_two >= 0.9 * hit_rate_one, (hit_rate_two, hit_rate_one)
    per_replica = dict(re.findall(r'^pagedserve_router_requests_total\{replica="(\d)"\} (\S+)$', metrics, re.M))
    assert min(float(v) for v in per_replica.values()) >= 16, per_replica  # both replicas served conversations
    # Every later turn was routed by what the replicas had cached, and the router's view was true.
    cache_hits = float(re.search(r'^pagedserve_router_decisions_total\{reason="cache_hit"\} (\S+)$', metrics,
                                 re.M).group(1))
    assert cache_hits >= 0.8 * ns.num_conversations * (ns.num_turns - 1), metrics
    predicted = sum(float(v) for v in re.findall(
        r'^pagedserve_router_predicted_hit_tokens_total\{[^}]*\} (\S+)$', metrics, re.M))
    actual = sum(float(v) for v in re.findall(
        r'^pagedserve_router_actual_hit_tokens_total\{[^}]*\} (\S+)$', metrics, re.M))
    assert 0.8 * actual <= predicted <= actual, (predicted, actual)
