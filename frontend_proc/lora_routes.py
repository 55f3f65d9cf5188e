"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's runtime adapter routes.

They exist only with --enable-lora and ``PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) set to 1 or true, as vLLM registers them: otherwise a 404,
so a deployment whose operator did not ask for it cannot have its adapters changed over HTTP.
Bodies and success texts are vLLM's. Every refusal is a 4xx naming the reason: a bad adapter (400,
the reader's words), a name already loaded (400, vLLM's text), an unknown name (404), an adapter
that requests in flight use (409: the request is right but must wait for them; unloading it
under them would end them with an error).
"""

from __future__ import annotations

import asyncio
import os
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedserve.client.lora_adapters import AdapterNameError, UnknownAdapter
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.errors import InvalidRequest, NotFound
from pagedserve.protocol.lora_adapter import LoRAAdapterError

RUNTIME_UPDATING_FLAGS = ("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(environ=os.environ) -> bool:
    """vLLM's reading of its flag: "1" or "true", any case, surrounding spaces ignored."""
    return any(environ.get(flag, "0").strip().lower() in ("1", "true") for flag in RUNTIME_UPDATING_FLAGS)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: new weights under a name already loaded


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's; when given it must be the adapter's


def add_lora_routes(app: FastAPI, engine: EngineClient, authorized: list) -> None:
    adapters = engine.adapters
    assert adapters is not None

    @app.post("/v1/load_lora_adapter", dependencies=authorized)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        try:
            adapters.check_free(body.lora_name, body.load_inplace)
            # the weights' digest reads every byte: off the event loop, which streams every other request
            spec = await asyncio.to_thread(adapters.read, body.lora_name, body.lora_path)
            engine.load_adapter(body.lora_name, spec, replace=body.load_inplace)
        except (AdapterNameError, LoRAAdapterError) as exc:
            raise InvalidRequest(str(exc), param="lora_path" if isinstance(exc, LoRAAdapterError)
                                 else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=authorized)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name:
            raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        adapter = adapters.get(body.lora_name)
        if adapter is not None and body.lora_int_id is not None and body.lora_int_id != adapter.lora_id:
            raise InvalidRequest(f"lora_int_id {body.lora_int_id} is not the lora adapter '{body.lora_name}' "
                                 f"(its id is {adapter.lora_id})", param="lora_int_id")
        try:
            engine.unload_adapter(body.lora_name)
        except UnknownAdapter as exc:
            raise NotFound(str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
