"""GGUF files on CPU: written by the ``gguf`` package (tools/gguf_model.py; the k-quants by tools/gguf_kquants.py)
and read back by transformers' GGUF loader, the oracle; Q8_0 / Q4_0 / Q5_0 / Q4_1 / Q4_K / Q6_K served as int8 /
int4 layers holding the file's own integers;
greedy tokens in float32 equal transformers' on the same file for each type and family; every bad
file refused by ``serve``'s config in one line, before any process starts."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.kernels import cpu_quantized
from pagedserve.protocol.model_identity import config_identity
from pagedserve.runtime import cpu_dtype
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.tools.gguf_model import build_gguf_model, write_gguf
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models import quantized_linear as ql
from support.oracle import hf_greedy, hf_model
from support.worker_harness import TrivialScheduler, random_prompts

gguf = pytest.importorskip("gguf")

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 19, 33]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
K_SHAPE = dict(SHAPE, hidden_size=256, intermediate_size=512)  # every projection's inputs in k-quant blocks of 256


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Made model directories go to this test's own cache, not the user's."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))


def _served_dir(path: Path, **options) -> str:
    return ServeConfig(model=str(path), device="cpu", **options).model


@pytest.mark.parametrize("tensor_type, integer, expected", [("Q8_0", True, "bfloat16"), ("F16", False, "float32")])
def test_auto_keeps_a_quantized_files_half_type_on_a_cpu_without_bfloat16_arithmetic(tmp_path, monkeypatch,
                                                                                    tensor_type, integer, expected):
    """Without AVX512-BF16 / AMX a half checkpoint computes in float32, but a GGUF whose matrices are all integer
    blocks multiplies them on the integer kernels, and in float32 each call would first dequantize its weight."""
    monkeypatch.setattr(cpu_dtype, "fast_bfloat16_matmuls", lambda: None)  # an AVX2 CPU's answer
    path = build_gguf_model(tmp_path / "m.gguf", tensor_type, "qwen2", **SHAPE)
    config = ServeConfig(model=str(path), device="cpu")
    assert json.loads((Path(config.model) / "config.json").read_text())["pagedserve_gguf"]["integer_matrices"] is integer
    assert config.dtype == expected


# ---------------------------------------------------------------- the writer against transformers' loader


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_transformers_reads_each_written_type_back_to_the_weights_it_was_written_from(tmp_path, tensor_type):
    """Llama's q/k rows are permuted in the file and put back by the loader: the same weights come out."""
    from safetensors.torch import load_file

    source = build_model_dir(tmp_path / "hf", "llama", **SHAPE)
    path = write_gguf(source, tmp_path / "m.gguf", tensor_type)
    original = load_file(str(source / "model.safetensors"))
    loaded = hf_model(str(path)).state_dict()
    for name, weight in original.items():
        if weight.dim() == 1 or tensor_type == "F32":
            expected = weight  # norms stay F32
        elif tensor_type in ("F16", "BF16"):
            expected = weight.to({"F16": torch.float16, "BF16": torch.bfloat16}[tensor_type]).float()
        else:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), qtype), qtype))
        assert torch.equal(loaded[name], expected), name


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q6_K"])
def test_the_k_quant_encoders_blocks_decode_by_gguf_to_within_a_quantization_step_of_the_rows(tensor_type):
    from pagedserve.tools.gguf_kquants import QUANTIZERS

    rows = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32) * 0.05
    rows[0, :256] = 0.0  # a super-block of zeros: d = dmin = 0
    rows[1, :32] = 0.01  # a constant sub-block: its 6-bit scale 0, the weight its min alone
    blocks = QUANTIZERS[tensor_type](rows)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    assert blocks.shape == gguf.quants.quant_shape_to_byte_shape(rows.shape, qtype)
    back = gguf.quants.dequantize(blocks, qtype)
    step = np.abs(rows).reshape(6, 2, 256).max(-1, keepdims=True) * (2 / 15 if tensor_type == "Q4_K" else 2 / 31)
    assert (np.abs(back - rows).reshape(6, 2, 256) <= step).all() and (back[0, :256] == 0).all()


# ---------------------------------------------------------------- the integer layers hold the file's blocks

_INT8 = "int8_blocks" if ql.int8_blocks_kernel() else "int8_grouped"
_INT4 = "int4_blocks" if ql.int8_blocks_kernel() else "int4"
_Q5 = "q5_0" if ql.int8_blocks_kernel() else "int8_grouped"
_Q8 = "q8_0" if ql.int8_blocks_kernel() else "int8_grouped"  # inputs a multiple of 64: in tiles


@pytest.mark.parametrize("tensor_type, kind, group", [("Q8_0", _Q8, 32), ("Q4_0", _INT4, 32), ("Q5_0", _Q5, 32),
                                                      ("Q4_1", _INT4, 32), ("Q4_K", _INT4, 32), ("Q6_K", _INT8, 16)])
def test_native_types_run_as_integer_layers_whose_weights_are_the_loaders(tmp_path, tensor_type, kind, group):
    """Q5_0 packed 5 bits a value (Q8_0's arithmetic); Q4_K and Q4_1 as int4 less a float min per group of 32; Q6_K
    as int8 in groups of 16: each dequantized weight is, bit for bit, the float32 matrix transformers' loader holds."""
    path = build_gguf_model(tmp_path / "m.gguf", tensor_type, "llama", **K_SHAPE)
    runner = ModelRunner(_served_dir(path), dtype="float32")
    theirs = hf_model(str(path)).state_dict()
    for i, layer in enumerate(runner.model.layers):
        attn = f"model.layers.{i}.self_attn."
        qkv = torch.cat([theirs[attn + f"{n}_proj.weight"] for n in "qkv"])
        for proj, want in ((layer.qkv, qkv), (layer.o_proj, theirs[attn + "o_proj.weight"]),
                           (layer.down, theirs[f"model.layers.{i}.mlp.down_proj.weight"])):
            assert proj.quantized is not None and proj.quantized.kind == kind and proj.quantized.group_size == group
            assert proj.weight is None  # no float copy beside the integers
            assert torch.equal(proj.quantized.dequantized(torch.float32), want)  # q * scale, exactly the loader's


def test_a_q4_k_m_projection_fusing_q4_k_and_q6_k_parts_is_a_layer_per_part_holding_the_loaders_weights(tmp_path):
    """On llama-quantize's "more bits" layers Q4_K_M stores attn_v in Q6_K beside Q4_K q and k: the fused qkv is a
    stack of their own integer layers, no float copy, its weight still the loader's."""
    path = build_gguf_model(tmp_path / "m.gguf", "Q4_K_M", "llama", **K_SHAPE)
    runner = ModelRunner(_served_dir(path), dtype="float32")
    theirs = hf_model(str(path)).state_dict()
    qkv = runner.model.layers[1].qkv  # layer 1 of 2: 7 n / 8 and on, more bits
    assert qkv.weight is None and [p.kind for p in qkv.quantized.parts] == [_INT4, _INT4, _INT8]
    want = torch.cat([theirs[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv.quantized.dequantized(torch.float32), want)
    assert f"{_INT4}: " in ql.describe_ops(runner.model.layers)  # the log names each part's op


# ---------------------------------------------------------------- greedy tokens against transformers


def _greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    runner = ModelRunner(model_dir, dtype="float32")
    scheduler = TrivialScheduler(runner, block_size=4)
    scheduler.add("r0", prompts[0], NEW_TOKENS)
    scheduler.add("r1", prompts[1], NEW_TOKENS, prefill_chunks=[7])
    scheduler.add("r2", prompts[2], NEW_TOKENS, arrival_step=2, prefill_chunks=[10, 11])
    outputs = scheduler.run()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def _hf_gguf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(str(path), prompt, NEW_TOKENS) for prompt in prompts]  # transformers' GGUF loader


CASES = {  # tensor type, family, extra model settings
    "llama_q8_0": ("Q8_0", "llama", {}),
    "qwen2_q4_0": ("Q4_0", "qwen2", {}),
    # Q4_K beside Q6_K (attn_v, ffn_down, output on llama-quantize's "more bits" layers; a qkv of both in float)
    "llama_q4_k_m": ("Q4_K_M", "llama", K_SHAPE),
    "qwen2_q5_0": ("Q5_0", "qwen2", {}),
    "qwen2_q4_1": ("Q4_1", "qwen2", {}),
    "mistral_f16": ("F16", "mistral", {"sliding_window": None}),
    "qwen2_bf16": ("BF16", "qwen2", {}),
    "llama_f32": ("F32", "llama", {}),
    "qwen3_q8_0": ("Q8_0", "qwen3", {}),  # head_dim 128, Qwen3's: transformers' loader reads no other
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_of_a_gguf_file_equal_transformers_on_the_same_file(tmp_path, case):
    tensor_type, arch, extra = CASES[case]
    path = build_gguf_model(tmp_path / f"{case}.gguf", tensor_type, arch, seed=len(case), **dict(SHAPE, **extra))
    model_dir = _served_dir(path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    got, expected = _greedy(model_dir, prompts), _hf_gguf_greedy(path, prompts)
    assert got == expected


# ---------------------------------------------------------------- the model directory made of a file


def test_a_gguf_is_served_under_its_file_name_from_a_directory_made_of_its_metadata(tmp_path):
    path = build_gguf_model(tmp_path / "tiny-Q8_0.gguf", "Q8_0", "qwen2", **SHAPE)
    cfg = ServeConfig(model=str(path), device="cpu")
    assert cfg.served_model_name == ["tiny-Q8_0.gguf"] and cfg.model_aliases == [str(path)]
    made = Path(cfg.model)
    assert not list(made.glob("*.safetensors"))  # the weights stay in the file
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(made))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "Hello, world! The quick brown fox 東京 🙂"
    assert ours(text).input_ids == theirs(text).input_ids and ours.chat_template == theirs.chat_template
    assert ServeConfig(model=str(tmp_path), device="cpu").model == cfg.model  # a directory holding it
    again = dataclasses.replace(cfg, max_num_seqs=3)  # a config made again from its own fields keeps them
    assert (again.model, again.served_model_name, again.model_aliases) == (cfg.model, cfg.served_model_name,
                                                                           cfg.model_aliases)
    assert dataclasses.replace(ServeConfig(model=str(path), device="cpu", load_format="gguf")).model == cfg.model
    # the same weights in another type are another model (its identity, a trace's fingerprint)
    other = build_gguf_model(tmp_path / "other" / "tiny-F16.gguf", "F16", "qwen2", **SHAPE)
    assert config_identity(made / "config.json") != config_identity(Path(_served_dir(other)) / "config.json")


def test_the_tokenizer_option_replaces_the_files_tokenizer(tmp_path):
    path = build_gguf_model(tmp_path / "m.gguf", "Q8_0", "qwen2", **SHAPE)
    tokenizer_dir = build_model_dir(tmp_path / "thinking", "qwen2", thinking_template=True)
    from transformers import AutoTokenizer

    served = AutoTokenizer.from_pretrained(_served_dir(path, tokenizer=str(tokenizer_dir)))
    assert served.chat_template == AutoTokenizer.from_pretrained(str(tokenizer_dir)).chat_template
    assert "<think>" in served.get_vocab()
    with pytest.raises(ConfigError, match="--tokenizer replaces a GGUF file's tokenizer"):
        ServeConfig(model=str(tokenizer_dir), device="cpu", tokenizer=str(tokenizer_dir))


# ---------------------------------------------------------------- refused before any process starts


def _refusal(model: str, **options) -> str:
    with pytest.raises(ConfigError) as info:
        ServeConfig(model=model, device="cpu", **options)
    message = str(info.value)
    assert "\n" not in message
    return message


def _retyped(src: Path, dst: Path, tensor: str, type_number: int) -> Path:
    """``src`` with ``tensor``'s type field in the header set to ``type_number``."""
    raw = bytearray(src.read_bytes())
    name = tensor.encode()
    at = raw.index(name) + len(name)
    dims = int.from_bytes(raw[at:at + 4], "little")
    at += 4 + 8 * dims
    raw[at:at + 4] = type_number.to_bytes(4, "little")
    dst.write_bytes(bytes(raw))
    return dst


def test_bad_gguf_files_are_refused_in_one_line(tmp_path):
    path = build_gguf_model(tmp_path / "good" / "m.gguf", "Q8_0", "llama", **SHAPE)
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) * 2 // 3])
    assert "short.gguf is not a readable GGUF file (truncated or corrupt" in _refusal(str(tmp_path / "short.gguf"))
    (tmp_path / "header.gguf").write_bytes(data[:2000])
    assert "truncated or corrupt" in _refusal(str(tmp_path / "header.gguf"))
    unknown = _retyped(path, tmp_path / "unknown.gguf", "blk.0.ffn_down.weight", 77)
    assert ("tensor blk.0.ffn_down.weight has type number 77, which is not a GGUF tensor type; supported types: "
            "F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q6_K, Q4_K, Q4_1, Q5_K, Q2_K, Q3_K, Q5_1") in _refusal(str(unknown))
    unsupported = _retyped(path, tmp_path / "iq.gguf", "blk.0.ffn_down.weight", gguf.GGMLQuantizationType.IQ2_XXS.value)
    assert "tensor types IQ2_XXS are not supported" in _refusal(str(unsupported))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no config.json and no .gguf file" in _refusal(str(empty))
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(path, two / "a.gguf")
    shutil.copy(path, two / "b.gguf")
    assert "holds 2 .gguf files (a.gguf, b.gguf)" in _refusal(str(two))
    hf = build_model_dir(tmp_path / "hf", "llama")
    assert "--load-format gguf" in _refusal(str(hf), load_format="gguf")
    assert "native families only" in _refusal(str(path), model_impl="transformers")


def test_an_architecture_pagedserve_has_no_family_for_is_refused_naming_the_supported(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert ("GGUF architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3 (mistral as llama)"
            in _refusal(str(tmp_path / "g.gguf")))


def test_a_tensor_parallel_slice_that_cuts_a_block_of_32_is_refused(tmp_path):
    path = build_gguf_model(tmp_path / "m.gguf", "Q8_0", "llama", **dict(SHAPE, intermediate_size=96))
    message = _refusal(str(path), tensor_parallel_size=2)
    assert "down_proj's 96 inputs split 2 ways cut a group (32 values)" in message
    assert ServeConfig(model=str(path), device="cpu", tensor_parallel_size=1).model  # one rank holds whole blocks


def test_a_tensor_parallel_slice_that_cuts_a_k_quant_block_of_256_is_refused_though_it_holds_whole_groups(tmp_path):
    path = build_gguf_model(tmp_path / "m.gguf", "Q4_K_M", "llama", **K_SHAPE)
    message = _refusal(str(path), tensor_parallel_size=2)  # o_proj's 128 inputs a rank: 4 groups, half a block
    assert "o_proj's 256 inputs split 2 ways cut a Q4_K block (256 values)" in message


def test_in_float32_a_q4_0_output_runs_on_the_int4_gemv_and_a_q8_0_one_keeps_its_exact_float_matrix(tmp_path):
    """The int4 GEMV sums in float32 at every decode size, so a Q4_0 lm_head stays integers in float32 too; Q8_0's
    layer would dequantize at every float32 call, so its head is read in float (q * scale, the loader's values)."""
    for tensor_type in ("Q4_0", "Q8_0"):
        path = build_gguf_model(tmp_path / f"{tensor_type}.gguf", tensor_type, "llama", **SHAPE)
        head = ModelRunner(_served_dir(path), dtype="float32").model.lm_head
        if tensor_type == "Q4_0" and ql.int8_blocks_kernel():
            assert head.quantized is not None and head.quantized.kind == "int4_blocks" and head.weight is None
        else:
            assert head.quantized is None
            assert torch.equal(head.weight, hf_model(str(path)).state_dict()["lm_head.weight"])


@pytest.mark.skipif(not ql.int8_blocks_kernel(), reason="native CPU kernels are not built here")
def test_in_bfloat16_q8_0_layers_multiply_as_llamacpp_does_and_a_decode_step_stays_near_the_float_model(tmp_path):
    """A decode row of a Q8_0 projection is quantized per block of 32 too (llama.cpp's Q8_0 x Q8_0, the worker's
    log names it), its products the reference's (q8_0_reference) within float32 sums; a Q8_0 matrix from another
    source (compressed-tensors' W8A16 g32) keeps float activations. The model's logits stay within bfloat16's
    distance of the float32 model's on the same file."""
    path = build_gguf_model(tmp_path / "m.gguf", "Q8_0", "qwen2", tie_word_embeddings=True, **SHAPE)
    model = ModelRunner(_served_dir(path), dtype="bfloat16").model
    layers = [p.quantized for layer in model.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert all(q.kind == "q8_0" for q in [*layers, model.lm_head.quantized])
    assert ql.describe_ops(model.layers).startswith("q8_0: native Q8_0 x Q8_0 GEMM in panels of 16 rows")
    copies = "in float32 only" if cpu_quantized.q8_0_variant() in ("avx512vnni", "avx2") else "from 16 rows"
    assert f"dequantized in one native pass (kernels/cpu_dequantize.c) {copies}" in ql.describe_ops(model.layers)
    x = torch.randn(3, layers[0].in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    values, scales = layers[0].blocks()
    want = ql.q8_0_reference(values, scales, x)
    assert ((layers[0].forward(x).double() - want).abs() <= 2e-2 * want.abs().max()).all()  # bfloat16's rounding
    float_model = ModelRunner(_served_dir(path), dtype="float32").model
    hidden = torch.randn(2, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(2))
    got, full = model.compute_logits(hidden.bfloat16()).float(), float_model.compute_logits(hidden)
    assert (got - full).abs().max() <= 3e-2 * full.abs().max()
    plain = ql.make_int8(values, scales.float(), None, 32, torch.bfloat16)  # not a GGUF's: W8A16
    assert plain.kind == "int8_blocks"


def test_in_bfloat16_a_q8_0_lm_head_is_an_integer_layer_giving_the_float_heads_logits(tmp_path):
    """The tied Q8_0 embeddings serve as lm_head without a float copy of the head; its logits are the
    dequantized head's within bfloat16's rounding."""
    path = build_gguf_model(tmp_path / "m.gguf", "Q8_0", "qwen2", tie_word_embeddings=True, **SHAPE)
    model = ModelRunner(_served_dir(path), dtype="bfloat16").model
    head = model.lm_head.quantized
    assert head is not None and head.kind == _Q8
    assert torch.equal(head.dequantized(torch.bfloat16), model.embed_tokens)  # the same rounding of q * scale
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = torch.nn.functional.linear(model.final_norm(hidden).float(), model.embed_tokens.float())
    got = model.compute_logits(hidden)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
