"""LoRA adapters in the worker: a batch mixing adapters and the base model decodes, request by request,
what transformers + peft decode with the same adapter (float32 greedy), on both delta paths; slots
reload; an adapter whose files changed, and a worker that cannot serve adapters, refuse in one line."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch

from pagedserve.protocol.lora_adapter import LoRAAdapterError
from pagedserve.protocol.messages import LoRAAdapter, LoRASlot, LoRAStep
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models import lora_linear
from pagedserve.worker_proc.models.lora_linear import LoRAConfig
from support.lora import ALL_TARGETS, adapter_message, make_adapter, peft_greedy
from support.worker_harness import TrivialScheduler, random_prompts

NEW_TOKENS = 8
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's projections
PHI3_TARGETS = [FUSED, ("qkv_proj",), FUSED, ("o_proj", "down_proj")]
# (rank, alpha, targets, rsLoRA) of the four adapters a batch mixes
ADAPTERS = [(8, 16, ALL_TARGETS, False), (4, 8, ("q_proj", "v_proj"), False), (8, 16, ALL_TARGETS, True),
            (2, 32, ("k_proj", "o_proj", "down_proj"), False)]


_BUILT: dict = {}


def _adapted(arch: str, tmp_path_factory):
    """A small model dir and four adapters of it (Phi-3: on its fused projections), once per module."""
    if arch not in _BUILT:
        _BUILT[arch] = _build(arch, tmp_path_factory.mktemp(f"lora-{arch}"))
    return _BUILT[arch]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2", "phi3"])
def adapted(request, tmp_path_factory):
    return _adapted(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _adapted("llama", tmp_path_factory)


def _build(arch: str, root):
    model_dir = build_model_dir(root / "model", arch, num_layers=2, norm_std=0.1 if arch == "gemma2" else 0.0)
    adapters = []
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        if arch == "phi3":
            targets = PHI3_TARGETS[i]
        adapters.append(make_adapter(model_dir, root / f"a{i}", rank, alpha, targets, seed=i, rslora=rslora))
    return model_dir, adapters


def _runner(model_dir, max_loras: int = 4) -> ModelRunner:
    return ModelRunner(str(model_dir), lora=LoRAConfig(max_loras=max_loras, max_rank=8))


def _on_slot_0(runner: ModelRunner, adapter: LoRAAdapter, max_tokens: int = 2) -> TrivialScheduler:
    """A scheduler whose first step loads ``adapter`` into slot 0 for its one request."""
    sched = TrivialScheduler(runner)
    sched.load_lora(0, adapter)
    sched.add("r", [5, 6, 7], max_tokens, lora_slot=0)
    return sched


@pytest.mark.parametrize("path", ["by step size", "native", "dense", "segments"])
def test_a_batch_mixing_four_adapters_and_the_base_model_decodes_what_peft_decodes(adapted, path, monkeypatch):
    if path != "by step size":  # every step through one path: decodes through segments, prompts dense
        monkeypatch.setattr(lora_linear, "choose_path", lambda device, num_tokens: path)
    model_dir, adapters = adapted
    prompts = random_prompts([7, 19, 4, 11, 25, 9], vocab_size=512, seed=3)
    slots = [0, 1, 2, 3, -1, 1]  # two requests share adapter 1; one is the base model
    sched = TrivialScheduler(_runner(model_dir))
    for slot, path_ in enumerate(adapters):
        sched.load_lora(slot, adapter_message(f"a{slot}", path_, slot + 1))
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, NEW_TOKENS, lora_slot=slots[i], arrival_step=i // 2,
                  prefill_chunks=[6] if i == 4 else None)
    ours = sched.run()
    expected = {i: peft_greedy(model_dir, adapters[s] if s >= 0 else None, [prompts[i]], NEW_TOKENS)[0]
                for i, s in enumerate(slots)}
    assert {i: ours[f"r{i}"] for i in expected} == expected
    assert len({tuple(t) for t in expected.values()}) == len(expected)  # every adapter changes the tokens


def test_a_slot_reloaded_with_another_adapter_computes_the_new_one(adapted):
    model_dir, adapters = adapted
    prompts = random_prompts([9, 6], vocab_size=512, seed=5)
    sched = TrivialScheduler(_runner(model_dir, max_loras=1))
    sched.load_lora(0, adapter_message("a0", adapters[0], 1))
    sched.add("first", prompts[0], NEW_TOKENS, lora_slot=0)
    sched.run()
    sched.load_lora(0, adapter_message("a2", adapters[2], 3), at_step=sched.step)
    sched.add("second", prompts[1], NEW_TOKENS, lora_slot=0, arrival_step=sched.step)
    second = sched.run()["second"]
    assert second == peft_greedy(model_dir, adapters[2], [prompts[1]], NEW_TOKENS)[0]
    assert second != peft_greedy(model_dir, adapters[0], [prompts[1]], NEW_TOKENS)[0]


def test_an_adapter_whose_files_changed_since_it_was_registered_is_refused(llama, tmp_path):
    model_dir, adapters = llama
    copy = shutil.copytree(adapters[0], tmp_path / "edited")
    registered = adapter_message("edited", str(copy))
    weights = safetensors.torch.load_file(copy / "adapter_model.safetensors")
    safetensors.torch.save_file({k: v * 2 for k, v in weights.items()}, copy / "adapter_model.safetensors")
    sched = _on_slot_0(_runner(model_dir), registered)
    with pytest.raises(LoRAAdapterError, match="files changed since it was registered"):
        sched.step_once()


def test_loading_over_the_slot_of_a_running_request_is_a_broken_contract(llama):
    model_dir, adapters = llama
    sched = _on_slot_0(_runner(model_dir), adapter_message("a0", adapters[0], 1), max_tokens=4)
    sched.step_once()
    sched.load_lora(0, adapter_message("a1", adapters[1], 2), at_step=sched.step)
    with pytest.raises(AssertionError, match="running request"):
        sched.step_once()


def test_a_lora_step_must_precede_the_output_of_its_own_step(llama):
    model_dir, adapters = llama
    sched = TrivialScheduler(_runner(model_dir))
    sched.runner.apply_lora_step(LoRAStep(step=5, loads=[LoRASlot(slot=0, adapter=adapter_message("a0", adapters[0]))]))
    sched.add("r", [5, 6, 7], 2)
    with pytest.raises(ValueError, match="LoRASteps \\[5\\] arrived before the SchedulerOutput of step 0"):
        sched.step_once()


def test_a_step_without_adapter_tokens_does_no_lora_work(llama):
    model_dir, adapters = llama
    runner = _runner(model_dir)
    sched = TrivialScheduler(runner)
    sched.load_lora(0, adapter_message("a0", adapters[0], 1))
    sched.add("base", [5, 6, 7, 8], 3)
    assert sched.run()["base"] == peft_greedy(model_dir, None, [[5, 6, 7, 8]], 3)[0]
    assert runner.lora.batch(list(runner._requests.values()), [1] * len(runner._requests)) is None


def test_the_transformers_backend_refuses_lora_in_one_line(llama):
    model_dir, _ = llama
    with pytest.raises(UnsupportedModelError, match="--enable-lora runs on the native families only"):
        ModelRunner(str(model_dir), model_impl="transformers", lora=LoRAConfig())


def test_an_adapter_above_the_slots_rank_is_refused_naming_the_limit(llama):
    model_dir, adapters = llama
    runner = ModelRunner(str(model_dir), lora=LoRAConfig(max_loras=2, max_rank=4))
    sched = _on_slot_0(runner, adapter_message("a0", adapters[0], 1))
    with pytest.raises(LoRAAdapterError, match="rank 8 exceeds --max-lora-rank 4"):
        sched.step_once()


def test_a_worker_without_lora_refuses_a_lora_step(llama):
    model_dir, adapters = llama
    runner = ModelRunner(str(model_dir))
    with pytest.raises(ValueError, match="without --enable-lora"):
        runner.apply_lora_step(LoRAStep(step=0, prefetch=[adapter_message("a0", adapters[0])]))


def test_prefetched_adapters_are_read_in_the_background_and_the_least_recently_used_dropped(llama):
    model_dir, adapters = llama
    runner = ModelRunner(str(model_dir), lora=LoRAConfig(max_loras=1, max_rank=8, max_cpu_loras=2))
    messages = [adapter_message(f"a{i}", path, i + 1) for i, path in enumerate(adapters[:3])]
    runner.apply_lora_step(LoRAStep(step=0, prefetch=messages))
    host = runner.lora.host
    assert "a0" not in host and "a1" in host and "a2" in host
    read = host.get(messages[2])
    assert read.spec.rank == 8 and read.adapter == messages[2]
    assert all(a.dtype == b.dtype == torch.float32 for a, b in read.layers[1].values())


def test_a_re_registered_name_with_other_files_is_read_again(llama):
    model_dir, adapters = llama
    runner = _runner(model_dir)
    host = runner.lora.host
    first = host.get(adapter_message("same", adapters[0]))
    again = host.get(LoRAAdapter(name="same", lora_id=1, path=adapters[1], digest=adapter_message("x", adapters[1]).digest))
    assert first.spec.path != again.spec.path and again.spec.rank == 4


def test_adapters_on_a_quantized_checkpoint_decode_what_peft_decodes_on_its_dequantized_weights(tmp_path):
    """The delta is the adapter's whatever the base layer's format: added to the int4 layer's output."""
    from pagedserve.tools.quantized_model import build_quantized_model_dir, dequantized_model_dir

    model_dir = build_quantized_model_dir(tmp_path / "q", "w4a16", "llama")
    floats = dequantized_model_dir(model_dir, tmp_path / "f")
    adapter = make_adapter(floats, tmp_path / "a", 8, 16, ALL_TARGETS, seed=3)
    prompts = random_prompts([6, 13], vocab_size=512, seed=4)
    sched = TrivialScheduler(_runner(model_dir))
    assert sched.runner.model.layers[0].qkv.quantized is not None
    sched.load_lora(0, adapter_message("a", adapter))
    sched.add("adapted", prompts[0], NEW_TOKENS, lora_slot=0)
    sched.add("base", prompts[1], NEW_TOKENS, arrival_step=1)
    ours = sched.run()
    for name, with_adapter, prompt in (("adapted", adapter, prompts[0]), ("base", None, prompts[1])):
        theirs = peft_greedy(floats, with_adapter, [prompt], NEW_TOKENS)[0]  # generate() stops at EOS
        assert ours[name][:len(theirs)] == theirs and len(theirs) >= 4


def test_the_real_scheduler_drives_more_adapters_than_slots_through_the_runner(llama):
    """The scheduler's LoRASteps (slot loads, reuse once a slot's requests finish, prefix caching per
    adapter) applied by the runner: every request decodes what peft decodes with its adapter."""
    from pagedserve.protocol.messages import SamplingParams
    from pagedserve.tools.in_process_engine import generate

    model_dir, adapters = llama
    messages = [adapter_message(f"a{i}", path, i + 1) for i, path in enumerate(adapters)]
    prompt = random_prompts([12], vocab_size=512, seed=11)[0]
    prompts = [prompt, prompt, prompt[:9] + [7, 8], prompt, prompt, prompt[:5]]  # shared prefixes across adapters
    names = ["a0", "a1", "", "a2", "a3", "a1"]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    streams, _ = generate(str(model_dir), prompts, [greedy] * len(prompts), lora_adapters=messages,
                          lora_names=names, runner_options={"lora": LoRAConfig(max_loras=2, max_rank=8)},
                          max_loras=2, enable_prefix_caching=True)
    by_name = {m.name: m.path for m in messages}
    for i, (prompt_i, name) in enumerate(zip(prompts, names)):
        theirs = peft_greedy(model_dir, by_name.get(name), [prompt_i], NEW_TOKENS)[0]
        assert streams[(f"r{i}", 0)][:len(theirs)] == theirs, (i, name)
