"""Issue 54's GPU goals, layer by layer, side by side with bfloat16 in one run: FP8 W8A8 (torch._scaled_mm, the
activations quantized per token as models/fp8_linear.py does) at prefill's rows, and Triton W4A16 / W8A16
(kernels/quantized_gemm.py) at decode's one row, on a 0.5B's and an 8B's projections. Prints one table: median
ms (min-max) of each product and its speed against bfloat16's F.linear.

    python bench/scripts/gpu_quant_bench.py              # a GPU (bench/gpu_session.sh quant)
    python bench/scripts/gpu_quant_bench.py --device cpu --rows 1 --shapes tiny   # a smoke run here (interpreter)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SHAPES = {  # name -> the projections (out, in) of one layer
    "0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "tiny": [(64, 64), (128, 64)],
}


def timed(fn, device, repeats: int) -> list[float]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", default=["0.5b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--prefill-rows", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1, help="decode's rows for the weight-only products")
    p.add_argument("--repeats", type=int, default=20)
    ns = p.parse_args()
    if ns.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from pagedserve.worker_proc.models.fp8_linear import make_fp8
    from pagedserve.worker_proc.models.linear import WeightLayout
    from pagedserve.worker_proc.models.quantized_linear import make_gpu_int

    device = torch.device(ns.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter: correctness only)"
    print(f"{name}; bfloat16; median ms (min-max) of {ns.repeats}")
    print(f"{'shape':6s} {'product':>14s} {'rows':>5s} {'bf16 F.linear':>24s} {'quantized':>24s} {'x bf16':>7s}")
    gen = torch.Generator().manual_seed(0)
    for shape in ns.shapes:
        for n, k in SHAPES[shape]:
            w = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
            cases = []
            scale = w.float().abs().amax(1, keepdim=True).cpu() / 448
            values = (w.float().cpu() / scale).to(torch.float8_e4m3fn).float()
            fp8 = make_fp8(values, scale, torch.bfloat16, WeightLayout(), "token", device=device, scaled_mm=True)
            cases.append(("FP8 W8A8", ns.prefill_rows, fp8.forward))
            group = min(128, k)
            for bits in (4, 8):
                half = 1 << (bits - 1)
                gscale = w.float().abs().reshape(n, k // group, group).amax(-1).cpu() / (half - 1)
                q = (w.float().cpu().reshape(n, k // group, group) / gscale[..., None]).round().clamp(-half, half - 1)
                layer = make_gpu_int(q.reshape(n, k).to(torch.int8), gscale, None, group, bits, device)
                cases.append((f"W{bits}A16 g{group}", ns.rows, layer.forward))
            for label, rows, fn in cases:
                x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
                base = timed(lambda: torch.nn.functional.linear(x, w), ns.device, ns.repeats)
                ours = timed(lambda: fn(x), ns.device, ns.repeats)
                b, o = statistics.median(base), statistics.median(ours)
                print(f"{shape:6s} {label + f' {n}x{k}':>14s} {rows:5d} {b:9.3f} ({min(base):.3f}-{max(base):.3f})"
                      f" {o:9.3f} ({min(ours):.3f}-{max(ours):.3f}) {b / o:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
