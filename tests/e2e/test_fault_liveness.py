"""Liveness and drain with default settings (real processes): a stopped worker is caught
by the learned step timeout within seconds, and SIGTERM ends every stream explicitly."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from support.fault_helpers import StreamingClients, completion, health, pid_of, process_gone, serves_a_request
from support.server import Server, pagedserve_processes, wait_until

pytestmark = pytest.mark.slow

DRAIN_S = 3
# Streams long enough to outlast the drain on a fast machine: at a few ms per step, 1,500
# tokens can finish inside SIGTERM + DRAIN_S, and then nothing is left to end explicitly.
CONTEXT = 16384
LONG_STREAM = 15000
ARGS = ["--num-threads", "1", "--num-gpu-blocks", str(8 * CONTEXT // 16 + 256), "--max-model-len", str(CONTEXT),
        "--drain-timeout-s", str(DRAIN_S)]  # no --step-timeout-s: the default (60 s) upper bound


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2", max_position_embeddings=CONTEXT), ARGS).start(tmp_path_factory.mktemp("liveness"))
    yield srv
    srv.stop()


def test_a_stopped_worker_under_load_ends_every_stream_within_15s_and_service_returns(server):
    assert completion(server, "warm up", 64).status_code == 200  # the timeout learns from these steps
    worker = pid_of(server, "worker", 0)
    clients = StreamingClients(server, 32, 1500).start()
    try:
        assert clients.wait_all_streaming(120)
        stopped_at = time.monotonic()
        os.kill(worker, signal.SIGSTOP)
        assert clients.join(30), "a stream never ended"
        last = max(o.ended_at for o in clients.outcomes) - stopped_at
        assert all(o.ended_explicitly and o.error for o in clients.outcomes), \
            [(o.index, o.finish_reason, o.error) for o in clients.outcomes if not o.error]
        assert last < 15, f"the last stream ended {last:.1f}s after the worker stopped"
        assert wait_until(lambda: process_gone(worker), 20)  # replaced, not left stopped
        assert wait_until(lambda: serves_a_request(server), 90)
        print(f"\nSIGSTOP under 32 streams: all ended {last:.1f}s after, serving again "
              f"{time.monotonic() - stopped_at:.1f}s after")
    finally:
        if psutil.pid_exists(worker):
            os.kill(worker, signal.SIGKILL)


def test_sigterm_ends_streams_longer_than_the_drain_timeout_explicitly_never_silently(server):
    """Last in this module on purpose: it stops the deployment."""
    assert wait_until(lambda: health(server)[0] == 200, 60)
    clients = StreamingClients(server, 8, LONG_STREAM).start()
    result: dict = {}
    try:
        assert clients.wait_all_streaming(60)
        import threading

        plain = threading.Thread(target=lambda: result.setdefault("resp", completion(
            server, "not streamed", LONG_STREAM, timeout_s=120)))
        plain.start()
        assert wait_until(lambda: health(server)[1]["replicas"][0]["num_running"] >= 9, 30)
        server.proc.send_signal(signal.SIGTERM)
        assert clients.join(DRAIN_S + 30)
        plain.join(DRAIN_S + 30)
    finally:
        server.stop()
    for o in clients.outcomes:
        assert o.status == 200 and o.finish_reason == "abort" and "shutting down" in (o.error or ""), \
            (o.index, o.status, o.finish_reason, o.error)
    resp = result["resp"]
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down", resp.text
    assert server.proc.returncode == 0
    assert wait_until(lambda: not pagedserve_processes(server.run_dir_parent), 5)
