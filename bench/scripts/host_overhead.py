"""The host's share of a served token at one stream (issue 53, item 3): TPOT minus the worker's
forward, and the CPU each process spends per token.

``pagedserve serve`` on a small model (default: the random 3-layer Llama of ``bench peer``, whose
forward is short so that host costs stand out), streamed one request at a time by the openai
client (``bench peer``'s ``drive``). Per process (frontend, scheduler, worker, supervisor, and
this client), CPU time from ``psutil`` before and after the timed requests, divided by the
tokens served. CPU time rather than wall time: the machine may be shared.

    cd /tmp && python -P /path/to/bench/scripts/host_overhead.py [--model DIR] [--requests 4]
        [--output-len 256] [--pagedserve-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile
import time

import httpx
import psutil

from pagedserve.bench.peer import drive, ensure_llama_model, make_prompts
from pagedserve.bench.report import cpu_label
from pagedserve.bench.serve import _parse_metrics
from pagedserve.bench.servers import BenchServer, pagedserve_command

ROLES = ("frontend_proc", "scheduler_proc", "worker_proc")
STATS_PERIOD_S = 0.6  # the scheduler's stats (and the worker counters in /metrics) come every 0.5 s


def role_of(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    return next((r for r in ROLES if r in cmd), "supervisor/other")


def cpu_by_role(root: int) -> dict[str, tuple[float, float]]:
    """user + system seconds of every live process under ``root``, summed per role: the whole
    process, and its main thread alone (the rest: ZeroMQ's I/O thread, torch's threads)."""
    out: dict[str, tuple[float, float]] = {}
    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    for p in procs:
        try:
            t, role = p.cpu_times(), role_of(p)
            main = sum(th.user_time + th.system_time for th in p.threads() if th.id == p.pid)
        except psutil.NoSuchProcess:
            continue
        total, main_total = out.get(role, (0.0, 0.0))
        out[role] = (total + t.user + t.system, main_total + main)
    return out


def worker_seconds(url: str) -> tuple[float, float]:
    """The worker's forward and idle totals so far (/metrics): busy on steps, waiting for the next."""
    metrics = _parse_metrics(httpx.get(url + "/metrics").text)
    return metrics.get("worker_forward_s", 0.0), metrics.get("worker_idle_s", 0.0)


def wait_for_counters(url: str, before: float) -> tuple[float, float]:
    """The worker's totals once the run's last steps reach /metrics (with the stats, <= 0.5 s)."""
    deadline = time.monotonic() + 2.0
    fwd, idle = worker_seconds(url)
    while fwd == before and time.monotonic() < deadline:
        time.sleep(0.1)  # polling: the counters come with the scheduler's periodic stats
        fwd, idle = worker_seconds(url)
    time.sleep(STATS_PERIOD_S)  # one more stats period: the last steps' share
    return worker_seconds(url)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the random 3-layer Llama)")
    p.add_argument("--requests", type=int, default=4, help="timed requests, one at a time")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` options, one shell-quoted string")
    ns = p.parse_args()
    model = ns.model or str(ensure_llama_model())
    prompts = make_prompts(model, ns.requests + 1, (ns.input_len, ns.input_len))
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as logs, BenchServer(
            "pagedserve", lambda port: pagedserve_command(model, port, ("--device", "cpu",
                                                                       *shlex.split(ns.pagedserve_args))),
            logs) as server:
        asyncio.run(drive(server.url, "pagedserve", model, prompts[:1], ns.output_len, 1))  # warm-up
        time.sleep(2 * STATS_PERIOD_S)  # the warm-up's last steps reach /metrics with the next stats, not in the run's share
        (fwd0, idle0), cpu0, mine0 = worker_seconds(server.url), cpu_by_role(server.proc.pid), me.cpu_times()
        load = os.getloadavg()
        result = asyncio.run(drive(server.url, "pagedserve", model, prompts[1:], ns.output_len, 1))
        cpu1, mine1 = cpu_by_role(server.proc.pid), me.cpu_times()
        fwd1, idle1 = wait_for_counters(server.url, fwd0)
    tokens = result["output_tokens"]
    if result["failed"] or not tokens:
        raise SystemExit(f"requests failed: {result['errors']}")
    steps = tokens  # one decode step per token at one stream (the prefill step makes the first)
    tpot_ms = 1e3 * result["tpot_s"]["mean"]
    forward_ms = 1e3 * (fwd1 - fwd0) / steps
    print(f"cpu: {cpu_label()}; load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{ns.requests} requests x {ns.output_len} tokens, one at a time; {model}")
    print(f"TPOT mean {tpot_ms:.3f} ms; worker forward {forward_ms:.3f} ms/token; "
          f"host (TPOT - forward) {tpot_ms - forward_ms:.3f} ms/token; "
          f"worker idle between steps {1e3 * (idle1 - idle0) / steps:.3f} ms/token")
    print(f"{'process':<18}{'CPU ms/token':>14}{'main thread':>14}")
    for role in (*ROLES, "supervisor/other"):
        (total0, main0), (total1, main1) = cpu0.get(role, (0.0, 0.0)), cpu1.get(role, (0.0, 0.0))
        print(f"{role:<18}{1e3 * (total1 - total0) / tokens:>14.3f}{1e3 * (main1 - main0) / tokens:>14.3f}")
    client = (mine1.user + mine1.system - mine0.user - mine0.system) / tokens
    print(f"{'client (this)':<18}{1e3 * client:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
