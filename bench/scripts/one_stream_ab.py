"""One stream's bfloat16 decode step with the step's fused single-core work on and off, alternating in one process.

A machine that other processes share changes speed from minute to minute, so two runs minutes apart compare the
load as much as the code. Here one model serves one long request, and blocks of decode steps alternate between
the fused forms (gate_up's SiLU gate in the GEMV's parallel region: kernels/cpu_gemv.c gemv_gate_up; the KV write
in one C call: kernels/cpu_write_kv.c) and the forms before them (gate_up's product, then the gate's torch ops;
reference.write_kv), with a read of the step's own weights (the memory's floor at this thread count) between
blocks. Min and median of each: the min is what an uninterrupted step costs.

    python bench/scripts/one_stream_ab.py --threads 2 --blocks 40 --block-steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from pagedserve.runtime.torch_env import apply_torch_env_defaults

apply_torch_env_defaults()  # as a worker does, before torch loads
import torch  # noqa: E402

from pagedserve.bench.shapes import SHAPES, ensure_shape_model
from pagedserve.protocol.messages import AddRequest, SamplingParams, WorkerInit
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.worker_proc.elementwise import NativeElementwise, TorchElementwise
from pagedserve.worker_proc.host_memory import keep_freed_memory
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models import decoder_layer, linear
from step_profile import step_weights


@contextmanager
def unfused():
    """The step's forms before the fusions: gate_up's [gate, up] then the gate's ops; the torch KV write."""
    silu_gate, write_kv = decoder_layer.silu_gate, NativeElementwise.write_kv
    decoder_layer.silu_gate = lambda x, w, ew: ew.silu_mul(linear.linear(x, w), w.gate_size)
    NativeElementwise.write_kv = TorchElementwise.write_kv
    try:
        yield
    finally:
        decoder_layer.silu_gate, NativeElementwise.write_kv = silu_gate, write_kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blocks", type=int, default=40, help="blocks of each form")
    p.add_argument("--block-steps", type=int, default=8, help="decode steps a block")
    ns = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(ns.threads)
    runner = ModelRunner(str(ensure_shape_model(SHAPES[ns.shape])), device="cpu", dtype="bfloat16")
    steps = 2 * ns.blocks * ns.block_steps + 2
    max_len = steps + 64
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=-(-max_len // 16) + 4, max_num_seqs=1,
                          max_num_batched_tokens=2048, max_model_len=max_len)
    runner.init_cache(WorkerInit(block_size=16, num_gpu_blocks=cfg.num_gpu_blocks, num_cpu_blocks=0,
                                 max_model_len=max_len, seed=0))
    sched = Scheduler(cfg)
    sched.add_request(AddRequest(request_id="r0", prompt_token_ids=list(range(3, 11)),
                                 sampling=SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)))
    weights = step_weights(runner)
    total = sum(t.nbytes for t in weights)

    def step() -> float:
        out = sched.schedule()
        start = time.perf_counter()
        result = runner.execute(out)
        took = time.perf_counter() - start
        sched.update_from_output(out, result)
        return took

    def read() -> float:
        start = time.perf_counter()
        for t in weights:
            t.view(torch.int32).amax()
        return time.perf_counter() - start

    for _ in range(2):  # the prefill, and a first decode
        step()
    times: dict[str, list[float]] = {"fused": [], "unfused": [], "floor": []}
    for _ in range(ns.blocks):
        times["floor"].append(read())
        times["fused"] += [step() for _ in range(ns.block_steps)]
        with unfused():
            times["unfused"] += [step() for _ in range(ns.block_steps)]
    floor = min(times["floor"])
    print(f"torch {torch.__version__}, {ns.threads} threads; the step's weights {total / 1e9:.3f} GB")
    for name, values in times.items():
        best, typical = min(values), statistics.median(values)
        share = "" if name == "floor" else f"; the floor is {100 * floor / best:.0f}% of the min"
        print(f"  {name:<8} min {1e3 * best:7.2f} ms ({total / best / 1e9:5.1f} GB/s)  median {1e3 * typical:7.2f} ms "
              f"({total / typical / 1e9:5.1f} GB/s)  {len(values)} runs{share}")


if __name__ == "__main__":
    main()
