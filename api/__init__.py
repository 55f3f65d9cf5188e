"""pagedserve: a multi-process paged-attention LLM serving engine.

``from pagedserve import LLM, SamplingParams`` is the offline API, as vLLM spells it
(``StructuredOutputsParams`` too; ``PoolingParams`` for ``LLM.embed`` and ``LLM.encode``; ``LoRARequest``
for ``generate(..., lora_request=...)``). The
names load on first use, so a process that imports only ``pagedserve.protocol`` (every
scheduler and worker) never pays for the offline API's imports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineDiedError",
           "PoolingParams", "EmbeddingRequestOutput", "PoolingRequestOutput", "LoRARequest", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from pagedserve.protocol.version import package_version

        return package_version()
    if name in __all__:
        from pagedserve.offline import llm as offline

        return getattr(offline, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
