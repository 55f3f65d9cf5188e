"""FP8 checkpoints (compressed-tensors' FP8_DYNAMIC and FP8 presets, float-quantized, as llm-compressor writes
them) on CPU: the weights dequantized at load (models/fp8_linear.py), each layer's input rounded through float8
as compressed-tensors' own forward rounds it (the same bits), so the model's hidden states are transformers' on
the same file up to the order of the sums; in bfloat16, close to float32's; the GPU's layer, float8 products
by torch._scaled_mm (run here on torch's CPU op), the reference of that arithmetic; the refusals of what the scheme
does not allow are config checks (test_quantized_models.py's BAD_CONFIGS). The native rounding pass
(kernels/cpu_fp8_round.c) gives the torch ops' bits."""

from __future__ import annotations

import pytest
import torch

from pagedserve.protocol.quantization import parse_quantization_config
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.models.fp8_linear import (FP8_MAX, fake_quantize_fp8, fake_quantize_fp8_torch, make_fp8,
                                                     scaled_mm_serves)
from pagedserve.worker_proc.models.linear import WeightLayout
from pagedserve.worker_proc.models.quantized_linear import QuantizedStack
from support.worker_harness import TrivialScheduler, final_states_beside_transformers, random_prompts

pytest.importorskip("compressed_tensors")
from pagedserve.tools.quantized_model import build_quantized_model_dir  # noqa: E402

# Teacher-forced on our own tokens, the final norm's output keeps at least this cosine with transformers' at
# every row (measured in float32: 1 - cosine ~1e-7, the float sums' order; an input rounded to the other side of
# a float8 step by that order moves it by ~1e-4 at most here).
MIN_COSINE = 0.9999


@pytest.fixture(scope="module", params=["fp8_dynamic", "fp8", "fp8_own_scales"])
def fp8_model(request, tmp_path_factory):
    """(case, model dir); "fp8_own_scales": the static file with each k_proj's input_scale 1.5x q's and v's (one
    calibration sees one input for the three; another tool could calibrate them apart)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp(request.param) / "m"
    scheme = "fp8" if request.param == "fp8_own_scales" else request.param
    model_dir = build_quantized_model_dir(path, scheme, "llama", initializer_range=0.02, seed=4)
    if request.param == "fp8_own_scales":
        file = next(model_dir.glob("*.safetensors"))
        tensors = load_file(str(file))
        for name in [n for n in tensors if n.endswith("k_proj.input_scale")]:
            tensors[name] = tensors[name] * 1.5
        save_file(tensors, str(file), metadata={"format": "pt"})
    return request.param, model_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_fake_quantization_is_compressed_tensors_forward(dtype):
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).input_activations
    x = (torch.randn(1, 37, 96, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    x[0, 3] = 0  # a zero row: the dtype's eps as its scale
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(96, 8))
    expected = fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args)
    assert torch.equal(fake_quantize_fp8(x[0]), expected[0]) and torch.equal(fake_quantize_fp8_torch(x[0]), expected[0])


@pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_native_pass_gives_torchs_bits(dtype):
    """kernels/cpu_fp8_round.c against the torch ops it replaces: rows over nine decades (float8's subnormals
    to its clamp), a zero row, dynamic, static, and a given row max (a tensor-parallel slice's)."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(9, 1000, generator=gen) * torch.logspace(-6, 3, 1000)).to(dtype)
    x[4] = 0
    row_max = (x.abs().amax(-1, keepdim=True) * 2).to(dtype)
    for static, given in ((None, None), (torch.tensor(0.0071), None), (None, row_max)):
        ours = cpu_native.fp8_round_rows(x, given, None if static is None else float(static))
        assert torch.equal(ours, fake_quantize_fp8_torch(x, static, given))


def test_static_fake_quantization_is_compressed_tensors_forward():
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = preset_name_to_scheme("FP8", ["Linear"]).input_activations
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(2)) * 3
    scale = torch.tensor([0.0071])  # inputs past 448 * scale clamp
    expected = fake_quantize(x=x, scale=scale, zero_point=torch.zeros(1, dtype=torch.float8_e4m3fn), args=args)
    assert torch.equal(fake_quantize_fp8(x, scale.reshape(())), expected)
    assert torch.equal(fake_quantize_fp8_torch(x, scale.reshape(())), expected)


def test_the_checkpoint_is_read_as_its_preset(fp8_model):
    scheme, model_dir = fp8_model
    import json

    spec = parse_quantization_config(json.loads((model_dir / "config.json").read_text()))
    assert spec.float8 and spec.float8_activations == ("token" if scheme == "fp8_dynamic" else "tensor")
    layer = ModelRunner(str(model_dir)).model.layers[0]
    for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
        assert {p.kind for p in proj.quantized.parts} == {"fp8"}
        if cpu_native.library() is not None:  # one byte a weight, widened in the native GEMV's registers
            assert {p.weight.quantized.kind for p in proj.quantized.parts} == {"fp8_blocks"}
    # q, k and v with scales of their own: one layer each, side by side; else one fused layer
    assert isinstance(layer.qkv.quantized, QuantizedStack) == (scheme == "fp8_own_scales")


def test_last_hidden_states_are_transformers_on_the_same_file(fp8_model):
    from transformers import AutoModelForCausalLM

    scheme, model_dir = fp8_model
    prompt = random_prompts([11], vocab_size=512, seed=2)[0]
    ours, theirs, tokens = final_states_beside_transformers(ModelRunner(str(model_dir)), model_dir, prompt, 16)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    print(scheme, "last hidden state cosine: min", cosine.min().item(), "; greedy tokens equal:",
          hf_tokens.tolist() == tokens)
    assert cosine.shape == (16,)
    assert cosine.min() >= MIN_COSINE, cosine.tolist()


def test_bfloat16_logits_stay_close_to_float32s(fp8_model):
    _, model_dir = fp8_model
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(str(model_dir), dtype=dtype)
        prompt = random_prompts([9], vocab_size=512, seed=5)[0]
        scheduler = TrivialScheduler(runner)
        scheduler.add("a", prompt, 1)
        captured = []
        compute_logits = runner.model.compute_logits
        runner.model.compute_logits = lambda h: captured.append(compute_logits(h).float()) or captured[-1]
        scheduler.run()
        logits[dtype] = captured[-1]
    error = (logits["bfloat16"] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    print("fp8 bfloat16 against float32: max logit error / max logit", error.item())
    assert error < 0.05


@pytest.mark.parametrize("activations", ["token", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_gpus_float8_layer_is_its_reference_and_the_cpus_within_rounding(activations, dtype):
    """make_fp8's torch._scaled_mm form (a GPU's; torch's CPU op here, slow but the same arithmetic): x
    quantized to float8 by the scheme's scale, the float8 products summed in float32, times both scales; and
    the dequantized form the CPU runs gives the same up to where each rounds (the same float8 x)."""
    gen = torch.Generator().manual_seed(8)
    values = (torch.randn(48, 64, generator=gen) * 40).to(torch.float8_e4m3fn).float()
    scale = torch.rand(48, 1, generator=gen) * 0.01 + 0.001
    static = torch.tensor(0.02) if activations == "tensor" else None
    x = torch.randn(5, 64, generator=gen).to(dtype)
    gpu_form = make_fp8(values, scale, dtype, WeightLayout(), activations, static, scaled_mm=True)
    cpu_form = make_fp8(values, scale, dtype, WeightLayout(), activations, static)
    assert gpu_form.kind == "fp8_scaled_mm" and gpu_form.float8_weight.dtype == torch.float8_e4m3fn
    assert cpu_form.kind == "fp8" and cpu_form.float8_weight is None
    if activations == "token":
        x_scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).float()
        xq = (x / x_scale.to(dtype)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        x_scale, xq = static, (x.float() / static).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    reference = ((xq.float() @ values.t()) * x_scale * scale.t()).to(dtype)
    ours = gpu_form.forward(x)
    torch.testing.assert_close(ours, reference, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(cpu_form.forward(x).float(), ours.float(), **tolerance)


def test_a_cpu_never_takes_the_float8_products_and_a_gpu_takes_them_where_the_op_can():
    assert not scaled_mm_serves(torch.device("cpu"), 64, 64, "token")
    assert scaled_mm_serves(torch.device("cuda"), 64, 64, "token")
    assert not scaled_mm_serves(torch.device("cuda"), 64, 60, "token")  # the op takes multiples of 16
    assert not scaled_mm_serves(torch.device("cuda"), 64, 64, None)  # weights only: dequantized
