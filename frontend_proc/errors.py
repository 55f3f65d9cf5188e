"""Errors that reach an HTTP client, each carrying its status and OpenAI-style body."""

from __future__ import annotations

from pagedserve.client.errors import APIError, InvalidRequest  # noqa: F401  (client/: the offline LLM raises them too)


class Unauthorized(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class ServiceUnavailable(APIError):
    """No live replica, or the replica serving the request failed (retrying may help)."""

    status_code = 503
    error_type = "service_unavailable"


class ShuttingDown(ServiceUnavailable):
    """The drain deadline passed while the request was still running."""

    finish_reason = "abort"

    def __init__(self, message: str):
        super().__init__(message, code="server_shutting_down")
