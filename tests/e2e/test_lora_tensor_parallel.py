"""Two CPU processes (gloo) each hold half of the model and of every LoRA adapter: column-parallel
projections B's rows, row-parallel ones A's columns (their delta summed by the all-reduce); rank 0's
greedy tokens for a batch mixing adapters and the base model equal transformers + peft's."""

from __future__ import annotations

import json

import pytest

from pagedserve.tools.demo_model import build_model_dir
from support.lora import ALL_TARGETS, make_adapter, peft_greedy
from support.worker_harness import random_prompts, run_two_ranks

NEW_TOKENS = 8

# Runs in each rank's process. Arguments: tests dir, rank, port, prompts (JSON), slots (JSON), model dir, adapters...
RANK_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models.lora_linear import LoRAConfig
from support.lora import adapter_message
from support.worker_harness import TrivialScheduler

tests_dir, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prompts, slots, model_dir, adapters = json.loads(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6], sys.argv[7:]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

def share_tokens(result, expected_req_ids):
    tokens = torch.tensor(result.sampled_token_ids if rank == 0 else [0] * len(expected_req_ids))
    dist.broadcast(tokens, src=0)
    return tokens.tolist()

runner = ModelRunner(model_dir, tp_rank=rank, tp_size=2, lora=LoRAConfig(max_loras=len(adapters), max_rank=8))
scheduler = TrivialScheduler(runner, share_tokens=share_tokens)
for slot, path in enumerate(adapters):
    scheduler.load_lora(slot, adapter_message(f"a{slot}", path, slot + 1))
for i, (prompt, slot) in enumerate(zip(prompts, slots)):
    scheduler.add(f"r{i}", prompt, NEW_TOKENS, lora_slot=slot, arrival_step=i % 2, prefill_chunks=[5] if i == 1 else None)
result = scheduler.run()
print(json.dumps([result[f"r{i}"] for i in range(len(prompts))]), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # torch + gloo may abort in static destructors at exit
""".replace("NEW_TOKENS", str(NEW_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("phi3", 1)])
def test_two_tensor_parallel_ranks_with_adapters_produce_peft_greedy_tokens(tmp_path, arch, kv_heads):
    model_dir = build_model_dir(tmp_path / "model", arch, num_heads=4, num_kv_heads=kv_heads, seed=4)
    targets = [("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("qkv_proj", "down_proj")] if arch == "phi3" \
        else [ALL_TARGETS, ("v_proj", "o_proj", "up_proj")]
    adapters = [make_adapter(model_dir, tmp_path / f"a{i}", r=8 - 4 * i, alpha=16, targets=t, seed=i)
                for i, t in enumerate(targets)]
    prompts = random_prompts([7, 13, 4], vocab_size=512, seed=9)
    slots = [0, 1, -1]
    rank0 = run_two_ranks(RANK_SCRIPT, tmp_path, [json.dumps(prompts), json.dumps(slots), str(model_dir), *adapters])
    for prompt, slot, ours in zip(prompts, slots, rank0):
        assert ours == peft_greedy(model_dir, adapters[slot] if slot >= 0 else None, [prompt], NEW_TOKENS)[0]
