"""Time limits: when each request arrived, and which requests are past a limit at a step's clock.

Time enters the scheduler only as the clock value each ``schedule(now)`` is given (the engine
reads its monotonic clock; a replay hands back the value recorded in that step's
``SchedulerOutput.now_s``), so aging, limits and the deadline policy's order replay bit for bit.

- A request is stamped with the clock of the first step after its arrival; until then it
  carries the previous step's, so an order computed in between is as deterministic. It arrived
  at most one step before its stamp: every limit is that much lenient.
- **First-token limit**: the smallest of its ``max_queue_time_s``, the server's
  ``--max-queue-time-s`` and its ``deadline_s``. A request that has sampled no token by then
  ends with a ``queue_timeout`` error (the frontend: 503 with Retry-After, or mid-stream an abort
  chunk and an error event), whether it waits, was preempted or is computing its prompt.
- **Deadline** (``deadline_s``): a request with tokens ends there with the tokens so far and
  ``finish_reason="length"``: a budget it set ran out, as with ``max_tokens`` (DECISIONS.md).
- **Urgency**, the deadline policy's key: the first-token limit, else arrival +
  ``--default-deadline-s``, so without limits the order is arrival order.

Limits sit in a heap: a step pays nothing while none is due; ended requests' entries are
dropped when they surface, or all at once when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Request

_FIRST_TOKEN, _DEADLINE = 0, 1


def has_first_token(request: "Request") -> bool:
    """Whether any sample of ``request`` has sampled a token."""
    return any(len(seq.token_ids) > seq.num_prompt_tokens for seq in request.sequences)


def first_token_limit_s(request: "Request", server_limit_s: Optional[float]) -> Optional[float]:
    limits = [s for s in (request.max_queue_time_s, server_limit_s, request.deadline_s) if s is not None]
    return min(limits) if limits else None


def queue_timeout_message(request: "Request", now: float, server_limit_s: Optional[float]) -> str:
    return (f"the request waited {now - request.arrival_time:.3f}s without a first token, past its limit of "
            f"{first_token_limit_s(request, server_limit_s):.3f}s (the smallest of its max_queue_time_s, its "
            f"deadline_s and the server's --max-queue-time-s); the server is busy, retry later")


class RequestTimes:
    """The scheduler's one record of arrivals and limits; it returns decisions, the scheduler ends requests."""

    def __init__(self, max_queue_time_s: Optional[float], default_deadline_s: float):
        self.max_queue_time_s = max_queue_time_s
        self.default_deadline_s = default_deadline_s
        self.now = 0.0  # the clock of the last step
        self._unstamped: list["Request"] = []
        self._due: list[tuple[float, int, int, str]] = []  # (when, arrival number, kind, request id)

    def arrived(self, request: "Request") -> None:
        request.arrival_time = self.now
        request.urgency = self.now + self.default_deadline_s
        self._unstamped.append(request)

    def advance(self, now: float, requests: dict[str, "Request"]) -> list[tuple["Request", bool]]:
        """Moves to the step's clock: stamps the arrivals since the last step and returns each
        live request past a limit with whether it missed its first token (else its deadline)."""
        self.now = now
        for request in self._unstamped:
            self._stamp(request, now)
        self._unstamped.clear()
        due, heap, seen = [], self._due, set()
        while heap and heap[0][0] <= now:
            _, number, kind, request_id = heapq.heappop(heap)
            request = requests.get(request_id)
            if request is None or request.arrival_number != number or request_id in seen:
                continue  # ended already (or an id reused by a later request)
            started = has_first_token(request)
            if request.deadline_at is not None and request.deadline_at <= now:
                due.append((request, not started))
            elif kind == _FIRST_TOKEN and not started:
                due.append((request, True))
            else:
                continue
            seen.add(request_id)
        if len(heap) > 2 * len(requests) + 64:
            self._due = [e for e in heap if (r := requests.get(e[3])) is not None and r.arrival_number == e[1]]
            heapq.heapify(self._due)
        return due

    def _stamp(self, request: "Request", now: float) -> None:
        request.arrival_time = now
        limit = first_token_limit_s(request, self.max_queue_time_s)
        number, request_id = request.arrival_number, request.request_id
        if limit is not None:
            request.first_token_by = now + limit
            heapq.heappush(self._due, (request.first_token_by, number, _FIRST_TOKEN, request_id))
        if request.deadline_s is not None:
            request.deadline_at = now + request.deadline_s
            heapq.heappush(self._due, (request.deadline_at, number, _DEADLINE, request_id))
        request.urgency = request.first_token_by if limit is not None else now + self.default_deadline_s
