"""The last layer computed for the sampled rows only (input_batch.OutputRows): the same hidden
states for those rows, and the same keys and values in the cache for every row, as the full layer.

A mixed step holds every kind of row: a prompt's only chunk, a chunk that stops mid-prompt (it
samples nothing, so the last layer attends for none of its rows), a chunk after a cached prefix,
a decode, and a decode verifying proposals (its k + 1 rows all sampled). The cache is NaN in
every block no request owns, so a pruned row that read the wrong block would show it.
"""

from support.kernel_device import DEVICE, MARKS  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import triton_ops
from pagedserve.protocol.messages import SamplingParams, WorkerInit
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.input_batch import build_forward_batch
from pagedserve.worker_proc.model_runner import ModelRunner

pytestmark = MARKS
BLOCK = 4
USED_BLOCKS = range(2, 20)


def runner_for(tmp_path, arch: str, kernels: str, monkeypatch, **config) -> ModelRunner:
    if kernels == "triton":
        monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    runner = ModelRunner(str(build_model_dir(tmp_path / "m", arch, num_layers=2, **config)), device=str(DEVICE),
                         cuda_graphs=False)
    assert (runner.ops is triton_ops) == (kernels == "triton")
    runner.init_cache(WorkerInit(block_size=BLOCK, num_gpu_blocks=24, num_cpu_blocks=0, max_model_len=64, seed=0))
    cache = torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0))
    unused = torch.ones(cache.shape[2], dtype=torch.bool)  # [layer, k|v, block, slot, head, dim]
    unused[list(USED_BLOCKS)] = False
    cache[:, :, unused] = float("nan")
    runner.kv_cache.copy_(cache.to(runner.kv_cache.dtype))
    return runner


def held(name: str, context: int, count: int, blocks: list[int], samples: bool = True, **sampling) -> HeldRequest:
    tokens = [(13 * len(name) + 7 * j) % 500 + 3 for j in range(context + count)]
    return HeldRequest(name, tokens, context + count, blocks, context, count, SamplingParams(max_tokens=8, **sampling),
                       samples=samples)


def mixed_step() -> tuple[list[HeldRequest], dict[str, list[int]]]:
    requests = [
        held("whole", 0, 11, [2, 3, 4]),  # a prompt's only chunk
        held("mid", 4, 6, [5, 6, 7], samples=False),  # a chunk that ends before its prompt does
        held("after prefix", 8, 5, [8, 9, 10, 11]),  # a chunk after cached blocks
        held("decode", 9, 1, [12, 13, 14]),
        held("verify", 6, 1, [15, 16, 17]),  # 1 + 3 proposals: 4 sampled rows
    ]
    return requests, {"verify": [40, 41, 42]}


def forward(runner: ModelRunner, requests, drafts, prune: bool, batched_decodes: bool):
    batch = build_forward_batch(requests, BLOCK, DEVICE, batched_decodes=batched_decodes,
                                workspace=runner._gather_workspace, drafts=drafts, prune_last_layer=prune)
    with torch.inference_mode():
        hidden = runner.model.forward(batch, runner.kv_cache, runner.ops)
    return batch, hidden


@pytest.mark.parametrize("arch,kernels,batched_decodes,config", [
    ("qwen2", "torch", True, {}),  # the CPU's paths: batched decodes, SDPA / native prefill
    ("qwen2", "torch", False, {}),  # the reference kernel
    ("mistral", "torch", True, {"sliding_window": 6}),  # windows shorter than the contexts
    ("qwen2", "triton", False, {}),  # the GPU's kernel (interpreted on a CPU)
])
def test_the_sampled_rows_and_the_cache_equal_the_full_last_layers(tmp_path, monkeypatch, arch, kernels,
                                                                     batched_decodes, config):
    runner = runner_for(tmp_path, arch, kernels, monkeypatch, **config)
    requests, drafts = mixed_step()
    before = runner.kv_cache.clone()
    full_batch, full = forward(runner, requests, drafts, prune=False, batched_decodes=batched_decodes)
    full_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    batch, pruned = forward(runner, requests, drafts, prune=True, batched_decodes=batched_decodes)

    assert full_batch.output_rows is None and batch.output_rows is not None
    assert full.shape[0] == 11 + 6 + 5 + 1 + 4
    assert batch.sample_indices.tolist() == [10, 21, 22, 23, 24, 25, 26]  # "mid" samples nothing
    assert pruned.shape == (7, full.shape[1])
    assert torch.isfinite(pruned).all()
    torch.testing.assert_close(pruned, full[batch.sample_indices], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv_cache, full_cache, rtol=0, atol=0, equal_nan=True)


def test_a_step_that_samples_nothing_still_writes_every_key_and_value(tmp_path, monkeypatch):
    runner = runner_for(tmp_path, "qwen2", "torch", monkeypatch)
    requests = [held("mid", 4, 6, [5, 6, 7], samples=False), held("first", 0, 8, [2, 3], samples=False)]
    before = runner.kv_cache.clone()
    forward(runner, requests, None, prune=False, batched_decodes=True)
    full_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    _, hidden = forward(runner, requests, None, prune=True, batched_decodes=True)
    assert hidden.shape[0] == 0
    assert not torch.equal(full_cache.nan_to_num(), before.nan_to_num())  # the step wrote something
    torch.testing.assert_close(runner.kv_cache, full_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("wants_every_row", [{"prompt_logprobs": 2}, {"pooling": "mean"}])
def test_a_request_that_reads_every_row_keeps_the_whole_last_layer(tmp_path, monkeypatch, wants_every_row):
    requests, drafts = mixed_step()
    if "pooling" in wants_every_row:
        requests[1].pooling = "mean"
    else:
        requests[1] = held("mid", 4, 6, [5, 6, 7], samples=False, prompt_logprobs=2)
    batch = build_forward_batch(requests, BLOCK, DEVICE, batched_decodes=True, drafts=drafts, prune_last_layer=True)
    assert batch.output_rows is None


def test_a_step_whose_every_row_samples_is_not_pruned(tmp_path):
    requests = [held("decode", 9, 1, [12, 13, 14]), held("other", 3, 1, [15])]
    batch = build_forward_batch(requests, BLOCK, DEVICE, batched_decodes=True, prune_last_layer=True)
    assert batch.output_rows is None
