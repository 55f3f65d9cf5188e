"""gpt-oss: a mixture of experts in every layer, with attention sinks, alternating sliding-window
and full attention (``layer_types``), YaRN rotary (worker_proc/rotary.py through transformers' own
init) and biases on q/k/v/o.

- Attention sinks (``self_attn.sinks``, one logit per query head): each softmax gains one more
  score that weighs no value (worker_proc/attention.py; every CPU path and the Triton kernel).
- The router (``mlp.router``, with a bias) takes the top-k logits, then a softmax over those k.
- The experts (``mlp.experts.*``, 3D, biases on both projections) apply the clamped SwiGLU
  (kernels/moe_reference.py ``ClampedSwiglu``: ``swiglu_alpha``, ``swiglu_limit``). The checkpoint
  keeps gate_up as [E, H, 2I] with gate and up columns interleaved (``[..., ::2]`` and ``[..., 1::2]``)
  and down as [E, I, H]: ``read_experts`` lays them out as the shared MoE block's [gate; up] rows
  and [H, I], each rank its slice of the intermediate features.

The hub's checkpoints keep the experts in MXFP4 (``quantization_config.quant_method: mxfp4``:
``*_blocks``, two e2m1 codes a byte, and ``*_scales``, a power of two per 32 inputs): they are
dequantized here at load, exactly (every value is representable in bfloat16), as transformers does
with ``Mxfp4Config(dequantize=True)``, and the experts then compute in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.kernels.moe_reference import ClampedSwiglu
from pagedserve.kernels.moe_routing import RoutingRule
from pagedserve.worker_proc.models.family import Family, LayerNames
from pagedserve.worker_proc.models.moe import ExpertNames, ExpertTensors, MoeDecoderLayer, MoeSpec
from pagedserve.worker_proc.weights import WeightSource


# e2m1's sixteen values by code (the sign is the high bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, out, G, 16] uint8 (codes of 32 inputs a group, the low nibble first) and scales
    [E, out, G] uint8 (2 ** (scale - 127)) -> float32 [E, G * 32, out]: the unquantized checkpoint's
    [E, in, out] layout."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [E, out, G, 16, 2]
    values = torch.tensor(FP4_VALUES)[codes].reshape(*scales.shape, 32)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:2], -1).transpose(1, 2)


def _expert_weight(source: WeightSource, name: str) -> torch.Tensor:
    """An experts' [E, in, out] tensor, as the checkpoint keeps it or dequantized from MXFP4."""
    if name in source:
        return source.get(name)
    return dequantize_mxfp4(source.get(name + "_blocks"), source.get(name + "_scales"))


def read_experts(source: WeightSource, block: str, part: tuple[int, int]) -> ExpertTensors:
    """A layer's experts from gpt-oss's checkpoint: rows [a, b) of each expert's gate and up (its
    interleaved columns), as [gate; up] [2s, H]; columns [a, b) of down as [H, s]; their biases."""
    a, b = part
    gate_up = _expert_weight(source, block + "experts.gate_up_proj")  # [E, H, 2I]: gate, up, gate, up, ...
    gate_up_bias = source.get(block + "experts.gate_up_proj_bias")  # [E, 2I], interleaved alike
    down = _expert_weight(source, block + "experts.down_proj")  # [E, I, H]
    return ExpertTensors(
        gate_ups=[torch.cat([w[:, 0::2][:, a:b].t(), w[:, 1::2][:, a:b].t()]) for w in gate_up],
        downs=[w[a:b].t() for w in down],
        gate_up_biases=[torch.cat([v[0::2][a:b], v[1::2][a:b]]) for v in gate_up_bias],
        down_biases=list(source.get(block + "experts.down_proj_bias")))


def _gpt_oss(config: Any) -> dict:
    routing = RoutingRule(config.num_experts_per_tok, softmax_after_topk=True)
    moe = MoeSpec(config.num_local_experts, config.intermediate_size, 0, (True,) * config.num_hidden_layers, routing,
                  ExpertNames(router="router"), router_bias=True,
                  activation=ClampedSwiglu(config.swiglu_alpha, config.swiglu_limit), read_experts=read_experts,
                  gate_up_interleaved=True)
    return dict(moe=moe)


FAMILIES = {"GptOssForCausalLM": Family(LayerNames(sinks="self_attn.sinks"), _gpt_oss, layer=MoeDecoderLayer)}
