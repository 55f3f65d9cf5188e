"""The operator's periodic one-line summary while the replica is busy."""

from __future__ import annotations

import logging
import time

from pagedserve.protocol.messages import SchedulerStats


class IntervalLog:
    def __init__(self, log: logging.Logger, interval_s: float):
        self.log = log
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last: SchedulerStats | None = None

    def maybe_log(self, s: SchedulerStats) -> None:
        now = time.monotonic()
        if self.last is None:
            self.last, self.last_time = s, now
            return
        dt = now - self.last_time
        if dt < self.interval_s:
            return
        prev, self.last, self.last_time = self.last, s, now
        if s.step == prev.step:
            return  # idle: nothing new to say
        idle = s.worker_idle_time_s - prev.worker_idle_time_s
        fwd = s.worker_forward_time_s - prev.worker_forward_time_s
        queries = s.prefix_cache_queries - prev.prefix_cache_queries
        hits = s.prefix_cache_hits - prev.prefix_cache_hits
        preempt = (s.num_preemptions_recompute + s.num_preemptions_swap
                   - prev.num_preemptions_recompute - prev.num_preemptions_swap)
        missed = (s.num_queue_time_expired + s.num_deadline_expired
                  - prev.num_queue_time_expired - prev.num_deadline_expired)
        self.log.info(
            "replica %d (%s): prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, "
            "swapped %d | KV %.1f%% | prefix hit %.1f%% | preemptions +%d | time limits +%d | shed +%d | "
            "worker idle %.1f%% of step",
            s.replica, s.scheduling_policy, (s.prompt_tokens - prev.prompt_tokens) / dt,
            (s.generation_tokens - prev.generation_tokens) / dt, s.num_running, s.num_waiting,
            s.num_swapped, 100 * s.kv_cache_usage, 100 * hits / queries if queries else 0.0,
            preempt, missed, s.num_requests_shed - prev.num_requests_shed,
            100 * idle / (idle + fwd) if idle + fwd > 0 else 0.0)
        drafts = s.spec_decode_num_drafts - prev.spec_decode_num_drafts
        if drafts:  # vLLM's figure: tokens per verifying step, the sampled one included
            accepted = s.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
            proposed = s.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
            self.log.info("replica %d: speculative decoding: mean acceptance length %.2f, acceptance rate "
                          "%.1f%% (%d proposals in %d verifications)", s.replica, 1 + accepted / drafts,
                          100 * accepted / proposed if proposed else 0.0, proposed, drafts)
