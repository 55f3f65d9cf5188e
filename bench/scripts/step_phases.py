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

PHASES = ("matmuls", "lm_head matmul", "routed experts", "attention", "KV write", "rotary", "rotary and KV write",
          "norms and activations", "sampling", "input preparation", "cache ops", "IPC encode/decode", "other (in forward)")


class PhaseTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # time.thread_time: CPU time of this thread (one torch thread: all of it)
        self.totals: dict[str, float] = defaultdict(float)
        self.work: dict[str, float] = defaultdict(float)  # "matmul flops", "weight bytes", ... this step
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

    def take_work(self) -> dict[str, float]:
        out, self.work = dict(self.work), defaultdict(float)
        return out


def instrument_worker(runner, clock: Callable[[], float] = time.perf_counter) -> PhaseTimer:
    """Wrap what ``ModelRunner.execute`` calls; ``runner`` is a ModelRunner."""
    import torch

    from pagedserve.kernels import cpu_moe
    from pagedserve.worker_proc import model_runner, sampler
    from pagedserve.worker_proc.kv_cache import KVCache
    from pagedserve.worker_proc.models import causal_lm, decoder_layer, moe

    timer = PhaseTimer(clock)
    lm_head = runner.model.lm_head

    def matmul_phase(x, w, *a, **k) -> str:  # w: a models/linear.py LinearWeight
        phase = "lm_head matmul" if w is lm_head else "matmuls"
        out_features, in_features = w.out_features, x.shape[1]
        timer.work[f"{phase} flops"] += 2 * x.shape[0] * out_features * in_features
        if getattr(w, "quantized", None) is not None:  # its integers, scales and zero points as stored
            timer.work[f"{phase} weight bytes"] += w.quantized.nbytes
        else:
            element = next(t for t in (w.panels, w.packed, w.weight) if t is not None).element_size()
            timer.work[f"{phase} weight bytes"] += out_features * in_features * element
        return phase

    def expert_phase(x, w, *a, **k) -> str:
        element = next(t for t in (w.gemv_panels, w.panels, w.packed, w.weight) if t is not None).element_size()
        timer.work["routed experts flops"] += 2 * x.shape[0] * w.out_features * x.shape[1]
        timer.work["routed experts weight bytes"] += w.out_features * x.shape[1] * element
        return "routed experts"

    def attention_phase(ops, q, k, v, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *a, **kw) -> str:
        # the K and V rows every sequence reads (its whole context; a sliding window reads less)
        timer.work["KV bytes"] += 2 * int(seq_lens.sum()) * k[0].numel() * k_cache.element_size()
        return "attention"

    timer.wrap(decoder_layer, "linear", matmul_phase)  # models/linear.py: F.linear or W @ x.T
    timer.wrap(causal_lm, "linear", matmul_phase)
    timer.wrap(decoder_layer, "silu_gate", matmul_phase)  # gate_up with its SiLU gate (a nested silu_mul apart)
    # a mixture of experts' products (models/moe.py): the experts the step's tokens activate, each read once
    timer.wrap(moe, "linear", expert_phase)
    timer.wrap(moe, "silu_gate", expert_phase)
    def native_experts_phase(experts, x, weights, ids) -> str:  # kernels/cpu_moe.py: one call a layer
        pairs, active = ids.numel(), int(torch.unique(ids).numel())
        timer.work["routed experts flops"] += 2 * pairs * 3 * experts.size * experts.hidden
        timer.work["routed experts weight bytes"] += experts.weight_bytes * active / experts.num_experts
        return "routed experts"

    timer.wrap(cpu_moe.NativeExperts, "__call__", native_experts_phase)
    timer.wrap(decoder_layer, "attend", attention_phase)
    timer.wrap(runner.ops, "write_kv", "KV write")
    elementwise = type(runner.model.elementwise)
    timer.wrap(elementwise, "rotary", "rotary")
    # the CPU's half-precision path rotates q/k and writes the KV in one call (elementwise.py)
    timer.wrap_any(elementwise, ("rotary_write_kv",), "rotary and KV write")
    timer.wrap_any(elementwise, ("rms_norm", "add_rms_norm", "silu_mul"), "norms and activations")
    timer.wrap_any(model_runner, ("sample", "launch_sample"), "sampling")
    if hasattr(sampler, "PendingSample"):
        timer.wrap(sampler.PendingSample, "collect", "sampling")
    timer.wrap_any(model_runner, ("build_step_batch", "build_forward_batch", "apply_output", "gather_batch",
                                  "upload_batch"), "input preparation")
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


def machine_limits(dtype, size: int = 4096, copy_bytes: int = 1 << 30, repeat: int = 5) -> dict[str, list[float]]:
    """This machine's own limits, timed now: one size^3 matmul in ``dtype`` through oneDNN's packed
    path (what models/linear.py runs) and through torch.mm (TFLOP/s), and the memory bandwidth
    of reading (a sum) and of copying (into a tensor already touched; read + write counted) ``copy_bytes`` (GB/s)."""
    import torch

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(b, None)  # b as an [out, in] weight
    big, dst = torch.ones(copy_bytes // 4), torch.zeros(copy_bytes // 4)  # both touched: no page faults timed
    runs = {
        "packed matmul TFLOP/s": (lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                                  2 * size ** 3 / 1e12),
        "torch.mm TFLOP/s": (lambda: torch.mm(a, b), 2 * size ** 3 / 1e12),
        "read GB/s (sum)": (lambda: big.sum(), copy_bytes / 1e9),
        "copy GB/s (read + write)": (lambda: dst.copy_(big), 2 * copy_bytes / 1e9),
    }
    return {name: sorted(work / t for t in timed_runs(fn, repeat)) for name, (fn, work) in runs.items()}


def timed_runs(fn, repeat: int, warmup: int = 1, clock=time.perf_counter) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn``, after ``warmup`` untimed ones, by ``clock``
    (``time.thread_time``: this thread's CPU time, which other work's threads cannot stretch)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def format_limits(work: dict[str, float], phases: dict[str, float], step_s: float,
                  limits: dict[str, list[float]]) -> str:
    """A step kind's matmul TFLOP/s and bytes per second (totals per step) against the machine's."""
    def med(values):
        return values[len(values) // 2]

    matmul_s = phases.get("matmuls", 0.0) + phases.get("lm_head matmul", 0.0)
    flops = work.get("matmuls flops", 0.0) + work.get("lm_head matmul flops", 0.0)
    weights = work.get("matmuls weight bytes", 0.0) + work.get("lm_head matmul weight bytes", 0.0)
    experts = work.get("routed experts weight bytes", 0.0)
    peak, read = med(limits["packed matmul TFLOP/s"]), med(limits["read GB/s (sum)"])
    lines = [f"  matmuls: {flops / 1e9:.1f} GFLOP in {1e3 * matmul_s:.1f} ms: {flops / matmul_s / 1e12:.3f} TFLOP/s, "
             f"{100 * flops / matmul_s / 1e12 / peak:.0f}% of the packed {peak:.3f}",
             f"  weights: {weights / 1e9:.3f} GB read by the matmuls: {weights / matmul_s / 1e9:.1f} GB/s "
             f"({100 * weights / matmul_s / 1e9 / read:.0f}% of the {read:.1f} GB/s read bandwidth)",
             f"  step: weights + KV ({work.get('KV bytes', 0.0) / 1e9:.3f} GB) over the whole step: "
             f"{(weights + experts + work.get('KV bytes', 0.0)) / step_s / 1e9:.1f} GB/s"]
    experts_s = phases.get("routed experts", 0.0)
    if experts and experts_s:
        lines.insert(2, f"  routed experts: {experts / 1e9:.3f} GB of activated experts in {1e3 * experts_s:.1f} ms: "
                        f"{experts / experts_s / 1e9:.1f} GB/s ({100 * experts / experts_s / 1e9 / read:.0f}% of the "
                        f"read bandwidth), {work.get('routed experts flops', 0.0) / experts_s / 1e12:.3f} TFLOP/s")
    return "\n".join(lines)


def format_machine_limits(limits: dict[str, list[float]]) -> str:
    return "\n".join(f"  {name:<34}median {v[len(v) // 2]:8.3f}  (range {v[0]:.3f}-{v[-1]:.3f}, {len(v)} runs)"
                     for name, v in limits.items())
