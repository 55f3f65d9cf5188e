"""Bearer-token (or Anthropic's x-api-key) check (a FastAPI dependency) for the generation, model, tokenize and metrics
routes; /health, /version, /ping and the API docs stay open, as vLLM leaves them."""

from __future__ import annotations

import secrets
from typing import Awaitable, Callable

from fastapi import Request

from pagedserve.frontend_proc.errors import Unauthorized


def key_matches(authorization: bytes, x_api_key: bytes, bearer: bytes, key: bytes) -> bool:
    """Either header carries the key: ``Authorization: Bearer <key>``, or Anthropic's
    ``x-api-key`` (/v1/messages). compare_digest on both, always: the time taken must not reveal
    how much of the key matched, nor which header was sent."""
    return bool(secrets.compare_digest(authorization, bearer) | secrets.compare_digest(x_api_key, key))


def make_api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    """The dependency that admits only requests bearing the key (no key: no dependency, app.py)."""

    expected = f"Bearer {api_key}".encode()
    key = api_key.encode()

    # async: FastAPI runs a plain def dependency in its thread pool, a thread hop per request
    async def require_api_key(request: Request) -> None:
        if not key_matches(request.headers.get("authorization", "").encode(),
                           request.headers.get("x-api-key", "").encode(), expected, key):
            raise Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>' "
                               "(or 'x-api-key: <key>')", code="invalid_api_key")

    return require_api_key
