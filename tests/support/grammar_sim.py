"""A simulated worker for grammar-constrained requests: where its step's bitmask (unpacked by
the workers' own code) gives a request a row, it samples a random allowed token, the stop token
half the time it is allowed, as a model that has finished would; elsewhere ``unmasked`` picks."""

from __future__ import annotations

import random
from typing import Callable, Optional

from pagedserve.worker_proc.grammar_mask import unpack_bitmask

from support.scheduler_sim import SimWorker


class MaskedSamplingWorker(SimWorker):
    def __init__(self, config, eos: int, seed: int = 0,
                 unmasked: Optional[Callable[[str, list[int]], int]] = None):
        self.rng = random.Random(seed)
        self.eos = eos
        self.unmasked = unmasked or (lambda req_id, tokens: self.rng.randrange(10, config.vocab_size))
        self.allowed: dict[str, list[int]] = {}
        super().__init__(config, self.pick)

    def step(self, out):
        self.allowed = {}
        if out.grammar is not None:
            rows = unpack_bitmask(out.grammar, self.config.vocab_size)
            self.allowed = {req_id: row.nonzero().flatten().tolist() for req_id, row in zip(out.grammar.req_ids, rows)}
        return super().step(out)

    def pick(self, req_id: str, tokens: list[int]) -> int:
        allowed = self.allowed.get(req_id)
        if allowed is None:
            return self.unmasked(req_id, tokens)
        if self.eos in allowed and self.rng.random() < 0.5:
            return self.eos
        return self.rng.choice(allowed)
