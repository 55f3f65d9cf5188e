"""Which live replica gets a request: cache-aware, least-loaded or round-robin.

Cache-aware (the default with more than one replica): send the request where the longest
prefix of its prompt is already cached (``cache_index.py``), so a conversation's next turn,
or a request sharing a long system prompt, does not prefill its prefix again elsewhere.
Two things keep it from hurting:

* Ties, including a prefix that is hot everywhere, go to the least-loaded of the tied, so a
  popular system prompt never piles every request onto one replica.
* A load bound: the cache winner is taken only when its load (sequences running or in flight
  from here, plus its queue counted again, as for least-loaded) is at most ``balance_abs``
  above the least-loaded replica's, or at most ``balance_rel`` times it. Beyond that the
  saved prefill costs less than the wait, and the least-loaded replica gets the request.

Equal loads go to the replica chosen least recently (then the lower KV usage), so a client
sending one request at a time still spreads over every replica.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from pagedserve.protocol.block_hash import prefix_block_hashes
from pagedserve.runtime.options import BY_NAME, ROUTER_KINDS  # noqa: F401 (ROUTER_KINDS re-exported)

if TYPE_CHECKING:
    from pagedserve.client.router import ReplicaStatus

# Why a replica was chosen (the reason label of pagedserve_router_decisions_total).
REASONS = ("cache_hit", "no_hit", "load_bound", "least_loaded", "round_robin")
# measured in bench/log/2026-11-23.md (cache-aware routing); defined with the option
DEFAULT_BALANCE_ABS = BY_NAME["router_balance_abs"].default  # sequences
DEFAULT_BALANCE_REL = BY_NAME["router_balance_rel"].default


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    kind: str = "least-loaded"
    balance_abs: int = DEFAULT_BALANCE_ABS
    balance_rel: float = DEFAULT_BALANCE_REL

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_KINDS)}, got {self.kind!r}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("--router-balance-abs must be >= 0 and --router-balance-rel >= 1.0, "
                             f"got {self.balance_abs} and {self.balance_rel}")


@dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    reason: str
    predicted_hit_tokens: int = 0


class ReplicaChooser:
    """The policy plus its small state (round-robin position, recency) and its counters."""

    def __init__(self, policy: RoutingPolicy, num_replicas: int):
        self.policy = policy
        self._picks = 0
        self._last_pick = [0] * num_replicas  # pick number when each replica was last chosen
        self.decisions: Counter[str] = Counter()
        self.requests = [0] * num_replicas
        # Over requests that finished normally, so the two are comparable.
        self.predicted_hit_tokens = [0] * num_replicas
        self.actual_hit_tokens = [0] * num_replicas
        self._priority: Optional[int] = None  # of the request being placed

    def _load_key(self, status: "ReplicaStatus") -> tuple:
        # Recency before KV usage: usage comes with stats up to a heartbeat old.
        load, kv_usage, _ = status.load(self._priority)
        return load, self._last_pick[status.replica], kv_usage

    def choose(self, live: Sequence["ReplicaStatus"], prompt_token_ids: Sequence[int] = (),
               priority: Optional[int] = None, seed: int = 0) -> Decision:
        """``live`` must not be empty; ``priority``: the request's, so that only the waiting requests
        that run before it count as load (replicas report per-priority queues under priority policies).
        ``seed``: the prompt's first block's parent, as the scheduler names an adapter's blocks."""
        self._priority = priority
        decision = self._decide(live, prompt_token_ids, seed)
        self._picks += 1
        self._last_pick[decision.replica] = self._picks
        self.decisions[decision.reason] += 1
        self.requests[decision.replica] += 1
        return decision

    def _decide(self, live: Sequence["ReplicaStatus"], prompt_token_ids: Sequence[int], seed: int = 0) -> Decision:
        kind = self.policy.kind
        if kind == "round-robin":
            return Decision(min(live, key=lambda r: self._last_pick[r.replica]).replica, "round_robin")
        least = min(live, key=self._load_key)
        if kind == "least-loaded" or len(live) == 1:
            return Decision(least.replica, "least_loaded")
        block_size = next((r.stats.block_size for r in live if r.stats is not None and r.stats.block_size), 0)
        hashes = prefix_block_hashes(prompt_token_ids, block_size, seed) if block_size and any(
            len(r.cache) for r in live) else []
        matched = {r.replica: r.cache.cached_prefix_blocks(hashes) for r in live} if hashes else {}
        best_blocks = max(matched.values(), default=0)
        if best_blocks == 0:
            return Decision(least.replica, "no_hit")
        tied = [r for r in live if matched[r.replica] == best_blocks]
        winner = min(tied, key=self._load_key)
        if not self._within_bound(winner.load(self._priority)[0], least.load(self._priority)[0]):
            return Decision(least.replica, "load_bound", matched[least.replica] * block_size)
        return Decision(winner.replica, "cache_hit", best_blocks * block_size)

    def _within_bound(self, load: float, least_load: float) -> bool:
        return load - least_load <= self.policy.balance_abs or load <= self.policy.balance_rel * least_load

    def record_finished(self, replica: int, predicted_hit_tokens: int, actual_hit_tokens: int) -> None:
        self.predicted_hit_tokens[replica] += predicted_hit_tokens
        self.actual_hit_tokens[replica] += actual_hit_tokens


def default_router(num_replicas: int, requested: Optional[str]) -> str:
    """``--router`` when not given: cache-aware when there is more than one replica to choose from."""
    if requested:
        return requested
    return "cache-aware" if num_replicas > 1 else "least-loaded"
