"""First come, first served under a tight cache, proven from the server's own record (the
protocol trace it writes), not from the order clients see answers in: client threads reach the
server in their own order, and requests that end in one step reach their clients in any order.

The seed-001 workload (shared/seeds/001): 40 concurrent requests into 112 blocks of 16 tokens, so
the newest give way while the oldest keep going, sent 2 ms apart (an issue's client sent them 20 ms
apart). Each prompt is one block and the other fifteen come from decoding: every request is
admitted on its one block, and the cache runs out as soon as seven of them grow to full length.
A request lives 240 steps, so that many overlap at any server speed, even at 20 ms apart. (With
64-token prompts and 64 output tokens, 8 blocks each, whether 15 overlapped depended on the
server's speed: a faster CI machine finished the early ones before the late ones arrived.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.server import Server

from pagedserve.protocol.trace import read_trace
from pagedserve.tools.trace_show import summarize, summarize_trace

pytestmark = pytest.mark.slow

NUM_REQUESTS, GAP_S, PROMPT_TOKENS, OUTPUT_TOKENS = 40, 0.002, 16, 240  # 256 tokens = 16 blocks each


@pytest.fixture(scope="module")
def recorded(model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fcfs")
    trace = tmp / "seed001.trace"
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "112", "--block-size", "16",
                                          "--record-trace", str(trace)]).start(tmp)
    statuses: dict[int, int] = {}

    def send(i: int) -> None:
        prompt = [(7 * i + j) % 500 + 3 for j in range(PROMPT_TOKENS)]
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True})
        statuses[i] = r.status_code if r.status_code == 200 else (r.status_code, r.text[:300])

    try:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(NUM_REQUESTS)]
        start = time.monotonic()
        for i, t in enumerate(threads):
            time.sleep(max(0.0, start + i * GAP_S - time.monotonic()))  # the workload's arrival schedule
            t.start()
        for t in threads:
            t.join()
    finally:
        srv.stop()
    assert statuses == {i: 200 for i in range(NUM_REQUESTS)}
    return trace


def test_first_tokens_follow_arrival_order_exactly(recorded):
    records = list(summarize_trace(read_trace(recorded)).requests_by_id.values())
    assert [r.arrival for r in records] == list(range(NUM_REQUESTS))
    first_tokens = [r.first_token_step for r in records]
    assert min(first_tokens) >= 0 and all(r.last_step >= r.first_token_step for r in records)
    assert first_tokens == sorted(first_tokens), first_tokens  # ties: one step's prompts together


def test_every_preemption_victim_is_the_newest_running_request(recorded):
    summary = summarize_trace(read_trace(recorded))
    records = summary.requests_by_id
    preemptions = {(step, r.req_id) for r in records.values() for step in r.preempted_steps}
    assert preemptions, "the workload no longer preempts: the cache is not tight"
    for step, dropped, held in summary.drops:
        for victim in (d for d in dropped if (step, d) in preemptions):
            newer_kept = [h for h in held if records[h].arrival > records[victim].arrival]
            assert not newer_kept, f"step {step}: {victim} preempted while newer {newer_kept} kept running"


def test_trace_show_prints_each_requests_record(recorded):
    text = summarize(str(recorded), per_request=True)
    lines = text.split("requests (arrival order):\n")[1].splitlines()
    assert len(lines) == NUM_REQUESTS and "first token at step" in lines[0] and "arrival #0" in lines[0]
    assert " tp=1 " in text  # the recorded config's tensor_parallel_size (tp=None before)
