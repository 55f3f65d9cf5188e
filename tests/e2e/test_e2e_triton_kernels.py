"""The worker's Triton kernels, run by Triton's CPU interpreter, serve transformers' tokens."""

from __future__ import annotations

import openai
import pytest

from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server

pytestmark = pytest.mark.slow


def test_greedy_tokens_through_the_server_with_interpreted_triton_kernels(model_factory, tmp_path):
    model = model_factory("llama")
    env = {"PAGEDSERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    srv = Server(model, ["--num-gpu-blocks", "24", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                         "--poison-kv-cache"],
                 env=env).start(tmp_path)
    try:
        tok = hf_tokenizer(model)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        name = c.models.list().data[0].id
        # 21 prompt tokens under a 16-token budget: a chunked prefill, then decodes
        ids = tok("Hello, world! The quick brown fox jumps over the lazy dog. Émile").input_ids
        text = c.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
        assert text == tok.decode(hf_greedy(model, ids, 6), skip_special_tokens=True)
        assert "triton" in srv.log().lower()
    finally:
        srv.stop()
