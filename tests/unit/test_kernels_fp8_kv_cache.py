"""--kv-cache-dtype fp8: keys and values stored as float8 e4m3 (torch's saturating cast, per-tensor scales of
1.0) and widened to the query's dtype by the Triton attention. The kernels against the reference on the same
float8 caches; a real forward through them close to the 16-bit cache's; what refuses it (a CPU's own attention,
serve on a CPU) in one line. Runs under TRITON_INTERPRET=1 on the CPU, or natively on a GPU
(support/kernel_device.py)."""

from support.kernel_device import DEVICE, MARKS, to_device  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import reference, triton_ops
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, random_prompts

pytestmark = MARKS
FP8 = torch.float8_e4m3fn


def test_keys_and_values_are_written_as_the_saturating_cast_and_attended_as_the_reference():
    gen = torch.Generator().manual_seed(3)
    blocks, block_size, kv_heads, dim, q_heads = 6, 4, 2, 32, 4
    seq_lens, q_lens = [9, 13], [3, 1]  # a prefill chunk over cached keys, and a decode
    tokens = sum(q_lens)
    key = torch.randn(tokens, kv_heads, dim, generator=gen).bfloat16() * 200  # some past float8's 448
    value = torch.randn(tokens, kv_heads, dim, generator=gen).bfloat16()
    slots = torch.tensor([6, 7, 8, 4 * 4 + 0])
    caches = {name: torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(FP8) for name in "kv"}
    ours = {name: t.clone() for name, t in caches.items()}
    reference.write_kv(key, value, caches["k"], caches["v"], slots)
    k_d, v_d = to_device(ours["k"], ours["v"])
    triton_ops.write_kv(*to_device(key, value), k_d, v_d, to_device(slots)[0])
    assert torch.equal(k_d.cpu().view(torch.uint8), caches["k"].view(torch.uint8))
    assert torch.equal(v_d.cpu().view(torch.uint8), caches["v"].view(torch.uint8))
    assert caches["k"].float().abs().max() == 448  # saturated, not NaN
    query = torch.randn(tokens, q_heads, dim, generator=gen).bfloat16()
    tables = torch.tensor([[1, 2, 3, 0], [5, 4, 0, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 3, 4], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = reference.paged_attention(query, caches["k"], caches["v"], tables, starts, lens, dim ** -0.5)
    got = triton_ops.paged_attention(*to_device(query, caches["k"], caches["v"], tables, starts, lens), dim ** -0.5)
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_a_forward_on_a_float8_cache_stays_close_to_the_16_bit_caches(tmp_path, monkeypatch):
    """The same model in bfloat16 with each cache: the logits within float8's rounding of K and V (3 mantissa
    bits: up to ~6% of a value). This model's K and V have a median |x| of 0.54 (max 2.5): max |difference| / max
    |logit| 0.038. With scales of 1.0 small values lose more: at weights of std 0.02 (K and V of median 0.11, 7%
    of them below float8's normal range) it was 0.15."""
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    model_dir = str(build_model_dir(tmp_path / "m", "llama", num_layers=2, initializer_range=0.1))
    prompt = random_prompts([10], vocab_size=512, seed=4)[0]
    logits = {}
    for kv in ("auto", "fp8"):
        runner = ModelRunner(model_dir, device=str(DEVICE), dtype="bfloat16", cuda_graphs=False, kv_cache_dtype=kv)
        captured = []
        compute_logits = runner.model.compute_logits
        runner.model.compute_logits = lambda h: captured.append(compute_logits(h).float().cpu()) or captured[-1]
        scheduler = TrivialScheduler(runner)
        scheduler.add("a", prompt, 3, prefill_chunks=[6])
        scheduler.run()
        assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else torch.bfloat16)
        logits[kv] = torch.cat(captured)
    error = (logits["fp8"] - logits["auto"]).abs().max() / logits["auto"].abs().max()
    print("float8 KV cache: max logit difference / max logit", error.item())
    assert 0 < error < 0.06


def test_a_cpus_own_attention_refuses_a_float8_cache_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    model_dir = str(build_model_dir(tmp_path / "m", "llama", num_layers=1))
    with pytest.raises(UnsupportedModelError, match="kv-cache-dtype fp8 runs on a GPU") as err:
        ModelRunner(model_dir, kv_cache_dtype="fp8")
    assert "\n" not in str(err.value)


def test_serve_on_a_cpu_refuses_a_float8_cache_before_starting(tmp_path):
    from pagedserve.deploy.serve_config import ConfigError, ServeConfig

    model_dir = str(build_model_dir(tmp_path / "m", "llama", num_layers=1))
    with pytest.raises(ConfigError, match="runs on a GPU"):
        ServeConfig(model=model_dir, device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_a_float8_cache_swaps_copies_and_zeroes_its_blocks_by_their_bytes(ops):
    """The block operations (swap out, swap in, copy, zero) on a float8 cache: torch has no float8 index ops on
    a CPU, so the cache moves as bytes; every value arrives unchanged and a zeroed block is +0."""
    from pagedserve.worker_proc.kv_cache import KVCache, KVCacheSpec

    module = reference if ops == "reference" else triton_ops
    cache = KVCache(2, 4, 2, 4, KVCacheSpec.per_head(2, 16), FP8, DEVICE, module)
    values = torch.randn(cache.device_cache.shape, generator=torch.Generator().manual_seed(5)).to(FP8)
    cache.device_cache.copy_(values.to(DEVICE))
    cache.apply_block_ops(swap_out=[(1, 0)], swap_in=[], copy=[], zero=[])
    cache.apply_block_ops(swap_out=[], swap_in=[(0, 3)], copy=[(2, 0)], zero=[1])
    got = cache.device_cache.cpu().view(torch.uint8)
    want = values.view(torch.uint8)
    assert torch.equal(got[:, :, 3], want[:, :, 1]) and torch.equal(got[:, :, 0], want[:, :, 2])
    assert torch.equal(got[:, :, 2], want[:, :, 2]) and not got[:, :, 1].any()
