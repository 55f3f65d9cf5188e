"""Structured output through real processes: the random model's output is noise, yet every
constrained answer follows its grammar, under preemption, with n = 3, streamed, over both
endpoints and the offline API; a grammar that cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import psutil

from support.fault_helpers import pid_of
from support.server import Server, wait_until
from support.structured_schemas import CHOICES, REGEX, SCHEMAS, check_choice, check_json, check_regex

pytestmark = pytest.mark.slow
MAX_TOKENS = 300  # far above what any bounded answer needs: every one ends with "stop"


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    # A tight cache: a dozen concurrent answers of ~80 tokens need more than 32 blocks of 8.
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "32", "--block-size", "8", "--max-model-len", "384",
                                          "--preemption-mode", "swap", "--max-num-seqs", "8"])
    srv.start(tmp_path_factory.mktemp("srv-structured"))
    yield srv
    srv.stop()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"max_tokens": MAX_TOKENS, "temperature": 1.0, **body}, timeout=300)


def chat(server: Server, body: dict) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Answer in JSON."}], **body})


def stream_texts(server: Server, path: str, body: dict) -> tuple[dict[int, str], dict[int, str]]:
    """The streamed choices' concatenated texts and finish reasons."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", server.url + path, timeout=300,
                      json={"max_tokens": MAX_TOKENS, "temperature": 1.0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
                if choice.get("finish_reason"):
                    finish[choice["index"]] = choice["finish_reason"]
    return texts, finish


def test_every_constrained_answer_follows_its_grammar_under_preemption(server):
    schema_format = {name: {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
                     for name, schema in SCHEMAS.items()}
    # Three 200-token answers in one request (a prompt list) reach the scheduler together and
    # are admitted in one step; any two of them need over 50 of the 32 blocks, so preemption
    # comes however fast the worker is (three separate requests could be admitted ~150
    # steps apart and run one after another). Submitted first, they are likely the oldest,
    # and the constrained requests after them the ones preempted.
    plain = {"prompt": ["noise", "noise", "noise"], "max_tokens": 200, "ignore_eos": True}
    jobs = {
        "plain": lambda: post(server, "/v1/completions", plain),
        **{f"chat-{name}": (lambda fmt=fmt: chat(server, {"response_format": fmt, "seed": 3}))
           for name, fmt in schema_format.items()},
        "chat-n3": lambda: chat(server, {"response_format": schema_format["person"], "n": 3}),
        "completion-guided_json": lambda: post(server, "/v1/completions",
                                               {"prompt": "data:", "guided_json": SCHEMAS["points"]}),
        "completion-structured_outputs": lambda: post(server, "/v1/completions",
                                                      {"prompt": "code:", "structured_outputs": {"regex": REGEX}}),
        "chat-guided_regex": lambda: chat(server, {"guided_regex": REGEX, "n": 2}),
        "completion-guided_choice": lambda: post(server, "/v1/completions",
                                                 {"prompt": "colour:", "guided_choice": CHOICES, "n": 3}),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        answers = {name: f.result() for name, f in futures.items()}
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
        for choice in r.json()["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            if name.startswith("plain"):
                assert choice["finish_reason"] == "length"
                continue
            assert choice["finish_reason"] == "stop", (name, text)
            if name.startswith("chat-") and name[5:] in SCHEMAS:
                check_json(text, name[5:])
            elif name == "chat-n3":
                check_json(text, "person")
            elif name == "completion-guided_json":
                check_json(text, "points")
            elif "regex" in name or name == "completion-structured_outputs":
                check_regex(text)
            else:
                check_choice(text)
    assert len(answers["chat-n3"].json()["choices"]) == 3
    def metrics() -> str:
        return httpx.get(server.url + "/metrics", timeout=30).text

    # the schedulers' stats arrive with their next heartbeat
    counted = re.compile(r"^pagedserve_structured_output_requests_total(\{[^}]*\})? 8\.0$", re.M)
    assert wait_until(lambda: counted.search(metrics()), 10), metrics()
    assert "pagedserve_structured_output_mask_seconds_total" in metrics()

    def preemptions() -> float:
        return next(float(line.split()[-1]) for line in metrics().splitlines()
                    if line.startswith("pagedserve_num_preemptions_total"))

    # Polled: the last heartbeat before the answers ended may predate the preemption.
    assert wait_until(lambda: preemptions() > 0, 10), "the cache was meant to be too small for every answer at once"


def test_streamed_constrained_answers_concatenate_to_valid_output(server):
    texts, finish = stream_texts(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "JSON please"}], "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS["reading"]}}})
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    for text in texts.values():
        check_json(text, "reading")
    texts, finish = stream_texts(server, "/v1/completions", {"prompt": "pick", "guided_choice": CHOICES})
    check_choice(texts[0])


def test_json_object_answers_are_json_objects(server):
    r = chat(server, {"response_format": {"type": "json_object"}, "temperature": 0.0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # any object may be long: only a finished one is whole
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "integer"}, "guided_choice": ["a"]}, "guided_choice"),
    # keywords the grammar engine would compile as if absent: refused, not broken by a "stop" answer
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 5}}}}},
     "guided_json"),
    ({"guided_json": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, "guided_json"),
    ({"guided_json": {"type": "string", "pattern": "^(?!a)"}}, "guided_json"),
    # what response_format does not define is refused, not ignored
    ({"response_format": {"type": "json_object", "schema": {"type": "integer"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"},
                                                                   "foo": 1}}}, "response_format"),
])
def test_a_grammar_that_cannot_compile_or_be_enforced_is_a_400_naming_the_field(server, body, param):
    r = chat(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_a_grammar_that_asks_for_a_surrogate_ends_with_a_400_not_an_engine_error(server):
    """xgrammar takes the bytes of a surrogate code point (written as an escape in the grammar's
    text, which the frontend's parse accepts); no UTF-8 text holds one, so the guard leaves no
    token (utf8_guard.py): the request's fault, said as such, and the replica keeps serving."""
    r = chat(server, {"guided_grammar": 'root ::= "\\ud83d\\ude42"', "temperature": 0.0})
    assert r.status_code == 400 and "no valid UTF-8" in r.json()["error"]["message"], r.text
    assert chat(server, {"guided_choice": ["yes", "no"]}).status_code == 200


def test_a_property_named_like_a_keyword_is_a_property(server):
    r = chat(server, {"guided_json": {"type": "object", "properties": {"not": {"type": "integer"}},
                                      "required": ["not"], "additionalProperties": False}, "temperature": 0.0})
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["not"], int)


def test_logprobs_of_tokens_a_grammar_masks_are_numbers(server):
    """Masked tokens have logprob -inf (of the masked distribution): JSON carries vLLM's -9999.0
    instead (a 500 before, from json.dumps; null in a stream, against OpenAI's schema)."""
    body = {"guided_choice": ["yes", "no"], "logprobs": True, "top_logprobs": 3, "temperature": 0.0}
    r = chat(server, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    values = [e["logprob"] for e in content] + [a["logprob"] for e in content for a in e["top_logprobs"]]
    assert values and all(isinstance(v, float) and -9999.0 <= v <= 0.0 for v in values)
    assert -9999.0 in values  # a choice of two leaves a third alternative masked
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300,
                      json={"messages": [{"role": "user", "content": "pick"}], "stream": True, **body}) as s:
        lines = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [a["logprob"] for chunk in lines for c in chunk["choices"] if c.get("logprobs")
                for e in c["logprobs"]["content"] for a in [e, *e["top_logprobs"]]]
    assert streamed and all(isinstance(v, float) for v in streamed)


def test_offline_constrained_generation_under_recompute_preemption(model_factory):
    from pagedserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model_factory("qwen2"), num_gpu_blocks=40, block_size=8, max_num_seqs=6,
              preemption_mode="recompute", max_model_len=384)
    try:
        params = [SamplingParams(max_tokens=MAX_TOKENS, seed=i, structured_outputs=spec) for i, spec in enumerate([
            StructuredOutputsParams(json=SCHEMAS["person"]), {"json": json.dumps(SCHEMAS["points"])},
            StructuredOutputsParams(regex=REGEX), {"choice": CHOICES}, StructuredOutputsParams(json=SCHEMAS["reading"]),
        ])] + [SamplingParams(max_tokens=MAX_TOKENS, n=3, structured_outputs={"json": SCHEMAS["person"]})]
        outputs = llm.generate(["a b c d e f g"] * len(params), params, use_tqdm=False)
        checks = [lambda t: check_json(t, "person"), lambda t: check_json(t, "points"), check_regex, check_choice,
                  lambda t: check_json(t, "reading"), lambda t: check_json(t, "person")]
        for output, check in zip(outputs, checks):
            for sample in output.outputs:
                assert sample.finish_reason == "stop", sample
                check(sample.text)
        assert len(outputs[-1].outputs) == 3
        with pytest.raises(ValueError, match="regex"):
            SamplingParams(structured_outputs={"regex": "([a-z"})
    finally:
        llm.close()


def test_a_schema_that_takes_seconds_to_check_holds_up_no_other_request(server):
    """Converting 400 nested arrays takes xgrammar seconds (300 took about a second on an idle Zen 5,
    and finished before the plain request); the frontend does it in a thread, so a plain request
    sent after it is answered first, and nobody gets a 503 (the replicas' heartbeats are still read)."""
    deep: dict = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    done: list[str] = []
    frontend = psutil.Process(pid_of(server, "frontend"))
    cpu_before = sum(frontend.cpu_times()[:2])

    def send(name: str, path: str, body: dict) -> httpx.Response:
        response = post(server, path, body)
        done.append(name)
        return response

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(send, "deep", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}})
        # the frontend is converting it once its CPU time has grown by a second
        assert wait_until(lambda: sum(frontend.cpu_times()[:2]) > cpu_before + 1.0, timeout_s=60)
        plain = pool.submit(send, "plain", "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert plain.result().status_code == 200
        assert slow.result().status_code == 200, slow.result().text
    assert done == ["plain", "deep"]
