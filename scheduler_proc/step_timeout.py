"""How long a step may take before its worker counts as hung, learned from recent steps.

A fixed ``--step-timeout-s 60`` let a stopped worker go unseen for a minute while clients
got nothing. Instead the allowance follows what steps of this replica's size have cost lately:

    timeout = min(upper, max(floor, factor x expected(tokens)))

- ``upper`` is ``--step-timeout-s``: never more than the operator allows.
- ``floor`` (5 s): a scheduling hiccup, a GC pause or a busy machine is not a hang.
- ``expected`` comes from steps of a similar size only: steps are bucketed by the power of
  two of their scheduled token count. A step's cost is roughly ``fixed + per_token x tokens``,
  so the cost per token of a much smaller step overstates a big step's cost by the fixed part
  (measured: the single-token warm-up decodes made a 32-decode step's allowance 17 s on a busy
  2-core box), and a few big prefills overstate a small decode's (11 s instead of 5 s). Within
  a bucket, ``expected = max(median step time, p99 time per token x tokens)``.
- A bucket with too few samples borrows from its nearest populated neighbours: a bigger
  bucket's median step time and a smaller bucket's p99 per-token time x tokens both bound
  the cost from above on that linear model, so the tighter of the two is used.
- Until ``warmup_steps`` steps of the current workers have been seen (model warm-up,
  kernel compilation, the first prefills), and for a step with more than
  ``unseen_scale`` x the most tokens seen lately, the allowance is ``upper``.

A pure object: the engine calls ``for_step`` before waiting and ``observe`` after.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Bucket:
    steps: deque
    per_token: deque
    step_s: float = 0.0  # the median step time, refreshed
    per_token_s: float = 0.0  # the p99 time per token, refreshed
    added: int = 0


@dataclass(slots=True)
class StepTimeout:
    upper_s: float
    floor_s: float = 5.0
    factor: float = 10.0
    percentile: float = 0.99  # of the time per token
    step_percentile: float = 0.5  # of the whole step time
    warmup_steps: int = 32
    unseen_scale: float = 2.0
    window: int = 256  # steps remembered per size bucket
    min_samples: int = 8  # a bucket with fewer borrows from its neighbours
    refresh_every: int = 32  # recompute the percentiles every this many steps (sorting costs)
    _buckets: dict = field(init=False)
    _recent_tokens: deque = field(init=False)
    _seen: int = field(init=False, default=0)
    _max_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.floor_s <= 0 or self.upper_s <= 0:
            raise ValueError("step timeouts must be positive")
        if self.factor < 1 or not (0 < self.percentile <= 1 and 0 < self.step_percentile <= 1):
            raise ValueError(f"need factor >= 1 and 0 < percentile <= 1, got {self.factor}, {self.percentile}")
        self.restart()

    def restart(self) -> None:
        """New workers: forget what the old ones cost and warm up again."""
        self._buckets = {}
        self._recent_tokens = deque(maxlen=2 * self.window)
        self._seen = 0
        self._max_tokens = 0

    def observe(self, seconds: float, num_tokens: int) -> None:
        key = num_tokens.bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(deque(maxlen=self.window), deque(maxlen=self.window))
        bucket.steps.append(seconds)
        if num_tokens > 0:
            bucket.per_token.append(seconds / num_tokens)
        bucket.added += 1
        if bucket.added <= self.warmup_steps or bucket.added % self.refresh_every == 0:
            bucket.step_s = self._quantile(bucket.steps, self.step_percentile)
            bucket.per_token_s = self._quantile(bucket.per_token, self.percentile)
        self._recent_tokens.append(num_tokens)
        self._seen += 1
        if self._seen % self.refresh_every == 0:
            self._max_tokens = max(self._recent_tokens, default=0)  # forget sizes not seen lately
        else:
            self._max_tokens = max(self._max_tokens, num_tokens)

    @staticmethod
    def _quantile(values: deque, q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def _expected_s(self, num_tokens: int) -> float | None:
        key = num_tokens.bit_length()
        own = self._buckets.get(key)
        if own is not None and len(own.steps) >= self.min_samples:  # the common case: no scan
            return max(own.step_s, own.per_token_s * num_tokens)
        known = [k for k, b in self._buckets.items() if len(b.steps) >= self.min_samples]
        up = [k for k in known if k > key]
        down = [k for k in known if k < key]
        bounds = ([self._buckets[min(up)].step_s] if up else []) + \
                 ([self._buckets[max(down)].per_token_s * num_tokens] if down else [])
        return min(bounds) if bounds else None

    def for_step(self, num_tokens: int) -> float:
        """Seconds to wait for the results of a step that schedules ``num_tokens`` tokens."""
        if self._seen < self.warmup_steps or num_tokens > self.unseen_scale * max(1, self._max_tokens):
            return self.upper_s
        expected = self._expected_s(num_tokens)
        if expected is None:
            return self.upper_s
        return min(self.upper_s, max(self.floor_s, self.factor * expected))
