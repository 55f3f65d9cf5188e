"""The prefix-cache name of a full block of tokens: one definition for every process.

Block ``i`` of a token sequence is named ``(parent, tokens, own)``: ``tokens`` is the raw
int64 bytes of its ``block_size`` token ids (what ``array("q")`` and numpy hold), ``own``
is ``hash((parent, int(tokens)))`` and ``parent`` is block ``i-1``'s ``own`` (0 for the
first block, or a LoRA adapter's ``adapter_seed``). ``own`` hashes ints only, which Python hashes the same way in every run and
process (unlike ``bytes`` or ``str``), so the scheduler's cache and the frontend's router
name the same prefix the same way, and a recorded trace's hits replay.
"""

from __future__ import annotations

from array import array
from typing import Sequence


def block_key(parent: int, tokens: bytes) -> tuple[int, bytes, int]:
    return parent, tokens, hash((parent, int.from_bytes(tokens, "little", signed=True)))


def adapter_seed(digest: str) -> int:
    """The first block's parent for a request computed by the adapter of ``digest`` (0 is the base
    model): the KV of one prompt differs by adapter, so two adapters never share its blocks, and
    an adapter replaced under the same name by other weights never hits the old one's."""
    return int(digest[:15], 16) + 1 if digest else 0


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """``own`` of every block a prefix-cache lookup of ``token_ids`` could hit, in order.

    Like the scheduler's lookup, the last token is never covered: something must be
    computed to sample, so only the full blocks of ``token_ids[:-1]`` are named.
    """
    num_blocks = (len(token_ids) - 1) // block_size
    if num_blocks <= 0:
        return []
    data = array("q", token_ids[:num_blocks * block_size]).tobytes()
    size = 8 * block_size
    hashes = []
    parent = seed
    for start in range(0, num_blocks * size, size):
        parent = hash((parent, int.from_bytes(data[start:start + size], "little", signed=True)))
        hashes.append(parent)
    return hashes
