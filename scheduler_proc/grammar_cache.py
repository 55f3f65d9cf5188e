"""Compiles a request's ``StructuredOutputs`` against the served tokenizer, once per grammar.

The scheduler process owns every constrained request's matcher (grammar.py); this is where
their compiled grammars come from. The tokenizer is read from the model directory on the
first constrained request, not at startup: a deployment that never sees one never pays for
xgrammar, torch and transformers in this process. Compiled grammars are kept in a bounded
LRU keyed by the grammar's wire bytes, so a schema sent by every request compiles once.

The bitmask width is the *model's* vocabulary (embedding rows, from the workers' hello),
which may exceed the tokenizer's: ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import msgspec

from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.protocol.structured_outputs import build_grammar
from pagedserve.protocol.validate import InvalidField

MAX_CACHED_GRAMMARS = 256


def words_per_row(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class CompiledGrammarCache:
    """The served tokenizer's grammar compiler plus an LRU of compiled grammars."""

    def __init__(self, model_dir: str, vocab_size: int, max_entries: int = MAX_CACHED_GRAMMARS):
        if vocab_size <= 0:
            raise ValueError("structured output needs the model's vocabulary size")
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words_per_row = words_per_row(vocab_size)
        self.max_entries = max_entries
        self._compiler = None
        self._compiled: OrderedDict[bytes, object] = OrderedDict()

    def _grammar_compiler(self):
        if self._compiler is None:
            import transformers
            import xgrammar

            tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec``, cached; raises InvalidField naming the problem."""
        key = msgspec.msgpack.encode(spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        grammar = build_grammar(spec)
        try:
            compiled = self._grammar_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidField("structured_outputs", f"the grammar cannot be compiled: {exc}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
        return compiled


def compile_for(cache: Optional[CompiledGrammarCache], spec: Optional[StructuredOutputs]):
    """(compiled grammar or None when unconstrained, None), or (None, why it cannot be served)."""
    if spec is None:
        return None, None
    if cache is None:
        return None, ("structured_outputs: structured output is not available on this replica "
                      "(it needs the model directory's tokenizer and vocabulary size)")
    try:
        return cache.compile(spec), None
    except InvalidField as exc:
        return None, str(exc)


def grammar_cache_for(model_dir: Optional[str], vocab_size: int) -> Optional[CompiledGrammarCache]:
    """The cache for a scheduler serving ``model_dir``, or None where structured output cannot work."""
    if not model_dir or vocab_size <= 0:
        return None
    return CompiledGrammarCache(model_dir, vocab_size)
