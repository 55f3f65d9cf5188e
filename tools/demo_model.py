"""Builds small random models as real HF model directories (config, safetensors, tokenizer).

No weights can be downloaded, so the demo and the tests make their own: a byte-level BPE
tokenizer trained on a fixed text, a chat template, and random weights from a fixed
seed. They load through the same code path as any model directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

_CORPUS = """
The quick brown fox jumps over the lazy dog. A paged attention engine keeps the key and
value cache in fixed-size blocks, so requests of any length share one pool of memory.
Schedulers admit requests first come, first served; when memory runs short the newest
request is preempted and the oldest keeps running. Hello, world! How are you today?
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Émile ate crème brûlée in Zürich; 東京は大きい。
Ünïcödé, emojis 🙂🚀 and symbols → ← ∑ π keep the detokenizer honest.
def main():\n    return 42\n
"""

# ChatML, plus tools and tool calls written as Qwen2.5 writes them (the hermes format:
# tools listed in the system turn, calls as <tool_call>{"name", "arguments"}</tool_call>,
# tool results as <tool_response> in a user turn), so tool calling is exercised end to end.
# A conversation without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "Function signatures are within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a JSON object with the function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's generation prompt: with enable_thinking false the template writes an empty, closed
# thinking block itself, so the model answers at once (the reasoning parser then reads none).
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
).replace(  # an assistant turn's earlier thinking (reasoning_content), shown as Qwen3's template shows it
    "'<|im_start|>' + message['role'] + '\\n' + message['content']",
    "'<|im_start|>' + message['role'] + '\\n' + _THINKING + message['content']"
).replace("{{- '<|im_start|>assistant' }}", "{{- '<|im_start|>assistant' }}{{- '\\n' + _THINKING if _THINKING }}"
).replace("{%- for message in messages %}",
          "{%- for message in messages %}{%- set _THINKING = ('<think>\\n' + message['reasoning_content'] + "
          "'\\n</think>\\n\\n') if message['reasoning_content'] is defined and message['reasoning_content'] "
          "else '' %}")
assert THINKING_CHAT_TEMPLATE != CHAT_TEMPLATE and "_THINKING +" in THINKING_CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A thinking model's tags, one token each and not special (decoded into the text), as in Qwen3's
# tokenizer: the grammar of a structured request starts after the ``</think>`` token, and a test
# can make a random model close its thinking with one logit_bias entry.
THINK_TOKENS = ["<think>", "</think>"]

# Shapes by family; every one is a few MB in fp32. ``config``: the family's own settings at a
# tiny scale (a config's keyword arguments override them).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen2": dict(cls="Qwen2Config", model_type="qwen2"),
    "llama": dict(cls="LlamaConfig", model_type="llama"),
    "qwen3": dict(cls="Qwen3Config", model_type="qwen3"),
    "mistral": dict(cls="MistralConfig", model_type="mistral"),
    # head_dim 16 (Gemma's default is 256), queries scaled by 24 ** -0.5 rather than 16 ** -0.5,
    # a window of 8 on every other layer, and Gemma 2's soft caps at values random weights reach
    "gemma2": dict(cls="Gemma2Config", model_type="gemma2", norm_init=0.0,  # its norms scale by 1 + weight
                   config=dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                               attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    "gemma3": dict(cls="Gemma3TextConfig", model_type="gemma3_text", norm_init=0.0,
                   config=dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2,
                               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": dict(cls="Phi3Config", model_type="phi3"),
    "olmo2": dict(cls="Olmo2Config", model_type="olmo2"),
    "granite": dict(cls="GraniteConfig", model_type="granite",
                    config=dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                logits_scaling=4.0)),
    # mixtures of experts (expert counts and sizes: build_model_dir's extra config)
    "mixtral": dict(cls="MixtralConfig", model_type="mixtral"),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", model_type="qwen2_moe"),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", model_type="qwen3_moe"),
    # head_dim 16, a window of 8 on every other layer, the hub's YaRN over 64 original positions (2048 /
    # 64 = its factor of 32); biases and
    # attention sinks drawn at random (``bias_std``), so each one changes the tokens
    "gpt_oss": dict(cls="GptOssConfig", model_type="gpt_oss", bias_std=0.5,
                    config=dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                     beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                     original_max_position_embeddings=64))),
    # multi-head latent attention (worker_proc/models/deepseek.py): a latent of 28 + 4 rope dims (32, a width
    # the native prefill kernel tiles), q_lora_rank set in V3 and None in V2; 8 experts in 4 groups, 2 picked
    # from 2 of them, a shared expert, layer 0 dense; V3's correction bias drawn at random (``bias_std``)
    "deepseek_v2": dict(cls="DeepseekV2Config", model_type="deepseek_v2",
                        config=dict(kv_lora_rank=28, q_lora_rank=None, qk_nope_head_dim=12, qk_rope_head_dim=4,
                                    v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                    topk_group=2, topk_method="group_limited_greedy", moe_intermediate_size=32,
                                    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5)),
    "deepseek_v3": dict(cls="DeepseekV3Config", model_type="deepseek_v3", bias_std=0.5,
                        config=dict(kv_lora_rank=28, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=4,
                                    v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                    topk_group=2, moe_intermediate_size=32, n_shared_experts=1,
                                    first_k_dense_replace=1, routed_scaling_factor=2.5)),
    # no native file: served by the transformers backend (worker_proc/models/transformers_backend.py)
    "stablelm": dict(cls="StableLmConfig", model_type="stablelm"),
    "starcoder2": dict(cls="Starcoder2Config", model_type="starcoder2"),
    "cohere": dict(cls="CohereConfig", model_type="cohere"),
    "smollm3": dict(cls="SmolLM3Config", model_type="smollm3"),
    "glm4": dict(cls="Glm4Config", model_type="glm4"),
}


def build_tokenizer(vocab_size: int, chat_template: str = CHAT_TEMPLATE, think_tokens: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS) if think_tokens else vocab_size,  # room for them
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = chat_template
    if think_tokens:
        fast.add_tokens(THINK_TOKENS)
    return fast


def build_model_dir(
    path: str | Path,
    arch: str = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    thinking_template: bool = False,
    initializer_range: float = 0.2,
    norm_std: float = 0.0,
    **extra_config: Any,
) -> Path:
    """Write a random ``arch`` model with a local tokenizer into ``path``; returns it.
    ``thinking_template``: the chat template reads Qwen3's ``enable_thinking``, and ``<think>`` /
    ``</think>`` are tokens of their own.
    ``initializer_range``: the weights' std; 0.2 (wide logits: greedy ties between engines are
    unlikely) unless a bench shape asks for a checkpoint's own (bench/shapes.py).
    ``norm_std``: norm weights drawn around their init value with this std (0: the init value), so
    a norm that scales by the wrong weight (Gemma's 1 + weight) changes the tokens."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {sorted(ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = (build_tokenizer(vocab_size, THINKING_CHAT_TEMPLATE, think_tokens=True) if thinking_template
                 else build_tokenizer(vocab_size))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config_cls = getattr(transformers, ARCHS[arch]["cls"])
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
        **{**ARCHS[arch].get("config", {}), **extra_config},
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _fill_weights(model, seed, config.initializer_range, config.pad_token_id, norm_std,
                  ARCHS[arch].get("norm_init", 1.0), ARCHS[arch].get("bias_std", 0.0))
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    meta = {"pagedserve_demo": True, "arch": arch, "seed": seed}
    (path / "pagedserve_demo.json").write_text(json.dumps(meta))
    return path


def _fill_weights(model: Any, seed: int, std: float, pad_token_id: Optional[int], norm_std: float = 0.0,
                  norm_init: float = 1.0, bias_std: float = 0.0) -> None:
    """Every parameter from our own seeded generator, in name order, with HF's init rules
    (matrices ~ N(0, std), biases 0, norm weights 1, the pad token's embedding 0). The values
    then depend on the seed and the parameter names and shapes only, not on how a transformers
    release initializes (5.24 changed it, and with it every golden trace's model). Norm weights are
    their init value (1, or 0 where the norm scales by 1 + weight), plus noise of ``norm_std``.
    ``bias_std``: biases and attention sinks ~ N(0, bias_std) instead (gpt-oss)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # DeepSeek-V3's e_score_correction_bias is a buffer the checkpoint holds: drawn with the biases
        buffers = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, param in sorted([*model.named_parameters(), *buffers]):  # tied weights appear once
            if bias_std and (name.endswith("bias") or name.endswith("sinks")):
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, bias_std, generator=generator))
            elif name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(norm_init)
                if norm_std:
                    param.add_(torch.empty(param.shape).normal_(0.0, norm_std, generator=generator))
            else:
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
        embeddings = model.get_input_embeddings().weight
        if pad_token_id is not None and 0 <= pad_token_id < embeddings.shape[0]:
            embeddings[pad_token_id].zero_()


def build_demo_model(path: str | Path) -> Path:
    """The embedded default: a small random Qwen2-family model with a chat template."""
    return build_model_dir(
        path, "qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=256, vocab_size=1024, max_position_embeddings=4096, seed=1234,
    )
