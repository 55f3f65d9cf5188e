"""Rotary position embeddings from a cos/sin table computed once per process.

The inverse frequencies come from transformers' own rope init functions (default,
"linear", "llama3", "yarn", "longrope"), so every scaling type a config names is computed
the way the oracle computes it. "dynamic" rescales with the sequence length and would
need a table per length, so it is refused. "longrope" (Phi-3) rotates with its short factors up
to ``original_max_position_embeddings``; past it transformers computes the whole sequence again with
its long factors (Phi3ForCausalLM drops its cache at the switch), which a paged cache shared by
prefixes cannot do, so the served length stops there (``LONGROPE_LIMIT``; serve_config.py caps or
refuses --max-model-len before any process starts).

A family whose layers rotate differently (Gemma 3: local layers their own base) passes a
``layer_type``: the key of its rope parameters in ``config.rope_parameters``; ``RotaryTables``
holds one table per key, grown and checked together.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedserve.kernels import cpu_native
from pagedserve.protocol.model_architectures import LONGROPE_LIMIT
from pagedserve.worker_proc.model_config import UnsupportedModelError


def _rope_params(config: Any, layer_type: Optional[str]) -> dict:
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params is not None and layer_type is not None:
        params = params[layer_type]
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inverse_frequencies(config: Any, head_dim: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling of cos/sin); longrope's short factors."""
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":  # the rotated dims: all, or the first ones (partial_rotary_factor, Phi-4-mini)
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError("rope_scaling type 'dynamic' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"unknown rope_scaling type {rope_type!r}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float().cpu(), float(scaling)


def _long_rope_start(config: Any, layer_type: Optional[str]) -> Optional[int]:
    """The longest sequence longrope rotates with its short factors alone; None for other rope types."""
    params = _rope_params(config, layer_type)
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    return int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)


class RotaryEmbedding:
    """Applies rotary embeddings to [tokens, heads, head_dim] tensors by position."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, device: torch.device, dtype: torch.dtype,
                 layer_type: Optional[str] = None):
        """A table of ``max_positions`` rows (longrope: at most its original length)."""
        self.config, self.head_dim, self.dtype, self.device = config, head_dim, dtype, device
        self.inv_freq, self.scaling = inverse_frequencies(config, head_dim, layer_type)
        self.rotary_dim = 2 * self.inv_freq.numel()  # head_dim, or the first dims of a partial rotary
        self.exact_positions = _long_rope_start(config, layer_type)  # None: every position
        self.max_positions = 0
        self.ensure_positions(max_positions if self.exact_positions is None
                              else min(max_positions, self.exact_positions))

    def ensure_positions(self, max_positions: int) -> None:
        """Grow the table to cover positions [0, max_positions)."""
        if max_positions <= self.max_positions:
            return
        if self.exact_positions is not None and max_positions > self.exact_positions:
            raise UnsupportedModelError(LONGROPE_LIMIT.format(limit=self.exact_positions, asked=max_positions))
        # Same float32 arithmetic as HF's rotary forward (position * inv_freq, then cos),
        # so the table entries equal what the oracle computes per call.
        # HF's table is cat((freqs, freqs)): both halves of a row are equal, so one half is kept.
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * self.inv_freq[None, :]
        self.cos = (freqs.cos() * self.scaling).to(self.device, self.dtype)
        self.sin = (freqs.sin() * self.scaling).to(self.device, self.dtype)
        self.max_positions = max_positions

    def check_positions(self, low: int, high: int) -> None:
        """Once per step, before the forward (ModelRunner.execute), on the host
        (ForwardBatch.position_range): every position has a row in the table. The native
        kernel reads the row it is given, torch's indexing would wrap a negative one, and on
        CUDA an index past the end is a device-side assert that ends the process."""
        if low < 0 or high >= self.max_positions:
            raise IndexError(f"a position outside the rotary table of {self.max_positions}")

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T] long. Returns a new tensor.

        HF computes x * cos + cat(-x2, x1) * sin; per half that is x1 * cos - x2 * sin and
        x2 * cos + x1 * sin with the same roundings (a + (-b) is a - b exactly), so this is
        bit for bit the same, written into one output without the concatenated copy. On CPU
        in float32 the native kernel computes the same products and sums in one pass. A partial
        rotary turns the first ``rotary_dim`` dims and copies the rest, as transformers does."""
        if self.rotary_dim != self.head_dim:
            out = x.clone()
            out[..., :self.rotary_dim] = self.torch_rotate(x[..., :self.rotary_dim], positions)
            return out
        if cpu_native.supports_rotary(x, self.cos):  # positions already checked (check_positions)
            return cpu_native.rotary(x, self.cos, self.sin, positions)
        return self.torch_rotate(x, positions)

    def torch_rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The torch ops' rotation (any device and dtype): the reference the kernels are held to."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        first, second = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=first).sub_(x2 * sin)
        torch.mul(x2, cos, out=second).add_(x1 * sin)
        return out


class RotaryTables:
    """The model's rotary tables, one per distinct layer type (most families have one): what
    the runner grows once the served length is known and checks before each step."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, device: torch.device, dtype: torch.dtype,
                 layer_types: tuple[Optional[str], ...]):
        self.by_type = {t: RotaryEmbedding(config, head_dim, max_positions, device, dtype, t)
                        for t in dict.fromkeys(layer_types)}

    def __getitem__(self, layer_type: Optional[str]) -> RotaryEmbedding:
        return self.by_type[layer_type]

    def ensure_positions(self, max_positions: int) -> None:
        for table in self.by_type.values():
            table.ensure_positions(max_positions)

    def check_positions(self, low: int, high: int) -> None:
        for table in self.by_type.values():
            table.check_positions(low, high)
