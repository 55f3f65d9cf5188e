"""The routes around generation that vLLM users and tools call: models, tokenize, version, ping.

Request and response shapes follow vLLM's serving API, so scripts written against it
work unchanged. Every body is validated strictly: an unknown field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.client.chat_template_options import ChatTemplateOptions
from pagedserve.frontend_proc.errors import InvalidRequest, NotFound
from pagedserve.frontend_proc.openai_schema import ChatMessage, EncodableStrings, ToolDefinition
from pagedserve.frontend_proc.serving import Serving
from pagedserve.protocol.version import package_version


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(_Strict, EncodableStrings):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    # prompt: the tokenizer's BOS/EOS (vLLM's default True); messages: the template places them,
    # so only false (vLLM's default there) is taken
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ToolDefinition]] = None

    def template_options(self) -> ChatTemplateOptions:
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        return ChatTemplateOptions.from_request(self.add_generation_prompt, self.continue_final_message,
                                                self.chat_template_kwargs, tools)

    def check_one_input(self) -> None:
        """One input, and no field the other form would read: each would be accepted and ignored."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        if self.prompt is not None:
            for name in sorted(self.model_fields_set & _CHAT_ONLY):
                raise InvalidRequest(f"{name} is read only with messages, not with prompt", param=name)
        elif self.add_special_tokens:
            raise InvalidRequest("add_special_tokens: with messages the chat template places the special tokens; "
                                 "leave it out or set it false", param="add_special_tokens")


_CHAT_ONLY = frozenset({"add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"})


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def _model_card(serving: Serving, name: str, created: int) -> dict:
    """vLLM's card: an adapter's ``root`` is its directory and its ``parent`` the base model's served name."""
    adapter = serving.adapters.get(name) if serving.adapters is not None else None
    root, parent = (adapter.path, serving.served_model_name) if adapter is not None else (name, None)
    return {"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
            "root": root, "parent": parent, "max_model_len": serving.max_model_len}


def add_utility_routes(app: FastAPI, serving: Serving, authorized: list, created: int) -> None:
    check_model = serving.lora_name_of  # tokenizing is the same for the model and its adapters

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(serving, n, created) for n in serving.model_names()]}

    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def model(model_id: str) -> dict:
        try:
            serving.lora_name_of(model_id)
        except InvalidRequest:
            raise NotFound(f"the model {model_id!r} does not exist; served: {serving.model_names()}",
                           param="model", code="model_not_found") from None
        return _model_card(serving, model_id, created)

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        body.check_one_input()
        tokenizer = serving.tokenizer
        if body.messages is not None:
            tokens = tokenizer.encode_chat(body.messages, body.template_options())
        else:
            tokens = tokenizer.encode_text(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        tokenizer = serving.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"tokens must be in [0, {tokenizer.vocab_size}); got {bad[:5]}",
                                 param="tokens")
        return {"prompt": tokenizer.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def server_version() -> dict:
        return {"version": package_version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> dict:
        return {}
