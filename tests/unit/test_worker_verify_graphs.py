"""Verification steps through VerifyGraphs' static, padded buffers: the same hidden states and KV
writes as the step run directly, with padding that reads NaN and writes nothing.

On CPU the buffer path runs eagerly (capture=False) through the attention the graphs would capture;
with PAGEDSERVE_TEST_DEVICE=cuda (tests/support/kernel_device.py) the graphs are captured and replayed.
"""

from support.kernel_device import DEVICE, MARKS  # first: it decides TRITON_INTERPRET

import torch

from pagedserve.protocol.messages import SamplingParams, WorkerInit
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.input_batch import build_forward_batch
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.verify_graphs import VerifyGraphs

pytestmark = MARKS
CAPTURE = DEVICE.type == "cuda"
BLOCK = 4
SPAN = 5  # k = 4 proposals and the decoded token
USED_BLOCKS = range(5, 14)  # the only blocks the real requests below own


def runner_with_cache(tmp_path) -> ModelRunner:
    runner = ModelRunner(str(build_model_dir(tmp_path / "m", "qwen2", num_layers=2)), device=str(DEVICE),
                         cuda_graphs=False)  # the tests build their own graphs
    runner.init_cache(WorkerInit(block_size=BLOCK, num_gpu_blocks=40, num_cpu_blocks=0, max_model_len=64, seed=0))
    cache = torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0))
    unused = torch.ones(cache.shape[2], dtype=torch.bool)  # [layer, k|v, block, slot, head, dim]
    unused[list(USED_BLOCKS)] = False
    cache[:, :, unused] = float("nan")  # what padding may read: never what a real row sees
    runner.kv_cache.copy_(cache)
    return runner


def verify_step(specs: list[tuple[int, int, list[int]]]):
    """One request per (context tokens, tokens this step, block table)."""
    requests = [HeldRequest(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(context + count)], 1, blocks, context,
                            count, SamplingParams(max_tokens=8)) for i, (context, count, blocks) in enumerate(specs)]
    return build_forward_batch(requests, BLOCK, DEVICE, batched_decodes=False)


MIXED = [(9, 5, [5, 6, 7, 8]), (3, 1, [9]), (6, 3, [10, 11, 12])]  # 9 tokens: a graph of 4 requests, 20 tokens


def graphs_for(runner: ModelRunner) -> VerifyGraphs:
    graphs = VerifyGraphs(runner.model, runner.kv_cache, runner.ops, BLOCK, max_model_len=64,
                          tokens_per_request=SPAN, max_batch=8, capture=CAPTURE)
    graphs.capture()
    return graphs


def test_a_padded_verification_step_matches_the_step_run_directly(tmp_path):
    runner = runner_with_cache(tmp_path)
    before = runner.kv_cache.clone()
    graphs = graphs_for(runner)
    batch = verify_step(MIXED)
    assert graphs.size_for(batch) == 4
    with torch.inference_mode():
        hidden = graphs.forward(batch, 4).clone()
        through_graph = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        direct = runner.model.forward(batch, runner.kv_cache, runner.ops)

    assert hidden.shape == direct.shape == (9, hidden.shape[1])
    assert torch.isfinite(hidden).all()  # padding read NaN blocks; no real row saw them
    torch.testing.assert_close(hidden, direct, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(through_graph, runner.kv_cache, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert graphs.replays == {4: 1}


def test_padding_writes_no_kv_where_a_longer_step_left_its_slots(tmp_path):
    runner = runner_with_cache(tmp_path)
    graphs = graphs_for(runner)
    with torch.inference_mode():
        graphs.forward(verify_step(MIXED), 4)  # slots 0-8 of 20 real
        before = runner.kv_cache.clone()
        graphs.forward(verify_step([(2, 5, [9, 10])]), 2)  # 5 real tokens of 10: slots 5-9 were real above

    changed = (torch.nan_to_num(runner.kv_cache, nan=7.0) != torch.nan_to_num(before, nan=7.0))
    slots = changed.any(dim=(0, 1, 4, 5)).nonzero().tolist()  # [block, slot]
    assert slots == [[9, 2], [9, 3], [10, 0], [10, 1], [10, 2]]  # positions 2-6 of the one request


def test_which_steps_a_verification_graph_takes(tmp_path):
    runner = runner_with_cache(tmp_path)
    graphs = VerifyGraphs(runner.model, runner.kv_cache, runner.ops, BLOCK, max_model_len=64,
                          tokens_per_request=SPAN, max_batch=8, capture=False)
    assert graphs.sizes == [2, 4, 8]  # at least one padding request; 8 x 5 tokens within 64
    assert graphs.size_for(verify_step([(3, 5, [5, 6])])) == 2
    assert graphs.size_for(verify_step([(3, 2, [5, 6])] * 4)) == 8  # 4 requests need a fifth for padding
    assert graphs.size_for(verify_step([(3, 1, [5])] * 3)) is None  # one token each: the decode graphs'
    assert graphs.size_for(verify_step([(3, 6, [5, 6, 7])])) is None  # more than k + 1 tokens: a prefill
    assert graphs.size_for(verify_step([(3, 2, [5, 6])] * 8)) is None  # more requests than the largest graph
    assert VerifyGraphs(runner.model, runner.kv_cache, runner.ops, BLOCK, max_model_len=16, tokens_per_request=SPAN,
                        capture=False).sizes == [2]


def test_the_runner_replays_a_verification_step_from_its_graph(tmp_path):
    runner = runner_with_cache(tmp_path)
    runner.verify_graphs = graphs_for(runner)
    with torch.inference_mode():
        hidden = runner._forward(verify_step(MIXED), runner.kv_cache)
    assert hidden.shape[0] == 9 and runner.verify_graphs.replays == {4: 1}
