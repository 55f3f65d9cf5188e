"""Speculative decoding's scheduler half: proposals, slots for them, and what came back.

Prompt lookup (``ngram``) runs here, in the scheduler process: it needs only the sequence's
token ids, which the scheduler holds whole (the workers hold them too, but only the scheduler
knows, before it builds the step, how many slots it can give). A draft model (``draft_model``)
runs in the worker, beside the target (worker_proc/draft_model.py): each step names the
speculating entries and how many tokens each may propose (``SchedulerOutput.draft_tokens``),
and the result brings the draft's proposals after each one's sample
(``StepResult.draft_token_ids``), kept on the sequence for its next step. Either way the
proposals then travel in the step (``SchedulerOutput.spec_token_ids``), trimmed here by the
same room, ``max_tokens``, cache and backoff rules, so every worker of a tensor-parallel group
and a replayed trace verify exactly the same ones.

One step of a speculating sequence: a plain decode (its newest token) followed by up to k
proposals; ``propose`` says which it wants, and the scheduler asks the block manager how many
fit and takes the slots for them. Proposals never preempt: they take only the blocks no later
sequence of the step may need, and shrink or vanish when the cache is tight. The workers score
the k + 1 positions in one forward, accept a prefix of the proposals and sample one more token;
the scheduler then takes the accepted ones, shrinks ``num_kv_tokens`` to the accepted positions
and gives the blocks of the rejected ones back in the same update (``Scheduler._apply_samples``).

Who speculates: sequences of requests that ask for no logprobs (their logprobs would be one
per accepted token; switched off instead, the simplest correct choice) and no grammar (a
mask per proposed position would need the matcher advanced through every proposal and rolled
back on rejection; switched off, the simplest correct choice). Such a sequence stays out of
the decode lane while it speculates, so a step holding one is never scheduled ahead
(``Scheduler.can_schedule_ahead``): async scheduling is off for those steps, on again once no sequence speculates.

Backoff, per sequence, by expected gain (spec_cost.py): the steps' recorded clock gives what
a verification position costs against a plain decode (``rho``), the sequence's verifications
give how often a proposal is accepted (``alpha``), and it proposes only the tokens whose
expected worth exceeds their cost; once none do, it stops for good and joins the decode lane,
where a decode costs what it costs without speculation (and async scheduling overlaps its
steps again). The number of proposals is that count too (up to k): one more position pays
while alpha^j > rho, so a sequence that is mostly right on a cheap row proposes all k, and one
often wrong, or on a dear row, fewer. Within that: two verifications in a row that accept
nothing pause it for 1, 2, 4, ... 16 steps (reset by any acceptance); and it stops for good
once 16 proposals were verified with under 10% accepted, or 32 decodes in a row found nothing
to propose.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.spec_cost import StepCost, worth_proposing

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Sequence

MISSES_BEFORE_PAUSE = 2  # verifications in a row that accept nothing
MAX_PAUSE = 16  # steps
GIVE_UP_AFTER = 16  # proposals verified before a sequence may stop for good
GIVE_UP_BELOW = 0.1  # ... when under this share of them was accepted
GIVE_UP_UNMATCHED = 32  # decodes in a row whose lookup found nothing: it stops for good


class SpecState:
    """One sequence's speculation: proposals in flight and its backoff."""

    __slots__ = ("drafts", "misses", "skip", "pause", "proposed", "accepted", "rejections", "unmatched",
                 "off", "worker_drafts", "worker_drafts_at")

    def __init__(self):
        self.drafts: list[int] = []  # proposals of the step out (verified by its result)
        self.misses = 0
        self.skip = 0  # steps left before it proposes again
        self.pause = 1  # the next pause's length
        self.proposed = 0
        self.accepted = 0
        self.rejections = 0  # verifications that stopped at a wrong proposal (spec_cost.worth_proposing)
        self.unmatched = 0  # decodes in a row with nothing to propose
        self.off = False  # stopped for good: it may join the decode lane
        self.worker_drafts: list[int] = []  # draft_model: the draft's proposals after the latest sample ...
        self.worker_drafts_at = -1  # ... when the sequence held this many tokens (stale after any other)


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier occurrence of the longest suffix of
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, in prompt and output alike.
    When the continuation reaches the end of the sequence it goes on through the proposals
    themselves, so a repetition with a period shorter than k still yields k proposals."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, tokens: array, max_tokens: int) -> list[int]:
        ids = np.frombuffer(tokens, dtype=np.int64)
        length = len(ids)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            tail = ids[length - n:]
            starts = np.flatnonzero(ids[:length - n] == tail[0])  # a match ends before the last token
            for offset in range(1, n):
                if not len(starts):
                    break
                starts = starts[ids[starts + offset] == tail[offset]]
            if len(starts):
                begin = int(starts[-1]) + n
                out: list[int] = []
                for j in range(max_tokens):
                    at = begin + j
                    out.append(int(ids[at]) if at < length else out[at - length])
                return out
        return []


class Speculator:
    """Proposals for a step's decodes, and the verdicts of their results, with the counters
    ``vllm:spec_decode_*`` report."""

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.k = config.num_speculative_tokens
        # draft_model: the worker's draft proposes (received), unless a test hands a proposer
        self.from_worker = proposer is None and config.method == "draft_model"
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0  # verifications (a sequence's proposals of one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.cost = StepCost()  # fed each step's recorded clock (observe_step)
        self.priced = config.backoff == "expected_gain"  # else acceptance alone decides
        self.plain_step = False  # the next step proposes nothing: it prices the plain decode

    def worth_starting(self) -> bool:
        """Whether a new sequence, at even odds, would propose at the measured cost; if not it
        never speculates and takes the decode lane from its first token."""
        return not self.priced or worth_proposing(0, 0, self.cost.rho, self.k) > 0

    def propose(self, seq: "Sequence", token_room: int) -> list[int]:
        """The proposals ``seq``, a decode whose one token already has its slot, wants to verify: at
        most ``token_room`` of the step's tokens, never past ``max_tokens`` (the scheduler cuts
        them to the blocks it can spare)."""
        spec = seq.spec
        if spec.off or (self.plain_step and self.priced):
            return []
        if spec.skip:
            spec.skip -= 1
            return []
        if not seq.worker_knows or seq.recompute_until > seq.num_kv_tokens:
            return []  # the step resends it whole (NewRequestData): plain this once
        tokens = seq.token_ids
        most = min(self.k, token_room, seq.max_len - len(tokens) - 1)
        if most <= 0:
            return []
        most = worth_proposing(spec.accepted, spec.rejections, self.cost.rho if self.priced else 0.0, most)
        if most <= 0:  # no proposal is worth its row: only a lookup would have changed that
            spec.off = True
            return []
        if self.from_worker:
            drafts = spec.worker_drafts[:most] if spec.worker_drafts_at == len(tokens) else []
        else:
            drafts = self.proposer.propose(tokens, most)
        if not drafts:
            spec.unmatched += 1
            spec.off = spec.unmatched >= GIVE_UP_UNMATCHED
            return []
        spec.unmatched = 0
        return drafts

    def settle(self, seq: "Sequence", num_accepted: int) -> None:
        """The result of ``seq``'s proposals: counters and its backoff."""
        spec = seq.spec
        proposed = len(spec.drafts)  # the scheduler clears them when it applies the samples
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        spec.proposed += proposed
        spec.accepted += num_accepted
        spec.rejections += num_accepted < proposed
        if num_accepted:
            spec.misses, spec.pause = 0, 1
        else:
            spec.misses += 1
            if spec.misses >= MISSES_BEFORE_PAUSE:
                spec.skip, spec.pause, spec.misses = spec.pause, min(2 * spec.pause, MAX_PAUSE), 0
        if spec.proposed >= GIVE_UP_AFTER and spec.accepted < GIVE_UP_BELOW * spec.proposed:
            spec.off = True

    def receive(self, seq: "Sequence", drafts: Optional[list[int]], length: int) -> None:
        """draft_model: the draft's proposals after ``seq``'s sample, once it holds ``length`` tokens."""
        spec = seq.spec
        spec.worker_drafts = drafts[:self.k] if drafts else []
        spec.worker_drafts_at = length

    def _wanted_drafts(self, batch, none: bool) -> dict[str, int]:
        """draft_model: every entry of a sequence still speculating goes through the worker's draft
        too (its cache must hold what the target's holds), with the proposals it may use next step
        (``none``: no proposals at all); one that backed off for good costs no draft work."""
        rho = self.cost.rho if self.priced else 0.0
        wanted = {}
        for seq in (*batch.sampling_new, *batch.sampling_cached, *batch.others):
            spec = seq.spec
            if spec is not None and not spec.off:
                most = min(self.k, seq.max_len - len(seq.token_ids) - 1)
                wanted[seq.seq_id] = 0 if none or spec.skip else max(0, worth_proposing(
                    spec.accepted, spec.rejections, rho, most))
        return wanted

    def observe_step(self, out, batch=None) -> None:
        """A step was built (``SchedulerOutput``): its recorded clock ends the previous step's cycle.
        With ``batch`` and a draft model, the step also names what the worker's draft computes."""
        plain = self.plain_step and self.priced
        if self.from_worker and batch is not None:
            # A plain step proposes nothing after it either, so its cycle prices a plain decode
            # (the draft's own rows aside); a step that asks for proposals without verifying any
            # prices neither a plain decode nor a row, and is left out.
            out.draft_tokens = self._wanted_drafts(batch, none=plain)
        num_seqs = len(out.new_requests) + len(out.cached_requests) + len(out.decodes.req_ids)
        num_rows = sum(len(d) for d in out.spec_token_ids.values())
        pure = (not out.new_requests and out.total_num_scheduled_tokens == num_seqs + num_rows
                and (num_rows > 0 or not any(out.draft_tokens.values())))
        self.cost.observe(out.step, out.now_s, num_seqs, num_rows, pure, overlapped=not out.cached_requests)
        self.plain_step = self.cost.wants_plain_step
        if self.plain_step and self.priced and out.draft_tokens:  # the next step would not use them
            out.draft_tokens = dict.fromkeys(out.draft_tokens, 0)

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


def speculator_for(config: Optional[SpeculativeConfig], proposer=None) -> Optional[Speculator]:
    return None if config is None else Speculator(config, proposer)


def spec_k_for(speculator: Optional[Speculator], msg, compiled_grammar) -> int:
    """Proposals per step a new request's samples may verify: none with logprobs or a grammar,
    nor while a verification position costs more than a fresh sequence's proposals are worth."""
    if speculator is None or msg.sampling.logprobs or compiled_grammar is not None or not speculator.worth_starting():
        return 0
    return speculator.k
