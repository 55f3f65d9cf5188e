"""Block-table entries freed behind a sliding window are never read, by any attention path.

The scheduler frees a sequence's blocks that lie wholly before ``first query - window`` and names
the null block in their place (scheduler_proc/sliding_window.py); the workers' own copies keep the
old ids, which another sequence may since fill. Here every such entry points at a block of NaN,
as the never-written null block is under ``--poison-kv-cache``: the Triton kernel (interpreted on
CPU, or on a GPU), the native CPU decode kernel, the gather + SDPA decode path and the SDPA prefill
chunks must each give the reference's answer over the intact tables, with no NaN.
"""

from support.kernel_device import MARKS, to_device  # first: it decides TRITON_INTERPRET before triton loads

import pytest
import torch

from pagedserve.kernels import cpu_native, reference, triton_ops
from pagedserve.worker_proc.attention import attend, plan_cpu_attention
from pagedserve.worker_proc.decode_attention import GatherWorkspace

from support.attention import nan_cache_with_requests

BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS = 4, 16, 2, 4
# (seq_len, tokens computed this step): decodes far past the window, a chunk after cached context
# (its queries reach back a window from its first position), a fresh prompt, a short decode.
BATCH = [(41, 1), (30, 1), (37, 9), (12, 12), (6, 1), (64, 1)]


def blocks_behind(position: int, window: int) -> int:  # the scheduler's rule (sliding_window.blocks_behind)
    return max(0, (position - window) // BLOCK)


def batch_with_freed_entries(window: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [n for n, _ in BATCH]
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, KV_HEADS, generator, BLOCK, HEAD_DIM, 96)
    owned = set(tables.flatten().tolist())
    null = next(b for b in range(k_cache.shape[0]) if b not in owned)  # all NaN, like the poisoned null block
    freed = tables.clone()
    for b, (seq_len, scheduled) in enumerate(BATCH):
        freed[b, :blocks_behind(seq_len - scheduled, window)] = null
    assert (freed != tables).sum() >= 10
    starts = [0]
    for _, scheduled in BATCH:
        starts.append(starts[-1] + scheduled)
    query = torch.randn(starts[-1], Q_HEADS, HEAD_DIM, generator=generator)
    key = torch.empty(starts[-1], KV_HEADS, HEAD_DIM)  # this step's rows, as written to the cache
    value = torch.empty_like(key)
    for b, (seq_len, scheduled) in enumerate(BATCH):
        for i, pos in enumerate(range(seq_len - scheduled, seq_len)):
            slot = (int(tables[b, pos // BLOCK]), pos % BLOCK)
            key[starts[b] + i], value[starts[b] + i] = k_cache[slot], v_cache[slot]
    return (query, key, value, k_cache, v_cache, tables, freed, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32))


@pytest.mark.parametrize("window", [1, 5, 8])
def test_the_triton_kernel_never_reads_a_freed_entry(window):
    query, _, _, k_cache, v_cache, tables, freed, starts, lens = batch_with_freed_entries(window, seed=window)
    expected = reference.paged_attention(query, k_cache, v_cache, tables, starts, lens, 0.25, window)
    for splits in (1, 3):
        got = triton_ops.paged_attention(*to_device(query, k_cache, v_cache, freed, starts, lens), 0.25, window,
                                         decode_splits=splits).cpu()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("decode_path", ["native", "torch"])
@pytest.mark.parametrize("window", [1, 5, 8])
def test_the_cpu_paths_never_read_a_freed_entry(window, decode_path, monkeypatch):
    if decode_path == "native" and cpu_native.library() is None:
        pytest.skip("native CPU kernels are not built on this machine (no C compiler)")
    if decode_path == "torch":
        monkeypatch.setattr(cpu_native, "supports_decode", lambda *_: False)
    query, key, value, k_cache, v_cache, tables, freed, starts, lens = batch_with_freed_entries(window, seed=window)
    expected = reference.paged_attention(query, k_cache, v_cache, tables, starts, lens, 0.25, window)
    scheduled = [n for _, n in BATCH]
    plan = plan_cpu_attention(scheduled, starts.tolist(), lens.tolist(), freed, BLOCK, GatherWorkspace())
    got = attend(reference, query, key, value, k_cache, v_cache, freed, starts, lens, 0.25, window, plan)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
