"""How long a step may take before its worker counts as hung, learned from recent steps.

A fixed ``--step-timeout-s 60`` let a stopped worker go unseen for a minute while clients
got nothing. Instead the allowance follows what steps of this replica have cost lately:

    timeout = min(upper, max(floor, factor x max(median step time, p99 time per token x tokens)))

- ``upper`` is ``--step-timeout-s``: never more than the operator allows.
- ``floor`` (5 s): a scheduling hiccup, a GC pause or a busy machine is not a hang.
- The per-token term scales the allowance with the step's scheduled token count, so a
  long prefill after a run of small decodes gets its share (decode steps overstate the
  cost per token: their fixed cost is spread over few tokens, which errs generous). The
  median step time covers the fixed cost of a step; a high percentile of whole steps
  would let the few big prefills set the allowance of every small decode after them
  (measured: 11 s instead of 5 s for 32 streams on the 2-core box).
- Until ``warmup_steps`` steps of the current workers have been seen (model warm-up,
  kernel compilation, the first prefills), and for a step with more than
  ``unseen_scale`` x the most tokens seen lately, the allowance is ``upper``.

A pure object: the engine calls ``for_step`` before waiting and ``observe`` after.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepTimeout:
    upper_s: float
    floor_s: float = 5.0
    factor: float = 10.0
    percentile: float = 0.99  # of the time per token
    step_percentile: float = 0.5  # of the whole step time
    warmup_steps: int = 32
    unseen_scale: float = 2.0
    window: int = 512
    refresh_every: int = 32  # recompute the percentiles every this many steps (sorting costs)
    _step_s: deque = field(init=False)
    _per_token_s: deque = field(init=False)
    _tokens: deque = field(init=False)
    _seen: int = field(init=False, default=0)
    _p_step_s: float = field(init=False, default=0.0)
    _p_per_token_s: float = field(init=False, default=0.0)
    _max_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.floor_s <= 0 or self.upper_s <= 0:
            raise ValueError("step timeouts must be positive")
        if self.factor < 1 or not (0 < self.percentile <= 1 and 0 < self.step_percentile <= 1):
            raise ValueError(f"need factor >= 1 and 0 < percentile <= 1, got {self.factor}, {self.percentile}")
        self.restart()

    def restart(self) -> None:
        """New workers: forget what the old ones cost and warm up again."""
        self._step_s = deque(maxlen=self.window)
        self._per_token_s = deque(maxlen=self.window)
        self._tokens = deque(maxlen=self.window)
        self._seen = 0
        self._p_step_s = self._p_per_token_s = 0.0
        self._max_tokens = 0

    def observe(self, seconds: float, num_tokens: int) -> None:
        self._step_s.append(seconds)
        self._tokens.append(num_tokens)
        if num_tokens > 0:
            self._per_token_s.append(seconds / num_tokens)
        self._seen += 1
        if self._seen <= self.warmup_steps or self._seen % self.refresh_every == 0:
            self._refresh()
        else:
            self._max_tokens = max(self._max_tokens, num_tokens)

    def _refresh(self) -> None:
        self._p_step_s = self._quantile(self._step_s, self.step_percentile)
        self._p_per_token_s = self._quantile(self._per_token_s, self.percentile)
        self._max_tokens = max(self._tokens, default=0)

    @staticmethod
    def _quantile(values: deque, q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def for_step(self, num_tokens: int) -> float:
        """Seconds to wait for the results of a step that schedules ``num_tokens`` tokens."""
        if self._seen < self.warmup_steps or num_tokens > self.unseen_scale * max(1, self._max_tokens):
            return self.upper_s
        expected = max(self._p_step_s, self._p_per_token_s * num_tokens)
        return min(self.upper_s, max(self.floor_s, self.factor * expected))
