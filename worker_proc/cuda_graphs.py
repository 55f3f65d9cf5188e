"""CUDA graphs of the model's forward pass over steps of one token per request (decodes).

Why: a decode step of the 0.5B shape launches ~800 kernels (24 layers). On an H100 they run
in about 4 ms, but the host needs ~25 ms to launch them one by one, so the GPU idles for most
of the step (bench/log/2026-11-25.md). A graph launches the whole forward at once.

How: every input of the forward lives in a static buffer. A step of n one-token requests
copies its inputs into the first n rows and replays the graph of the smallest captured batch
size b >= n. Rows n..b are padding that touches nothing: slot -1 (write_kv skips it), a
context of one token in whatever block the row names; their hidden states are discarded.
Only the forward is captured: logits and sampling run eagerly on the sampled rows, so
sampling options, grammars and logprobs need nothing here. Capture warms each size first
with every slot at -1, so it writes no KV; it runs again whenever the cache is (re)built.

``capture=False`` runs the same static-buffer path eagerly: how the CPU tests check the
padding without a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.worker_proc.input_batch import ForwardBatch

# vLLM's capture sizes to 256: every step of up to 256 decodes pads by less than 16 rows.
CAPTURE_SIZES = (1, 2, 4, 8) + tuple(range(16, 257, 16))


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, ops, block_size: int, max_model_len: int,
                 max_batch: int = CAPTURE_SIZES[-1], capture: bool = True):
        self.model, self.kv_cache, self.ops = model, kv_cache, ops
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch]
        self.capture_graphs = capture
        device = kv_cache.device
        rows, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token each
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: dict[int, int] = {}  # batch size -> steps run at it (tests, logs)

    def _static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            sample_indices=self.input_ids[:0], sampled_requests=[], position_range=(0, 0),
            attention_plan=None, max_query_len=1)

    def capture(self) -> None:
        if not self.capture_graphs:
            return
        with torch.inference_mode():  # as execute() runs: the buffers stay usable there
            self.graphs, self.outputs = capture_graphs(self.model, self.kv_cache, self.ops, self.sizes,
                                                       self._static_batch)

    def size_for(self, batch: ForwardBatch) -> Optional[int]:
        """The captured size that runs ``batch``, or None: not one token per request, too many
        requests, or a block table wider than the buffers (never, under max_model_len)."""
        rows = batch.seq_lens.shape[0]
        if batch.input_ids.shape[0] != rows or rows > self.sizes[-1] or rows == 0:
            return None
        if batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next(s for s in self.sizes if s >= rows)

    def forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """Hidden states of ``batch``'s rows; valid until the next forward (they live in the graph's pool)."""
        rows, width = batch.seq_lens.shape[0], batch.block_tables.shape[1]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        self.seq_lens[:rows].copy_(batch.seq_lens)
        self.block_tables[:rows, :width].copy_(batch.block_tables)
        if rows < size:  # earlier steps' rows: make them padding again
            self.slot_mapping[rows:size].fill_(-1)
            self.seq_lens[rows:size].fill_(1)
        self.replays[size] = self.replays.get(size, 0) + 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:rows]
        return self.model.forward(self._static_batch(size), self.kv_cache, self.ops)[:rows]


def capture_graphs(model, kv_cache: torch.Tensor, ops, sizes: list[int], static_batch) -> tuple[dict, dict]:
    """One graph of the forward over ``static_batch(size)`` per size, and its output: largest
    first, all in one memory pool (each smaller graph fits in what the largest took), warmed off
    the default stream first, as torch's docs ask."""
    graphs, outputs = {}, {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(kv_cache.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in reversed(sizes):
            model.forward(static_batch(size), kv_cache, ops)
    torch.cuda.current_stream().wait_stream(stream)
    for size in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = model.forward(static_batch(size), kv_cache, ops)
        graphs[size] = graph
    torch.cuda.synchronize(kv_cache.device)
    return graphs, outputs
