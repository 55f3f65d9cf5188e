"""Model implementations written against the paged KV cache, by HF architecture name.

The architectures are protocol/model_architectures.py's registry; each names the file under this
package that declares its family (family.py). Every dense family runs the one CausalLM; the
family's declaration (ModelSpec.family) tells its layers apart.
"""

from pagedserve.protocol.model_architectures import ARCHITECTURES
from pagedserve.worker_proc.models.causal_lm import CausalLM

MODEL_CLASSES = {arch: CausalLM for arch in ARCHITECTURES}

__all__ = ["CausalLM", "MODEL_CLASSES"]
