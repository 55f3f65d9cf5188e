"""Holds the frontend's messages from a grammar-constrained request whose grammar is not ready
until it is: first the grammar backend's load (grammar_cache.py, in a thread; started here if it
was not yet), then the grammar's own compilation, in a thread here. Either in the loop would
block the loop, and with it the steps of running requests and the heartbeats the frontend
counts a replica alive by: a JSON Schema enum of 5,000 long strings took 4 s to compile on a
512-token vocabulary and one of 60,000 over 30 s, and the frontend failed every request of the
replica after 5 s of silence. Everything after the first held message is held too, so messages
are applied in arrival order (an abort never overtakes its request), and the trace records
each where it was applied: a replay, which compiles in line, admits it at the same step.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Optional

from pagedserve.protocol.messages import AddRequest, StructuredOutputs
from pagedserve.protocol.validate import InvalidField

from pagedserve.scheduler_proc.grammar_cache import CompiledGrammarCache, GrammarBackendLoader


class GrammarGate:
    def __init__(self, loader: Optional[GrammarBackendLoader]):
        self.loader = loader
        self.cache: Optional[CompiledGrammarCache] = None  # the scheduler's, once there is one
        self.held: list = []
        self._compiling: Optional[tuple[StructuredOutputs, Future]] = None

    def admit(self, msgs: list) -> list:
        """The messages to apply now, in order; the rest wait for their grammar."""
        queue, self.held = self.held + msgs, []
        for i, msg in enumerate(queue):
            if self._must_wait(msg):
                self.held = queue[i:]
                return queue[:i]
        return queue

    def _must_wait(self, msg) -> bool:
        if self.loader is None or not isinstance(msg, AddRequest) or msg.sampling.structured_outputs is None:
            return False
        if not self.loader.ready():
            self.loader.start()
            return True
        spec, cache = msg.sampling.structured_outputs, self.cache
        if cache is None or cache.known(spec):  # no cache: the scheduler refuses it at once
            return False
        if self._compiling is None:
            self._compiling = (spec, _in_thread(cache.compile_uncached, spec))
            return True
        compiling, future = self._compiling
        if compiling is not spec or not future.done():
            return True
        self._compiling = None
        error = future.exception()
        if error is not None and not isinstance(error, InvalidField):
            error = InvalidField("structured_outputs", f"the grammar cannot be compiled: {error}")
        cache.store(spec, error if error is not None else future.result())
        return False


def _in_thread(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread: a stopping scheduler does not wait for a compilation."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the loop, which answers the request with it
            future.set_exception(exc)

    threading.Thread(target=run, name="grammar-compile", daemon=True).start()
    return future
