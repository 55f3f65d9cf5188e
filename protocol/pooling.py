"""Embedding requests on the wire: which pooling, and the pieces of an embedding a step sends.

A pooling request is computed as a prompt and never sampled. Each step that computes part of
its prompt may send a ``PooledChunk``: the sum of the final-norm hidden states of prompt
positions ``[start, start + count)`` (``last``: only the last position, in the step that
computes it). The scheduler adds the chunks of one request in prompt order, so a prompt
spread over several chunked-prefill steps pools exactly as one computed at once, and a
swapped-out request keeps what it has (docs/DECISIONS.md, "Embeddings").
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pagedserve.protocol.sampling_params import MAX_COUNT

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean")
FLOAT32_BYTES = 4


class PooledChunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    start: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]  # first prompt position summed
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]  # positions summed
    values: bytes  # hidden_size float32 values, little-endian: the sum over those positions

    def __post_init__(self) -> None:
        if not self.values or len(self.values) % FLOAT32_BYTES:
            raise ValueError(f"a pooled chunk of {len(self.values)} bytes is not a float32 vector")

    @property
    def end(self) -> int:
        """One past the last position summed."""
        return self.start + self.count
