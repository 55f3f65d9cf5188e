"""Holds the frontend's messages from the first grammar-constrained request until the grammar
backend has loaded (grammar_cache.py, in a thread; started here if it was not yet): loading
it in the loop would block the loop, and its heartbeats, for seconds. Everything after the first held
message is held too, so messages are applied in arrival order (an abort never overtakes its
request); running requests keep stepping meanwhile."""

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
                self.loader.start()
                self.held.append(msg)
            else:
                now.append(msg)
        return now
