"""What ``LLM.generate`` returns, and how one request's deltas build it.

Text follows the HTTP frontend's rules exactly (client/sample_text.py): stop tokens are not
rendered, a stop string ends the text before it. ``token_ids`` holds every token the engine
sampled for the sample until it ended (a stop token included, as vLLM's do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Optional, Union

import msgspec

from pagedserve.client.engine_session import InFlight
from pagedserve.client.routing_policy import Decision
from pagedserve.protocol import messages as m
from pagedserve.client.detokenizer import TextDecoder
from pagedserve.client.prompt_logprobs import prompt_logprob_tables
from pagedserve.client.sample_text import SampleText, ended_by_stop_string


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's logprob, its rank among the vocabulary (1: most likely) and its text.

    A sampled token's rank is known only when it is one of the k alternatives asked for (its place
    among them): the wire carries no rank for the sampled token itself, so outside them it is None.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None
    # vLLM's, with SamplingParams.logprobs=k: per token id a dict token id -> Logprob of the
    # sampled token and the k most likely
    logprobs: Optional[list[dict[int, Logprob]]] = None
    # vLLM's: the stop string or requested stop token id that ended the sample, else None
    stop_reason: Union[str, int, None] = None

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """The sum of the sampled tokens' logprobs (a stop token's included, as in vLLM);
        None without logprobs."""
        if self.logprobs is None:
            return None
        return float(sum(lp[token].logprob for token, lp in zip(self.token_ids, self.logprobs)))


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result; ``text`` / ``token_ids`` / ``finish_reason`` are its first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float = 0.0  # time.perf_counter() when it was sent
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # when each delta of sample 0 arrived
    prompt: Optional[str] = None  # the prompt's text; None when given as token ids
    # With SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then
    # per token a dict token id -> Logprob of the prompt token and the k most likely.
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason


class PendingRequest(InFlight):
    """A request sent and not finished (the engine session's record of it): where its result goes
    and each sample's text so far."""

    def __init__(self, index: int, output: RequestOutput, placed: Decision, decoder: TextDecoder,
                 stop_strings: list[str], stop_token_ids: Collection[int] = (), min_tokens: int = 0,
                 lora_name: str = ""):
        super().__init__(output.request_id, placed.replica, len(output.outputs), placed.predicted_hit_tokens,
                         lora_name)
        self.index = index  # in the caller's list of prompts
        self.stop_token_ids = frozenset(stop_token_ids)
        self.output = output
        # Without stop strings, the text is decoded once at the end: the same text (the
        # detokenizer decodes its whole window), without a decode per token.
        self.streaming = bool(stop_strings)
        self.token_text = lambda token: decoder.decode([token])
        self.texts = [SampleText(decoder, stop_strings, decoder.stream_backend, min_tokens)
                      for _ in output.outputs]

    @property
    def finished(self) -> bool:
        """Every sample ended here (a stop string may end one before the scheduler does)."""
        return self.output.finished

    @property
    def ended_by_stop_string(self) -> bool:
        """Finished here while the scheduler still runs it (it knows no strings)."""
        return ended_by_stop_string(self.texts)

    def apply(self, delta: m.RequestDelta, now: float) -> int:
        """Apply one delta; returns how many tokens it added."""
        if delta.finish_reason == "error":  # an error for the request (sample 0 only, at times) ends it
            for sample, text in zip(self.output.outputs, self.texts):
                if sample.finish_reason is None:
                    tokens = [] if self.streaming else sample.token_ids  # flush what is held back
                    sample.text += text.apply(m.RequestDelta(delta.request_id, sample.index, tokens, "error")).text
                    sample.finish_reason, sample.error = "error", delta.error
            self.output.finish_time = now
            return 0
        if not 0 <= delta.index < len(self.output.outputs):
            return 0
        sample = self.output.outputs[delta.index]
        if sample.finish_reason is not None:
            return 0  # ended by a stop string; the scheduler lags behind
        text = self.texts[delta.index]
        if self.streaming:  # first: a stop string inside a speculative step's tokens ends the sample there
            update = text.apply(delta)
            sample.text += update.text
            if update.consumed < len(delta.new_token_ids):
                delta = msgspec.structs.replace(
                    delta, new_token_ids=delta.new_token_ids[:update.consumed],
                    logprobs=None if delta.logprobs is None else delta.logprobs[:update.consumed],
                    top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[:update.consumed])
        sample.token_ids += delta.new_token_ids
        if delta.prompt_logprobs is not None and self.output.prompt_logprobs is None:
            # as many alternatives as the scheduler sent (as were asked for)
            self.output.prompt_logprobs = prompt_logprob_tables(
                self.output.prompt_token_ids, delta.prompt_logprobs, m.MAX_TOP_LOGPROBS,
                lambda token, logprob, rank: Logprob(logprob, rank, self.token_text(token)))
        if delta.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + self._logprobs(delta)
        if delta.index == 0 and delta.new_token_ids:
            self.output.first_token_time = self.output.first_token_time or now
            self.output.token_times.append(now)
        if not self.streaming and delta.finish_reason is not None:
            sample.text = text.apply(m.RequestDelta(delta.request_id, delta.index, sample.token_ids,
                                                    delta.finish_reason,
                                                    stop_token_id=delta.stop_token_id)).text
        if text.finish_reason is not None:
            sample.finish_reason, sample.error = text.finish_reason, delta.error
            sample.stop_reason = text.stop_reason(self.stop_token_ids)
        if self.finished:
            self.output.finish_time = now
        return len(delta.new_token_ids)

    def _logprobs(self, delta: m.RequestDelta) -> list[dict[int, Logprob]]:
        alternatives = delta.top_logprobs or [[] for _ in delta.new_token_ids]
        tables = []
        for token, logprob, top in zip(delta.new_token_ids, delta.logprobs, alternatives):
            ranks = {alt: rank for rank, (alt, _) in enumerate(top, start=1)}
            table = {token: Logprob(logprob, ranks.get(token), self.token_text(token))}  # the sampled token first
            for alt, alt_logprob in top:
                if alt not in table:
                    table[alt] = Logprob(alt_logprob, ranks[alt], self.token_text(alt))
            tables.append(table)
        return tables


def progress_bar(use_tqdm: Any, total: int, desc: str):
    """vLLM's ``use_tqdm``: True or False, or a callable that builds the bar (tqdm's keywords)."""
    from tqdm.auto import tqdm

    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, disable=not use_tqdm)
