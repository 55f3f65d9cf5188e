"""Restart budget and graceful drain, through a real deployment (one replica each)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from support.fault_helpers import (StreamingClients, completion, health, pid_of, process_gone, processes,
                                  serves_a_request)
from support.server import Server, pagedserve_processes, wait_until

pytestmark = pytest.mark.slow


def test_a_replica_that_keeps_crashing_is_marked_failed_and_health_says_so(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "64", "--max-restarts", "1"]).start(tmp_path)
    try:
        first = pid_of(srv, "worker", 0)
        os.kill(first, signal.SIGKILL)  # within budget: replaced
        assert wait_until(lambda: serves_a_request(srv), 60)
        second = pid_of(srv, "worker", 0)
        assert second != first
        os.kill(second, signal.SIGKILL)  # over budget: the replica is failed, not restarted

        def failed() -> bool:
            status, body = health(srv)
            return status == 503 and body["replicas"][0]["state"] == "failed" and body.get("failed_replicas") == [0]

        assert wait_until(failed, 15), health(srv)
        resp = completion(srv, "Hello")
        assert resp.status_code == 503 and "no scheduler replica is ready" in resp.json()["error"]["message"]
        # It stays failed instead of flapping: nothing of replica 0 is started again.
        time.sleep(2)  # observing that nothing happens over a while; no event to poll for
        assert failed() and not processes(srv, "worker", 0) and not processes(srv, "scheduler", 0)
        assert processes(srv, "frontend")  # the frontend keeps answering
    finally:
        srv.stop()


def test_sigterm_finishes_the_request_in_flight_refuses_new_ones_then_exits(model_factory, tmp_path):
    # The longest request the demo model takes (its 4096 positions): on a fast, quiet machine 1500
    # tokens could finish before the refusal was seen, and the check below raced it.
    srv = Server(model_factory("qwen2", max_position_embeddings=4096),
                 ["--num-gpu-blocks", "256", "--max-model-len", "4096", "--drain-timeout-s", "60"]).start(tmp_path)
    try:
        url = srv.url + "/v1/completions"
        body = {"prompt": "drain me", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            in_flight = client.build_request("POST", url, json=body)
            result: dict = {}
            thread = threading.Thread(target=lambda: result.setdefault("resp", client.send(in_flight)))
            thread.start()
            assert wait_until(lambda: health(srv)[1]["replicas"][0]["num_running"] == 1, 30)
            srv.proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    return httpx.post(url, json={"prompt": "late", "max_tokens": 2}, timeout=10).status_code == 503
                except httpx.TransportError:
                    return True  # the listener is closed

            assert wait_until(refused, 10)
            assert thread.is_alive(), "the long request should still be running while new ones are refused"
            thread.join(90)
        resp = result["resp"]
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4000
        assert srv.proc.wait(30) == 0
        assert wait_until(lambda: not pagedserve_processes(srv.run_dir_parent), 5)
    finally:
        srv.stop()


def test_a_killed_frontend_is_restarted_on_the_same_port_and_its_requests_do_not_outlive_it(model_factory, tmp_path):
    long_context = model_factory("qwen2", max_position_embeddings=32768)
    srv = Server(long_context, ["--num-gpu-blocks", "8192", "--max-model-len", "32768", "--max-num-seqs", "4",
                                "--max-queue-time-s", "5"]).start(tmp_path)
    try:
        # the supervisor's process table reaches /health once a second
        assert wait_until(lambda: len(processes(srv, "frontend")) == 1, 30)
        before = [p["pid"] for p in processes(srv, "frontend")]
        scheduler = pid_of(srv, "scheduler", 0)
        clients = StreamingClients(srv, 4, 32000).start()  # every seat, for far longer than the test
        assert clients.wait_all_streaming(60)
        os.kill(before[0], signal.SIGKILL)
        assert wait_until(lambda: serves_a_request(srv), 60)
        assert wait_until(lambda: [p["pid"] for p in processes(srv, "frontend")] not in ([], before), 30)
        assert pid_of(srv, "scheduler", 0) == scheduler  # the replica was not touched
        # nobody reads the dead frontend's streams: the replica ended them, and its seats are free
        assert wait_until(lambda: health(srv)[1]["replicas"][0]["num_running"] == 0, 10), health(srv)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_hung_scheduler_is_detected_by_its_silence_and_the_replica_is_restarted(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "64", "--scheduler-timeout-s", "4",
                                          "--replica-timeout-s", "2"]).start(tmp_path)
    hung = pid_of(srv, "scheduler", 0)
    try:
        with httpx.Client(timeout=60) as client:
            result: dict = {}
            body = {"prompt": "hang", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
            thread = threading.Thread(target=lambda: result.setdefault(
                "resp", client.post(srv.url + "/v1/completions", json=body)))
            thread.start()
            assert wait_until(lambda: health(srv)[1]["replicas"][0]["num_running"] == 1, 30)
            os.kill(hung, signal.SIGSTOP)
            thread.join(30)
            assert result["resp"].status_code == 503  # an explicit error, not a hang
        assert wait_until(lambda: serves_a_request(srv), 60)
        assert pid_of(srv, "scheduler", 0) != hung
        assert wait_until(lambda: process_gone(hung), 10)
    finally:
        if psutil.pid_exists(hung):
            os.kill(hung, signal.SIGKILL)
        srv.stop()
