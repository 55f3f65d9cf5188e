"""Load shedding at the door (``--max-waiting-requests``): when every live replica is full, a
generation request (completions, chat, ``/v1/responses``, ``/v1/messages``) gets its 429 from this
ASGI layer, before FastAPI routes it, validates the body, tokenizes the prompt or allocates
anything per request.

The refusals share one event loop with the admitted streams, so each one must cost little of it:
a flood of them through the whole request path (pydantic, the tokenizer, the router) was what
made the 429s slow and the admitted streams' TPOT grow (bench/log/2026-11-26.md, "Scheduling policies").

What a 429 looked like before stays: the same body (engine_client.overloaded) in each surface's
error shape (OpenAI's; Anthropic's on ``/v1/messages``, by the function the app's handler uses),
``Retry-After``, and the count per tenant and per priority. The only fields read are the two those
counts need (``priority``, ``user``; ``/v1/messages`` names its user ``metadata.user_id``), with
msgspec, ignoring the rest; ``/v1/responses`` and ``/v1/messages`` become chat requests without a
priority, so theirs count as the app counts them: priority 0. A request this layer cannot judge
cheaply (no valid API key, a body that is not a JSON object, a priority of the wrong type or out
of range) goes on to the app, which answers it as before: so a 401 stays a 401, and malformed
input gets the 400 that names its field. A request that does go on is still refused in
``EngineClient.submit`` if the replicas are still full by then.
"""

from __future__ import annotations

from typing import Annotated, Callable, ClassVar, Optional

import msgspec

from pagedserve.frontend_proc.anthropic_messages import anthropic_error_body
from pagedserve.frontend_proc.auth import key_matches
from pagedserve.frontend_proc.class_metrics import ShedCounts
from pagedserve.frontend_proc.engine_client import overloaded
from pagedserve.frontend_proc.errors import APIError
from pagedserve.client.router import Router
from pagedserve.frontend_proc.tenant import tenant_of
from pagedserve.protocol.priority import PRIORITY_MAX, PRIORITY_MIN


class _ClassFields(msgspec.Struct):
    """What the per-class 429 counts need from a body; every other field is skipped unread."""

    priority: int = 0
    user: Optional[str] = None


class _TranslatedFields(msgspec.Struct):
    """A body translated into a chat request without its priority or user (responses_schema.py):
    it only has to be a JSON object."""

    priority: ClassVar[int] = 0
    user: ClassVar[Optional[str]] = None


class _AnthropicMetadata(msgspec.Struct):
    # the app's limit (anthropic_schema.Metadata): a longer id goes on to get its 400
    user_id: Optional[Annotated[str, msgspec.Meta(max_length=256)]] = None


class _AnthropicFields(msgspec.Struct):
    """/v1/messages: no priority; ``metadata.user_id`` is its user (anthropic_schema.py)."""

    priority: ClassVar[int] = 0
    metadata: Optional[_AnthropicMetadata] = None

    @property
    def user(self) -> Optional[str]:
        return None if self.metadata is None else self.metadata.user_id


_OWN, _TRANSLATED = msgspec.json.Decoder(_ClassFields), msgspec.json.Decoder(_TranslatedFields)
_ANTHROPIC = msgspec.json.Decoder(_AnthropicFields)
# path -> the fields that name its class, and its error body (what app.py's handler renders)
SURFACES: dict[str, tuple[msgspec.json.Decoder, Callable[[APIError], dict]]] = {
    "/v1/completions": (_OWN, APIError.body),
    "/v1/chat/completions": (_OWN, APIError.body),
    "/v1/responses": (_TRANSLATED, APIError.body),
    "/v1/messages": (_ANTHROPIC, anthropic_error_body),
}
_JSON = msgspec.json.Encoder()


class _Headers:
    """The lookups tenant_of makes, on the raw ASGI header list (lower-case names, latin-1),
    without building a Starlette Headers per request."""

    __slots__ = ("raw",)

    def __init__(self, raw) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k == key:
                return v.decode("latin-1")
        return default


class EarlyShed:
    """ASGI middleware in front of the FastAPI app."""

    def __init__(self, app, router: Router, limit: Optional[int], shed: ShedCounts, api_key: Optional[str] = None,
                 tenant_header: Optional[str] = None):
        """``limit``: --max-waiting-requests (None: nothing is shed, every request goes on)."""
        self.app = app
        self.router = router
        self.limit = limit
        self.shed = shed
        self.tenant_header = tenant_header
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        limit = self.limit
        surface = SURFACES.get(scope["path"]) if scope["type"] == "http" else None
        if (limit is None or surface is None
                or scope["method"] != "POST" or not self.router.every_live_full(limit)
                or not self._authorized(scope["headers"])):
            await self.app(scope, receive, send)
            return
        messages, body = await _read_body(receive)
        if messages is None:  # the client went away before its body arrived
            return
        fields_of, error_body = surface
        try:
            fields = fields_of.decode(body)
        except msgspec.DecodeError:
            fields = None
        if fields is None or not PRIORITY_MIN <= fields.priority <= PRIORITY_MAX:
            await self.app(scope, _replay(messages, receive), send)
            return
        self.shed.count(tenant_of(_Headers(scope["headers"]), fields.user, self.tenant_header), fields.priority)
        exc = overloaded(self.router, limit)
        payload = _JSON.encode(error_body(exc))
        await send({"type": "http.response.start", "status": exc.status_code, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in exc.headers().items())]})
        await send({"type": "http.response.body", "body": payload})

    def _authorized(self, raw_headers) -> bool:
        """auth.py's check on the raw headers; without a key, all pass."""
        if self._bearer is None:
            return True
        given = other = b""
        for k, v in raw_headers:  # the first of each, as Starlette's Headers.get
            if k == b"authorization" and not given:
                given = v
            elif k == b"x-api-key" and not other:
                other = v
        return key_matches(given, other, self._bearer, self._key)


async def _read_body(receive) -> tuple[Optional[list], bytes]:
    messages = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, b""
        messages.append(message)
        if not message.get("more_body", False):
            break
    body = messages[0].get("body", b"") if len(messages) == 1 else b"".join(m.get("body", b"") for m in messages)
    return messages, body


def _replay(messages: list, receive):
    """``receive`` for the app: the body messages already read, then the client's own."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
