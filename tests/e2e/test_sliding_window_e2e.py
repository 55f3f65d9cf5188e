"""A model whose every layer attends within a sliding window, served through the real processes
with a cache smaller than one sequence: blocks behind the window go back to the pool and are reused
by the other sequences, and greedy tokens still equal transformers' (scheduler_proc/sliding_window.py).

The cache starts poisoned (NaN) and the null block that freed table entries name is never written:
a kernel that read a freed entry (a stale block now another sequence's, or the null block in a
table sent after a swap-in) would change the tokens."""

from __future__ import annotations

import httpx
import pytest

from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_tokenizer
from support.server import Server, wait_until

pytestmark = pytest.mark.slow

WINDOW, BLOCK, BLOCKS = 8, 4, 12  # 11 usable blocks: 44 tokens, where each sequence reaches 50 or more
NEW_TOKENS = 48


def metric(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_windowed_model_serves_sequences_longer_than_the_cache_at_transformers_parity(
        preemption, model_factory, tmp_path):
    model = model_factory("mistral", sliding_window=WINDOW)
    tok = hf_tokenizer(model)
    text = ("The quick brown fox jumps over the lazy dog. A paged attention engine keeps its cache in "
            "blocks, and a sliding window only looks back so far.")
    ids = tok(text).input_ids
    # Short prompts, so all four start at once; as each grows to its window's 3 blocks, 12 do not fit 11.
    prompts = [ids[:4], ids[4:7], ids[8:12], ids[12:14]]
    assert all(len(p) + NEW_TOKENS > (BLOCKS - 1) * BLOCK for p in prompts)  # none would fit whole
    srv = Server(model, ["--num-gpu-blocks", str(BLOCKS), "--block-size", str(BLOCK), "--max-model-len", "256",
                         "--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--enable-chunked-prefill",
                         "--preemption-mode", preemption, "--swap-space", "0.01",
                         "--poison-kv-cache", "--debug-invariants"]).start(tmp_path)
    try:
        results = greedy_completions(srv, prompts, NEW_TOKENS)
        assert f"every layer attends within {WINDOW} positions: KV blocks behind the window are freed" in srv.log()
        assert_equal_to_transformers(model, prompts, results, NEW_TOKENS)
        # some gave way (by swap: their live blocks only; by recompute) and came back with their window
        assert wait_until(lambda: metric(srv, "pagedserve_num_preemptions_total") > 0, 5)
    finally:
        srv.stop()
