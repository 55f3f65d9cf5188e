"""Prometheus series per priority and per tenant, summed over the replicas' SchedulerStats.

vLLM exports no per-priority or per-tenant series, so these carry pagedserve's names, each with
a ``priority`` or ``tenant`` label; the counts behind them are kept by the schedulers
(scheduler_proc/stats.py: counted as requests end, at most 256 tenant keys per replica).
Gauges read only replicas whose stats are fresh; counters every replica that ever reported.
The frontend's own 429s (``--max-waiting-requests``) are ``pagedserve_requests_shed_total``.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.client.router import Router
from pagedserve.protocol.priority import MAX_TENANT_KEYS, OTHER_TENANTS

# family name -> (help, SchedulerStats field, label); gauges of live replicas
_GAUGES = {
    "pagedserve_num_requests_waiting_by_tenant": ("Requests waiting per tenant", "num_waiting_by_tenant", "tenant"),
    "pagedserve_num_requests_running_by_tenant": ("Requests running per tenant", "num_running_by_tenant", "tenant"),
    "pagedserve_num_requests_waiting_by_priority": ("Requests waiting per priority (priority, deadline policies)",
                                                    "num_waiting_by_priority", "priority"),
    "pagedserve_num_requests_running_by_priority": ("Requests running per priority (priority, deadline policies)",
                                                    "num_running_by_priority", "priority"),
    "pagedserve_tenant_service": ("Fair policy: each tenant's virtual token counter", "tenant_service", "tenant"),
}
_COUNTERS = {
    "pagedserve_generation_tokens_by_tenant": ("Tokens generated per tenant (counted as requests end)",
                                               "generation_tokens_by_tenant", "tenant"),
    "pagedserve_generation_tokens_by_priority": ("Tokens generated per priority (counted as requests end)",
                                                 "generation_tokens_by_priority", "priority"),
    "pagedserve_deadline_misses_by_tenant": ("Requests ended by a time limit per tenant",
                                             "deadline_misses_by_tenant", "tenant"),
    "pagedserve_deadline_misses_by_priority": ("Requests ended by a time limit per priority",
                                               "deadline_misses_by_priority", "priority"),
}
_TOTALS = {
    "pagedserve_queue_time_expired": ("Requests ended without a first token past their queue limit",
                                      "num_queue_time_expired"),
    "pagedserve_deadline_expired": ("Requests ended at their deadline_s with the tokens so far", "num_deadline_expired"),
    "pagedserve_scheduler_requests_shed": ("Requests a scheduler refused past --max-waiting-requests",
                                           "num_requests_shed"),
}


class ShedCounts:
    """The frontend's own 429s, in total, per tenant and per priority."""

    def __init__(self) -> None:
        self.total = 0
        self.by_tenant: dict[str, int] = {}
        self.by_priority: dict[int, int] = {}

    def count(self, tenant: str, priority: int) -> None:
        self.total += 1
        key = tenant if tenant in self.by_tenant or len(self.by_tenant) < MAX_TENANT_KEYS else OTHER_TENANTS
        self.by_tenant[key] = self.by_tenant.get(key, 0) + 1
        self.by_priority[priority] = self.by_priority.get(priority, 0) + 1


class ClassStatsCollector(Collector):
    def __init__(self, router: Router, model_name: str, shed: ShedCounts):
        self.router = router
        self.model_name = model_name
        self.shed = shed

    def collect(self):
        now = time.monotonic()
        reported = [r.stats for r in self.router.replicas if r.stats is not None]
        fresh = [r.stats for r in self.router.replicas
                 if r.stats is not None and r.is_fresh(now, self.router.timeout_s)]
        for name, (help_text, field, label) in _GAUGES.items():
            yield self._family(GaugeMetricFamily, name, help_text, label, fresh, field)
        for name, (help_text, field, label) in _COUNTERS.items():
            yield self._family(CounterMetricFamily, name, help_text, label, reported, field)
        for name, (help_text, field) in _TOTALS.items():
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], sum(getattr(s, field) for s in reported))
            yield family
        shed = CounterMetricFamily("pagedserve_requests_shed", "Requests the frontend answered 429 "
                                   "(--max-waiting-requests)", labels=["model_name"])
        shed.add_metric([self.model_name], self.shed.total)
        yield shed
        for label, counts in (("tenant", self.shed.by_tenant), ("priority", self.shed.by_priority)):
            family = CounterMetricFamily(f"pagedserve_requests_shed_by_{label}", f"429s answered here per {label}",
                                         labels=["model_name", label])
            for key, value in sorted(counts.items(), key=lambda kv: str(kv[0])):
                family.add_metric([self.model_name, str(key)], value)
            yield family

    def _family(self, kind, name: str, help_text: str, label: str, stats: list, field: str):
        summed: dict = {}
        for s in stats:
            for key, value in getattr(s, field).items():
                summed[key] = summed.get(key, 0) + value
        family = kind(name, help_text, labels=["model_name", label])
        for key, value in sorted(summed.items(), key=lambda kv: str(kv[0])):
            family.add_metric([self.model_name, str(key)], value)
        return family
