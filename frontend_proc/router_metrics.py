"""Prometheus view of the router's decisions and of how well it predicted cache hits."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.client.router import Router
from pagedserve.client.routing_policy import REASONS


class RouterCollector(Collector):
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        chooser = self.router.chooser
        decisions = CounterMetricFamily(
            "pagedserve_router_decisions", "Requests routed, by why the replica was chosen "
            "(cache_hit, no_hit, load_bound, least_loaded, round_robin)", labels=["reason"])
        for reason in REASONS:
            decisions.add_metric([reason], chooser.decisions[reason])
        requests = CounterMetricFamily("pagedserve_router_requests", "Requests routed per replica",
                                       labels=["replica"])
        predicted = CounterMetricFamily(
            "pagedserve_router_predicted_hit_tokens",
            "Prompt tokens the router expected cached, over requests that finished", labels=["replica"])
        actual = CounterMetricFamily(
            "pagedserve_router_actual_hit_tokens",
            "Prompt tokens the replica found cached, over the same requests", labels=["replica"])
        known = GaugeMetricFamily("pagedserve_router_cached_blocks",
                                  "Blocks the router believes each replica's prefix cache holds",
                                  labels=["replica"])
        for r in self.router.replicas:
            label = [str(r.replica)]
            requests.add_metric(label, chooser.requests[r.replica])
            predicted.add_metric(label, chooser.predicted_hit_tokens[r.replica])
            actual.add_metric(label, chooser.actual_hit_tokens[r.replica])
            known.add_metric(label, len(r.cache))
        yield from (decisions, requests, predicted, actual, known)
