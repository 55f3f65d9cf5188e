"""Quantized checkpoints (compressed-tensors) on CPU: each op against its plain-torch reference,
greedy tokens against transformers loading the same file, and every bad checkpoint refused in one line.

The checkpoints are made by compressed-tensors itself (tools/quantized_model.py). transformers
decompresses them to float weights, so for the weight-only schemes (computed in float32) its
greedy tokens are the oracle; an asymmetric pack-quantized file, which transformers 5.25 cannot
load, is checked against the float model the library's decompressor makes of it. W8A8 quantizes
activations too, which transformers does not: it is held to a bound on the last hidden state.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.kernels import cpu_quantized
from pagedserve.protocol.quantization import (QuantizationConfigError, check_shapes, parse_quantization_config,
                                              projection_inputs)
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models import quantized_linear as ql
from pagedserve.worker_proc.models.quantized_linear import (make_int4, make_int8, make_w8a8, quantize_per_token,
                                                            reference)
from support.worker_harness import final_states_beside_transformers, hf_greedy, random_prompts, staggered_greedy

pytest.importorskip("compressed_tensors")
from pagedserve.tools.quantized_model import build_quantized_model_dir, dequantized_model_dir  # noqa: E402

NEW_TOKENS = 14
PROMPT_LENGTHS = [5, 19, 33, 9]


def _random_q(bits, n, k, group, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    groups = k // group if group else 1
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(lo, hi + 1, (n, groups), generator=g, dtype=torch.int8) if asym else None
    return q, scale, zero


# ---------------------------------------------------------------- each op against its reference

OPS = {  # (bits, group, asymmetric)
    "int4_g128": (4, 128, False), "int4_g32_asym": (4, 32, True), "int4_per_channel": (4, None, False),
    "int8_per_channel": (8, None, False), "int8_per_channel_asym": (8, None, True),
    "int8_g128": (8, 128, False), "int8_g64_asym": (8, 64, True),
}


@pytest.mark.parametrize("path", ["torch_op", "dequantized_for_the_call"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_each_weight_only_op_equals_the_dequantized_weights_matmul(op, dtype, path, monkeypatch):
    bits, group, asym = OPS[op]
    n, k = 128, 256
    q, scale, zero = _random_q(bits, n, k, group, asym)
    make = make_int4 if bits == 4 else make_int8
    layer = make(q, scale, zero, group, dtype)
    assert layer.weight.dtype in (torch.uint8, torch.int8)  # the integers as stored, no float copy
    assert layer.can_dequantize()
    monkeypatch.setattr(ql, "dequantize_min_rows", lambda kind, dtype: 10**9 if path == "torch_op" else 1)
    for rows in (1, 3, 8, 37):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got, want = layer.forward(x), reference(q, scale, zero, group, x.float())
        assert got.dtype == dtype and got.shape == (rows, n)
        # float32: the same products summed in another order; bfloat16: scales and output rounded
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got.float() - want).abs().max() <= tol * want.abs().max(), op


def test_an_int4_weight_whose_rows_are_not_whole_blocks_of_64_keeps_torchs_op(monkeypatch):
    monkeypatch.setattr(ql, "int8_blocks_kernel", lambda: False)  # torch's int4 layout: no native kernel here
    q, scale, _ = _random_q(4, 96, 256, 128, False)
    layer = make_int4(q, scale, None, 128, torch.float32)
    assert not layer.can_dequantize()
    x = torch.randn(40, 256)
    assert (layer.forward(x) - reference(q, scale, None, 128, x)).abs().max() < 1e-4 * x.abs().max() * 256


def test_float32_dequantized_weights_are_the_ones_compressed_tensors_decompresses(tmp_path):
    """So a float32 prompt's products are transformers' own, bit for bit."""
    from safetensors.torch import load_file

    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama")
    floats = load_file(str(dequantized_model_dir(model_dir, tmp_path / "f") / "model.safetensors"))
    runner = ModelRunner(str(model_dir))
    down = runner.model.layers[1].down.quantized
    assert torch.equal(down.dequantized(torch.float32), floats["model.layers.1.mlp.down_proj.weight"])


def test_w8a8_sums_int8_products_exactly_in_int32_then_scales_them():
    n, k = 80, 320
    q, scale, _ = _random_q(8, n, k, None, False)
    layer = make_w8a8(q, scale)
    for rows in (1, 4, 17, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        xq, x_scale = quantize_per_token(x)
        acc = torch._int_mm(xq, q.t().contiguous())  # the path without native kernels
        assert acc.dtype == torch.int32
        assert torch.equal(acc.long(), xq.long() @ q.long().t())  # exact, no rounding anywhere
        assert torch.equal(layer.forward(x), reference(q, scale, None, None, x, dynamic_int8=True))
    # compressed-tensors' own per-token quantizer gives the same integers
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    x = torch.randn(5, k)
    xq, x_scale = quantize_per_token(x)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    theirs = quantize(x, x_scale, torch.zeros_like(x_scale), args, dtype=torch.int8)
    assert torch.equal(xq, theirs)


# ---------------------------------------------------------------- models against transformers


def _greedy(model_dir, prompts, **runner_kwargs):
    runner = ModelRunner(str(model_dir), **runner_kwargs)
    return runner, staggered_greedy(runner, prompts, NEW_TOKENS)


INT4_KIND = "int4_blocks" if ql.int8_blocks_kernel() else "int4"  # kernels/cpu_gemv_int4.c where it is built
INT8_CHANNEL_KIND = "int8_blocks" if ql.int8_blocks_kernel() else "int8"  # one block a row: kernels/cpu_gemv_int8.c
MODELS = {  # scheme, arch, the kind every projection runs, oracle from the library's decompressor
    "w4a16": ("w4a16", "llama", INT4_KIND, False),
    "w4a16_qwen2_bias": ("w4a16", "qwen2", INT4_KIND, False),
    "w8a16_per_channel": ("w8a16", "qwen3", INT8_CHANNEL_KIND, False),
    "w8a16_g128": ("w8a16_g128", "llama", "int8_blocks" if ql.int8_blocks_kernel() else "int8_grouped", False),
    "w4a16_asym": ("w4a16_asym", "llama", INT4_KIND, True),
    "w8a16_asym": ("w8a16_asym", "qwen2", "int8", True),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_weight_only_greedy_tokens_equal_transformers_on_the_same_file(tmp_path, case):
    scheme, arch, kind, decompressed_oracle = MODELS[case]
    model_dir = build_quantized_model_dir(tmp_path / case, scheme, arch, seed=len(case))
    oracle = dequantized_model_dir(model_dir, tmp_path / "oracle") if decompressed_oracle else model_dir
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    runner, got = _greedy(model_dir, prompts)
    for layer in runner.model.layers:
        for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert proj.quantized is not None and proj.quantized.kind == kind
            # nothing float of the weight is kept beside its integers
            assert proj.weight is None and proj.weight_t is None and proj.packed is None and proj.panels is None
    assert runner.model.lm_head.quantized is None  # lm_head is in the config's ignore list
    assert ql.describe_ops(runner.model.layers).startswith(f"{kind}: ")  # the worker's log names the op
    if kind == "int4_blocks":  # and the instructions it multiplies with (vdpbf16ps for bfloat16 x, here)
        assert f"({cpu_quantized.gemv_int4_variant()}" in ql.describe_ops(runner.model.layers)
    expected = hf_greedy(str(oracle), prompts, NEW_TOKENS)
    for ours, theirs in zip(got, expected):
        assert len(theirs) >= 12 and ours[: len(theirs)] == theirs


def test_a_layer_the_config_ignores_keeps_its_float_weight(tmp_path):
    """llm-compressor's ignore list can leave whole projections in float: they take the float path."""
    from safetensors.torch import load_file, save_file

    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama")
    float_dir = dequantized_model_dir(model_dir, tmp_path / "float")
    tensors = load_file(str(model_dir / "model.safetensors"))
    floats = load_file(str(float_dir / "model.safetensors"))
    for name in ("q_proj", "k_proj", "v_proj"):  # layer 1's attention, dequantized as the library does it
        prefix = f"model.layers.1.self_attn.{name}"
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            tensors.pop(f"{prefix}.{suffix}")
        tensors[f"{prefix}.weight"] = floats[f"{prefix}.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=3)
    runner, got = _greedy(model_dir, prompts)
    assert runner.model.layers[1].qkv.quantized is None and runner.model.layers[1].o_proj.quantized is not None
    assert got == [e for e in hf_greedy(str(float_dir), prompts, NEW_TOKENS)]


HEAD_KINDS = {"w4a16": INT4_KIND, "w8a16_g128": "int8_blocks" if ql.int8_blocks_kernel() else "int8_grouped"}


@pytest.mark.parametrize("scheme", list(HEAD_KINDS))
def test_a_quantized_lm_head_runs_as_its_integer_layer_and_greedy_tokens_equal_transformers(tmp_path, scheme):
    """A recipe without ``ignore: ["lm_head"]`` stores lm_head.weight_packed (or an int8 weight): the logits
    of the sampled rows come from its integers, and the tokens are transformers' on the same file."""
    model_dir = build_quantized_model_dir(tmp_path / scheme, scheme, "llama", quantize_lm_head=True, seed=7)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=7)
    runner, got = _greedy(model_dir, prompts)
    head = runner.model.lm_head
    assert head.quantized is not None and head.quantized.kind == HEAD_KINDS[scheme]
    assert head.weight is None and head.weight_t is None and head.packed is None and head.panels is None
    expected = hf_greedy(str(model_dir), prompts, NEW_TOKENS)
    for ours, theirs in zip(got, expected):
        assert len(theirs) >= 12 and ours[: len(theirs)] == theirs


def test_a_tied_models_quantized_lm_head_is_its_own_and_the_embeddings_stay_float(tmp_path):
    """llm-compressor unties a tied pair to quantize lm_head: the file holds lm_head.weight_packed beside the
    float embeddings, under ``tie_word_embeddings: true``. The engine serves both as stored: the lookup from
    the float rows, the logits from the integers. transformers cannot load that file tied, so the oracle is
    the same tensors under an untied config."""
    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama", quantize_lm_head=True,
                                          tie_word_embeddings=True, seed=8)
    oracle = tmp_path / "untied"
    shutil.copytree(model_dir, oracle)
    config = json.loads((oracle / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    (oracle / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=8)
    runner, got = _greedy(model_dir, prompts)
    assert runner.model.lm_head.quantized is not None and runner.model.embed_tokens.dtype == torch.float32
    expected = hf_greedy(str(oracle), prompts, NEW_TOKENS)
    for ours, theirs in zip(got, expected):
        assert len(theirs) >= 12 and ours[: len(theirs)] == theirs


def test_a_quantized_lm_head_in_bfloat16_stays_close_to_the_float32_logits(tmp_path):
    """In half precision the same integer layer runs the decode rows (the int4 GEMV): its logits track
    the float32 engine's within bfloat16's rounding of the activations."""
    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama", quantize_lm_head=True, seed=9)
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model = ModelRunner(str(model_dir), dtype=dtype).model
        assert model.lm_head.quantized.kind == INT4_KIND
        logits[dtype] = model.compute_logits(hidden.to(getattr(torch, dtype)))
    error = (logits["bfloat16"] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    print("bfloat16 quantized lm_head: max logit error / max logit", error.item())
    assert error < 0.02


W8A8_MIN_COSINE = 0.999


def test_a_w8a8_lm_head_computes_the_logits_in_int8_as_the_reference_arithmetic_does(tmp_path):
    """A W8A8 recipe that keeps lm_head in its targets: the logits come from the int8 layer (each row's
    activations rounded to int8, int32 sums, both scales), equal to the torch reference of that same
    arithmetic, and within the int8 rounding of the dequantized float product (cosine >= W8A8_MIN_COSINE)."""
    model_dir = build_quantized_model_dir(tmp_path / "m", "w8a8", "llama", quantize_lm_head=True,
                                          initializer_range=0.02, seed=10)
    model = ModelRunner(str(model_dir)).model
    head = model.lm_head.quantized
    assert head is not None and head.kind == "w8a8"
    hidden = torch.randn(5, 128, generator=torch.Generator().manual_seed(10))
    logits = model.compute_logits(hidden)
    normed = model.final_norm(hidden.clone())
    stored = load_file(next(model_dir.glob("*.safetensors")))
    q, scale = stored["lm_head.weight"], stored["lm_head.weight_scale"].reshape(-1)
    torch.testing.assert_close(logits, ql.reference(q, scale, None, None, normed, dynamic_int8=True).float(),
                               rtol=1e-5, atol=1e-5)
    cosine = torch.nn.functional.cosine_similarity(logits, normed @ (q.float() * scale[:, None]).t(), dim=-1)
    assert cosine.min() >= W8A8_MIN_COSINE


def test_w8a8_last_hidden_states_stay_close_to_the_dequantized_float_model(tmp_path):
    """transformers runs the dequantized weights on float activations; W8A8 rounds each token's
    activations to int8 before every projection. Teacher-forced on our own tokens, the final
    norm's output at every sampled row keeps a cosine >= W8A8_MIN_COSINE with transformers'
    (measured 0.99988 min, 0.99991 mean over these 16 rows, weights of std 0.02: 1 - cosine
    ~8x inside the bound)."""
    model_dir = build_quantized_model_dir(tmp_path / "m", "w8a8", "llama", initializer_range=0.02)
    runner = ModelRunner(str(model_dir))
    assert runner.model.layers[0].qkv.quantized.kind == "w8a8"
    if ql.w8a8_kernel():  # the MLP's SiLU gate in gate_up's epilogue
        assert runner.model.layers[0].gate_up.quantized.gate_size == runner.model.layers[0].intermediate
    prompt = random_prompts([11], vocab_size=512, seed=2)[0]
    ours, theirs, _ = final_states_beside_transformers(runner, model_dir, prompt, 16)
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    print("w8a8 last hidden state cosine: min", cosine.min().item(), "mean", cosine.mean().item())
    assert cosine.shape == (16,)
    assert cosine.min() >= W8A8_MIN_COSINE, cosine.tolist()


# ---------------------------------------------------------------- refusals, each one line


def _config(**weights):
    args = dict(num_bits=4, type="int", symmetric=True, group_size=128, strategy="group", dynamic=False) | weights
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}}


BAD_CONFIGS = {
    "not_an_object": ({"quantization_config": "w4a16"}, "must be an object"),
    "another_method": ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    "no_groups": ({"quantization_config": {"quant_method": "compressed-tensors"}}, "config_groups"),
    "three_bits": (_config(num_bits=3), "3-bit"),
    "nf4_weights": (_config(type="nf4"), "type 'nf4'"),
    "float8_in_groups": (_config(type="float", num_bits=8), "float8 weights.strategy 'group'"),
    "float4_weights": (_config(type="float", num_bits=4, strategy="channel", group_size=None), "4-bit float"),
    "asymmetric_float8": (_config(type="float", num_bits=8, strategy="channel", group_size=None, symmetric=False),
                          "asymmetric float8"),
    "float8_packed": (_config(type="float", num_bits=8, strategy="channel", group_size=None), "does not hold float8"),
    "odd_int4_group": (_config(group_size=100), "groups of 100"),
    "group_zero": (_config(group_size=0), "positive integer"),
    "tensor_strategy": (_config(strategy="tensor", group_size=None), "strategy 'tensor'"),
    "activation_order": (_config(actorder="group"), "activation ordering"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_quantization_config_is_refused_in_one_line(case):
    config, words = BAD_CONFIGS[case]
    with pytest.raises(QuantizationConfigError, match=words) as err:
        parse_quantization_config(config)
    assert "\n" not in str(err.value)


def test_targets_that_name_lm_head_are_read_and_other_modules_refused():
    """A recipe may list its targets by name (``re:`` patterns of projections, ``lm_head``); anything else it
    names (an embedding, a norm) is no Linear layer this engine quantizes."""
    config = _config()
    scheme = config["quantization_config"]["config_groups"]["group_0"]
    scheme["targets"] = ["re:.*proj$", "lm_head"]
    assert parse_quantization_config(config).bits == 4
    scheme["targets"] = ["re:.*proj$", "model.embed_tokens"]
    with pytest.raises(QuantizationConfigError, match="targets .* are not supported"):
        parse_quantization_config(config)


def test_quantization_option_must_match_the_checkpoint():
    assert parse_quantization_config(_config(), "compressed-tensors").bits == 4
    with pytest.raises(QuantizationConfigError, match="not quantized"):
        parse_quantization_config({}, "compressed-tensors")
    with pytest.raises(QuantizationConfigError, match="not supported"):
        parse_quantization_config(_config(), "fp8")
    with pytest.raises(QuantizationConfigError, match="does not match the checkpoint's quant_method 'compressed"):
        parse_quantization_config(_config(), "awq")


def test_shapes_that_do_not_divide_into_groups_or_tensor_parallel_slices_are_refused():
    spec = parse_quantization_config(_config())
    qwen_05b = dict(hidden_size=896, num_attention_heads=14, intermediate_size=4864)
    check_shapes(spec, projection_inputs(qwen_05b), 1)
    with pytest.raises(QuantizationConfigError, match="o_proj's 896 inputs split 2 ways cut a group"):
        check_shapes(spec, projection_inputs(qwen_05b), 2)  # 448 per rank: 3.5 groups of 128
    with pytest.raises(QuantizationConfigError, match="q_proj has 200 inputs, not a multiple of group_size 128"):
        check_shapes(spec, projection_inputs(dict(hidden_size=200, num_attention_heads=4, intermediate_size=256)), 1)


def test_serve_refuses_a_quantized_model_whose_tensor_parallel_slices_cut_groups_before_starting(tmp_path):
    from pagedserve.deploy.serve_config import ConfigError, ServeConfig

    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama")  # o_proj: 128 inputs
    cfg = ServeConfig(model=str(model_dir), device="cpu", quantization="compressed-tensors")
    worker_cmd = cfg.worker_cmd("run", replica=0, rank=0, dist_init=None)
    assert worker_cmd[worker_cmd.index("--quantization") + 1] == "compressed-tensors"
    with pytest.raises(ConfigError, match="split 2 ways cut a group") as err:
        ServeConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not quantized"):
        ServeConfig(model=str(dequantized_model_dir(model_dir, tmp_path / "f")), device="cpu",
                    quantization="compressed-tensors")


def test_the_worker_refuses_a_corrupt_tensor_in_one_line_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama")
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].contiguous()  # one group's scale for 256 inputs
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="down_proj.weight_scale has shape") as err:
        ModelRunner(str(model_dir))
    assert "\n" not in str(err.value)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = "four"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'four'-bit weights are not supported"):
        ModelRunner(str(broken))


def test_a_gpu_serves_fp8_and_weight_only_integers_and_refuses_the_rest_before_starting(tmp_path):
    """FP8 (torch._scaled_mm) and weight-only int4 / int8 (Triton) run on a GPU; W8A8 int8 and GGUF's types are
    refused by serve's check, in one line, before any process starts."""
    from pagedserve.deploy.serve_config import ConfigError, ServeConfig
    from pagedserve.protocol.gguf_file import quantization_spec as gguf_spec
    from pagedserve.protocol.quantization import gpu_serves

    fp8 = _config(type="float", num_bits=8, strategy="channel", group_size=None)
    fp8["quantization_config"]["format"] = "float-quantized"
    assert gpu_serves(parse_quantization_config(fp8)) and gpu_serves(parse_quantization_config(_config()))
    assert not gpu_serves(gguf_spec("Q4_K"))
    ServeConfig(model=str(build_quantized_model_dir(tmp_path / "w4a16", "w4a16", "llama")), device="cuda")
    with pytest.raises(ConfigError, match="runs on CPU only") as err:
        ServeConfig(model=str(build_quantized_model_dir(tmp_path / "w8a8", "w8a8", "llama")), device="cuda")
    assert "\n" not in str(err.value)
