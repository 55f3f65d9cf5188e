"""OpenAI chat messages, as /v1/chat/completions and ``LLM.chat`` both take them."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class Lenient(BaseModel):
    """Undeclared fields are kept (for the frontend to judge); a string where a number belongs is
    an error, not a silent coercion."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCall(Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Lenient):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # role "tool": the call this answers
    # an assistant's earlier thinking (vLLM's field), for templates that show it (Qwen3's)
    reasoning_content: Optional[str] = None

    def text(self) -> str:
        """The content as one string; only text parts are understood."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
