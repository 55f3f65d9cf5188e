"""Helpers (no tests) for the fault-injection tests: streaming clients that record how
each request ended, and the deployment's processes as /health reports them."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import psutil

from support.server import Server, wait_until


@dataclass
class StreamOutcome:
    index: int
    status: Optional[int] = None
    texts: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # an SSE error event, an HTTP error body or a client exception
    ended_at: Optional[float] = None  # monotonic
    first_token: threading.Event = field(default_factory=threading.Event)

    @property
    def ended_explicitly(self) -> bool:
        """Completed, or told the client why not: never a silent hang or a cut connection."""
        return self.finish_reason is not None or (self.error is not None and "exception" not in self.error)


class StreamingClients:
    """``n`` concurrent streaming completions, each in its own thread."""

    def __init__(self, srv: Server, n: int, max_tokens: int, headers: Optional[dict] = None,
                 prompt: str = "The quick brown fox"):
        self.srv = srv
        self.outcomes = [StreamOutcome(i) for i in range(n)]
        self._threads = [threading.Thread(target=self._run, args=(o, f"{prompt} {i}", max_tokens, headers),
                                          daemon=True) for i, o in enumerate(self.outcomes)]

    def start(self) -> "StreamingClients":
        for t in self._threads:
            t.start()
        return self

    def _run(self, out: StreamOutcome, prompt: str, max_tokens: int, headers: Optional[dict]) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", self.srv.url + "/v1/completions", json=body, headers=headers,
                              timeout=120) as resp:
                out.status = resp.status_code
                if resp.status_code != 200:
                    out.error = json.loads(resp.read())["error"]["message"]
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        out.error = event["error"]["message"]
                        continue
                    for choice in event["choices"]:
                        out.texts.append(choice["text"])
                        out.first_token.set()
                        out.finish_reason = choice["finish_reason"] or out.finish_reason
        except Exception as exc:  # recorded, and the test asserts none happened
            out.error = f"client exception {exc!r}"
        finally:
            out.ended_at = time.monotonic()
            out.first_token.set()  # a request that failed before its first token releases waiters too

    def wait_all_streaming(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(o.first_token.wait(max(0.0, deadline - time.monotonic())) for o in self.outcomes)

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def health(srv: Server, timeout_s: float = 10) -> tuple[int, dict]:
    resp = httpx.get(srv.url + "/health", timeout=timeout_s)
    return resp.status_code, resp.json()


def processes(srv: Server, role: str, replica: Optional[int] = None) -> list[dict]:
    """Live processes of ``role`` as /health reports them (the supervisor's process table)."""
    _, body = health(srv)
    if role == "frontend":
        return [p for p in body.get("processes", []) if p["role"] == role and p["alive"]]
    return [p for r in body["replicas"] if replica is None or r["replica"] == replica
            for p in r["processes"] if p["role"] == role and p["alive"]]


def pid_of(srv: Server, role: str, replica: int = 0, timeout_s: float = 30) -> int:
    """The pid of the (single) live ``role`` process of ``replica``, once /health lists it."""
    found: list[int] = []

    def listed() -> bool:
        procs = processes(srv, role, replica)
        found[:] = [p["pid"] for p in procs if psutil.pid_exists(p["pid"])]
        return len(found) == 1

    assert wait_until(listed, timeout_s), f"no single live {role} of replica {replica} in /health"
    return found[0]


def completion(srv: Server, prompt, max_tokens: int = 8, headers: Optional[dict] = None,
               timeout_s: float = 60) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers=headers, timeout=timeout_s,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def serves_a_request(srv: Server, headers: Optional[dict] = None) -> bool:
    try:
        return completion(srv, "Hello", 3, headers, timeout_s=30).status_code == 200
    except httpx.HTTPError:
        return False


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its parent counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
