"""A real Scheduler driving a real ModelRunner in one process (no sockets): every token the
engine would stream, for tests of what the two halves of a step contract do together."""

from __future__ import annotations

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

    LoRA: ``lora_adapters`` are registered (as LoadLoRA does) before the requests, and
    ``lora_names[i]`` names request i's adapter ("" the base model); passing either turns
    ``enable_lora`` on. Each step's LoRAStep reaches the runner before the step, as the engine
    loop sends it. ``runner_options``: keyword arguments of the ModelRunner (its LoRA limits)."""
    settings = dict(block_size=4, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=128,
                    max_model_len=512, debug_invariants=True, speculative=speculative,
                    enable_lora=bool(lora_adapters or lora_names))
    settings.update(config)
    cfg = SchedulerConfig(**settings)
    runner = ModelRunner(model_dir, speculative=speculative, **(runner_options or {}))
    runner.init_cache(WorkerInit(block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
                                 num_cpu_blocks=cfg.num_cpu_blocks, max_model_len=cfg.max_model_len, seed=0))
    sched = Scheduler(cfg, lora_adapters=lora_adapters)
    names = list(lora_names) if lora_names is not None else [""] * len(prompts)
    for i, (prompt, params, name) in enumerate(zip(prompts, sampling, names)):
        assert sched.add_request(AddRequest(f"r{i}", prompt, params, lora_name=name)) == []
    streams: dict = {}
    while sched.has_unfinished():
        out = sched.schedule()
        lora_step = sched.take_lora_step()
        if lora_step is not None:
            runner.apply_lora_step(lora_step)
        for delta in sched.update_from_output(out, runner.execute(out)):
            assert delta.error is None, delta.error
            streams.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    return streams, sched
