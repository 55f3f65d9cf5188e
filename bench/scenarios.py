"""``pagedserve bench scenario misaligned|tight-kv``: the seed workloads, each on its own engine.
(``priority|fair|deadline|shedding``: the scheduling policies against fcfs, policy_scenarios.py.)

- ``misaligned``: 6 concurrent requests with prompts of deliberately different lengths,
  50 output tokens each, a cache with room for all. Reports aggregate and per-request
  tok/s against one request alone, end to end (prefill included) and while decoding
  (after the first token), and the preemption count (goal: none; aggregate >= 5x).
- ``tight-kv``: 40 concurrent requests with the KV cache sized for about a third of them.
  Reports that all complete, latency per request in arrival order, preemptions and swaps,
  and the most times any one request was preempted (goal: at most twice).

Both run the offline LLM (scheduler + worker processes) and record the protocol trace,
from which each request's preemptions are counted: a request the workers are sent in
full again (a NewRequestData after its first) was preempted in between.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import Counter

from pagedserve.bench.policy_scenarios import POLICY_SCENARIOS
from pagedserve.bench.report import RequestRecord, latency_table, plot_run, summarize

MISALIGNED_PROMPT_LENS = (7, 33, 90, 170, 260, 411)
BLOCK_SIZE = 16


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=["misaligned", "tight-kv", *POLICY_SCENARIOS])
    p.add_argument("--scheduling-policy", default="fcfs", help="misaligned, tight-kv: the engine's policy")
    p.add_argument("--seconds", type=float, default=20.0, help="policy scenarios: length of each timed run")
    p.add_argument("--model", help="model directory (default: the demo model)")
    p.add_argument("--num-requests", type=int, help="tight-kv: requests (default 40)")
    p.add_argument("--output-len", type=int, default=50)
    p.add_argument("--num-threads", type=int, help="CPU threads of the worker")
    p.add_argument("--log-level", default="WARNING", help="of the engine processes (INFO shows the interval log)")
    p.add_argument("--output-json", help="write the result here")
    p.add_argument("--output-png", help="tight-kv: plot latency per request and queues")
    p.add_argument("--http", action="store_true", help="misaligned: through a pagedserve server started here "
                   "(HTTP frontend, warm; misaligned_http.py) instead of the offline engine")
    p.add_argument("--rounds", type=int, default=5, help="misaligned --http: timed rounds (alone, then six)")
    p.add_argument("--flood-same-loop", action="store_true", help="shedding: send the flood from the admitted "
                   "streams' event loop instead of a client process of its own")
    p.add_argument("--fair-streams", type=int, nargs=2, default=[32, 4], metavar=("A", "B"),
                   help="fair: closed-loop streams of tenants A and B (64 8: B over its 4 fair seats)")
    p.add_argument("--serve-args", default="", help="misaligned --http: extra `pagedserve serve` options")


def records_from(outputs, t0: float) -> list[RequestRecord]:
    out = []
    for i, o in enumerate(outputs):
        times = o.token_times
        out.append(RequestRecord(
            i, len(o.prompt_token_ids), start=o.arrival_time - t0,
            ttft=o.first_token_time - o.arrival_time if o.first_token_time else None,
            e2e=o.finish_time - o.arrival_time if o.finish_time else None, output_tokens=len(o.token_ids),
            itl=[b - a for a, b in zip(times, times[1:])],
            error=o.outputs[0].error if o.finish_reason in ("error", "abort") else None))
    return out


def decode_rate(out) -> float:
    """Tokens after the first over the time from the first to the last: the decode phase."""
    span = out.finish_time - out.first_token_time
    return (len(out.token_ids) - 1) / span if span > 0 else 0.0


def preemptions_per_request(trace_path: str) -> Counter:
    from pagedserve.protocol import messages as m
    from pagedserve.protocol.codec import Decoder
    from pagedserve.protocol.trace import read_trace

    decoder = Decoder(m.SchedulerToWorker)
    sent_in_full: Counter = Counter()
    for direction, payload in read_trace(trace_path).records:
        if direction == "to_worker":
            msg = decoder.decode(payload)
            if isinstance(msg, m.SchedulerOutput):
                sent_in_full.update(r.req_id for r in msg.new_requests)
    return Counter({rid: n - 1 for rid, n in sent_in_full.items()})


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def misaligned(ns: argparse.Namespace, model: str, trace: str) -> dict:
    from pagedserve.offline.llm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [_random_prompt(rng, n) for n in MISALIGNED_PROMPT_LENS]
    sampling = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    with LLM(model, num_threads=ns.num_threads, log_level=ns.log_level, record_trace=trace,
             max_model_len=1024, scheduling_policy=ns.scheduling_policy) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm up
        alone = llm.generate([prompts[3]], sampling, use_tqdm=False)[0]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.refresh_stats()[0]
    alone_tps = len(alone.token_ids) / (alone.finish_time - alone.arrival_time)
    alone_decode = decode_rate(alone)
    records = records_from(outs, t0)
    per_request = [r.output_tokens / r.e2e for r in records]
    per_request_decode = [decode_rate(o) for o in outs]
    aggregate = sum(r.output_tokens for r in records) / wall
    # All six decode together from the step after the shared prefill to the end, so the
    # sum of their decode rates is the batch's decode throughput over that window.
    aggregate_decode = sum(per_request_decode)
    preempted = preemptions_per_request(trace)
    result = {
        "scenario": "misaligned", "prompt_lens": list(MISALIGNED_PROMPT_LENS), "output_len": ns.output_len,
        "alone_tok_s": alone_tps, "aggregate_tok_s": aggregate, "speedup": aggregate / alone_tps,
        "alone_decode_tok_s": alone_decode, "aggregate_decode_tok_s": aggregate_decode,
        "decode_speedup": aggregate_decode / alone_decode,
        "per_request_tok_s": per_request, "per_request_decode_tok_s": per_request_decode,
        "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
        "requests_preempted": sum(1 for n in preempted.values() if n),
    }
    print(f"misaligned: 6 requests, prompts {list(MISALIGNED_PROMPT_LENS)} tokens, {ns.output_len} output tokens each")
    print(f"{'tok/s':<34}{'end-to-end':>12}{'decoding':>12}")
    print(f"{'one request alone (prompt ' + str(MISALIGNED_PROMPT_LENS[3]) + ')':<34}{alone_tps:12.1f}{alone_decode:12.1f}")
    for n, e2e, dec in zip(MISALIGNED_PROMPT_LENS, per_request, per_request_decode):
        print(f"{'  prompt ' + str(n) + ' of the six':<34}{e2e:12.1f}{dec:12.1f}")
    print(f"{'six together, aggregate':<34}{aggregate:12.1f}{aggregate_decode:12.1f}")
    print(f"{'  / one alone':<34}{result['speedup']:11.2f}x{result['decode_speedup']:11.2f}x   (goal >= 5x)")
    print(f"preemptions {result['preemptions']} (goal 0)")
    return result


def tight_kv(ns: argparse.Namespace, model: str, trace: str) -> dict:
    from pagedserve.offline.llm import LLM, SamplingParams

    num = ns.num_requests or 40
    rng = random.Random(1)
    prompt_lens = [rng.randint(24, 72) for _ in range(num)]
    prompts = [_random_prompt(rng, n) for n in prompt_lens]
    blocks_each = [-(-(n + ns.output_len) // BLOCK_SIZE) for n in prompt_lens]
    num_blocks = max(max(blocks_each) + 1, sum(blocks_each) // 3)
    sampling = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    with LLM(model, num_threads=ns.num_threads, log_level=ns.log_level, record_trace=trace,
             num_gpu_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=1024,
             scheduling_policy=ns.scheduling_policy) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.refresh_stats()[0]
    records = records_from(outs, t0)
    preempted = preemptions_per_request(trace)
    for rec, out in zip(records, outs):
        rec.preemptions = preempted.get(out.request_id, 0)
    result = summarize(records, wall)
    completed = sum(1 for o in outs if o.finish_reason == "length")
    result.update({
        "scenario": "tight-kv", "num_requests": num, "num_gpu_blocks": num_blocks,
        "blocks_needed_by_all": sum(blocks_each), "completed_all_tokens": completed,
        "preemptions_recompute": stats.num_preemptions_recompute, "preemptions_swap": stats.num_preemptions_swap,
        "blocks_swapped_out": stats.num_blocks_swapped_out, "blocks_swapped_in": stats.num_blocks_swapped_in,
        "max_preemptions_per_request": max((r.preemptions for r in records), default=0),
        "requests": [vars(r) for r in records],
    })
    print(f"tight-kv: {num} requests, cache {num_blocks} blocks of {BLOCK_SIZE} "
          f"(all of them need {sum(blocks_each)})")
    print(latency_table(result))
    print("latency per request, arrival order (s): " + " ".join(f"{r.e2e or 0:.2f}" for r in records))
    print("preemptions per request, arrival order: " + " ".join(str(r.preemptions) for r in records))
    print(f"completed {completed}/{num}; preemptions: {stats.num_preemptions_recompute} recompute, "
          f"{stats.num_preemptions_swap} swap ({stats.num_blocks_swapped_out} blocks out, "
          f"{stats.num_blocks_swapped_in} in); most per request: {result['max_preemptions_per_request']} (goal <= 2)")
    return result


def main(ns: argparse.Namespace) -> int:
    from pagedserve.deploy.cli import ensure_demo_model

    model = ns.model or str(ensure_demo_model())
    if ns.name in POLICY_SCENARIOS:
        from pagedserve.bench.policy_scenarios import run_policy_scenario

        result = run_policy_scenario(ns, model)
        if ns.output_json:
            with open(ns.output_json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if ns.http:
        if ns.name != "misaligned":
            raise SystemExit("--http: only the misaligned scenario runs through HTTP")
        from pagedserve.bench.misaligned_http import misaligned_http

        result = misaligned_http(ns, model)
        if ns.output_json:
            with open(ns.output_json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    with tempfile.TemporaryDirectory(prefix="pagedserve-scenario-") as tmp:
        trace = os.path.join(tmp, "trace.bin")
        result = misaligned(ns, model, trace) if ns.name == "misaligned" else tight_kv(ns, model, trace)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    if ns.output_png and ns.name == "tight-kv":
        plot_run(result, ns.output_png, title=f"tight-kv: {result['num_requests']} requests, "
                 f"{result['num_gpu_blocks']} blocks")
    return 0
