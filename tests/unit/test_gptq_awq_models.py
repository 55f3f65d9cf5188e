"""GPTQ and AWQ checkpoints on CPU: the formats' packing held to the libraries' own dequantize code, the
engine's reader (whole and per tensor-parallel slice) to the same, a layer in activation order to its
plain-torch product, greedy tokens to transformers on the dequantized float32 model, and every bad
checkpoint refused in one line.

The checkpoints are written by tools/gptq_awq_model.py (GPTQModel and AutoAWQ do not install here); the
oracle's weights come from tests/support/gptq_awq_reference.py, the libraries' unpacking transcribed.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagedserve.protocol.quantization import (QuantizationConfigError, check_shapes, parse_quantization_config,
                                              projection_inputs)
from pagedserve.tools.gptq_awq_model import (awq_config, build_gptq_awq_model_dir, gptq_config, pack_awq, pack_gptq)
from pagedserve.worker_proc.gptq_awq_weights import packed_reader
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models import quantized_linear as ql
from pagedserve.worker_proc.models.quantized_linear import make_int4, make_int8, reference
from pagedserve.worker_proc.weights import WeightSource
from support.gptq_awq_reference import awq_dequantize, dequantize, dequantized_model_dir, gptq_dequantize
from support.oracle import hf_greedy
from support.worker_harness import random_prompts, staggered_greedy

NEW_TOKENS = 14
PROMPT_LENGTHS = [5, 19, 33, 9]


def _random_ints(bits, n, k, group, seed=0, min_zero=0):
    """Unsigned values over the whole range, zero points over the format's, fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    groups = k // (group or k)
    q = torch.randint(0, maxq + 1, (n, k), generator=g)
    zero = torch.randint(min_zero, maxq + 1, (n, groups), generator=g)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    return q, zero, scale


def _plain_weight(q, zero, scale, g_idx):
    """(q - zero) * scale per input's group, float32 [out, in]: what the formats mean."""
    return (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]


# ---------------------------------------------------------------- the formats, against the libraries

FORMATS = {  # method, bits, group, GPTQ checkpoint_format, desc_act
    "gptq_v1_w4_g32": ("gptq", 4, 32, "gptq", False), "gptq_v2_w4_g32_desc_act": ("gptq", 4, 32, "gptq_v2", True),
    "gptq_v1_w8_g64": ("gptq", 8, 64, "gptq", False), "gptq_v2_w8_per_channel": ("gptq", 8, None, "gptq_v2", False),
    "awq_w4_g32": ("awq", 4, 32, None, False), "awq_w4_per_channel": ("awq", 4, None, None, False),
}


@pytest.mark.parametrize("case", list(FORMATS))
def test_the_writers_tensors_dequantize_by_the_libraries_code_to_the_integers_written(case):
    method, bits, group, fmt, desc_act = FORMATS[case]
    n, k = 48, 128
    q, zero, scale = _random_ints(bits, n, k, group, seed=len(case), min_zero=1 if fmt == "gptq" else 0)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(1)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // (group or k)
    if method == "gptq":
        t = pack_gptq(q, scale, zero, g_idx, bits, fmt)
        theirs = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, fmt)
    else:
        t = pack_awq(q, scale, zero)
        theirs = awq_dequantize(t["qweight"], t["qzeros"], t["scales"], bits, group or k)
    assert all(w.dtype == torch.int32 for name, w in t.items() if name != "scales")
    assert torch.equal(theirs, _plain_weight(q, zero, scale, g_idx))


def test_a_word_holds_its_values_where_each_format_puts_them():
    """Pinned by hand, apart from both the writer and the references: GPTQ's inputs 0..7 from the lowest
    nibble up; AWQ's outputs in the nibble order 0, 2, 4, 6, 1, 3, 5, 7; GPTQ v1's zero points less one."""
    rising = torch.arange(1, 9).reshape(1, 8)  # GPTQ: [out, in], input i has the value i + 1
    gptq = pack_gptq(rising.expand(8, 8), torch.ones(8, 1).half(), torch.full((8, 1), 9),
                     torch.zeros(8, dtype=torch.int64), 4, "gptq")
    assert gptq["qweight"].tolist() == [[0x87654321 - (1 << 32)] * 8]
    assert gptq["qzeros"].tolist() == [[0x88888888 - (1 << 32)]]  # 9, stored as 8
    awq = pack_awq(rising.t(), torch.ones(8, 1).half(), torch.zeros(8, 1, dtype=torch.int64))  # [out, in]
    assert awq["qweight"].tolist() == [[0x86427531 - (1 << 32)]]  # output o has the value o + 1


def test_the_engine_reads_each_slice_as_the_libraries_dequantize_it(tmp_path):
    """Whole tensors and tensor-parallel slices: outputs (q/k/v, gate/up rows; AWQ's cut inside a word)
    and inputs (o_proj, down_proj: whole groups), each equal to the slice of the reference's weight."""
    from safetensors.torch import load_file

    inputs_in_groups_of_64 = (("mlp.down_proj", 1, (128, 256)), ("self_attn.o_proj", 1, (0, 64)))
    cases = {  # build_gptq_awq_model_dir's arguments, the slices read
        "gptq": (dict(method="gptq", bits=4, group_size=64, sym=False), inputs_in_groups_of_64),
        "gptq8": (dict(method="gptq", bits=8, group_size=128, checkpoint_format="gptq_v2"),
                  (("mlp.down_proj", 1, (128, 256)),)),
        "gptq_per_channel": (dict(method="gptq", bits=4, group_size=None, sym=False), inputs_in_groups_of_64),
        "awq": (dict(method="awq", group_size=64), (("mlp.up_proj", 0, (3, 21)), *inputs_in_groups_of_64)),
    }
    for case, (kwargs, slices) in cases.items():
        model_dir = build_gptq_awq_model_dir(tmp_path / case, arch="llama", **kwargs)
        config = json.loads((model_dir / "config.json").read_text())
        tensors = load_file(str(model_dir / "model.safetensors"))
        source = WeightSource(model_dir)
        reader = packed_reader(source, source.quantization)
        for name, dim, part in (("self_attn.q_proj", 0, None), ("mlp.gate_proj", 0, (64, 192)), *slices):
            prefix = f"model.layers.1.{name}"
            q, scale, zero, _ = reader.read(prefix, dim, part)
            ours = reference(q, scale, zero, kwargs["group_size"], torch.eye(q.shape[1])).t()  # [out, in]
            theirs = dequantize(tensors, prefix, config["quantization_config"])
            start, end = part or (0, theirs.shape[dim])
            want = theirs[start:end] if dim == 0 else theirs[:, start:end]
            assert torch.equal(ours, want), (case, name, part)


def test_activation_order_puts_the_weights_inputs_in_group_order_and_the_layer_gathers_them(tmp_path):
    model_dir = build_gptq_awq_model_dir(tmp_path / "m", arch="llama", group_size=32, desc_act=True)
    source = WeightSource(model_dir)
    reader = packed_reader(source, source.quantization)
    prefix = "model.layers.0.mlp.down_proj"
    order = reader.input_order(prefix, 1, None)
    g_idx = source.get(prefix + ".g_idx").long()
    assert not torch.equal(order, torch.arange(256))
    assert torch.equal(g_idx[order], torch.arange(256) // 32)  # each group's inputs together
    q, scale, zero, _ = reader.read(prefix, 1, None)
    theirs = gptq_dequantize(*(source.get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales", "g_idx")),
                             4, "gptq")
    for make in (make_int4, make_int8):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):  # bfloat16: inputs and output rounded
            layer = make(q, scale, zero, 32, dtype, order)
            for rows in (1, 3, 9, 200):  # the kernels' rows, and a prefill's dequantized product
                x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
                want = x.float() @ theirs.t()
                got = layer.forward(x)
                assert got.dtype == dtype and (got.float() - want).abs().max() <= tol * want.abs().max()


INT4_KIND = "int4_blocks" if ql.int8_blocks_kernel() else "int4"
MODELS = {  # build_gptq_awq_model_dir's arguments, the kind every projection runs
    "gptq_w4_g128": (dict(method="gptq", arch="llama"), INT4_KIND),
    "gptq_w4_g32_asym_desc_act_qwen2": (dict(method="gptq", group_size=32, sym=False, desc_act=True), INT4_KIND),
    "gptq_v2_w4_per_channel_asym": (dict(method="gptq", group_size=None, sym=False, checkpoint_format="gptq_v2",
                                         arch="llama"), INT4_KIND),
    "gptq_w8_g128": (dict(method="gptq", bits=8, arch="llama"),
                     "int8_blocks" if ql.int8_blocks_kernel() else "int8_grouped"),
    "gptq_w8_g64_asym_desc_act": (dict(method="gptq", bits=8, group_size=64, sym=False, desc_act=True),
                                  "int8_grouped"),
    "gptq_w8_per_channel": (dict(method="gptq", bits=8, group_size=None, arch="qwen3"),
                            "int8_blocks" if ql.int8_blocks_kernel() else "int8"),  # one block a row
    "awq_w4_g128_qwen2": (dict(method="awq"), INT4_KIND),
    "awq_w4_g64": (dict(method="awq", group_size=64, arch="llama"), INT4_KIND),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, case):
    kwargs, kind = MODELS[case]
    model_dir = build_gptq_awq_model_dir(tmp_path / case, seed=len(case), **kwargs)
    oracle = dequantized_model_dir(model_dir, tmp_path / "oracle")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    runner = ModelRunner(str(model_dir))
    outputs = staggered_greedy(runner, prompts, NEW_TOKENS)
    for layer in runner.model.layers:
        for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert proj.quantized is not None and proj.quantized.kind == kind
            assert proj.weight is None and proj.weight_t is None and proj.packed is None and proj.panels is None
            assert (proj.quantized.input_order is not None) == kwargs.get("desc_act", False)
    assert runner.model.lm_head.quantized is None
    for i, prompt in enumerate(prompts):  # every token, EOS or not: the scheduler here never stops early
        assert outputs[i] == hf_greedy(str(oracle), prompt, NEW_TOKENS), i


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gptq_lm_head_true_checkpoint_runs_its_lm_head_on_the_integer_layer(tmp_path, bits):
    """GPTQModel's ``lm_head: true`` stores lm_head.qweight: read like a projection, its tokens are
    transformers' on the dequantized weights (lm_head's included)."""
    model_dir = build_gptq_awq_model_dir(tmp_path / "m", arch="llama", bits=bits, lm_head=True, seed=bits)
    oracle = dequantized_model_dir(model_dir, tmp_path / "oracle")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=bits)
    runner = ModelRunner(str(model_dir))
    head = runner.model.lm_head.quantized
    assert head is not None and head.kind == MODELS[f"gptq_w{bits}_g128"][1] and runner.model.lm_head.weight is None
    outputs = staggered_greedy(runner, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == hf_greedy(str(oracle), prompt, NEW_TOKENS), i


# ---------------------------------------------------------------- refusals, each one line


def _gptq(**fields):
    return {"quantization_config": gptq_config(4, 128, True, False, "gptq") | fields}


def _awq(**fields):
    return {"quantization_config": awq_config(128) | fields}


BAD_CONFIGS = {
    "gptq_three_bits": (_gptq(bits=3), "3-bit GPTQ weights are not supported"),
    "gptq_bits_a_string": (_gptq(bits="4"), "bits must be int, got '4'"),
    "gptq_odd_int4_group": (_gptq(group_size=100), "int4 groups of 100"),
    "gptq_group_zero": (_gptq(group_size=0), "group_size must be positive or -1"),
    "gptq_marlin": (_gptq(checkpoint_format="marlin"), "checkpoint_format 'marlin' is not supported"),
    "gptq_is_marlin_format": (_gptq(is_marlin_format=True), "checkpoint_format 'marlin'"),
    "gptq_formats_disagree": (_gptq(format="gptq_v2"), "disagree"),
    "gptq_int16_words": (_gptq(pack_dtype="int16"), "pack_dtype 'int16'"),
    "gptq_dynamic": (_gptq(dynamic={".*down.*": {"bits": 8}}), "dynamic"),
    "gptq_desc_act_not_bool": (_gptq(desc_act="yes"), "desc_act must be true or false"),
    "awq_eight_bits": (_awq(bits=8), "8-bit AWQ weights are not supported"),
    "awq_gemv": (_awq(version="GEMV"), "AWQ version 'gemv' is not supported"),
    "awq_marlin": (_awq(version="marlin"), "'marlin'"),
    "awq_exllama": (_awq(version="exllama"), "'exllama'"),
    "awq_llm_awq_backend": (_awq(backend="llm-awq"), "backend 'llm-awq'"),
    "awq_no_zero_point": (_awq(zero_point=False), "zero_point: false"),
    "awq_no_group_size": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "no group_size"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_gptq_or_awq_config_is_refused_in_one_line_naming_the_field(case):
    config, words = BAD_CONFIGS[case]
    try:
        parse_quantization_config(config)
    except QuantizationConfigError as exc:
        message = str(exc)
    else:
        pytest.fail(f"{case} was accepted")
    assert message.startswith("quantization_config: ") and words in message and "\n" not in message, message


def test_both_libraries_spellings_are_read():
    spec = parse_quantization_config({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                              "zero_point": True, "version": "GEMM"}})
    assert (spec.method, spec.bits, spec.group_size, spec.symmetric) == ("awq", 4, 64, False)
    spec = parse_quantization_config(_gptq(checkpoint_format=None, format="gptq_v2", group_size=-1, sym=False))
    assert (spec.format, spec.group_size, spec.symmetric, spec.act_order) == ("gptq_v2", None, False, False)
    # static groups are cut in the inputs' own order: nothing to reorder
    assert not parse_quantization_config(_gptq(desc_act=True, static_groups=True)).act_order
    assert parse_quantization_config(_gptq(desc_act=True)).act_order


def test_quantization_option_must_name_the_checkpoints_method():
    assert parse_quantization_config(_gptq(), "gptq").method == "gptq"
    assert parse_quantization_config(_awq(), "awq").method == "awq"
    with pytest.raises(QuantizationConfigError, match="--quantization awq does not match the checkpoint's "
                                                      "quant_method 'gptq'"):
        parse_quantization_config(_gptq(), "awq")
    with pytest.raises(QuantizationConfigError, match="--quantization gptq: the checkpoint is not quantized"):
        parse_quantization_config({}, "gptq")


def test_shapes_that_cut_groups_or_words_and_activation_order_across_ranks_are_refused():
    qwen_05b = dict(hidden_size=896, num_attention_heads=14, intermediate_size=4864)
    check_shapes(parse_quantization_config(_gptq(group_size=64)), projection_inputs(qwen_05b), 2)
    with pytest.raises(QuantizationConfigError, match="o_proj's 896 inputs split 2 ways cut a group"):
        check_shapes(parse_quantization_config(_gptq()), projection_inputs(qwen_05b), 2)
    with pytest.raises(QuantizationConfigError, match="o_proj's 896 inputs split 3 ways cut a group"):
        check_shapes(parse_quantization_config(_awq(group_size=64)), projection_inputs(qwen_05b), 3)
    with pytest.raises(QuantizationConfigError, match="q_proj has 200 inputs, not a multiple of group_size 128"):
        check_shapes(parse_quantization_config(_awq()),
                     projection_inputs(dict(hidden_size=200, num_attention_heads=4, intermediate_size=256)), 1)
    desc_act = parse_quantization_config(_gptq(desc_act=True))
    llama_1b = dict(hidden_size=2048, num_attention_heads=32, intermediate_size=8192)
    check_shapes(desc_act, projection_inputs(llama_1b), 1)
    with pytest.raises(QuantizationConfigError, match="desc_act .* --tensor-parallel-size > 1 is not supported"):
        check_shapes(desc_act, projection_inputs(llama_1b), 2)


def test_serve_refuses_activation_order_across_ranks_and_the_transformers_backend_before_starting(tmp_path):
    from pagedserve.deploy.serve_config import ConfigError, ServeConfig

    model_dir = build_gptq_awq_model_dir(tmp_path / "m", arch="llama", hidden_size=256, intermediate_size=512,
                                         desc_act=True)
    assert ServeConfig(model=str(model_dir), device="cpu", quantization="gptq").quantization == "gptq"
    refusals = {  # what serve was given -> the start of its one line
        "desc_act (activation order) with --tensor-parallel-size > 1": dict(tensor_parallel_size=2),
        "--quantization awq does not match the checkpoint's quant_method 'gptq'": dict(quantization="awq"),
        "--model-impl transformers runs the model through the transformers backend": dict(model_impl="transformers"),
    }
    for words, options in refusals.items():
        with pytest.raises(ConfigError) as err:
            ServeConfig(model=str(model_dir), device="cpu", **options)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def _rewrite(model_dir, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _one_scale_row(tensors):
    name = "model.layers.0.mlp.down_proj.scales"
    tensors[name] = tensors[name][:1].contiguous()


def _lopsided_group(tensors):
    g_idx = tensors["model.layers.1.self_attn.o_proj.g_idx"]
    g_idx[g_idx == 1] = 0  # group 0 of 64 inputs, group 1 of none


def _k_ordered_apart(tensors):
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()


def _zeros_short_of_outputs(tensors):
    name = "model.layers.0.self_attn.q_proj.qzeros"
    tensors[name] = tensors[name][:, :-1].contiguous()


def _qweight_as_int64(tensors):
    name = "model.layers.0.mlp.gate_proj.qweight"
    tensors[name] = tensors[name].long()


CORRUPT = {  # a change to a good checkpoint's tensors -> the worker's one line
    "scales_of_the_wrong_shape": (_one_scale_row, "down_proj.scales has shape [1, 128], not [8, 128]"),
    "g_idx_with_a_lopsided_group": (_lopsided_group, "o_proj.g_idx does not give each group 32 inputs"),
    "q_and_k_ordered_differently": (_k_ordered_apart, "q_proj, k_proj, v_proj order their inputs differently"),
    "qzeros_short_of_outputs": (_zeros_short_of_outputs, "q_proj.qzeros has shape [4, 15], not [4, 16]"),
    "qweight_in_int64": (_qweight_as_int64, "gate_proj.qweight is I64, not int32 words"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_the_worker_refuses_a_corrupt_tensor_in_one_line_naming_it(tmp_path, case):
    change, words = CORRUPT[case]
    model_dir = build_gptq_awq_model_dir(tmp_path / "m", arch="llama", group_size=32, desc_act=True)
    _rewrite(model_dir, change)
    with pytest.raises(UnsupportedModelError, match=re.escape(words)) as err:
        ModelRunner(str(model_dir))
    assert "\n" not in str(err.value)


def test_a_fused_projection_whose_parts_differ_in_zero_points_keeps_each_parts(tmp_path):
    """A part whose zero points are all the midpoint is read as symmetric (no zero points); fused with a part
    that has others, its rows keep zero point 0 and the others theirs."""
    model_dir = build_gptq_awq_model_dir(tmp_path / "m", arch="llama", sym=False, seed=5)

    def q_proj_at_the_midpoint(tensors):
        name = "model.layers.0.self_attn.q_proj.qzeros"
        tensors[name] = torch.full_like(tensors[name], 0x77777777)  # v1: 8 stored as 7, every nibble
    _rewrite(model_dir, q_proj_at_the_midpoint)
    oracle = dequantized_model_dir(model_dir, tmp_path / "oracle")
    runner = ModelRunner(str(model_dir))
    assert runner.model.layers[0].qkv.quantized.nibble_zeros is not None
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=5)
    outputs = staggered_greedy(runner, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == hf_greedy(str(oracle), prompt, NEW_TOKENS), i


def test_a_layer_left_in_float_keeps_the_float_path(tmp_path):
    """AWQ's modules_to_not_convert (GPTQ's modules_in_block_to_quantize) leave projections in float."""
    from safetensors.torch import load_file

    model_dir = build_gptq_awq_model_dir(tmp_path / "m", "awq", arch="llama")
    floats = load_file(str(dequantized_model_dir(model_dir, tmp_path / "float") / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"

    def to_float(tensors):
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{prefix}.{suffix}")
        tensors[f"{prefix}.weight"] = floats[f"{prefix}.weight"]
    _rewrite(model_dir, to_float)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.mlp.down_proj"]
    (model_dir / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(str(model_dir))
    assert runner.model.layers[1].down.quantized is None and runner.model.layers[1].gate_up.quantized is not None
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=3)
    outputs = staggered_greedy(runner, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == hf_greedy(str(tmp_path / "float"), prompt, NEW_TOKENS), i
