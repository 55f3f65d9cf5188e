"""Q4_K and Q6_K blocks made from float rows, for GGUF files of small random models (tools/gguf_model.py).

The ``gguf`` package dequantizes the k-quants but has no quantizer for them, and llama.cpp's ``llama-quantize``
is a build the tests cannot count on. These encoders make valid blocks by the simplest rule that keeps a random
model's greedy tokens meaningful (per sub-block min / max, rounded to nearest); they are not llama.cpp's
searched quantizers, and need not be: a file's weights are whatever its blocks decode to, and the oracle
(transformers' GGUF loader) reads them back through ``gguf.quants.dequantize``
(tests/unit/test_gguf_models.py checks the round trip).

Layouts (ggml-common.h's ``block_q4_K`` / ``block_q6_K``; the byte order ``gguf.quants`` decodes):
- Q4_K, 144 bytes per 256 inputs: float16 d and dmin, 12 bytes of 6-bit sc / m for the 8 sub-blocks of 32, then
  128 bytes of nibbles, each 64 inputs as 32 bytes (the first 32 low, the next 32 high); w = d sc q - dmin m.
- Q6_K, 210 bytes per 256 inputs: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
  inputs), float16 d; w = d sc (q - 32).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # inputs in a k-quant super-block


def _blocks(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    if rows.shape[-1] % QK_K:
        raise ValueError(f"k-quants take rows of whole {QK_K}-input blocks, not {rows.shape[-1]}")
    return rows.reshape(-1, QK_K)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float rows [..., K] (K a multiple of 256) -> Q4_K blocks as uint8 [..., K / 256 * 144]."""
    x = _blocks(rows)
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # the offset is subtracted: m >= 0
    span = (sub.max(-1) - low) / 15.0
    d = (span.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(span / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-low / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        scale, offset = d[:, None] * sc, dmin[:, None] * m
        q = np.where(scale[..., None] > 0, np.rint((sub + offset[..., None]) / scale[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(n, 4, 2, 32)  # 64 inputs: the first 32 low nibbles, the next high
    packed_q = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, packed_q], axis=-1)
    return out.reshape(*np.shape(rows)[:-1], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """float rows [..., K] (K a multiple of 256) -> Q6_K blocks as uint8 [..., K / 256 * 210]."""
    x = _blocks(rows)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    group_scale = np.abs(sub).max(-1) / 31.0
    d = (group_scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(group_scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        scale = d[:, None] * sc
        q = np.where(scale[..., None] != 0, np.rint(sub / scale[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    ql = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)  # each half's 4 runs of 32 share 32 bytes, 2 bits each
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return out.reshape(*np.shape(rows)[:-1], -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
