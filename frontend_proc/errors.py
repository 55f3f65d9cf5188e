"""Errors that reach an HTTP client, each carrying its status and OpenAI-style body."""

from __future__ import annotations

import re
from typing import Optional, Sequence

from pagedserve.client.errors import APIError, InvalidRequest  # noqa: F401  (client/: the offline LLM raises them too)


class Unauthorized(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class Conflict(APIError):
    """The request is well formed but the server's state forbids it now (an adapter in use)."""

    status_code = 409
    error_type = "invalid_request_error"


class TooManyRequests(APIError):
    """Load shedding (--max-waiting-requests): refused at once, before any byte is streamed;
    retrying after ``Retry-After`` seconds may find room."""

    status_code = 429
    error_type = "too_many_requests"
    retry_after_s = 1  # one second: about how long a busy replica takes to start a few more

    def __init__(self, message: str):
        super().__init__(message, code="overloaded")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailable(APIError):
    """No live replica, or the replica serving the request failed (retrying may help)."""

    status_code = 503
    error_type = "service_unavailable"


class QueueTimeout(ServiceUnavailable):
    """The request waited past its first-token limit (--max-queue-time-s, max_queue_time_s,
    deadline_s): a 503 with Retry-After before streaming (SGLang's status for it), an abort
    chunk and an error event after."""

    finish_reason = "abort"
    retry_after_s = 1

    def __init__(self, message: str):
        super().__init__(message, code="queue_timeout")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ShuttingDown(ServiceUnavailable):
    """The drain deadline passed while the request was still running."""

    finish_reason = "abort"

    def __init__(self, message: str):
        super().__init__(message, code="server_shutting_down")


_CHAT_MESSAGE = re.compile(r"messages\[(\d+)\]")


def in_surface_terms(exc: APIError, names: dict[str, str], origins: Sequence[str] = (),
                     parts: Optional[dict[str, tuple[str, str]]] = None) -> APIError:
    """A refusal of a translated chat request in the terms its client sent: field names (Responses'
    ``text.format`` for chat's ``response_format``, ...), and ``messages[k]`` as ``origins[k]``, the
    part of the request that chat message came from (the indices differ: a system prompt leads,
    a tool result is a message of its own, a reasoning item and the message after it are one).
    ``parts``: what follows ``messages[k]`` in the client's terms, as (param, text). Other errors
    as they are."""
    if not isinstance(exc, InvalidRequest) or exc.param is None:
        return exc
    found = _CHAT_MESSAGE.match(exc.param)
    if found and int(found[1]) < len(origins):
        rest = exc.param[found.end():]
        param_rest, text_rest = (parts or {}).get(rest, (rest, rest))
        origin = origins[int(found[1])]
        return InvalidRequest(exc.message.replace(exc.param, origin + text_rest, 1), param=origin + param_rest,
                              code=exc.code)
    chat_field = exc.param.split(".")[0].split("[")[0]
    if chat_field not in names:
        return exc
    ours = names[chat_field]
    return InvalidRequest(exc.message.replace(chat_field, ours), param=exc.param.replace(chat_field, ours, 1),
                          code=exc.code)
