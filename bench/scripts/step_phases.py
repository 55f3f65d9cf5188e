"""Per-phase timing of the worker's step, for bench/scripts/step_profile.py --phases.

Wraps the functions a step calls (module attributes, for this process only) with timers
that book *exclusive* time: a norm inside the final logits call counts as a norm, and the
logits matmul as a matmul. On CPU every op is synchronous, so wall time per call is the
op's cost; the wrappers add about a microsecond per call, which lands in the phases.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

PHASES = ("matmuls", "lm_head matmul", "attention", "KV write", "rotary", "norms and activations",
          "sampling", "input preparation", "cache ops", "IPC encode/decode", "other (in forward)")


class PhaseTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # time.thread_time: CPU time of this thread (one torch thread: all of it)
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, start, time in nested phases]
        self._patches: list[tuple[object, str, object]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        frame = [name, self.clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = self.clock() - frame[1]
            self.totals[name] += elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed

    def wrap(self, owner: object, attr: str, name: str | Callable[..., str]) -> None:
        """Time every call of ``owner.attr`` as phase ``name`` (or ``name(*args)``)."""
        original = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            with timer.phase(name(*args, **kwargs) if callable(name) else name):
                return original(*args, **kwargs)

        self._patches.append((owner, attr, original))
        setattr(owner, attr, timed)

    def wrap_any(self, owner: object, attrs: tuple[str, ...], name: str) -> None:
        """Wrap each of ``attrs`` that ``owner`` has (names differ between versions)."""
        for attr in attrs:
            if hasattr(owner, attr):
                self.wrap(owner, attr, name)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._patches):
            setattr(owner, attr, original)
        self._patches.clear()

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def instrument_worker(runner, clock: Callable[[], float] = time.perf_counter) -> PhaseTimer:
    """Wrap what ``ModelRunner.execute`` calls; ``runner`` is a ModelRunner."""
    from pagedserve.worker_proc import model_runner
    from pagedserve.worker_proc.kv_cache import KVCache
    from pagedserve.worker_proc.models import causal_lm, decoder_layer

    timer = PhaseTimer(clock)
    lm_head = runner.model.lm_head

    def matmul_phase(x, w, *a, **k) -> str:  # w: a models/linear.py LinearWeight
        return "lm_head matmul" if w is lm_head else "matmuls"

    timer.wrap(decoder_layer, "linear", matmul_phase)  # models/linear.py: F.linear or W @ x.T
    timer.wrap(causal_lm, "linear", matmul_phase)
    timer.wrap(decoder_layer, "attend", "attention")
    timer.wrap(runner.ops, "write_kv", "KV write")
    elementwise = type(runner.model.elementwise)
    timer.wrap(elementwise, "rotary", "rotary")
    timer.wrap_any(elementwise, ("rms_norm", "add_rms_norm", "silu_mul"), "norms and activations")
    timer.wrap(model_runner, "sample", "sampling")
    timer.wrap_any(model_runner, ("build_step_batch", "build_forward_batch", "apply_output"),
                   "input preparation")
    timer.wrap_any(type(runner), ("_update_requests",), "input preparation")
    timer.wrap(KVCache, "apply_block_ops", "cache ops")
    return timer


def format_phases(per_step: dict[str, float], step_ms: float, title: str) -> str:
    lines = [title, f"  {'phase':<26}{'ms/step':>10}{'share':>8}"]
    for name in PHASES:
        ms = per_step.get(name, 0.0)
        lines.append(f"  {name:<26}{ms:10.3f}{100 * ms / step_ms if step_ms else 0:7.1f}%")
    lines.append(f"  {'worker step (execute)':<26}{step_ms:10.3f}")
    return "\n".join(lines)
