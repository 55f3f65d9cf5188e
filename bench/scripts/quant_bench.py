"""Quantized checkpoints on CPU against the float model: decode step time at one stream and
prefill throughput through the real Scheduler + ModelRunner (one process), and each projection's
op per row count, side by side: bf16 (oneDNN's packed weight, the float path), W8A16 per channel
(``_weight_int8pack_mm``), W8A16 in groups of 128 (that op once per group), W4A16 g128
(kernels/cpu_gemv_int4.c where the native kernels build, else ``_weight_int4pack_mm_for_cpu``), W8A8
(kernels/cpu_gemm_w8a8.c: per-token int8 activations quantized on entry, an int8 GEMM), and issue 54's
two end-to-end loads (``--workloads``: prefill-heavy, decode-heavy) on bf16 against each scheme; ``w4a16_lm_head``:
W4A16 with lm_head quantized too (the recipe without ``ignore: ["lm_head"]``; the tied shape untied as llm-compressor
does, the embeddings float). ``gguf_q8_0``: the shape's model written as a GGUF Q8_0 file (tools/gguf_model.py, lm_head
tied in Q8_0), served as llama.cpp multiplies it (x quantized per block of 32, kernels/cpu_gemm_q8_0.c);
``gguf_q8_0_widened``: the same file with its integers widened to float32 instead (the same weights, float activations).
``gguf_q4_k_m``: the model written with llama-quantize's Q4_K_M mix (Q4_K / Q6_K, and at the 0.5B's 896 inputs their
fallbacks Q5_0 / Q8_0), every matrix on an integer kernel; ``gguf_q4_k_m_float``: the same file as served before the
k-quants had a kernel (Q4_K, Q6_K and Q5_0 dequantized at load into the serving dtype; Q8_0 still native).

The quantized models are the shape's random model quantized by compressed-tensors
(tools/quantized_model.py), or written as GPTQ / AWQ checkpoints (tools/gptq_awq_model.py: GPTQ 4-bit g128,
the same in activation order, AWQ GEMM g128), once beside it (bench/shapes.py's cache).

    python bench/scripts/quant_bench.py --shape 0.5b --dtype bfloat16
    python bench/scripts/quant_bench.py --ops-only --threads 1
    python bench/scripts/quant_bench.py --build-only   # quantize the shape's model (no timing)
    python bench/scripts/quant_bench.py --models-only --schemes gptq_w4_g128 awq_w4_g128
    python bench/scripts/quant_bench.py --workloads --schemes w8a8 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from pagedserve.runtime.torch_env import apply_torch_env_defaults

apply_torch_env_defaults()  # as a worker does, before torch loads
import torch  # noqa: E402

from pagedserve.bench.shapes import SHAPES, ensure_shape_model, shape_cache_dir  # noqa: E402
from pagedserve.kernels import cpu_quantized  # noqa: E402
from pagedserve.protocol.messages import AddRequest, SamplingParams, WorkerInit  # noqa: E402
from pagedserve.scheduler_proc.config import SchedulerConfig  # noqa: E402
from pagedserve.scheduler_proc.scheduler import Scheduler  # noqa: E402
from pagedserve.worker_proc.model_runner import ModelRunner  # noqa: E402
from pagedserve.worker_proc.models import quantized_linear as ql  # noqa: E402
from step_phases import timed_runs  # noqa: E402

GPTQ_AWQ = {  # tools/gptq_awq_model.quantize_model_dir's arguments
    "gptq_w4_g128": dict(method="gptq"), "gptq_w4_g128_desc_act": dict(method="gptq", desc_act=True),
    "awq_w4_g128": dict(method="awq"),
}
# compressed-tensors' scheme, lm_head quantized too
WITH_LM_HEAD = {"w4a16_lm_head": "w4a16", "w8a16_lm_head": "w8a16", "w8a8_lm_head": "w8a8"}
GGUF = {"gguf_q8_0": "Q8_0", "gguf_q8_0_widened": "Q8_0",  # tools/gguf_model.write_gguf's tensor type
        "gguf_q4_k_m": "Q4_K_M", "gguf_q4_k_m_float": "Q4_K_M"}
NATIVE_BEFORE_K_QUANTS = ("Q8_0", "Q4_0")  # the GGUF types on integer kernels before Q4_K, Q6_K and Q5_0 had one
SCHEMES = ("w8a16", "w8a16_g128", "w4a16", "w8a8", *GPTQ_AWQ, *WITH_LM_HEAD, *GGUF, "fp8_dynamic", "fp8")


def ensure_quantized(shape: str, scheme: str) -> Path:
    from pagedserve.tools import gptq_awq_model, quantized_model

    if scheme in GGUF:
        return _gguf_model_dir(shape, GGUF[scheme])
    path = shape_cache_dir() / f"{shape}-{scheme}"
    if not (path / "config.json").exists():
        print(f"quantizing {shape} by {scheme} into {path} (once)", flush=True)
        partial = path.with_name(path.name + ".partial")
        source = ensure_shape_model(SHAPES[shape])
        if scheme in GPTQ_AWQ:
            gptq_awq_model.quantize_model_dir(source, partial, **GPTQ_AWQ[scheme])
        else:
            quantized_model.quantize_model_dir(source, partial, WITH_LM_HEAD.get(scheme, scheme),
                                               quantize_lm_head=scheme in WITH_LM_HEAD)
        partial.rename(path)
    return path


def _gguf_model_dir(shape: str, tensor_type: str) -> Path:
    """The model directory serve makes of the shape's model written as a GGUF file of ``tensor_type`` (once)."""
    from pagedserve.deploy.serve_config import ServeConfig
    from pagedserve.tools.gguf_model import write_gguf

    path = shape_cache_dir() / f"{shape}-{tensor_type.lower()}.gguf"
    if not path.exists():
        print(f"writing {shape} as GGUF {tensor_type} into {path} (once)", flush=True)
        partial = path.with_name(path.name + ".partial")
        write_gguf(ensure_shape_model(SHAPES[shape]), partial, tensor_type)
        partial.rename(path)
    return Path(ServeConfig(model=str(path), device="cpu").model)


def time_model(model_dir: Path, dtype: str, prefill_tokens: int, decode_steps: int, repeats: int,
               clock=time.perf_counter, widen_q8_0: bool = False, k_quants_in_float: bool = False) -> dict:
    """Median ms of a decode step (one stream) and prefill tokens/s of one prompt in one step, by ``clock``;
    ``widen_q8_0``: a GGUF's Q8_0 layers multiply float activations (gemv_int8_blocks) instead of llama.cpp's;
    ``k_quants_in_float``: a GGUF's types other than NATIVE_BEFORE_K_QUANTS dequantized at load (the old path)."""
    runner = _runner_with_k_quants_in_float(model_dir, dtype) if k_quants_in_float else ModelRunner(str(model_dir),
                                                                                                       dtype=dtype)
    for proj in _projections(runner) if widen_q8_0 else ():
        q = proj.quantized
        if q is not None and q.kind == "q8_0":
            values, scales = q.blocks()
            q.weight, q.kind, q.scales = values.contiguous(), "int8_blocks", scales.float().contiguous()
    block = 16
    cfg = SchedulerConfig(block_size=block, num_gpu_blocks=4096, max_num_seqs=8,
                          max_num_batched_tokens=max(prefill_tokens, 16), max_model_len=4096)
    runner.init_cache(WorkerInit(block_size=block, num_gpu_blocks=4096, num_cpu_blocks=0, max_model_len=4096, seed=0))
    rng = random.Random(0)
    prefill_ms, decode_ms = [], []
    for r in range(repeats):
        sched = Scheduler(cfg)
        prompt = [rng.randrange(3, 1000) for _ in range(prefill_tokens)]
        sampling = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
        sched.add_request(AddRequest(request_id=f"r{r}", prompt_token_ids=prompt, sampling=sampling))
        while sched.has_unfinished():
            out = sched.schedule()
            t0 = clock()
            result = runner.execute(out)
            ms = 1e3 * (clock() - t0)
            sched.update_from_output(out, result)
            (prefill_ms if out.total_num_scheduled_tokens > 1 else decode_ms).append(ms)
    weights = sum(layer.nbytes for layer in _quantized_layers(runner))
    return dict(decode=statistics.median(decode_ms), decode_spread=(min(decode_ms), max(decode_ms)),
                prefill=prefill_tokens / statistics.median(prefill_ms) * 1e3,
                prefill_ms=statistics.median(prefill_ms), qbytes=weights, step_bytes=decode_step_bytes(runner))


def _runner_with_k_quants_in_float(model_dir: Path, dtype: str) -> ModelRunner:
    """The model as loaded before the k-quants had a kernel: the GGUF reader's native types narrowed for the load."""
    from pagedserve.worker_proc import gguf_weights

    native = gguf_weights.NATIVE_TYPES
    gguf_weights.NATIVE_TYPES = {t: native[t] for t in NATIVE_BEFORE_K_QUANTS}
    try:
        return ModelRunner(str(model_dir), dtype=dtype)
    finally:
        gguf_weights.NATIVE_TYPES = native


def _projections(runner: ModelRunner):
    for layer in runner.model.layers:
        yield from (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    yield runner.model.lm_head


# issue 54's two loads: (prompts, prompt tokens low-high, new tokens each)
WORKLOADS = {"prefill-heavy": (32, (8, 256), 32), "decode-heavy": (64, (16, 64), 256)}


def time_workload(model_dir: Path, dtype: str, name: str, clock=time.perf_counter) -> dict:
    """One of WORKLOADS run to the end through the real Scheduler + ModelRunner, every prompt admitted at once:
    the steps' summed time by ``clock`` (s) and the tokens (prompt + generated) per second of it."""
    count, (low, high), new = WORKLOADS[name]
    runner = ModelRunner(str(model_dir), dtype=dtype)
    block = 16
    cfg = SchedulerConfig(block_size=block, num_gpu_blocks=4096, max_num_seqs=count, max_num_batched_tokens=2048,
                          max_model_len=4096)
    runner.init_cache(WorkerInit(block_size=block, num_gpu_blocks=4096, num_cpu_blocks=0, max_model_len=4096, seed=0))
    rng = random.Random(0)
    sched = Scheduler(cfg)
    tokens = 0
    for i in range(count):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(low, high))]
        tokens += len(prompt) + new
        sched.add_request(AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                     sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)))
    seconds = 0.0
    while sched.has_unfinished():
        out = sched.schedule()
        t0 = clock()
        result = runner.execute(out)
        seconds += clock() - t0
        sched.update_from_output(out, result)
    return dict(seconds=seconds, tok_s=tokens / seconds)


def _quantized_layers(runner: ModelRunner):
    for proj in _projections(runner):
        if proj.quantized is not None:
            yield proj.quantized


def decode_step_bytes(runner: ModelRunner) -> int:
    """The weight bytes a one-stream decode step reads: every projection and lm_head once (a float one's
    smallest copy: the step reads one of its layouts), the integers and scales of a quantized one."""
    total = 0
    for proj in _projections(runner):
        if proj.quantized is not None:
            total += proj.quantized.nbytes
        else:
            total += min(t.nbytes for t in (proj.weight, proj.weight_t, proj.packed, proj.panels, proj.gemv_panels)
                         if t is not None)
    return total


def read_bandwidth_gbs(clock, mib: int = 1024) -> float:
    """This machine's read bandwidth at torch's threads: the best of a few sums over ``mib`` MiB, by ``clock``."""
    x = torch.ones(mib * 2**20 // 4)
    best = min(timed_runs(lambda: x.sum(), 5, warmup=1, clock=clock))
    return x.nbytes / best / 1e9


def _min_median_ms(fn, repeats: int) -> tuple[float, float]:
    """(fastest, median) of ``repeats`` calls: on a shared machine the fastest is the op's own
    cost and the median adds the other processes' share."""
    times = timed_runs(fn, repeats, warmup=3)
    return 1e3 * min(times), 1e3 * statistics.median(times)


def ops_table(rows_list: list[int], dtype: torch.dtype, repeats: int) -> None:
    """The 0.5B shape's four projections of one layer, summed, per row count: each quantized
    layer through torch's op ("op") and through a dequantized copy made for the call ("deq")."""
    shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down
    g = torch.Generator().manual_seed(0)
    layers: dict[str, list] = {"bf16 packed" if dtype == torch.bfloat16 else "float": [], "w8a16": [],
                               "w8a16_g128": [], "w4a16": [], "w8a8": [], "w8a8_int_mm": [], "q8_0": [],
                               "int8_g32": []}
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        layers[next(iter(layers))].append(torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
                                          if dtype == torch.bfloat16 else w)
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        q4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        layers["w8a16"].append(ql.make_int8(q8, torch.rand(n, 1), None, None, dtype))
        layers["w8a16_g128"].append(ql.make_int8(q8, torch.rand(n, k // 128), None, 128, dtype))
        q8_0_scales = (torch.rand(n, k // 32) * 0.01).half().float()  # GGUF Q8_0's: float16 values
        layers["q8_0"].append(ql.make_int8(q8, q8_0_scales, None, 32, dtype, q8_0=True))
        layers["int8_g32"].append(ql.make_int8(q8, q8_0_scales, None, 32, dtype))
        layers["w4a16"].append(ql.make_int4(q4, torch.rand(n, k // 128), None, 128, dtype))
        w8a8_scale = torch.rand(n, 1)
        layers["w8a8"].append(ql.make_w8a8(q8, w8a8_scale))  # kernels/cpu_gemm_w8a8.c where it builds
        # the path without native kernels: quantize_per_token, then torch._int_mm on the weight transposed
        layers["w8a8_int_mm"].append(ql.QuantizedLinear("w8a8", n, k, q8.t().contiguous(), w8a8_scale.reshape(1, n)))
    columns = [(next(iter(layers)), None)] + [(f"{name} {path}", path) for name in ("w8a16", "w8a16_g128", "w4a16")
                                              for path in ("op", "deq")] + [("w8a8", None), ("w8a8_int_mm", None),
                                                                            ("q8_0", None), ("int8_g32", None)]
    print(f"one 0.5B layer's projections (qkv, o, gate_up, down), {dtype}, ms: fastest / median, "
          f"threads {torch.get_num_threads()}")
    print(f"{'rows':>6} " + " ".join(f"{name:>17}" for name, _ in columns))
    chosen = ql.dequantize_min_rows
    for rows in rows_list:
        cells = []
        xs = [torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes]
        for name, path in columns:
            ws = layers[name.split(" ")[0] if path else name]
            ql.dequantize_min_rows = (lambda kind, dtype, first=1 if path == "deq" else 10**9: first)
            if name in ("bf16 packed", "float"):
                def fn():
                    for x, w in zip(xs, ws):
                        (torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") if dtype == torch.bfloat16
                         else torch.nn.functional.linear(x, w))
            else:
                def fn():
                    for x, w in zip(xs, ws):
                        w.forward(x)
            cells.append(_min_median_ms(fn, repeats if rows < 64 else max(3, repeats // 6)))
        ql.dequantize_min_rows = chosen
        print(f"{rows:>6} " + " ".join(f"{f'{lo:.2f} / {med:.2f}':>17}" for lo, med in cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES[:4]), choices=SCHEMES)
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--op-repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; on a shared "
                   "machine 1 keeps the timings from waiting on a descheduled thread)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="the models' steps timed by the wall "
                   "clock or by this thread's CPU time (robust to other processes' load; with --threads 1)")
    p.add_argument("--ops-only", action="store_true")
    p.add_argument("--models-only", action="store_true")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS), default=None,
                   help="instead of the tables: these loads (all without a name) on bf16 and each scheme, end to end")
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.build_only:
        for scheme in ns.schemes:
            ensure_quantized(ns.shape, scheme)
        return
    if ns.workloads is not None and {"gguf_q8_0_widened", "gguf_q4_k_m_float"} & set(ns.schemes):
        p.error("--workloads runs each model as served: gguf_q8_0_widened and gguf_q4_k_m_float are decode-step "
                "comparisons (--models-only)")
    if ns.workloads is not None:
        dirs = {"float": ensure_shape_model(SHAPES[ns.shape])} | {s: ensure_quantized(ns.shape, s) for s in ns.schemes}
        clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
        for load in ns.workloads or sorted(WORKLOADS):
            results = {name: time_workload(model_dir, ns.dtype, load, clock) for name, model_dir in dirs.items()}
            base = results["float"]["tok_s"]
            print(f"{ns.shape}, {ns.dtype}, threads {torch.get_num_threads()}, {ns.clock} clock, {load} "
                  f"{WORKLOADS[load]}: " + ", ".join(f"{name} {r['seconds']:.1f} s, {r['tok_s']:.0f} tok/s "
                                                     f"({r['tok_s'] / base:.2f}x)" for name, r in results.items()),
                  flush=True)
        return
    if not ns.models_only:
        ops_table(ns.rows, getattr(torch, ns.dtype), ns.op_repeats)
    if ns.ops_only:
        return
    dirs = {"float": ensure_shape_model(SHAPES[ns.shape])} | {s: ensure_quantized(ns.shape, s) for s in ns.schemes}
    print(f"{ns.shape}, {ns.dtype}, threads {torch.get_num_threads()}, {ns.clock} clock: decode at 1 stream "
          f"(median ms/step, min-max), prefill of {ns.prefill_tokens} tokens in one step")
    clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
    print(f"read bandwidth at {torch.get_num_threads()} threads: {read_bandwidth_gbs(clock):.1f} GB/s (a sum over "
          f"1 GiB, {ns.clock} clock; the weights' GB/s below are the bytes a decode step reads / its time)")
    if ql.int8_blocks_kernel():  # which instructions the W4A16 rows' GEMVs run (the worker's log names them too)
        print(f"int4 GEMV: {cpu_quantized.gemv_int4_variant()} (kernels/cpu_gemv_int4.c)")
    print(f"{'model':<14} {'decode ms':>10} {'(min-max)':>16} {'x float':>8} {'prefill tok/s':>14} "
          f"{'quantized MiB':>18} {'step MiB':>9} {'GB/s':>6}")
    float_decode = None
    for name, model_dir in dirs.items():
        r = time_model(model_dir, ns.dtype, ns.prefill_tokens, ns.decode_steps, ns.repeats, clock,
                       widen_q8_0=name == "gguf_q8_0_widened", k_quants_in_float=name == "gguf_q4_k_m_float")
        lo, hi = r["decode_spread"]
        mib = f"{r['qbytes'] / 2**20:.0f}" if r["qbytes"] else "-"
        float_decode = float_decode or r["decode"]  # dirs' first: the float model, this run's own
        print(f"{name:<14} {r['decode']:>10.2f} {f'({lo:.1f}-{hi:.1f})':>16} {float_decode / r['decode']:>7.2f}x "
              f"{r['prefill']:>14.0f} {mib:>18} {r['step_bytes'] / 2**20:>9.0f} "
              f"{r['step_bytes'] / r['decode'] / 1e6:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
