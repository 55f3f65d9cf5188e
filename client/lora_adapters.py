"""The LoRA adapters a client of the engine has registered, by the name requests give them.

The HTTP frontend and the offline ``LLM`` are each the one writer of the adapters their
schedulers know: they read an adapter (protocol/lora_adapter.py) against the base model's
own projections and layer count before any process hears of it, so a bad adapter is refused
in one line naming the reason and the engine keeps serving. ``serve`` reads ``--lora-modules``
through the same ``read_model_adapter`` before it starts any process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence

from pagedserve.protocol.block_hash import adapter_seed
from pagedserve.protocol.lora_adapter import (AdapterSpec, LoRAAdapterError, expert_count, projection_shapes,
                                              read_adapter)
from pagedserve.protocol.messages import MAX_LORA_NAME_CHARS, LoRAAdapter


class AdapterNameError(ValueError):
    """A name no adapter can take here (empty, a served model's, or already loaded)."""


class UnknownAdapter(KeyError):
    """No adapter of that name is registered."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else ""


def adaptable_projections(model_cfg: dict) -> tuple[dict[str, tuple[int, int]], Optional[int]]:
    """(module -> (in, out), layer count) of the base model of config.json ``model_cfg``;
    LoRAAdapterError when the config lacks the sizes an adapter is checked against."""
    try:
        projections = projection_shapes(model_cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise LoRAAdapterError(f"config.json has no adaptable projections (no {exc} to size them by)") from None
    text = model_cfg.get("text_config") or model_cfg
    layers = text.get("num_hidden_layers")
    return projections, int(layers) if isinstance(layers, int) else None


def read_model_adapter(path: str, model_cfg: dict, max_rank: int) -> AdapterSpec:
    """The adapter at ``path`` judged against the base model of config.json ``model_cfg``."""
    projections, num_layers = adaptable_projections(model_cfg)
    return read_adapter(path, max_rank, projections, num_layers, expert_count(model_cfg) or None)


def check_adapter_name(name: str, reserved: Sequence[str]) -> None:
    if not isinstance(name, str) or not name:
        raise AdapterNameError("a LoRA adapter needs a non-empty name")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise AdapterNameError(f"LoRA adapter name {name[:40]!r}... is longer than {MAX_LORA_NAME_CHARS} characters")
    if name in reserved:
        raise AdapterNameError(f"LoRA adapter name {name!r} is the base model's served name: a request naming it "
                               f"would be ambiguous; choose another")


class AdapterRegistry:
    """name -> LoRAAdapter, for one base model. ``lora_id``s count from 1 and are never reused, so
    an id names one adapter for the deployment's life (vLLM's ``lora_int_id``)."""

    def __init__(self, model_dir: str | Path, max_rank: int, reserved_names: Sequence[str] = ()):
        self.model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_rank = max_rank
        self.reserved_names = tuple(reserved_names)  # the base model's names
        self._adapters: dict[str, LoRAAdapter] = {}
        self._next_id = 1

    def read(self, name: str, path: str) -> AdapterSpec:
        """The adapter ``name`` would be: AdapterNameError or LoRAAdapterError naming the reason."""
        check_adapter_name(name, self.reserved_names)
        return read_model_adapter(path, self.model_cfg, self.max_rank)

    def add(self, name: str, spec: AdapterSpec, *, replace: bool = False,
            lora_id: Optional[int] = None) -> LoRAAdapter:
        """Register ``name`` as the adapter ``read`` returned (``replace``: under a name already loaded,
        keeping its id); ``lora_id``: the caller's (offline LoRARequest.lora_int_id), else the next free one."""
        self.check_free(name, replace)
        old = self._adapters.get(name)
        if lora_id is None:
            lora_id = old.lora_id if old is not None else self._next_id
        owner = self.by_id(lora_id)
        if owner is not None and owner.name != name:
            raise AdapterNameError(f"lora_int_id {lora_id} is already LoRA adapter {owner.name!r}")
        self._next_id = max(self._next_id, lora_id + 1)
        adapter = LoRAAdapter(name=name, lora_id=lora_id, path=spec.path, digest=spec.digest)
        self._adapters[name] = adapter
        return adapter

    def check_free(self, name: str, replace: bool = False) -> None:
        if name in self._adapters and not replace:
            raise AdapterNameError(f"The lora adapter '{name}' has already been loaded.")  # vLLM's words

    def remove(self, name: str) -> LoRAAdapter:
        if name not in self._adapters:
            raise UnknownAdapter(f"The lora adapter '{name}' cannot be found.")  # vLLM's words
        return self._adapters.pop(name)

    def get(self, name: str) -> Optional[LoRAAdapter]:
        return self._adapters.get(name)

    def by_id(self, lora_id: int) -> Optional[LoRAAdapter]:
        return next((a for a in self._adapters.values() if a.lora_id == lora_id), None)

    def seed(self, name: str) -> int:
        """The prefix-cache seed of a request computed by adapter ``name`` ("" or unknown: the base model's)."""
        adapter = self._adapters.get(name) if name else None
        return adapter_seed(adapter.digest) if adapter is not None else 0

    def __iter__(self) -> Iterator[LoRAAdapter]:
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters
