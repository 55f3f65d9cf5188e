"""Serving one completion or chat request: checks, submit, then a JSON body or an SSE stream.

Streaming responses wait for the first delta before sending the 200 headers, so a
request the scheduler rejects at once still gets a proper 400 (or 503). A client that
disconnects, before or during the stream, gets its request aborted at the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Optional, Sequence, TypeVar, Union

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.frontend_proc.chat_request import prepare_chat
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.errors import APIError, InvalidRequest, TooManyRequests
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.prompt_logprobs_format import echo_entries, prompt_logprob_dicts
from pagedserve.frontend_proc.openai_schema import (
    DEFAULT_MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, SamplingFields)
from pagedserve.frontend_proc.completion_batch import CompletionBatch
from pagedserve.frontend_proc.request_fields import refuse_unsupported_fields
from pagedserve.frontend_proc.request_stream import ChoiceUpdate, RequestStream
from pagedserve.frontend_proc.response_format import (
    ChatFormat, CompletionFormat, LogprobEntries, usage)
from pagedserve.frontend_proc.structured_request import structured_outputs_of
from pagedserve.frontend_proc.tenant import tenant_of
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.tool_call_output import ToolCallChoices
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig
from pagedserve.protocol.messages import AddRequest, SamplingParams, StructuredOutputs
from pagedserve.client.detokenizer import Decodes, TextDecoder
from pagedserve.client.generation_defaults import GenerationDefaults
from pagedserve.protocol.priority import priority_refusal
from pagedserve.protocol.validate import InvalidField, check_request

log = logging.getLogger(__name__)
T = TypeVar("T")
# What renders a request's choices: its format, or a wrapper of it (tool_call_output.py).
ChoiceRenderer = Union[CompletionFormat, ToolCallChoices]
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Protocol field -> the request field a client sent it as.
_CLIENT_FIELD = {"prompt_token_ids": "prompt", "request_id": None, "eos_token_ids": None}


def _first(*values: Optional[T]) -> T:
    """The request's value, else the --generation-config default, else the built-in one."""
    return next(v for v in values if v is not None)


class ClientDisconnected(Exception):
    pass


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


_JSON = msgspec.json.Encoder()  # UTF-8 as is, like json.dumps(ensure_ascii=False), several times faster


def _sse(payload: Union[dict[str, Any], str]) -> bytes:
    """One event; at one per token per stream, its encoding is on the frontend's hot path."""
    data = payload.encode() if isinstance(payload, str) else _JSON.encode(payload)
    return b"data: " + data + b"\n\n"


class Serving:
    def __init__(self, served_model_names: Sequence[str], max_model_len: int, engine: EngineClient,
                 tokenizer: PromptTokenizer, metrics: FrontendMetrics,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 tool_calling: ToolCallingConfig = ToolCallingConfig(),
                 defaults: GenerationDefaults = GenerationDefaults(), model_aliases: Sequence[str] = (),
                 scheduling_policy: str = "fcfs", tenant_header: Optional[str] = None):
        self.served_model_names = list(served_model_names)  # what /v1/models lists
        self.served_model_name = self.served_model_names[0]  # what responses name
        # what a request may name the model: the served names, or the path as given (vLLM's name)
        self.accepted_model_names = self.served_model_names + [a for a in model_aliases
                                                               if a not in self.served_model_names]
        self.max_model_len = max_model_len
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_logprobs = max_logprobs
        self.tool_calling = tool_calling
        self.defaults = defaults  # --generation-config: for fields a request leaves out
        self.scheduling_policy = scheduling_policy
        self.tenant_header = tenant_header  # --tenant-header (tenant.py)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        refuse_unsupported_fields(body)
        self._check_model(body)
        prompts = body.prompts()
        prompt_ids = [self.tokenizer.encode_prompt(p) for p in prompts]
        max_tokens = [self._max_tokens(len(ids), body.max_tokens, default=DEFAULT_COMPLETION_MAX_TOKENS)
                      for ids in prompt_ids]
        echo_texts = ([p if isinstance(p, str) else self._decoder(body).decode(p) for p in prompts]
                      if body.echo else None)
        return await self._generate(body, prompt_ids, max_tokens, body.wants_logprobs(),
                                    CompletionFormat(self.served_model_name), request, echo_texts)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        refuse_unsupported_fields(body)
        self._check_model(body)
        fmt = ChatFormat(self.served_model_name)
        chat = prepare_chat(body, self.tokenizer, self.tool_calling, fmt)
        max_tokens = self._max_tokens(len(chat.prompt_ids), body.requested_max_tokens(), default=None)
        return await self._generate(body, [chat.prompt_ids], [max_tokens], body.wants_logprobs(), fmt,
                                    request, structured_outputs=chat.structured_outputs, choices=chat.choices)

    def _check_model(self, body: SamplingFields) -> None:
        if body.model is not None and body.model not in self.accepted_model_names:
            raise InvalidRequest(f"model {body.model!r} is not served here; "
                                 f"use one of {self.served_model_names}",
                                 param="model", code="model_not_found")

    def _max_tokens(self, num_prompt: int, requested: Optional[int],
                    default: Optional[int]) -> int:
        """vLLM's rule: an omitted max_tokens becomes min(default, room left)."""
        if num_prompt == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"the prompt has {num_prompt} tokens; shorten the prompt", param="prompt")
        if requested is None:
            return min(v for v in (room, default, self.defaults.max_tokens) if v is not None)
        if num_prompt + requested > self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt} prompt tokens + {requested} max_tokens = "
                f"{num_prompt + requested}; reduce max_tokens or the prompt",
                param="max_tokens")
        return requested

    def _check_sampling_fields(self, body: SamplingFields) -> None:
        """What the schema alone cannot say: limits of this deployment, fields that need others."""
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: set logprobs to true as well",
                                 param="top_logprobs")
        if body.num_top_logprobs() > self.max_logprobs:
            field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise InvalidRequest(f"{field}: at most {self.max_logprobs} logprobs per token are served here "
                                 f"(--max-logprobs), got {body.num_top_logprobs()}", param=field)
        if body.prompt_logprobs is not None:
            if body.prompt_logprobs > self.max_logprobs:
                raise InvalidRequest(f"prompt_logprobs: at most {self.max_logprobs} logprobs per token are served "
                                     f"here (--max-logprobs), got {body.prompt_logprobs}", param="prompt_logprobs")
            if body.stream:
                raise InvalidRequest("prompt_logprobs are not available with stream=true (as in vLLM); "
                                     "drop one of them", param="prompt_logprobs")
        refusal = priority_refusal(self.scheduling_policy, body.priority)
        if refusal is not None:
            raise InvalidRequest(refusal, param="priority")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest(f"best_of: only best_of equal to n ({body.n}) is supported, got "
                                 f"{body.best_of}; ask for n samples instead", param="best_of")

    def _sampling(self, body: SamplingFields, max_tokens: int, logprobs: bool,
                  structured_outputs: Optional[StructuredOutputs] = None) -> SamplingParams:
        """``structured_outputs``: a forced tool choice's grammar (chat_request.py), which
        already refused any other structured output the body asks for."""
        self._check_sampling_fields(body)
        d = self.defaults
        top_k = _first(body.top_k, d.top_k, 0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(body.temperature, d.temperature, 1.0),
            top_p=_first(body.top_p, d.top_p, 1.0),
            top_k=0 if top_k < 0 else top_k,
            seed=body.seed, n=body.n, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=_first(body.repetition_penalty, d.repetition_penalty, 1.0),
            min_p=_first(body.min_p, d.min_p, 0.0), logit_bias=body.token_logit_bias(),
            top_logprobs=body.num_top_logprobs() if logprobs else 0,
            prompt_logprobs=body.wire_prompt_logprobs(),
            structured_outputs=structured_outputs or structured_outputs_of(body))

    def _check(self, add: AddRequest, body: SamplingFields) -> None:
        """The protocol's own ranges, checked before anything is encoded: a value no process
        can hold (a 2**70 seed, a stop token outside the vocabulary) is a 400 naming it."""
        try:
            check_request(add, self.tokenizer.vocab_size)
        except InvalidField as exc:
            param = _CLIENT_FIELD.get(exc.field, exc.field)
            if param == "prompt" and isinstance(body, ChatCompletionRequest):
                param = "messages"
            raise InvalidRequest(str(exc) if param is None else f"{param}: {exc.reason}",
                                 param=param) from None

    def _submit_all(self, body: SamplingFields, prompt_ids: list[list[int]], max_tokens: list[int],
                    logprobs: bool, fmt: CompletionFormat,
                    structured_outputs: Optional[StructuredOutputs], tenant: str) -> list[RequestStream]:
        """One engine request per prompt, every one checked before any is sent."""
        adds = []
        for i, (ids, limit) in enumerate(zip(prompt_ids, max_tokens)):
            request_id = fmt.id if len(prompt_ids) == 1 else f"{fmt.id}-{i}"
            add = AddRequest(request_id=request_id, prompt_token_ids=ids,
                             sampling=self._sampling(body, limit, logprobs, structured_outputs),
                             eos_token_ids=self.tokenizer.eos_token_ids, priority=body.priority,
                             max_queue_time_s=body.max_queue_time_s, deadline_s=body.deadline_s, tenant=tenant)
            self._check(add, body)
            adds.append(add)
        streams: list[RequestStream] = []
        decoder = self._decoder(body)
        try:
            for add in adds:
                handle = self.engine.submit(add)
                streams.append(RequestStream(self.engine, handle, decoder, body.stop_strings(),
                                             len(add.prompt_token_ids), self.metrics))
        except APIError as exc:
            for stream in streams:
                stream.abort()
            if isinstance(exc, TooManyRequests):
                self.metrics.shed.count(tenant, body.priority)
            raise
        return streams

    def _decoder(self, body: SamplingFields) -> Decodes:
        """How the choices' text is decoded: with special tokens only when asked (vLLM)."""
        return self.tokenizer if body.skip_special_tokens else TextDecoder(self.tokenizer.tokenizer, False)

    async def _generate(self, body: SamplingFields, prompt_ids: list[list[int]], max_tokens: list[int],
                        logprobs: bool, fmt: CompletionFormat, request: Request,
                        echo_texts: Optional[list[str]] = None,
                        structured_outputs: Optional[StructuredOutputs] = None,
                        choices: Optional[ChoiceRenderer] = None) -> Response:
        choices = choices or fmt
        streams = self._submit_all(body, prompt_ids, max_tokens, logprobs, fmt, structured_outputs,
                                   tenant_of(request.headers, body.user, self.tenant_header))
        stream = CompletionBatch(streams, echo_texts, stop_token_ids=frozenset(body.stop_token_ids or ()),
                                 prompt_ids=prompt_ids, prompt_logprobs=body.prompt_logprobs,
                                 echo_logprobs=body.echo_logprobs())
        updates = stream.updates()
        try:
            if not body.stream:
                return await _unless_disconnected(request, self._collect(stream, updates, fmt, choices))
            first = await _unless_disconnected(request, updates.__anext__())
        except ClientDisconnected:
            stream.abort()
            return Response(status_code=499)
        except APIError as exc:
            stream.abort()
            return error_response(exc)
        except StopAsyncIteration:
            first = []
        return StreamingResponse(
            self._sse_events(stream, updates, first, fmt, choices, body.include_usage_in_stream()),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _logprob_entries(self, update: ChoiceUpdate, stream: CompletionBatch) -> Optional[LogprobEntries]:
        text = self.tokenizer.token_text
        echoed: LogprobEntries = []
        if stream.echo_logprobs is not None and update.prompt_logprobs is not None:
            prompt = stream.choices[update.index].prompt_token_ids
            echoed = echo_entries(prompt, update.prompt_logprobs, stream.echo_logprobs, text)
        if update.logprobs is None:
            return echoed or None
        alternatives = update.top_logprobs or [[] for _ in update.token_ids]
        return echoed + [(text(t), lp, [(text(a), alp) for a, alp in top])
                         for t, lp, top in zip(update.token_ids, update.logprobs, alternatives)]

    async def _collect(self, stream: CompletionBatch,
                       updates: AsyncIterator[list[ChoiceUpdate]],
                       fmt: CompletionFormat, render: ChoiceRenderer) -> JSONResponse:
        texts = [[] for _ in stream.choices]
        logprobs: list[Optional[LogprobEntries]] = [None for _ in stream.choices]
        prompt_logprobs = [None for _ in stream.choices]
        async for batch in updates:
            for update in batch:
                texts[update.index].append(update.text)
                if update.prompt_logprobs is not None and stream.prompt_logprobs is not None:
                    prompt_logprobs[update.index] = prompt_logprob_dicts(
                        stream.choices[update.index].prompt_token_ids, update.prompt_logprobs,
                        stream.prompt_logprobs, self.tokenizer.token_text)
                entries = self._logprob_entries(update, stream)
                if entries is not None:
                    logprobs[update.index] = (logprobs[update.index] or []) + entries
        choices = [render.full_choice(c.index, "".join(texts[c.index]), logprobs[c.index],
                                      c.finish_reason, c.stop_reason) for c in stream.choices]
        payload = fmt.envelope(fmt.object_full, choices)
        if stream.prompt_logprobs is not None:  # vLLM's places: on each completion choice, atop a chat
            if isinstance(fmt, ChatFormat):
                payload["prompt_logprobs"] = prompt_logprobs[0]
            else:
                for choice, scored in zip(choices, prompt_logprobs):
                    choice["prompt_logprobs"] = scored
        payload["usage"] = usage(stream.num_prompt_tokens, stream.num_completion_tokens)
        return JSONResponse(payload)

    async def _sse_events(self, stream: CompletionBatch,
                          updates: AsyncIterator[list[ChoiceUpdate]], first: list[ChoiceUpdate],
                          fmt: CompletionFormat, render: ChoiceRenderer,
                          include_usage: bool) -> AsyncIterator[bytes]:
        try:
            opening = fmt.opening_chunk_choices(len(stream.choices))
            if opening:
                yield _sse(fmt.envelope(fmt.object_chunk, opening))
            batch: Optional[list[ChoiceUpdate]] = first
            while batch is not None:
                # One event per step's token (as vLLM), even while its text waits for the rest
                # of a character or a possible stop string; the events that piled up while
                # this task waited go out in one write. A tool-call renderer may hold a chunk.
                chunks = (render.chunk_choice(u.index, u.text, self._logprob_entries(u, stream), u.finish_reason,
                                              stream.choices[u.index].stop_reason)
                          for u in batch if u.text or u.finish_reason or u.logprobs or u.token_ids)
                events = b"".join(_sse(fmt.envelope(fmt.object_chunk, [c])) for c in chunks if c is not None)
                if events:
                    yield events
                batch = await anext(updates, None)
            if include_usage:
                final = fmt.envelope(fmt.object_chunk, [])
                final["usage"] = usage(stream.num_prompt_tokens, stream.num_completion_tokens)
                yield _sse(final)
        except APIError as exc:
            # Cut short: every choice still open ends with a finish_reason, then the reason.
            ended = [fmt.chunk_choice(c.index, "", None, exc.finish_reason)
                     for c in stream.choices if c.finish_reason is None]
            if ended:
                yield _sse(fmt.envelope(fmt.object_chunk, ended))
            yield _sse(exc.body())
        finally:
            stream.abort()  # no-op when finished; frees the request after a disconnect
        yield _sse("[DONE]")
