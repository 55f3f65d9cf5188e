"""The model shapes ``pagedserve bench offline --shapes`` compares, with the workload of each.

Random weights (no download), built once into a cache directory by the demo-model code, so
a run measures the same model every time. ``0.5b`` is Qwen2.5-0.5B's shape in float32
(about 2 GB on disk): compute-bound on a CPU, where the matmuls should set the pace.
``qwen3-moe-a3b-12l`` (issue 52, ~15.5 GB in bfloat16) is written layer by layer instead
(``streamed_model.py``): building it in memory would not fit beside other work.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchShape:
    name: str
    model: dict[str, Any] = field(default_factory=dict)  # build_model_dir keyword arguments
    num_prompts: int = 64
    input_len: tuple[int, int] = (16, 64)
    output_len: int = 64
    # written tensor by tensor (bench/streamed_model.py) rather than by build_model_dir: too large for memory
    streamed: bool = False


SHAPES = {s.name: s for s in (
    # the demo model (tools/demo_model.py build_demo_model)
    BenchShape("tiny", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, vocab_size=1024, max_position_embeddings=4096,
                            seed=1234)),
    BenchShape("small", dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                             intermediate_size=1536, vocab_size=32000, max_position_embeddings=4096,
                             seed=1234), num_prompts=64, input_len=(16, 64), output_len=64),
    # issue 31's served fp32 workload: "random Llama, 8 layers, hidden 512, head_dim 64, vocab 32k"
    BenchShape("small-llama", dict(arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                                   intermediate_size=1536, vocab_size=32000, max_position_embeddings=4096,
                                   seed=1234), num_prompts=64, input_len=(16, 64), output_len=64),
    BenchShape("0.5b", dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                            intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                            tie_word_embeddings=True, rope_theta=1000000.0, seed=1234),
               num_prompts=32, input_len=(8, 256), output_len=32),
    # The same weights as real checkpoints ship them, in bfloat16 (0.5b's rounded): --dtype float32
    # computes them in float32 (pagedserve keeps them in bfloat16 on AVX2, widened exactly).
    BenchShape("0.5b-bf16", dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                                 tie_word_embeddings=True, rope_theta=1000000.0, seed=1234, dtype="bfloat16"),
               num_prompts=32, input_len=(8, 256), output_len=32),
    # The same shape with Qwen2.5-0.5B's own initializer_range (0.02, its config.json) instead
    # of the demo models' 0.2: the residual stream then carries the tied input embedding
    # through, and greedy output falls into short loops (a token, or a phrase of 2-6, repeated
    # for a while, then another), the workload prompt lookup is for (speculative decoding).
    BenchShape("0.5b-loops", dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                                  tie_word_embeddings=True, rope_theta=1000000.0, seed=1234,
                                  initializer_range=0.02),
               num_prompts=1, input_len=(16, 64), output_len=256),
    # Issue 52's dense goal: Gemma 3 1B's text shape (26 layers, 4 query heads, 1 KV head of 256, a window of
    # 512 on five layers of six, local rope base 1e4, global 1e6, tied 262,144-token embeddings: ~2 GB in
    # bfloat16) with its initializer_range; decode-heavy as issue 31's: 64 prompts of 16-64 tokens, 256 new.
    BenchShape("gemma3-1b", dict(arch="gemma3", hidden_size=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                                 head_dim=256, query_pre_attn_scalar=256, intermediate_size=6912,
                                 vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
                                 sliding_window_pattern=6, tie_word_embeddings=True, seed=1234,
                                 dtype="bfloat16", initializer_range=0.02),
               num_prompts=64, input_len=(16, 64), output_len=256),
    # Issue 52's MoE: Qwen3-30B-A3B's shape (32 query heads, 4 KV heads, head_dim 128, 128 experts, top 8,
    # moe_intermediate 768, no shared expert, vocab 151936) with its 48 layers cut to 12: 7.25 G expert
    # parameters, ~15.5 GB in bfloat16 with attention and embeddings. Qwen3's initializer_range (0.02),
    # which keeps activations finite in bfloat16; decode-heavy: 64 prompts of 16-64 tokens, 256 new.
    BenchShape("qwen3-moe-a3b-12l", dict(arch="qwen3_moe", hidden_size=2048, num_layers=12, num_heads=32,
                                         num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                                         num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                                         max_position_embeddings=4096, rope_theta=1e6, norm_topk_prob=True,
                                         seed=1234, dtype="bfloat16", initializer_range=0.02),
               num_prompts=64, input_len=(16, 64), output_len=256, streamed=True),
)}

# Draft models for speculative decoding's draft_model (issue 33): ``ensure_draft_model`` builds
# them on first use. ``first-layers``: the target's own embeddings, first layers and final norm,
# an early exit that shares the target's representation; ``random``: a small model of its own.
DRAFTS = {
    "0.5b-loops-first2": ("0.5b-loops", dict(first_layers=2)),
    "0.5b-loops-random": ("0.5b-loops", dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                             intermediate_size=1024, seed=99)),
}


def shape_cache_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_BENCH_MODELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve", "bench-models")
    return Path(base)


def ensure_shape_model(shape: BenchShape) -> Path:
    """The shape's model directory, written on first use."""
    from pagedserve.bench.streamed_model import build_streamed_model_dir
    from pagedserve.tools.demo_model import build_model_dir

    path = shape_cache_dir() / shape.name
    if not (path / "config.json").exists():
        print(f"writing the random {shape.name} model to {path} (once)", flush=True)
        partial = path.with_name(f"{shape.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        model = dict(shape.model)
        build = build_streamed_model_dir if shape.streamed else build_model_dir
        build(partial, model.pop("arch", "qwen2"), **model)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # a run killed while writing leaves no half model behind
    return path


def ensure_draft_model(name: str) -> Path:
    """The draft ``name`` of ``DRAFTS`` for its target shape (same vocabulary and tokenizer)."""
    import json

    import safetensors.torch
    from pagedserve.tools.demo_model import build_model_dir

    target_name, spec = DRAFTS[name]
    target = ensure_shape_model(SHAPES[target_name])
    path = shape_cache_dir() / name
    if (path / "config.json").exists():
        return path
    partial = path.with_name(f"{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    if "first_layers" in spec:
        keep = spec["first_layers"]
        shutil.copytree(target, partial, ignore=shutil.ignore_patterns("*.safetensors*"))
        config = json.loads((target / "config.json").read_text())
        config["num_hidden_layers"] = keep
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:keep]
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {}
        for file in sorted(target.glob("*.safetensors")):
            for key, value in safetensors.torch.load_file(file).items():
                layer = key.split(".")[2] if key.startswith("model.layers.") else None
                if layer is None or int(layer) < keep:
                    tensors[key] = value
        safetensors.torch.save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    else:
        model = {**SHAPES[target_name].model, **spec}
        build_model_dir(partial, model.pop("arch", "qwen2"), **model)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path
