"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), and the registry lookup."""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall, ToolParser
from pagedserve.frontend_proc.tool_parsers.hermes import parse_hermes
from pagedserve.frontend_proc.tool_parsers.llama3_json import parse_llama3_json

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,  # Qwen2 / Qwen2.5 / Qwen3, Hermes
    "llama3_json": parse_llama3_json,  # Llama 3.1 / 3.2 / 3.3
}


class UnknownToolParser(ValueError):
    pass


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownToolParser(f"--tool-call-parser {name!r} is not known; choose one of "
                                f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ParsedOutput", "PartialCall", "ToolParser", "UnknownToolParser",
           "get_tool_parser"]
