"""Serving one completion or chat request: checks, submit, then a JSON body or an SSE stream.

Streaming responses wait for the first delta before sending the 200 headers, so a
request the scheduler rejects at once still gets a proper 400 (or 503). A client that
disconnects, before or during the stream, gets its request aborted at the scheduler.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional, Sequence, TypeVar, Union

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.frontend_proc.chat_request import prepare_chat
from pagedserve.frontend_proc.completion_batch import CompletionBatch
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.errors import APIError, InvalidRequest, TooManyRequests
from pagedserve.frontend_proc.generation import ChoiceRenderer, Generation
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.openai_schema import (
    DEFAULT_MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, SamplingFields)
from pagedserve.frontend_proc.reasoning import ReasoningParser
from pagedserve.frontend_proc.request_fields import refuse_unsupported_fields
from pagedserve.frontend_proc.request_stream import RequestStream
from pagedserve.frontend_proc.response_format import CompletionFormat, ChatFormat
from pagedserve.frontend_proc.structured_request import check_grammars_off_loop, structured_outputs_of
from pagedserve.frontend_proc.tenant import tenant_of
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig, plan_tool_calls
from pagedserve.client.detokenizer import Decodes, TextDecoder
from pagedserve.client.generation_defaults import GenerationDefaults
from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.protocol.messages import AddRequest, SamplingParams, StructuredOutputs
from pagedserve.protocol.priority import priority_refusal
from pagedserve.protocol.validate import InvalidField, check_request

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Protocol field -> the request field a client sent it as.
_CLIENT_FIELD = {"prompt_token_ids": "prompt", "request_id": None, "eos_token_ids": None}


def _first(*values: Optional[T]) -> T:
    """The request's value, else the --generation-config default, else the built-in one."""
    return next(v for v in values if v is not None)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


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
                 scheduling_policy: str = "fcfs", tenant_header: Optional[str] = None,
                 reasoning_parser: Optional[ReasoningParser] = None, adapters: Optional[AdapterRegistry] = None):
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
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: None leaves chat output whole
        self.adapters = adapters  # --enable-lora: the engine client's registry, read here (None: LoRA off)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        await check_grammars_off_loop(body)
        refuse_unsupported_fields(body)
        lora_name = self.lora_name_of(body.model)
        prompts = body.prompts()
        prompt_ids = [self.tokenizer.encode_prompt(p) for p in prompts]
        max_tokens = [self._max_tokens(len(ids), body.max_tokens, default=DEFAULT_COMPLETION_MAX_TOKENS)
                      for ids in prompt_ids]
        echo_texts = ([p if isinstance(p, str) else self._decoder(body).decode(p) for p in prompts]
                      if body.echo else None)
        generation = self._start(body, prompt_ids, max_tokens, body.wants_logprobs(),
                                 CompletionFormat(lora_name or self.served_model_name), request, echo_texts,
                                 include_usage=body.include_usage_in_stream(), lora_name=lora_name)
        if not isinstance(prompts[0], str):  # token ids are echoed decoded, as the choices' text (a text as given)
            generation.echo_hidden = generation.hidden
        return await self._respond(generation, body.stream)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        await self.check_chat_grammars(body)
        return await self._respond(self.start_chat(body, request), body.stream)

    async def check_chat_grammars(self, body: ChatCompletionRequest) -> None:
        """What start_chat will check of the request's grammars (a forced tool call's too), done
        in a thread first (structured_request.check_grammars_off_loop)."""
        forced = None
        if body.tools and body.tool_choice not in (None, "none", "auto"):  # only a forced call has a grammar
            try:
                forced = plan_tool_calls(body, self.tool_calling).structured_outputs
            except InvalidRequest:
                pass  # start_chat says why
        await check_grammars_off_loop(body, [forced])

    def start_chat(self, body: ChatCompletionRequest, request: Request,
                   include_usage: Optional[bool] = None) -> Generation:
        """A chat request checked and submitted; the other chat surfaces (Responses, Anthropic)
        come through here with the request they translated."""
        refuse_unsupported_fields(body)
        lora_name = self.lora_name_of(body.model)
        fmt = ChatFormat(lora_name or self.served_model_name)
        chat = prepare_chat(body, self.tokenizer, self.tool_calling, fmt, self.reasoning_parser)
        max_tokens = self._max_tokens(len(chat.prompt_ids), body.requested_max_tokens(), default=None)
        return self._start(body, [chat.prompt_ids], [max_tokens], body.wants_logprobs(), fmt, request,
                           structured_outputs=chat.structured_outputs, choices=chat.choices,
                           include_usage=body.include_usage_in_stream() if include_usage is None else include_usage,
                           lora_name=lora_name)

    def count_chat_prompt(self, body: ChatCompletionRequest) -> int:
        """The prompt tokens a chat request would send (Anthropic's count_tokens)."""
        refuse_unsupported_fields(body)
        self.lora_name_of(body.model)
        fmt = ChatFormat(self.served_model_name)
        return len(prepare_chat(body, self.tokenizer, self.tool_calling, fmt, self.reasoning_parser).prompt_ids)

    def lora_name_of(self, model: Optional[str]) -> str:
        """The adapter a request's ``model`` field names ("": the base model, by one of its names or
        none); an InvalidRequest for a name served neither as the model nor as an adapter."""
        if model is None or model in self.accepted_model_names:
            return ""
        adapters = self.adapters
        if adapters is not None and model in adapters:
            return model
        raise InvalidRequest(f"model {model!r} is not served here; use one of {self.model_names()}",
                             param="model", code="model_not_found")

    def model_names(self) -> list[str]:
        """What /v1/models lists: the served names, then each LoRA adapter's."""
        return self.served_model_names + [a.name for a in self.adapters or ()]

    def response_model_name(self, model: Optional[str]) -> str:
        """The ``model`` a response names: the adapter that computed it, else the first served name."""
        return self.lora_name_of(model) or self.served_model_name

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
                    structured_outputs: Optional[StructuredOutputs], tenant: str,
                    lora_name: str = "") -> list[RequestStream]:
        """One engine request per prompt, every one checked before any is sent."""
        adds = []
        for i, (ids, limit) in enumerate(zip(prompt_ids, max_tokens)):
            request_id = fmt.id if len(prompt_ids) == 1 else f"{fmt.id}-{i}"
            add = AddRequest(request_id=request_id, prompt_token_ids=ids,
                             sampling=self._sampling(body, limit, logprobs, structured_outputs),
                             eos_token_ids=self.tokenizer.eos_token_ids, priority=body.priority,
                             max_queue_time_s=body.max_queue_time_s, deadline_s=body.deadline_s, tenant=tenant,
                             lora_name=lora_name)
            self._check(add, body)
            adds.append(add)
        streams: list[RequestStream] = []
        decoder = self._decoder(body)
        try:
            for add in adds:
                handle = self.engine.submit(add)
                streams.append(RequestStream(self.engine, handle, decoder, body.stop_strings(),
                                             len(add.prompt_token_ids), self.metrics, add.sampling.min_tokens))
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

    def _start(self, body: SamplingFields, prompt_ids: list[list[int]], max_tokens: list[int],
               logprobs: bool, fmt: CompletionFormat, request: Request,
               echo_texts: Optional[list[str]] = None,
               structured_outputs: Optional[StructuredOutputs] = None,
               choices: Optional[ChoiceRenderer] = None, include_usage: bool = False,
               lora_name: str = "") -> Generation:
        streams = self._submit_all(body, prompt_ids, max_tokens, logprobs, fmt, structured_outputs,
                                   tenant_of(request.headers, body.user, self.tenant_header), lora_name)
        stream = CompletionBatch(streams, echo_texts, stop_token_ids=frozenset(body.stop_token_ids or ()),
                                 prompt_ids=prompt_ids, prompt_logprobs=body.prompt_logprobs,
                                 echo_logprobs=body.echo_logprobs())
        return Generation(stream, fmt, choices or fmt, request, self.tokenizer.token_text, include_usage,
                          hidden=self.tokenizer.special_ids if body.skip_special_tokens else frozenset())

    async def _respond(self, generation: Generation, stream: bool) -> Response:
        """The generation as a JSON body or an SSE stream (APIError / ClientDisconnected raised
        before anything is sent: app.py renders them)."""
        if not stream:
            return JSONResponse(await generation.full())
        await generation.start_stream()
        return StreamingResponse(_sse_events(generation.chunks()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


async def _sse_events(chunks: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
    try:
        async for payloads in chunks:
            yield b"".join(_sse(p) for p in payloads)
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await chunks.aclose()
    yield _sse("[DONE]")
