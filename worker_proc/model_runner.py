"""Executes one SchedulerOutput on this worker's shard of the model and returns a StepResult.

A step, in order on the device's current stream: drop finished requests; swap out, swap
in, copy, zero cache blocks; apply the step to the held requests (protocol/step_state.py:
new ones, cached ones' diffs, decodes, placeholders resolved); run the model once over the
flattened ragged batch (prefill chunks and decodes mixed); sample for the entries flagged
``samples``; prompt logprobs of the chunks that ask (prompt_logprobs.py); pooled hidden states of
embedding requests (pooling.py). Every rank samples and remembers its samples; rank 0 reports them.
With ``--enable-lora`` a step's LoRAStep (``apply_lora_step``, before ``execute``) changes the adapter
slots once the step's finished requests are gone, before its forward (lora_slots.py).
With a draft model (draft_model.py) it runs over the speculating entries after the target's
forward, and proposes after their samples; its cache takes every block operation too.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.kernels.ops import select_ops
from pagedserve.protocol.kv_groups import KVGroups, kv_groups
from pagedserve.protocol.lora_adapter import SHARED_EXPERT_MODULES, projection_shapes
from pagedserve.protocol.messages import GroupedSchedulerOutput, LoRAStep, SchedulerOutput, StepResult, WorkerInit
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.protocol.step_state import HeldRequest, StepContractError, apply_output, note_accepted, note_samples
from pagedserve.worker_proc.cuda_graphs import DecodeGraphs
from pagedserve.worker_proc.decode_attention import GatherWorkspace
from pagedserve.worker_proc.draft_model import DraftModel
from pagedserve.worker_proc.elementwise import select_elementwise
from pagedserve.worker_proc.env_switch import env_switch
from pagedserve.worker_proc.grammar_mask import apply_grammar_bitmask
from pagedserve.worker_proc.input_batch import (BatchError, HostBatch, gather_batch, resolve_placeholders,
                                                upload_batch)
from pagedserve.worker_proc.kv_cache import KVCache, KVCacheSpec, block_bytes, max_num_blocks
from pagedserve.worker_proc.lora_adapters import AdapterReader, shard_parts
from pagedserve.worker_proc.lora_slots import LoRASlots
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_impl import select_implementation
from pagedserve.worker_proc.models.lora_linear import LoRAConfig
from pagedserve.worker_proc.models.moe import moe_rank_parts
from pagedserve.worker_proc.pooling import pool_chunks
from pagedserve.worker_proc.quantization import checkpoint_quantization
from pagedserve.worker_proc.prompt_logprobs import compute_prompt_logprobs
from pagedserve.worker_proc.sampler import launch_sample
from pagedserve.worker_proc.spec_verify import accept
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.verify_graphs import VerifyGraphs

log = logging.getLogger("pagedserve.worker")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# --kv-cache-dtype: auto keeps the model's dtype; fp8 (vLLM's fp8 / fp8_e4m3) stores keys and values as float8 e4m3,
# by torch's saturating cast (per-tensor scales of 1.0, vLLM's default without calibrated ones), and the Triton
# attention widens them to the query's dtype: half a 16-bit cache's bytes, twice its blocks
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# Activations budget kept free of KV blocks on CUDA: one step of this many tokens.
HEADROOM_TOKENS = 8192
HEADROOM_LOGIT_ROWS = 256
PRUNE_ENV = "PAGEDSERVE_PRUNE_LAST_LAYER"  # 0: the last layer computes every row (A/B runs)
HYBRID_KV_ENV = "PAGEDSERVE_HYBRID_KV"  # 0: one block table for every layer of a hybrid model, every block kept


class ModelRunner:
    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None, cuda_graphs: bool = True,
                 speculative: Optional[SpeculativeConfig] = None, quantization: Optional[str] = None,
                 model_impl: str = "auto", lora: Optional[LoRAConfig] = None, expert_parallel: bool = False,
                 kv_cache_dtype: str = "auto"):
        """``cuda_graphs``: on CUDA, replay decode steps from captured graphs (cuda_graphs.py);
        one GPU per replica only, for now (an all-reduce inside a graph is not yet checked).
        ``speculative``: with method draft_model, the draft is loaded beside the model.
        ``quantization``: ``--quantization``, which must name the checkpoint's own method.
        ``model_impl``: native, transformers or auto (model_impl.py).
        ``lora``: serve LoRA adapters (``--enable-lora``): the slots are allocated now.
        ``expert_parallel``: a mixture of experts' experts whole on each rank (models/expert_parallel.py).
        ``kv_cache_dtype``: KV_CACHE_DTYPES' (fp8: the Triton attention only, a native family's, no latent cache)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        implementation = select_implementation(model_dir, model_impl)
        self.spec, self.model_impl = implementation.spec, implementation.description
        self.quantization = checkpoint_quantization(model_dir, quantization)  # refused here, in one line
        if self.quantization is not None and not implementation.is_native:
            # transformers would decompress every weight to full precision: the point of the format lost
            raise UnsupportedModelError(f"quantized checkpoints run on the native families only, not the "
                                        f"{implementation.description}")
        if lora is not None and not implementation.is_native:
            raise UnsupportedModelError(f"--enable-lora runs on the native families only, not the "
                                        f"{implementation.description} (--model-impl native)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            # events, graph capture and Triton's launches take the current device, not the tensors':
            # a replica's worker on cuda:1 would otherwise record and capture on cuda:0's stream
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[dtype]
        self.rank = tp_rank
        if expert_parallel and not implementation.is_native:
            raise UnsupportedModelError(f"--enable-expert-parallel: experts are placed by the native model families "
                                        f"only, not the {implementation.description}")
        if expert_parallel and lora is not None and tp_size > 1:
            # an expert adapter's A and B would have to be cut by expert, as the experts are
            raise UnsupportedModelError("--enable-lora does not run with --enable-expert-parallel at "
                                        "--tensor-parallel-size > 1")
        self.shard = TensorParallelShard.for_rank(self.spec, tp_rank, tp_size, tp_group, expert_parallel)
        self.ops = select_ops(self.device)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one of "
                             f"{sorted(KV_CACHE_DTYPES)}")
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        if self.kv_dtype != self.dtype and (self.ops is reference or not implementation.is_native
                                            or self.spec.latent_cache_dim):
            raise UnsupportedModelError(f"--kv-cache-dtype {kv_cache_dtype} runs on a GPU's Triton attention, for the "
                                        f"native families without a latent cache (here: {self.device.type}, "
                                        f"{implementation.description})")
        if self.device.type == "cpu":
            cpu_native.library()  # compiled (once per machine) now, not during the first decode step
        self.model = implementation.model_class(model_dir, self.spec, self.shard, self.device, self.dtype,
                                                select_elementwise(self.ops, self.dtype),
                                                **({} if lora is None else {"lora": lora}))
        self.lora = None if lora is None else self._lora_slots(lora)
        if self.model.spec is not self.spec:  # the transformers backend reads the cache's shape off its model
            self.spec = self.model.spec
            self.shard = TensorParallelShard.for_rank(self.spec, tp_rank, tp_size, tp_group, expert_parallel)
        self.draft = (DraftModel(speculative, model_dir, self.spec, self.device, self.dtype, self.ops, tp_size)
                      if speculative is not None and speculative.method == "draft_model" else None)
        self._requests: dict[str, HeldRequest] = {}
        self._ahead: Optional[StepAhead] = None  # the next step, applied and gathered during this one
        self.steps_prepared_ahead = 0  # (tests, logs)
        self._cache: Optional[KVCache] = None
        self._seed = 0
        self._gather_workspace = GatherWorkspace()  # CPU decode attention's K/V gather buffers
        self.kv_groups = self._kv_groups()
        # the graphs' static batch has no local groups' tables
        self._use_graphs = (cuda_graphs and self.device.type == "cuda" and tp_size == 1 and implementation.is_native
                            and self.kv_groups is None)
        self.decode_graphs: Optional[DecodeGraphs] = None
        self.verify_graphs: Optional[VerifyGraphs] = None
        self._speculative = speculative
        self.prune_last_layer = env_switch(PRUNE_ENV) is not False  # input_batch.OutputRows

    def _kv_groups(self) -> Optional[KVGroups]:
        """The KV groups this worker lays its cache out in (protocol/kv_groups.py), its model told
        each layer's slot; None: one table for every layer. Not with a draft model, whose layers
        read the global tables' blocks in a cache of its own, nor a model that cannot take its
        layers' slots (the transformers backend), nor with ``PAGEDSERVE_HYBRID_KV=0``."""
        if env_switch(HYBRID_KV_ENV) is False or self.draft is not None or not hasattr(self.model, "kv_layer_slots"):
            return None
        groups = kv_groups([w or 0 for w in self.spec.layer_sliding_windows])
        if groups is not None:
            self.model.kv_layer_slots = groups.layer_slots
        return groups

    def _lora_slots(self, config: LoRAConfig) -> LoRASlots:
        spec, shard, d = self.spec, self.shard, self.spec.head_dim
        projections = projection_shapes(spec.hf_config.to_dict())  # also a .gguf's, which has no config.json

        shared_parts, expert_rows = moe_rank_parts(spec.moe, shard) if spec.moe is not None else (None, None)

        def rank_parts(module: str) -> list[tuple[int, int]]:
            if module in SHARED_EXPERT_MODULES and shared_parts is not None:
                return shared_parts(module)
            return shard_parts(module, shard.head_rows(d), shard.kv_head_rows(d), shard.intermediate_rows(),
                               spec.num_heads * d, spec.num_kv_heads * d, spec.intermediate_size)

        reader = AdapterReader(config.max_rank, projections, spec.num_layers, rank_parts, self.dtype,
                               spec.moe.num_experts if spec.moe is not None else None, expert_rows)
        return LoRASlots([layer.lora for layer in self.model.layers], config.max_loras, config.max_rank, reader,
                         config.max_cpu_loras, self.device, self.dtype)

    def apply_lora_step(self, msg: LoRAStep) -> None:
        """The LoRA changes of the step whose SchedulerOutput comes next: adapter reads start now
        (in the background), the slots change in that step's ``execute``, before its forward."""
        if self.lora is None:
            raise StepContractError(f"LoRAStep {msg.step} for a worker started without --enable-lora")
        self.lora.receive(msg)

    # ------------------------------------------------------------------ description

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def block_bytes(self, block_size: int) -> int:
        """A block's bytes in every cache it indexes (the draft's too)."""
        draft = self.draft.block_bytes(block_size) if self.draft is not None else 0
        return draft + block_bytes(self.cache_layers, block_size, self.cache_spec, self.kv_dtype)

    @property
    def cache_layers(self) -> int:
        """Layer slots of the cache: one per layer, or a KV group's layers (protocol/kv_groups.py)."""
        return self.kv_groups.group_size if self.kv_groups is not None else self.spec.num_layers

    @property
    def cache_spec(self) -> KVCacheSpec:
        """What this rank's cache keeps per token and layer: its family declares it (model_config.py)."""
        return self.spec.cache_spec(self.shard.num_kv_heads)

    def max_gpu_blocks(self, block_size: int, memory_bytes: Optional[int] = None,
                       memory_utilization: Optional[float] = None) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        spec, shard = self.spec, self.shard
        per_token = 4 * spec.hidden_size + 3 * shard.num_heads * spec.head_dim + 3 * shard.intermediate_size
        # latent attention's absorbed queries and their outputs: every head as wide as the latent row
        per_token += 2 * shard.num_heads * spec.latent_cache_dim
        headroom = HEADROOM_TOKENS * per_token * element + HEADROOM_LOGIT_ROWS * spec.vocab_size * 4 * 4
        blocks = self.block_bytes(block_size)
        scratch = 0 if self.draft is None else -(-self.draft.scratch_blocks(block_size)
                                                 * self.draft.block_bytes(block_size) // blocks)
        return max(0, max_num_blocks(blocks, self.device, memory_bytes, headroom, memory_utilization) - scratch)

    # ------------------------------------------------------------------ cache

    def init_cache(self, init: WorkerInit) -> None:
        self._cache = KVCache(self.cache_layers, init.num_gpu_blocks, init.num_cpu_blocks, init.block_size,
                              self.cache_spec, self.kv_dtype, self.device, self.ops)
        self.model.rotary.ensure_positions(init.max_model_len)
        if self.draft is not None:
            self.draft.init_cache(init)
        self.decode_graphs = self.verify_graphs = None
        if self._use_graphs:
            self.decode_graphs = DecodeGraphs(self.model, self._cache.device_cache, self.ops, init.block_size,
                                              init.max_model_len)
            self.decode_graphs.capture()
            if self._speculative is not None:  # steps of up to k + 1 tokens a request
                self.verify_graphs = VerifyGraphs(self.model, self._cache.device_cache, self.ops, init.block_size,
                                                  init.max_model_len, self._speculative.num_speculative_tokens + 1)
                try:
                    self.verify_graphs.capture()
                    torch.cuda.synchronize(self.device)
                except Exception as exc:  # not yet run on a GPU: verifications then run eagerly, as before
                    torch.cuda.synchronize(self.device)  # a fault on the device itself is fatal: raised here
                    log.warning("verification steps run without CUDA graphs: capturing them failed: %s", exc)
                    self.verify_graphs = None
        self._requests.clear()
        self._ahead = None
        if self.lora is not None:
            self.lora.discard_pending()
        self._seed = init.seed
        torch.manual_seed(init.seed)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._initialized_cache().device_cache

    @property
    def host_cache(self) -> torch.Tensor:
        return self._initialized_cache().host_cache

    def poison_cache(self, value: float = float("nan")) -> None:
        """Fill the whole device cache with ``value``: stands in for stale contents in tests."""
        self._initialized_cache().device_cache.fill_(value)
        if self.draft is not None:
            self.draft.cache.device_cache.fill_(value)

    def _initialized_cache(self) -> KVCache:
        if self._cache is None:
            raise RuntimeError("the KV cache is not allocated yet: call init_cache(WorkerInit) first")
        return self._cache

    # ------------------------------------------------------------------ step

    def _forward(self, batch, device_cache: torch.Tensor) -> torch.Tensor:
        """The step's hidden states (its output rows': ``ForwardBatch.output_rows``): replayed from
        a graph where one was captured for its shape."""
        for graphs in (self.decode_graphs, self.verify_graphs):
            # a step with adapter tokens runs eagerly: the graphs were captured without LoRA's deltas
            size = graphs.size_for(batch) if graphs is not None and batch.lora is None else None
            if size:
                hidden = graphs.forward(batch, size)
                return hidden if batch.output_rows is None else hidden[batch.output_rows.rows]
        return self.model.forward(batch, device_cache, self.ops)

    def execute(self, out: SchedulerOutput, peek: Optional[Callable[[], object]] = None) -> StepResult:
        """``peek``: the next message if it has arrived, without waiting for it. A step it gives is
        applied and gathered while this one's sample runs on the device (``_prepare_ahead``)."""
        cache = self._initialized_cache()
        started = time.perf_counter()
        req_ids: list[str] = []
        token_ids: list[int] = []
        logprobs = alternatives = prompt_logprobs = pooled = None
        num_accepted: dict[str, int] = {}
        proposals: dict[str, list[int]] = {}
        draft = self.draft if out.draft_tokens else None
        with torch.inference_mode():
            for kv in (cache, self.draft and self.draft.cache):
                if kv is not None:
                    kv.apply_block_ops(out.blocks_to_swap_out, out.blocks_to_swap_in,
                                       out.blocks_to_copy, out.new_block_ids_to_zero)
            if self.draft is not None:
                self.draft.note_block_ops(out)
            scheduled, host = self._prepared(out)
            if self.lora is not None:  # once the step's finished requests are gone: their slots are free
                self.lora.apply(out, self._requests, scheduled[:len(out.new_requests)])
            if scheduled:
                batch = upload_batch(host, cache.block_size, self.device, batched_decodes=self.device.type == "cpu",
                                     workspace=self._gather_workspace, prune_last_layer=self.prune_last_layer)
                if self.lora is not None:
                    batch.lora = self.lora.batch(scheduled, host.num_scheduled)
                    for view in batch.window_views or ():  # every KV group's layers run the step's adapters
                        view.lora = batch.lora
                # Before either path: a graph replays rotary's table lookups without Python
                self.model.rotary.check_positions(*batch.position_range)
                hidden = self._forward(batch, cache.device_cache)
                if draft is not None:  # before verification changes the entries' state
                    draft.compute(scheduled, batch, out, self._gather_workspace)
                # Decodes (batched last) score no prompt token: only the prefill entries are looked at.
                prefills = scheduled[:len(out.new_requests) + len(out.cached_requests)]
                # Only rank 0 reports them and lm_head is replicated (models/causal_lm.py): the
                # other ranks skip the work. A vocab-parallel lm_head would need every rank here.
                if self.rank == 0 and any(r.sampling.prompt_logprobs is not None for r in prefills):
                    prompt_logprobs = compute_prompt_logprobs(hidden, prefills, self.model.compute_logits,
                                                              out.spec_token_ids) or None
                if self.rank == 0 and any(r.pooling is not None for r in prefills):
                    pooled = pool_chunks(hidden, prefills, self.model.final_norm) or None
                if batch.sampled_requests:
                    # Every rank samples (the same logits, the same seeded noise), so every rank
                    # holds the token a placeholder in the next step stands for; rank 0 reports.
                    sampled_hidden = hidden if batch.output_rows is not None else hidden[batch.sample_indices]
                    logits = self.model.compute_logits(sampled_hidden)
                    logits = apply_grammar_bitmask(logits, batch.sampled_requests, out.grammar, out.step)
                    pending = launch_sample(logits, batch.sampled_requests)
                    if peek is not None and not out.spec_token_ids and self.draft is None:
                        self._prepare_ahead(out, peek)
                    sampled = pending.collect()
                    entries, token_ids, logprobs, alternatives = (batch.sampled_requests, sampled.token_ids,
                                                                  sampled.logprobs, sampled.top_logprobs)
                    if out.spec_token_ids:  # one token per entry, after its accepted proposals (spec_verify.py)
                        entries, token_ids, rows, num_accepted = accept(entries, token_ids, out.spec_token_ids)
                        logprobs = None if logprobs is None else [logprobs[i] for i in rows]
                        alternatives = None if alternatives is None else [alternatives[i] for i in rows]
                        note_accepted(self._requests, num_accepted, cache.block_size)
                    note_samples(entries, token_ids)
                    if self._ahead is not None and self._ahead.host is not None:
                        try:  # the step prepared ahead takes these samples for its placeholders
                            resolve_placeholders(self._ahead.host, self._ahead.out.step)
                        except StepContractError as exc:
                            self._ahead.error = BatchError(str(exc))
                    if draft is not None:
                        proposals = draft.propose(entries, token_ids, out.draft_tokens, self._gather_workspace)
                    if self.rank == 0:
                        req_ids = [r.req_id for r in entries]
                    else:
                        token_ids, logprobs, alternatives, num_accepted, proposals = [], None, None, {}, {}
                if draft is not None:
                    draft.note_accepted(num_accepted)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(step=out.step, rank=self.rank, req_ids=req_ids, sampled_token_ids=token_ids,
                          logprobs=logprobs, forward_time_s=time.perf_counter() - started,
                          top_logprobs=alternatives,
                          prompt_logprobs=prompt_logprobs, num_accepted_tokens=num_accepted, pooled=pooled,
                          draft_token_ids=proposals)

    # ------------------------------------------------------------------ a step prepared ahead

    def _prepared(self, out: SchedulerOutput) -> tuple[list[HeldRequest], Optional[HostBatch]]:
        """The step applied to the held requests and gathered: by ``_prepare_ahead`` during the
        step before, or now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.out is not out:  # its changes to the held requests are already made
                raise BatchError(f"step {ahead.out.step} was prepared ahead but step {out.step} came")
            if ahead.error is not None:
                raise ahead.error
            return ahead.scheduled, ahead.host
        try:
            self._check_grouped(out)
            scheduled = apply_output(self._requests, out)
        except StepContractError as exc:
            raise BatchError(str(exc)) from None
        self._seed_new(scheduled[:len(out.new_requests)])
        return scheduled, gather_batch(scheduled, self._initialized_cache().block_size, out.spec_token_ids)

    def _prepare_ahead(self, out: SchedulerOutput, peek: Callable[[], object]) -> None:
        """While the device runs this step, apply and gather the next one if it is already here:
        on a GPU the host work of a step (~1 ms of a 4 ms decode step on an H200, bench/log/2026-11-28.md
        "GPU: speculative decoding on an H200") then no longer leaves the device idle. Its decodes'
        tokens are this step's samples, still placeholders until they are read back."""
        nxt = self._next_message(peek)
        if (not isinstance(nxt, SchedulerOutput) or nxt.step <= out.step or nxt.spec_token_ids
                or nxt.draft_tokens):
            return  # the worker's loop takes it (and rejects a step out of order) as it would have
        try:
            self._check_grouped(nxt)
            scheduled = apply_output(self._requests, nxt, resolve_placeholders=False)
            self._seed_new(scheduled[:len(nxt.new_requests)])
            self._ahead = StepAhead(nxt, scheduled, gather_batch(scheduled, self._initialized_cache().block_size))
            self.steps_prepared_ahead += 1
        except StepContractError as exc:  # raised when that step runs, in its turn
            self._ahead = StepAhead(nxt, [], None, BatchError(str(exc)))

    def _check_grouped(self, out: SchedulerOutput) -> None:
        """A step carries a table per KV group exactly when this cache is laid out in groups."""
        grouped = isinstance(out, GroupedSchedulerOutput)
        if grouped != (self.kv_groups is not None):
            raise StepContractError(f"step {out.step}: {'a table per KV group' if grouped else 'one block table'} "
                                    f"for a cache {'not ' if grouped else ''}laid out in KV groups")

    def _next_message(self, peek: Callable[[], object]):
        if self.device.type != "cuda":  # the step's work is done already: nothing to wait for
            return peek()  # (a CPU peeks only under PAGEDSERVE_PREPARE_AHEAD=1, and in tests)
        done = torch.cuda.Event()
        done.record()
        while True:
            nxt = peek()
            if nxt is not None or done.query():
                return nxt

    def _seed_new(self, new_requests: list[HeldRequest]) -> None:
        for state in new_requests:
            if state.seed is None:  # the scheduler normally assigns one; stay deterministic anyway
                state.seed = self._seed ^ zlib.crc32(state.req_id.encode())


@dataclass(slots=True)
class StepAhead:
    """A step applied and gathered during the one before it (ModelRunner._prepare_ahead)."""

    out: SchedulerOutput
    scheduled: list[HeldRequest]
    host: Optional[HostBatch]
    error: Optional[BatchError] = None
