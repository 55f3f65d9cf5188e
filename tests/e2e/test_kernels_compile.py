"""Every Triton kernel, the fused elementwise ones and the MLA one too, compiles to a cubin for an H100 (sm_90)
without a GPU present.

The interpreter tests check the maths; this catches what only the real compiler rejects
(loop-carried type changes, dot shapes under 16, unsupported dtype casts). It runs in a
fresh interpreter without TRITON_INTERPRET, which the other kernel tests set process-wide.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE_EVERY_KERNEL = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.kernels import (copy_blocks, fused_norm, fused_rotary, fused_silu_mul, mla_attention, paged_attention,
                               write_kv, zero_blocks)

def compile_for_h100(kernel, pointer_types, constexprs):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "i64" if name.endswith("stride") else "i32")
    indexed = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
    compiled = triton.compile(ASTSource(kernel, signature, indexed), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], kernel.__name__

for dtype in ("bf16", "fp16", "fp32"):
    data = "*" + dtype
    pointers = dict(out_ptr=data, query_ptr=data, k_cache_ptr=data, v_cache_ptr=data, block_tables_ptr="*i32",
                    query_start_loc_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32", part_ptr="*fp32",
                    part_ml_ptr="*fp32")
    long_rows, long_keys = paged_attention.LONG_TILE[4 if dtype == "fp32" else 2][:2]
    for window, group_pad in ((0, 1), (4096, 4)):
        # the short launch, alone or in 4 parts (flash-decoding), and the long launch
        for serves, rows, keys, splits in ((1, 16, 64, 1), (1, 16, 64, 4), (2, long_rows, long_keys, 1)):
            if splits > 1 and dtype != "bf16":  # the parts are float32 whatever the cache
                continue
            compile_for_h100(paged_attention._paged_attention_kernel, pointers, dict(
                SLIDING_WINDOW=window, SERVES=serves, BLOCK_Q=max(rows // group_pad, 1), GROUP_PAD=group_pad,
                BLOCK_N=keys, DIM_PAD=128, DOT_IN_FP32=False, NUM_SPLITS=splits, SOFTCAP=False, SINKS=False))
    # gpt-oss: attention sinks (a float32 logit per head) beside a window, short and split launches
    for serves, rows, keys, splits in ((1, 16, 64, 1), (1, 16, 64, 4)):
        if splits > 1 and dtype != "bf16":
            continue
        compile_for_h100(paged_attention._paged_attention_kernel, {**pointers, "sinks_ptr": "*fp32"}, dict(
            SLIDING_WINDOW=128, SERVES=serves, BLOCK_Q=16, GROUP_PAD=1, BLOCK_N=keys, DIM_PAD=128,
            DOT_IN_FP32=False, NUM_SPLITS=splits, SOFTCAP=False, SINKS=True))
    compile_for_h100(paged_attention._combine_splits_kernel, dict(out_ptr=data, part_ptr="*fp32",
                     part_ml_ptr="*fp32"), dict(NUM_SPLITS=4, SPLITS_PAD=4, DIM_PAD=128))
    # DeepSeek's latent attention: V3's latent (512 + 64), and a narrow one
    for latent, rope in ((512, 64), (28, 4)):
        compile_for_h100(mla_attention._mla_attention_kernel, dict(
            out_ptr=data, query_ptr=data, cache_ptr=data, block_tables_ptr="*i32", query_start_loc_ptr="*i32",
            seq_lens_ptr="*i32", scale_log2="fp32"), dict(
            LATENT=latent, ROPE=rope, LATENT_PAD=max(triton.next_power_of_2(latent), 16),
            ROPE_PAD=max(triton.next_power_of_2(rope), 16), BLOCK_H=mla_attention.BLOCK_H,
            BLOCK_N=mla_attention.BLOCK_N, DOT_IN_FP32=False))
    compile_for_h100(zero_blocks._zero_blocks_kernel, dict(cache_ptr=data, block_ids_ptr="*i32"), dict(CHUNK=4096))
    compile_for_h100(copy_blocks._copy_blocks_kernel, dict(cache_ptr=data, mapping_ptr="*i32"), dict(CHUNK=4096))
    compile_for_h100(write_kv._write_kv_kernel, dict(key_ptr=data, value_ptr=data, k_cache_ptr=data,
                     v_cache_ptr=data, slot_mapping_ptr="*i64"), dict(HEADS_PAD=8, DIM_PAD=128))
    for add in (False, True):
        compile_for_h100(fused_norm._rms_norm_kernel, dict(x_ptr=data, residual_ptr=data, weight_ptr=data,
                         out_ptr=data, eps="fp32"), dict(ADD_RESIDUAL=add, BLOCK=1024))
    compile_for_h100(fused_rotary._rotary_kernel, dict(x_ptr=data, positions_ptr="*i64", cos_ptr=data,
                     sin_ptr=data, out_ptr=data), dict(HEADS_PAD=16, HALF_PAD=64))
    compile_for_h100(fused_silu_mul._silu_mul_kernel, dict(gate_up_ptr=data, out_ptr=data), dict(BLOCK=1024))
print("compiled")
"""


@pytest.mark.slow  # a fresh interpreter, without TRITON_INTERPRET
def test_every_kernel_compiles_for_sm90_in_every_cache_dtype(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_EVERY_KERNEL], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
