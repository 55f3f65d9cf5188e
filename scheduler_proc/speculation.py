"""Speculative decoding's scheduler half: proposals, slots for them, and what came back.

The proposer runs here, in the scheduler process, not in the worker: prompt lookup (``ngram``)
needs only the sequence's token ids, which the scheduler holds whole (the workers hold them
too, but only the scheduler knows, before it builds the step, how many slots it can give),
and the proposals then travel in the step (``SchedulerOutput.spec_token_ids``), so every
worker of a tensor-parallel group and a replayed trace verify exactly the same ones.

One step of a speculating sequence: a plain decode (its newest token) followed by up to k
proposals, with slots for all k + 1 reserved from the block manager (check, then commit).
Proposals never preempt: they take only the blocks no later sequence of the step may need,
and shrink or vanish when the cache is tight. The workers score the k + 1 positions in one
forward, accept a prefix of the proposals and sample one more token; the scheduler then takes
the accepted ones, shrinks ``num_kv_tokens`` to the accepted positions and gives the blocks
of the rejected ones back in the same update (``Scheduler.update_from_output``).

Who speculates: sequences of requests that ask for no logprobs (their logprobs would be one
per accepted token; switched off instead, the simplest correct choice) and no grammar (a
mask per proposed position would need the matcher advanced through every proposal and rolled
back on rejection; switched off, the simplest correct choice). Such a sequence stays out of
the decode lane while it speculates, so a step holding one is never scheduled ahead
(overlap.py): async scheduling is off for those steps, on again once no sequence speculates.

Backoff, per sequence, by measured acceptance: after two verifications in a row that accept
nothing the sequence pauses proposing for 1, 2, 4, ... 16 steps (reset by any acceptance),
and the number of proposals follows the last acceptance (one more than accepted, up to k).
Once 16 proposals of a sequence have been verified with under 10% accepted, or 32 decodes in
a row found nothing to propose, it stops for good and joins the decode lane, where a decode
costs what it costs without speculation (and async scheduling overlaps its steps again).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedserve.protocol.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.block_manager import BlockManager
    from pagedserve.scheduler_proc.request import Sequence

MISSES_BEFORE_PAUSE = 2  # verifications in a row that accept nothing
MAX_PAUSE = 16  # steps
GIVE_UP_AFTER = 16  # proposals verified before a sequence may stop for good
GIVE_UP_BELOW = 0.1  # ... when under this share of them was accepted
GIVE_UP_UNMATCHED = 32  # decodes in a row whose lookup found nothing: it stops for good


class SpecState:
    """One sequence's speculation: proposals in flight and its backoff."""

    __slots__ = ("drafts", "k_now", "misses", "skip", "pause", "proposed", "accepted", "unmatched", "off")

    def __init__(self, k: int):
        self.drafts: list[int] = []  # proposals of the step out (verified by its result)
        self.k_now = k
        self.misses = 0
        self.skip = 0  # steps left before it proposes again
        self.pause = 1  # the next pause's length
        self.proposed = 0
        self.accepted = 0
        self.unmatched = 0  # decodes in a row with nothing to propose
        self.off = False  # stopped for good: it may join the decode lane


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
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0  # verifications (a sequence's proposals of one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def new_state(self) -> SpecState:
        return SpecState(self.k)

    def propose(self, seq: "Sequence", bm: "BlockManager", token_room: int, blocks_to_leave: int) -> list[int]:
        """Proposals for ``seq``, a decode whose one token already has its slot: at most
        ``token_room`` of the step's tokens, never past ``max_tokens``, and only in blocks
        that leave ``blocks_to_leave`` free for the step's later sequences."""
        spec = seq.spec
        if spec.off:
            return []
        if spec.skip:
            spec.skip -= 1
            return []
        if not seq.worker_knows or seq.recompute_until > seq.num_kv_tokens:
            return []  # the step resends it whole (NewRequestData): plain this once
        tokens = seq.token_ids
        most = min(spec.k_now, token_room, seq.max_len - len(tokens) - 1)
        if most <= 0:
            return []
        drafts = self.proposer.propose(tokens, most)
        if not drafts:
            spec.unmatched += 1
            spec.off = spec.unmatched >= GIVE_UP_UNMATCHED
            return []
        spec.unmatched = 0
        base = bm.num_new_blocks(seq, 1)
        spare = bm.device.num_free - base - blocks_to_leave
        while drafts and bm.num_new_blocks(seq, 1 + len(drafts)) - base > spare:
            drafts.pop()
        return drafts

    def settle(self, seq: "Sequence", num_accepted: int) -> None:
        """The result of ``seq``'s proposals: counters and its backoff."""
        spec = seq.spec
        proposed = len(spec.drafts)
        spec.drafts = []
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        spec.proposed += proposed
        spec.accepted += num_accepted
        spec.k_now = min(self.k, num_accepted + 1)
        if num_accepted:
            spec.misses, spec.pause = 0, 1
        else:
            spec.misses += 1
            if spec.misses >= MISSES_BEFORE_PAUSE:
                spec.skip, spec.pause, spec.misses = spec.pause, min(2 * spec.pause, MAX_PAUSE), 0
        if spec.proposed >= GIVE_UP_AFTER and spec.accepted < GIVE_UP_BELOW * spec.proposed:
            spec.off = True

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


def speculator_for(config: Optional[SpeculativeConfig], proposer=None) -> Optional[Speculator]:
    return None if config is None else Speculator(config, proposer)


def spec_k_for(speculator: Optional[Speculator], msg, compiled_grammar) -> int:
    """Proposals per step a new request's samples may verify: none with logprobs or a grammar."""
    if speculator is None or msg.sampling.logprobs or compiled_grammar is not None:
        return 0
    return speculator.k


def schedule_decode(speculator: Optional[Speculator], seq: "Sequence", bm: "BlockManager", batch,
                    later: int) -> None:
    """``seq``'s decode, with proposals when it speculates (its one token's block is free)."""
    drafts = speculator.propose(seq, bm, batch.budget - 1 - later, later) if seq.spec is not None else None
    if drafts:
        bm.append_slots(seq, 1 + len(drafts))
        batch.add_drafted(seq, drafts)
    else:
        bm.append_slots(seq, 1)
        batch.add_decode(seq)


def release_rejected(bm: "BlockManager", drafted: list["Sequence"]) -> None:
    """The blocks that held only rejected proposals go back to the pool in the same update."""
    for seq in drafted:
        bm.release_unused(seq)  # a sequence that ended holds nothing: nothing to release
        # the workers drop the same blocks (protocol/step_state.py, note_accepted)
        seq.num_blocks_sent = min(seq.num_blocks_sent, len(seq.block_ids))
