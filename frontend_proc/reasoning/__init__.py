"""Reasoning parsers by ``--reasoning-parser`` name (vLLM's names)."""

from __future__ import annotations

from pagedserve.frontend_proc.reasoning.think_tags import ReasoningSplit, ThinkTagParser

ReasoningParser = ThinkTagParser

REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ThinkTagParser("qwen3", reads_enable_thinking=True, tool_call_ends_reasoning=True),
    "deepseek_r1": ThinkTagParser("deepseek_r1"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ThinkTagParser",
           "get_reasoning_parser"]
