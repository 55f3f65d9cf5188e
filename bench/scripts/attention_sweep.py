"""Time the Triton paged-attention kernel over tile shapes on the steps a serving run makes.

    python bench/scripts/attention_sweep.py                  # on CUDA: every config, every workload
    python bench/scripts/attention_sweep.py --configs default 16:32:4:3/16:32:4:3

A config is SHORT/LONG, each ROWS:KEYS:WARPS:STAGES: the tile of the launch for requests of a
few tokens (decodes) and of the one for longer ones (prompts): query rows, keys per step,
Triton's num_warps and num_stages. "default" is what the engine launches; 16:32:4:3/16:32:4:3
is the kernel before the two launches (one shape for every request). A suffix @N cuts each
decode's keys into N parts in steps of decodes only (flash-decoding; the other steps ignore it). The workloads are one layer of Qwen3-0.6B's attention (16 query and
8 kv heads of 128, bfloat16, 16-token blocks, block tables shuffled as a long-running cache
leaves them): a step of 256 or 16 decodes at ``--context`` keys, and a step mixing 16 prompts
of 512 tokens with 240 such decodes. Each config's output is checked against the default's
(a config that breaks the kernel shows a large difference). Read-side bandwidth counts the K
and V bytes a decode must read once, against one large device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kernels_bench import copy_bandwidth  # this folder's; a script's own folder is on sys.path
from pagedserve.kernels.paged_attention import paged_attention

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def make_step(decodes: int, prompts: int, prompt_len: int, context: int, device, generator):
    """(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, kv bytes to read)."""
    lens_q = [prompt_len] * prompts + [1] * decodes
    seq_lens = [prompt_len] * prompts + [context + 1] * decodes
    blocks_each = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_each) + 64
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device, generator=generator)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device, generator=generator)
    order = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    width = max(blocks_each)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(blocks_each):
        tables[b, :n] = order[used:used + n]
        used += n
    starts = [0]
    for n in lens_q:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=generator)
    kv_bytes = sum(seq_lens) * 2 * KV_HEADS * HEAD_DIM * 2
    return (query, k_cache, v_cache, tables, torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), kv_bytes)


def time_ms(fn, iters: int, rounds: int) -> list[float]:
    """ms a call, from replays of one CUDA graph of ``iters`` calls, as the engine replays its decode
    steps: timed call by call from Python, a small step measures the kernel's launch instead
    (0.08 ms for one decode as for 16, bench/log/2026-11-28.md "GPU: speculative decoding on an H200")."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / iters)
    return times


def parse_config(text: str) -> dict:
    text, _, splits = text.partition("@")
    launch = dict(decode_splits=int(splits)) if splits else {}
    if text != "default":
        short, long = (tuple(int(x) for x in part.split(":")) for part in text.split("/"))
        launch["tiles"] = (short, long)
    return launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=[
        "default", "16:32:4:3/16:32:4:3", "16:128:4:2/128:64:8:2", "16:64:4:2/128:64:8:3", "16:64:4:2/128:64:4:2",
        "16:64:4:2/128:32:4:2", "16:64:4:2/64:64:4:2", "16:64:4:2/128:128:8:2", "16:64:4:2/64:32:4:3",
        "default@2", "default@4", "default@8", "default@16"])
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    copy_gbs = copy_bandwidth(device, 2048, 5) / 1e9
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)")
    workloads = {
        "256 decodes": make_step(256, 0, 0, ns.context, device, generator),
        "16 decodes": make_step(16, 0, 0, ns.context, device, generator),
        "1 decode": make_step(1, 0, 0, ns.context, device, generator),
        "16x512 prompt + 240 decodes": make_step(240, 16, 512, ns.context, device, generator),
        "16x512 prompt": make_step(0, 16, 512, ns.context, device, generator),
    }
    scale = HEAD_DIM ** -0.5
    for name, (*args, kv_bytes) in workloads.items():
        reference = paged_attention(*args, scale)
        print(f"\n{name}, context {ns.context}: KV {kv_bytes / 1e6:.1f} MB")
        print(f"{'config':>21} {'median ms':>10} {'range':>17} {'KV GB/s':>8} {'of copy':>8} {'max diff':>9}")
        for text in ns.configs:
            label, launch = text, parse_config(text)
            try:
                out = paged_attention(*args, scale, **launch)
                diff = (out.float() - reference.float()).abs().max().item()
                times = time_ms(lambda: paged_attention(*args, scale, **launch), ns.iters, ns.rounds)
            except Exception as error:  # a config Triton cannot build (shared memory, registers)
                print(f"{label:>21} failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            ms = statistics.median(times)
            gbs = kv_bytes / ms / 1e6
            print(f"{label:>21} {ms:10.4f} {min(times):8.4f}-{max(times):8.4f} {gbs:8.0f} {gbs / copy_gbs:7.1%}"
                  f" {diff:9.2e}")


if __name__ == "__main__":
    main()
