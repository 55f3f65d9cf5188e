"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), and the registry lookup."""

from __future__ import annotations

from typing import Optional

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall, ToolParser
from pagedserve.frontend_proc.tool_parsers.hermes import parse_hermes
from pagedserve.frontend_proc.tool_parsers.llama3_json import parse_llama3_json
from pagedserve.frontend_proc.tool_parsers.pythonic import parse_pythonic
from pagedserve.frontend_proc.tool_parsers.qwen3_coder import (
    ParameterSchemas, parse_qwen3_coder, qwen3_coder_parser)

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,  # Qwen2 / Qwen2.5 / Qwen3, Hermes
    "llama3_json": parse_llama3_json,  # Llama 3.1 / 3.2 / 3.3
    "pythonic": parse_pythonic,  # Llama 3.2 / 4, ToolACE
    "qwen3_coder": parse_qwen3_coder,  # Qwen3-Coder, Qwen3.5 (untyped here; typed per request below)
}


class UnknownToolParser(ValueError):
    pass


def get_tool_parser(name: str, schemas: Optional[ParameterSchemas] = None) -> ToolParser:
    """The parser; ``schemas`` (the request's tools' parameter properties) types the values of
    parsers whose format writes them untyped."""
    if name == "qwen3_coder" and schemas:
        return qwen3_coder_parser(schemas)
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownToolParser(f"--tool-call-parser {name!r} is not known; choose one of "
                                f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ParsedOutput", "PartialCall", "ToolParser", "UnknownToolParser",
           "get_tool_parser"]
