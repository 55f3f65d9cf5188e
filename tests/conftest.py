"""Shared fixtures: random tiny models built once per session, and the transformers oracle."""

from __future__ import annotations

import multiprocessing.process
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

# ---------------------------------------------------------------- the slow mark, enforced
# A test that starts a process (a deployment, LLM, a subprocess, multiprocessing) must be
# marked slow, so `pytest -m "not slow"` stays the fast, single-process suite. Every start is
# recorded against the test being set up, run or torn down (fixtures of any scope included);
# the process still starts, so the test cleans up as usual, and then its report fails.

_running_item = None
_unmarked_starts: dict[str, str] = {}  # node id -> the first process it started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running_item
    _running_item = item
    try:
        yield
    finally:
        _running_item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _unmarked_starts.pop(item.nodeid, None)
    if started is not None and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"UnmarkedSlowTest: {item.nodeid} starts a process ({started}) but is not marked "
                           "slow; add @pytest.mark.slow (docs/CONTRIBUTING.md)")


def _record_start(what: str) -> None:
    item = _running_item
    if item is not None and item.get_closest_marker("slow") is None:
        _unmarked_starts.setdefault(item.nodeid, what[:100])


def pytest_configure(config):
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recorded_popen_init(self, args, *rest, **kwargs):
        _record_start(args if isinstance(args, str) else " ".join(map(str, args)))
        popen_init(self, args, *rest, **kwargs)

    def recorded_process_start(self):
        _record_start(f"multiprocessing {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = recorded_popen_init
    multiprocessing.process.BaseProcess.start = recorded_process_start


def pytest_sessionstart(session):
    """Build the native CPU kernels (a compiler run, cached) before any test, so the in-process
    tests use them as a worker would, and the build is charged to no test (the slow mark)."""
    from pagedserve.kernels import cpu_native

    cpu_native.library()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """build(arch, **overrides) -> model dir, cached per (arch, overrides) for the session."""
    from pagedserve.tools.demo_model import build_model_dir

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


def prompt_whose_greedy_output_ends_at_eos(model_dir: str, max_new_tokens: int, min_new_tokens: int = 4,
                                           prompt_len: int = 6, tries: int = 4096) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy output) where generation stops at the model's EOS after at
    least ``min_new_tokens`` tokens: random weights rarely emit EOS from text prompts, so a test of
    EOS stopping must pick a prompt that really reaches it (for some seeds one prompt in
    hundreds does). Deterministic: seeded candidates, tried in batches until one qualifies."""
    import torch

    model, _ = _hf(model_dir)
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
    return _hf(model_dir)[1]


@pytest.fixture
def tmp_dir(tmp_path) -> Path:
    return tmp_path
