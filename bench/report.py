"""Per-request records, latency statistics, the printed table and the PNG plot shared by
the benchmarks (bench serve over HTTP, the scenarios over the offline engine).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timings, in seconds; ``start`` is since the run began."""

    index: int
    prompt_tokens: int
    max_tokens: int = 0
    start: float = 0.0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: Optional[str] = None
    preemptions: int = 0

    def token_event(self, sent: float, last: float, now: float) -> float:
        """A stream event with a token reached the client at ``now``: the first sets TTFT
        (from ``sent``), each later one adds an ITL gap (from ``last``); returns ``now``."""
        if self.ttft is None:
            self.ttft = now - sent
        else:
            self.itl.append(now - last)
        return now


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * pct / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def median_spread(values: Sequence[float], digits: int = 1) -> str:
    """``median (min-max)``: how every bench prints the runs of one measurement."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered) if ordered else 0.0}
    out.update({f"p{p}": _percentile(ordered, p) for p in PERCENTILES})
    return out


def summarize(records: Sequence, duration: float) -> dict:
    ok = [r for r in records if r.error is None and r.e2e is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(max(r.prompt_tokens, 0) for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration else 0.0,
        "output_tokens": output_tokens,
        "ttft_s": stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": stats(tpot),
        "itl_s": stats([gap for r in ok for gap in r.itl]),
        "e2e_s": stats([r.e2e for r in ok]),
    }


def latency_table(result: dict) -> str:
    lines = [f"completed {result['completed']}, failed {result['failed']} in {result['duration_s']:.2f} s; "
             f"{result['request_throughput']:.2f} req/s, output {result['output_token_throughput']:.1f} tok/s, "
             f"total {result['total_token_throughput']:.1f} tok/s"]
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = result[key]
        lines.append(f"{label:<6}" + "".join(f"{1e3 * s[k]:10.1f}" for k in ("mean", "p50", "p90", "p99")))
    if result.get("server_ttft_p50_s") is not None:
        lines.append(f"server TTFT p50 {1e3 * result['server_ttft_p50_s']:.1f} ms (the frontend's histogram: "
                     "from the request's submission to the engine, without the client's own delays)")
    if "preemptions" in result:
        lines.append(f"preemptions {result['preemptions']:.0f}")
    if "worker_idle_pct" in result:
        lines.append(f"worker idle {result['worker_idle_pct']:.1f}% of busy time (from /metrics)")
    for err in result.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)


def cache_table(result: dict) -> str:
    """The run's prefix-cache hit rate and the router's decisions (from /metrics counter deltas)."""
    cache = result["cache"]
    lines = [f"prefix cache hit rate {100 * result['prefix_hit_rate']:.1f}% of prompt tokens"]
    routed = {k: v for k, v in cache.items() if k.startswith("pagedserve_router_") and v}
    if routed:
        lines.append("router: " + ", ".join(f"{k.removeprefix('pagedserve_router_')} {v:.0f}"
                                            for k, v in sorted(routed.items())))
    return "\n".join(lines)


def plot_run(result: dict, path: str, title: str = "") -> None:
    """Latency per request in arrival order; KV usage / running / waiting over time."""
    try:
        import matplotlib
    except ImportError:  # the numbers are already printed and saved; only the picture is missing
        print(f"no plot written to {path}: matplotlib is not installed (pip install 'pagedserve[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = sorted(result["requests"], key=lambda r: r["start"])
    samples = result.get("metrics_samples", [])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7))
    xs = list(range(len(requests)))
    top.plot(xs, [r["e2e"] or 0 for r in requests], ".-", label="end-to-end")
    top.plot(xs, [r["ttft"] or 0 for r in requests], ".-", label="TTFT")
    top.set_xlabel("request (arrival order)")
    top.set_ylabel("seconds")
    top.legend()
    top.set_title(title)
    if samples:
        t = [s["t"] for s in samples]
        bottom.plot(t, [s.get("running", 0) for s in samples], label="running")
        bottom.plot(t, [s.get("waiting", 0) for s in samples], label="waiting")
        bottom.plot(t, [s.get("swapped", 0) for s in samples], label="swapped")
        bottom.set_ylabel("requests")
        kv = bottom.twinx()
        kv.plot(t, [100 * s.get("kv_usage", 0) for s in samples], "k--", label="KV usage %")
        kv.set_ylabel("KV usage %")
        kv.set_ylim(0, 105)
        kv.legend(loc="upper right")
        bottom.legend(loc="upper left")
    else:
        bottom.text(0.5, 0.5, "no /metrics samples (offline run)", ha="center", va="center")
    bottom.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# /proc/cpuinfo flag -> the name a table prints; the ISAs that set a CPU engine's pace
ISA_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"),
             ("amx_int8", "AMX-INT8"))


def cpu_label(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """``AMD EPYC (family 26 model 2), 2 CPUs: AVX2 AVX-512 AVX512-BF16, no AMX``: what every
    bench table names, because a CPU number is comparable only on the same ISA."""
    import os
    import platform

    fields: dict[str, str] = {}
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block describes them all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (no /proc/cpuinfo)"
    flags = set(fields.get("flags", "").split())
    isa = " ".join(name for flag, name in ISA_FLAGS if flag in flags) or "no AVX2"
    if not any(flag.startswith("amx") for flag in flags):
        isa += ", no AMX"
    name = fields.get("model name", platform.machine())
    family = f" (family {fields['cpu family']} model {fields.get('model', '?')})" if "cpu family" in fields else ""
    return f"{name}{family}, {os.cpu_count()} CPUs: {isa}"
