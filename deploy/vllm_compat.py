"""vLLM's command-line vocabulary: the dtype names it accepts, and the flags pagedserve lacks.

A vLLM user who passes a flag pagedserve does not support gets one line that says so and
why, instead of argparse's usage dump and "unrecognized arguments".
"""

from __future__ import annotations

from typing import Optional

from pagedserve.runtime.options import DTYPE_ALIASES, DTYPE_CHOICES, resolve_dtype  # noqa: F401 (re-exported)

UNSUPPORTED_FLAGS = {
    "--pipeline-parallel-size": "pipeline parallelism is not supported; use --tensor-parallel-size "
                                "and --data-parallel-size",
    "-pp": "pipeline parallelism is not supported; use --tensor-parallel-size and --data-parallel-size",
    "--speculative-model": "vLLM's old flag: use --speculative-config '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4}'",
    # LoRA: --enable-lora, --lora-modules, --max-loras, --max-lora-rank and --max-cpu-loras are served
    "--fully-sharded-loras": "adapters are always split over tensor-parallel ranks as their base layer is "
                             "(B sharded with it, A sharded or replicated)",
    "--lora-dtype": "adapter weights are computed in the model's --dtype",
    "--enable-lora-bias": "LoRA biases are not supported",
    "--lora-extra-vocab-size": "adapters that add tokens (embeddings, lm_head) are not supported",
    "--long-lora-scaling-factors": "long-context LoRA scaling is not supported",
    "--default-mm-loras": "multimodal models are not supported",
    "--cpu-offload-gb": "weight offloading is not supported",
    "--tokenizer-mode": "the tokenizer is always the model directory's (fast) tokenizer, or a GGUF's --tokenizer",
    "--trust-remote-code": "remote code is never run: only built-in model families are served",
    "--revision": "models are local directories; nothing is downloaded",
    "--download-dir": "models are local directories; nothing is downloaded",
    "--rope-scaling": "RoPE scaling is read from the model's config.json",
    "--hf-overrides": "the model's config.json is used as it is",
    "--limit-mm-per-prompt": "multimodal models are not supported",
    "--mm-processor-kwargs": "multimodal models are not supported",
    "--compilation-config": "there is no compilation config; see --help for the performance options",
    "--ssl-keyfile": "TLS is not terminated by pagedserve; put a TLS proxy in front",
    "--ssl-certfile": "TLS is not terminated by pagedserve; put a TLS proxy in front",
}


def unsupported_flag(argv: list[str]) -> Optional[str]:
    """The one-line complaint about the first vLLM flag in ``argv`` that pagedserve lacks."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        reason = UNSUPPORTED_FLAGS.get(flag)
        if reason is not None:
            return f"{flag} is a vLLM option that pagedserve does not support: {reason}"
    return None
