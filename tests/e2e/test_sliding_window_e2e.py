"""A model whose every layer attends within a sliding window, served through the real processes
with a cache smaller than one sequence: blocks behind the window go back to the pool and are reused
by the other sequences, and greedy tokens still equal transformers' (scheduler_proc/sliding_window.py).

The cache starts poisoned (NaN) and the null block that freed table entries name is never written:
a kernel that read a freed entry (a stale block now another sequence's, or the null block in a
table sent after a swap-in) would change the tokens."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.greedy import assert_equal_to_transformers, client, streamed_completion
from support.oracle import hf_tokenizer
from support.server import Server, wait_until

pytestmark = pytest.mark.slow

WINDOW, BLOCK, BLOCKS = 8, 4, 10  # 9 usable blocks, 36 tokens, where each sequence reaches 50 or more
LOW_TOKENS, URGENT_TOKENS = 480, 48  # the low ones still decode when the urgent one comes


def metric(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_windowed_model_serves_sequences_longer_than_the_cache_at_transformers_parity(
        preemption, model_factory, tmp_path):
    """Three low-priority sequences hold their windows (3 blocks each: all 9); an urgent one arriving
    while they decode preempts one, which comes back (by swap: its live blocks, its table naming the
    null block where blocks were freed) and finishes with transformers' tokens."""
    model = model_factory("mistral", sliding_window=WINDOW)
    tok = hf_tokenizer(model)
    ids = tok("The quick brown fox jumps over the lazy dog. A paged attention engine keeps its cache").input_ids
    prompts = [ids[:4], ids[4:7], ids[8:12], ids[12:14]]
    assert all(len(p) + URGENT_TOKENS > (BLOCKS - 1) * BLOCK for p in prompts)  # none would fit whole
    srv = Server(model, ["--num-gpu-blocks", str(BLOCKS), "--block-size", str(BLOCK), "--max-model-len", "512",
                         "--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--enable-chunked-prefill",
                         "--scheduling-policy", "priority", "--preemption-mode", preemption, "--swap-space", "0.01",
                         "--poison-kv-cache", "--debug-invariants"]).start(tmp_path)
    try:
        c = client(srv)
        name = c.models.list().data[0].id

        started = [threading.Event() for _ in range(3)]

        def complete(ids, priority, max_tokens, started=None):
            return streamed_completion(c, name, ids, priority, max_tokens, started)

        with ThreadPoolExecutor(len(prompts)) as pool:
            low = [pool.submit(complete, p, 1, LOW_TOKENS, event) for p, event in zip(prompts[:3], started)]
            assert all(event.wait(60) for event in started)  # all three decode: their windows fill the cache
            urgent = pool.submit(complete, prompts[3], 0, URGENT_TOKENS)
            low_results, urgent_result = [f.result() for f in low], urgent.result()
        assert wait_until(lambda: metric(srv, "pagedserve_num_preemptions_total") > 0, 5), srv.log()[-3000:]
        assert f"every layer attends within {WINDOW} positions: KV blocks behind the window are freed" in srv.log()
        assert_equal_to_transformers(model, prompts[:3], low_results, LOW_TOKENS)
        assert_equal_to_transformers(model, prompts[3:], [urgent_result], URGENT_TOKENS)
    finally:
        srv.stop()
