"""vLLM's side of ``pagedserve bench offline``: run by vLLM's own interpreter, never imported.

    VLLM_PYTHON vllm_runner.py IN.json OUT.json

vLLM lives in its own environment (its torch build and pins differ from pagedserve's), so
the bench runs this file with that interpreter. It imports only vLLM and the standard
library. IN.json holds the workload: ``model``, ``dtype``, ``prompts`` (token-id lists),
``max_tokens``, ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``runs``, ``warmup_prompts``
and ``engine_args`` (extra ``vllm.LLM`` keyword arguments). OUT.json receives, on success, the seconds of each timed run, the
token ids of the first timed run in prompt order, whether every run produced the
same ids, and the time from this process's start to the engine's first answer. JSON files
rather than stdout, because vLLM and its children log to stdout.
"""

import json
import sys
import time

STARTED = time.perf_counter()  # before vLLM's import: the start-to-first-answer clock


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0, **spec.get("engine_args", {}))
    try:
        loaded = time.perf_counter() - STARTED
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:spec.get("warmup_prompts", 2)], warm, use_tqdm=False)
        first_answer = time.perf_counter() - STARTED
        # unseeded: the batch-wide sampling path a user of vLLM gets by default
        limits = {"top_p": spec.get("top_p", 1.0), **({"top_k": spec["top_k"]} if spec.get("top_k", 0) > 0 else {})}
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec.get("temperature", 0.0),
                                ignore_eos=True, **limits)
        seconds, runs = [], []
        for _ in range(spec["runs"]):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)  # returned in prompt order
            seconds.append(time.perf_counter() - start)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
    finally:
        # its engine core and worker processes outlive this one unless told to stop
        llm.llm_engine.engine_core.shutdown()
    import torch
    import vllm

    return {"seconds": seconds, "token_ids": runs[0] if runs else [],
            "runs_identical": all(r == runs[0] for r in runs), "load_s": loaded,
            "first_answer_s": first_answer, "vllm_version": vllm.__version__,
            "torch_version": torch.__version__}


def main() -> int:
    in_path, out_path = sys.argv[1], sys.argv[2]
    with open(in_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process, which re-imports this file
    sys.exit(main())
