"""vLLM's ``LoRARequest`` for ``LLM.generate`` / ``LLM.chat``, and the offline LLM's adapters.

``LLM(model, enable_lora=True)`` is the one writer of its engine's adapters, as the HTTP
frontend is of a deployment's: an adapter is read and judged (client/lora_adapters.py) the first
time a request names it, then registered with every replica before that request is sent. The
engine names an adapter by ``lora_name``; the id and path a name was first registered with stay
its own, so a second LoRARequest that reuses the name or the id for something else is refused
rather than silently computed by the first adapter (which is what vLLM, keyed by id, would do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.protocol.messages import LoRAAdapter


class LoRARequest:
    """vLLM's ``vllm.lora.request.LoRARequest``: an adapter directory (PEFT's format) by name and id.
    Equal (and hashed) by name, as vLLM's."""

    __slots__ = ("lora_name", "lora_int_id", "lora_path")

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = ""):
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")  # vLLM's words
        if not lora_path:
            raise ValueError("lora_path cannot be empty")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError("lora_name must be a non-empty string")
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = str(lora_path)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, lora_path={self.lora_path!r})"


LoRARequests = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]


def as_lora_list(lora_request: LoRARequests, count: int, enabled: bool) -> list[Optional[LoRARequest]]:
    """One LoRARequest (or None: the base model) per prompt; ValueError as vLLM raises it."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        requests = [lora_request] * count
    elif isinstance(lora_request, (list, tuple)):
        if len(lora_request) != count:
            raise ValueError("Lengths of prompts and lora_request must be the same.")
        requests = list(lora_request)
    else:
        raise TypeError(f"lora_request must be a LoRARequest, a list of them (None for the base model) or None, "
                        f"got {type(lora_request).__name__}")
    for item in requests:
        if item is not None and not isinstance(item, LoRARequest):
            raise TypeError(f"lora_request items must be LoRARequest or None, got {type(item).__name__}")
        if item is not None and not enabled:
            raise ValueError(f"Got lora_request {item} but LoRA is not enabled!")
    return requests


def new_adapters(adapters: AdapterRegistry, requests: Sequence[Optional[LoRARequest]]) -> list[LoRAAdapter]:
    """Register each adapter the registry does not know yet (read and judged first: ValueError naming
    the reason); returns them, for the caller to send to every replica before the requests."""
    added = []
    for request in requests:  # each one checked: two of one name may disagree
        if request is None:
            continue
        known = adapters.get(request.lora_name)
        if known is None:
            spec = adapters.read(request.lora_name, request.lora_path)
            added.append(adapters.add(request.lora_name, spec, lora_id=request.lora_int_id))
            continue
        if known.lora_id != request.lora_int_id:
            raise ValueError(f"{request}: the LoRA adapter {request.lora_name!r} was registered with "
                             f"lora_int_id {known.lora_id}; one name keeps one id")
        if Path(request.lora_path).expanduser().resolve() != Path(known.path):
            raise ValueError(f"{request}: the LoRA adapter {request.lora_name!r} was registered from "
                             f"{known.path}; give the new adapter a new name")
    return added
