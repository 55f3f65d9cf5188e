"""Random models too large to build in memory, written tensor by tensor into safetensors shards.

``build_model_dir`` instantiates the whole transformers model, fills it and saves it: for the
Qwen3-30B-A3B-shaped MoE of issue 52 (7.25 G expert parameters, ~15.5 GB in bfloat16) that is the
model once in memory, then save_pretrained's copies, on a machine of 23 GiB shared with other work.
Here only one decoder layer's tensors (~1.2 GB in bfloat16) are held at a time: each is drawn from
one seeded generator in the checkpoint's own order, rounded to the checkpoint dtype, and the layer
written as a shard of its own, with the hub's index file (``model.safetensors.index.json``), so
every loader (pagedserve, transformers, vLLM, llama.cpp's converter) reads it as a hub checkpoint.

The tensors carry the hub checkpoints' names (experts one by one, ``mlp.experts.N.gate_proj``) and
HF's init rules as ``demo_model._fill_weights`` applies them (matrices ~ N(0, initializer_range),
norm weights 1); the values differ from what build_model_dir would draw for the same seed (another
order), which no bench compares. Qwen3-MoE only: the one architecture a bench shape needs it for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

ARCHS = ("qwen3_moe",)


def build_streamed_model_dir(path: str | Path, arch: str = "qwen3_moe", *, hidden_size: int, num_layers: int,
                             num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                             num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                             vocab_size: int, max_position_embeddings: int = 4096, rope_theta: float = 1e6,
                             norm_topk_prob: bool = True, tie_word_embeddings: bool = False, seed: int = 0,
                             dtype: str = "bfloat16", initializer_range: float = 0.02) -> Path:
    """Write a random ``arch`` model (config, tokenizer, one safetensors shard per layer) into ``path``."""
    import safetensors.torch
    import torch
    import transformers

    from pagedserve.tools.demo_model import build_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"the streamed builder writes {ARCHS} only, not {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, eos_token_id=eos_id,
        bos_token_id=None, pad_token_id=tokenizer.pad_token_id, initializer_range=initializer_range,
        dtype=dtype)
    config.save_pretrained(path)
    # What save_pretrained of a model writes and a bare config does not (llama.cpp's converter picks its
    # class by it), and the hub's Qwen3-MoE spellings (num_experts, a top-level rope_theta) older readers look for
    written = json.loads((path / "config.json").read_text())
    written.update(architectures=["Qwen3MoeForCausalLM"], num_experts=num_experts, rope_theta=rope_theta)
    (path / "config.json").write_text(json.dumps(written, indent=2))
    transformers.GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)

    generator = torch.Generator().manual_seed(seed)
    out_dtype = getattr(torch, dtype)

    def tensor(shape: tuple[int, ...], matrix: bool = True) -> torch.Tensor:
        if not matrix:  # a norm's weight: its init value
            return torch.ones(shape, dtype=out_dtype)
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, initializer_range, generator=generator).to(out_dtype)

    weight_map: dict[str, str] = {}
    total_size = 0
    shards = _shards(num_layers, tie_word_embeddings)
    for index, (name, entries) in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, spec in entries(hidden_size, num_heads, num_kv_heads, head_dim, num_experts,
                                 moe_intermediate_size, vocab_size):
            tensors[key] = tensor(*spec)
            weight_map[key] = file
            total_size += tensors[key].nbytes
        if name == "embeddings":
            tensors["model.embed_tokens.weight"][tokenizer.pad_token_id].zero_()  # as _fill_weights does
        safetensors.torch.save_file(tensors, path / file, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total_size},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "pagedserve_demo.json").write_text(json.dumps({"pagedserve_demo": True, "arch": arch, "seed": seed,
                                                           "streamed": True}))
    return path


def _shards(num_layers: int, tied: bool) -> list:
    """(name, entries) per shard: the embeddings, each layer, then the final norm and lm_head."""
    def embeddings(h, nh, nkv, d, e, i, v) -> Iterator:
        yield "model.embed_tokens.weight", ((v, h),)

    def layer(n: int):
        def entries(h, nh, nkv, d, e, i, v) -> Iterator:
            p = f"model.layers.{n}."
            yield p + "input_layernorm.weight", ((h,), False)
            yield p + "self_attn.q_proj.weight", ((nh * d, h),)
            yield p + "self_attn.k_proj.weight", ((nkv * d, h),)
            yield p + "self_attn.v_proj.weight", ((nkv * d, h),)
            yield p + "self_attn.o_proj.weight", ((h, nh * d),)
            yield p + "self_attn.q_norm.weight", ((d,), False)
            yield p + "self_attn.k_norm.weight", ((d,), False)
            yield p + "post_attention_layernorm.weight", ((h,), False)
            yield p + "mlp.gate.weight", ((e, h),)
            for x in range(e):
                yield p + f"mlp.experts.{x}.gate_proj.weight", ((i, h),)
                yield p + f"mlp.experts.{x}.up_proj.weight", ((i, h),)
                yield p + f"mlp.experts.{x}.down_proj.weight", ((h, i),)
        return entries

    def head(h, nh, nkv, d, e, i, v) -> Iterator:
        yield "model.norm.weight", ((h,), False)
        if not tied:
            yield "lm_head.weight", ((v, h),)

    return [("embeddings", embeddings), *((f"layer {n}", layer(n)) for n in range(num_layers)), ("head", head)]
