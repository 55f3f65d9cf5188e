"""The frontend's side of the scheduler replicas: the asyncio sockets around the engine session.

The decisions are ``client/engine_session.py``'s (the request table, replica choice, liveness and
loss, shared with the offline LLM); this module does the I/O around them and keeps it thin. One
PULL socket receives every replica's RequestOutputs, SchedulerStats and PrefixCacheEvents (read
asynchronously: a replica's stream of frames must never starve the loop, or a killed scheduler's
requests would never be failed); one PUSH socket per replica carries AddRequest / AbortRequest.
Each submitted request gets an inbox of its RequestDeltas; a watchdog hands what the session
finds lost (a replica silent, out of the ready/draining states, or a new scheduler process) to
the requests' inboxes as ReplicaFailed. The supervisor's ProcessTable arrives on the same socket
and only feeds /health.

With --enable-lora it is also the one writer of the deployment's adapters (``AdapterRegistry``):
each registration or removal goes to every replica, in order with the requests on its socket,
and a restarted scheduler is sent the whole registry again before any new request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import zmq
import zmq.asyncio

from pagedserve.client.engine_session import EngineSession, InFlight, Lost
from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.client.router import Router
from pagedserve.protocol.lora_adapter import AdapterSpec
from pagedserve.frontend_proc.errors import Conflict, ServiceUnavailable, TooManyRequests
from pagedserve.frontend_proc.zmq_async import AsyncReceiver
from pagedserve.protocol.messages import (
    AbortRequest, AddRequest, FrontendStarted, FrontendToScheduler, LoadLoRA, LoRAAdapter, PrefixCacheEvents,
    ProcessTable, RequestDelta, RequestOutputs, SchedulerStats, SchedulerToFrontend, UnloadLoRA, iter_deltas)
from pagedserve.protocol.rate_limited_log import RateLimitedLog
from pagedserve.protocol.zmq_io import Endpoints, Sender

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplicaFailed:
    message: str
    shutting_down: bool = False  # ended by the drain deadline, not by a fault


Event = Union[RequestDelta, ReplicaFailed]


@dataclass(slots=True, eq=False)
class RequestHandle(InFlight):
    """A request's inbox. Its task takes everything that arrived since it last looked in one
    go (``take``), so a task that wakes once per step handles that step's events together,
    and one that fell behind catches up in one pass instead of one wake-up per token."""

    pending: list = field(default_factory=list)
    waiter: Optional[asyncio.Future] = None

    def push(self, event: Event) -> None:
        self.pending.append(event)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Event]:
        """Every event that arrived since the last call, in order; waits for at least one."""
        while not self.pending:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        events, self.pending = self.pending, []
        return events


class EngineClient:
    def __init__(self, endpoints: Endpoints, router: Router, max_waiting_requests: Optional[int] = None,
                 adapters: Optional[AdapterRegistry] = None):
        """``adapters``: with --enable-lora, the registry (its --lora-modules already in it); None without."""
        self.router = router
        self.session = EngineSession(router)
        self.adapters = adapters
        self.max_waiting_requests = max_waiting_requests  # --max-waiting-requests, per replica
        self._ctx = zmq.asyncio.Context()
        self._outputs: AsyncReceiver[SchedulerToFrontend] = AsyncReceiver(
            self._ctx, endpoints.frontend_outputs(), SchedulerToFrontend)
        router.clock = self._outputs.read_up_to
        # Sends never wait (try_send), so they can happen anywhere, even in a cancelled
        # task's cleanup: plain synchronous sockets on their own context. The queues are
        # bounded (REQUEST_HWM): a replica that cannot keep up refuses new requests with a
        # 503, and aborts that do not fit wait in _pending_aborts (never dropped: blocks).
        self._send_ctx = zmq.Context()
        self._inputs = [Sender(self._send_ctx, endpoints.scheduler_inputs(r))
                        for r in range(len(router.replicas))]
        for sender in self._inputs:  # first on each socket: ahead of every request of this frontend
            sender.try_send(FrontendStarted())
        # Registry changes not yet on a replica's socket (its queue was full), sent before its next request
        self._pending_control: list[list[FrontendToScheduler]] = [[] for _ in router.replicas]
        for replica in range(len(self._inputs)):
            self._send_registry(replica)
        self._pending_aborts: list[list[str]] = [[] for _ in router.replicas]
        self._stray_log = RateLimitedLog(log)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop(), name="receive-outputs"),
                       asyncio.create_task(self._watchdog_loop(), name="replica-watchdog")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._outputs.close()
        for sender in self._inputs:
            sender.close()
        self._ctx.term()
        self._send_ctx.term()

    def submit(self, request: AddRequest) -> RequestHandle:
        seed = self.adapters.seed(request.lora_name) if self.adapters is not None else 0
        decision = self.session.choose(request.prompt_token_ids, priority=request.priority, seed=seed)
        if decision is None:
            raise ServiceUnavailable("no scheduler replica is ready; see GET /health")
        replica, predicted = self._shed(decision.replica), decision.predicted_hit_tokens
        if replica != decision.replica:
            predicted = 0
        if not self._flush_control(replica) or not self._inputs[replica].try_send(request):
            raise ServiceUnavailable(f"scheduler replica {replica} is not keeping up (its input queue "
                                     f"is full); retry the request later")
        handle = RequestHandle(request.request_id, replica, request.sampling.n, predicted, request.lora_name)
        self.session.track(handle)
        return handle

    # ------------------------------------------------------------------ LoRA adapters

    def load_adapter(self, name: str, spec: AdapterSpec, replace: bool = False) -> LoRAAdapter:
        """Register the adapter ``spec`` (AdapterRegistry.read) under ``name`` with every replica
        (POST /v1/load_lora_adapter); ``replace``: vLLM's load_inplace, new weights under a name
        already loaded. Raises AdapterNameError, or Conflict while requests in flight use the old one."""
        assert self.adapters is not None, "LoRA is off: the route does not exist"
        if replace and name in self.adapters:
            self._refuse_in_use(name, "replaced")
        adapter = self.adapters.add(name, spec, replace=replace)
        self._broadcast(LoadLoRA(adapter))
        return adapter

    def unload_adapter(self, name: str) -> LoRAAdapter:
        """Remove an adapter from every replica (POST /v1/unload_lora_adapter); UnknownAdapter, or
        Conflict while a request in flight uses it (the scheduler would end it with an error)."""
        assert self.adapters is not None, "LoRA is off: the route does not exist"
        if name in self.adapters:
            self._refuse_in_use(name, "unloaded")
        adapter = self.adapters.remove(name)
        self._broadcast(UnloadLoRA(name))
        return adapter

    def _refuse_in_use(self, name: str, what: str) -> None:
        using = self.session.using_adapter(name)
        if using:
            raise Conflict(f"The lora adapter '{name}' is in use by {using} request(s) in flight and cannot be "
                           f"{what} now; retry once they finish", param="lora_name")

    def _broadcast(self, msg: FrontendToScheduler) -> None:
        for replica in range(len(self._inputs)):
            self._send_control(replica, msg)

    def _send_registry(self, replica: int) -> None:
        """Every registered adapter to ``replica`` (at start, and to a restarted scheduler)."""
        for adapter in self.adapters or ():
            self._send_control(replica, LoadLoRA(adapter))

    def _send_control(self, replica: int, msg: FrontendToScheduler) -> None:
        self._pending_control[replica].append(msg)
        self._flush_control(replica)

    def _flush_control(self, replica: int) -> bool:
        """Send ``replica``'s pending registry changes in order; False while some still wait for room."""
        pending = self._pending_control[replica]
        while pending and self._inputs[replica].try_send(pending[0]):
            pending.pop(0)
        return not pending

    def _shed(self, replica: int) -> int:
        """Where the request goes under --max-waiting-requests: the chosen replica, or when its queue
        is full as far as this frontend knows, the live one with the most room; a 429 at once when
        every one is full (shedding across the router). The scheduler refuses what a stale view
        lets through (admission.py)."""
        limit = self.max_waiting_requests
        if limit is None:
            return replica
        target = self.router.with_room(replica, limit)
        if target is not None:
            return target
        raise overloaded(self.router, limit)

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request the client no longer needs; the scheduler frees its blocks."""
        if handle.done:
            return
        self.session.forget(handle)
        self._send_abort(handle.replica, [handle.request_id])

    def _send_abort(self, replica: int, request_ids: list[str]) -> None:
        pending = self._pending_aborts[replica]
        pending.extend(request_ids)
        if self._inputs[replica].try_send(AbortRequest(list(pending))):
            pending.clear()  # else retried by the watchdog until the scheduler has room

    def end_all_for_shutdown(self, reason: str) -> int:
        """End every request in flight with ``reason`` (the drain deadline); returns how many."""
        lost = self.session.lose_all(reason)
        for handle in lost.requests if lost is not None else ():
            handle.push(ReplicaFailed(reason, shutting_down=True))
            self._send_abort(handle.replica, [handle.request_id])
        return len(lost.requests) if lost is not None else 0

    async def _receive_loop(self) -> None:
        session = self.session
        while True:
            msg = await self._outputs.recv()
            try:
                if isinstance(msg, RequestOutputs):
                    for delta in iter_deltas(msg):
                        handle = session.on_delta(delta)
                        if handle is not None:
                            handle.push(delta)
                        else:
                            log.debug("delta for unknown or finished request %s dropped", delta.request_id)
                elif isinstance(msg, SchedulerStats):
                    if not session.knows(msg.replica):
                        self._stray_log.warning("stats from an unknown replica ignored", "replica %d", msg.replica)
                    lost = session.on_stats(msg)
                    if lost is not None:
                        self._fail(lost)
                elif isinstance(msg, PrefixCacheEvents):
                    session.on_cache_events(msg)
                elif isinstance(msg, ProcessTable):
                    self.router.processes = msg
            except Exception:  # one bad message must not stop every request's output
                log.exception("failed to handle %s", type(msg).__name__)

    async def _watchdog_loop(self) -> None:
        period = min(0.25, self.router.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                for replica, pending in enumerate(self._pending_aborts):
                    self._flush_control(replica)
                    if pending:
                        self._send_abort(replica, [])
                for lost in self.session.failed():
                    self._fail(lost)
            except Exception:  # the watchdog must outlive any one failure
                log.exception("replica watchdog check failed")

    def _fail(self, lost: Lost) -> None:
        """End the requests the session found lost; a new scheduler process gets the registry again."""
        if lost.restarted:
            self._pending_control[lost.replica].clear()  # the whole registry follows: it holds them all
            self._send_registry(lost.replica)
        if not lost.requests:
            return
        log.error("%s; failing %d in-flight request(s)", lost.reason, len(lost.requests))
        for handle in lost.requests:
            handle.push(ReplicaFailed(f"{lost.reason}; the request was lost, retry it"))
        # Fire-and-forget: if the replica comes back it frees whatever it still holds.
        self._send_abort(lost.replica, lost.request_ids)

    def num_in_flight(self) -> int:
        return len(self.session)


def overloaded(router: Router, limit: int) -> TooManyRequests:
    """The 429 of --max-waiting-requests, here and at the door (early_shed.py): one wording."""
    waiting = sum(r.num_waiting() for r in router.replicas)
    return TooManyRequests(f"the server is overloaded: {waiting} requests are waiting, every replica is at "
                           f"the limit of {limit} (--max-waiting-requests); retry later")
