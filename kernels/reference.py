"""Plain-torch references of every kernel: the CPU path and the oracle for the Triton ones.

Cache layout (one tensor per worker): ``kv_cache[layer, 0|1, block, slot, kv_head, dim]``
with 0 = K and 1 = V, so ``kv_cache[l, 0]`` is layer l's K cache in blocks of
``block_size`` tokens. A host (swap) cache has the same layout with its own block count.
"""

from __future__ import annotations

from typing import Optional

import torch


def zero_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Zero the listed blocks in every layer, K and V."""
    if block_ids.numel() == 0:
        return
    kv_cache.index_fill_(2, block_ids.to(kv_cache.device, torch.long), 0)


def copy_blocks(kv_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy block ``mapping[i, 0]`` onto block ``mapping[i, 1]`` in every layer, K and V."""
    if mapping.numel() == 0:
        return
    mapping = mapping.to(kv_cache.device, torch.long)
    kv_cache[:, :, mapping[:, 1]] = kv_cache[:, :, mapping[:, 0]]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy block ``mapping[i, 0]`` of ``src_cache`` to block ``mapping[i, 1]`` of ``dst_cache``.

    The caches may live on different devices (device <-> pinned host).
    """
    if mapping.numel() == 0:
        return
    src_idx = mapping[:, 0].to(src_cache.device, torch.long)
    dst_idx = mapping[:, 1].to(dst_cache.device, torch.long)
    # Non-blocking only towards a device: a non-blocking device->host copy returns before the
    # data has landed, and the host-side index_copy_ below would read it too early.
    towards_device = dst_cache.device.type != "cpu"
    moved = src_cache.index_select(2, src_idx).to(dst_cache.device, non_blocking=towards_device)
    dst_cache.index_copy_(2, dst_idx, moved)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write rows ``key[t]``/``value[t]`` ([T, kv_heads, dim]) into flat slot ``slot_mapping[t]``.

    ``k_cache``/``v_cache`` are one layer's [blocks, block_size, kv_heads, dim]; slot -1
    marks padding and is skipped.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)  # float8: saturating at +-448, torch's cast
    if k_cache.dtype == torch.float8_e4m3fn:  # torch has no float8 index_copy_ on CPU: copy the bytes
        flat_k, flat_v, key, value = (t.view(torch.uint8) for t in (flat_k, flat_v, key, value))
    flat_k.index_copy_(0, slot_mapping.long(), key)
    flat_v.index_copy_(0, slot_mapping.long(), value)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of queries over their paged context.

    query: [T, q_heads, dim], request b's queries are rows
    ``query_start_loc[b]:query_start_loc[b+1]`` and sit at the last positions of its
    ``seq_lens[b]`` tokens (cached context followed by this step's tokens, whose K/V have
    already been written). block_tables: [B, max_blocks] int32. Returns [T, q_heads, dim].
    A key at position p is visible to a query at position i when p <= i and, with a
    sliding window w, i - p < w. ``softcap`` c: each scaled score s becomes c * tanh(s / c)
    before the softmax (Gemma 2's attention soft-capping). ``sinks`` [q_heads] (gpt-oss's attention
    sinks): a learned logit per head that joins every query's softmax as one more score, taking its
    share of the probability but adding no value.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q = query[starts[b] : starts[b + 1]]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        # [heads, q_len, dim] x [heads, dim, seq_len]
        qh = q.transpose(0, 1).float()
        kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            visible &= (q_pos - k_pos) < sliding_window
        # Masked positions are dropped with where(), not multiplied by zero, so a stale
        # NaN in an unused slot can never leak into a row.
        scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
        if sinks is not None:  # the sink's column is dropped after the softmax: it weighs no value
            sink_column = sinks.float()[:, None, None].expand(num_q_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[starts[b] : starts[b + 1]] = torch.matmul(probs, vh).transpose(0, 1).to(query.dtype)
    return out


def mla_attention(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """Multi-head latent attention with absorbed queries (DeepSeek-V2/V3; worker_proc/latent_attention.py).

    query [T, heads, L + R]: each head's q_nope through its W_UK (L dims), then its rotated q_pe (R);
    latent_cache [blocks, block_size, 1, L + R]: every token's latent row, c (L) then the rotated
    k_pe (R). A score is query . row over all L + R dims, the value is the row's first L dims: the
    output [T, heads, L] is attention in the latent space (W_UV then takes it to each head's values).
    Causal and ragged as ``paged_attention``; float32 arithmetic."""
    out = torch.empty(*query.shape[:2], latent_dim, dtype=query.dtype, device=query.device)
    rows = paged_attention(query, latent_cache, latent_cache, block_tables, query_start_loc, seq_lens, scale)
    out.copy_(rows[..., :latent_dim])
    return out


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, s: torch.Tensor) -> None:
    """s[t] = a[token_slots[t]] @ x[t] (float32 sums) for each token with a slot (>= 0); others untouched."""
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().flatten()
            s[rows] = x[rows].float() @ a[slot].float().t()


def lora_expand(s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """y[t] += s[t, :R] @ b[token_slots[t]] in place (float32 sums, rounded once) for each token with a slot."""
    rank = b.shape[1]
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().flatten()
            y[rows] = (y[rows].float() + s[rows, :rank].float() @ b[slot].float()).to(y.dtype)


def _segment_slots(seg_starts: torch.Tensor, seg_slots: torch.Tensor, rows: int) -> torch.Tensor:
    """Each sorted row's slot (-1 past the last segment)."""
    slots = torch.full((rows,), -1, dtype=torch.long, device=seg_slots.device)
    for i, slot in enumerate(seg_slots.tolist()):
        slots[int(seg_starts[i]):int(seg_starts[i + 1])] = slot
    return slots


def lora_shrink_segments(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                         s: torch.Tensor, max_segment: int = 0) -> None:
    """lora_shrink over rows sorted by slot: rows [seg_starts[i], seg_starts[i + 1]) take slot seg_slots[i]."""
    lora_shrink(x, a, _segment_slots(seg_starts, seg_slots, x.shape[0]), s)


def lora_expand_segments(s: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                         y: torch.Tensor, max_segment: int = 0) -> None:
    """lora_expand over rows sorted by slot (as lora_shrink_segments)."""
    lora_expand(s, b, _segment_slots(seg_starts, seg_slots, y.shape[0]), y)
