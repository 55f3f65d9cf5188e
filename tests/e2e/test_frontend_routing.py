"""Routing across replicas, replica failure and metrics, through a real frontend process."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest


pytestmark = pytest.mark.slow  # a real frontend process


def _load_until_seen(frontend, fakes, stats_per_replica):
    for fake, fields in zip(fakes, stats_per_replica):
        fake.stats_fields = fields
    frontend.wait_until(lambda r: all(
        x["num_running"] == f.get("num_running", 0) and x["num_waiting"] == f.get("num_waiting", 0)
        for x, f in zip(r.json()["replicas"], stats_per_replica)))


def _owner(fakes, request_id):
    return [f.replica for f in fakes if any(a.request_id == request_id for a in f.added)]


def test_each_request_goes_to_the_less_loaded_replica(env):
    frontend, fakes, _ = env
    with frontend.client() as http:
        _load_until_seen(frontend, fakes, [{"num_running": 6, "num_waiting": 3}, {}])
        first = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20}).json()
        _load_until_seen(frontend, fakes, [{}, {"num_running": 4, "kv_cache_usage": 0.9}])
        second = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20}).json()
    assert _owner(fakes, first["id"]) == [1]
    assert _owner(fakes, second["id"]) == [0]


def test_a_replica_going_silent_fails_its_in_flight_request_with_503(env):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.mode = "silent"
    _load_until_seen(frontend, fakes, [{"num_waiting": 5}, {}])
    with frontend.client() as http, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, "/v1/completions", json={"prompt": "Hi"})
        fakes[1].wait_for(lambda f: len(f.added) > 0)
        fakes[1].heartbeat = False
        response = pending.result(timeout=15)
    assert response.status_code == 503
    assert "replica 1" in response.json()["error"]["message"]
    fakes[1].wait_for(lambda f: f.added[-1].request_id in f.aborted)


def test_a_replica_going_silent_mid_stream_ends_the_stream_with_an_error_event(env):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.mode = "hold"
    _load_until_seen(frontend, fakes, [{"num_waiting": 5}, {}])
    with frontend.client() as http:
        body = {"prompt": "Hi", "max_tokens": 20, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"]
            fakes[1].heartbeat = False
            rest = [line for line in lines if line]
    events = [json.loads(line.removeprefix("data: ")) for line in rest if line != "data: [DONE]"]
    errors = [e for e in events if "error" in e]
    assert errors and errors[0]["error"]["type"] == "service_unavailable"
    # the choice is closed before the error event: a client reading chunks sees why it ended
    assert [c["finish_reason"] for e in events if "choices" in e for c in e["choices"]][-1] == "error"
    assert rest[-1] == "data: [DONE]"


def test_health_is_503_and_requests_are_refused_when_no_replica_is_live(env):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.heartbeat = False
    health = frontend.wait_until(lambda r: r.status_code == 503)
    assert {x["state"] for x in health.json()["replicas"]} == {"unresponsive"}
    with frontend.client() as http:
        response = http.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 503 and "no scheduler replica" in response.text


METRIC_NAMES = [
    "pagedserve_num_requests_running", "pagedserve_num_requests_waiting",
    "pagedserve_num_requests_swapped", "pagedserve_num_preemptions_total",
    "pagedserve_kv_cache_usage_ratio", "pagedserve_prefix_cache_queries_total",
    "pagedserve_prefix_cache_hits_total", "pagedserve_prompt_tokens_total",
    "pagedserve_generation_tokens_total", "pagedserve_recomputed_tokens_total",
    "pagedserve_num_swapped_blocks_total", "pagedserve_time_to_first_token_seconds_bucket",
    "pagedserve_time_per_output_token_seconds_bucket",
    "pagedserve_e2e_request_latency_seconds_bucket", "pagedserve_request_success_total",
]


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_metrics_sum_scheduler_stats_over_replicas_and_count_finished_requests(env):
    frontend, fakes, _ = env
    _load_until_seen(frontend, fakes, [
        {"num_running": 2, "prompt_tokens": 100, "num_preemptions_swap": 1},
        {"num_running": 3, "prompt_tokens": 50, "num_preemptions_recompute": 2}])
    with frontend.client() as http:
        assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
        text = http.get("/metrics").text
    for name in METRIC_NAMES:
        assert name in text
    model = '{model_name="tiny"}'
    for prefix in ("pagedserve_", "vllm:"):  # vLLM's names, for its dashboards, mean the same
        assert _sample(text, f"{prefix}num_requests_running{model}") == 5
        assert _sample(text, f"{prefix}prompt_tokens_total{model}") == 150
        assert _sample(text, f"{prefix}num_preemptions_total{model}") == 3
        assert _sample(text, f"{prefix}e2e_request_latency_seconds_count{model}") >= 1
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert _sample(text, name + model) >= 0
    assert _sample(text, 'pagedserve_request_success_total{finish_reason="stop",model_name="tiny"}') >= 1
    assert 'pagedserve_replica_up{model_name="tiny",replica="1"} 1.0' in text
