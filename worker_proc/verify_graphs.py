"""CUDA graphs of the forward over steps of a few tokens per request: speculative verifications.

Why: a step that verifies proposals has 1 to k + 1 tokens per request, which the decode graphs
(cuda_graphs.py, one token per request) do not take, so it ran eagerly, every kernel launched
from the host. On an H200 that made speculation worthless: at 64 streams, 2.7 tokens accepted
a verification gained nothing over plain decode steps replayed from graphs (bench/log/2026-11-28.md
"GPU: speculative decoding on an H200").

How: a graph of R requests holds R x (k + 1) tokens, in static buffers as the decode graphs'.
A step of n < R requests and t tokens takes the smallest captured R > n: its rows go first,
exactly as built (ragged; its own block tables and context lengths, so a real row reads only
what its request wrote), then R - n padding requests take the t' = R(k + 1) - t tokens left:
one token each, the last all the rest. Padding tokens write no KV (slot -1), sit at position
0, attend over whatever block their stale table row names, and their hidden states are
discarded. A graph's size bounds the last padding request to R(k + 1) tokens, which stays within
a table row (sizes are capped at max_model_len tokens).

``capture=False`` runs the same static-buffer path eagerly: how the CPU tests check it.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.worker_proc.cuda_graphs import CAPTURE_SIZES, capture_graphs
from pagedserve.worker_proc.input_batch import ForwardBatch


class VerifyGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, ops, block_size: int, max_model_len: int,
                 tokens_per_request: int, max_batch: int = CAPTURE_SIZES[-1], capture: bool = True):
        if tokens_per_request < 2:
            raise ValueError("verification graphs take steps of up to k + 1 >= 2 tokens per request")
        self.model, self.kv_cache, self.ops = model, kv_cache, ops
        self.span = tokens_per_request
        # at least one padding request (R > n), and a padding request's tokens within a table row
        self.sizes = [s for s in CAPTURE_SIZES if 2 <= s <= max_batch and s * tokens_per_request <= max_model_len]
        self.capture_graphs = capture
        device = kv_cache.device
        rows = self.sizes[-1] if self.sizes else 0
        tokens, width = rows * tokens_per_request, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        # until a step writes its own: requests of k + 1 padding tokens each
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device) * tokens_per_request
        self.seq_lens = torch.full((rows,), tokens_per_request, dtype=torch.int32, device=device)
        self._ramp = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: dict[int, int] = {}  # requests of the graph -> steps run at it (tests, logs)

    def _static_batch(self, size: int) -> ForwardBatch:
        tokens = size * self.span
        return ForwardBatch(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            sample_indices=self.input_ids[:0], sampled_requests=[], position_range=(0, 0),
            attention_plan=None, max_query_len=tokens)

    def capture(self) -> None:
        if self.capture_graphs and self.sizes:
            with torch.inference_mode():  # as execute() runs
                self.graphs, self.outputs = capture_graphs(self.model, self.kv_cache, self.ops, self.sizes,
                                                           self._static_batch)

    def size_for(self, batch: ForwardBatch) -> Optional[int]:
        """The requests of the graph that runs ``batch``, or None: a step of one token per
        request (the decode graphs'), a request of more than k + 1 tokens, too many requests,
        or a block table wider than the buffers."""
        rows, tokens = batch.seq_lens.shape[0], batch.input_ids.shape[0]
        if rows == 0 or tokens == rows or not 1 <= batch.max_query_len <= self.span:
            return None
        if batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next((s for s in self.sizes if s > rows), None)

    def forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """Hidden states of ``batch``'s tokens; valid until the next forward (the graph's pool)."""
        rows, tokens, width = batch.seq_lens.shape[0], batch.input_ids.shape[0], batch.block_tables.shape[1]
        total, pad = size * self.span, size - rows
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.positions[tokens:total].zero_()
        self.slot_mapping[:tokens].copy_(batch.slot_mapping)
        self.slot_mapping[tokens:total].fill_(-1)  # padding writes no KV, wherever a longer step left its slots
        self.block_tables[:rows, :width].copy_(batch.block_tables)
        self.query_start_loc[:rows + 1].copy_(batch.query_start_loc)
        # padding requests start one token apart after the real ones; the last ends at the graph's end
        torch.add(self._ramp[1:pad], tokens, out=self.query_start_loc[rows + 1:size])
        self.query_start_loc[size].fill_(total)
        self.seq_lens[:rows].copy_(batch.seq_lens)
        self.seq_lens[rows:size - 1].fill_(1)
        self.seq_lens[size - 1].fill_(total - tokens - (pad - 1))
        self.replays[size] = self.replays.get(size, 0) + 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:tokens]
        return self.model.forward(self._static_batch(size), self.kv_cache, self.ops)[:tokens]
