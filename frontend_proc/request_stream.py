"""One request's token deltas turned into text updates per choice (detokenize, stop strings).

Errors surface as APIError exceptions so the caller can answer with a status code before
streaming starts or with an SSE error event after. A stop string ends its choice here;
once every choice has ended here but not at the scheduler, the request is aborted there
so its KV blocks are freed at once.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from pagedserve.frontend_proc.engine_client import EngineClient, ReplicaFailed, RequestHandle
from pagedserve.frontend_proc.errors import (
    APIError, InvalidRequest, QueueTimeout, ServiceUnavailable, ShuttingDown, TooManyRequests)
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.protocol.messages import PromptLogprobs, RequestDelta
from pagedserve.protocol.priority import QUEUE_TIMEOUT
from pagedserve.client.sample_text import SampleText, ended_by_stop_string

log = logging.getLogger(__name__)
_LEADING_FIELD = re.compile(r"([a-z_]+)(?::|=)")


@dataclass(slots=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)  # rendered tokens, for logprobs
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token, its alternatives
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # with the sample's first token, when asked


class ChoiceState:
    def __init__(self, index: int, tokenizer: PromptTokenizer, stop_strings: list[str], min_tokens: int = 0):
        self.index = index
        self.text = SampleText(tokenizer, stop_strings, tokenizer.stream_backend, min_tokens)
        self.decoder = tokenizer  # how its tokens became its text
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None

    @property
    def finish_reason(self) -> Optional[str]:
        return self.text.finish_reason

    @property
    def num_tokens(self) -> int:  # what usage counts
        return self.text.num_tokens

    def apply(self, delta: RequestDelta) -> ChoiceUpdate:
        update = self.text.apply(delta)
        return ChoiceUpdate(self.index, update.text, update.token_ids, update.logprobs,
                            update.top_logprobs, update.finish_reason, delta.prompt_logprobs)


def _delta_error(delta: RequestDelta) -> APIError:
    message = delta.error or "the request failed in the engine"
    if delta.error_kind == "invalid_request":  # the scheduler's refusals start with the field they name
        field = _LEADING_FIELD.match(message)
        return InvalidRequest(message, param=field.group(1) if field else None)
    if delta.error_kind == "overloaded":  # the scheduler shed what the frontend's view let through
        return TooManyRequests(message)
    if delta.error_kind == QUEUE_TIMEOUT:
        return QueueTimeout(message)
    return ServiceUnavailable(message)


class RequestStream:
    def __init__(self, engine: EngineClient, handle: RequestHandle, tokenizer: PromptTokenizer,
                 stop_strings: list[str], num_prompt_tokens: int, metrics: FrontendMetrics, min_tokens: int = 0):
        self.engine = engine
        self.handle = handle
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = metrics
        self.choices = [ChoiceState(i, tokenizer, stop_strings, min_tokens) for i in range(handle.num_seqs)]
        self.arrival = time.monotonic()
        self._open = len(self.choices)  # choices without a finish_reason: checked per event

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def is_finished(self) -> bool:
        return self._open == 0

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Yield, per wake-up, the updates of every delta that arrived meanwhile (in order;
        several for one choice when this task fell behind) until every choice finished."""
        while not self.is_finished():
            batch = []
            for event in await self.handle.take():
                if isinstance(event, ReplicaFailed):
                    raise (ShuttingDown if event.shutting_down else ServiceUnavailable)(event.message)
                if event.finish_reason == "error":
                    self.abort()
                    raise _delta_error(event)
                update = self._apply(event)
                if update is None:
                    continue
                batch.append(update)
                if self.is_finished():
                    if ended_by_stop_string(c.text for c in self.choices):
                        self.abort()  # the scheduler still runs it: free the blocks now
                    break
            if batch:
                yield batch

    def _apply(self, delta: RequestDelta) -> Optional[ChoiceUpdate]:
        if not 0 <= delta.index < len(self.choices):
            log.warning("delta index %d out of range for %s", delta.index, delta.request_id)
            return None
        choice = self.choices[delta.index]
        if choice.finish_reason is not None:
            return None  # already ended by a stop string; the scheduler lags behind
        now = time.monotonic()
        if delta.new_token_ids:
            self._observe_tokens(choice, now)
        update = choice.apply(delta)
        if update.finish_reason is not None:  # once per choice: a finished one returns above
            self._open -= 1
            decode_seconds = 0.0 if choice.first_token_at is None else choice.last_token_at - choice.first_token_at
            self.metrics.count_finish(update.finish_reason, now - self.arrival, decode_seconds, choice.num_tokens,
                                      self.handle.lora_name)
        return update

    def abort(self) -> None:
        """Free the request at the scheduler unless it already finished there."""
        self.engine.abort(self.handle)

    def _observe_tokens(self, choice: ChoiceState, now: float) -> None:
        """Each choice is a sequence of its own (vLLM's child request): its own TTFT, then one gap per
        delta, as vLLM observes one inter-token latency per step however many tokens the step brought."""
        if choice.first_token_at is None:
            choice.first_token_at = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            self.metrics.observe_token_gap(now - choice.last_token_at)
        choice.last_token_at = now
