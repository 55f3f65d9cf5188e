"""A mixture-of-experts layer's routed experts in one native call on CPU (kernels/cpu_moe.c), in bfloat16.

``NativeExperts`` packs a layer's experts once, at load, as one stacked tensor of panels per projection
(cpu_moe.c's layout: cpu_gemv.c's bfloat16 panels, gate's and up's blocks alternating), then takes each
step's routing (ids and weights [T, top_k], moe_routing.route) and returns each token's weighted sum of its
experts' outputs: kernels/moe_reference.py's ``fused_moe`` with its roundings, SiLU or gpt-oss's clamped
SwiGLU, and each projection's bias. The pairs are sorted by expert inside the call, and an expert no pair
routes to is never read. ``rows`` serves expert parallelism's exchanged rows (already sorted, unweighted).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.moe_reference import ClampedSwiglu

BLOCK = 16  # cpu_moe.c: the outputs of one panel


def supports_native_experts() -> bool:
    """Whether the worker takes the kernel by default: where it multiplies by vdpbf16ps (AVX512-BF16), the
    variant measured faster than the per-expert path at every row count. Its widened forms (AVX-512, AVX2),
    run here as the x86-64-v4 and -v3 builds, read a decode step's experts 1.2-2.1x as fast as the per-expert
    path but took 1.3-2.1x as long at 256 tokens (prefill), and the model keeps one layout of its experts:
    they serve only where asked for (models/moe.py's switch)."""
    return cpu_native.kernel_variant() == "avx512bf16"


def _panels(weight: torch.Tensor, k_pad: int) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), k_pad / 2, 16, 2] bfloat16, zero past N and K (k_pad even, >= K)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // BLOCK) * BLOCK, k_pad, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(-1, BLOCK, k_pad // 2, 2).permute(0, 2, 1, 3).contiguous()


class NativeExperts:
    """One layer's (or one rank's) experts as cpu_moe.c's stacked bfloat16 panels.

    ``gate_ups[e]`` [2I, H] (gate rows, then up rows), ``downs[e]`` [H, I]; biases [2I] and [H] per expert
    (gpt-oss) or None; ``activation`` None for SiLU(gate) * up."""

    def __init__(self, gate_ups: Sequence[torch.Tensor], downs: Sequence[torch.Tensor],
                 gate_up_biases: Optional[Sequence[torch.Tensor]] = None,
                 down_biases: Optional[Sequence[torch.Tensor]] = None, activation: Optional[ClampedSwiglu] = None):
        self.num_experts = len(gate_ups)
        self.size, self.hidden = gate_ups[0].shape[0] // 2, gate_ups[0].shape[1]
        if (self.num_experts == 0 or len(downs) != self.num_experts
                or any(w.shape != (2 * self.size, self.hidden) for w in gate_ups)
                or any(w.shape != (self.hidden, self.size) for w in downs)):
            raise ValueError("NativeExperts: every expert's gate_up must be [2I, H] and its down [H, I]")
        size, hidden = self.size, self.hidden
        padded_size = -(-size // BLOCK) * BLOCK
        blocks, hidden_pairs = padded_size // BLOCK, -(-hidden // 2)
        # one tensor per projection, filled expert by expert: a layer's experts are never held twice over
        self.gate_up = torch.empty(self.num_experts, blocks, 2, hidden_pairs, BLOCK, 2, dtype=torch.bfloat16)
        self.down = torch.empty(self.num_experts, -(-hidden // BLOCK), padded_size // 2, BLOCK, 2, dtype=torch.bfloat16)
        for e, (gu, d) in enumerate(zip(gate_ups, downs)):
            self.gate_up[e, :, 0] = _panels(gu[:size], 2 * hidden_pairs)
            self.gate_up[e, :, 1] = _panels(gu[size:], 2 * hidden_pairs)
            self.down[e] = _panels(d, padded_size)
        self.gate_up_bias = _stacked(gate_up_biases, (2 * size,))
        self.down_bias = _stacked(down_biases, (hidden,))
        self.activation = activation

    @property
    def weight_bytes(self) -> int:
        return (self.gate_up.numel() + self.down.numel()) * 2

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] bfloat16 (rows may be strided), routing ``weights`` / ``ids`` [T, top_k] -> [T, H]
        bfloat16: moe_reference.fused_moe's result. An id out of range raises IndexError, as there."""
        tokens = x.shape[0]
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.hidden or ids.shape != weights.shape:
            raise ValueError("NativeExperts: x must be [T, H] bfloat16 and the routing [T, top_k]")
        out = torch.zeros(tokens, self.hidden, dtype=torch.bfloat16)
        if tokens == 0 or ids.numel() == 0:
            return out
        if x.stride(1) != 1:
            x = x.contiguous()
        if self.hidden % 2:  # the kernel reads x in pairs: the pad's products are 0 * 0
            x = torch.cat([x, x.new_zeros(tokens, 1)], dim=1)
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        activation = self.activation
        status = cpu_native.library().moe_experts_bf16(
            x.data_ptr(), x.stride(0), tokens, self.hidden, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            self.num_experts, self.size, self.gate_up.data_ptr(), self.down.data_ptr(),
            _pointer(self.gate_up_bias), _pointer(self.down_bias), 0 if activation is None else 1,
            1.0 if activation is None else activation.alpha, 0.0 if activation is None else activation.limit,
            out.data_ptr(), self.hidden)
        if status == -1:
            raise IndexError(f"NativeExperts: an expert id is not one of {self.num_experts}")
        if status:
            raise MemoryError("NativeExperts: no memory for the kernel's scratch")
        return out

    def rows(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each row's output of its expert, unweighted [P, H]: ``rows`` sorted by expert, ``counts[e]`` of
        expert e's (expert parallelism's exchange; models/moe.py ``expert_runs``)."""
        ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))[:, None]
        return self(rows, torch.ones(ids.shape, dtype=torch.float32), ids)


def _stacked(biases: Optional[Sequence[torch.Tensor]], shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    if biases is None:
        return None
    if any(b.shape != shape for b in biases):
        raise ValueError(f"NativeExperts: every expert's bias must be {list(shape)}")
    return torch.stack([b.to(torch.bfloat16) for b in biases]).contiguous()


def _pointer(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()

