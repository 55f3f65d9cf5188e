"""The worker process's loop: receive a SchedulerOutput, run it, answer with a StepResult.

The worker owns the model and the KV cache of one device (one tensor-parallel rank). It
never decides anything: it applies exactly what the scheduler sent, in order.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender

log = logging.getLogger("pagedserve.worker")


@dataclass(slots=True)
class WorkerConfig:
    run_dir: str
    model: str
    replica: int = 0
    rank: int = 0
    tp_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_threads: Optional[int] = None  # CPU: torch intra-op threads
    dist_init: Optional[str] = None  # torch.distributed init method for tp_size > 1
    kv_cache_memory_gib: Optional[float] = None
    poison_kv_cache: bool = False  # debug: fill the cache with NaN at start (stale contents)


def _init_distributed(cfg: WorkerConfig):
    if cfg.tp_size == 1:
        return None
    import torch.distributed as dist

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=cfg.dist_init, rank=cfg.rank, world_size=cfg.tp_size)
    return dist.group.WORLD


def _device_for_rank(cfg: WorkerConfig) -> str:
    if cfg.device == "cuda":
        return f"cuda:{cfg.rank}" if "CUDA_VISIBLE_DEVICES" not in os.environ else "cuda:0"
    return cfg.device


class Worker:
    def __init__(self, cfg: WorkerConfig, ctx: Optional[zmq.Context] = None):
        from pagedserve.worker_proc.model_runner import ModelRunner

        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        ep = Endpoints(cfg.run_dir)
        self.inputs: Receiver = Receiver(self.ctx, ep.worker_inputs(cfg.replica, cfg.rank),
                                         m.SchedulerToWorker, bind=False)
        self.results = Sender(self.ctx, ep.worker_results(cfg.replica))
        self.to_supervisor = Sender(self.ctx, ep.supervisor())
        if cfg.num_threads:
            import torch

            torch.set_num_threads(cfg.num_threads)
        group = _init_distributed(cfg)
        self.runner = ModelRunner(cfg.model, device=_device_for_rank(cfg), dtype=cfg.dtype,
                                  tp_rank=cfg.rank, tp_size=cfg.tp_size, tp_group=group)

    def hello(self) -> m.WorkerHello:
        block_size = self.cfg.block_size
        budget = None if self.cfg.kv_cache_memory_gib is None else int(self.cfg.kv_cache_memory_gib * (1 << 30))
        return m.WorkerHello(
            rank=self.cfg.rank, pid=os.getpid(), device=str(self.runner.device),
            model_id=self.runner.model_id, num_layers=self.runner.num_layers,
            block_bytes=self.runner.block_bytes(block_size),
            max_gpu_blocks=self.runner.max_gpu_blocks(block_size, budget))

    def run(self) -> None:
        self.results.send(self.hello())
        sent_at = time.perf_counter()
        while True:
            msg = self.inputs.recv()
            if isinstance(msg, m.Shutdown):
                log.info("shutdown: %s", msg.reason)
                return
            if isinstance(msg, m.WorkerInit):
                self.runner.init_cache(msg)
                if self.cfg.poison_kv_cache:
                    self.runner.poison_cache()
                self.results.send(m.WorkerReady(rank=self.cfg.rank, num_gpu_blocks=msg.num_gpu_blocks,
                                                num_cpu_blocks=msg.num_cpu_blocks))
                self.to_supervisor.send(m.ProcessReady(role="worker", replica=self.cfg.replica,
                                                       rank=self.cfg.rank, pid=os.getpid()))
                sent_at = time.perf_counter()
                continue
            idle = time.perf_counter() - sent_at
            try:
                result = self.runner.execute(msg)
            except Exception as exc:  # reported to the scheduler, which restarts the replica
                log.error("step %d failed:\n%s", msg.step, traceback.format_exc())
                result = m.StepResult(step=msg.step, rank=self.cfg.rank, req_ids=[], sampled_token_ids=[],
                                      error=f"{type(exc).__name__}: {exc}")
            result.idle_time_s = idle
            self.results.send(result)
            sent_at = time.perf_counter()

    def close(self) -> None:
        for s in (self.inputs, self.results, self.to_supervisor):
            s.close()
