"""The flattened ragged batch of one step's forward pass (``ForwardBatch``).

The per-request state the worker keeps between steps is protocol/step_state.py's
``HeldRequest``, updated by ``apply_output``. Each step's batch concatenates every scheduled request's tokens
``token_ids[num_computed : num_computed + num_scheduled]`` — prefill chunks and decodes
alike, no padding — with the metadata the attention kernels read. The metadata is gathered
on the host into typed arrays (``HostBatch``) that torch then shares without a copy (``upload_batch``).

A hybrid model's requests (protocol/kv_groups.py) hold a table per KV group: the batch's own tables
and slots are the global group's, and ``window_views`` holds one batch per local group, the same
tokens over that group's tables and slots, which the model gives that group's layers.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch

from pagedserve.protocol.step_state import PLACEHOLDER_TOKEN, HeldRequest, StepContractError, placeholder_token
from pagedserve.worker_proc.attention import CpuAttentionPlan, plan_cpu_attention
from pagedserve.worker_proc.decode_attention import GatherWorkspace
from pagedserve.worker_proc.spec_verify import DraftRow, draft_rows

if TYPE_CHECKING:
    from pagedserve.worker_proc.models.lora_linear import LoRABatch


class BatchError(StepContractError):
    """The scheduler sent a step the worker cannot run as described."""


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each token's K/V
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context + this step's tokens
    sample_indices: torch.Tensor  # [S] long: rows whose hidden state is sampled
    sampled_requests: list  # the entries flagged ``samples``, in batch order (k + 1 DraftRows with proposals)
    position_range: tuple[int, int]  # (lowest, highest) position, known on the host: no device read
    attention_plan: Optional[CpuAttentionPlan]  # CPU only: batched decodes, SDPA prefill chunks
    max_query_len: int = 0  # the most tokens of one request, known on the host (0: not known)
    output_rows: Optional["OutputRows"] = None  # forward() returns only these rows' hidden states
    lora: Optional["LoRABatch"] = None  # each token's LoRA slot (worker_proc/lora_slots.py); None: no adapter
    window_views: Optional[list["ForwardBatch"]] = None  # per local KV group: its tables and slots; None: one group


@dataclass(slots=True)
class OutputRows:
    """The rows whose hidden states the step reads, when they are fewer than its tokens: the
    last layer writes every token's keys and values but attends and runs its MLP for these rows
    only (1/layers of a prefill's matmuls). Each request's rows are the end of its chunk, so they
    form a ragged batch of their own over the same contexts."""

    rows: torch.Tensor  # [R] long: batch rows, in batch order (the sampled rows)
    block_tables: torch.Tensor  # of the requests with rows
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    attention_plan: Optional[CpuAttentionPlan]


def upload(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors of one dtype on ``device``. On CUDA: one pinned buffer, one non-blocking
    copy, views into it. A copy from pageable memory would make the host wait for the
    stream, and seven of them a step serialised host and GPU (bench/log/2026-11-25.md, H100)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(device, non_blocking=True)
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


@dataclass(slots=True)
class HostBatch:
    """A step's batch gathered on the host, not yet on the device: the worker can build it while
    the device still runs the step before, with that step's samples (placeholders) to fill in."""

    input_ids: array
    positions: array
    slots: array
    query_start_loc: array
    seq_lens: array
    sample_rows: array
    tables: list[int]  # every request's table, padded to max_blocks
    max_blocks: int
    num_scheduled: list[int]
    sampled: list  # the entries that sample, in batch order (k + 1 DraftRows with proposals)
    position_range: tuple[int, int]
    placeholders: list[tuple[int, HeldRequest]]  # (row, request) whose token is still PLACEHOLDER_TOKEN
    num_output_rows: list[int]  # per request, its rows whose hidden states are read (the last ones)
    all_rows_read: bool  # a request reads every row (prompt logprobs, pooling): no pruning
    # per local KV group (a hybrid model): its slots and its padded tables, as ``slots`` and ``tables``
    window_slots: Optional[list[array]] = None
    window_tables: Optional[list[list[int]]] = None


def build_forward_batch(
    requests: list[HeldRequest], block_size: int, device: torch.device, batched_decodes: bool,
    workspace: Optional[GatherWorkspace] = None, drafts: Optional[dict[str, list[int]]] = None,
    prune_last_layer: bool = False,
) -> ForwardBatch:
    """``batched_decodes``: plan the CPU attention paths (batched decodes, SDPA prefill chunks).
    ``drafts``: speculative proposals by request id, computed after its tokens (spec_verify.py).
    ``prune_last_layer``: forward() returns the sampled rows only (``OutputRows``)."""
    return upload_batch(gather_batch(requests, block_size, drafts), block_size, device, batched_decodes, workspace,
                        prune_last_layer)


def gather_batch(requests: list[HeldRequest], block_size: int,
                 drafts: Optional[dict[str, list[int]]] = None) -> HostBatch:
    """The step's metadata in typed arrays that torch takes without a copy: on a GPU the device
    waits for this host work every step (a quarter of a 128-decode step, bench/log/2026-11-28.md "GPU:
    speculative decoding on an H200"), and torch.tensor() over Python lists was most of it."""
    input_ids, positions, slots = array("q"), array("q"), array("q")
    query_start_loc, seq_lens, sample_rows = array("i", [0]), array("i"), array("q")
    tables: list[list[int]] = []
    sampled: list[HeldRequest] = []
    placeholders: list[tuple[int, HeldRequest]] = []
    low, high = 0, 0
    num_scheduled: list[int] = []
    num_output_rows: list[int] = []
    all_rows_read = False
    num_groups = len(requests[0].window_tables) if requests else 0
    window_slots = [array("q") for _ in range(num_groups)]
    window_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    for req in requests:
        all_rows_read = all_rows_read or req.pooling is not None or req.sampling.prompt_logprobs is not None
        start = req.num_computed_tokens
        end = start + req.num_scheduled_tokens
        proposed = drafts.get(req.req_id) if drafts else None
        if end > len(req.token_ids):
            raise BatchError(
                f"request {req.req_id!r}: {end} tokens scheduled but the worker knows only {len(req.token_ids)}"
            )
        tokens = req.token_ids[start:end]
        if tokens and tokens[-1] == PLACEHOLDER_TOKEN:  # only ever a request's newest token
            placeholders.append((query_start_loc[-1] + len(tokens) - 1, req))
        if proposed:
            if not req.samples:
                raise BatchError(f"request {req.req_id!r}: proposals for an entry that does not sample")
            tokens += proposed
            end += len(proposed)
        num_blocks = -(-end // block_size)
        block_ids = req.block_ids
        if num_blocks > len(block_ids):
            raise BatchError(
                f"request {req.req_id!r}: {end} tokens need {num_blocks} blocks of {block_size}, "
                f"but its block table has {len(block_ids)}"
            )
        low, high = min(low, start), max(high, end - 1)
        input_ids.extend(tokens)
        positions.extend(range(start, end))
        _extend_slots(slots, block_ids, start, end, block_size)
        num_scheduled.append(end - start)
        query_start_loc.append(query_start_loc[-1] + end - start)
        seq_lens.append(end)
        tables.append(block_ids[:num_blocks])
        if len(req.window_tables) != num_groups:
            raise BatchError(f"request {req.req_id!r}: {len(req.window_tables)} local block tables, the batch's "
                             f"first request {num_groups}")
        for group_slots, group_tables, table in zip(window_slots, window_tables, req.window_tables):
            _extend_slots(group_slots, table, start, end, block_size)
            group_tables.append(table[:num_blocks])
        if proposed:
            sample_rows.extend(range(query_start_loc[-2] + req.num_scheduled_tokens - 1, query_start_loc[-1]))
            sampled += draft_rows(req, proposed)
            num_output_rows.append(len(proposed) + 1)
        elif req.samples:
            sample_rows.append(query_start_loc[-1] - 1)
            sampled.append(req)
            num_output_rows.append(1)
        else:
            num_output_rows.append(0)
    if drafts and len(drafts) != sum(isinstance(r, DraftRow) and r.j == 0 for r in sampled):
        raise BatchError(f"proposals for {sorted(drafts)}, not all of them entries of this step that sample")
    flat, max_blocks = _padded(tables)
    host = HostBatch(input_ids, positions, slots, query_start_loc, seq_lens, sample_rows, flat, max_blocks,
                     num_scheduled, sampled, (low, high), placeholders, num_output_rows, all_rows_read)
    if num_groups:  # every local table is as long as the global one: the same width
        host.window_slots, host.window_tables = window_slots, [_padded(t)[0] for t in window_tables]
    return host


def gather_decodes(tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int) -> HostBatch:
    """One token per entry at ``positions``, attending over ``tables``, sampling every row (the
    draft model's steps, which hold no HeldRequest)."""
    n = len(tokens)
    slots = array("q")
    for position, table in zip(positions, tables):
        _extend_slots(slots, table, position, position + 1, block_size)
    flat, max_blocks = _padded(tables)
    return HostBatch(array("q", tokens), array("q", positions), slots, array("i", range(n + 1)),
                     array("i", [p + 1 for p in positions]), array("q", range(n)), flat, max_blocks, [1] * n, [],
                     (min(positions), max(positions)), [], [1] * n, False)


def resolve_placeholders(host: HostBatch, step: int) -> None:
    """Each placeholder becomes its request's newest sample, in the request's tokens and in the
    batch: what apply_output does when the sample is known before the step is applied."""
    for row, req in host.placeholders:
        req.token_ids[-1] = host.input_ids[row] = placeholder_token(req, step)
    host.placeholders = []


def upload_batch(host: HostBatch, block_size: int, device: torch.device, batched_decodes: bool,
                 workspace: Optional[GatherWorkspace] = None, prune_last_layer: bool = False) -> ForwardBatch:
    """``prune_last_layer``: the last layer computes only the rows the step reads (``OutputRows``)."""
    if host.placeholders:
        raise BatchError(f"{len(host.placeholders)} tokens of the step are still placeholders")
    num_requests = len(host.num_scheduled)
    block_tables = _tables_tensor(host.tables, num_requests, host.max_blocks)
    input_ids_t, positions_d, slot_mapping, sample_indices = upload(
        device, _as_tensor(host.input_ids, torch.long), _as_tensor(host.positions, torch.long),
        _as_tensor(host.slots, torch.long), _as_tensor(host.sample_rows, torch.long))
    block_tables_d, query_start_loc_t, seq_lens_t = upload(
        device, block_tables, _as_tensor(host.query_start_loc, torch.int32), _as_tensor(host.seq_lens, torch.int32))
    batch = ForwardBatch(
        input_ids=input_ids_t,
        positions=positions_d,
        slot_mapping=slot_mapping,
        block_tables=block_tables_d,
        query_start_loc=query_start_loc_t,
        seq_lens=seq_lens_t,
        sample_indices=sample_indices,
        sampled_requests=host.sampled,
        position_range=host.position_range,
        attention_plan=plan_cpu_attention(host.num_scheduled, host.query_start_loc, host.seq_lens, block_tables,
                                          block_size, workspace) if batched_decodes else None,
        max_query_len=max(host.num_scheduled, default=0),
        output_rows=_output_rows(host, block_tables, sample_indices, block_size, device, batched_decodes, workspace)
        if prune_last_layer else None,
    )
    if host.window_tables is not None:
        batch.window_views = [_window_view(batch, host, slots, tables, block_size, device, batched_decodes, workspace,
                                           prune_last_layer)
                              for slots, tables in zip(host.window_slots, host.window_tables)]
    return batch


def _tables_tensor(flat: list[int], num_requests: int, width: int) -> torch.Tensor:
    return _as_tensor(array("i", flat), torch.int32).view(num_requests, width)


def _window_view(batch: ForwardBatch, host: HostBatch, slots: array, flat_tables: list[int], block_size: int,
                 device: torch.device, batched_decodes: bool, workspace: Optional[GatherWorkspace],
                 prune_last_layer: bool) -> ForwardBatch:
    """``batch`` over one local group's tables and slots: what that group's layers read and write."""
    tables = _tables_tensor(flat_tables, len(host.num_scheduled), host.max_blocks)
    slot_mapping, = upload(device, _as_tensor(slots, torch.long))
    tables_d, = upload(device, tables)
    return replace(
        batch, slot_mapping=slot_mapping, block_tables=tables_d,
        attention_plan=plan_cpu_attention(host.num_scheduled, host.query_start_loc, host.seq_lens, tables,
                                          block_size, workspace) if batched_decodes else None,
        output_rows=_output_rows(host, tables, batch.sample_indices, block_size, device, batched_decodes, workspace)
        if prune_last_layer else None,
        window_views=None)


def _output_rows(host: HostBatch, block_tables: torch.Tensor, sample_indices: torch.Tensor, block_size: int,
                 device: torch.device, batched_decodes: bool,
                 workspace: Optional[GatherWorkspace]) -> Optional[OutputRows]:
    """The read rows as a batch of their own, or None where every row is read. They are the
    sampled rows: each request's last (its k + 1 last when it verifies proposals)."""
    counts = host.num_output_rows
    if host.all_rows_read or sum(counts) >= len(host.input_ids):
        return None
    which = [b for b, m in enumerate(counts) if m]
    query_start_loc, seq_lens = array("i", [0]), array("i")
    for b in which:
        query_start_loc.append(query_start_loc[-1] + counts[b])
        seq_lens.append(host.seq_lens[b])
    tables = block_tables if len(which) == len(counts) else block_tables[which]
    tables_d, query_start_loc_t, seq_lens_t = upload(
        device, tables, _as_tensor(query_start_loc, torch.int32), _as_tensor(seq_lens, torch.int32))
    plan = plan_cpu_attention([counts[b] for b in which], query_start_loc, seq_lens, tables, block_size,
                              workspace) if batched_decodes else None
    return OutputRows(sample_indices, tables_d, query_start_loc_t, seq_lens_t, plan)


def _padded(tables: list[list[int]]) -> tuple[list[int], int]:
    """Every table in one flat list, each padded with block 0 to the widest; and that width."""
    width = max((len(t) for t in tables), default=0)
    flat: list[int] = []
    for table in tables:
        flat += table
        if len(table) < width:
            flat += [0] * (width - len(table))
    return flat, width


def _as_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """The array's memory as a tensor; empty arrays have no buffer to share. Through a memoryview,
    which the tensor keeps: while it lives the array cannot grow (BufferError), where growing
    would move the memory from under the tensor."""
    return torch.frombuffer(memoryview(values), dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)


def _extend_slots(slots: array, block_ids: list[int], start: int, end: int, block_size: int) -> None:
    """The flat cache slot of each position in [start, end): one range per block it touches."""
    if end - start == 1:  # a decode
        slots.append(block_ids[start // block_size] * block_size + start % block_size)
        return
    position = start
    while position < end:
        block, offset = divmod(position, block_size)
        count = min(block_size - offset, end - position)
        base = block_ids[block] * block_size + offset
        slots.extend(range(base, base + count))
        position += count
