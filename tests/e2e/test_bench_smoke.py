"""The benchmarks run end to end at small scale: bench serve against a real server, a scenario on the LLM."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.bench.cli import bench_main
from support.server import Server

pytestmark = pytest.mark.slow


def run_bench(*args: str) -> int:
    return bench_main(argparse.Namespace(bench_args=list(args)))


def test_bench_serve_writes_a_json_result_and_a_png_plot(shared_server, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = run_bench("serve", "--url", shared_server.url, "--num-prompts", "6", "--input-len", "4", "12",
                   "--output-len", "5", "--max-concurrency", "4", "--metrics-interval", "0.1",
                   "--output-json", str(out_json), "--output-png", str(out_png), "--no-progress")
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_tokens"] == 30
    # one stream event per token (empty text mid-character): 4 gaps for 5 tokens
    assert all(r["output_tokens"] == 5 and len(r["itl"]) == 4 for r in result["requests"])
    assert result["ttft_s"]["p50"] > 0 and result["e2e_s"]["p99"] >= result["e2e_s"]["p50"]
    assert 0 < result["server_ttft_p50_s"] < 30  # from the server's histogram, over this run's requests
    assert result["metrics_samples"] and "kv_usage" in result["metrics_samples"][0]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_multi_turn_sends_each_turn_after_the_answer_and_reports_the_hit_rate(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "128", "--max-model-len", "1024",
                                          "--enable-prefix-caching"]).start(tmp_path)
    try:
        out_json = tmp_path / "m.json"
        rc = run_bench("serve", "--url", srv.url, "--dataset", "multi-turn", "--num-conversations", "2",
                       "--num-turns", "3", "--system-prompt-len", "40", "--turn-len", "8", "--output-len", "3",
                       "--output-json", str(out_json), "--output-png", str(tmp_path / "m.png"), "--no-progress")
    finally:
        srv.stop()
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    by_turn = sorted(result["requests"], key=lambda r: r["index"])
    for first, later in ((by_turn[0], by_turn[1]), (by_turn[1], by_turn[2])):  # one conversation
        assert later["start"] >= first["start"] + first["e2e"]  # asked only once answered
        assert later["prompt_tokens"] > first["prompt_tokens"] + 3  # the history grows
    assert 0.3 < result["prefix_hit_rate"] < 1.0


def test_tight_kv_scenario_completes_every_request_and_counts_preemptions(model_factory, tmp_path):
    out_json = tmp_path / "tight.json"
    rc = run_bench("scenario", "tight-kv", "--model", model_factory("qwen2"), "--num-requests", "9",
                   "--output-len", "24", "--output-json", str(out_json))
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["completed_all_tokens"] == 9 and result["failed"] == 0
    assert result["num_gpu_blocks"] < result["blocks_needed_by_all"]
    assert result["preemptions_recompute"] + result["preemptions_swap"] > 0
    assert sum(r["preemptions"] for r in result["requests"]) == \
        result["preemptions_recompute"] + result["preemptions_swap"]


def test_misaligned_over_http_reports_rounds_and_stops_its_server(model_factory, tmp_path):
    import psutil

    model = model_factory("qwen2")
    others = {p.pid for p in psutil.process_iter(["cmdline"]) if model in " ".join(p.info["cmdline"] or [])}
    out_json = tmp_path / "mis.json"
    rc = run_bench("scenario", "misaligned", "--http", "--model", model, "--rounds", "2", "--output-len", "4",
                   "--serve-args", "--num-gpu-blocks 64 --max-model-len 512", "--output-json", str(out_json))
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["preemptions"] == 0 and len(result["rounds"]) == 2
    assert all(r["alone_tok_s"] > 0 and r["aggregate_tok_s"] > 0 for r in result["rounds"])
    left = [p.pid for p in psutil.process_iter(["cmdline"])  # others: the session's shared server, say
            if model in " ".join(p.info["cmdline"] or []) and p.pid not in others]
    assert left == []  # the server it started (supervisor, frontend, scheduler, worker) is gone


def _policy_scenario(name: str, model: str, tmp_path, seconds: int) -> dict:
    out_json = tmp_path / f"{name}.json"
    rc = run_bench("scenario", name, "--model", model, "--seconds", str(seconds),
                   "--serve-args", "--num-gpu-blocks 256 --max-model-len 512", "--output-json", str(out_json))
    assert rc == 0
    return json.loads(out_json.read_text())


def test_a_policy_scenario_prints_both_policies_and_writes_them(model_factory, tmp_path, capsys):
    result = _policy_scenario("deadline", model_factory("qwen2"), tmp_path, 2)
    assert result["fcfs"]["tok_s"] > 0 and result["deadline"]["tok_s"] > 0
    assert 0.0 <= result["deadline"]["miss_rate"] <= 1.0
    table = capsys.readouterr().out
    assert "miss rate" in table and "fcfs" in table and "deadline" in table


def test_the_shedding_scenario_floods_from_its_own_process(model_factory, tmp_path, capsys):
    result = _policy_scenario("shedding", model_factory("qwen2"), tmp_path, 5)
    assert result["fcfs"]["flood"] == 0 and result["shedding"]["flood"] > 0  # its rows came back over the pipe
    # how many are refused depends on the machine's speed (a fast one may keep the queue short)
    assert 0 <= result["shedding"]["refused"] <= result["shedding"]["flood"]
    assert result["shedding"]["admitted_tpot_ms"] > 0
    assert "from a client process of its own" in capsys.readouterr().out
