"""LoRA adapters through the real server, checked against transformers + peft on the same weights.

One deployment mixes four adapters and the base model in its steps (--max-loras 4), with prefix
caching on, a cache small enough that sequences are preempted, and the same prompts sent to
several adapters (so a block cached for one adapter must never serve another). Greedy tokens in
float32 equal ``PeftModel.from_pretrained(...).generate(do_sample=False)`` for every request, at
TP=1 and TP=2. Adapters loaded and unloaded at run time while 32 streams run lose no request and
answer none with the wrong adapter; a worker restart keeps them.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import httpx
import openai
import psutil
import pytest
from pagedserve.tools.lora_adapters import make_adapter
from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server, wait_until

pytestmark = pytest.mark.slow

RUNTIME = {"PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
MAX_TOKENS = 12


@lru_cache(maxsize=16)
def _peft_model(model_dir: str, adapter_dir: str):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: str, adapter_dir: str | None, ids: list[int], n: int) -> list[int]:
    """transformers + peft's greedy continuation: the oracle (the base model's for None)."""
    if adapter_dir is None:
        return hf_greedy(model_dir, ids, n)
    import torch

    model = _peft_model(model_dir, adapter_dir)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def lora_setup(model_factory, tmp_path_factory):
    """A small Llama and five adapters of different ranks, scalings and targets."""
    model = model_factory("llama", norm_std=0.1, seed=31)
    root = tmp_path_factory.mktemp("adapters")
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    specs = {"a0": dict(r=8, alpha=16, targets=all7), "a1": dict(r=4, alpha=8, targets=["q_proj", "v_proj"]),
             "a2": dict(r=8, alpha=32, targets=all7, rslora=True), "a3": dict(r=2, alpha=4, targets=["o_proj", "down_proj"]),
             "a4": dict(r=8, alpha=16, targets=["gate_proj", "up_proj", "k_proj"])}
    adapters = {name: make_adapter(model, str(root / name), seed=100 + i, **spec)
                for i, (name, spec) in enumerate(specs.items())}
    return model, adapters


def _prompts() -> list[list[int]]:
    """Prompts of 9-30 tokens, some sharing their first 12 (a prefix-cache hit across requests)."""
    head = [(7 * i + 3) % 120 + 2 for i in range(12)]
    return [head + [(5 * i + k) % 120 + 2 for i in range(3 + 2 * k)] for k in range(8)] + [head[:9]]


def _complete(srv: Server, model: str, ids: list[int]) -> str:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def expected(model: str, adapter_dir: str | None, ids: list[int]) -> str:
    return hf_tokenizer(model).decode(peft_greedy(model, adapter_dir, ids, MAX_TOKENS), skip_special_tokens=True)


def _base_name(srv: Server) -> str:
    return next(m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"] if not m.get("parent"))


def _check_mix(srv: Server, model: str, adapters: dict, names: list[str]) -> None:
    base = _base_name(srv)
    jobs = [(name, ids) for ids in _prompts() for name in names]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda job: _complete(srv, base if job[0] is None else job[0], job[1]), jobs))
    for (name, ids), tokens in zip(jobs, got):
        assert tokens == expected(model, adapters.get(name), ids), (name, ids)
    for name in filter(None, names):  # each adapter changes some answer: served by the base, this would fail
        assert any(expected(model, adapters[name], ids) != expected(model, None, ids) for ids in _prompts()), name


@pytest.mark.parametrize("tp", [1, 2])
def test_a_batch_of_four_adapters_and_the_base_model_equals_peft_greedy(tp, lora_setup, tmp_path):
    model, adapters = lora_setup
    mods = [f"{n}={adapters[n]}" for n in ("a0", "a1", "a2", "a3")]
    srv = Server(model, ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--lora-modules", *mods,
                         "--enable-prefix-caching", "--block-size", "4", "--num-gpu-blocks", "48",
                         "--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--max-model-len", "128",
                         "--dtype", "float32", "-tp", str(tp), "--debug-invariants"]).start(tmp_path)
    try:
        models = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]}
        assert {"a0", "a1", "a2", "a3"} <= set(models) and models["a0"]["parent"] == _base_name(srv)
        _check_mix(srv, model, adapters, [None, "a0", "a1", "a2", "a3"])
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "vllm:lora_requests_info" in metrics
        preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("pagedserve_num_preemptions_total"))
        assert preempted > 0, "the cache was meant to be small enough to preempt"
    finally:
        srv.stop()


def test_more_adapters_than_slots_all_answer_correctly(lora_setup, tmp_path):
    """Five adapters through two slots: every request is served, by its own adapter."""
    model, adapters = lora_setup
    mods = [f"{n}={p}" for n, p in adapters.items()]
    srv = Server(model, ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *mods,
                         "--max-model-len", "128", "--dtype", "float32"]).start(tmp_path)
    try:
        _check_mix(srv, model, adapters, list(adapters))
    finally:
        srv.stop()


def test_runtime_load_and_unload_while_32_streams_run(lora_setup, tmp_path):
    model, adapters = lora_setup
    srv = Server(model, ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                         "--lora-modules", f"a0={adapters['a0']}", "--max-model-len", "128", "--dtype", "float32"],
                 env=RUNTIME).start(tmp_path)
    try:
        base = _base_name(srv)
        prompts = _prompts()
        jobs = [("a0" if i % 2 else None, prompts[i % len(prompts)]) for i in range(32)]
        with ThreadPoolExecutor(32) as pool:
            running = [pool.submit(_complete, srv, base if n is None else n, ids) for n, ids in jobs]
            r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]},
                           timeout=60)
            assert r.status_code == 200, r.text
            late = [pool.submit(_complete, srv, "a2", ids) for ids in prompts[:6]]
            unload_busy = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"}, timeout=60)
            got = [f.result() for f in running]
            got_late = [f.result() for f in late]
        assert unload_busy.status_code in (200, 400, 409), unload_busy.text
        for (name, ids), tokens in zip(jobs, got):
            assert tokens == expected(model, adapters.get(name), ids), (name, ids)
        for ids, tokens in zip(prompts[:6], got_late):
            assert tokens == expected(model, adapters["a2"], ids)
        bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"},
                         timeout=60)
        assert 400 <= bad.status_code < 500 and "does not exist" in bad.text
        # a worker restart keeps the adapters loaded at run time
        workers = [p for p in (psutil.Process(pid) for pid in srv.pids())
                   if "pagedserve.worker_proc" in " ".join(p.cmdline())]
        os.kill(workers[0].pid, signal.SIGKILL)

        def answers_again() -> bool:
            try:
                return _complete(srv, "a2", prompts[0]) == expected(model, adapters["a2"], prompts[0])
            except openai.APIError:
                return False
        assert wait_until(answers_again, 120, 0.5)
    finally:
        srv.stop()


def test_offline_generate_with_a_lora_request_per_prompt_equals_peft(lora_setup):
    """vLLM's offline idiom: LLM(enable_lora=True), one LoRARequest (or None) per prompt."""
    from pagedserve.offline import LoRARequest
    from pagedserve.offline.llm import LLM, SamplingParams

    model, adapters = lora_setup
    prompts = _prompts()[:5]
    requests = [None, *(LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(("a0", "a1", "a2", "a3")))]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", max_model_len=128) as llm:
        outs = llm.generate(prompts, greedy, lora_request=requests, use_tqdm=False)
        again = llm.generate(prompts[:1], greedy, lora_request=requests[3], use_tqdm=False)
    for ids, req, out in zip(prompts, requests, outs):
        assert out.token_ids == peft_greedy(model, req.lora_path if req else None, ids, MAX_TOKENS), req
    assert again[0].token_ids == peft_greedy(model, adapters["a2"], prompts[0], MAX_TOKENS)
