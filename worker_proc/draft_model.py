"""Speculative decoding's ``draft_model`` proposer: a smaller model of the target's vocabulary,
run in the worker beside the target, with its own paged KV cache.

Its cache has the target's block size and number of blocks and is indexed by the same block
tables and slots the scheduler sent, so the scheduler's one block manager manages both: every
swap, copy-on-write and zeroing of a step is applied to it too, and a prefix-cache hit finds
the draft's keys and values in the block beside the target's where a speculating sequence wrote
them (else see below). One step, after the target's
forward, for the entries the scheduler names (``SchedulerOutput.draft_tokens``: its sequences
that speculate; one that backed off for good costs nothing here):

1. ``compute``: the draft's forward over the same rows as the target's (proposals included,
   same positions and slots), so its cache holds every position the target's does. Rows of
   rejected proposals are rewritten next step, whose tokens start at the first unverified one.
2. ``propose``: from each entry's new sample at position p, k single-token greedy steps give
   k proposals. Positions p .. p+k-1 have no blocks from the scheduler yet, so they are written
   to worker-only scratch blocks past the shared ones (the block holding p copied into the
   first, so the steps see the context before p); step 1 of the next step rewrites them in the
   real blocks. The scheduler's pool is never touched.

Where the draft's cache lacks a sequence's earlier positions, step 1 computes them first: blocks
written while nobody speculated (a prefix-cache hit on blocks a ``logprobs`` request computed, the
prompt of an ``n > 1`` request's parent, a sequence that had backed off) hold the target's keys
and values but not the draft's, and proposals from a context it never saw are rarely accepted.
The worker keeps, per block, how many leading slots hold the draft's keys and values of the
tokens the target's hold (``filled``), moved by the step's swaps and copies and reset by its
zeroing, as the blocks themselves are.

Greedy argmax makes the proposer a point mass, so the worker's verification (spec_verify.py)
stays exact rejection sampling under temperature: the output distribution is the target's.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.protocol.messages import SchedulerOutput, WorkerInit
from pagedserve.protocol.speculative import SpeculativeConfig, check_draft_model
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.decode_attention import GatherWorkspace
from pagedserve.worker_proc.elementwise import select_elementwise
from pagedserve.worker_proc.input_batch import ForwardBatch, build_forward_batch, gather_decodes, upload_batch
from pagedserve.worker_proc.kv_cache import KVCache, KVCacheSpec, block_bytes
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError, load_model_spec
from pagedserve.worker_proc.models import MODEL_CLASSES
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

GROUP = 64  # entries proposing in one batch of single-token steps; the scratch blocks are sized for it


class DraftModel:
    """The draft model, its KV cache (the shared blocks plus its scratch blocks) and its two phases."""

    def __init__(self, config: SpeculativeConfig, target_dir: str, target: ModelSpec, device: torch.device,
                 dtype: torch.dtype, ops, tp_size: int = 1):
        check_draft_model(config, target_dir, tp_size)
        self.spec = load_model_spec(config.model)  # refuses a family the worker cannot run
        if self.spec.vocab_size != target.vocab_size:
            raise UnsupportedModelError(f"--speculative-config: model {config.model!r} has {self.spec.vocab_size} "
                                        f"tokens, the target {target.vocab_size}: a draft shares the tokenizer")
        self.path, self.k = config.model, config.num_speculative_tokens
        self.device, self.dtype, self.ops = device, dtype, ops
        shard = TensorParallelShard.for_rank(self.spec, 0, 1)
        self.model = MODEL_CLASSES[self.spec.architecture](config.model, self.spec, shard, device, dtype,
                                                           select_elementwise(ops, dtype))
        self.cache: Optional[KVCache] = None
        self.scratch_start = 0
        self.filled: list[int] = []  # per device block: leading slots holding the draft's keys and values
        self.host_filled: list[int] = []  # per host block, while swapped out
        self.valid_end: dict[str, int] = {}  # per request: its positions before this hold the draft's
        self._computed: list[tuple[HeldRequest, int, int]] = []  # this step's (entry, first, end of tokens)

    @property
    def num_params(self) -> int:
        return self.spec.num_layer_params + 2 * self.spec.vocab_size * self.spec.hidden_size

    @property
    def cache_spec(self) -> KVCacheSpec:
        return self.spec.cache_spec(self.spec.num_kv_heads)

    def block_bytes(self, block_size: int) -> int:
        return block_bytes(self.spec.num_layers, block_size, self.cache_spec, self.dtype)

    def scratch_blocks(self, block_size: int) -> int:
        """Positions p .. p+k-1 of an entry span at most this many blocks, whatever p is."""
        return GROUP * ((block_size + self.k - 2) // block_size + 1)

    def init_cache(self, init: WorkerInit) -> None:
        self.scratch_start = init.num_gpu_blocks
        self.cache = KVCache(self.spec.num_layers, init.num_gpu_blocks + self.scratch_blocks(init.block_size),
                             init.num_cpu_blocks, init.block_size, self.cache_spec, self.dtype, self.device, self.ops)
        self.model.rotary.ensure_positions(init.max_model_len + self.k)
        self.filled, self.host_filled = [0] * init.num_gpu_blocks, [0] * init.num_cpu_blocks
        self.valid_end = {}

    def note_block_ops(self, out: SchedulerOutput) -> None:
        """What the step's cache operations did to the draft's blocks: swap out, swap in, copy, zero."""
        for device, host in out.blocks_to_swap_out:
            self.host_filled[host] = self.filled[device]
        for host, device in out.blocks_to_swap_in:
            self.filled[device] = self.host_filled[host]
        for src, dst in out.blocks_to_copy:
            self.filled[dst] = self.filled[src]
        for block in out.new_block_ids_to_zero:
            self.filled[block] = 0
        for req_id in out.finished_req_ids:  # preempted ones too: their blocks may be handed out again
            self.valid_end.pop(req_id, None)

    def _first_missing(self, req: HeldRequest) -> int:
        """The first of ``req``'s computed positions whose draft keys and values are missing."""
        end = req.num_computed_tokens
        if self.valid_end.get(req.req_id) == end:  # its last step ran the draft: nothing to scan
            return end
        bs = self.cache.block_size
        for b in range(-(-end // bs)):
            have = self.filled[req.block_ids[b]]
            if have < min(bs, end - b * bs):
                return b * bs + have
        return end

    def _with_catch_up(self, req: HeldRequest, first: int) -> HeldRequest:
        """``req`` scheduled from ``first``: its missing positions, then the step's own tokens."""
        extra = req.num_computed_tokens - first
        if not extra:
            return req
        return HeldRequest(req.req_id, req.token_ids, req.num_prompt_tokens, req.block_ids, first,
                           req.num_scheduled_tokens + extra, req.sampling, req.seed, req.samples, req.pooling,
                           req.min_tokens_stops)

    def note_accepted(self, num_accepted: dict[str, int]) -> None:
        """After verification: the slots the draft computed that hold accepted tokens count as filled
        (a rejected proposal's do not: the next step rewrites them)."""
        bs = self.cache.block_size
        for req, first, end in self._computed:
            end += num_accepted.get(req.req_id, 0)
            for b in range(first // bs, -(-end // bs)):
                self.filled[req.block_ids[b]] = min(bs, end - b * bs)
            self.valid_end[req.req_id] = end
        self._computed = []

    def compute(self, scheduled: list[HeldRequest], batch: ForwardBatch, out: SchedulerOutput,
                workspace: Optional[GatherWorkspace]) -> None:
        """Step 1: the draft's keys and values for the named entries' rows of the target's batch
        (before verification changes their state)."""
        wanted = out.draft_tokens
        subset = [r for r in scheduled if r.req_id in wanted]
        firsts = [self._first_missing(r) for r in subset]
        self._computed = [(r, first, r.num_computed_tokens + r.num_scheduled_tokens) for r, first in zip(subset, firsts)]
        if not subset:
            return
        catch_up = any(first < r.num_computed_tokens for r, first in zip(subset, firsts))
        if catch_up:
            subset = [self._with_catch_up(r, first) for r, first in zip(subset, firsts)]
        if catch_up or len(subset) < len(scheduled):
            drafts = {i: d for i, d in out.spec_token_ids.items() if i in wanted}
            batch = build_forward_batch(subset, self.cache.block_size, self.device,
                                        batched_decodes=self.device.type == "cpu", workspace=workspace,
                                        drafts=drafts, prune_last_layer=True)  # only the cache is wanted
        self.model.forward(batch, self.cache.device_cache, self.ops)

    def propose(self, entries: list[HeldRequest], token_ids: list[int], wanted: dict[str, int],
                workspace: Optional[GatherWorkspace]) -> dict[str, list[int]]:
        """Step 2: up to k greedy proposals after each named entry's new sample, by id."""
        todo = [(req, token, min(wanted[req.req_id], self.k)) for req, token in zip(entries, token_ids)
                if wanted.get(req.req_id)]
        proposals: dict[str, list[int]] = {}
        for start in range(0, len(todo), GROUP):
            proposals.update(self._propose_group(todo[start:start + GROUP], workspace))
        return proposals

    def _propose_group(self, group: list, workspace: Optional[GatherWorkspace]) -> dict[str, list[int]]:
        cache = self.cache
        bs = cache.block_size
        tables, copies, positions = [], [], []
        scratch = self.scratch_start
        for req, _, k in group:
            p = req.num_computed_tokens + req.num_scheduled_tokens  # the new sample's position
            first, last = p // bs, (p + k - 1) // bs
            own = list(range(scratch, scratch + last - first + 1))
            scratch += len(own)
            if p % bs:  # the context before p in that block
                copies.append((req.block_ids[first], own[0]))
            tables.append(req.block_ids[:first] + own)
            positions.append(p)
        if copies:
            self.ops.copy_blocks(cache.device_cache, torch.tensor(copies, dtype=torch.long))
        proposals = {req.req_id: [] for req, _, _ in group}
        tokens = [token for _, token, _ in group]
        active = list(range(len(group)))
        for j in range(max(k for _, _, k in group)):
            active = [i for i in active if group[i][2] > j]
            host = gather_decodes([tokens[i] for i in active], [positions[i] + j for i in active],
                                  [tables[i] for i in active], bs)
            batch = upload_batch(host, bs, self.device, batched_decodes=self.device.type == "cpu",
                                 workspace=workspace)
            self.model.rotary.check_positions(*batch.position_range)
            hidden = self.model.forward(batch, cache.device_cache, self.ops)
            best = self.model.compute_logits(hidden).argmax(-1).tolist()
            for i, token in zip(active, best):
                proposals[group[i][0].req_id].append(token)
                tokens[i] = token
        return proposals
