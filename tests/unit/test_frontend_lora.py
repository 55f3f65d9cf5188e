"""The frontend's LoRA adapters as pure objects and real sockets (no processes): registration with
every replica and again with a restarted one, the refusal to unload an adapter in use, routing
by an adapter's prefix blocks, and the adapters' Prometheus series."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.errors import Conflict
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.router import Router
from pagedserve.client.routing_policy import RoutingPolicy
from pagedserve.protocol.block_hash import adapter_seed, prefix_block_hashes
from pagedserve.protocol.messages import (AddRequest, FrontendStarted, FrontendToScheduler, LoadLoRA, PrefixCacheEvents,
                                          RequestDelta, RequestOutputs, SamplingParams, SchedulerStats, UnloadLoRA)
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir
from support.frontend_harness import poll
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


@contextmanager
def played_replicas(tmp_path, num_replicas: int):
    """A private run dir and the input socket of each of ``num_replicas`` schedulers, played here."""
    endpoints = Endpoints(make_run_dir(str(tmp_path)))
    ctx = zmq.Context()
    schedulers = [Receiver(ctx, endpoints.scheduler_inputs(r), FrontendToScheduler) for r in range(num_replicas)]
    try:
        yield endpoints, ctx, schedulers
    finally:
        for rx in schedulers:
            rx.close()
        ctx.term()


@asynccontextmanager
async def engine_client(endpoints, ctx, registry, pids: list[int]):
    """A started EngineClient, every replica live (one heartbeat each, from ``pids``): yields
    (router, client, the heartbeats' socket)."""
    router = Router(len(pids), timeout_s=60.0)
    client = EngineClient(endpoints, router, adapters=registry)
    client.start()
    heartbeats = Sender(ctx, endpoints.frontend_outputs())
    try:
        for replica, pid in enumerate(pids):
            heartbeats.send(SchedulerStats(replica=replica, state="ready", pid=pid))
        await poll(lambda: all(r.stats is not None for r in router.replicas))
        yield router, client, heartbeats
    finally:
        heartbeats.close()
        await client.close()


def received(scheduler: Receiver) -> list:
    out = []
    while (msg := scheduler.recv(timeout_ms=200)) is not None:
        out.append(msg)
    return out


def test_adapters_reach_every_replica_first_again_after_a_restart_and_never_leave_while_in_use(
        tmp_path, registry_factory):
    registry = registry_factory("sql")
    sql = registry.get("sql")

    async def scenario(endpoints, ctx):
        async with engine_client(endpoints, ctx, registry, [100, 101]) as (router, client, heartbeats):
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

    with played_replicas(tmp_path, 2) as (endpoints, ctx, schedulers):
        replica, chat = asyncio.run(scenario(endpoints, ctx))
        got = [received(s) for s in schedulers]
    for r, messages in enumerate(got):
        kinds = [type(m).__name__ for m in messages]
        if r == replica:
            assert kinds[:6] == ["FrontendStarted", "LoadLoRA", "LoadLoRA", "AddRequest", "UnloadLoRA", "AbortRequest"]
            assert messages[3].lora_name == "chat" and messages[4] == UnloadLoRA("sql")
        assert [m for m in messages if isinstance(m, (LoadLoRA, UnloadLoRA))][:4] == [
            LoadLoRA(sql), LoadLoRA(chat), UnloadLoRA("sql"), UnloadLoRA("chat")]
        assert isinstance(messages[0], FrontendStarted)
    # the restarted replica is sent what is registered now: nothing (both were unloaded)
    assert [type(m).__name__ for m in got[1]].count("LoadLoRA") == 2


def test_a_restarted_scheduler_is_sent_every_registered_adapter_before_any_new_request(tmp_path, registry_factory):
    registry = registry_factory("sql", "chat")

    async def scenario(endpoints, ctx):
        async with engine_client(endpoints, ctx, registry, [100]) as (router, client, heartbeats):
            heartbeats.send(SchedulerStats(replica=0, state="ready", pid=101))
            await poll(lambda: router.replicas[0].stats.pid == 101)
            client.submit(add("after", "sql"))

    with played_replicas(tmp_path, 1) as (endpoints, ctx, [scheduler]):
        asyncio.run(scenario(endpoints, ctx))
        kinds = [(type(m).__name__, getattr(getattr(m, "adapter", None), "name", None)) for m in received(scheduler)]
    assert kinds == [("FrontendStarted", None), ("LoadLoRA", "sql"), ("LoadLoRA", "chat"),
                     ("LoadLoRA", "sql"), ("LoadLoRA", "chat"), ("AddRequest", None)]


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


# ------------------------------------------------------------------ the HTTP routes, in process


class LoRAFrontend:
    """The real app and engine client over real sockets in a private run dir, one replica played
    here: what the frontend sends it is read from its socket, answers are written back by hand."""

    def __init__(self, endpoints, ctx, scheduler: Receiver, model_dir: str, registry):
        self.endpoints, self.ctx, self.scheduler = endpoints, ctx, scheduler
        self.model_dir, self.registry = model_dir, registry
        self.step = 0

    async def run(self, scenario) -> None:
        from pagedserve.client.tokenization import PromptTokenizer
        from pagedserve.frontend_proc.app import build_app
        from pagedserve.frontend_proc.serving import Serving

        async with engine_client(self.endpoints, self.ctx, self.registry, [100]) as (router, engine, outputs):
            self.outputs = outputs
            metrics = FrontendMetrics(router, "base", lora_enabled=self.registry is not None)
            serving = Serving(["base"], 128, engine, PromptTokenizer(Path(self.model_dir)), metrics,
                              adapters=self.registry)
            app = build_app(serving, router, metrics, None)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
                await scenario(self, http)

    async def next_frame(self, kind: type):
        """The next frame of ``kind`` the replica received (others before it are skipped)."""
        while True:
            msg = await asyncio.to_thread(self.scheduler.recv, 5000)
            assert msg is not None, f"no {kind.__name__} arrived"
            if isinstance(msg, kind):
                return msg

    async def answered(self, request) -> tuple[httpx.Response, AddRequest]:
        """``request`` (a coroutine) answered with one token, and the AddRequest it sent."""
        task = asyncio.create_task(request)
        add = await self.next_frame(AddRequest)
        self.finish(add)
        return await task, add

    def finish(self, add: AddRequest) -> None:
        self.step += 1
        self.outputs.send(RequestOutputs(0, self.step, [RequestDelta(add.request_id, 0, [7], "length",
                                                                     num_prompt_tokens=len(add.prompt_token_ids))]))


def lora_frontend(tmp_path, model_dir, registry, scenario):
    with played_replicas(tmp_path, 1) as (endpoints, ctx, [scheduler]):
        asyncio.run(LoRAFrontend(endpoints, ctx, scheduler, model_dir, registry).run(scenario))


@pytest.fixture(scope="module")
def llama(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture
def llama_registry(llama, tmp_path):
    registry = AdapterRegistry(llama, 16, ["base"])
    path = write_adapter(tmp_path / "sql", llama)
    registry.add("sql", registry.read("sql", path))
    return registry


def test_the_model_field_picks_the_adapter_and_models_lists_it_under_its_parent(tmp_path, llama, llama_registry):
    async def scenario(frontend: LoRAFrontend, http: httpx.AsyncClient):
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
            ("base", None, "base"), ("sql", "base", llama_registry.get("sql").path)]
        assert (await http.get("/v1/models/sql")).json()["parent"] == "base"
        for model, lora_name in (("sql", "sql"), ("base", ""), (None, "")):
            body = {"prompt": "hello", "max_tokens": 1, **({"model": model} if model else {})}
            answer, add = await frontend.answered(http.post("/v1/completions", json=body))
            assert answer.status_code == 200 and add.lora_name == lora_name
            assert answer.json()["model"] == (lora_name or "base")  # vLLM names the adapter that answered
        chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        answer, add = await frontend.answered(http.post("/v1/chat/completions", json=chat))
        assert answer.status_code == 200 and add.lora_name == "sql" and answer.json()["model"] == "sql"
        for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                           ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
            answer, add = await frontend.answered(http.post(path, json={"model": "sql", **body}))
            assert answer.status_code == 200 and add.lora_name == "sql" and answer.json()["model"] == "sql", path
        unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "hello", "max_tokens": 1})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "model_not_found"
        assert "'nope' is not served here" in unknown.json()["error"]["message"]
        assert (await http.post("/tokenize", json={"model": "sql", "prompt": "hi"})).status_code == 200

    lora_frontend(tmp_path, llama, llama_registry, scenario)


@pytest.mark.parametrize("flag, value, routed", [
    (None, None, False), ("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1", True),
    ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", " True ", True), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0", False)])
def test_the_runtime_routes_exist_only_when_allowed(tmp_path, llama, llama_registry, monkeypatch, flag, value, routed):
    for name in ("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    if flag:
        monkeypatch.setenv(flag, value)

    async def scenario(frontend, http):
        answer = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert answer.status_code == (200 if routed else 404)

    lora_frontend(tmp_path, llama, llama_registry, scenario)


def test_without_enable_lora_the_runtime_routes_do_not_exist_whatever_the_flag(tmp_path, llama, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")

    async def scenario(frontend, http):
        assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})).status_code == 404
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base"]

    lora_frontend(tmp_path, llama, None, scenario)


def test_load_and_unload_answer_vllms_texts_and_a_4xx_naming_each_refusal(tmp_path, llama, llama_registry, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    chat_path = write_adapter(tmp_path / "chat", llama, seed=3)
    big = write_adapter(tmp_path / "big", llama, r=32)

    async def scenario(frontend: LoRAFrontend, http: httpx.AsyncClient):
        async def load(**body):
            return await http.post("/v1/load_lora_adapter", json=body)

        answer = await load(lora_name="chat", lora_path=chat_path)
        assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
        loaded = await frontend.next_frame(LoadLoRA)
        while loaded.adapter.name != "chat":  # the registry's own first
            loaded = await frontend.next_frame(LoadLoRA)
        assert (loaded.adapter.lora_id, loaded.adapter.path) == (2, chat_path)
        assert "chat" in [m["id"] for m in (await http.get("/v1/models")).json()["data"]]

        refusals = [
            (dict(lora_name="chat", lora_path=chat_path), 400, "The lora adapter 'chat' has already been loaded."),
            (dict(lora_name="base", lora_path=chat_path), 400, "'base' is the base model's served name"),
            (dict(lora_name="x", lora_path=str(tmp_path / "missing")), 400, "missing: does not exist"),
            (dict(lora_name="x", lora_path=big), 400, "rank 32 exceeds --max-lora-rank 16"),
            (dict(lora_name="", lora_path=chat_path), 400, "Both 'lora_name' and 'lora_path' must be provided."),
            (dict(lora_name="x"), 400, "lora_path"),
            (dict(lora_name="x", lora_path=chat_path, rank=8), 400, "rank"),
            (dict(lora_name=3, lora_path=chat_path), 400, "lora_name"),
        ]
        for body, status, words in refusals:
            answer = await load(**body)
            assert answer.status_code == status and words in answer.json()["error"]["message"], (body, answer.text)
        not_json = await http.post("/v1/load_lora_adapter", content=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400

        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
        wrong_id = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat", "lora_int_id": 9})
        assert wrong_id.status_code == 400 and "its id is 2" in wrong_id.json()["error"]["message"]

        # in use: refused while a request computed by it is in flight, accepted once it finished
        task = asyncio.create_task(http.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 1}))
        add = await frontend.next_frame(AddRequest)
        busy = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert busy.status_code == 409 and "in use by 1 request(s) in flight" in busy.json()["error"]["message"]
        replaced = await load(lora_name="chat", lora_path=chat_path, load_inplace=True)
        assert replaced.status_code == 409
        frontend.finish(add)
        assert (await task).status_code == 200
        answer = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
        assert await frontend.next_frame(UnloadLoRA) == UnloadLoRA("chat")
        gone = await http.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 1})
        assert gone.status_code == 400 and gone.json()["error"]["code"] == "model_not_found"

        other = write_adapter(tmp_path / "sql2", llama, seed=5)
        replaced = await load(lora_name="sql", lora_path=other, load_inplace=True)
        assert replaced.status_code == 200
        frame = await frontend.next_frame(LoadLoRA)
        assert (frame.adapter.name, frame.adapter.lora_id, frame.adapter.path) == ("sql", 1, other)

    lora_frontend(tmp_path, llama, llama_registry, scenario)
