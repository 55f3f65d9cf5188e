"""Several prompts of one /v1/completions request as one stream of choices.

Each prompt is its own engine request (its own id, its own n samples); their updates are
merged in arrival order and renumbered prompt-major, as OpenAI and vLLM number them:
prompt i's sample j is choice ``i * n + j``. Usage sums over the prompts. With ``echo``,
each choice's first update starts with its prompt's text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Collection, Optional, Sequence, Union

from pagedserve.frontend_proc.request_stream import ChoiceState, ChoiceUpdate, RequestStream

_ENDED = object()  # a prompt's stream has no more updates


@dataclass(slots=True)
class BatchChoice:
    """One choice of the response: which prompt's which sample."""

    index: int  # in the response
    state: ChoiceState
    echo: str = ""  # text to put before the first update ("" once sent, or without echo)
    stop_token_ids: Collection[int] = ()
    prompt_token_ids: Sequence[int] = ()  # its prompt's, for prompt logprobs

    @property
    def finish_reason(self) -> Optional[str]:
        return self.state.finish_reason

    @property
    def stop_reason(self) -> Optional[Union[str, int]]:
        return self.state.text.stop_reason(self.stop_token_ids)


class CompletionBatch:
    """The prompts' RequestStreams, seen as one (the interface serving.py formats)."""

    def __init__(self, streams: list[RequestStream], echo_texts: Optional[list[str]] = None,
                 stop_token_ids: Collection[int] = (), prompt_ids: Optional[list[list[int]]] = None,
                 prompt_logprobs: Optional[int] = None, echo_logprobs: Optional[int] = None):
        self.streams = streams
        # Alternatives per prompt token, for the prompt_logprobs field / the echoed logprobs (None: not shown)
        self.prompt_logprobs = prompt_logprobs
        self.echo_logprobs = echo_logprobs
        self.choices: list[BatchChoice] = []
        self._offsets: list[int] = []
        for i, stream in enumerate(streams):
            self._offsets.append(len(self.choices))
            echo = echo_texts[i] if echo_texts else ""
            prompt = prompt_ids[i] if prompt_ids else ()
            self.choices += [BatchChoice(len(self.choices) + c.index, c, echo, stop_token_ids, prompt)
                             for c in stream.choices]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.streams)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_completion_tokens for s in self.streams)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        if len(self.streams) == 1:  # the common case, one generator less per token
            async for batch in self.streams[0].updates():
                yield [self._renumber(0, update) for update in batch]
            return
        async for batch in self._merged():
            yield [self._renumber(stream_index, update) for stream_index, update in batch]

    def _renumber(self, stream_index: int, update: ChoiceUpdate) -> ChoiceUpdate:
        choice = self.choices[self._offsets[stream_index] + update.index]
        update.index = choice.index
        if choice.echo:
            update.text, choice.echo = choice.echo + update.text, ""
        return update

    async def _merged(self) -> AsyncIterator[list[tuple[int, ChoiceUpdate]]]:
        """Every prompt's updates as they come; the first error ends them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream_index: int, stream: RequestStream) -> None:
            try:
                async for batch in stream.updates():
                    await queue.put([(stream_index, u) for u in batch])
            except Exception as exc:  # APIError mostly: re-raised in the consumer
                await queue.put(exc)
            await queue.put(_ENDED)

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        running = len(pumps)
        try:
            while running:
                item = await queue.get()
                if item is _ENDED:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()
            self.abort()
