"""The offline `LLM` API: a client of one replica over the same protocol as the HTTP frontend."""

from pagedserve.offline.lora import LoRARequest  # noqa: F401  (vLLM's vllm.lora.request.LoRARequest)
