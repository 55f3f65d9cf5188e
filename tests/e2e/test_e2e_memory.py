"""Memory pressure through real processes: stale KV, preemption, swap, prefix hits, forks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server, wait_until

pytestmark = pytest.mark.slow

SHARED = "The quick brown fox jumps over the lazy dog. A paged attention engine keeps the key and value cache"
TAILS = [" in blocks.", " for requests of any length.", " so memory is shared.", "!", " Hello, world!",
         " 0 1 2 3 4 5 6 7 8 9", " Émile ate crème brûlée", " def main():"]


def metric(srv: Server, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def tight_server(model_factory, tmp_path_factory):
    # 8 blocks of 16 tokens; each request ends at ~75 tokens (5 blocks, one of them the shared
    # prefix): any two running together outgrow the cache, so the newest is preempted (to
    # host blocks while they last, else recompute), whatever the arrival timing.
    # The whole KV cache starts as NaN: only zeroed or written blocks may ever be read.
    args = ["--num-gpu-blocks", "8", "--swap-space", "0.0005", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "8", "--enable-prefix-caching", "--poison-kv-cache", "--debug-invariants"]
    srv = Server(model_factory("qwen2"), args).start(tmp_path_factory.mktemp("tight"))
    yield srv
    srv.stop()


def test_greedy_tokens_survive_a_nan_poisoned_cache_preemption_swap_and_prefix_hits(tight_server):
    srv = tight_server
    tok = hf_tokenizer(srv.model)
    prompts = [tok(SHARED + t).input_ids for t in TAILS]
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
    name = c.models.list().data[0].id

    def complete(ids):
        r = c.completions.create(model=name, prompt=ids, max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    for ids, text in zip(prompts, texts):
        assert text == tok.decode(hf_greedy(srv.model, ids, 40), skip_special_tokens=True)
    # the counters reach /metrics with the next stats heartbeat (every 0.5 s)
    for name in ("pagedserve_num_preemptions_total", "pagedserve_num_swapped_blocks_total",
                 "pagedserve_prefix_cache_hits_total"):
        assert wait_until(lambda: metric(srv, name) > 0, 5), name


def test_parallel_samples_share_the_prompt_and_each_equal_greedy(tight_server):
    srv = tight_server
    tok = hf_tokenizer(srv.model)
    ids = tok(SHARED + TAILS[1]).input_ids
    r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
        "model": srv.model.rsplit("/", 1)[-1], "prompt": ids, "max_tokens": 10, "temperature": 0, "n": 3,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    expected = tok.decode(hf_greedy(srv.model, ids, 10), skip_special_tokens=True)
    assert [ch["index"] for ch in choices] == [0, 1, 2]
    assert all(ch["text"] == expected for ch in choices)


def test_seeded_sampling_is_reproducible_and_seeds_differ(tight_server):
    srv = tight_server
    body = {"model": srv.model.rsplit("/", 1)[-1], "prompt": SHARED, "max_tokens": 12, "temperature": 1.0,
            "ignore_eos": True}
    texts = [httpx.post(srv.url + "/v1/completions", json={**body, "seed": s}, timeout=120).json()
             ["choices"][0]["text"] for s in (1, 1, 2)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
