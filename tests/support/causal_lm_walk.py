"""Every causal LM transformers maps, built tiny and random, through the transformers backend against
transformers' own greedy tokens: how many serve at parity, and why the others do not.

Run as a script for the full report: ``python tests/support/causal_lm_walk.py [NAME_FILTER]``.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

NEW_TOKENS = 6
MAX_PARAMS = 25_000_000
PROMPT_LENGTHS = (7, 3)
# A tiny shape for any config: the names a config does not have are left out.
TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    first_k_dense_replace=1, num_kv_shared_layers=0,
    intermediate_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # mixtures of experts, latent attention, hybrids: few and small
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    tie_word_embeddings=False, initializer_range=0.2,
    # GPT-J, CodeGen; BERT-style and BART-style decoders; GPT-Neo's layer pattern
    rotary_dim=8, is_decoder=True, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
    encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, attention_types=[[["global", "local"], 1]],
    vocab_size_per_layer_input=512, hidden_size_per_layer_input=16, default_language="en_XX",
)


@dataclass
class Outcome:
    name: str
    ok: bool
    reason: str = ""
    seconds: float = 0.0


def causal_lm_classes(pattern: str = "") -> list[type]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = []
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        for name in (value,) if isinstance(value, str) else value:
            if name not in names and re.search(pattern, name, re.I):
                names.append(name)
    return [getattr(transformers, n) for n in names if hasattr(transformers, n)]


def tiny_config(cls: type):
    """``cls``'s config class's defaults with TINY's sizes."""
    defaults = cls.config_class()
    values = {k: v for k, v in TINY.items() if _settable(defaults, k)}
    if "kv_lora_rank" in values:  # latent attention: every head has its own keys and values
        values["num_key_value_heads"] = values["num_attention_heads"]
    config = cls.config_class(**values)
    config.architectures = [cls.__name__]
    return config


def tiny_model(cls: type, seed: int = 0):
    """A 2-layer random float32 ``cls`` from its config class's defaults and TINY."""
    from pagedserve.tools.demo_model import _fill_weights

    config = tiny_config(cls)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:  # sub-configs or sizes TINY does not name: too big to walk in minutes
        raise ValueError(f"{size / 1e6:.0f}M parameters at the tiny shape")
    model = cls(config).float().eval()
    _fill_weights(model, seed, 0.2, 0)
    return model


def _settable(config, name: str) -> bool:
    """Not a derived property (Falcon's head_dim, xLSTM's v_head_dim) or a per-layer one (Gemma 4's head_dim)."""
    attribute = getattr(type(config), name, None)
    if isinstance(attribute, property) and attribute.fset is None:
        return False
    try:
        getattr(config, name)
    except Exception:
        return False
    return True


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def check(cls: type, workdir: Path, new_tokens: int = NEW_TOKENS) -> Outcome:
    """Build ``cls`` tiny, serve it in process through the backend, compare greedy tokens with generate()."""
    from pagedserve.worker_proc.model_config import UnsupportedModelError
    from pagedserve.worker_proc.model_runner import ModelRunner
    from support.worker_harness import TrivialScheduler, random_prompts

    from pagedserve.worker_proc.models.transformers_backend import load_backend_spec

    started = time.perf_counter()
    name = cls.__name__
    path = workdir / name
    try:  # what the config alone refuses is refused before the model is built (RWKV's looks for a compiler)
        tiny_config(cls).save_pretrained(path)
        load_backend_spec(path)
    except UnsupportedModelError as exc:
        _remove(path)
        return Outcome(name, False, f"refused: {exc}", time.perf_counter() - started)
    except Exception:
        pass  # the model's build below says why
    try:
        model = tiny_model(cls)
    except Exception as exc:  # a config the tiny shape does not fit: not the backend's failure
        return Outcome(name, False, f"tiny model not built: {one_line(exc)}", time.perf_counter() - started)
    prompts = random_prompts(list(PROMPT_LENGTHS), vocab_size=min(512, model.config.vocab_size), seed=1)
    try:
        model.save_pretrained(path)
        expected = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                                     min_new_tokens=new_tokens)
                expected.append(out[0, len(prompt):].tolist())
    except Exception as exc:
        return Outcome(name, False, f"transformers itself fails: {one_line(exc)}", time.perf_counter() - started)
    del model
    try:
        runner = ModelRunner(str(path), model_impl="transformers")
        scheduler = TrivialScheduler(runner, block_size=4, num_gpu_blocks=64)
        scheduler.add("a", prompts[0], new_tokens, prefill_chunks=[4])
        scheduler.add("b", prompts[1], new_tokens, arrival_step=1)
        got = scheduler.run()
    except UnsupportedModelError as exc:
        return Outcome(name, False, f"refused: {exc}", time.perf_counter() - started)
    except Exception as exc:
        return Outcome(name, False, f"error: {one_line(exc)}", time.perf_counter() - started)
    finally:
        _remove(workdir / name)
    if [got["a"], got["b"]] != expected:
        return Outcome(name, False, f"tokens differ: {[got['a'], got['b']]} != {expected}", time.perf_counter() - started)
    return Outcome(name, True, "", time.perf_counter() - started)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def walk(pattern: str = "", new_tokens: int = NEW_TOKENS, log=None, part: int = 0, parts: int = 1) -> list[Outcome]:
    """``part`` of ``parts``: every parts-th class from the part-th, so the walk can run in pieces."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    outcomes = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread costs more than it gives
    with tempfile.TemporaryDirectory() as tmp:
        for cls in causal_lm_classes(pattern)[part::parts]:
            try:
                outcome = check(cls, Path(tmp), new_tokens)
            except Exception as exc:  # the walk reports, it does not stop
                outcome = Outcome(cls.__name__, False, f"walk error: {one_line(exc)}")
            outcomes.append(outcome)
            if log is not None:
                log(f"{'ok  ' if outcome.ok else 'FAIL'} {outcome.name} ({outcome.seconds:.1f}s) {outcome.reason}")
    torch.set_num_threads(threads)
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    passed = [o.name for o in outcomes if o.ok]
    lines = [f"{len(passed)} of {len(outcomes)} causal LMs serve at parity through the transformers backend"]
    lines += [f"  {o.name}: {o.reason}" for o in outcomes if not o.ok]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    results = walk(sys.argv[1] if len(sys.argv) > 1 else "", log=lambda line: print(line, flush=True))
    print(report(results))
