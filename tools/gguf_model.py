"""GGUF files of small random models, written by the ``gguf`` package itself (its writer and quantizer).

A model directory from ``demo_model.build_model_dir`` (Llama, Mistral, Qwen2 or Qwen3) becomes one ``.gguf`` as
llama.cpp's ``convert_hf_to_gguf.py`` lays it out: the hyperparameters under the architecture's keys,
the byte-level BPE tokenizer as ``tokenizer.ggml.*`` (tokens, types, merges, special ids, chat
template), tensors under GGUF's names (``gguf.get_tensor_name_map``), Llama's q/k rows permuted for
llama.cpp's rotary layout, norms and biases in F32, and every matrix (embeddings included) in the
type asked for, quantized by ``gguf.quants.quantize`` (the k-quants, which it cannot make, by
tools/gguf_kquants.py). ``Q4_K_M`` mixes them as llama-quantize's preset does: Q6_K for the output matrix (the
embeddings where they are tied) and for attn_v and ffn_down on its "more bits" layers, Q4_K elsewhere, and a
k-quant whose rows are no whole 256-input blocks falls back as llama-quantize's does (Q4_K to Q5_0, Q6_K to
Q8_0). transformers' GGUF loader reads the result back (config, tokenizer, dequantized weights): that is the
oracle of the engine's GGUF path, and a bench can write its own files here without llama.cpp's converter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pagedserve.tools.gguf_kquants import QK_K, QUANTIZERS

# The matrix types this writer makes (gguf.quants.quantize, tools/gguf_kquants.py), and llama-quantize's Q4_K_M mix
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M")
_K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama-quantize's, for rows of no whole 256-input blocks
# config.json model_type -> GGUF general.architecture (Mistral is "llama" to llama.cpp, named by general.name)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _llama_permute(weights: Any, n_head: int) -> Any:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved, on the output rows."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tokenizer_fields(writer: Any, model_dir: Path, vocab_size: int) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokens = [""] * vocab_size
    types = [1] * vocab_size  # gguf.TokenType.NORMAL
    for token, index in data["model"]["vocab"].items():
        tokens[index] = token
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    for index, token in enumerate(tokens):
        if not token:  # the model's rows past the tokenizer's vocabulary
            tokens[index], types[index] = f"[PAD{index}]", 5  # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the demo tokenizer splits by GPT-2's own regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    index_of = {t: i for i, t in enumerate(tokens)}
    for key, add in (("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id),
                     ("bos_token", writer.add_bos_token_id)):
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token in index_of:
            add(index_of[token])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def write_gguf(model_dir: str | Path, path: str | Path, tensor_type: str = "Q8_0") -> Path:
    """``model_dir`` (config.json, model.safetensors, tokenizer.json) as one GGUF file at ``path``,
    its matrices in ``tensor_type`` (one of TENSOR_TYPES); returns ``path``."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor type {tensor_type!r}: one of {', '.join(TENSOR_TYPES)}")
    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r}: this writer makes {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[model_type]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{model_type} random {model_dir.name}")  # "mistral" in the name: transformers' cue
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    if arch != "qwen2":  # transformers reads head_dim from here (Qwen2's is hidden / heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window") and model_type == "mistral":
        raise ValueError("a sliding window has no GGUF key transformers reads: build the model without one")
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S"}.get(tensor_type, f"MOSTLY_{tensor_type}")  # no Q4_K-only
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    _tokenizer_fields(writer, model_dir, config["vocab_size"])

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    tensors = load_file(str(model_dir / "model.safetensors"))
    has_output = "lm_head.weight" in tensors and not config.get("tie_word_embeddings")
    for hf_name in sorted(tensors):
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ValueError(f"{hf_name} has no GGUF name")
        data = tensors[hf_name].astype(np.float32)
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            data = _llama_permute(data, heads if stem.endswith("q_proj") else kv_heads)
        kind = _matrix_type(tensor_type, gguf_name, layers, data.shape[-1], has_output) if data.ndim == 2 else "F32"
        if kind in QUANTIZERS:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(f"{gguf_name}.{suffix}", QUANTIZERS[kind](data), raw_dtype=qtype)
        elif kind != "F32":
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _matrix_type(tensor_type: str, gguf_name: str, layers: int, inputs: int, has_output: bool) -> str:
    """The type a matrix is written in: ``tensor_type``, or Q4_K_M's choice for this tensor (llama.cpp's
    llama-quant.cpp: Q6_K for ``output``, or ``token_embd`` without one, and for attn_v / ffn_down where
    ``use_more_bits``), a k-quant of rows that are no whole super-blocks replaced by its fallback."""
    kind = tensor_type
    if tensor_type == "Q4_K_M":
        parts = gguf_name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else -1
        more_bits = layer >= 0 and (layer < layers // 8 or layer >= 7 * layers // 8
                                    or (layer - layers // 8) % 3 == 2)
        head = gguf_name == ("output" if has_output else "token_embd")
        kind = "Q6_K" if head or (parts[-1] in ("attn_v", "ffn_down") and more_bits) else "Q4_K"
    return _K_FALLBACK[kind] if kind in _K_FALLBACK and inputs % QK_K else kind


def build_gguf_model(path: str | Path, tensor_type: str = "Q8_0", arch: str = "qwen2", **model_kwargs: Any) -> Path:
    """A random ``arch`` model (``demo_model.build_model_dir``'s arguments; the defaults give every
    projection inputs in whole blocks of 32) written as the GGUF file ``path``; returns it."""
    from pagedserve.tools.demo_model import build_model_dir

    path = Path(path)
    source = build_model_dir(path.with_name(path.stem + "-hf"), arch, **model_kwargs)
    write_gguf(source, path, tensor_type)
    shutil.rmtree(source)
    return path
