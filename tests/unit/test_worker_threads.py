"""The CPU worker's default thread count: every core for a compute-bound model, one left
to the scheduler and frontend otherwise (measured; docs/DECISIONS.md)."""

from __future__ import annotations

import os

from pagedserve.worker_proc.model_config import load_model_spec
from pagedserve.worker_proc.worker import ALL_CORES_MIN_LAYER_PARAMS, WorkerConfig, _default_cpu_threads


def test_a_compute_bound_model_gets_every_core_and_a_small_one_leaves_one_free(model_factory):
    cores = len(os.sched_getaffinity(0))
    cfg = WorkerConfig(run_dir="unused", model="unused")
    small = load_model_spec(model_factory("qwen2")).num_layer_params
    assert small < ALL_CORES_MIN_LAYER_PARAMS
    assert _default_cpu_threads(cfg, small) == max(1, cores - 1)
    assert _default_cpu_threads(cfg, ALL_CORES_MIN_LAYER_PARAMS) == cores
    two_ranks = WorkerConfig(run_dir="unused", model="unused", tensor_parallel_size=2)
    assert _default_cpu_threads(two_ranks, ALL_CORES_MIN_LAYER_PARAMS) == max(1, cores // 2)
    assert _default_cpu_threads(WorkerConfig(run_dir="u", model="u", device="cuda"), small) is None


def test_the_layer_weight_count_matches_the_model_s_own_parameters(model_factory):
    import torch
    import transformers

    model_dir = model_factory("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    matrices = sum(p.numel() for name, p in hf.model.layers.named_parameters()
                   if p.dim() == 2)  # the projections: norms and biases are not matmul weights
    assert load_model_spec(model_dir).num_layer_params == matrices
