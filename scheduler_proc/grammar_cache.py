"""Compiles a request's ``StructuredOutputs`` against the served tokenizer, once per grammar.

The scheduler process owns every constrained request's matcher (grammar.py); this is where
their compiled grammars come from. xgrammar (with torch) and the model directory's tokenizer
take seconds to load, longer than the frontend waits for a heartbeat, so the engine loads
them in a thread (``GrammarBackendLoader``) from its start, while the workers start, and
holds frontend messages from a constrained request that comes before they are in
(grammar_gate.py). Loading them at the first constrained request instead was tried: loading
torch's libraries holds the GIL, and on a loaded machine the loop's heartbeats stopped for
more than the frontend's 5 s, failing requests. Compiled
grammars are kept in a bounded LRU keyed by the grammar's wire bytes, so a schema sent by
every request compiles once.

The bitmask width is the *model's* vocabulary (embedding rows, from the workers' hello),
which may exceed the tokenizer's: ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import msgspec

from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.protocol.structured_outputs import build_grammar
from pagedserve.protocol.validate import InvalidField
from pagedserve.scheduler_proc.grammar import ServedGrammar
from pagedserve.scheduler_proc.utf8_guard import Utf8Guard

MAX_CACHED_GRAMMARS = 256


def words_per_row(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarBackendLoader:
    """Imports xgrammar, reads ``model_dir``'s tokenizer and builds a grammar compiler for the
    vocabulary size in its config.json: in a thread once ``start``ed (the engine, at its
    start), or in the caller on first use (replay, tests)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.tokenizer = None
        self.compiler = None  # for ``compiler_vocab_size`` ids
        self.compiler_vocab_size = 0
        self.error: Optional[str] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None and not self._done.is_set():
            self._thread = threading.Thread(target=self._load, name="grammar-backend-loader", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            import transformers

            self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
            config = transformers.AutoConfig.from_pretrained(self.model_dir)
            vocab_size = getattr(config.get_text_config(), "vocab_size", 0) or 0
            if vocab_size > 0:
                self.compiler = new_compiler(self.tokenizer, vocab_size)
                self.compiler_vocab_size = vocab_size
        except Exception as exc:  # reported to every constrained request, never fatal to serving
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self):
        """The tokenizer; raises InvalidField if it could not be loaded."""
        if self._thread is None and not self._done.is_set():
            self._load()
        self._done.wait()
        if self.tokenizer is None:
            raise InvalidField("structured_outputs", f"structured output is not available on this replica: "
                                                     f"the tokenizer of {self.model_dir} did not load ({self.error})")
        return self.tokenizer


def new_compiler(tokenizer, vocab_size: int):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class CompiledGrammarCache:
    """The served tokenizer's grammar compiler plus an LRU of compiled grammars."""

    def __init__(self, loader: GrammarBackendLoader, vocab_size: int, max_entries: int = MAX_CACHED_GRAMMARS):
        if vocab_size <= 0:
            raise ValueError("structured output needs the model's vocabulary size")
        self.loader = loader
        self.vocab_size = vocab_size
        self.words_per_row = words_per_row(vocab_size)
        self.max_entries = max_entries
        self._compiler = None
        self._utf8: Optional[Utf8Guard] = None
        self._compiled: OrderedDict[bytes, ServedGrammar] = OrderedDict()
        self._failed: OrderedDict[bytes, InvalidField] = OrderedDict()

    def _grammar_compiler(self):
        if self._compiler is None:
            tokenizer = self.loader.wait()
            if self.loader.compiler_vocab_size == self.vocab_size:
                self._compiler = self.loader.compiler
            else:  # the workers' embedding rows differ from config.json's vocab_size
                self._compiler = new_compiler(tokenizer, self.vocab_size)
        return self._compiler

    @staticmethod
    def _key(spec: StructuredOutputs) -> bytes:
        if spec.start_after:  # when the grammar starts is the matcher's business, not the grammar's
            spec = msgspec.structs.replace(spec, start_after=[])
        return msgspec.msgpack.encode(spec)

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec``, cached; raises InvalidField naming the problem."""
        key = self._key(spec)
        if key not in self._compiled and key not in self._failed:
            try:
                self.store(spec, self.compile_uncached(spec))
            except InvalidField as exc:
                self.store(spec, exc)
        failed = self._failed.get(key)
        if failed is not None:
            raise failed
        self._compiled.move_to_end(key)
        return self._compiled[key]

    def known(self, spec: StructuredOutputs) -> bool:
        """Whether ``compile`` answers ``spec`` at once (compiled, or known to fail)."""
        key = self._key(spec)
        return key in self._compiled or key in self._failed

    def compile_uncached(self, spec: StructuredOutputs):
        """xgrammar's compiled grammar of ``spec`` (seconds for a large one; xgrammar lets go of
        the GIL, so a thread may run it while the loop steps: grammar_gate.py); raises InvalidField.
        Reads nothing the loop changes: ``store`` files the result."""
        grammar = build_grammar(spec)
        try:
            return self._grammar_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidField("structured_outputs", f"the grammar cannot be compiled: {exc}") from None

    def store(self, spec: StructuredOutputs, result) -> None:
        """File ``compile_uncached``'s result for ``spec``: a compiled grammar, or the InvalidField
        it raised (remembered too, so a slow failure is not compiled again)."""
        key = self._key(spec)
        if isinstance(result, InvalidField):
            self._failed[key] = result
            if len(self._failed) > self.max_entries:
                self._failed.popitem(last=False)
            return
        if self._utf8 is None:  # one tokenizer per cache: its guard is built once
            self._utf8 = Utf8Guard(result.tokenizer_info.decoded_vocab)
        self._compiled[key] = ServedGrammar(result, self._utf8)
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)


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


def grammar_cache_for(loader: Optional[GrammarBackendLoader], vocab_size: int) -> Optional[CompiledGrammarCache]:
    """The cache for a scheduler, or None where structured output cannot work (no model
    directory, or an unknown vocabulary size)."""
    if loader is None or vocab_size <= 0:
        return None
    return CompiledGrammarCache(loader, vocab_size)
