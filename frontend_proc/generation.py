"""One submitted request's output as OpenAI payloads: the full body, or its chunks as they come.

The chat and completions routes render these as JSON or SSE; the Responses and Anthropic
surfaces (responses_api.py, anthropic_messages.py) translate the same chat payloads into
their own shapes, so tool calls, reasoning, stop strings and logprobs are worked out once.
A stream's first update is awaited before anything is sent, so a request the scheduler
rejects at once still gets a proper 4xx; a client that goes away gets its request aborted.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import Request

from pagedserve.frontend_proc.completion_batch import CompletionBatch
from pagedserve.frontend_proc.errors import APIError
from pagedserve.frontend_proc.prompt_logprobs_format import echo_entries, prompt_logprob_dicts
from pagedserve.frontend_proc.request_stream import ChoiceUpdate
from pagedserve.frontend_proc.response_format import ChatFormat, CompletionFormat, LogprobEntries, usage

T = TypeVar("T")
# What renders a request's choices: its format, or a wrapper of it (tool calls, reasoning).
ChoiceRenderer = Any



LOWEST_LOGPROB = -9999.0  # vLLM's stand-in for -inf


def _finite(logprob: float) -> float:
    """A token a grammar masks has logprob -inf (of the masked distribution, as vLLM's), which
    JSON cannot carry (json.dumps refused it: a 500) and msgspec writes as null (not a number,
    against OpenAI's schema): vLLM's -9999.0 instead."""
    return max(logprob, LOWEST_LOGPROB)

class ClientDisconnected(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; raise ClientDisconnected (cancelling it) if the client goes away."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if not work_task.done():
        work_task.cancel()
        raise ClientDisconnected()
    return work_task.result()


class Generation:
    def __init__(self, stream: CompletionBatch, fmt: CompletionFormat, render: ChoiceRenderer,
                 request: Request, token_text: Callable[[int], str], include_usage: bool,
                 hidden: frozenset[int] = frozenset(), echo_hidden: frozenset[int] = frozenset()):
        """``hidden``: the tokens the choices' text leaves out (special ones, skip_special_tokens);
        ``echo_hidden``: those the echoed prompt's text leaves out (none when it was given as text)."""
        self.stream = stream
        self.fmt = fmt
        self.render = render
        self.request = request
        self.token_text = token_text
        self.hidden, self.echo_hidden = hidden, echo_hidden
        self.include_usage = include_usage
        self._updates = stream.updates()
        self._first: Optional[list[ChoiceUpdate]] = None
        # Each choice's rendered tokens, kept only where reasoning_tokens will count them.
        self._rendered: Optional[list[list[int]]] = (
            [[] for _ in stream.choices] if hasattr(render, "reasoning_tokens") else None)

    @property
    def num_prompt_tokens(self) -> int:
        return self.stream.num_prompt_tokens

    def abort(self) -> None:
        self.stream.abort()  # no-op when finished

    async def full(self) -> dict[str, Any]:
        """The whole response body; raises APIError or ClientDisconnected (the request aborted)."""
        try:
            return await unless_disconnected(self.request, self._collect())
        except (APIError, ClientDisconnected):
            self.abort()
            raise

    async def start_stream(self) -> None:
        """Wait for the first update (raises APIError or ClientDisconnected, the request aborted)."""
        try:
            self._first = await unless_disconnected(self.request, self._updates.__anext__())
        except StopAsyncIteration:
            self._first = []
        except (APIError, ClientDisconnected):
            self.abort()
            raise

    def _logprob_entries(self, update: ChoiceUpdate) -> Optional[LogprobEntries]:
        stream, text = self.stream, self.token_text
        echoed: LogprobEntries = []
        if stream.echo_logprobs is not None and update.prompt_logprobs is not None:
            prompt = stream.choices[update.index].prompt_token_ids
            echoed = echo_entries(prompt, update.prompt_logprobs, stream.echo_logprobs, text, self.echo_hidden)
        if update.logprobs is None:
            return echoed or None
        alternatives = update.top_logprobs or [[] for _ in update.token_ids]
        return echoed + [(text(t), _finite(lp), [(text(a), _finite(alp)) for a, alp in top], t not in self.hidden)
                         for t, lp, top in zip(update.token_ids, update.logprobs, alternatives)]

    async def _collect(self) -> dict[str, Any]:
        stream, fmt = self.stream, self.fmt
        texts: list[list[str]] = [[] for _ in stream.choices]
        logprobs: list[Optional[LogprobEntries]] = [None for _ in stream.choices]
        prompt_logprobs = [None for _ in stream.choices]
        async for batch in self._updates:
            self._keep_tokens(batch)
            for update in batch:
                texts[update.index].append(update.text)
                if update.prompt_logprobs is not None and stream.prompt_logprobs is not None:
                    prompt_logprobs[update.index] = prompt_logprob_dicts(
                        stream.choices[update.index].prompt_token_ids, update.prompt_logprobs,
                        stream.prompt_logprobs, self.token_text)
                entries = self._logprob_entries(update)
                if entries is not None:
                    logprobs[update.index] = (logprobs[update.index] or []) + entries
        choices = [self.render.full_choice(c.index, "".join(texts[c.index]), logprobs[c.index],
                                           c.finish_reason, c.stop_reason) for c in stream.choices]
        payload = fmt.envelope(fmt.object_full, choices)
        if stream.prompt_logprobs is not None:  # vLLM's places: on each completion choice, atop a chat
            if isinstance(fmt, ChatFormat):
                payload["prompt_logprobs"] = prompt_logprobs[0]
            else:
                for choice, scored in zip(choices, prompt_logprobs):
                    choice["prompt_logprobs"] = scored
        payload["usage"] = self._usage()
        return payload

    def _usage(self) -> dict[str, Any]:
        """Token counts, once every choice has been rendered; with a reasoning parser, the
        thinking's share of the completion tokens too (reasoning/token_count.py)."""
        stream = self.stream
        body: dict[str, Any] = usage(stream.num_prompt_tokens, stream.num_completion_tokens)
        if self._rendered is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.render.reasoning_tokens(c.index, self._rendered[c.index], c.state.decoder)
                for c in stream.choices)}
        return body

    def _keep_tokens(self, batch: list[ChoiceUpdate]) -> None:
        if self._rendered is not None:
            for update in batch:
                self._rendered[update.index] += update.token_ids

    async def chunks(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The chunks after start_stream(), those of one wake-up together (one write). An error
        mid-stream ends every open choice with a chunk carrying its finish_reason, then is
        raised; the request is aborted on any exit."""
        stream, fmt, render = self.stream, self.fmt, self.render
        try:
            opening = fmt.opening_chunk_choices(len(stream.choices))
            if opening:
                yield [fmt.envelope(fmt.object_chunk, opening)]
            batch: Optional[list[ChoiceUpdate]] = self._first
            while batch is not None:
                self._keep_tokens(batch)
                # One event per step's token (as vLLM), even while its text waits for the rest
                # of a character or a possible stop string. A renderer may hold a chunk back.
                chunks = (render.chunk_choice(u.index, u.text, self._logprob_entries(u), u.finish_reason,
                                              stream.choices[u.index].stop_reason)
                          for u in batch if u.text or u.finish_reason or u.logprobs or u.token_ids)
                payloads = [fmt.envelope(fmt.object_chunk, [c]) for c in chunks if c is not None]
                if payloads:
                    yield payloads
                batch = await anext(self._updates, None)
            if self.include_usage:
                final = fmt.envelope(fmt.object_chunk, [])
                final["usage"] = self._usage()
                yield [final]
        except APIError as exc:
            ended = [fmt.chunk_choice(c.index, "", None, exc.finish_reason)
                     for c in stream.choices if c.finish_reason is None]
            if ended:
                yield [fmt.envelope(fmt.object_chunk, ended)]
            raise
        finally:
            self.abort()
