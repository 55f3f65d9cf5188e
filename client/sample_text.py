"""One sample's token deltas -> the text its caller sees; the one rule for HTTP and offline.

A stop token (EOS, or one of ``stop_token_ids``) ends the sample but is not rendered; a stop
string ends the text just before it (OpenAI semantics) and ends the sample with "stop", even
while the scheduler, which knows no strings, still runs it. Text is emitted only once whole
characters have arrived (``make_detokenizer``), and never a stop string's prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterable, Optional, Union

from pagedserve.client.detokenizer import Decodes, make_detokenizer
from pagedserve.protocol.messages import RequestDelta
from pagedserve.client.stop_strings import StopCheck, StopStringMatcher


@dataclass(slots=True)
class TextUpdate:
    text: str  # new text, safe to show
    token_ids: list[int]  # the delta's rendered tokens (a stop token left out)
    logprobs: Optional[list[float]]  # theirs
    top_logprobs: Optional[list[list[tuple[int, float]]]]  # theirs: per token, its alternatives
    finish_reason: Optional[str]  # set once this sample has ended
    consumed: int  # the delta's tokens that count as output: not those after a stop string's end


class SampleText:
    def __init__(self, tokenizer: Decodes, stop_strings: list[str],
                 stream_backend: Optional[Any] = None, min_tokens: int = 0):
        # ``stream_backend``: a fast tokenizer's ``tokenizers.Tokenizer`` (``fast_backend``),
        # for the Rust streaming decoder; without one, the Python window method.
        self.detokenizer = make_detokenizer(tokenizer, stream_backend)
        self.stop_matcher = StopStringMatcher(stop_strings)
        # vLLM's min_tokens holds stop strings back too: text of the first min_tokens tokens is
        # never searched for them (vLLM V1's detokenizer moves its search offset past it)
        self.min_tokens = min_tokens
        self.num_tokens = 0  # output tokens so far (a stop token included, those after a stop string not)
        self.finish_reason: Optional[str] = None
        self.ended_by_token: Optional[int] = None  # the stop token (EOS or a stop id) that ended it

    def stop_reason(self, stop_token_ids: Collection[int]) -> Optional[Union[str, int]]:
        """vLLM's ``stop_reason``: the stop string or the requested stop token id that ended
        the sample; None when it ended otherwise (EOS, length, still running)."""
        if self.finish_reason != "stop":
            return None
        if self.stop_matcher.matched is not None:
            return self.stop_matcher.matched
        return self.ended_by_token if self.ended_by_token in stop_token_ids else None

    def apply(self, delta: RequestDelta) -> TextUpdate:
        rendered, logprobs, alternatives = delta.new_token_ids, delta.logprobs, delta.top_logprobs
        if (delta.stop_token_id is not None and rendered
                and rendered[-1] == delta.stop_token_id):
            rendered = rendered[:-1]  # EOS / stop_token_ids are not part of the text
            self.ended_by_token = delta.stop_token_id
            logprobs = logprobs[:len(rendered)] if logprobs is not None else None
            alternatives = alternatives[:len(rendered)] if alternatives is not None else None
        consumed = len(delta.new_token_ids)
        if self.stop_matcher.stop_strings and (len(delta.new_token_ids) > 1 or self.num_tokens < self.min_tokens):
            # A speculative step accepts several tokens at once: one token at a time, as a plain
            # decode would have fed them, so the sample ends at the token that completes a stop
            # string, and the accepted tokens after it are neither counted nor returned.
            text = ""
            for i, token in enumerate(rendered):
                if self.num_tokens + i + 1 <= self.min_tokens:
                    text += self.stop_matcher.pass_through(self.detokenizer.add([token]))
                    continue
                check = self.stop_matcher.feed(self.detokenizer.add([token]))
                text += check.text
                if check.matched is not None:
                    consumed, rendered, self.ended_by_token = i + 1, rendered[:i + 1], None
                    logprobs = logprobs[:i + 1] if logprobs is not None else None
                    alternatives = alternatives[:i + 1] if alternatives is not None else None
                    break
            check = StopCheck(text, self.stop_matcher.matched)
        else:
            check = self.stop_matcher.feed(self.detokenizer.add(rendered))
        self.num_tokens += consumed
        text, finish_reason = check.text, None
        if check.matched is not None:
            finish_reason = "stop"
        elif delta.finish_reason is not None:
            text += self.stop_matcher.feed(self.detokenizer.flush()).text
            if self.stop_matcher.matched is not None:
                finish_reason = "stop"
            else:
                text += self.stop_matcher.flush()
                finish_reason = delta.finish_reason
        self.finish_reason = finish_reason
        return TextUpdate(text, list(rendered), logprobs, alternatives, finish_reason, consumed)


def ended_by_stop_string(samples: Iterable[SampleText]) -> bool:
    """Every sample of a request has ended, one of them on a stop string: the scheduler, which
    knows no strings, still runs it, so the client aborts it there to free its blocks now."""
    samples = list(samples)
    return (all(s.finish_reason is not None for s in samples)
            and any(s.finish_reason == "stop" and s.stop_matcher.matched is not None for s in samples))
