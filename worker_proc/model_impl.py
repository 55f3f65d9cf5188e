"""``--model-impl``: which implementation runs a model directory, native or the transformers backend.

``native`` takes the model family pagedserve writes itself (models/, model_config.py) and refuses
the rest; ``transformers`` runs transformers' own modeling code over the paged cache
(models/transformers_backend.py), as vLLM's ``--model-impl transformers``; ``auto`` (vLLM's default
too) takes the native family where there is one, otherwise the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedserve.protocol.model_architectures import ARCHITECTURES, ModelConfigError, read_model_config
from pagedserve.runtime.options import MODEL_IMPLS
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError, load_model_spec


@dataclass(frozen=True, slots=True)
class ModelImplementation:
    spec: ModelSpec
    model_class: type  # built as model_class(model_dir, spec, shard, device, dtype, elementwise)
    description: str  # for the worker's log

    @property
    def is_native(self) -> bool:
        return not self.description.startswith("transformers")


def select_implementation(model_dir: str | Path, model_impl: str = "auto") -> ModelImplementation:
    """The implementation ``model_impl`` picks; UnsupportedModelError (one line) when it cannot run the model."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    native_refusal = None
    if model_impl != "transformers":
        try:
            spec = load_model_spec(model_dir)
        except ModelConfigError as exc:  # UnsupportedModelError, or the registry's own check
            if model_impl == "native" or _names_a_native_family(model_dir):
                raise  # a native family's config that breaks its own rules: no other implementation fixes that
            native_refusal = exc
        else:
            from pagedserve.worker_proc.models import MODEL_CLASSES

            return ModelImplementation(spec, MODEL_CLASSES[spec.architecture], f"native ({spec.architecture})")
    from pagedserve.worker_proc.models.transformers_backend import TransformersCausalLM, load_backend_spec

    try:
        spec = load_backend_spec(model_dir)
    except UnsupportedModelError as exc:
        if native_refusal is None:
            raise
        raise UnsupportedModelError(f"natively: {native_refusal}; by the transformers backend: {exc}") from None
    return ModelImplementation(spec, TransformersCausalLM, f"transformers backend ({spec.architecture})")


def _names_a_native_family(model_dir: str | Path) -> bool:
    try:
        named = read_model_config(model_dir).get("architectures") or []
    except ModelConfigError:
        return False
    return any(a in ARCHITECTURES for a in named if isinstance(a, str))
