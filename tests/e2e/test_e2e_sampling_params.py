"""Through real processes: top-k logprobs, penalties and bias over HTTP, against transformers."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from support.oracle import hf_model, hf_tokenizer
from support.server import Server

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def hf_greedy_with_logprobs(model_dir: str, prompt: list[int], repetition_penalty: float = 1.0):
    """transformers' greedy tokens (with the penalty processor) and each step's raw log_softmax."""
    model = hf_model(model_dir)
    ids = list(prompt)
    steps = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            steps.append(torch.log_softmax(logits[0], -1))
            scores = RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([ids]), logits.clone())
            ids.append(int(scores.argmax()))
    return ids[len(prompt):], steps


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body},
                      timeout=120)


def test_completion_top_logprobs_are_transformers_log_softmax(server):
    tok = hf_tokenizer(server.model)
    prompt = tok("The quick brown fox").input_ids
    tokens, steps = hf_greedy_with_logprobs(server.model, prompt)
    r = post(server, "/v1/completions", {"prompt": prompt, "logprobs": 3})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"]) == MAX_TOKENS
    for token, lp, top, reference in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], steps):
        assert lp == pytest.approx(reference[token].item(), abs=1e-4)
        values, ids = reference.topk(3)
        expected = {}
        for i, v in zip(ids.tolist(), values.tolist()):  # texts that collide keep their best
            expected.setdefault(tok.decode([i]), v)
        assert top.keys() == expected.keys()
        assert all(top[k] == pytest.approx(expected[k], abs=1e-4) for k in expected), (top, expected, ids)


def test_chat_top_logprobs_are_transformers_log_softmax(server):
    tok = hf_tokenizer(server.model)
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    tokens, steps = hf_greedy_with_logprobs(server.model, prompt)
    r = post(server, "/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == MAX_TOKENS
    for token, entry, reference in zip(tokens, content, steps):
        assert entry["logprob"] == pytest.approx(reference[token].item(), abs=1e-4)
        values, ids = reference.topk(2)
        assert [a["token"] for a in entry["top_logprobs"]] == [tok.decode([i]) for i in ids.tolist()]
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert all(bytes(a["bytes"]).decode() == a["token"] for a in entry["top_logprobs"])
    streamed = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "logprobs": True, "top_logprobs": 2, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content", [])
    assert streamed == content


def test_echo_with_logprobs_and_prompt_logprobs_score_the_prompt_as_transformers(server):
    tok = hf_tokenizer(server.model)
    prompt = tok("The quick brown fox jumps over").input_ids
    tokens, steps = hf_greedy_with_logprobs(server.model, prompt)
    model = hf_model(server.model)
    with torch.no_grad():
        prompt_rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    r = post(server, "/v1/completions", {"prompt": prompt, "logprobs": 2, "echo": True, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + MAX_TOKENS
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][:len(prompt)] == [tok.decode([t]) for t in prompt]
    expected = [prompt_rows[i - 1][prompt[i]].item() for i in range(1, len(prompt))]
    expected += [reference[token].item() for token, reference in zip(tokens, steps)]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert choice["text"] == tok.decode(prompt) + tok.decode(tokens, skip_special_tokens=True)
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for i, entry in enumerate(scored[1:], start=1):
        row = prompt_rows[i - 1]
        best = int(row.argmax())
        assert set(entry) == {str(prompt[i]), str(best)}
        assert entry[str(prompt[i])]["logprob"] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entry[str(prompt[i])]["rank"] == int((row > row[prompt[i]]).sum()) + 1
        assert entry[str(best)]["rank"] == 1 and entry[str(best)]["decoded_token"] == tok.decode([best])
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0}).json()
    chat_prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert len(chat["prompt_logprobs"]) == len(chat_prompt)  # vLLM's place for chat: the response
    assert [list(e) for e in chat["prompt_logprobs"][1:]] == [[str(t)] for t in chat_prompt[1:]]
    streamed = {"tokens": [], "token_logprobs": []}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "logprobs": 2, "echo": True, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for chunk_choice in json.loads(line[6:])["choices"]:
                    for key in streamed:
                        streamed[key] += (chunk_choice["logprobs"] or {}).get(key, [])
    assert streamed == {key: logprobs[key] for key in streamed}
    plain = post(server, "/v1/completions", {"prompt": prompt, "logprobs": 2})
    # Equal up to rounding: with echo the last layer computes every prompt row (prompt_logprobs), without
    # it only the sampled row, and on AVX-512 the matmul's blocking follows the row count (1 ulp here).
    assert plain.json()["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        logprobs["token_logprobs"][len(prompt):], abs=1e-5)
    assert "prompt_logprobs" not in plain.json()["choices"][0]


# 1.8 first bites on a repeated output token (step 5), 0.3 on the prompt's tokens
@pytest.mark.parametrize("text,penalty", [("The quick brown fox", 1.8), ("aaaa bbbb aaaa", 0.3)])
def test_greedy_with_repetition_penalty_and_bias_follows_transformers(server, text, penalty):
    tok = hf_tokenizer(server.model)
    prompt = tok(text).input_ids
    plain, _ = hf_greedy_with_logprobs(server.model, prompt)
    penalized, _ = hf_greedy_with_logprobs(server.model, prompt, repetition_penalty=penalty)
    assert penalized != plain  # the penalty matters on this prompt
    r = post(server, "/v1/completions", {"prompt": prompt, "repetition_penalty": penalty, "logprobs": 0})
    assert r.json()["choices"][0]["text"] == tok.decode(penalized, skip_special_tokens=True)
    forced = post(server, "/v1/completions", {"prompt": prompt, "logit_bias": {str(plain[0] + 1): 100}})
    assert forced.json()["choices"][0]["text"] == tok.decode([plain[0] + 1] * MAX_TOKENS, skip_special_tokens=True)


def test_min_tokens_holds_back_a_stop_token_as_transformers_min_new_tokens_does(server):
    """vLLM's min_tokens: the stop token greedy picks first is not chosen before 3 outputs (a
    masked logit, transformers' MinNewTokensLengthLogitsProcessor), so the output neither begins
    with it nor stops there; once allowed it stops the output as a stop token does."""
    tok = hf_tokenizer(server.model)
    prompt = tok("The quick brown fox").input_ids
    plain, _ = hf_greedy_with_logprobs(server.model, prompt)
    stop = plain[0]
    model, ids = hf_model(server.model), list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < MAX_TOKENS and (len(ids) == len(prompt) or ids[-1] != stop):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [stop])
            ids.append(int(processor(torch.tensor([ids]), logits).argmax()))
    expected = ids[len(prompt):]
    assert expected[0] != stop
    r = post(server, "/v1/completions", {"prompt": prompt, "min_tokens": 3, "stop_token_ids": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode([t for t in expected if t != stop], skip_special_tokens=True)
    assert r.json()["usage"]["completion_tokens"] == len(expected)
    assert choice["finish_reason"] == ("stop" if expected[-1] == stop else "length")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param
