"""Greedy completions through a real deployment, checked against transformers' own greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy_completions(srv: Server, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, int]]:
    c = client(srv)
    name = c.models.list().data[0].id

    def complete(ids):
        r = c.completions.create(model=name, prompt=ids, max_tokens=max_tokens, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def assert_equal_to_transformers(model: str, prompts: list[list[int]], results, max_tokens: int) -> None:
    tok = hf_tokenizer(model)
    for ids, (text, n) in zip(prompts, results):
        assert n == max_tokens
        assert text == tok.decode(hf_greedy(model, ids, max_tokens), skip_special_tokens=True), ids


def streamed_completion(c: openai.OpenAI, name: str, ids: list[int], priority: int, max_tokens: int,
                        started=None) -> tuple[str, int]:
    """Greedy, ``ignore_eos``, streamed so a test knows when the sequence decodes: ``started`` (an Event) is set
    once 40 characters have come back; (text, completion tokens)."""
    text, usage = "", None
    for chunk in c.completions.create(model=name, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                                      stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True, "priority": priority}):
        if chunk.choices:
            text += chunk.choices[0].text
            if started is not None and len(text) > 40:
                started.set()
        usage = chunk.usage or usage
    return text, usage.completion_tokens
