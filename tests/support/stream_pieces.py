"""Text cut as a stream cuts it (token by token, at byte boundaries, at random), and a chat
choice renderer's chunks added up as the openai client adds them (no tests here)."""

from __future__ import annotations

import codecs
import random
from typing import Any, Optional

from pagedserve.tools.demo_model import build_tokenizer


def token_pieces(text: str) -> list[str]:
    """The text as the demo tokenizer's incremental decode would stream it."""
    tokenizer = build_tokenizer(512)
    ids = tokenizer.encode(text)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:i])
        if not decoded.endswith("\ufffd"):
            pieces.append(decoded[len(done):])
            done = decoded
    assert "".join(pieces) == text
    return pieces


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def byte_cut_pieces(text: str, cut: int) -> list[str]:
    """The text's UTF-8 bytes cut once at ``cut``, each side decoded as a stream decodes it (a
    character split by the cut arrives whole with the second piece)."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = [decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)]
    return [p for p in pieces if p] or [""]


def streamed(renderer: Any, pieces: list[str], finish: str = "stop") -> dict[str, Any]:
    """Feed the pieces as a stream does; the content, reasoning, calls and finish_reason the
    deltas add up to."""
    content, reasoning, calls, finish_reason = "", "", [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk: Optional[dict] = renderer.chunk_choice(0, piece, None, finish if last else None)
        if chunk is None:
            continue
        content += chunk["delta"].get("content") or ""
        reasoning += chunk["delta"].get("reasoning_content") or ""
        for delta in chunk["delta"].get("tool_calls", []):
            if delta["index"] == len(calls):
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                calls.append({"name": delta["function"]["name"], "arguments": ""})
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
        finish_reason = chunk["finish_reason"]
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish_reason": finish_reason}
