"""A request's ways of asking for structured output, as the one ``StructuredOutputs`` it sends.

OpenAI's ``response_format`` (``json_object``, ``json_schema``; ``text`` asks for nothing)
and vLLM's extras (``structured_outputs``, ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``) on both endpoints. At most one may be given; two are a
400 rather than a guess. The grammar is parsed here (protocol/structured_outputs.py, no
tokenizer needed), so a schema that cannot compile is a 400 naming the field before anything
reaches a scheduler; the scheduler compiles it against the tokenizer.

``json_schema.strict``: the output is always held to the schema exactly (xgrammar's strict
mode: no properties beyond those listed), so ``strict: false`` gets the strict behaviour too.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Iterable, Optional

import msgspec

from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import SamplingFields
from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.protocol.structured_outputs import build_grammar, structured_outputs_from_dict
from pagedserve.protocol.validate import InvalidField

_CHECKED_LIMIT = 1024
# grammars checked already: None where they compiled, else why not (checks run in threads too)
_checked: OrderedDict[bytes, Optional[InvalidField]] = OrderedDict()
_checked_lock = threading.Lock()


def _requested(body: SamplingFields) -> list[tuple[str, dict]]:
    """(client field, vLLM structured_outputs dict) for every way the body asks."""
    asked = []
    fmt = body.response_format
    if fmt is not None:
        _check_response_format(fmt)
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest("response_format: type json_schema needs json_schema.schema",
                                 param="response_format")
        asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            asked.append((field, {key: value}))
    return asked


def _check_response_format(fmt) -> None:
    """Nothing in response_format goes unread: a key OpenAI does not define there, or a
    json_schema beside another type, would be accepted and ignored (a json_object's "schema")."""
    for extra in sorted(fmt.model_extra or {}):
        raise InvalidRequest(f"response_format.{extra} is not a field of response_format (type, json_schema)",
                             param=f"response_format.{extra}")
    if fmt.json_schema is None:
        return
    if fmt.type != "json_schema":
        raise InvalidRequest(f"response_format.json_schema is read only with type json_schema, not {fmt.type}",
                             param="response_format.json_schema")
    for extra in sorted(fmt.json_schema.model_extra or {}):
        raise InvalidRequest(f"response_format.json_schema.{extra} is not a field of json_schema "
                             "(name, description, schema, strict)", param=f"response_format.json_schema.{extra}")


def structured_output_field(body: SamplingFields) -> Optional[str]:
    """The field the body asks for structured output with (the first if several); None if none."""
    asked = _requested(body)
    return asked[0][0] if asked else None


def structured_outputs_of(body: SamplingFields) -> Optional[StructuredOutputs]:
    """The body's structured output request in wire form, its grammar checked; None if none.
    Raises InvalidRequest naming the field."""
    asked = _requested_spec(body)
    if asked is None:
        return None
    field, spec = asked
    try:
        check_grammar(spec)
    except InvalidField as exc:
        raise InvalidRequest(f"{field}: {exc.reason}", param=field) from None
    return spec


def _requested_spec(body: SamplingFields) -> Optional[tuple[str, StructuredOutputs]]:
    asked = _requested(body)
    if not asked:
        return None
    if len(asked) > 1:
        fields = ", ".join(field for field, _ in asked)
        raise InvalidRequest(f"structured output is asked for more than once ({fields}); send one",
                             param=asked[1][0])
    field, value = asked[0]
    try:
        return field, structured_outputs_from_dict(value, field)
    except InvalidField as exc:
        raise InvalidRequest(f"{field}: {exc.reason}", param=field) from None


def check_grammar(spec: StructuredOutputs) -> None:
    """Raise InvalidField unless ``spec``'s grammar parses; the answer is remembered."""
    key = msgspec.msgpack.encode(spec)
    with _checked_lock:
        known = key in _checked
        if known:
            _checked.move_to_end(key)
            failure = _checked[key]
    if not known:
        try:
            build_grammar(spec)
            failure = None
        except InvalidField as exc:
            failure = exc
        with _checked_lock:
            _checked[key] = failure
            if len(_checked) > _CHECKED_LIMIT:
                _checked.popitem(last=False)
    if failure is not None:
        raise failure


async def check_grammars_off_loop(body: SamplingFields, more: Iterable[Optional[StructuredOutputs]] = ()) -> None:
    """Check the body's grammars (and ``more``) in a thread, ahead of the request's synchronous
    path, which then finds the answers remembered. Converting a deep schema takes seconds
    (400 nested arrays: ~10 s); xgrammar releases the GIL meanwhile, so the loop goes on serving
    every other request and reading the replicas' heartbeats. Errors are left to that path."""
    try:
        asked = _requested_spec(body)
    except InvalidRequest:
        asked = None
    specs = [spec for spec in ([asked[1]] if asked else []) + list(more) if spec is not None]
    with _checked_lock:  # a thread costs ~0.2 ms a request: only for grammars not checked before
        specs = [spec for spec in specs if msgspec.msgpack.encode(spec) not in _checked]
    if specs:
        await asyncio.to_thread(_check_quietly, specs)


def _check_quietly(specs: list[StructuredOutputs]) -> None:
    for spec in specs:
        try:
            check_grammar(spec)
        except InvalidField:
            pass
