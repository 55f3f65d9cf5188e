"""One check of a request against the protocol's own types, shared by every edge.

msgspec enforces the ranges declared in messages.py when it *decodes* a frame, not when a
struct is built in Python. Each boundary checks a request once:
- a message built in process (the HTTP frontend, the offline LLM, a test driving a scheduler
  directly) goes through ``check_request``: the ranges, by the same round trip decoding does,
  then ``check_fields``;
- a frame is range-checked by decoding it, and the scheduler then applies only
  ``check_fields``: the rules between fields and against the model's vocabulary, which no type
  states (the vocabulary is known only once the workers said it).
A bad value raises ``InvalidField``, which names the field, before anything is encoded or sent.

``RequestFrameDecoder`` is the scheduler's side: a frame it cannot accept is answered with an
error for its request id when that id can still be read, so no caller waits for a reply that
will never come.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import msgspec

from pagedserve.protocol.codec import PROTOCOL_VERSION, Decoder, ProtocolError
from pagedserve.protocol.messages import MAX_REQUEST_ID_CHARS, AddRequest, FrontendToScheduler, RequestDelta

_AT_PATH = re.compile(r"^(?P<why>.*?)(?: - at `(?:key` in `)?\$\.?(?P<path>[^`]*)`)?$", re.S)  # dict keys too


class InvalidField(ValueError):
    """A request field outside its range; ``field`` is its name (``seed``, ``prompt_token_ids``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def _field_error(exc: msgspec.ValidationError) -> InvalidField:
    """``Expected `int` <= 9223372036854775807 - at `$.sampling.seed``` -> InvalidField("seed", ...)."""
    match = _AT_PATH.match(str(exc))
    path = (match.group("path") or "") if match else ""
    why = match.group("why") if match else str(exc)
    top = path.removeprefix("sampling.").split(".")[0].split("[")[0] or "request"
    where = path.removeprefix("sampling.")
    return InvalidField(top, why if where == top else f"{why} (at {where})")


def unencodable_string(value: Any, path: str = "") -> Optional[tuple[str, str]]:
    """(field path, why) of the first string in ``value`` (nested dicts, lists, tuples, dict keys)
    that UTF-8 cannot encode: a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes and
    Python's ``json.loads`` of bytes ``ED A0 80`` both produce. No tokenizer, msgpack frame or
    grammar compiler can take one, so every edge refuses it where the request is decoded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path or "(body)", (f"holds the lone UTF-16 surrogate {ascii(value[exc.start])} at character "
                                      f"{exc.start}, which is not a character")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = key if isinstance(key, str) and unencodable_string(key) is None else ascii(key)
            where = f"{path}.{name}" if path else name
            found = unencodable_string(key, where) or unencodable_string(item, where)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = unencodable_string(item, f"{path}[{i}]")
            if found:
                return found
    return None


def check_message(msg: Any) -> None:
    """The ranges of ``type(msg)``, applied to a message built in process, as decoding would."""
    try:
        msgspec.convert(msgspec.to_builtins(msg), type(msg))
    except msgspec.ValidationError as exc:
        raise _field_error(exc) from None
    except (TypeError, OverflowError, ValueError) as exc:  # e.g. an object msgspec cannot serialize
        raise InvalidField("request", str(exc)) from None


def _check_vocabulary(field: str, token_ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidField(field, f"token id {bad} is outside the model's vocabulary "
                                  f"(ids must be in [0, {vocab_size}))")


def check_structured_outputs(spec) -> None:
    """Exactly one kind set, and a choice list that can match something."""
    kinds = spec.kinds_set()
    if len(kinds) != 1:
        raise InvalidField("structured_outputs", "exactly one of json, json_object, regex, choice, grammar "
                                                 f"must be set, got {kinds or 'none'}")
    if spec.choice is not None and (not spec.choice or any(not c for c in spec.choice)):
        raise InvalidField("structured_outputs", "choice must list at least one non-empty string")


def check_request(msg: AddRequest, vocab_size: int = 0) -> None:
    """Raise InvalidField unless ``msg``, built in process, is in range; ``vocab_size`` 0 skips
    the vocabulary check."""
    check_message(msg)
    check_fields(msg, vocab_size)


def check_fields(msg: AddRequest, vocab_size: int = 0) -> None:
    """What decoding does not check: the rules between fields, and token ids against the vocabulary."""
    sampling = msg.sampling
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidField("min_tokens", f"min_tokens ({sampling.min_tokens}) exceeds max_tokens "
                                         f"({sampling.max_tokens})")
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: set logprobs to true as well")
    if sampling.structured_outputs is not None:
        check_structured_outputs(sampling.structured_outputs)
    if msg.pooling is not None and (sampling.n != 1 or sampling.logprobs or sampling.prompt_logprobs is not None
                                    or sampling.structured_outputs is not None):
        raise InvalidField("pooling", "an embedding request samples nothing: n must be 1, without logprobs, "
                                      "prompt_logprobs or structured outputs")
    if vocab_size > 0:
        _check_vocabulary("logit_bias", list(sampling.logit_bias), vocab_size)
        _check_vocabulary("prompt_token_ids", msg.prompt_token_ids, vocab_size)
        _check_vocabulary("stop_token_ids", sampling.stop_token_ids, vocab_size)
        _check_vocabulary("eos_token_ids", msg.eos_token_ids, vocab_size)
        if sampling.structured_outputs is not None:
            _check_vocabulary("structured_outputs.start_after", sampling.structured_outputs.start_after, vocab_size)


class _RequestIdOnly(msgspec.Struct):  # unknown fields ignored: reads an id out of a bad request
    type: str
    request_id: str


_salvage = msgspec.msgpack.Decoder(tuple[int, _RequestIdOnly])


def rejected_request_id(frame: bytes | memoryview) -> Optional[str]:
    """The request id of a rejected AddRequest frame, if it can still be read."""
    try:
        version, body = _salvage.decode(frame)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    if version != PROTOCOL_VERSION or body.type != "AddRequest":
        return None
    if not 0 < len(body.request_id) <= MAX_REQUEST_ID_CHARS:
        return None
    return body.request_id


def rejection_delta(request_id: str, reason: str) -> RequestDelta:
    return RequestDelta(request_id=request_id, index=0, new_token_ids=[], finish_reason="error",
                        error=reason, error_kind="invalid_request")


class RequestFrameDecoder(Decoder):
    """The frontend -> scheduler decoder that remembers (request id, reason) of every AddRequest
    frame it rejects; the scheduler answers them (``take_rejected``) with an error delta."""

    def __init__(self, **kwargs: Any):
        super().__init__(FrontendToScheduler, **kwargs)
        self._rejected: list[tuple[str, str]] = []

    def decode(self, frame: bytes | memoryview) -> Any:
        try:
            return super().decode(frame)
        except ProtocolError as exc:
            request_id = rejected_request_id(frame)
            if request_id is not None and len(self._rejected) < 10_000:  # bounded while unanswered
                self._rejected.append((request_id, f"the request was rejected: {exc}"))
            raise

    def take_rejected(self) -> list[tuple[str, str]]:
        rejected, self._rejected = self._rejected, []
        return rejected
