"""The frontend's LoRA adapters as pure objects and real sockets (no processes): registration with
every replica and again with a restarted one, the refusal to unload an adapter in use, routing
by an adapter's prefix blocks, and the adapters' Prometheus series."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.errors import Conflict
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.router import Router
from pagedserve.frontend_proc.routing_policy import RoutingPolicy
from pagedserve.protocol.block_hash import adapter_seed, prefix_block_hashes
from pagedserve.protocol.messages import (AddRequest, FrontendStarted, FrontendToScheduler, LoadLoRA, PrefixCacheEvents,
                                          SamplingParams, SchedulerStats, UnloadLoRA)
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir
from support.lora_files import write_adapter

LLAMA = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256, "hidden_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2}
BS = 4


@pytest.fixture(scope="module")
def registry_factory(tmp_path_factory):
    model = tmp_path_factory.mktemp("llama")
    (model / "config.json").write_text(json.dumps(LLAMA))
    paths = [write_adapter(tmp_path_factory.mktemp("adapters") / f"a{i}", model, seed=i) for i in range(2)]

    def make(*names: str) -> AdapterRegistry:
        registry = AdapterRegistry(model, 16, ["base"])
        for name, path in zip(names, paths):
            registry.add(name, registry.read(name, path))
        return registry

    make.paths = paths
    return make


def add(request_id: str, lora_name: str = "", prompt=(5, 6)) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling=SamplingParams(max_tokens=4),
                      eos_token_ids=[2], lora_name=lora_name)


async def poll(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def received(scheduler: Receiver) -> list:
    out = []
    while (msg := scheduler.recv(timeout_ms=200)) is not None:
        out.append(msg)
    return out


def test_adapters_reach_every_replica_first_again_after_a_restart_and_never_leave_while_in_use(
        tmp_path, registry_factory):
    endpoints = Endpoints(make_run_dir(str(tmp_path)))
    ctx = zmq.Context()
    schedulers = [Receiver(ctx, endpoints.scheduler_inputs(r), FrontendToScheduler) for r in range(2)]
    registry = registry_factory("sql")
    sql = registry.get("sql")

    async def scenario():
        router = Router(2, timeout_s=30.0)
        client = EngineClient(endpoints, router, adapters=registry)
        client.start()
        heartbeats = Sender(ctx, endpoints.frontend_outputs())
        try:
            for replica in range(2):
                heartbeats.send(SchedulerStats(replica=replica, state="ready", pid=100 + replica))
            await poll(lambda: all(r.stats is not None for r in router.replicas))
            chat = client.load_adapter("chat", registry.read("chat", registry_factory.paths[1]))
            handle = client.submit(add("a", "chat"))
            with pytest.raises(Conflict, match="'chat' is in use by 1 request"):
                client.unload_adapter("chat")
            assert "chat" in registry
            client.unload_adapter("sql")  # no request uses it
            client.abort(handle)
            client.unload_adapter("chat")
            heartbeats.send(SchedulerStats(replica=1, state="ready", pid=201))  # replica 1 restarted
            await poll(lambda: router.replicas[1].stats.pid == 201)
            return handle.replica, chat
        finally:
            heartbeats.close()
            await client.close()

    try:
        replica, chat = asyncio.run(scenario())
        got = [received(s) for s in schedulers]
        for r, messages in enumerate(got):
            kinds = [type(m).__name__ for m in messages]
            start = ["FrontendStarted", "LoadLoRA", "LoadLoRA", "UnloadLoRA"]
            if r == replica:
                assert kinds[:6] == [*start[:3], "AddRequest", "UnloadLoRA", "AbortRequest"]
                assert messages[3].lora_name == "chat" and messages[4] == UnloadLoRA("sql")
            assert [m for m in messages if isinstance(m, (LoadLoRA, UnloadLoRA))][:4] == [
                LoadLoRA(sql), LoadLoRA(chat), UnloadLoRA("sql"), UnloadLoRA("chat")]
            assert isinstance(messages[0], FrontendStarted)
        # the restarted replica is sent what is registered now: nothing (both were unloaded)
        assert [type(m).__name__ for m in got[1]].count("LoadLoRA") == 2
    finally:
        for rx in schedulers:
            rx.close()
        ctx.term()


def test_a_restarted_scheduler_is_sent_every_registered_adapter_before_any_new_request(tmp_path, registry_factory):
    endpoints = Endpoints(make_run_dir(str(tmp_path)))
    ctx = zmq.Context()
    scheduler = Receiver(ctx, endpoints.scheduler_inputs(0), FrontendToScheduler)
    registry = registry_factory("sql", "chat")

    async def scenario():
        router = Router(1, timeout_s=30.0)
        client = EngineClient(endpoints, router, adapters=registry)
        client.start()
        heartbeats = Sender(ctx, endpoints.frontend_outputs())
        try:
            heartbeats.send(SchedulerStats(replica=0, state="ready", pid=100))
            await poll(lambda: router.replicas[0].stats is not None)
            heartbeats.send(SchedulerStats(replica=0, state="ready", pid=101))
            await poll(lambda: router.replicas[0].stats.pid == 101)
            client.submit(add("after", "sql"))
        finally:
            heartbeats.close()
            await client.close()

    try:
        asyncio.run(scenario())
        kinds = [(type(m).__name__, getattr(getattr(m, "adapter", None), "name", None)) for m in received(scheduler)]
        assert kinds == [("FrontendStarted", None), ("LoadLoRA", "sql"), ("LoadLoRA", "chat"),
                         ("LoadLoRA", "sql"), ("LoadLoRA", "chat"), ("AddRequest", None)]
    finally:
        scheduler.close()
        ctx.term()


def test_an_adapters_request_goes_where_that_adapters_blocks_are_cached_not_the_base_models(registry_factory):
    registry = registry_factory("sql")
    seed = registry.seed("sql")
    assert seed == adapter_seed(registry.get("sql").digest)
    router = Router(2, timeout_s=1.0, policy=RoutingPolicy("cache-aware"))
    for r in range(2):
        router.update(SchedulerStats(replica=r, state="ready", pid=100 + r, block_size=BS, num_gpu_blocks=64), now=10.0)
    prompt = list(range(100, 116))
    router.apply_cache_events(PrefixCacheEvents(0, 100, 0, False, prefix_block_hashes(prompt + [1], BS), []))
    router.apply_cache_events(PrefixCacheEvents(1, 101, 0, False, prefix_block_hashes(prompt + [1], BS, seed), []))
    assert router.choose(prompt + [5], now=10.1).replica == 0
    decision = router.choose(prompt + [5], now=10.1, seed=seed)
    assert (decision.replica, decision.reason, decision.predicted_hit_tokens) == (1, "cache_hit", 16)


def samples(metrics: FrontendMetrics, name: str) -> list:
    families = text_string_to_metric_families(metrics.render().decode())
    return [s for f in families for s in f.samples if s.name == name]


def test_lora_metrics_are_vllms_info_gauge_and_counters_per_adapter():
    router = Router(2, timeout_s=30.0)
    metrics = FrontendMetrics(router, "base", lora_enabled=True)
    assert samples(metrics, "vllm:lora_requests_info") == []  # no stats yet
    router.update(SchedulerStats(replica=0, state="ready", pid=1, running_lora_adapters=["sql"],
                                 waiting_lora_adapters=["chat"], max_lora=4,
                                 generation_tokens_by_lora={"sql": 10, "chat": 2}))
    router.update(SchedulerStats(replica=1, state="ready", pid=2, running_lora_adapters=["chat", "sql"],
                                 max_lora=4, generation_tokens_by_lora={"sql": 5}))
    before = time.time()
    [info] = samples(metrics, "vllm:lora_requests_info")
    assert info.labels == {"max_lora": "4", "running_lora_adapters": "chat,sql", "waiting_lora_adapters": "chat"}
    assert before - 5 < info.value <= time.time()  # the time of the last update, as vLLM's set_to_current_time
    tokens = {s.labels["lora_name"]: s.value for s in samples(metrics, "pagedserve_lora_generation_tokens_total")}
    assert tokens == {"sql": 15, "chat": 2}
    metrics.count_finish("stop", 0.5, 0.2, 3, lora_name="sql")
    metrics.count_finish("length", 0.5, 0.2, 3, lora_name="sql")
    metrics.count_finish("stop", 0.5, 0.2, 3)  # the base model's: not an adapter's
    [count] = samples(metrics, "pagedserve_lora_requests_total")
    assert count.labels == {"model_name": "base", "lora_name": "sql"} and count.value == 2
    assert samples(FrontendMetrics(router, "base"), "vllm:lora_requests_info") == []  # LoRA off: no series
