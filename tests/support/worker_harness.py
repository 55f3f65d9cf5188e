"""Helpers (no tests) for driving a ModelRunner the way the scheduler does, and the HF oracle.

TrivialScheduler plays a minimal scheduler: blocks come from a free list (freed blocks
are reused, so they hold stale data and are listed in new_block_ids_to_zero), a request
is sent in full once and then as diffs (a plain one-token decode in the step's DecodeBatch
unless ``decode_batch=False``), prompts may be split into chunks, and requests may arrive
at later steps so prefills and decodes of different lengths share a batch. With LoRA, a request may
name a slot and adapters may be loaded at a step: the step's LoRAStep goes to the runner first.
A runner whose cache is in KV groups (a hybrid model, protocol/kv_groups.py) gets a table per group
(``GroupedSchedulerOutput``); the local tables keep every block, as they may.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from pagedserve.protocol.messages import (
    CachedRequestData, DecodeBatch, GroupedSchedulerOutput, LoRAAdapter, LoRASlot, LoRAStep, NewRequestData,
    SamplingParams, SchedulerOutput, StepResult, WorkerInit,
)

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0)


@dataclass
class _Request:
    req_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    prefill_chunks: list[int]
    arrival_step: int
    outputs: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_tokens_sent: int = 0  # how many of prompt + outputs the worker has been told
    preemption: Optional[tuple[str, int, int]] = None  # (mode "swap" | "recompute", at step, resume step)
    host_block_ids: list[int] = field(default_factory=list)
    lora_slot: int = -1  # the LoRA slot it is computed by (-1: the base model)
    window_tables: list[list[int]] = field(default_factory=list)  # the local KV groups' tables
    window_host: list[list[int]] = field(default_factory=list)

    def tables(self) -> list[list[int]]:
        return [self.block_ids, *self.window_tables]

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class TrivialScheduler:
    def __init__(self, runner, block_size: int = 4, num_gpu_blocks: int = 256, num_cpu_blocks: int = 8,
                 max_model_len: int = 512, seed: int = 0,
                 share_tokens: Optional[Callable[[StepResult, list[str]], list[int]]] = None,
                 decode_batch: bool = True):
        self.runner, self.block_size = runner, block_size
        groups = getattr(runner, "kv_groups", None)
        self.num_window_groups = groups.num_window_groups if groups is not None else 0
        self.decode_batch = decode_batch
        runner.init_cache(WorkerInit(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks, max_model_len=max_model_len, seed=seed,
        ))
        self.free_blocks = list(range(num_gpu_blocks - 1, -1, -1))
        self.free_host_blocks = list(range(num_cpu_blocks - 1, -1, -1))
        self.requests: list[_Request] = []
        self.step = 0
        self.finished: list[str] = []
        # Tensor-parallel ranks other than 0 sample nothing; this hook gives them rank 0's tokens.
        self.share_tokens = share_tokens
        self.results: list[StepResult] = []
        self.lora_loads: dict[int, list[LoRASlot]] = {}  # step -> the adapters loaded before it

    def add(self, req_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams = GREEDY,
            prefill_chunks: Optional[list[int]] = None, arrival_step: int = 0, lora_slot: int = -1) -> None:
        self.requests.append(_Request(req_id, list(prompt), max_tokens, sampling,
                                      list(prefill_chunks or []), arrival_step, lora_slot=lora_slot,
                                      window_tables=[[] for _ in range(self.num_window_groups)]))

    def load_lora(self, slot: int, adapter: LoRAAdapter, at_step: int = 0) -> None:
        """Load ``adapter`` into ``slot`` before step ``at_step`` (no request may use the slot then)."""
        self.lora_loads.setdefault(at_step, []).append(LoRASlot(slot=slot, adapter=adapter))

    def preempt(self, req_id: str, mode: str, at_step: int, resume_step: int) -> None:
        """Preempt ``req_id`` by swap or recompute at ``at_step``; it resumes at ``resume_step``."""
        next(r for r in self.requests if r.req_id == req_id).preemption = (mode, at_step, resume_step)

    def _preempt_or_resume(self, req: _Request, swap_out: list, swap_in: list) -> bool:
        """Applies a pending preemption; True while the request sits this step out."""
        mode, at_step, resume_step = req.preemption
        if self.step == at_step:
            self.finished.append(req.req_id)
            if mode == "swap":
                req.host_block_ids = [self.free_host_blocks.pop() for _ in req.block_ids]
                swap_out += zip(req.block_ids, req.host_block_ids)
                req.window_host = [[self.free_host_blocks.pop() for _ in t] for t in req.window_tables]
                for table, host in zip(req.window_tables, req.window_host):
                    swap_out += zip(table, host)
            else:
                req.num_computed = 0
            for table in req.tables():
                self.free_blocks.extend(reversed(table))
            req.block_ids, req.num_tokens_sent = [], 0
            req.window_tables = [[] for _ in req.window_tables]
        if at_step <= self.step < resume_step:
            return True
        if self.step == resume_step and req.host_block_ids:
            req.block_ids = [self.free_blocks.pop() for _ in req.host_block_ids]
            swap_in += zip(req.host_block_ids, req.block_ids)
            self.free_host_blocks.extend(req.host_block_ids)
            req.host_block_ids = []
            req.window_tables = [[self.free_blocks.pop() for _ in host] for host in req.window_host]
            for table, host in zip(req.window_tables, req.window_host):
                swap_in += zip(host, table)
                self.free_host_blocks.extend(host)
            req.window_host = []
        return False

    def _schedule(self, req: _Request, zero: list[int]) -> tuple[int, list[int]]:
        tokens = len(req.prompt) + len(req.outputs)
        if req.num_computed < len(req.prompt) and req.prefill_chunks:
            count = req.prefill_chunks.pop(0)
        else:
            count = tokens - req.num_computed
        count = min(count, tokens - req.num_computed)
        new_blocks = []
        while len(req.block_ids) * self.block_size < req.num_computed + count:
            block = self.free_blocks.pop()
            req.block_ids.append(block)
            new_blocks.append(block)
            zero.append(block)
            for table in req.window_tables:
                table.append(self.free_blocks.pop())
                zero.append(table[-1])
        return count, new_blocks

    def build_step(self) -> tuple[SchedulerOutput, list[_Request]]:
        new, cached, zero, new_batch, cached_batch, decode_batch = [], [], [], [], [], []
        decodes = DecodeBatch([], [], [], [])
        swap_out, swap_in = [], []
        window_blocks: dict[str, list[list[int]]] = {}
        for req in self.requests:
            if req.done or req.arrival_step > self.step:
                continue
            if req.preemption is not None and self._preempt_or_resume(req, swap_out, swap_in):
                continue
            sent = len(req.block_ids) if req.num_tokens_sent else 0
            count, new_blocks = self._schedule(req, zero)
            if req.window_tables and len(req.block_ids) > sent:
                window_blocks[req.req_id] = [table[sent:] for table in req.window_tables]
            tokens = req.prompt + req.outputs
            if req.num_tokens_sent == 0:
                new.append(NewRequestData(req.req_id, tokens, len(req.prompt), list(req.block_ids),
                                          req.num_computed, count, req.sampling, req.num_computed + count == len(tokens)))
                new_batch.append(req)
            elif self.decode_batch and len(tokens) - req.num_tokens_sent == 1 == count:
                for block in new_blocks:
                    decodes.new_blocks.append((len(decodes.req_ids), block))
                decodes.req_ids.append(req.req_id)
                decodes.num_computed_tokens.append(req.num_computed)
                decodes.token_ids.append(tokens[-1])
                decode_batch.append(req)
            else:
                cached.append(CachedRequestData(req.req_id, tokens[req.num_tokens_sent:], new_blocks,
                                                req.num_computed, count, req.num_computed + count == len(tokens)))
                cached_batch.append(req)
            req.num_tokens_sent = len(tokens)
            req.num_computed += count
        grouped = {"window_block_ids": window_blocks} if self.num_window_groups else {}
        out = (GroupedSchedulerOutput if grouped else SchedulerOutput)(
            **grouped, step=self.step, new_requests=new, cached_requests=cached, decodes=decodes,
            finished_req_ids=self.finished, blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in,
            blocks_to_copy=[], new_block_ids_to_zero=zero,
            total_num_scheduled_tokens=sum(r.num_scheduled_tokens for r in new)
            + sum(r.num_scheduled_tokens for r in cached) + len(decodes.req_ids),
        )
        return out, new_batch + cached_batch + decode_batch  # the worker's batch order

    def step_once(self) -> StepResult:
        out, batch = self.build_step()
        self.finished = []
        held = {r.req_id: r for r in batch}
        request_slots = {new.req_id: held[new.req_id].lora_slot for new in out.new_requests
                         if held[new.req_id].lora_slot >= 0}
        loads = self.lora_loads.pop(out.step, [])
        if loads or request_slots:
            self.runner.apply_lora_step(LoRAStep(step=out.step, loads=loads, request_slots=request_slots))
        result = self.runner.execute(out)
        self.results.append(result)
        expected = [r.req_id for r in batch if r.num_computed == len(r.prompt) + len(r.outputs)]
        tokens = result.sampled_token_ids
        if self.share_tokens is not None:
            tokens = self.share_tokens(result, expected)
        elif result.req_ids != expected:
            raise AssertionError(f"step {self.step}: sampled {result.req_ids}, expected {expected}")
        by_id = {r.req_id: r for r in batch}
        for req_id, token in zip(expected, tokens):
            req = by_id[req_id]
            req.outputs.append(token)
            if req.done:
                self.finished.append(req_id)
                for table in req.tables():
                    self.free_blocks.extend(reversed(table))
        self.step += 1
        return result

    def run(self) -> dict[str, list[int]]:
        while not all(r.done for r in self.requests):
            self.step_once()
        return {r.req_id: r.outputs for r in self.requests}


def staggered_greedy(runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Four prompts' greedy tokens, two prefilled in chunks and two arriving at later steps, so prefill
    chunks and decodes of different lengths share steps."""
    scheduler = TrivialScheduler(runner, block_size=4)
    scheduler.add("r0", prompts[0], new_tokens)
    scheduler.add("r1", prompts[1], new_tokens, prefill_chunks=[7])
    scheduler.add("r2", prompts[2], new_tokens, arrival_step=2, prefill_chunks=[10, 11])
    scheduler.add("r3", prompts[3], new_tokens, arrival_step=5)
    outputs = scheduler.run()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def final_states_beside_transformers(runner, model_dir, prompt: list[int],
                                     new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(ours, transformers', our tokens): the final norm's output at each of ``new_tokens`` greedy steps of
    ``runner`` (prefill in chunks of 4), and transformers' float32 model's over the same tokens, teacher forced
    (one divergent argmax cannot shift every later comparison); the comparison of quantized schemes whose
    activations round (W8A8, FP8), where greedy tokens may part at a near tie."""
    from transformers import AutoModelForCausalLM

    states = []
    compute_logits = runner.model.compute_logits

    def recording(hidden):  # records what the real method computes, changes nothing
        states.append(runner.model.final_norm(hidden.clone()))
        return compute_logits(hidden)

    runner.model.compute_logits = recording
    scheduler = TrivialScheduler(runner)
    scheduler.add("a", prompt, new_tokens, prefill_chunks=[4])
    tokens = scheduler.run()["a"]
    runner.model.compute_logits = compute_logits
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        hf(torch.tensor([prompt]))  # a compressed checkpoint's first forward decompresses its weights (a hook)
        theirs = hf.model(torch.tensor([prompt + tokens])).last_hidden_state[0, len(prompt) - 1:-1]
    return torch.cat(states), theirs, tokens


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy tokens, one prompt at a time (no padding), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def run_two_ranks(script: str, tmp_path: Path, args: list[str], timeout: float = 180):
    """``script`` run as two tensor-parallel ranks (its argv: the tests dir, the rank, a free port for gloo,
    then ``args``), each printing its result as JSON on its last line: rank 0's result, once both ranks
    exited cleanly and printed the same (rank 1 decodes the tokens rank 0 broadcasts)."""
    from support.server import free_port

    path = tmp_path / "rank.py"
    path.write_text(script)
    common = [str(Path(__file__).parents[1]), str(free_port())]
    ranks = [subprocess.Popen([sys.executable, str(path), common[0], str(rank), common[1], *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    finished = [rank.communicate(timeout=timeout) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, finished):
        assert rank.returncode == 0, stderr[-3000:]
    rank0, rank1 = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in finished)
    assert rank0 == rank1
    return rank0
