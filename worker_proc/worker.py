"""The worker process's loop: receive a SchedulerOutput, run it, answer with a StepResult.

The worker owns the model and the KV cache of one device (one tensor-parallel rank). It
never decides anything: it applies exactly what the scheduler sent, in order.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
import dataclasses
import json
from pathlib import Path
from typing import Optional

import zmq

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.models.linear import GEMV_MAX_ROWS, GEMV_PANEL_MAX_ROWS
from pagedserve.worker_proc.models.quantized_linear import describe_ops
from pagedserve.protocol import messages as m
from pagedserve.runtime import options as opts
from pagedserve.protocol.speculative import parse_speculative_config
from pagedserve.runtime.torch_env import huge_pages_state
from pagedserve.protocol.worker_link import SchedulerLink
from pagedserve.protocol.zmq_io import Endpoints, Sender
from pagedserve.worker_proc.attention import SOFTCAP_ON_CPU
from pagedserve.worker_proc.env_switch import env_switch
from pagedserve.worker_proc.models.lora_linear import LoRAConfig, path_description

log = logging.getLogger("pagedserve.worker")


class _WorkerConfigRules:
    def __post_init__(self) -> None:
        opts.validate(opts.values_of(self, opts.options_for(opts.WORKER)))
        self.device = opts.resolve_device(self.device)
        if self.dtype == "auto":  # started by hand: serve passes the dtype it resolved
            path = Path(self.model) / "config.json"
            model_config = json.loads(path.read_text()) if path.is_file() else {}
            self.dtype = opts.resolve_dtype(self.dtype, model_config, self.device, self.model)
        else:
            self.dtype = opts.DTYPE_ALIASES[self.dtype]


# The serve options a worker takes (runtime/options.py), plus how the supervisor wires it.
WorkerConfig = opts.make_config("WorkerConfig", [
    ("run_dir", str), ("model", str),
    ("replica", int, dataclasses.field(default=0)),
    ("rank", int, dataclasses.field(default=0)),
    ("dist_init", Optional[str], dataclasses.field(default=None)),  # torch.distributed init for TP > 1
    # debug: a deliberately different sampler (replay tests)
    ("debug_sampling_seed_offset", int, dataclasses.field(default=0)),
    *opts.dataclass_fields(opts.WORKER)], _WorkerConfigRules)


def _init_distributed(cfg: WorkerConfig):
    if cfg.tensor_parallel_size == 1:
        return None
    import torch.distributed as dist

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=cfg.dist_init, rank=cfg.rank, world_size=cfg.tensor_parallel_size)
    return dist.group.WORLD


def _device_for_rank(cfg: WorkerConfig) -> str:
    """Replica r's rank k takes visible GPU r * tp + k, so replicas do not stack on one GPU;
    where fewer are visible (Ray shows each worker only its own), they wrap around."""
    if cfg.device != "cuda":
        return cfg.device
    import torch

    index = cfg.replica * cfg.tensor_parallel_size + cfg.rank
    count = max(torch.cuda.device_count(), 1)
    if index >= count and count > 1:
        log.warning("replica %d rank %d: only %d GPUs are visible; sharing cuda:%d",
                    cfg.replica, cfg.rank, count, index % count)
    return f"cuda:{index % count}"


# Host work (scheduler, frontend: detokenize, SSE, HTTP) costs up to ~0.1 ms of CPU per token.
# A model whose layers hold 10M weights costs >= 20 MFLOP per token, ~0.4 ms on one core:
# from there on the worker's compute dwarfs the host work running beside it, and a second
# core's matmul throughput outweighs the stalls when the host work preempts one of its
# threads. Measured on 2 cores (docs/DECISIONS.md): Qwen2.5-0.5B's shape (358M) generates
# 1.5x faster offline on both cores than on one; the demo model (0.3M) serving 64 streams
# is several times slower on both, since its steps last a few ms and every intra-op thread
# the frontend or scheduler preempts stalls the whole parallel op.
ALL_CORES_MIN_LAYER_PARAMS = 10_000_000
PREPARE_AHEAD_ENV = "PAGEDSERVE_PREPARE_AHEAD"  # 1 or 0; unset: on CUDA only


def _default_cpu_threads(cfg: WorkerConfig, num_layer_params: int) -> Optional[int]:
    """Every core (over the TP size) for a compute-bound model; otherwise one core is left
    to the scheduler and frontend, which run between and during every two steps."""
    if cfg.device != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_layer_params >= ALL_CORES_MIN_LAYER_PARAMS:
        return max(1, cores // cfg.tensor_parallel_size)
    return max(1, (cores - 1) // cfg.tensor_parallel_size)


class StepOrderError(RuntimeError):
    """A SchedulerOutput whose step number does not increase."""


class Worker:
    def __init__(self, cfg: WorkerConfig, ctx: Optional[zmq.Context] = None):
        from pagedserve.worker_proc.model_impl import select_implementation
        from pagedserve.worker_proc.model_runner import ModelRunner

        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        ep = Endpoints(cfg.run_dir)
        # One DEALER both ways, known to the scheduler by a routing id only a worker can mint.
        self.inputs = self.results = SchedulerLink(self.ctx, ep, cfg.replica, cfg.rank)
        self._next = None  # a message received early (ModelRunner.execute peeks at it), taken next
        self.to_supervisor = Sender(self.ctx, ep.supervisor())
        threads = cfg.num_threads or _default_cpu_threads(
            cfg, select_implementation(cfg.model, cfg.model_impl).spec.num_layer_params)
        if threads:
            import torch

            torch.set_num_threads(threads)
        group = _init_distributed(cfg)
        lora = LoRAConfig(cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) if cfg.enable_lora else None
        self.runner = ModelRunner(cfg.model, device=_device_for_rank(cfg), dtype=cfg.dtype,
                                  tp_rank=cfg.rank, tp_size=cfg.tensor_parallel_size, tp_group=group,
                                  cuda_graphs=not cfg.enforce_eager,
                                  speculative=parse_speculative_config(cfg.speculative_config),
                                  quantization=cfg.quantization, model_impl=cfg.model_impl, lora=lora,
                                  kv_cache_dtype=cfg.kv_cache_dtype,
                                  expert_parallel=cfg.enable_expert_parallel)
        log.info("model implementation: %s", self.runner.model_impl)
        if self.runner.lora is not None:
            slots = self.runner.lora
            log.info("LoRA: %d slots of rank %d (%.1f MiB), %d adapters in host memory; deltas: %s", slots.max_loras,
                     slots.max_rank, slots.slot_bytes / 2**20, slots.host.capacity, path_description(self.runner.device))
        # Peek at the next step while this one samples (ModelRunner._prepare_ahead): on CUDA, where the
        # device works meanwhile; a CPU has nothing to overlap (bench/log/2026-11-28.md), but the switch may ask.
        ahead = env_switch(PREPARE_AHEAD_ENV)
        self._peek_next = self.runner.device.type == "cuda" if ahead is None else ahead
        kernels = self.runner.ops.__name__.rsplit(".", 1)[-1]
        if self.runner.device.type == "cpu" and cpu_native.library() is not None:
            kernels += f" + native CPU decode and prompt attention, rotary ({cpu_native.kernel_variant()})"
        panels = self.runner.model.lm_head.panels
        if panels is not None:
            kernels += (f" + native matmuls ({str(panels.dtype).removeprefix('torch.')} weights, float32 sums; AVX2, FMA;"
                        " gate_up with its SiLU gate in one call)")
        elif self.runner.model.lm_head.gemv:
            above = "oneDNN packed" if self.runner.model.lm_head.packed is not None else "F.linear"
            rows = GEMV_PANEL_MAX_ROWS if self.runner.model.lm_head.gemv_panels is not None else GEMV_MAX_ROWS
            kernels += f" + native GEMV matmuls at 1-{rows} rows ({cpu_native.gemv_variant()}), {above} above"
        elif self.runner.model.lm_head.packed is not None:
            kernels += " + oneDNN packed matmuls"
        if self.runner.model.elementwise.name == "fused":
            kernels += " + fused norms, rotary and SiLU gate"
        elif self.runner.model.elementwise.name == "native":
            kernels += " + native residual add and RMSNorm"
        quantized = describe_ops(getattr(self.runner.model, "layers", []))
        if quantized is not None:
            kernels += f"; quantized projections: {quantized}"
        head = getattr(self.runner.model.lm_head, "quantized", None)
        if head is not None:  # the checkpoint's own quantized lm_head (models/causal_lm.py)
            kernels += f"; lm_head quantized: {head.kind}"
        if self.runner.device.type == "cpu":
            kernels += f"; huge pages {huge_pages_state()}"
            if self.runner.spec.attn_logit_softcap is not None and self.runner.ops is reference:
                kernels += f"; {SOFTCAP_ON_CPU}"
        log.info("%s on %s (%s), kernels: %s", self.runner.model_id, self.runner.device, cfg.dtype, kernels)
        draft = self.runner.draft
        if draft is not None:
            log.info("draft model %s (%s, %d layers, %.1fM parameters): up to %d proposals per step", draft.path,
                     draft.spec.architecture, draft.spec.num_layers, draft.num_params / 1e6, draft.k)

    def hello(self) -> m.WorkerHello:
        block_size = self.cfg.block_size
        budget = None if self.cfg.kv_cache_memory_gib is None else int(self.cfg.kv_cache_memory_gib * (1 << 30))
        hello = m.GroupedWorkerHello if self.runner.kv_groups is not None else m.WorkerHello
        return hello(
            rank=self.cfg.rank, pid=os.getpid(), device=str(self.runner.device),
            model_id=self.runner.model_id, num_layers=self.runner.num_layers,
            block_bytes=self.runner.block_bytes(block_size),
            max_gpu_blocks=self.runner.max_gpu_blocks(block_size, budget, self.cfg.gpu_memory_utilization),
            hostname=socket.gethostname(),
            vocab_size=self.runner.spec.vocab_size, dtype=self.cfg.dtype, enforce_eager=bool(self.cfg.enforce_eager),
            layer_windows=[w or 0 for w in self.runner.spec.layer_sliding_windows])

    def run(self) -> None:
        self.results.send(self.hello())
        last_step = 0
        said_ahead = False
        lora_error: Optional[Exception] = None
        sent_at = time.perf_counter()
        while True:
            msg = self._next if self._next is not None else self._receive()
            self._next = None
            if isinstance(msg, m.WorkerInit):
                started = time.perf_counter()
                self.runner.init_cache(msg)
                if self.runner.decode_graphs is not None:
                    verify = self.runner.verify_graphs
                    log.info("CUDA graphs of decode steps of %s requests%s captured in %.1f s",
                             ", ".join(map(str, self.runner.decode_graphs.sizes)),
                             f", of verification steps of up to {verify.span} tokens for up to {verify.sizes[-1] - 1} requests"
                             if verify is not None and verify.sizes else "", time.perf_counter() - started)
                if self.cfg.poison_kv_cache:
                    self.runner.poison_cache()
                self.results.send(m.WorkerReady(rank=self.cfg.rank, num_gpu_blocks=msg.num_gpu_blocks,
                                                num_cpu_blocks=msg.num_cpu_blocks))
                self.to_supervisor.send(m.ProcessReady(role="worker", replica=self.cfg.replica,
                                                       rank=self.cfg.rank, pid=os.getpid()))
                sent_at = time.perf_counter()
                continue
            if isinstance(msg, m.LoRAStep):  # the adapter changes of the step that comes next
                try:
                    self.runner.apply_lora_step(msg)
                except Exception as exc:  # that step answers with it
                    lora_error = exc
                continue
            idle = time.perf_counter() - sent_at
            try:
                if lora_error is not None:
                    raise lora_error
                if msg.step <= last_step:  # a replayed or duplicated frame: never run a step twice
                    raise StepOrderError(f"step {msg.step} arrived after step {last_step}")
                last_step = msg.step
                result = self.runner.execute(msg, peek=self._peek if self._peek_next else None)
                if self.runner.steps_prepared_ahead and not said_ahead:
                    said_ahead = True
                    log.info("steps are prepared ahead: each applied and gathered while the one before samples")
            except Exception as exc:  # reported to the scheduler, which restarts the replica
                log.error("step %d failed:\n%s", msg.step, traceback.format_exc())
                result = m.StepResult(step=msg.step, rank=self.cfg.rank, req_ids=[], sampled_token_ids=[],
                                      error=f"{type(exc).__name__}: {exc}")
            lora_error = None
            result.idle_time_s = idle
            self.results.send(result)
            sent_at = time.perf_counter()

    def _receive(self, timeout_ms: Optional[float] = None):
        msg = self.inputs.recv(timeout_ms=timeout_ms)
        for req in msg.new_requests if isinstance(msg, m.SchedulerOutput) and self.cfg.debug_sampling_seed_offset \
                else ():
            req.sampling.seed = (req.sampling.seed or 0) + self.cfg.debug_sampling_seed_offset
        return msg

    def _peek(self):
        """The next message if it has arrived, kept for the loop to take next."""
        if self._next is None:
            self._next = self._receive(timeout_ms=0)
        return self._next

    def close(self) -> None:
        for s in (self.inputs, self.results, self.to_supervisor):
            s.close()
        if self.runner.lora is not None:
            self.runner.lora.close()
        if self.cfg.tensor_parallel_size > 1:
            _leave_distributed()


def _leave_distributed() -> None:
    """Tear down the TP group locally; no barrier, since the other ranks may be gone already."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # exiting anyway: say so, but do not turn it into a crash
            log.warning("destroy_process_group failed at shutdown: %s", exc)
