"""The correctness oracle: transformers' own model, tokenizer and greedy tokens on the same
weights as the engine under test, loaded once per model dir."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def hf_model_and_tokenizer(model_dir: str):
    """``model_dir``: an HF directory, or a ``.gguf`` file (transformers' GGUF loader dequantizes it)."""
    import transformers

    kwargs = {}
    if model_dir.endswith(".gguf"):
        model_dir, kwargs = str(Path(model_dir).parent), {"gguf_file": Path(model_dir).name}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", **kwargs).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, **kwargs)
    return model, tok


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
    """transformers' own greedy continuation: the correctness oracle."""
    import copy

    import torch

    model, _ = hf_model_and_tokenizer(model_dir)
    gen = copy.deepcopy(model.generation_config)
    gen.do_sample, gen.max_new_tokens, gen.pad_token_id = False, max_new_tokens, 0
    if not eos:
        # like ignore_eos: keep going without suppressing the token (None would mean
        # "use the model's default", which stops at EOS)
        gen.eos_token_id = []
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


def prompt_whose_greedy_output_ends_at_eos(model_dir: str, max_new_tokens: int, min_new_tokens: int = 4,
                                           prompt_len: int = 6, tries: int = 4096) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy output) where generation stops at the model's EOS after at
    least ``min_new_tokens`` tokens: random weights rarely emit EOS from text prompts, so a test of
    EOS stopping must pick a prompt that really reaches it (for some seeds one prompt in
    hundreds does). Deterministic: seeded candidates, tried in batches until one qualifies."""
    import torch

    model, _ = hf_model_and_tokenizer(model_dir)
    eos = model.generation_config.eos_token_id
    candidates = torch.randint(3, model.config.vocab_size, (tries, prompt_len), generator=torch.Generator().manual_seed(0))
    for batch_ids in candidates.split(256):
        with torch.no_grad():  # one batched pass to shortlist, then the single-prompt oracle decides
            batch = model.generate(batch_ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[],
                                   pad_token_id=0)[:, prompt_len:].tolist()
        for ids, out in zip(batch_ids.tolist(), batch):
            if eos in out and out.index(eos) + 1 >= min_new_tokens:
                expected = hf_greedy(model_dir, ids, max_new_tokens, eos=True)
                if expected[-1] == eos and len(expected) >= min_new_tokens:
                    return ids, expected
    raise AssertionError(f"no seeded prompt of {model_dir} reaches EOS within {max_new_tokens} greedy tokens")


def hf_tokenizer(model_dir: str):
    return hf_model_and_tokenizer(model_dir)[1]


def hf_model(model_dir: str):
    return hf_model_and_tokenizer(model_dir)[0]


def hf_embedding(model_dir: str, prompt_ids: list[int], pooling: str, dimensions: int | None = None,
                 normalize: bool = True):
    """transformers' last_hidden_state of ``prompt_ids`` pooled (last token or mean), truncated to
    ``dimensions`` and L2-normalised (unless not): what an embedding from the engine must equal (float32)."""
    import torch

    model, _ = hf_model_and_tokenizer(model_dir)
    with torch.no_grad():
        states = model.model(torch.tensor([prompt_ids])).last_hidden_state[0]
    pooled = states[-1] if pooling == "last" else states.mean(0)
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return (torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled).tolist()
