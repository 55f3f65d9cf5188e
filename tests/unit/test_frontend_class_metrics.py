"""/metrics per priority and per tenant: the replicas' SchedulerStats summed into labelled series,
and the 429s the frontend answered itself (pure objects: no process)."""

from __future__ import annotations

from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.router import Router
from pagedserve.protocol.messages import SchedulerStats


def _stats(replica: int, **fields) -> SchedulerStats:
    return SchedulerStats(replica=replica, state="ready", pid=10 + replica, scheduling_policy="fair", **fields)


def test_per_tenant_and_per_priority_series_sum_the_replicas():
    router = Router(2, timeout_s=5.0)
    router.update(_stats(0, num_waiting_by_tenant={"gold": 2}, generation_tokens_by_tenant={"gold": 10, "free": 3},
                         deadline_misses_by_priority={0: 1}, num_queue_time_expired=1, tenant_service={"gold": 7.5}))
    router.update(_stats(1, num_waiting_by_tenant={"gold": 1, "free": 4}, generation_tokens_by_tenant={"gold": 5},
                         num_deadline_expired=2, num_requests_shed=3))
    metrics = FrontendMetrics(router, "m")
    for tenant, priority in (("gold", 0), ("free", 3), ("free", 3), ("free", 0)):
        metrics.shed.count(tenant, priority)
    text = metrics.render().decode()
    lines = set(text.splitlines())
    assert 'pagedserve_num_requests_waiting_by_tenant{model_name="m",tenant="gold"} 3.0' in lines
    assert 'pagedserve_num_requests_waiting_by_tenant{model_name="m",tenant="free"} 4.0' in lines
    assert 'pagedserve_generation_tokens_by_tenant_total{model_name="m",tenant="gold"} 15.0' in lines
    assert 'pagedserve_deadline_misses_by_priority_total{model_name="m",priority="0"} 1.0' in lines
    assert 'pagedserve_tenant_service{model_name="m",tenant="gold"} 7.5' in lines
    assert 'pagedserve_queue_time_expired_total{model_name="m"} 1.0' in lines
    assert 'pagedserve_deadline_expired_total{model_name="m"} 2.0' in lines
    assert 'pagedserve_scheduler_requests_shed_total{model_name="m"} 3.0' in lines
    assert 'pagedserve_requests_shed_total{model_name="m"} 4.0' in lines
    assert 'pagedserve_requests_shed_by_tenant_total{model_name="m",tenant="free"} 3.0' in lines
    assert 'pagedserve_requests_shed_by_priority_total{model_name="m",priority="3"} 2.0' in lines
