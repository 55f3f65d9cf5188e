"""kernels/cpu_moe.c, this CPU's build (a layer's routed experts in one call; the build for each x86-64 level:
tests/e2e/test_kernels_cpu_moe.py): against the torch reference (transformers' experts loop) at decode's and
prefill's row counts, sizes that are not whole panels, gpt-oss's biases and clamped SwiGLU, experts no token
routes to, one expert holding every token, a token routed twice to one expert; the bits whatever the thread
count; expert parallelism's unweighted rows; the refusals."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, moe_reference
from support.moe_kernel_checks import assert_reference, check_native_experts, experts, native, randn, routing
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# (experts, top_k, hidden, intermediate): whole panels; an intermediate size of 2.5 panels and a hidden size
# that ends mid-panel; an odd hidden size (x read in pairs); a longer product (several unrolled steps)
SHAPES = [(8, 2, 64, 48), (16, 4, 62, 40), (6, 3, 33, 20), (8, 2, 1024, 384)]


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 9, 40, 130])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_gives_the_references_outputs(shape, tokens, gpt_oss):
    num_experts, top_k, hidden, size = shape
    check_native_experts(tokens, num_experts, top_k, hidden, size, seed=tokens, gpt_oss=gpt_oss)


def test_an_expert_no_token_routes_to_adds_nothing_even_if_its_weights_are_nan():
    """A path that multiplied every expert and weighted the unrouted ones by 0 would give NaN here."""
    x = randn(12, 64, seed=1)
    gate_up, down, *_ = experts(8, 64, 48, seed=2)
    weights, ids = routing(12, 8, 2, seed=3, unused=(1, 5, 6))
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids)
    gate_up[[1, 5, 6]], down[[1, 5, 6]] = float("nan"), float("nan")
    assert_reference(native(gate_up, down)(x, weights, ids), expected)


@pytest.mark.parametrize("tokens", [1, 40])
def test_one_expert_holding_every_token_gives_the_references_outputs(tokens):
    ids = torch.full((tokens, 1), 3)
    check_native_experts(tokens, 8, 1, 64, 48, ids=ids)
    both = torch.tensor([[3, 5]]).repeat(tokens, 1)  # top 2: every token on the same two experts
    check_native_experts(tokens, 8, 2, 64, 48, seed=1, ids=both)


def test_a_token_routed_twice_to_one_expert_gets_both_weighted_outputs():
    """top-k > 1 with repeated ids: the reference adds the expert's output once per slot, in slot order."""
    ids = torch.tensor([[2, 2], [0, 2], [4, 4], [2, 0]])
    check_native_experts(4, 8, 2, 64, 48, ids=ids)


def test_the_bits_do_not_depend_on_the_thread_count():
    """Each sum is one (expert, block)'s, in one order, and a token's experts are added in ascending order by
    the one thread that owns its columns, whatever the threads (the weights are past the kernel's fork size)."""
    x = randn(37, 256, seed=4)
    gate_up, down, *_ = experts(16, 256, 128, seed=5)
    weights, ids = routing(37, 16, 4, seed=6)
    kernel = native(gate_up, down)
    outs = results_at_thread_counts(lambda: kernel(x, weights, ids))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_expert_parallel_rows_are_each_rows_unweighted_expert_output():
    gate_up, down, *_ = experts(4, 64, 48, seed=7)
    counts = [3, 0, 1, 5]
    rows = randn(9, 64, seed=8)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    expected = moe_reference.fused_moe(rows, gate_up, down, torch.ones(9, 1, dtype=torch.bfloat16), ids)
    assert_reference(native(gate_up, down).rows(rows, counts), expected)


def test_no_tokens_give_no_rows():
    gate_up, down, *_ = experts(8, 64, 48, seed=0)
    weights, ids = routing(0, 8, 2, seed=0)
    assert native(gate_up, down)(randn(0, 64, seed=0), weights, ids).shape == (0, 64)


def test_an_expert_id_out_of_range_is_an_index_error_as_in_the_reference():
    gate_up, down, *_ = experts(8, 64, 48, seed=0)
    x, weights = randn(2, 64, seed=1), torch.full((2, 1), 1.0)
    for bad in (8, -1):
        ids = torch.tensor([[0], [bad]])
        with pytest.raises(IndexError):
            moe_reference.fused_moe(x, gate_up, down, weights, ids)
        with pytest.raises(IndexError):
            native(gate_up, down)(x, weights, ids)


def test_mismatched_weights_and_inputs_are_an_error_not_a_wild_read():
    gate_up, down, *_ = experts(4, 64, 48, seed=0)
    with pytest.raises(ValueError):
        native(gate_up, down[:, :, :40])  # down's inputs are not gate_up's intermediate size
    with pytest.raises(ValueError):
        native(gate_up, down, gate_up_bias=torch.zeros(4, 48, dtype=torch.bfloat16))  # a bias of half the rows
    kernel = native(gate_up, down)
    weights, ids = routing(3, 4, 2, seed=0)
    for x in (randn(3, 32, seed=0), randn(3, 64, seed=0).float()):  # another hidden size; not bfloat16
        with pytest.raises(ValueError):
            kernel(x, weights, ids)
