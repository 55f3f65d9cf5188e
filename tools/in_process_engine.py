"""The whole engine in one loop, in one process: start here.

Every step of ``pagedserve serve`` is this loop with sockets between its halves. The scheduler
(``scheduler_proc/scheduler.py``) decides the step's batch and hands out KV-cache blocks; the model
runner (``worker_proc/model_runner.py``) computes it over the paged cache and samples; the
scheduler takes the sampled tokens, applies the stop rules and frees what finished::

    while scheduler.has_unfinished():
        step = scheduler.schedule()                    # SchedulerOutput: who runs, which blocks
        result = runner.execute(step)                  # StepResult: the sampled tokens
        for delta in scheduler.update_from_output(step, result):
            ...                                        # RequestDelta: each sample's new tokens

Served, the scheduler runs this loop in its own process (``scheduler_proc/engine.py``), the
``SchedulerOutput`` goes over ZeroMQ to one worker process per device and the deltas to the HTTP
frontend or the offline ``LLM``, both of which drive one engine session
(``client/engine_session.py``). Here nothing crosses a process, which makes it the shortest way to
read, debug or profile a step, and the harness of the tests that check what the two halves of a
step do together.

    python -m pagedserve.tools.in_process_engine MODEL_DIR --prompt "Hello" --max-tokens 16
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from pagedserve.protocol.messages import AddRequest, LoRAAdapter, SamplingParams, WorkerInit
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.worker_proc.model_runner import ModelRunner


def generate(model_dir: str, prompts: list[list[int]], sampling: list[SamplingParams],
             speculative: Optional[SpeculativeConfig] = None, lora_names: Optional[Sequence[str]] = None,
             lora_adapters: Sequence[LoRAAdapter] = (), runner_options: Optional[dict] = None,
             **config) -> tuple[dict, Scheduler]:
    """Streams by (request id ``r{i}``, sample index), and the scheduler (for its stats).

    ``config``: SchedulerConfig fields over small defaults (debug invariants on). LoRA:
    ``lora_adapters`` are registered (as LoadLoRA does) before the requests, and ``lora_names[i]``
    names request i's adapter ("" the base model); passing either turns ``enable_lora`` on. Each
    step's LoRAStep reaches the runner before the step, as the engine loop sends it.
    ``runner_options``: keyword arguments of the ModelRunner (its LoRA limits). A request the
    scheduler refuses, or ends with an error, raises RuntimeError naming it."""
    settings = dict(block_size=4, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=128,
                    max_model_len=512, debug_invariants=True, speculative=speculative,
                    enable_lora=bool(lora_adapters or lora_names))
    runner = ModelRunner(model_dir, speculative=speculative, **(runner_options or {}))
    groups = runner.kv_groups  # a hybrid model's cache in KV groups: a table per group, as the engine keeps
    if groups is not None:
        settings.update(num_window_groups=groups.num_window_groups, hybrid_window=groups.window)
    settings.update(config)
    cfg = SchedulerConfig(**settings)
    runner.init_cache(WorkerInit(block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
                                 num_cpu_blocks=cfg.num_cpu_blocks, max_model_len=cfg.max_model_len, seed=0))
    sched = Scheduler(cfg, lora_adapters=lora_adapters)
    names = list(lora_names) if lora_names is not None else [""] * len(prompts)
    for i, (prompt, params, name) in enumerate(zip(prompts, sampling, names)):
        for refusal in sched.add_request(AddRequest(f"r{i}", prompt, params, lora_name=name)):
            raise RuntimeError(f"{refusal.request_id}: {refusal.error}")
    streams: dict = {}
    while sched.has_unfinished():
        out = sched.schedule()
        lora_step = sched.take_lora_step()  # the adapters this step loads into the runner's slots
        if lora_step is not None:
            runner.apply_lora_step(lora_step)
        for delta in sched.update_from_output(out, runner.execute(out)):
            if delta.error is not None:
                raise RuntimeError(f"{delta.request_id}: {delta.error}")
            streams.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    return streams, sched


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.tools.in_process_engine",
                                description="Greedy (or sampled) text from a model directory, scheduler and "
                                            "model runner in this one process.")
    p.add_argument("model", help="a model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", action="append", help="a prompt; repeat for a batch (default: 'Hello')")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    ns = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    texts = ns.prompt or ["Hello"]
    prompts = [tokenizer.encode(text) for text in texts]
    sampling = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=0)
    longest = max(len(prompt) for prompt in prompts) + ns.max_tokens
    streams, _ = generate(ns.model, prompts, [sampling] * len(prompts), max_model_len=max(512, longest),
                          num_gpu_blocks=max(256, len(prompts) * (longest // 4 + 1)))
    for i, text in enumerate(texts):
        print(f"{text!r} -> {tokenizer.decode(streams.get((f'r{i}', 0), []))!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
