"""The server-side TTFT the benches report: read from the frontend's own histogram in /metrics
and interpolated as Prometheus's histogram_quantile does."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

from pagedserve.bench.serve import histogram_quantile, ttft_histogram
from pagedserve.frontend_proc.metrics import _TTFT_BUCKETS, _Observed


def test_quantiles_interpolate_inside_the_bucket_over_what_the_run_added():
    before = {0.01: 2, 0.02: 2, 0.04: 2, math.inf: 2}  # observed before the run: not counted
    after = {0.01: 2, 0.02: 6, 0.04: 10, math.inf: 10}
    assert histogram_quantile(before, after, 0.25) == 0.015
    assert histogram_quantile(before, after, 0.5) == 0.02
    assert histogram_quantile(before, after, 0.75) == 0.03
    assert histogram_quantile(after, after, 0.5) is None  # nothing observed in between
    assert histogram_quantile({}, {0.1: 1, math.inf: 3}, 0.5) == 0.1  # beyond the last bound


def test_the_frontend_histogram_parses_from_its_metrics_text_and_gives_its_median():
    registry = CollectorRegistry()
    ttft = _Observed(registry, "m", "time_to_first_token_seconds", "ttft", _TTFT_BUCKETS)
    before = ttft_histogram(generate_latest(registry).decode())
    for seconds in (0.003, 0.045, 0.05, 0.055, 0.07, 0.3, 9.0):
        ttft.observe(seconds)
    after = ttft_histogram(generate_latest(registry).decode())
    assert after[math.inf] == 7 and after[0.06] == 4  # pagedserve's series only, not vllm:'s too
    assert 0.04 < histogram_quantile(before, after, 0.5) <= 0.06  # the median, 55 ms, is in (40, 60]
