"""Drain: after SIGTERM, in-flight requests may run until --drain-timeout-s; then every
one still running is ended explicitly, so no client sees a connection cut mid-body.

uvicorn stops accepting connections at once and waits for open responses, but at its
own deadline it just closes them. So the frontend gives uvicorn ``DRAIN_GRACE_S`` more
than the drain timeout, and at the drain deadline ends every request still in flight
itself: a stream gets a final chunk whose open choices have ``finish_reason: "abort"``,
then an SSE error event and ``[DONE]``; a non-streaming request gets a 503 body
(``code: server_shutting_down``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import Optional

import uvicorn

from pagedserve.frontend_proc.engine_client import EngineClient

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 5.0  # after the drain deadline: time to write the error events and close
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also says when a signal began its shutdown: the drain waits on
    that instead of polling ``should_exit`` 20 times a second for the process's whole life."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.exit_requested = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        super().handle_exit(sig, frame)
        self._loop.call_soon_threadsafe(self.exit_requested.set)  # a signal handler: not inside the loop's step


async def end_requests_at_drain_deadline(exit_requested: asyncio.Event, engine: EngineClient,
                                         drain_timeout_s: float) -> None:
    """``exit_requested``: set when shutdown began (SIGTERM / SIGINT, ``DrainingServer``)."""
    await exit_requested.wait()
    deadline = time.monotonic() + drain_timeout_s
    log.info("draining: %d request(s) in flight may run for up to %gs", engine.num_in_flight(), drain_timeout_s)
    while engine.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    ended = engine.end_all_for_shutdown(
        f"the server is shutting down and the request was still running at the end of its "
        f"{drain_timeout_s:g}s drain; retry it")
    if ended:
        log.warning("drain deadline: ended %d request(s) still in flight", ended)
