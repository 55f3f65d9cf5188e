"""The frontend's side of the scheduler replicas: submit, abort, and deltas per request.

One PULL socket receives every replica's RequestOutputs and SchedulerStats; one PUSH
socket per replica carries AddRequest / AbortRequest. Each submitted request gets a
queue of its RequestDeltas; a watchdog turns a replica that stops sending stats (or
leaves the ready/draining states) into a ReplicaFailed event for its requests, and so
does a heartbeat from a new scheduler process (a restarted replica knows none of them).
The supervisor's ProcessTable arrives on the same socket and only feeds /health.

With --enable-lora it is also the one writer of the deployment's adapters (``AdapterRegistry``):
each registration or removal goes to every replica, in order with the requests on its socket,
and a restarted scheduler is sent the whole registry again before any new request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import zmq
import zmq.asyncio

from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.protocol.lora_adapter import AdapterSpec
from pagedserve.frontend_proc.errors import Conflict, ServiceUnavailable, TooManyRequests
from pagedserve.frontend_proc.router import Router
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


@dataclass(slots=True)
class RequestHandle:
    """A request's inbox. Its task takes everything that arrived since it last looked in one
    go (``take``), so a task that wakes once per step handles that step's events together,
    and one that fell behind catches up in one pass instead of one wake-up per token."""

    request_id: str
    replica: int
    num_seqs: int
    predicted_hit_tokens: int = 0  # what the router expected the replica to have cached
    lora_name: str = ""  # the adapter computing it ("": the base model)
    pending: list = field(default_factory=list)
    finished_indexes: set[int] = field(default_factory=set)
    done: bool = False  # the scheduler holds nothing more for it (or we stopped listening)
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
        self._requests: dict[str, RequestHandle] = {}
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
        decision = self.router.choose(request.prompt_token_ids, priority=request.priority, seed=seed)
        if decision is None:
            raise ServiceUnavailable("no scheduler replica is ready; see GET /health")
        replica, predicted = self._shed(decision.replica), decision.predicted_hit_tokens
        if replica != decision.replica:
            predicted = 0
        handle = RequestHandle(request.request_id, replica, request.sampling.n, predicted, request.lora_name)
        self._requests[request.request_id] = handle
        if not self._flush_control(replica) or not self._inputs[replica].try_send(request):
            del self._requests[request.request_id]
            raise ServiceUnavailable(f"scheduler replica {replica} is not keeping up (its input queue "
                                     f"is full); retry the request later")
        self.router.assign(replica, request.request_id, handle.num_seqs)
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
        using = sum(1 for handle in self._requests.values() if handle.lora_name == name)
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
        self._forget(handle)
        self._send_abort(handle.replica, [handle.request_id])

    def _send_abort(self, replica: int, request_ids: list[str]) -> None:
        pending = self._pending_aborts[replica]
        pending.extend(request_ids)
        if self._inputs[replica].try_send(AbortRequest(list(pending))):
            pending.clear()  # else retried by the watchdog until the scheduler has room

    def end_all_for_shutdown(self, reason: str) -> int:
        """End every request in flight with ``reason`` (the drain deadline); returns how many."""
        handles = list(self._requests.values())
        for handle in handles:
            handle.push(ReplicaFailed(reason, shutting_down=True))
            self._forget(handle)
            self._send_abort(handle.replica, [handle.request_id])
        return len(handles)

    def _forget(self, handle: RequestHandle) -> None:
        handle.done = True
        self._requests.pop(handle.request_id, None)
        self.router.release(handle.replica, handle.request_id, handle.num_seqs)

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._outputs.recv()
            try:
                if isinstance(msg, SchedulerStats):
                    self._check_restarted(msg)
                    if not self.router.update(msg):
                        self._stray_log.warning("stats from an unknown replica ignored", "replica %d", msg.replica)
                elif isinstance(msg, PrefixCacheEvents):
                    self.router.apply_cache_events(msg)
                elif isinstance(msg, ProcessTable):
                    self.router.processes = msg
                elif isinstance(msg, RequestOutputs):
                    for delta in iter_deltas(msg):
                        self._dispatch(delta)
            except Exception:  # one bad message must not stop every request's output
                log.exception("failed to handle %s", type(msg).__name__)

    def _dispatch(self, delta: RequestDelta) -> None:
        handle = self._requests.get(delta.request_id)
        if handle is None:
            log.debug("delta for unknown or finished request %s dropped", delta.request_id)
            return
        handle.push(delta)
        if delta.finish_reason is not None:
            handle.finished_indexes.add(delta.index)
            if len(handle.finished_indexes) >= handle.num_seqs:
                if delta.error is None:  # prediction vs the hits the replica reports
                    self.router.chooser.record_finished(handle.replica, handle.predicted_hit_tokens,
                                                        delta.num_cached_tokens)
                self._forget(handle)

    def _check_restarted(self, stats: SchedulerStats) -> None:
        if not 0 <= stats.replica < len(self.router.replicas) or not stats.pid:
            return
        last = self.router.replicas[stats.replica].stats
        if last is not None and last.pid and last.pid != stats.pid:
            self._fail_requests_on(stats.replica, f"scheduler replica {stats.replica} was restarted "
                                                  f"(pid {last.pid} -> {stats.pid})")
            self._pending_control[stats.replica].clear()  # the whole registry follows: it holds them all
            self._send_registry(stats.replica)

    async def _watchdog_loop(self) -> None:
        period = min(0.25, self.router.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                for replica, pending in enumerate(self._pending_aborts):
                    self._flush_control(replica)
                    if pending:
                        self._send_abort(replica, [])
                for replica in self.router.failed_replicas():
                    self._fail_requests_on(replica.replica)
            except Exception:  # the watchdog must outlive any one failure
                log.exception("replica watchdog check failed")

    def _fail_requests_on(self, replica: int, reason: Optional[str] = None) -> None:
        status = self.router.replicas[replica]
        state = status.stats.state if status.stats else "unknown"
        if reason is None and status.is_fresh(self.router.clock(), self.router.timeout_s):
            reason = f"scheduler replica {replica} went to state {state!r}"
        elif reason is None:
            reason = (f"scheduler replica {replica} sent no stats for "
                      f"{self.router.timeout_s:g} s")
        request_ids = sorted(status.request_ids)
        if not request_ids:
            return
        log.error("%s; failing %d in-flight request(s)", reason, len(request_ids))
        for request_id in request_ids:
            handle = self._requests.get(request_id)
            if handle is None:
                self.router.release(replica, request_id, 0)
                continue
            handle.push(ReplicaFailed(f"{reason}; the request was lost, retry it"))
            self._forget(handle)
        # Fire-and-forget: if the replica comes back it frees whatever it still holds.
        self._send_abort(replica, request_ids)

    def num_in_flight(self) -> int:
        return len(self._requests)


def overloaded(router: Router, limit: int) -> TooManyRequests:
    """The 429 of --max-waiting-requests, here and at the door (early_shed.py): one wording."""
    waiting = sum(r.num_waiting() for r in router.replicas)
    return TooManyRequests(f"the server is overloaded: {waiting} requests are waiting, every replica is at "
                           f"the limit of {limit} (--max-waiting-requests); retry later")
