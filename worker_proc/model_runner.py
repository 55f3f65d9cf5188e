"""Executes one SchedulerOutput on this worker's shard of the model and returns a StepResult.

A step, in order on the device's current stream: drop finished requests; swap out, swap
in, copy, zero cache blocks; register new requests, apply the diffs of cached ones and the
new tokens of decodes; run the model once over the flattened ragged batch (prefill chunks
and decodes mixed); sample for the requests whose every known token is now computed. Only
rank 0 samples.
"""

from __future__ import annotations

import time
import zlib
from typing import Optional

import torch

from pagedserve.kernels.ops import select_ops
from pagedserve.protocol.messages import DecodeBatch, SchedulerOutput, StepResult, WorkerInit
from pagedserve.worker_proc.decode_attention import GatherWorkspace
from pagedserve.worker_proc.input_batch import BatchError, RequestState, build_step_batch
from pagedserve.worker_proc.kv_cache import KVCache, block_bytes, max_num_blocks
from pagedserve.worker_proc.model_config import load_model_spec
from pagedserve.worker_proc.models import MODEL_CLASSES
from pagedserve.worker_proc.sampler import sample
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Activations budget kept free of KV blocks on CUDA: one step of this many tokens.
HEADROOM_TOKENS = 8192
HEADROOM_LOGIT_ROWS = 256


class ModelRunner:
    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32",
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        self.spec = load_model_spec(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[dtype]
        self.rank = tp_rank
        self.shard = TensorParallelShard.for_rank(self.spec, tp_rank, tp_size, tp_group)
        self.ops = select_ops(self.device)
        self.model = MODEL_CLASSES[self.spec.architecture](model_dir, self.spec, self.shard, self.device, self.dtype)
        self._requests: dict[str, RequestState] = {}
        self._cache: Optional[KVCache] = None
        self._seed = 0
        self._gather_workspace = GatherWorkspace()  # CPU decode attention's K/V gather buffers

    # ------------------------------------------------------------------ description

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def block_bytes(self, block_size: int) -> int:
        return block_bytes(self.spec.num_layers, block_size, self.shard.num_kv_heads, self.spec.head_dim, self.dtype)

    def max_gpu_blocks(self, block_size: int, memory_bytes: Optional[int] = None) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        spec, shard = self.spec, self.shard
        per_token = 4 * spec.hidden_size + 3 * shard.num_heads * spec.head_dim + 3 * shard.intermediate_size
        headroom = HEADROOM_TOKENS * per_token * element + HEADROOM_LOGIT_ROWS * spec.vocab_size * 4 * 4
        return max_num_blocks(self.block_bytes(block_size), self.device, memory_bytes, headroom)

    # ------------------------------------------------------------------ cache

    def init_cache(self, init: WorkerInit) -> None:
        self._cache = KVCache(self.spec.num_layers, init.num_gpu_blocks, init.num_cpu_blocks, init.block_size,
                              self.shard.num_kv_heads, self.spec.head_dim, self.dtype, self.device, self.ops)
        self.model.rotary.ensure_positions(init.max_model_len)
        self._requests.clear()
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

    def _initialized_cache(self) -> KVCache:
        if self._cache is None:
            raise RuntimeError("the KV cache is not allocated yet: call init_cache(WorkerInit) first")
        return self._cache

    # ------------------------------------------------------------------ step

    def execute(self, out: SchedulerOutput) -> StepResult:
        cache = self._initialized_cache()
        started = time.perf_counter()
        req_ids: list[str] = []
        token_ids: list[int] = []
        logprobs = alternatives = None
        with torch.inference_mode():
            for req_id in out.finished_req_ids:
                self._requests.pop(req_id, None)
            cache.apply_block_ops(out.blocks_to_swap_out, out.blocks_to_swap_in,
                                  out.blocks_to_copy, out.new_block_ids_to_zero)
            scheduled = self._update_requests(out)
            if scheduled:
                batch = build_step_batch(scheduled, cache.block_size, self.device,
                                         batched_decodes=self.device.type == "cpu", workspace=self._gather_workspace)
                hidden = self.model.forward(batch, cache.device_cache, self.ops)
                if self.rank == 0 and batch.sampled_requests:
                    logits = self.model.compute_logits(hidden[batch.sample_indices])
                    sampled = sample(logits, batch.sampled_requests)
                    req_ids = [r.req_id for r in batch.sampled_requests]
                    token_ids, logprobs, alternatives = sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(step=out.step, rank=self.rank, req_ids=req_ids, sampled_token_ids=token_ids,
                          logprobs=logprobs, forward_time_s=time.perf_counter() - started,
                          top_logprobs=alternatives)

    def _update_requests(self, out: SchedulerOutput) -> list[RequestState]:
        """Register new requests, apply cached ones' diffs and decodes; returns them in batch order."""
        scheduled = []
        for new in out.new_requests:
            seed = new.sampling.seed
            if seed is None:  # the scheduler normally assigns one; stay deterministic anyway
                seed = self._seed ^ zlib.crc32(new.req_id.encode())
            state = RequestState(new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                 new.num_computed_tokens, new.num_scheduled_tokens, new.sampling, seed)
            self._requests[new.req_id] = state
            scheduled.append(state)
        for diff in out.cached_requests:
            state = self._requests.get(diff.req_id)
            if state is None:
                raise BatchError(f"cached request {diff.req_id!r} is unknown to this worker "
                                 f"(never sent as new, or already finished)")
            state.token_ids += diff.new_token_ids
            state.block_ids += diff.new_block_ids
            state.num_computed_tokens = diff.num_computed_tokens
            state.num_scheduled_tokens = diff.num_scheduled_tokens
            scheduled.append(state)
        self._apply_decodes(out.decodes, scheduled)
        return scheduled

    def _apply_decodes(self, decodes: DecodeBatch, scheduled: list[RequestState]) -> None:
        # Runs for every running request every step: no per-request allocation or lookup
        # beyond the dict get. An error leaves earlier requests updated; the scheduler
        # restarts the replica on any step error, so nothing runs on that state again.
        req_ids = decodes.req_ids
        num_decodes = len(req_ids)
        if len(decodes.num_computed_tokens) != num_decodes or len(decodes.token_ids) != num_decodes:
            raise BatchError(f"decodes: {num_decodes} req_ids but {len(decodes.num_computed_tokens)} "
                             f"num_computed_tokens and {len(decodes.token_ids)} token_ids")
        first = len(scheduled)
        requests, append = self._requests, scheduled.append
        for req_id, num_computed, token in zip(req_ids, decodes.num_computed_tokens, decodes.token_ids):
            state = requests.get(req_id)
            if state is None:
                raise BatchError(f"decode request {req_id!r} is unknown to this worker "
                                 f"(never sent as new, or already finished)")
            token_ids = state.token_ids
            # The new token goes at position num_computed: anything else means this worker
            # missed (or double-applied) a step and its KV no longer matches the scheduler's.
            if num_computed != len(token_ids):
                raise BatchError(f"decode request {req_id!r}: its new token is at position {num_computed} "
                                 f"but this worker holds {len(token_ids)} tokens (out of sync)")
            token_ids.append(token)
            state.num_computed_tokens = num_computed
            state.num_scheduled_tokens = 1
            append(state)
        for index, block in decodes.new_blocks:
            if not 0 <= index < num_decodes:  # a negative index would silently pick another request
                raise BatchError(f"decodes: new block {block} names decode {index}, "
                                 f"but the step has {num_decodes} decodes")
            scheduled[first + index].block_ids.append(block)
