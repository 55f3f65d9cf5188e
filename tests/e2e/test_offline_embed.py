"""The offline ``LLM.embed`` as vLLM spells it: ``LLM(model, runner="pooling")`` (or
``task="embed"``) returns one EmbeddingRequestOutput per prompt whose ``outputs.embedding``
equals transformers' last hidden state of the last token, normalised (within 1e-4 in float32),
for a batch with a prompt longer than a step; ``encode`` (vLLM's pooling API) gives the same
vectors as ``PoolingRequestOutput.outputs.data``; ``dimensions`` only where the model declares
it; generate, embed and encode each refused on the other kind of engine."""

from __future__ import annotations

import numpy as np
import pytest

from support.oracle import hf_embedding

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embed_llm(model_factory):
    from pagedserve import LLM

    with LLM(model_factory("qwen2"), runner="pooling", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8,
             num_gpu_blocks=64, seed=0) as engine:
        yield engine


def test_llm_embed_returns_vllm_shaped_outputs_equal_to_transformers(embed_llm, model_factory):
    from pagedserve import EmbeddingRequestOutput

    prompts = ["Hello, my name is", [5, 6, 7], {"prompt_token_ids": list(range(10, 90))}, "x"]
    outputs = embed_llm.embed(prompts, use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * 4
    for output, prompt in zip(outputs, prompts):
        ids = output.prompt_token_ids
        if isinstance(prompt, list):
            assert ids == prompt
        vector = output.outputs.embedding
        assert isinstance(vector, list) and len(vector) == 64 and output.finished
        np.testing.assert_allclose(vector, hf_embedding(model_factory("qwen2"), ids, "last"), atol=1e-4)


def test_encode_is_vllms_pooling_api_with_embeds_vectors_as_outputs_data(embed_llm):
    import torch

    from pagedserve import PoolingRequestOutput

    prompts = ["Hello", [5, 6, 7]]
    encoded = embed_llm.encode(prompts, use_tqdm=False)
    embedded = embed_llm.embed(prompts, use_tqdm=False)
    assert [type(o) for o in encoded] == [PoolingRequestOutput] * 2
    for pooled, embedding in zip(encoded, embedded):
        assert isinstance(pooled.outputs.data, torch.Tensor) and pooled.outputs.data.dtype == torch.float32
        np.testing.assert_allclose(pooled.outputs.data.numpy(), embedding.outputs.embedding, atol=1e-6)
        assert pooled.prompt_token_ids == embedding.prompt_token_ids and pooled.finished


def test_dimensions_on_a_model_that_declares_no_matryoshka_sizes_is_refused_before_anything_runs(embed_llm):
    from pagedserve import PoolingParams

    with pytest.raises(ValueError, match="does not declare Matryoshka"):
        embed_llm.embed(["hi"], PoolingParams(dimensions=16), use_tqdm=False)
    raw = embed_llm.embed(["hi"], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # the pooled state as it is


def test_each_kind_of_engine_refuses_the_other_kinds_call(embed_llm, shared_llm):
    with pytest.raises(ValueError, match="LLM.embed"):
        embed_llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match='task="embed"'):
        shared_llm.embed(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling API.*LLM.generate"):  # not a tokenizer
        shared_llm.encode("hi", use_tqdm=False)


def test_a_sentence_transformers_model_pools_offline_as_it_declares(tmp_path):
    """modules.json's mean pooling without a Normalize module, as served (client/pooling.py)."""
    import json

    from pagedserve import LLM
    from pagedserve.tools.demo_model import build_model_dir

    model_dir = build_model_dir(tmp_path / "st", "qwen2")
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with LLM(str(model_dir), task="embed", max_model_len=128, num_gpu_blocks=32) as llm:
        (output,) = llm.embed([[5, 6, 7, 8]], use_tqdm=False)
    expected = hf_embedding(str(model_dir), [5, 6, 7, 8], "mean", normalize=False)
    np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-4)
