"""``pagedserve trace show TRACE``: what happened in a recorded run, for a human."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, ProtocolError
from pagedserve.protocol.trace import TraceError, read_trace


def summarize(path: str, per_step: bool = False) -> str:
    trace = read_trace(path)
    to_worker, from_worker = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
    from_frontend = Decoder(m.FrontendToScheduler)
    c: Counter = Counter()
    seen: set[str] = set()
    dropped: set[str] = set()
    lines: list[str] = []
    for direction, payload in trace.records:
        try:
            if direction == "from_frontend":
                msg = from_frontend.decode(payload)
                c[type(msg).__name__] += 1
            elif direction == "to_worker":
                msg = to_worker.decode(payload)
                if not isinstance(msg, m.SchedulerOutput):
                    continue
                c["steps"] += 1
                for r in msg.new_requests:
                    c["resumed" if r.req_id in dropped else "admitted"] += 1
                    if r.req_id not in seen:
                        seen.add(r.req_id)
                    dropped.discard(r.req_id)
                dropped.update(msg.finished_req_ids)
                c["prefill_tokens"] += sum(r.num_scheduled_tokens for r in msg.new_requests)
                c["scheduled_tokens"] += msg.total_num_scheduled_tokens
                c["swap_out"] += len(msg.blocks_to_swap_out)
                c["swap_in"] += len(msg.blocks_to_swap_in)
                c["copies"] += len(msg.blocks_to_copy)
                c["zeroed"] += len(msg.new_block_ids_to_zero)
                if per_step:
                    lines.append(
                        f"  step {msg.step:>6}: new {len(msg.new_requests):>3} cached {len(msg.cached_requests):>4} "
                        f"tokens {msg.total_num_scheduled_tokens:>5} swap-out {len(msg.blocks_to_swap_out)} "
                        f"swap-in {len(msg.blocks_to_swap_in)} copy {len(msg.blocks_to_copy)} "
                        f"zero {len(msg.new_block_ids_to_zero)} dropped {len(msg.finished_req_ids)}")
            elif direction == "from_worker":
                msg = from_worker.decode(payload)
                if isinstance(msg, m.StepResult) and msg.rank == 0:
                    c["sampled_tokens"] += len(msg.sampled_token_ids)
                    c["worker_errors"] += bool(msg.error)
            elif direction == "fail_all":
                c["worker_failures"] += 1
        except ProtocolError as exc:
            raise TraceError(f"{path}: a {direction} record is not a valid frame: {exc}") from None
    meta = trace.meta
    cfg = meta.get("config", {})
    out = [
        f"trace {path}",
        f"  protocol v{meta['protocol_version']}, model {meta.get('model_id')} on {meta.get('device')}",
        f"  config: block_size={cfg.get('block_size')} tp={cfg.get('tp_size')} "
        f"prefix_caching={cfg.get('enable_prefix_caching')} chunked_prefill={cfg.get('enable_chunked_prefill')}",
        f"  steps {c['steps']}, requests {len(seen)} (added {c['AddRequest']}, aborts {c['AbortRequest']}), "
        f"sampled tokens {c['sampled_tokens']}",
        f"  scheduled tokens {c['scheduled_tokens']}, preemptions (resumed requests) {c['resumed']}",
        f"  blocks: swapped out {c['swap_out']}, swapped in {c['swap_in']}, copied {c['copies']}, "
        f"zeroed {c['zeroed']}",
        f"  worker errors {c['worker_errors']}, worker failures {c['worker_failures']}",
    ]
    if trace.torn_tail:
        out.append(f"  WARNING: {trace.torn_tail}")
    return "\n".join(out + lines)


def show_main(ns: argparse.Namespace) -> int:
    try:
        print(summarize(ns.trace, per_step=ns.steps))
    except TraceError as exc:
        print(f"pagedserve trace show: {exc}", file=sys.stderr)
        return 2
    return 0
