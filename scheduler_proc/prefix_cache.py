"""Prefix caching: full blocks are named by their content and the content before them.

The key of block ``i`` of a sequence is ``(parent, tokens, own)``, defined once in
protocol/block_hash.py so the frontend's router names blocks exactly as we do: ``tokens``
is the raw int64 bytes of its token ids (8 bytes a token, where a tuple of ints costs ~40)
and ``own`` hashes ``(parent, int(tokens))`` with ints only, the same in every process.
Carrying ``own`` means the next block's parent is read, not recomputed. The cache is a
dict on those keys, so equal-hash collisions of different tokens are told apart by
equality; only a 64-bit collision of two *parent* hashes could alias, as in vLLM.

A request computed by a LoRA adapter starts its chain at ``adapter_seed(digest)`` instead of 0
(protocol/block_hash.py, as the router does): its KV differs from the base model's for the same
tokens, so no two adapters (nor an adapter and the base model) ever share a block.

A hybrid model's local groups (protocol/kv_groups.py) cache their blocks too, under the global
key with the group's number appended: the same tokens, other layers' KV. Only global keys are
reported to the router. A local group's hit needs only the blocks its window reaches from the hit
point (vLLM's ``SlidingWindowManager.find_longest_cache_hit``): ``window_hits`` shortens the
global hit to the longest that every local group covers so.

A block is published only after the step that computes its last token has run
(``register_computed``), so a hit never points at KV that is not yet written.
"""

from __future__ import annotations

from pagedserve.protocol.block_hash import block_key
from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.request import Sequence
from pagedserve.scheduler_proc.sliding_window import blocks_behind


def window_key(key: tuple, group: int) -> tuple:
    """The key of local group ``group``'s block of the tokens ``key`` names (groups count from 1)."""
    return (*key, group)

__all__ = ["block_key", "lookup", "register_computed", "republish", "window_hits"]


def lookup(pool: BlockPool, seq: Sequence, block_size: int) -> tuple[list[int], list]:
    """Blocks cached for the leading full blocks of ``seq`` and their keys.

    A hit never covers the last token: at least one token must be computed to sample.
    """
    tokens = seq.token_ids
    max_blocks = (len(tokens) - 1) // block_size
    hits: list[int] = []
    keys: list = []
    parent = seq.request.prefix_seed  # 0, or its LoRA adapter's: adapters never share a prompt's blocks
    for i in range(max_blocks):
        key = block_key(parent, tokens[i * block_size:(i + 1) * block_size].tobytes())
        block = pool.lookup(key)
        if block is None:
            break
        hits.append(block)
        keys.append(key)
        parent = key[2]
    return hits, keys


def window_hits(pool: BlockPool, hits: list[int], keys: list, num_groups: int, window: int,
                block_size: int) -> tuple[int, tuple[list[int], ...], int]:
    """The longest prefix of the global hits ``hits`` (keys ``keys``) that every one of the
    ``num_groups`` local groups also holds from the first block its window reaches on: how many
    blocks, each group's hits and the count of leading blocks behind the window."""
    for num_hits in range(len(hits), 0, -1):
        behind = blocks_behind(num_hits * block_size, window, block_size)
        found = tuple([pool.lookup(window_key(keys[i], group)) for i in range(behind, num_hits)]
                      for group in range(1, num_groups + 1))
        if all(block is not None for group_hits in found for block in group_hits):
            return num_hits, found, behind
    return 0, tuple([] for _ in range(num_groups)), 0


def register_computed(pool: BlockPool, seq: Sequence, block_size: int) -> None:
    """Publish every full block of ``seq`` whose tokens are all computed and not yet named."""
    keys = seq.block_keys
    computed = seq.num_kv_tokens
    if seq.spec is not None:  # proposals of a step out count until verified: only tokens before them are known
        computed -= len(seq.spec.drafts)
    num_full = computed // block_size
    if len(keys) >= num_full:
        return
    tokens = seq.token_ids
    blocks = seq.block_ids
    parent = keys[-1][2] if keys else seq.request.prefix_seed
    num_freed = seq.num_freed_blocks  # freed behind a window before their step's result came: the chain
    first_new = len(keys)
    for i in range(first_new, num_full):  # goes on through their keys, but the pool may have reused them
        key = block_key(parent, tokens[i * block_size:(i + 1) * block_size].tobytes())
        keys.append(key)
        if i >= num_freed:
            pool.register(blocks[i], key)
        parent = key[2]
    if seq.window_tables:
        _register_window_tables(pool, seq, first_new, num_full)


def _register_window_tables(pool: BlockPool, seq: Sequence, start: int, end: int) -> None:
    """Publish the local tables' blocks ``start .. end - 1`` that are not freed behind the window."""
    keys = seq.block_keys
    for group, table in enumerate(seq.window_tables, 1):
        for i in range(max(start, seq.num_window_freed), end):
            pool.register(table[i], window_key(keys[i], group))


def republish(pool: BlockPool, seq: Sequence) -> None:
    """After a swap-in the sequence's full blocks live in new device blocks: name them again."""
    num_freed = seq.num_freed_blocks
    for block, key in zip(seq.block_ids[num_freed:], seq.block_keys[num_freed:]):
        pool.register(block, key)
    if seq.window_tables:
        _register_window_tables(pool, seq, 0, len(seq.block_keys))
