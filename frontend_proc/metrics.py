"""Prometheus metrics: scheduler stats summed over replicas, plus latencies seen here.

Scheduler counters are cumulative per replica; a restarted replica starts again at zero,
which Prometheus reads as a counter reset. Gauges count only replicas that are still
sending stats, so a dead replica's last queue lengths do not linger.

Every series carries a ``model_name`` label. Where a metric means what a vLLM metric
means, it is also exported under vLLM's name (``vllm:...``), so a stock vLLM dashboard's
queries return data.
"""

from __future__ import annotations

import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.frontend_proc.class_metrics import ClassStatsCollector, ShedCounts
from pagedserve.client.router import Router
from pagedserve.frontend_proc.router_metrics import RouterCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's TTFT buckets (its dashboards' histogram_quantile reads the same resolution), fine below 100 ms
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# metric name -> (help, how to read it from one SchedulerStats)
_GAUGES = {
    "pagedserve_num_requests_running": ("Requests running, all replicas", lambda s: s.num_running),
    "vllm:num_requests_running": ("Requests running, all replicas", lambda s: s.num_running),
    "pagedserve_num_requests_waiting": ("Requests waiting, all replicas", lambda s: s.num_waiting),
    "vllm:num_requests_waiting": ("Requests waiting, all replicas", lambda s: s.num_waiting),
    "pagedserve_num_requests_swapped": ("Requests swapped to host memory",
                                        lambda s: s.num_swapped),
}
_PREEMPTIONS = ("Preemptions (recompute + swap)",
                lambda s: s.num_preemptions_recompute + s.num_preemptions_swap)
_PREFIX_QUERIES = ("Prompt tokens looked up in the prefix cache", lambda s: s.prefix_cache_queries)
_PREFIX_HITS = ("Prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits)
_PROMPT_TOKENS = ("Prompt tokens prefilled", lambda s: s.prompt_tokens)
_GENERATION_TOKENS = ("Tokens generated", lambda s: s.generation_tokens)
_COUNTERS = {
    "pagedserve_num_preemptions_total": _PREEMPTIONS,
    "vllm:num_preemptions_total": _PREEMPTIONS,
    "pagedserve_prefix_cache_queries_total": _PREFIX_QUERIES,
    "vllm:prefix_cache_queries_total": _PREFIX_QUERIES,
    "pagedserve_prefix_cache_hits_total": _PREFIX_HITS,
    "vllm:prefix_cache_hits_total": _PREFIX_HITS,
    "pagedserve_prompt_tokens_total": _PROMPT_TOKENS,
    "vllm:prompt_tokens_total": _PROMPT_TOKENS,
    "pagedserve_generation_tokens_total": _GENERATION_TOKENS,
    "vllm:generation_tokens_total": _GENERATION_TOKENS,
    "pagedserve_recomputed_tokens_total": ("Tokens recomputed after preemption",
                                           lambda s: s.recomputed_tokens),
    "pagedserve_num_swapped_blocks_total": (
        "KV blocks swapped out plus swapped in",
        lambda s: s.num_blocks_swapped_out + s.num_blocks_swapped_in),
    "pagedserve_scheduler_steps_total": ("Steps the schedulers sent to their workers", lambda s: s.step),
    "pagedserve_structured_output_requests_total": (
        "Requests whose output a grammar constrains", lambda s: s.structured_output_requests),
    "pagedserve_structured_output_mask_seconds_total": (
        "Seconds the schedulers spent filling grammar bitmasks for their steps",
        lambda s: s.structured_output_mask_time_s),
    # speculative decoding (scheduler_proc/speculation.py), vLLM's names
    **{f"{prefix}spec_decode_{name}_total": (help_text, read) for prefix in ("vllm:", "pagedserve_")
       for name, help_text, read in (
           ("num_drafts", "Verifications of speculative proposals (one sequence, one step)",
            lambda s: s.spec_decode_num_drafts),
           ("num_draft_tokens", "Speculative proposals verified", lambda s: s.spec_decode_num_draft_tokens),
           ("num_accepted_tokens", "Speculative proposals accepted", lambda s: s.spec_decode_num_accepted_tokens))},
    # forward / (forward + idle) is the share of time the device computes while there is work
    "pagedserve_worker_forward_seconds_total": (
        "Seconds the driver workers spent in forward + sample", lambda s: s.worker_forward_time_s),
    "pagedserve_worker_idle_seconds_total": (
        "Seconds the driver workers waited for a step while requests were running",
        lambda s: s.worker_idle_time_s),
}


class SchedulerStatsCollector(Collector):
    """Reads the router's latest stats at scrape time."""

    def __init__(self, router: Router, model_name: str, lora_enabled: bool = False):
        self.router = router
        self.model_name = model_name
        self.lora_enabled = lora_enabled  # --enable-lora: the adapters' series (none without, as vLLM)

    def _family(self, kind, name: str, help_text: str, value: float):
        family = kind(name, help_text, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        now = time.monotonic()
        known = [r for r in self.router.replicas if r.stats is not None]
        fresh = [r for r in known if r.is_fresh(now, self.router.timeout_s)]
        for name, (help_text, read) in _GAUGES.items():
            yield self._family(GaugeMetricFamily, name, help_text, sum(read(r.stats) for r in fresh))
        usage = [r.stats.kv_cache_usage for r in fresh]
        mean_usage = sum(usage) / len(usage) if usage else 0.0
        yield self._family(GaugeMetricFamily, "pagedserve_kv_cache_usage_ratio",
                           "KV-cache usage, mean over live replicas (0..1)", mean_usage)
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                           "KV-cache usage, mean over live replicas; 1 means 100 percent", mean_usage)
        for name, (help_text, read) in _COUNTERS.items():
            yield self._family(CounterMetricFamily, name, help_text, sum(read(r.stats) for r in known))
        yield from self._accepted_per_position(known)
        yield from self._per_replica(now)
        if self.lora_enabled:
            yield from self._lora(known, fresh, now)

    def _lora(self, known, fresh, now: float):
        """vLLM's ``vllm:lora_requests_info``: one series whose labels list the adapters with running and
        waiting requests (comma-joined, over the live replicas) and whose value is the wall time of the
        stats it was read from; and the tokens each adapter generated, summed over replicas."""
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        if known:
            running = sorted({name for r in fresh for name in r.stats.running_lora_adapters})
            waiting = sorted({name for r in fresh for name in r.stats.waiting_lora_adapters})
            max_lora = max(r.stats.max_lora for r in known)
            updated = time.time() - (now - max(r.last_seen for r in known))
            info.add_metric([str(max_lora), ",".join(waiting), ",".join(running)], updated)
        yield info
        tokens = CounterMetricFamily("pagedserve_lora_generation_tokens_total", "Tokens generated per LoRA adapter",
                                     labels=["model_name", "lora_name"])
        totals: Tally[str] = Tally()
        for r in known:
            totals.update(r.stats.generation_tokens_by_lora)
        for name, count in sorted(totals.items()):
            tokens.add_metric([self.model_name, name], count)
        yield tokens

    def _accepted_per_position(self, known):
        """vLLM's ``spec_decode_num_accepted_tokens_per_pos``: a counter labelled by proposal position."""
        totals: list[int] = []
        for r in known:
            for pos, count in enumerate(r.stats.spec_decode_num_accepted_tokens_per_pos):
                totals += [0] * (pos + 1 - len(totals))
                totals[pos] += count
        for name in ("vllm:spec_decode_num_accepted_tokens_per_pos", "pagedserve_spec_decode_num_accepted_tokens_per_pos"):
            family = CounterMetricFamily(name, "Speculative proposals accepted, by position in the proposal",
                                         labels=["model_name", "position"])
            for pos, count in enumerate(totals):
                family.add_metric([self.model_name, str(pos)], count)
            yield family

    def _per_replica(self, now: float):
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily("pagedserve_replica_up",
                               "1 when the replica is live (fresh stats, state ready)", labels=labels)
        running = GaugeMetricFamily("pagedserve_replica_num_requests_running",
                                    "Requests running per replica", labels=labels)
        waiting = GaugeMetricFamily("pagedserve_replica_num_requests_waiting",
                                    "Requests waiting per replica", labels=labels)
        usage = GaugeMetricFamily("pagedserve_replica_kv_cache_usage_ratio",
                                  "KV-cache usage per replica (0..1)", labels=labels)
        generated = CounterMetricFamily("pagedserve_replica_generation_tokens",
                                        "Tokens generated per replica (data-parallel balance)",
                                        labels=labels)
        # Under --scheduling-policy priority only (vLLM has no per-priority series: pagedserve's names)
        by_priority = [GaugeMetricFamily(f"pagedserve_replica_num_requests_{kind}_by_priority",
                                         f"Requests {kind} per replica and priority", labels=[*labels, "priority"])
                       for kind in ("waiting", "running")]
        for r in self.router.replicas:
            label = [self.model_name, str(r.replica)]
            if r.stats is not None and r.is_fresh(now, self.router.timeout_s):
                for family, counts in zip(by_priority, (r.stats.num_waiting_by_priority,
                                                        r.stats.num_running_by_priority)):
                    for priority, count in sorted(counts.items()):
                        family.add_metric([*label, str(priority)], count)
            up.add_metric(label, 1.0 if r.is_live(now, self.router.timeout_s) else 0.0)
            if r.stats is not None and r.is_fresh(now, self.router.timeout_s):
                running.add_metric(label, r.stats.num_running)
                waiting.add_metric(label, r.stats.num_waiting)
                usage.add_metric(label, r.stats.kv_cache_usage)
            if r.stats is not None:
                generated.add_metric(label, r.stats.generation_tokens)
        yield from (up, running, waiting, usage, generated, *by_priority)


class _Observed:
    """One observation recorded under pagedserve's name and vLLM's, both labelled by model."""

    __slots__ = ("_children",)

    def __init__(self, registry: CollectorRegistry, model_name: str, suffix: str, help_text: str,
                 buckets: tuple[float, ...]):
        self._children = [
            Histogram(f"{prefix}{suffix}", help_text, labelnames=["model_name"], buckets=buckets,
                      registry=registry).labels(model_name)
            for prefix in ("pagedserve_", "vllm:")]

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class FrontendMetrics:
    """Latencies and finishes counted per sequence, as vLLM v1 counts them: it runs each of a request's n
    samples as its own child request, each with its own TTFT, inter-token gaps, e2e latency and success,
    and an embedding input as a request of its own. Counting choices everywhere keeps the counter and the
    histograms' ``_count`` equal, so a dashboard's rate(success) matches rate(e2e_count)."""

    def __init__(self, router: Router, model_name: str, lora_enabled: bool = False):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(SchedulerStatsCollector(router, model_name, lora_enabled))
        self.registry.register(RouterCollector(router))
        self.shed = ShedCounts()  # 429s answered here (--max-waiting-requests)
        self.registry.register(ClassStatsCollector(router, model_name, self.shed))
        self.time_to_first_token = _Observed(
            self.registry, model_name, "time_to_first_token_seconds", "Arrival to a sequence's first output token",
            _TTFT_BUCKETS)
        # vLLM observes every decode gap under both names (time_per_output_token is its older one)
        self._token_gaps = [_Observed(self.registry, model_name, suffix, "Gap between a sequence's consecutive outputs",
                                      _TPOT_BUCKETS)
                            for suffix in ("time_per_output_token_seconds", "inter_token_latency_seconds")]
        self._mean_token_gap = _Observed(
            self.registry, model_name, "request_time_per_output_token_seconds",
            "A finished sequence's mean gap between output tokens", _TPOT_BUCKETS)
        self.e2e_request_latency = _Observed(
            self.registry, model_name, "e2e_request_latency_seconds", "Arrival to a sequence's last output",
            _LATENCY_BUCKETS)
        self._request_success = [
            Counter(name, "Finished sequences by finish reason", labelnames=["model_name", label],
                    registry=self.registry).labels  # vLLM spells the label finished_reason
            for name, label in (("pagedserve_request_success", "finish_reason"),
                                ("vllm:request_success", "finished_reason"))]
        # per adapter, counted as request_success counts (one per finished sequence)
        self._lora_requests = Counter("pagedserve_lora_requests", "Finished sequences per LoRA adapter",
                                      labelnames=["model_name", "lora_name"], registry=self.registry).labels

    def observe_token_gap(self, seconds: float) -> None:
        for gaps in self._token_gaps:
            gaps.observe(seconds)

    def count_finish(self, finish_reason: str, e2e_seconds: float, decode_seconds: float = 0.0,
                     num_tokens: int = 0, lora_name: str = "") -> None:
        """One sequence ended: its success, its e2e latency and, past one token, its mean token gap;
        ``lora_name``: the adapter that computed it ("": the base model)."""
        for labels in self._request_success:
            labels(self.model_name, finish_reason).inc()
        if lora_name:
            self._lora_requests(self.model_name, lora_name).inc()
        self.e2e_request_latency.observe(e2e_seconds)
        if num_tokens > 1:
            self._mean_token_gap.observe(decode_seconds / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
