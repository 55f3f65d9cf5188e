"""Test harness: a real frontend subprocess and scripted fake schedulers.

The session's shared `deployment` and the `env` fixture that resets it live in tests/e2e/conftest.py.

A FakeReplica plays one scheduler over real ZeroMQ sockets: it PULLs what the frontend
sends on scheduler_inputs(replica), answers AddRequests as its `mode` says, and PUSHes
SchedulerStats heartbeats (every 0.1 s) to frontend_outputs. Everything the frontend
sent it is recorded; tests wait on those records through a condition variable.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx
import zmq

from pagedserve.protocol.messages import (
    AbortRequest, AddRequest, FrontendToScheduler, LoadLoRA, RequestDelta, RequestOutputs,
    SchedulerStats, ToSupervisor, UnloadLoRA)
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender
from support.server import free_port

API_KEY = "test-key"
MAX_MODEL_LEN = 64
STATS_PERIOD_S = 0.1


async def poll(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait on this event loop until ``condition()`` holds (the frontend's own tasks run meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class FakeReplica:
    def __init__(self, run_dir: Path, replica: int, tokenizer, eos_token_id: int):
        self.replica = replica
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.mode = "finish"  # finish | hold | silent | reject
        self.reply_text = "Hello, world! How are you today?"
        self.stats_fields: dict = {}
        self.heartbeat = True
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.lora_frames: list = []  # LoadLoRA / UnloadLoRA, in arrival order
        self.stats_sent = 0  # heartbeats so far: one sent after a change of stats_fields carries it
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        endpoints = Endpoints(run_dir)
        self._inputs = Receiver(self._ctx, endpoints.scheduler_inputs(replica),
                                FrontendToScheduler, bind=True)
        self._outputs = Sender(self._ctx, endpoints.frontend_outputs())
        self._step = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait_for(self, predicate: Callable[["FakeReplica"], bool], timeout: float = 10.0):
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self), timeout), "timed out"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._inputs.close()
        self._outputs.close()
        self._ctx.term()

    def _run(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            if self.heartbeat and time.monotonic() >= next_stats:
                self._outputs.send(SchedulerStats(replica=self.replica,
                                                  **{"state": "ready", **self.stats_fields}))
                next_stats = time.monotonic() + STATS_PERIOD_S
                with self._cond:
                    self.stats_sent += 1
                    self._cond.notify_all()
            msg = self._inputs.recv(timeout_ms=20)
            if msg is None:
                continue
            with self._cond:
                if isinstance(msg, AddRequest):
                    self.added.append(msg)
                elif isinstance(msg, AbortRequest):
                    self.aborted.extend(msg.request_ids)
                elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                    self.lora_frames.append(msg)
                self._cond.notify_all()
            if isinstance(msg, AddRequest):
                self._answer(msg)

    def _send(self, *deltas: RequestDelta, tokens: Sequence[tuple[str, int, int]] = ()) -> None:
        """One RequestOutputs; ``tokens`` (request id, index, token) go in its token lists,
        where the real scheduler puts every plain token."""
        self._step += 1
        request_ids, indices, token_ids = (list(column) for column in zip(*tokens)) if tokens else ([], [], [])
        self._outputs.send(RequestOutputs(self.replica, self._step, list(deltas), request_ids, indices, token_ids))

    def _answer(self, req: AddRequest) -> None:
        if self.mode == "silent":
            return
        n_prompt = len(req.prompt_token_ids)
        if self.mode == "reject":
            self._send(RequestDelta(req.request_id, 0, [], finish_reason="error",
                                    error="prompt needs 99 KV blocks but the cache holds 8",
                                    error_kind="invalid_request", num_prompt_tokens=n_prompt))
            return
        reply = self.tokenizer.encode(self.reply_text)
        plain = not req.sampling.logprobs
        finish = self.mode == "finish"
        for index in range(req.sampling.n):
            for i, token in enumerate(reply):  # one token per message: exercises incremental decoding
                if not plain:
                    self._send(RequestDelta(req.request_id, index, [token], logprobs=[-0.5],
                                            num_prompt_tokens=n_prompt))
                elif i + 1 < len(reply) or not finish:
                    self._send(tokens=[(req.request_id, index, token)])
            if finish:
                # The last plain token shares the stop's message: lost unless the token lists
                # are applied before the deltas.
                last = [(req.request_id, index, reply[-1])] if plain and reply else []
                self._send(RequestDelta(req.request_id, index, [self.eos_token_id],
                                        finish_reason="stop", stop_token_id=self.eos_token_id,
                                        logprobs=None if plain else [-0.1], num_prompt_tokens=n_prompt),
                           tokens=last)


class FrontendProcess:
    """`python -m pagedserve.frontend_proc` as a subprocess, with its ProcessReady checked."""

    def __init__(self, run_dir: Path, model_dir: str, num_replicas: int, max_model_len: int,
                 replica_timeout_s: float = 1.0, api_key: Optional[str] = API_KEY,
                 extra_args: Sequence[str] = ()):
        self.port = free_port()
        self.run_dir = run_dir
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._ctx = zmq.Context()
        self._supervisor = Receiver(self._ctx, Endpoints(run_dir).supervisor(), ToSupervisor)
        cmd = [sys.executable, "-m", "pagedserve.frontend_proc", "--run-dir", str(run_dir),
               "--model", model_dir, "--served-model-name", "tiny", "--port", str(self.port),
               "--data-parallel-size", str(num_replicas), "--max-model-len", str(max_model_len),
               "--replica-timeout-s", str(replica_timeout_s), "--log-level", "warning"]
        if api_key:
            cmd += ["--api-key", api_key]
        cmd += list(extra_args)
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready_msg = self._supervisor.recv(timeout_ms=60_000)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=20)

    def wait_until(self, predicate: Callable[[httpx.Response], bool], timeout: float = 20.0):
        """Poll /health until predicate(response) holds."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"frontend exited with {self.proc.returncode}"
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=2)
                if predicate(response):
                    return response
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "frontend health condition not reached"
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._supervisor.close()
        self._ctx.term()


@contextmanager
def fake_deployment(tmp_path_factory, model_dir: str, num_replicas: int, max_model_len: int,
                    extra_args: Sequence[str] = ()):
    """A frontend process (API key, 1 s replica timeout) in front of scripted fake replicas,
    once every replica is live: yields (frontend, fakes, tokenizer)."""
    run_dir = tmp_path_factory.mktemp("run")
    os.chmod(run_dir, 0o700)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    fakes = [FakeReplica(run_dir, r, tokenizer, eos) for r in range(num_replicas)]
    frontend = None
    try:
        frontend = FrontendProcess(run_dir, model_dir, num_replicas=num_replicas,
                                   max_model_len=max_model_len, extra_args=extra_args)
        assert frontend.ready_msg is not None and frontend.ready_msg.role == "frontend"
        frontend.wait_until(lambda r: r.status_code == 200 and all(
            x["live"] for x in r.json()["replicas"]))
        yield frontend, fakes, tokenizer
    finally:
        if frontend is not None:
            frontend.close()
        for fake in fakes:
            fake.close()

