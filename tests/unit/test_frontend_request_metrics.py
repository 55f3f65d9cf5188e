"""/metrics after known requests, over the real app in process with a scripted engine (no replica):
every sequence counts once, as vLLM v1 counts its child requests, in request_success (under
pagedserve's and vLLM's name and label), TTFT and e2e latency; each decode gap is one inter-token
observation; an embedding input counts as a request of its own."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagedserve.client.pooling import PoolerSettings
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.app import build_app
from pagedserve.frontend_proc.embeddings_api import EmbeddingServing
from pagedserve.frontend_proc.engine_client import RequestHandle
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving
from pagedserve.protocol.messages import AddRequest, RequestDelta

TOKENS_PER_CHOICE = 3  # one delta each: 1 TTFT, then 2 gaps
HIDDEN = 64


class ScriptedEngine:
    """Answers each request at once: every choice its tokens one delta at a time, ending on
    max_tokens; an embedding request its vector."""

    max_waiting_requests = None

    def submit(self, add: AddRequest) -> RequestHandle:
        handle = RequestHandle(add.request_id, 0, add.sampling.n)
        if add.pooling is not None:
            handle.push(RequestDelta(add.request_id, 0, [], "stop", num_prompt_tokens=len(add.prompt_token_ids),
                                     embedding=np.ones(HIDDEN, "<f4").tobytes()))
            return handle
        for index in range(add.sampling.n):
            for i in range(TOKENS_PER_CHOICE):
                last = i == TOKENS_PER_CHOICE - 1
                handle.push(RequestDelta(add.request_id, index, [100 + i], "length" if last else None,
                                         num_prompt_tokens=len(add.prompt_token_ids)))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        pass


def _scrape(model_dir: str, task: str, requests: list[tuple[str, dict]]) -> str:
    async def run():
        router = Router(1, timeout_s=60.0)
        metrics = FrontendMetrics(router, "m")
        engine, tokenizer = ScriptedEngine(), PromptTokenizer(Path(model_dir))
        serving = Serving(["m"], 1024, engine, tokenizer, metrics)
        embeddings = (EmbeddingServing(task, Path(model_dir), ["m"], ["m"], 1024, engine, tokenizer,
                                       PoolerSettings(), metrics) if task == "embed" else None)
        app = build_app(serving, router, metrics, None, embeddings)
        app.user_middleware.clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            for path, body in requests:
                answer = await client.post(path, json={"model": "m", **body})
                assert answer.status_code == 200, answer.text
            return (await client.get("/metrics")).text

    return asyncio.run(run())


def _sample(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert found, f"{series} missing from /metrics"
    return float(found.group(1))


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("qwen2")


def test_every_sequence_counts_once_in_success_ttft_and_e2e_under_both_names(model_dir):
    text = _scrape(model_dir, "generate", [
        ("/v1/completions", {"prompt": "hi", "max_tokens": TOKENS_PER_CHOICE, "n": 3}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": TOKENS_PER_CHOICE})])
    sequences = 3 + 1
    assert _sample(text, 'vllm:request_success_total{finished_reason="length",model_name="m"}') == sequences
    assert _sample(text, 'pagedserve_request_success_total{finish_reason="length",model_name="m"}') == sequences
    for prefix in ("vllm:", "pagedserve_"):
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                          "request_time_per_output_token_seconds"):
            assert _sample(text, f'{prefix}{histogram}_count{{model_name="m"}}') == sequences, histogram


def test_each_decode_gap_is_one_inter_token_observation(model_dir):
    text = _scrape(model_dir, "generate", [
        ("/v1/completions", {"prompt": "hi", "max_tokens": TOKENS_PER_CHOICE, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": TOKENS_PER_CHOICE})])
    gaps = 3 * (TOKENS_PER_CHOICE - 1)  # three sequences, each a delta per token
    for prefix in ("vllm:", "pagedserve_"):
        for histogram in ("time_per_output_token_seconds", "inter_token_latency_seconds"):
            assert _sample(text, f'{prefix}{histogram}_count{{model_name="m"}}') == gaps, histogram


def test_each_embedding_input_counts_as_a_finished_request(model_dir):
    text = _scrape(model_dir, "embed", [("/v1/embeddings", {"input": ["a", "b"]}),
                                        ("/v1/embeddings", {"input": "c"})])
    assert _sample(text, 'vllm:request_success_total{finished_reason="stop",model_name="m"}') == 3
    assert _sample(text, 'pagedserve_request_success_total{finish_reason="stop",model_name="m"}') == 3
    assert _sample(text, 'vllm:e2e_request_latency_seconds_count{model_name="m"}') == 3
    assert _sample(text, 'vllm:time_to_first_token_seconds_count{model_name="m"}') == 0  # no token generated
