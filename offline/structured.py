"""vLLM's ``StructuredOutputsParams`` for the offline API, and what ``SamplingParams(
structured_outputs=...)`` accepts: that class, a dict of the same keys, or the wire form."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pagedserve.protocol import messages as m
from pagedserve.protocol.structured_outputs import build_grammar, structured_outputs_from_dict


@dataclass
class StructuredOutputsParams:
    """One grammar for the output; exactly one field set (vLLM's names)."""

    json: Union[str, dict, None] = None  # a JSON Schema, as a dict or its text
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # EBNF (GBNF dialect)
    json_object: Optional[bool] = None  # any JSON object

    def __post_init__(self) -> None:
        self.to_protocol()  # refuses a bad one at once (ValueError naming the problem)

    def to_protocol(self) -> m.StructuredOutputs:
        return as_structured_outputs({f.name: getattr(self, f.name) for f in fields(self)})


def as_structured_outputs(value: Any) -> Optional[m.StructuredOutputs]:
    """The wire form of ``value`` (None, StructuredOutputsParams, dict or the wire struct), its
    grammar checked; raises InvalidField (a ValueError) naming the problem."""
    if value is None or isinstance(value, m.StructuredOutputs):
        spec = value
    elif isinstance(value, StructuredOutputsParams):
        return value.to_protocol()
    else:
        spec = structured_outputs_from_dict(value)
    if spec is not None:
        build_grammar(spec)
    return spec
