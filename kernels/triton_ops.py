"""The Triton implementation of every kernel, as one namespace with the reference's names.

Importing this module imports triton and compiles nothing; kernels compile on first launch.
"""

from __future__ import annotations

from pagedserve.kernels.copy_blocks import copy_blocks
from pagedserve.kernels.lora import lora_expand, lora_expand_segments, lora_shrink, lora_shrink_segments
from pagedserve.kernels.mla_attention import mla_attention
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.swap import swap_blocks
from pagedserve.kernels.write_kv import write_kv
from pagedserve.kernels.zero_blocks import zero_blocks

__all__ = ["copy_blocks", "lora_expand", "lora_expand_segments", "lora_shrink", "lora_shrink_segments",
           "mla_attention", "paged_attention", "swap_blocks", "write_kv", "zero_blocks"]
