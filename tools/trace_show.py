"""``pagedserve trace show TRACE``: what happened in a recorded run, for a human (and tests).

Everything is derived from the recorded frames alone. A sequence the scheduler dropped
from its workers (``finished_req_ids``) and later sent again in full was preempted; it
was swapped if its resumption swapped blocks back into its block table, recomputed
otherwise. A new sequence whose first schedule starts past token 0 hit the prefix cache,
unless it is sample ``i`` of an n>1 request (``PARENT/i``), forked from the parent's prompt.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, ProtocolError
from pagedserve.protocol.step_state import HeldRequest, StepContractError, apply_output, note_accepted
from pagedserve.protocol.trace import Trace, TraceError, read_trace


@dataclass
class TraceSummary:
    steps: int = 0
    steps_ahead: int = 0  # sent before the previous step's result came back (async scheduling)
    requests: int = 0  # AddRequest messages
    parallel_sample_requests: int = 0  # n > 1
    sequences: int = 0  # distinct sequence ids the workers saw
    aborts: int = 0  # request ids in AbortRequest messages (stop strings, client hang-ups)
    prefill_tokens: int = 0
    chunked_prefill_chunks: int = 0  # prompt chunks that stopped short of the prompt's end
    decode_tokens: int = 0
    forked_samples: int = 0  # "PARENT/i" sequences of n>1 requests, sharing the parent's blocks
    prefix_hits: int = 0  # sequences admitted with cached tokens (forks aside)
    prefix_hit_tokens: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_copied: int = 0
    blocks_zeroed: int = 0
    sampled_tokens: int = 0
    worker_errors: int = 0
    worker_failures: int = 0  # fail_all records: the scheduler lost its workers
    step_lines: list[str] = field(default_factory=list)
    requests_by_id: dict[str, "RequestRecord"] = field(default_factory=dict)  # arrival order
    drops: list[tuple[int, list[str], list[str]]] = field(default_factory=list)  # (step, dropped, running after it)


@dataclass
class RequestRecord:
    """One sequence's life as the scheduler's own record shows it: the order it arrived in, the
    step that first scheduled it, the step whose result is its first token (its prompt's last
    chunk), the steps that preempted it (the workers dropped it, then were sent it whole again), and
    the last step that computed a token of it."""
    req_id: str
    arrival: int  # index among the AddRequests, in the order the scheduler received them
    first_scheduled_step: int = -1
    first_token_step: int = -1
    preempted_steps: list[int] = field(default_factory=list)
    last_step: int = -1

    def line(self) -> str:
        return (f"  {self.req_id}: arrival #{self.arrival}, first scheduled at step {self.first_scheduled_step}, "
                f"first token at step {self.first_token_step}, preempted at steps {self.preempted_steps or '-'}, "
                f"last token at step {self.last_step}")


class _Summarizer:
    def __init__(self, per_step: bool):
        self.s = TraceSummary()
        self.per_step = per_step
        self.held: dict[str, HeldRequest] = {}  # what the workers hold, as they would apply each step
        self.seen: set[str] = set()  # every sequence id sent in full
        self.dropped: dict[str, int] = {}  # dropped by the workers and not (yet) sent again -> the step
        self.steps_out = 0  # steps sent whose rank-0 result is not yet in

    def frontend(self, msg) -> None:
        if isinstance(msg, m.AddRequest):
            self.s.requests_by_id[msg.request_id] = RequestRecord(msg.request_id, self.s.requests)
            self.s.requests += 1
            self.s.parallel_sample_requests += msg.sampling.n > 1
        elif isinstance(msg, m.AbortRequest):
            self.s.aborts += len(msg.request_ids)

    def _count(self, seq: HeldRequest) -> None:
        s = self.s
        computed, scheduled = seq.num_computed_tokens, seq.num_scheduled_tokens
        if computed + scheduled < len(seq.token_ids):
            s.prefill_tokens += scheduled
            s.chunked_prefill_chunks += computed + scheduled < seq.num_prompt_tokens
        elif scheduled == 1 and computed >= seq.num_prompt_tokens:
            s.decode_tokens += 1
        else:
            s.prefill_tokens += scheduled

    def _record(self, req_id: str) -> RequestRecord:
        """A sequence's record (samples of an n>1 request, "PARENT/i", get their own)."""
        records = self.s.requests_by_id
        if req_id not in records:
            records[req_id] = RequestRecord(req_id, records[req_id.rpartition("/")[0]].arrival
                                            if req_id.rpartition("/")[0] in records else -1)
        return records[req_id]

    def step(self, out: m.SchedulerOutput) -> None:
        s = self.s
        s.steps += 1
        s.steps_ahead += self.steps_out > 0
        self.steps_out += 1
        swapped_in = {dst for _, dst in out.blocks_to_swap_in}
        for r in out.new_requests:
            if r.req_id not in self.seen:
                s.sequences += 1
                parent = r.req_id.rpartition("/")[0]
                if parent in self.seen:  # sample i of an n>1 request, forked from its prompt
                    s.forked_samples += 1
                elif r.num_computed_tokens > 0:
                    s.prefix_hits += 1
                    s.prefix_hit_tokens += r.num_computed_tokens
            elif r.req_id in self.dropped:
                self._record(r.req_id).preempted_steps.append(self.dropped[r.req_id])
                if swapped_in & set(r.block_ids):
                    s.preemptions_swap += 1
                else:
                    s.preemptions_recompute += 1
            self.seen.add(r.req_id)
            self.dropped.pop(r.req_id, None)
        dropped = [req_id for req_id in out.finished_req_ids if req_id in self.held]
        if dropped:  # a preemption or an end: which one shows when (if) it is sent again
            running = [r for r in self.held if r not in dropped]  # and those this step sends (admits)
            s.drops.append((out.step, dropped, running + [r.req_id for r in out.new_requests if r.req_id not in running]))
        for req_id in dropped:
            self.dropped[req_id] = out.step
        try:
            # Counting needs no token values, and a step sent ahead precedes the result its
            # placeholders stand for: they stay unresolved.
            scheduled = apply_output(self.held, out, resolve_placeholders=False)
        except StepContractError as exc:
            raise TraceError(str(exc)) from None
        for seq in scheduled:
            self._count(seq)
            record = self._record(seq.req_id)
            if record.first_scheduled_step < 0:
                record.first_scheduled_step = out.step
            if record.first_token_step < 0 and seq.num_computed_tokens + seq.num_scheduled_tokens >= seq.num_prompt_tokens:
                record.first_token_step = out.step
            record.last_step = out.step
        decodes = out.decodes
        s.blocks_swapped_out += len(out.blocks_to_swap_out)
        s.blocks_swapped_in += len(out.blocks_to_swap_in)
        s.blocks_copied += len(out.blocks_to_copy)
        s.blocks_zeroed += len(out.new_block_ids_to_zero)
        if self.per_step:
            s.step_lines.append(
                f"  step {out.step:>6}: new {len(out.new_requests):>3} cached {len(out.cached_requests):>4} "
                f"decodes {len(decodes.req_ids):>4} tokens {out.total_num_scheduled_tokens:>5} "
                f"swap-out {len(out.blocks_to_swap_out)} swap-in {len(out.blocks_to_swap_in)} "
                f"copy {len(out.blocks_to_copy)} zero {len(out.new_block_ids_to_zero)} "
                f"dropped {len(out.finished_req_ids)}")

    def result(self, msg) -> None:
        if isinstance(msg, m.StepResult) and msg.rank == 0:
            self.steps_out = max(0, self.steps_out - 1)
            self.s.sampled_tokens += len(msg.sampled_token_ids) + sum(msg.num_accepted_tokens.values())
            note_accepted(self.held, msg.num_accepted_tokens, None)  # a step that verified proposals is never ahead
            self.s.worker_errors += bool(msg.error)


def summarize_trace(trace: Trace, per_step: bool = False) -> TraceSummary:
    to_worker, from_worker = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
    from_frontend = Decoder(m.FrontendToScheduler)
    acc = _Summarizer(per_step)
    for index, (direction, payload) in enumerate(trace.records):
        try:
            if direction == "from_frontend":
                acc.frontend(from_frontend.decode(payload))
            elif direction == "to_worker":
                msg = to_worker.decode(payload)
                if isinstance(msg, m.SchedulerOutput):
                    acc.step(msg)
            elif direction == "from_worker":
                acc.result(from_worker.decode(payload))
            elif direction == "fail_all":
                acc.s.worker_failures += 1
                acc.held.clear()
                acc.seen.clear()
                acc.dropped.clear()
                acc.steps_out = 0
        except ProtocolError as exc:
            raise TraceError(f"{trace.path}: record {index + 2} ({direction}) is not a valid frame: {exc}") from None
    return acc.s


def format_summary(trace: Trace, s: TraceSummary) -> str:
    meta, cfg, init = trace.meta, trace.meta["config"], trace.meta.get("init") or {}
    out = [
        f"trace {trace.path}",
        f"  protocol v{meta['protocol_version']}, model {meta.get('model_id')} "
        f"(weights {meta.get('weights')}) on {meta.get('device')}",
        f"  config: block_size={cfg.get('block_size')} gpu_blocks={init.get('num_gpu_blocks')} "
        f"cpu_blocks={init.get('num_cpu_blocks')} max_num_batched_tokens={cfg.get('max_num_batched_tokens')} "
        f"tp={cfg.get('tensor_parallel_size')} prefix_caching={cfg.get('enable_prefix_caching')} "
        f"chunked_prefill={cfg.get('enable_chunked_prefill')} seed={cfg.get('seed')}",
        f"  steps {s.steps} (scheduled ahead of the previous result: {s.steps_ahead}), requests {s.requests} (n>1: {s.parallel_sample_requests}), "
        f"sequences {s.sequences} (forked samples {s.forked_samples}), aborts {s.aborts}",
        f"  tokens: prefill {s.prefill_tokens} (chunks cut short {s.chunked_prefill_chunks}), "
        f"decode {s.decode_tokens}, sampled {s.sampled_tokens}",
        f"  prefix cache: {s.prefix_hits} hits, {s.prefix_hit_tokens} tokens",
        f"  preemptions: swap {s.preemptions_swap}, recompute {s.preemptions_recompute}",
        f"  blocks: swapped out {s.blocks_swapped_out}, swapped in {s.blocks_swapped_in}, "
        f"copied {s.blocks_copied}, zeroed {s.blocks_zeroed}",
        f"  worker errors {s.worker_errors}, worker failures {s.worker_failures}",
    ]
    if trace.torn_tail:
        out.append(f"  WARNING: {trace.torn_tail}")
    return "\n".join(out + s.step_lines)


def summarize(path: str, per_step: bool = False, per_request: bool = False) -> str:
    trace = read_trace(path)
    summary = summarize_trace(trace, per_step)
    lines = [format_summary(trace, summary)]
    if per_request:
        lines += ["requests (arrival order):", *(r.line() for r in summary.requests_by_id.values())]
    return "\n".join(lines)


def show_main(ns: argparse.Namespace) -> int:
    try:
        text = summarize(ns.trace, per_step=ns.steps, per_request=ns.requests)
    except TraceError as exc:
        print(f"pagedserve trace show: {exc}", file=sys.stderr)
        return 2
    try:
        print(text)
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 0

