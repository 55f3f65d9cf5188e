"""Errors that reach an HTTP client, each carrying its status and OpenAI-style body."""

from __future__ import annotations

from pagedserve.client.errors import APIError, InvalidRequest  # noqa: F401  (client/: the offline LLM raises them too)


class Unauthorized(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFound(APIError):
    status_code = 404
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


def in_surface_terms(exc: APIError, names: dict[str, str]) -> APIError:
    """A refusal of a translated chat request in the field names its client sent (Responses'
    ``text.format`` for chat's ``response_format``, ...); other errors as they are."""
    if not isinstance(exc, InvalidRequest) or exc.param is None:
        return exc
    chat_field = exc.param.split(".")[0].split("[")[0]
    if chat_field not in names:
        return exc
    ours = names[chat_field]
    return InvalidRequest(exc.message.replace(chat_field, ours), param=exc.param.replace(chat_field, ours, 1),
                          code=exc.code)
