"""msgpack framing: every frame is ``[PROTOCOL_VERSION, message]``, validated on decode.

Any bad frame (garbage, truncated, oversized, unknown type, wrong field types, another
protocol version) raises :class:`ProtocolError`; receivers log it and keep running.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

PROTOCOL_VERSION = 15  # 2: SchedulerOutput.decodes and RequestOutputs' token lists; 3: samples flags, placeholder tokens; 4: sampling controls, top logprobs, PrefixCacheEvents, WorkerHello.vocab_size; 5: structured outputs, SchedulerOutput.grammar; 6: prompt logprobs (SamplingParams, StepResult, RequestDelta); 7: dead fields and messages removed (Shutdown, ProcessFailed, AddRequest.arrival_time, some SchedulerStats and WorkerInit fields); 8: AddRequest.priority, SchedulerStats.scheduling_policy; 9: AddRequest.max_queue_time_s, deadline_s and tenant, SchedulerOutput.now_s, error_kind queue_timeout, SchedulerStats per tenant and deadline counts; speculative decoding (SchedulerOutput.spec_token_ids, StepResult.num_accepted_tokens, SchedulerStats.spec_decode_*); AddRequest.pooling, StepResult.pooled, RequestDelta.embedding (embeddings); 10: reasoning: StructuredOutputs.start_after (the grammar starts after the reasoning's end tag); 11: draft_model speculation (SchedulerOutput.draft_tokens, StepResult.draft_token_ids); 12: a sampled token races in two levels (chunks, then tokens) on counter-based noise, not 11's generator-drawn vector (a seed's tokens differ); 13: NewRequestData.min_tokens_stop_ids (min_tokens masks the stop tokens, as vLLM's); 14: FrontendStarted (a restarted frontend's replicas abort the dead one's requests); 15: FCFS starts the older of the swapped and waiting heads (a recorded run's steps differ); WorkerHello.dtype and enforce_eager (a replay computes as recorded)
MAX_FRAME_BYTES = 64 * 1024 * 1024

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame that cannot be accepted; the message says why."""


# msgspec raises UnicodeDecodeError (a ValueError), not DecodeError, for a str field
# holding invalid UTF-8: one flipped bit in a request id would otherwise crash the receiver.
# RecursionError: deeply nested garbage.
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, RecursionError)
_envelope_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


def encode(msg: Any) -> bytes:
    return _envelope_encoder.encode((PROTOCOL_VERSION, msg))


class Decoder(Generic[T]):
    """Decodes frames of one channel's union type (see protocol.messages)."""

    def __init__(self, union: Any, max_frame_bytes: int = MAX_FRAME_BYTES):
        self._body = msgspec.msgpack.Decoder(union)
        self.max_frame_bytes = max_frame_bytes

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        try:
            version, body = _header_decoder.decode(frame)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"malformed frame header: {exc}") from None
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (this build speaks {PROTOCOL_VERSION})"
            )
        try:
            return self._body.decode(body)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"invalid message: {exc}") from None
