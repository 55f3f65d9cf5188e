"""LoRA adapters on mixtures of experts: PEFT's adapters on the routed experts' fused parameters
(``target_parameters``, or expert ``target_modules`` PEFT converts to them), on a shared expert, a
dense layer's MLP and attention are read as PEFT writes them, and a batch mixing such adapters and
the base model decodes in process what transformers + peft decode (float32 greedy) for Qwen3-MoE,
Qwen2-MoE, Mixtral and gpt-oss; the torch reference loop a GPU step with expert adapters takes adds
the same deltas as the CPU grouped path; what cannot be served is refused in one line naming it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from pagedserve.kernels import moe_reference
from pagedserve.protocol.lora_adapter import LoRAAdapterError, expert_count, projection_shapes, read_adapter
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout
from pagedserve.worker_proc.models.lora_experts import ExpertLoRA
from pagedserve.worker_proc.models.lora_linear import LoRABatch, LoRAConfig
from pagedserve.worker_proc.models.moe import grouped_experts
from support.lora import adapter_message, make_adapter, peft_greedy
from support.worker_harness import TrivialScheduler, random_prompts

NEW_TOKENS = 8
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MODELS = {  # case -> (architecture, its config)
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=96)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=48, swiglu_limit=1.5, seed=4)),  # gate_up's columns interleaved
    # layer 0 a dense MLP, layer 1 the experts
    "qwen3_moe_dense_layer": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                                decoder_sparse_step=2, seed=1)),
}
# (rank, alpha, target_modules, target_parameters, rsLoRA): the experts alone; attention and down only
ADAPTERS = [(8, 16, (), EXPERTS, False), (4, 8, ("q_proj", "o_proj"), EXPERTS[1:], True)]
# One more adapter on a case's MLP linears: Qwen2-MoE's shared expert (and its experts' gate_up). Mixtral's and
# Qwen3-MoE's expert projections named as target_modules, which PEFT converts to the fused parameters,
# gate_up at twice the rank and alpha (a rank_pattern and an alpha_pattern in the saved config).
MLP = {"qwen2_moe": (4, 8, ("gate_proj", "up_proj", "down_proj"), EXPERTS[:1], False),
       "qwen3_moe_dense_layer": (4, 8, ("gate_proj", "up_proj", "down_proj"), (), False),
       "mixtral": (4, 8, ("w1", "w3", "w2"), (), False)}

_BUILT: dict = {}


def _adapted(case: str, root: Path) -> tuple[str, list[str]]:
    """A two-layer model of ``case`` and its adapters (one more on the MLP where it has linears), once."""
    if case not in _BUILT:
        from pagedserve.tools.demo_model import build_model_dir

        arch, config = MODELS[case]
        model = str(build_model_dir(root / "model", arch, num_layers=2, **config))
        specs = ADAPTERS + ([MLP[case]] if case in MLP else [])
        _BUILT[case] = model, [make_adapter(model, str(root / f"a{i}"), r, alpha, targets, seed=10 + i,
                                            rslora=rslora, parameters=params)
                               for i, (r, alpha, targets, params, rslora) in enumerate(specs)]
    return _BUILT[case]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _adapted("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _model_cfg(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def _read(adapter: str, model: str):
    cfg = _model_cfg(model)
    return read_adapter(adapter, 16, projection_shapes(cfg), cfg["num_hidden_layers"], expert_count(cfg))


def _assert_mix_decodes_what_peft_decodes(runner: ModelRunner, model: str, adapters: list[str]) -> None:
    """Six requests over the adapters' slots (two sharing slots 0 and 1) and the base model, prompts
    arriving over steps, one prefilled in chunks: each request's tokens are peft's with its adapter."""
    sched = TrivialScheduler(runner)
    for slot, path in enumerate(adapters):
        sched.load_lora(slot, adapter_message(f"a{slot}", path, slot + 1))
    prompts = random_prompts([7, 19, 4, 11, 9, 13], vocab_size=512, seed=3)
    slots = [0, 1, -1, 0, len(adapters) - 1, 1]
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, NEW_TOKENS, lora_slot=slots[i], arrival_step=i // 2,
                  prefill_chunks=[5] if i == 1 else None)
    ours = sched.run()
    expected = {i: peft_greedy(model, adapters[s] if s >= 0 else None, [prompts[i]], NEW_TOKENS)[0]
                for i, s in enumerate(slots)}
    assert {i: ours[f"r{i}"] for i in expected} == expected
    base = {i: peft_greedy(model, None, [prompts[i]], NEW_TOKENS)[0] for i in expected}
    assert all(expected[i] != base[i] for i, s in enumerate(slots) if s >= 0)  # every adapter changes tokens


@pytest.mark.parametrize("case", list(MODELS))
def test_a_batch_mixing_expert_adapters_and_the_base_model_decodes_what_peft_decodes(case, tmp_path_factory):
    model, adapters = _adapted(case, tmp_path_factory.mktemp(case))
    _assert_mix_decodes_what_peft_decodes(ModelRunner(model, lora=LoRAConfig(max_loras=4, max_rank=8)), model, adapters)


def test_expert_adapters_on_native_panels_decode_what_peft_decodes(tmp_path_factory, monkeypatch):
    """Where the experts take cpu_linear.c's panels (AVX2 without AVX-512, or the switch): with LoRA no
    gate_up is packed for the fused SiLU gate, so a delta joins gate and up before the gate."""
    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models import linear

    if not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here (it needs AVX2 and FMA, and a C compiler)")
    monkeypatch.setenv(linear.NATIVE_ENV, "1")
    monkeypatch.setattr(linear, "CACHE_RESIDENT_MAX_BYTES", 0)
    model, adapters = _adapted("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))
    runner = ModelRunner(model, lora=LoRAConfig(max_loras=4, max_rank=8))
    block = runner.model.layers[0].moe
    assert block.experts[0][0].panels is not None and block.experts[0][0].gate_size == 0
    assert block.shared[0].panels is not None and block.shared[0].gate_size == 0
    _assert_mix_decodes_what_peft_decodes(runner, model, adapters)


def test_peft_expert_adapters_are_read_as_peft_writes_them(qwen3):
    """A [r * E, in] and B [out, r * E] per fused parameter; two parameters' nested wrappers
    (``experts.base_layer.lora_A``: gate_up, wrapped first) told apart as PEFT nests them."""
    model, (both, down_only) = qwen3
    spec = _read(both, model)
    assert spec.target_modules == ("experts.down_proj", "experts.gate_up_proj") and spec.rank == 8
    assert spec.tensors[(0, "experts.gate_up_proj", "A")][1] == (8 * 8, 64)
    assert spec.tensors[(0, "experts.gate_up_proj", "B")][1] == (2 * 48, 8 * 8)
    assert spec.tensors[(1, "experts.down_proj", "A")][1] == (8 * 8, 48)
    assert spec.tensor_names[(0, "experts.gate_up_proj", "A")].endswith("mlp.experts.base_layer.lora_A.weight")
    alone = _read(down_only, model)
    assert alone.target_modules == ("experts.down_proj", "o_proj", "q_proj")
    assert alone.tensor_names[(0, "experts.down_proj", "B")].endswith("mlp.experts.lora_B.weight")
    assert alone.scaling == pytest.approx(8 / 4 ** 0.5)  # rsLoRA, per expert's rank


def test_expert_target_modules_peft_converts_are_read_as_peft_applies_them(tmp_path_factory):
    """target_modules w1 / w3 / w2 on Mixtral: PEFT targets the fused parameters instead, gate_up at
    rank 2r and alpha 2 alpha (its saved rank_pattern / alpha_pattern), down at r."""
    model, adapters = _adapted("mixtral", tmp_path_factory.mktemp("mixtral"))
    config = json.loads((Path(adapters[2]) / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8}
    assert config["alpha_pattern"] == {r".*\.gate_up_proj": 16}
    spec = _read(adapters[2], model)
    assert spec.target_modules == ("experts.down_proj", "experts.gate_up_proj") and spec.rank == 8
    assert spec.modules[(0, "experts.gate_up_proj")] == (8, 2.0)
    assert spec.modules[(0, "experts.down_proj")] == (4, 2.0)
    assert spec.tensors[(1, "experts.gate_up_proj", "A")][1] == (8 * 4, 64)


def _edited(adapter: str, tmp_path: Path, config: dict = None, rename: tuple[str, str] = None) -> str:
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if rename is not None:
        file = out / "adapter_model.safetensors"
        tensors = safetensors.torch.load_file(file)
        safetensors.torch.save_file({k.replace(*rename): v for k, v in tensors.items()}, file)
    return str(out)


@pytest.mark.parametrize("config, rename, reason", [
    ({"target_parameters": ["mlp.gate.weight"]}, None,
     "target_parameters entry 'mlp.gate.weight' is not served (only the mixture-of-experts parameters"),
    ({"target_parameters": None}, None, "adapts the experts, but target_parameters names none of their parameters"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, None, "adapts the experts, but target_parameters names 1"),
    (None, ("experts.base_layer.", "experts.0.gate_proj."), "single experts' modules (transformers 4's experts.N.*)"),
    (None, ("mlp.experts.base_layer.", "mlp.gate."), "module 'gate' is not supported"),
    ({"rank_pattern": {r".*\.gate_up_proj": 4}}, None,
     "experts.gate_up_proj lora_A has 16 experts of r=4; the base model has 8"),
])
def test_expert_adapters_that_cannot_be_served_are_refused_by_name(qwen3, tmp_path, config, rename, reason):
    model, (both, _) = qwen3
    with pytest.raises(LoRAAdapterError, match=re.escape(reason)):
        _read(_edited(both, tmp_path, config, rename), model)


def test_a_rank_pattern_beyond_the_experts_is_refused_and_one_that_names_no_module_is_harmless(qwen3, tmp_path):
    model, (both, down_only) = qwen3
    with pytest.raises(LoRAAdapterError, match=re.escape("rank_pattern 'q_proj' on q_proj is not supported")):
        _read(_edited(down_only, tmp_path, {"rank_pattern": {"q_proj": 2}}), model)
    assert _read(_edited(both, tmp_path / "both", {"rank_pattern": {"q_proj": 2}}), model).rank == 8


def test_an_expert_adapter_of_another_model_is_refused(qwen3, model_factory):
    _, (both, _) = qwen3
    fewer = model_factory("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    with pytest.raises(LoRAAdapterError, match=r"has 8 experts of r=8; the base model has 4"):
        _read(both, fewer)
    dense = model_factory("qwen3")
    with pytest.raises(LoRAAdapterError, match=r"module 'experts\.(gate_up|down)_proj' is not a projection of this"):
        _read(both, dense)


def test_a_dense_mlp_adapter_on_a_model_whose_every_mlp_is_experts_is_refused_before_it_loads(model_factory,
                                                                                            tmp_path):
    """Mixtral has no dense gate/up/down: a Mistral adapter on them is refused where it is read."""
    mistral = model_factory("mistral")
    adapter = make_adapter(mistral, str(tmp_path / "mistral"), r=4, alpha=8, targets=("q_proj", "gate_proj"))
    mixtral = model_factory("mixtral", **MODELS["mixtral"][1])
    with pytest.raises(LoRAAdapterError, match=r"module 'gate_proj' is not a projection of this model"):
        _read(adapter, mixtral)
    assert _read(adapter, mistral).target_modules == ("gate_proj", "q_proj")


def _weights(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * 0.3


def _merged(w: torch.Tensor, pair) -> torch.Tensor:
    """W + B @ A per expert (the scaling is in B), or W for a module the adapter leaves alone."""
    return w if pair is None else w + pair[1] @ pair[0]


MIXED = [0, 1, -1, 2, 0, 1, 1, -1, 0, 2, 2, 0]


@pytest.mark.parametrize("token_slots", [MIXED, [1] * 12, [-1] * 6 + [1] * 6, [-1] * 12],
                         ids=["slots mixed in each expert", "one slot of rank 2 of 4", "base and one slot", "base"])
def test_the_reference_loop_adds_the_deltas_the_grouped_cpu_path_adds_and_both_equal_merged_weights(token_slots):
    """Each token through its routed experts with W + scaling * B @ A of its own slot (PEFT's merged
    weights, float64): the CPU grouped path and the reference loop (a GPU step's) alike, whether an
    expert's rows mix slots (masked), are one slot's (that slot's weights alone) or the base model's."""
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, num_experts, top_k, max_rank = 12, 16, 8, 4, 2, 4
    gate_up = _weights(num_experts, 2 * inter, hidden, generator=g)
    down = _weights(num_experts, hidden, inter, generator=g)
    x = _weights(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    lora = ExpertLoRA(num_experts, hidden, inter, LoRAConfig(max_loras=3, max_rank=max_rank), torch.float64,
                      torch.device("cpu"))
    ranks = (4, 2, 3)
    merged = {}  # slot -> (gate_up, down) with the adapter merged, as PEFT computes it
    for slot, r in enumerate(ranks):
        targets = {"experts.gate_up_proj": (_weights(num_experts, r, hidden, generator=g),
                                            _weights(num_experts, 2 * inter, r, generator=g)),
                   "experts.down_proj": (_weights(num_experts, r, inter, generator=g),
                                         _weights(num_experts, hidden, r, generator=g))}
        if slot == 2:
            del targets["experts.gate_up_proj"]  # down alone
        lora.load(slot, targets)
        merged[slot] = (_merged(gate_up, targets.get("experts.gate_up_proj")),
                        _merged(down, targets.get("experts.down_proj")))
    batch = LoRABatch.build(torch.tensor(token_slots), torch.device("cpu"), 3, max_rank, torch.float64, ranks,
                            path="segments")
    deltas = lora.deltas(batch)

    expected = torch.zeros_like(x)
    for t in range(tokens):
        gu, dn = merged[token_slots[t]] if token_slots[t] >= 0 else (gate_up, down)
        for k in range(top_k):
            e = int(ids[t, k])
            gate, up = (gu[e] @ x[t]).split(inter)
            expected[t] += weights[t, k] * (dn[e] @ (torch.nn.functional.silu(gate) * up))

    reference = moe_reference.fused_moe(x, gate_up, down, weights, ids, deltas=deltas)
    experts = [(LinearWeight.of(gate_up[e], None, WeightLayout()), LinearWeight.of(down[e], None, WeightLayout()))
               for e in range(num_experts)]
    grouped = grouped_experts(x, experts, weights, ids, TorchElementwise(), deltas=deltas)
    torch.testing.assert_close(reference, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grouped, expected, rtol=1e-10, atol=1e-10)
    base = moe_reference.fused_moe(x, gate_up, down, weights, ids)
    assert torch.allclose(base, expected) == (max(token_slots) < 0)
