"""``POST /v1/embeddings`` (OpenAI's), served by a deployment started with ``--task embed``.

The body follows OpenAI's published ``CreateEmbeddingRequest``: ``input`` as a string, a list
of strings, token ids or a list of token-id lists; ``model``, ``encoding_format`` (float or
base64: the float32 little-endian bytes, as OpenAI's and vLLM's), ``dimensions`` (Matryoshka
models only, client/pooling.py) and ``user``. Anything else is refused by request_fields.py.
Each input is one engine request that computes its prompt and returns the pooled hidden
state (scheduler_proc/pooling.py); this module truncates and normalises it, as vLLM does.

A deployment serves one task, as vLLM's: ``/v1/embeddings`` on a generating deployment, and
completions or chat on an embedding one, answer 400 naming the flag.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Literal, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from pagedserve.client.chat_messages import Lenient
from pagedserve.client.pooling import Matryoshka, PoolerSettings, finish_embedding
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.engine_client import EngineClient, ReplicaFailed, RequestHandle
from pagedserve.frontend_proc.errors import APIError, InvalidRequest, ServiceUnavailable, ShuttingDown
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.openai_schema import EncodableStrings
from pagedserve.frontend_proc.request_fields import refuse_unsupported_fields
from pagedserve.frontend_proc.request_stream import _delta_error
from pagedserve.frontend_proc.generation import ClientDisconnected, unless_disconnected
from pagedserve.frontend_proc.serving import error_response
from pagedserve.protocol.messages import AddRequest, RequestDelta, SamplingParams
from pagedserve.protocol.validate import InvalidField, check_request

MAX_INPUTS = 2048  # OpenAI's maxItems for input


class EmbeddingRequest(Lenient, EncodableStrings):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Optional[Literal["float", "base64"]] = "float"  # null: omitted, as everywhere
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None  # describes the caller: accepted, nothing to do

    @field_validator("input")
    @classmethod
    def _inputs_are_not_empty(cls, value: Any):
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return value
        if not value:
            raise ValueError("input must not be an empty list")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
        if isinstance(value[0], (str, list)) and any(len(item) == 0 for item in value):
            raise ValueError("no input in the list may be empty")
        return value

    def inputs(self) -> list[Union[str, list[int]]]:
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


def task_refusal(task: str, wanted: str, endpoint: str) -> None:
    """A 400 when ``endpoint`` belongs to another task than this deployment's (vLLM's rule)."""
    if task == wanted:
        return
    if wanted == "embed":
        raise InvalidRequest(f"{endpoint} is not served: this deployment generates text; serve the model "
                             f"with --task embed (vLLM's --runner pooling) for embeddings")
    raise InvalidRequest(f"{endpoint} is not served: this deployment computes embeddings (--task embed); "
                         f"use /v1/embeddings")


class EmbeddingServing:
    def __init__(self, task: str, model_dir: Path, served_model_names: Sequence[str], accepted_model_names: Sequence[str],
                 max_model_len: int, engine: EngineClient, tokenizer: PromptTokenizer, pooler: PoolerSettings,
                 metrics: Optional[FrontendMetrics] = None):
        self.task = task
        self.served_model_name = served_model_names[0]
        self.accepted_model_names = list(accepted_model_names)
        self.max_model_len = max_model_len
        self.engine = engine
        self.tokenizer = tokenizer
        # a generating deployment never pools: its model's pooler files must not stop it starting
        self.pooler = pooler.under_model_defaults(model_dir) if task == "embed" else pooler
        self.metrics = metrics
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.hidden_size = int(config.get("hidden_size") or 0)
        self.matryoshka = Matryoshka.of(config)

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        task_refusal(self.task, "embed", "/v1/embeddings")
        refuse_unsupported_fields(body)
        if body.model is not None and body.model not in self.accepted_model_names:
            raise InvalidRequest(f"model {body.model!r} is not served here; use {self.served_model_name!r}",
                                 param="model", code="model_not_found")
        if body.dimensions is not None:
            refusal = self.matryoshka.refusal(body.dimensions, self.hidden_size)
            if refusal is not None:
                raise InvalidRequest(refusal, param="dimensions")
        request_id = f"embd-{uuid.uuid4().hex}"
        adds = [self._add_request(f"{request_id}-{i}", prompt) for i, prompt in enumerate(body.inputs())]
        handles: list[RequestHandle] = []
        arrival = time.monotonic()
        try:
            for add in adds:
                handles.append(self.engine.submit(add))
            deltas = await unless_disconnected(request, _embeddings_of([self._counted(h, arrival) for h in handles]))
        except ClientDisconnected:
            self._abort(handles)
            return Response(status_code=499)
        except APIError as exc:
            self._abort(handles)
            return error_response(exc)
        return JSONResponse(self._body(body, adds, deltas))

    def _add_request(self, request_id: str, prompt: Union[str, list[int]]) -> AddRequest:
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise InvalidRequest("an input has no tokens", param="input")
        if len(ids) > self.max_model_len:
            raise InvalidRequest(f"this model's maximum context length is {self.max_model_len} tokens, but an "
                                 f"input has {len(ids)} tokens; shorten it", param="input")
        add = AddRequest(request_id=request_id, prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1),
                         pooling=self.pooler.pooling_type)
        try:
            check_request(add, self.tokenizer.vocab_size)
        except InvalidField as exc:
            raise InvalidRequest(f"input: {exc.reason}", param="input") from None
        return add

    async def _counted(self, handle: RequestHandle, arrival: float) -> RequestDelta:
        """Each input is an engine request of its own, so each counts once, as a vLLM pooling request
        does: a success ("stop", vLLM's finish for a pooled request) and its arrival-to-embedding time."""
        delta = await _embedding_of(handle)
        if self.metrics is not None:
            self.metrics.count_finish("stop", time.monotonic() - arrival)
        return delta

    def _abort(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            self.engine.abort(handle)

    def _body(self, body: EmbeddingRequest, adds: list[AddRequest], deltas: list[RequestDelta]) -> dict:
        data = []
        for index, delta in enumerate(deltas):
            vector = finish_embedding(delta.embedding, body.dimensions, self.pooler.normalize)
            encoded = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                       if body.encoding_format == "base64" else vector.tolist())
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        num_tokens = sum(len(add.prompt_token_ids) for add in adds)
        return {"object": "list", "model": self.served_model_name, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def _embeddings_of(embeddings: list[Awaitable[RequestDelta]]) -> list[RequestDelta]:
    """Every input's embedding delta, in order; on the first failure the others stop waiting."""
    waits = [asyncio.ensure_future(e) for e in embeddings]
    try:
        return list(await asyncio.gather(*waits))
    finally:
        for wait in waits:
            wait.cancel()


async def _embedding_of(handle: RequestHandle) -> RequestDelta:
    """The request's one delta that carries its embedding; an APIError for anything else."""
    while True:
        for event in await handle.take():
            if isinstance(event, ReplicaFailed):
                raise (ShuttingDown if event.shutting_down else ServiceUnavailable)(event.message)
            if event.finish_reason == "error":
                raise _delta_error(event)
            if event.embedding is not None:
                return event
            if event.finish_reason is not None:
                raise ServiceUnavailable(f"the embedding request ended without an embedding ({event.finish_reason})")


def add_embedding_routes(app: FastAPI, embeddings: EmbeddingServing, authorized: list) -> None:
    @app.post("/v1/embeddings", dependencies=authorized)
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create(body, request)
