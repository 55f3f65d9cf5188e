"""Errors a client of the engine reports about a request, each carrying its HTTP status and
OpenAI-style body: the frontend answers with them, the offline `LLM` turns them into InvalidField."""

from __future__ import annotations

from typing import Any, Optional


class APIError(Exception):
    """An error with the HTTP status and the OpenAI error object to answer with."""

    status_code = 500
    error_type = "internal_error"
    finish_reason = "error"  # what a stream's unfinished choices end with when this cuts it short

    def __init__(self, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"
