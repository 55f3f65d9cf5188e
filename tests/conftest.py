"""Shared fixtures: random tiny models built once per session, and the transformers oracle."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """build(arch, **overrides) -> model dir, cached per (arch, overrides) for the session."""
    from pagedserve.deploy.demo_model import build_model_dir

    cache: dict = {}

    def build(arch: str = "qwen2", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"model-{arch}")
            cache[key] = str(build_model_dir(path, arch, **overrides))
        return cache[key]

    return build


@lru_cache(maxsize=8)
def _hf(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, tok


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
    """transformers' own greedy continuation: the correctness oracle."""
    import copy

    import torch

    model, _ = _hf(model_dir)
    gen = copy.deepcopy(model.generation_config)
    gen.do_sample, gen.max_new_tokens, gen.pad_token_id = False, max_new_tokens, 0
    if not eos:
        # like ignore_eos: keep going without suppressing the token (None would mean
        # "use the model's default", which stops at EOS)
        gen.eos_token_id = []
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


def hf_tokenizer(model_dir: str):
    return _hf(model_dir)[1]


@pytest.fixture
def tmp_dir(tmp_path) -> Path:
    return tmp_path
