"""Settings of the session's shared deployments (tests/e2e/conftest.py), near the defaults.

The server's cache (80 blocks of 16 tokens, 1,280 tokens) is smaller than its --max-model-len
(1,536), so a prompt can fit the model and still never fit the cache; it holds a forced tool
call's 800-token prompt and 300 answer tokens. The first grammar compile can stall a loaded
machine's scheduler for seconds, hence the long replica timeout.
"""

from __future__ import annotations

SERVER_MAX_MODEL_LEN = 1536
SERVER_CACHE_TOKENS = 80 * 16
SERVER_ARGS = ["--num-gpu-blocks", "80", "--max-model-len", str(SERVER_MAX_MODEL_LEN),
               "--max-num-batched-tokens", "256", "--debug-invariants", "--replica-timeout-s", "60"]

LLM_MAX_MODEL_LEN = 512
LLM_MAX_NUM_SEQS = 8
GPU_MEMORY_UTILIZATION = 0.0005  # on CPU: the share of RAM the KV cache may take
LLM_OPTIONS = dict(dtype="auto", seed=0, max_model_len=LLM_MAX_MODEL_LEN, max_num_seqs=LLM_MAX_NUM_SEQS,
                   gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
