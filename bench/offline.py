"""``pagedserve bench offline``: the offline LLM against vLLM's offline ``LLM`` and
transformers' generate_batch (``--engines``, any subset, in turn order).

Every engine gets the same random prompts (token ids, lengths uniform in a range) and
generates exactly the output length in tokens each (EOS ignored), greedy, in ``--dtype``.
The engines run one after the other, each stopped before the next starts, so they never
share the CPU. vLLM runs in a subprocess of its own environment's interpreter
(``--vllm-python``), ``vllm_runner.py``, which takes the workload and returns token ids
and timings as JSON files. Each engine warms up, then generates the whole workload ``--runs``
times; throughput is generated tokens over wall time from submit to last result, reported
as the median and the spread (min-max) of the runs, with pagedserve's ratio to each peer and
how many of its greedy outputs equal the peer's. ``--shapes tiny,small,0.5b`` runs the
shapes of ``shapes.py`` one after the other and prints them side by side.
``--speculative-config JSON`` runs pagedserve a second time with speculative decoding in the
same invocation and prints both rows with their ratio and acceptance; ``--temperature T``
samples instead of greedy (pagedserve seeded per prompt, vLLM unseeded, its default; tokens are
then not compared): random weights under greedy fall into cycles that prompt lookup predicts,
sampled at temperature 1 they repeat nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from pagedserve.bench.report import cpu_label
from pagedserve.bench.servers import (VLLM_MEMORY_UTILIZATION, VLLM_PYTHON_ENV, add_sampling_args, bench_sampling,
                                             parse_engines, resolve_vllm_python, sampling_label, vllm_env)

RUNNER = Path(__file__).with_name("vllm_runner.py")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model directory (or use --shapes)")
    p.add_argument("--shapes", help="comma-separated built-in shapes instead of a model: tiny, small, 0.5b")
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (median and spread)")
    p.add_argument("--num-prompts", type=int, help="default: the shape's workload, or 64")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] tokens (default: the shape's, or 16 64)")
    p.add_argument("--output-len", type=int, help="default: the shape's workload, or 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default="pagedserve,transformers",
                   help="comma-separated, in turn order: pagedserve, vllm, transformers")
    p.add_argument("--vllm-python", help=f"the python of vLLM's own venv (default: ${VLLM_PYTHON_ENV})")
    p.add_argument("--vllm-memory-utilization", type=float, default=VLLM_MEMORY_UTILIZATION,
                   help="vLLM's gpu_memory_utilization: on a CPU, the share of RAM it reserves")
    p.add_argument("--peer", default="sdpa", help="transformers attn_implementation for generate_batch "
                   "(sdpa = its paged sdpa path; 'none' drops transformers from the engines)")
    p.add_argument("--num-threads", type=int, help="torch threads for both engines (default: each "
                   "engine's own default)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, help="default: the engine's for the device")
    p.add_argument("--num-gpu-blocks", type=int)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda, for both engines")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache of both engines")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="pagedserve's overlapped scheduling (default on)")
    p.add_argument("--speculative-config", metavar="JSON", help="also run pagedserve with this speculative "
                   "config (vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}') and "
                   "print it beside the run without")
    add_sampling_args(p)
    p.add_argument("--repeating-prompts", type=int, default=0, metavar="N", help="each prompt its first N "
                   "tokens over and over (a workload whose outputs may repeat what came before; 0: random)")
    p.add_argument("--no-check", action="store_true", help="skip comparing the engines' tokens")
    p.add_argument("--output-json", help="write the result here")


def make_prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    high = max(vocab - 1, 10)
    return [[rng.randrange(3, high) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def _summary(engine: str, seconds: list[float], token_ids: list[list[int]], **extra) -> dict:
    tokens = sum(len(t) for t in token_ids)
    rates = [tokens / s for s in seconds]
    return {"engine": engine, "runs_tokens_per_s": rates, "tokens_per_s": statistics.median(rates),
            "min_tokens_per_s": min(rates), "max_tokens_per_s": max(rates),
            "generated_tokens": tokens, "token_ids": token_ids, **extra}


def run_pagedserve(ns: argparse.Namespace, model: str, prompts: list[list[int]], output_len: int,
                   speculative_config: str | None = None) -> dict:
    from pagedserve.offline.llm import LLM, SamplingParams

    opts = dict(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,  # None: default
                device=ns.device, dtype=ns.dtype, num_threads=ns.num_threads,
                async_scheduling=ns.async_scheduling, speculative_config=speculative_config)
    if ns.num_gpu_blocks:
        opts["num_gpu_blocks"] = ns.num_gpu_blocks
    temperature = getattr(ns, "temperature", 0.0)
    sampling = [SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True,
                               top_k=getattr(ns, "top_k", 0), top_p=getattr(ns, "top_p", 1.0),
                               seed=ns.seed + i if temperature else None) for i in range(len(prompts))]
    seconds, outputs = [], []
    started = time.perf_counter()
    with LLM(model, **opts) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm up
        first_answer = time.perf_counter() - started
        before = llm.refresh_stats()[0]
        for _ in range(ns.runs):
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            outputs.append([o.token_ids for o in outs])
        stats = llm.refresh_stats()[0]
    idle = stats.worker_idle_time_s - before.worker_idle_time_s
    fwd = stats.worker_forward_time_s - before.worker_forward_time_s
    row = _summary("pagedserve" + (" + speculative" if speculative_config else ""), seconds, outputs[0])
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts:
        accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        proposed = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        row.update(mean_acceptance_length=1 + accepted / drafts, acceptance_rate=accepted / max(proposed, 1))
    row.update(runs_identical=all(o == outputs[0] for o in outputs),
               preemptions=stats.num_preemptions_recompute + stats.num_preemptions_swap,
               worker_idle_pct=100 * idle / (idle + fwd) if idle + fwd else 0.0,
               steps=(stats.step - before.step) // max(ns.runs, 1), first_answer_s=first_answer)
    return row


def run_vllm(ns: argparse.Namespace, model: str, prompts: list[list[int]], output_len: int) -> dict:
    """vLLM's offline LLM in its own interpreter; the workload and the result cross as JSON."""
    spec = {"model": str(Path(model).resolve()), "dtype": ns.dtype, "prompts": prompts, "max_tokens": output_len,
            "temperature": ns.temperature, "top_k": ns.top_k, "top_p": ns.top_p, "runs": ns.runs, "warmup_prompts": 2,
            "engine_args": {"gpu_memory_utilization": ns.vllm_memory_utilization, "max_num_seqs": ns.max_num_seqs,
                            **({"max_num_batched_tokens": ns.max_num_batched_tokens}
                               if ns.max_num_batched_tokens else {})}}
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-vllm-") as tmp:
        in_path, out_path, log_path = (os.path.join(tmp, n) for n in ("in.json", "out.json", "vllm.log"))
        with open(in_path, "w") as f:
            json.dump(spec, f)
        env = vllm_env()
        with open(log_path, "wb") as log:
            # its own session: a bench stopped mid-run takes vLLM's engine core and worker with it
            proc = subprocess.Popen([ns.vllm_python, str(RUNNER), in_path, out_path], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
            try:
                rc = proc.wait()
            finally:
                _stop_group(proc)
        if rc != 0 or not os.path.exists(out_path):
            tail = Path(log_path).read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM ({ns.vllm_python}) exited with {rc}:\n{tail}")
        with open(out_path) as f:
            out = json.load(f)
    return _summary(f"vLLM {out['vllm_version']} LLM", out["seconds"], out["token_ids"],
                    runs_identical=out["runs_identical"], first_answer_s=out["first_answer_s"])


def _stop_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever vLLM left of its group once the runner returned
    except ProcessLookupError:
        pass
    proc.wait()


def run_transformers(ns: argparse.Namespace, model_dir: str, prompts: list[list[int]],
                     output_len: int) -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # persistent_manager warnings
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, ns.dtype), attn_implementation=ns.peer).to(ns.device).eval()
    pad = model.generation_config.pad_token_id or 0
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=pad)
    # generate_batch warms up (a forward of its largest batch) each time it builds a manager:
    # build and warm one, sized for this workload, outside the timed runs, and keep it.
    model.generate_batch(prompts, generation_config=config, persistent_manager=True)
    seconds, token_ids = [], []
    for _ in range(ns.runs):
        start = time.perf_counter()
        results = model.generate_batch(prompts, generation_config=config, persistent_manager=True)
        seconds.append(time.perf_counter() - start)
        # generate_batch returns its results in input order
        token_ids = [list(r.generated_tokens) for r in results.values()]
    model.destroy_cached_continuous_batching_manager()
    return _summary(f"transformers generate_batch ({ns.peer})", seconds, token_ids)


RUNNERS = {"pagedserve": run_pagedserve, "vllm": run_vllm, "transformers": run_transformers}


def bench_one(ns: argparse.Namespace, label: str, model: str, num_prompts: int,
              input_len: tuple[int, int], output_len: int) -> dict:
    with open(f"{model}/config.json") as f:
        vocab = int(json.load(f).get("vocab_size") or 1000)
    prompts = make_prompts(num_prompts, input_len, min(vocab, 1000), ns.seed)
    if getattr(ns, "repeating_prompts", 0):
        prompts = [(p[:ns.repeating_prompts] * len(p))[:len(p)] for p in prompts]
    print(f"{label}: {num_prompts} prompts of {input_len[0]}-{input_len[1]} tokens, {output_len} output "
          f"tokens each, {sampling_label(vars(ns))}, {ns.dtype}, "
          f"{ns.device}, {ns.runs} run(s) per engine; {cpu_label()}", flush=True)
    rows = {engine: RUNNERS[engine](ns, model, prompts, output_len) for engine in ns.engines}
    if ns.speculative_config and "pagedserve" in rows:  # the same workload again, speculating
        rows["pagedserve-spec"] = run_pagedserve(ns, model, prompts, output_len, ns.speculative_config)
    result = {"shape": label, "model": model, "rows": rows, "num_prompts": num_prompts, "ratio": {},
              "identical_outputs": {}, "mean_common_prefix": {}}
    ours = rows.get("pagedserve")
    spec = rows.get("pagedserve-spec")
    if ours is not None and spec is not None:
        result["speculative"] = {"speedup": spec["tokens_per_s"] / ours["tokens_per_s"],
                                 "identical_outputs": sum(a == b for a, b in zip(spec["token_ids"], ours["token_ids"])),
                                 "mean_acceptance_length": spec.get("mean_acceptance_length", 1.0),
                                 "acceptance_rate": spec.get("acceptance_rate", 0.0)}
    for engine, row in rows.items():
        if ours is None or engine.startswith("pagedserve"):
            continue
        result["ratio"][engine] = ours["tokens_per_s"] / row["tokens_per_s"]
        if not ns.no_check:
            pairs = list(zip(ours["token_ids"], row["token_ids"]))
            result["identical_outputs"][engine] = sum(a == b for a, b in pairs)
            # in half precision two engines part at the first near-tie: how far they agree says more
            result["mean_common_prefix"][engine] = statistics.fmean(_common_prefix(a, b) for a, b in pairs)
    print(format_rows([result]), flush=True)
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def format_rows(results: list[dict]) -> str:
    """One row per engine; a peer's row carries pagedserve's ratio to it, the greedy outputs that
    equal pagedserve's and the mean number of leading tokens they share."""
    lines = [f"{'shape':<8} {'engine':<36} {'median tok/s':>12} {'min-max':>15} {'ours/it':>7} {'identical':>9}"
             f" {'prefix':>6} {'1st answer':>10}"]
    for r in results:
        for engine, row in r["rows"].items():
            spread = f"{row['min_tokens_per_s']:.1f}-{row['max_tokens_per_s']:.1f}"
            ratio = f"{r['ratio'][engine]:.2f}x" if engine in r["ratio"] else ""
            same = f"{r['identical_outputs'][engine]}/{r['num_prompts']}" if engine in r["identical_outputs"] else ""
            prefix = f"{r['mean_common_prefix'][engine]:.1f}" if engine in r.get("mean_common_prefix", {}) else ""
            first = f"{row['first_answer_s']:.1f} s" if "first_answer_s" in row else ""
            lines.append(f"{r['shape']:<8} {row['engine']:<36} {row['tokens_per_s']:12.1f} {spread:>15} "
                         f"{ratio:>7} {same:>9} {prefix:>6} {first:>10}")
        spec = r.get("speculative")
        if spec:
            lines.append(f"{'':<8} speculative / plain: {spec['speedup']:.2f}x tokens per second, mean acceptance "
                         f"length {spec['mean_acceptance_length']:.2f}, acceptance rate "
                         f"{100 * spec['acceptance_rate']:.1f}%, outputs identical {spec['identical_outputs']}"
                         f"/{r['num_prompts']}")
        ours = r["rows"].get("pagedserve")
        if ours:
            lines.append(f"{'':<8} pagedserve: worker idle {ours['worker_idle_pct']:.1f}% of step, "
                         f"{ours['steps']} steps per run, preemptions {ours['preemptions']}, "
                         f"runs identical: {ours['runs_identical']}")
    lines.append(f"{'':<8} (prefix: mean leading tokens equal to pagedserve's; 1st answer: the engine's start, "
                 "in this process for pagedserve, as a new process for vLLM, to its warm-up's answer)")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    from pagedserve.bench.shapes import SHAPES, ensure_shape_model
    from pagedserve.runtime.options import resolve_device

    ns.device = resolve_device(ns.device)
    ns.engines = [e for e in parse_engines(ns.engines) if not (e == "transformers" and ns.peer == "none")]
    ns.vllm_python = resolve_vllm_python(ns.engines, ns.vllm_python)
    if bench_sampling(ns, ns.engines)["temperature"] > 0:
        ns.no_check = True  # sampled tokens of two random streams are not comparable

    if ns.shapes:
        names = [s.strip() for s in ns.shapes.split(",") if s.strip()]
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            raise SystemExit(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
        # a GPU needs a larger workload than a CPU's shape defaults: the flags override them
        jobs = [(n, str(ensure_shape_model(SHAPES[n])), ns.num_prompts or SHAPES[n].num_prompts,
                 tuple(ns.input_len or SHAPES[n].input_len), ns.output_len or SHAPES[n].output_len)
                for n in names]
    elif ns.model:
        jobs = [("model", ns.model, ns.num_prompts or 64, tuple(ns.input_len or (16, 64)), ns.output_len or 64)]
    else:
        raise SystemExit("give a model directory or --shapes")
    results = [bench_one(ns, *job) for job in jobs]
    if len(results) > 1:
        print(f"\nall shapes ({cpu_label()}):\n" + format_rows(results))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"cpu": cpu_label(), "results": [
                {**r, "rows": {e: {k: v for k, v in row.items() if k != "token_ids"} for e, row in r["rows"].items()}}
                for r in results]}, f, indent=2)
    return 0
