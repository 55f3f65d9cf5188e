"""LoRA as an operator and an HTTP client see it before any adapter computes: `pagedserve serve`
refusing what could not work in one line with nothing started, and a real frontend process (fake
schedulers, support/frontend_harness.py) registering adapters made by peft with every replica,
again with a restarted one, and routing a request's `model` field to its adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.protocol.messages import LoadLoRA, UnloadLoRA
from support.frontend_harness import MAX_MODEL_LEN, fake_deployment
from support.lora_files import write_adapter
from support.server import pagedserve_processes

pytestmark = pytest.mark.slow

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_adapter(model_dir: str, out_dir: Path, r: int, targets, seed: int) -> str:
    """An adapter as peft saves it, with random (not zero) B so it would change the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out_dir)
    return str(out_dir.resolve())


@pytest.fixture(scope="module")
def llama(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("adapters")
    return {"sql": peft_adapter(llama, base / "sql", 8, ALL_SEVEN, 0),
            "chat": peft_adapter(llama, base / "chat", 4, ("q_proj", "v_proj"), 1)}


@pytest.fixture(scope="module")
def lora_deployment(tmp_path_factory, llama, adapters):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with fake_deployment(tmp_path_factory, llama, 2, MAX_MODEL_LEN, extra_args=[
                "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}"]) as deployed:
            yield deployed


def sent_to(fakes, request_id: str):
    return next(add for fake in fakes for add in fake.added if add.request_id == request_id)


def test_a_served_adapter_reaches_every_replica_is_listed_and_is_chosen_by_the_model_field(lora_deployment, adapters):
    frontend, fakes, _tokenizer = lora_deployment
    for fake in fakes:
        fake.wait_for(lambda f: f.lora_frames)
        [first, *_] = fake.lora_frames
        assert isinstance(first, LoadLoRA) and (first.adapter.name, first.adapter.lora_id, first.adapter.path) == (
            "sql", 1, adapters["sql"])
    with frontend.client() as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == adapters["sql"]
        for model, lora_name in (("sql", "sql"), ("tiny", "")):
            answer = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["model"] == model
            assert sent_to(fakes, answer.json()["id"]).lora_name == lora_name
        chat = http.post("/v1/chat/completions", json={"model": "sql", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and sent_to(fakes, chat.json()["id"]).lora_name == "sql"
        unknown = http.post("/v1/completions", json={"model": "chat", "prompt": "hello"})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_runtime_adapter_reaches_every_replica_and_a_restarted_one_is_sent_them_all(lora_deployment, adapters, tmp_path):
    frontend, fakes, _tokenizer = lora_deployment
    with frontend.client() as http:
        too_big = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": write_adapter(
            tmp_path / "big", frontend_model(frontend), r=16)})
        assert too_big.status_code == 400 and "rank 16 exceeds --max-lora-rank 8" in too_big.json()["error"]["message"]
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]})
        assert answer.status_code == 200, answer.text
        for fake in fakes:
            fake.wait_for(lambda f: any(isinstance(m, LoadLoRA) and m.adapter.name == "chat" for m in f.lora_frames))
        restarted = fakes[1]
        sent = restarted.stats_sent
        restarted.stats_fields = {"pid": 4242}  # the scheduler as the frontend first hears of it
        restarted.wait_for(lambda f: f.stats_sent >= sent + 2)  # the second heartbeat since carries it
        seen = len(restarted.lora_frames)
        restarted.stats_fields = {"pid": 4243}  # a new scheduler process: it knows no adapter
        restarted.wait_for(lambda f: len(f.lora_frames) >= seen + 2)
        assert [(type(m), m.adapter.name) for m in restarted.lora_frames[seen:]] == [(LoadLoRA, "sql"), (LoadLoRA, "chat")]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
        for fake in fakes:
            fake.wait_for(lambda f: f.lora_frames[-1] == UnloadLoRA("chat"))


def frontend_model(frontend) -> str:
    """The model directory the harness's frontend serves (its command line's --model)."""
    args = frontend.proc.args
    return args[args.index("--model") + 1]


def refused_serve(model: str, tmp_path: Path, *args: str) -> str:
    """The one line `pagedserve serve` refuses ``args`` with, having started nothing."""
    run_dirs = tmp_path / "run"
    run_dirs.mkdir()
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", model, "--port", "0",
                          "--run-dir-parent", str(run_dirs), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: "), lines[-20:]
    assert not list(run_dirs.iterdir()) and not pagedserve_processes(str(run_dirs))
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (("--lora-modules", "sql={sql}"), "--lora-modules: LoRA option(s) that need --enable-lora"),
    (("--enable-lora", "--max-lora-rank", "4", "--lora-modules", "sql={sql}"),
     "--lora-modules sql: LoRA adapter {sql}: rank 8 exceeds --max-lora-rank 4"),
    (("--enable-lora", "--served-model-name", "sql", "--lora-modules", "sql={sql}"),
     "'sql' is the base model's served name"),
    (("--enable-lora", "--task", "embed"), "--enable-lora: adapters are served for generation only"),
    (("--enable-lora", "--fully-sharded-loras"), "--fully-sharded-loras is a vLLM option that pagedserve does not support"),
])
def test_serve_refuses_lora_settings_that_could_not_work_in_one_line_before_any_process_starts(
        llama, adapters, tmp_path, args, words):
    line = refused_serve(llama, tmp_path, *(a.format(**adapters) for a in args))
    assert words.format(**adapters) in line


def test_the_offline_llm_refuses_a_lora_request_without_enable_lora_before_sending_anything(shared_llm, adapters):
    from pagedserve.offline import LoRARequest

    for call in (lambda r: shared_llm.generate(["hello"], lora_request=r),
                 lambda r: shared_llm.chat([{"role": "user", "content": "hi"}], lora_request=[r])):
        with pytest.raises(ValueError, match=r"^Got lora_request LoRARequest\(lora_name='sql'.* but LoRA is not enabled!$"):
            call(LoRARequest("sql", 1, adapters["sql"]))
    assert shared_llm.generate(["hello"], lora_request=None)[0].outputs[0].finish_reason is not None
