"""Model implementations written against the paged KV cache, by HF architecture name."""

from pagedserve.worker_proc.model_config import SUPPORTED_ARCHITECTURES
from pagedserve.worker_proc.models.causal_lm import CausalLM

# Every supported architecture is the same Llama-family decoder; ModelSpec carries the
# switches (q/k norm, biases, sliding window) that tell them apart.
MODEL_CLASSES = {arch: CausalLM for arch in SUPPORTED_ARCHITECTURES}

__all__ = ["CausalLM", "MODEL_CLASSES"]
