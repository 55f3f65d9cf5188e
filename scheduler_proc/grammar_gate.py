"""Holds the frontend's messages while the grammar backend is still loading, should a
grammar-constrained request arrive before it is in (grammar_cache.py): compiling it would
block the loop, and its heartbeats, for seconds. Everything after the first held message is
held too, so messages are applied in arrival order (an abort never overtakes its request)."""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import AddRequest

from pagedserve.scheduler_proc.grammar_cache import GrammarBackendLoader


class GrammarGate:
    def __init__(self, loader: Optional[GrammarBackendLoader]):
        self.loader = loader
        self.held: list = []

    def admit(self, msgs: list) -> list:
        """The messages to apply now, in order; the rest wait for the backend."""
        if self.loader is None or self.loader.ready():
            if not self.held:
                return msgs
            released, self.held = self.held, []
            return released + msgs
        now = []
        for msg in msgs:
            if self.held or (isinstance(msg, AddRequest) and msg.sampling.structured_outputs is not None):
                self.held.append(msg)
            else:
                now.append(msg)
        return now
