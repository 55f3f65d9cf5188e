"""prompt_logprobs offline: every prompt position's logprobs equal log_softmax of transformers'
logits on the same weights, across chunked prefill, with the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from support.oracle import hf_model


def hf_prompt_log_softmax(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row i is the distribution transformers gives at position i."""
    model = hf_model(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.slow
def test_offline_prompt_logprobs_equal_transformers_log_softmax_across_chunks(model_factory):
    from pagedserve.offline.llm import LLM, SamplingParams as OfflineParams

    model = model_factory("qwen2")
    long_prompt = [(7 * i + 3) % 500 + 3 for i in range(45)]  # 3 chunks of at most 16 tokens
    short_prompt = long_prompt[:20]  # shares a prefix the cache holds once the long one ran
    k = 3
    with LLM(model, num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=4,
             enable_prefix_caching=True) as llm:
        plain = llm.generate([long_prompt], OfflineParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
        outs = llm.generate([long_prompt, short_prompt, [9]],
                            [OfflineParams(max_tokens=3, temperature=0.0, prompt_logprobs=k),
                             OfflineParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, n=2),
                             OfflineParams(max_tokens=1, prompt_logprobs=2)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert outs[0].token_ids == plain.token_ids  # asking for them changes no output
    for out, prompt, alternatives in ((outs[0], long_prompt, k), (outs[1], short_prompt, 0)):
        expected = hf_prompt_log_softmax(model, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = expected[i - 1]
            token = prompt[i]
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4), f"position {i}"
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            best = row.topk(alternatives).indices.tolist()
            assert set(entry) == set(best) | {token}
            for rank, alt in enumerate(best, start=1):
                assert entry[alt].logprob == pytest.approx(float(row[alt]), abs=1e-4)
                assert entry[alt].rank == rank
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt has nothing to score
