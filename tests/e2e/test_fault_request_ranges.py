"""Every request field, out of range, through a real deployment: a 4xx naming the problem,
never a 500, a crash or a restart. Then OpenAI's own published schema, fuzzed by schemathesis:
no server error. One deployment for the whole module."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from support.fault_helpers import health, pid_of
from support.openai_stream_schema import STREAM_SCHEMA, pin_model, stream_validator, stream_violations
from support.server import Server, served_model

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64
VOCAB = 512  # the demo model's
NAN = math.nan
HUGE = [2**63, 2**70, 10**30]
REPO_ROOT = Path(__file__).resolve().parents[2]
OPENAI_SCHEMA = REPO_ROOT.parent / "shared" / "openai-openapi" / "openai_subset.json"


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
                                          "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
                 ).start(tmp_path_factory.mktemp("ranges"))
    srv.first_scheduler_pid = pid_of(srv, "scheduler")
    yield srv
    srv.stop()


# field -> values that must each be refused (valid neighbours such as seed=-1 or top_k=-1 are not here)
COMMON = {
    "max_tokens": [*HUGE, 0, -1, -(2**63), NAN, "", [], "5", 2.5, True],
    "temperature": [*HUGE, -1, -0.1, NAN, math.inf, "", [], "x"],
    "top_p": [*HUGE, 0, -1, 1.5, NAN, "", [], "x"],
    "top_k": [*HUGE, -2, -(2**63), NAN, "", [], "3"],
    "seed": [*HUGE, -(2**63) - 1, -(2**70), NAN, "", [], "x", 1.5],
    "n": [*HUGE, 0, -1, NAN, "", [], "2", 9],  # 9 > --max-num-seqs
    "stop": ["", [""], 5, [1], {}, NAN],
    "stop_token_ids": [[t] for t in HUGE] + [[-1], [VOCAB], [NAN], [""], "", [[1]], 5],
    "ignore_eos": ["no", 0, NAN, [], ""],
    "min_tokens": [*HUGE, -1, NAN, "", [], "1"],
    "stream": ["yes", 1, NAN, [], ""],
    "stream_options": ["x", {"include_usage": "yes"}, [], NAN],
    "model": [5, [], "", "gpt-4", NAN],
    "presence_penalty": [*HUGE, 2.5, -2.5, NAN, "", "1"],
    "frequency_penalty": [*HUGE, 2.5, -2.5, NAN, ""],
    "repetition_penalty": [*HUGE, 0, -1, 2.5, NAN, ""],
    "min_p": [*HUGE, -0.1, 1.5, NAN, ""],
    "logit_bias": [{"1": 101}, {"1": -101}, {"x": 1}, {"-1": 1}, {str(VOCAB): 1}, {"1": NAN}, {"1": "x"}, [], "x",
                   {"\u00b2": 1}, {"\u2460": 1}, {"\uff15": 1}, {"5": 1, "05": -1}],  # "²", "①", fullwidth "５"; one id twice
    "best_of": [0, -1, 2, "", NAN],
    "prompt_logprobs": [*HUGE, -1, 21, NAN, "", "x"],
}
COMPLETION = {
    **COMMON,
    "prompt": [[t] for t in HUGE] + [[-1], [VOCAB], [NAN], [], "", [[]], [1.5], NAN, 5, [5] * MAX_MODEL_LEN],
    "logprobs": [*HUGE, -1, 21, NAN, "", "x"],
    "echo": ["x", NAN, 1],
    "suffix": ["x", 5],
}
CHAT = {
    **COMMON,
    "messages": [[], "", "hi", NAN, [{"role": "user", "content": 5}], [{"content": "x"}],
                 [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]],
    "max_completion_tokens": [*HUGE, 0, -1, NAN, ""],
    "logprobs": ["x", 2, NAN],
    "top_logprobs": [*HUGE, -1, 21, NAN, ""],
}
CASES = [("/v1/completions", f, v) for f, vs in COMPLETION.items() for v in vs] + \
        [("/v1/chat/completions", f, v) for f, vs in CHAT.items() for v in vs]


@pytest.mark.parametrize("path,field,value", CASES,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{str(v)[:20]}" for p, f, v in CASES])
def test_an_out_of_range_field_is_a_4xx_that_names_it(server, path, field, value):
    base = {"model": served_model(server), "max_tokens": 3}
    base.update({"prompt": "hi"} if path.endswith("/completions") and "chat" not in path
                else {"messages": [{"role": "user", "content": "hi"}]})
    body = json.dumps({**base, field: value})  # NaN travels as the JSON extension NaN
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"]
    if error.get("param") is not None and field not in ("prompt", "messages", "max_completion_tokens"):
        assert error["param"].split(".")[0] == field, error


def test_what_only_the_scheduler_refuses_still_names_its_field(server):
    """n above --max-num-seqs is known only where the seats are: the scheduler's refusal names n."""
    body = {"model": served_model(server), "max_tokens": 3, "prompt": "hi", "n": 9}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_after_every_bad_field_the_same_scheduler_serves_and_is_ready(server):
    # the reported crash, six times: it once took the replica down for good
    for _ in range(6):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": served_model(server), "prompt": "hi", "max_tokens": 3, "stop_token_ids": [2**63]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    status, body = health(server)
    assert status == 200 and body["replicas"][0]["state"] == "ready"
    assert pid_of(server, "scheduler") == server.first_scheduler_pid
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 3, "seed": -1, "top_k": -1, "stop_token_ids": [VOCAB - 1]})
    assert r.status_code == 200, r.text


def test_the_openapi_document_and_docs_are_served(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200


def test_openai_published_schema_fuzzed_by_schemathesis_gets_no_server_error_and_conforming_bodies(server):
    if not OPENAI_SCHEMA.is_file():
        pytest.skip(f"OpenAI's schema is not at {OPENAI_SCHEMA} (../shared/openai-openapi from the repo root)")
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import response_schema_conformance

    raw = json.loads(OPENAI_SCHEMA.read_text())
    schemas = raw["components"]["schemas"]
    for request_schema in ("CreateCompletionRequest", "CreateChatCompletionRequest"):
        pin_model(schemas[request_schema], served_model(server))
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("POST", "/completions"), ("POST", "/chat/completions"), ("GET", "/models")}
    server_errors, nonconforming = [], []
    stream_validators = {path: stream_validator(raw, path) for path in STREAM_SCHEMA}
    for op in operations:
        strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=40, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def call(case):
            response = case.call(base_url=server.url + "/v1", timeout=60)
            if response.status_code >= 500:
                server_errors.append((op.method, op.path, case.body, response.status_code, response.text[:300]))
            if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
                problems = stream_violations(stream_validators[op.path], response.content.decode())
                if problems:
                    nonconforming.append((op.method, op.path, case.body, problems[:3]))
                return
            try:  # a 200 body must match OpenAI's response schema (a 400's is not specified there)
                case.validate_response(response, checks=[response_schema_conformance])
            except Exception as exc:  # schemathesis' failure group: which field, which rule
                nonconforming.append((op.method, op.path, case.body, str(exc)[:500]))

        call()
    assert not server_errors, server_errors[:3]
    assert not nonconforming, nonconforming[:3]
    assert pid_of(server, "scheduler") == server.first_scheduler_pid


# Strings no tool should be able to turn into a server error: lone UTF-16 surrogates (JSON
# escapes), NUL, terminal control characters, a BOM with a right-to-left override.
HOSTILE_STRINGS = ["\ud800", "\udfff x", "a\x00b", "\x1b[31m\x07\x08", "\ufeff\u202eabc"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
STRING_FIELDS = {  # where each hostile string goes, as a function of it
    "/v1/completions": {
        "prompt": lambda s: {"prompt": s}, "stop": lambda s: {"stop": [s]}, "user": lambda s: {"user": s},
        "model": lambda s: {"model": s},
        "structured_outputs.regex": lambda s: {"structured_outputs": {"regex": s}},
        "structured_outputs.choice": lambda s: {"structured_outputs": {"choice": [s, "b"]}},
        "structured_outputs.grammar": lambda s: {"structured_outputs": {"grammar": f'root ::= "{s}"'}},
        "guided_regex": lambda s: {"guided_regex": s},
        "guided_json": lambda s: {"guided_json": {"type": "string", "const": s}},
        "response_format.json_schema.name": lambda s: {"response_format": {"type": "json_schema", "json_schema": {
            "name": s, "schema": SCHEMA}}},
        "response_format.json_schema.description": lambda s: {"response_format": {"type": "json_schema",
                                                                                  "json_schema": {"name": "x", "description": s, "schema": SCHEMA}}},
        "undeclared key": lambda s: {s: 1},
    },
    "/v1/chat/completions": {
        "messages.content": lambda s: {"messages": [{"role": "user", "content": s}]},
        "messages.name": lambda s: {"messages": [{"role": "user", "content": "hi", "name": s}]},
        "tools.function.name": lambda s: {"tools": [{"type": "function", "function": {"name": s}}]},
        "tools.function.description": lambda s: {"tools": [{"type": "function", "function": {
            "name": "f", "description": s, "parameters": {"type": "object"}}}]},
        "tool_choice.function.name": lambda s: {"tools": [{"type": "function", "function": {"name": "f"}}],
                                                "tool_choice": {"type": "function", "function": {"name": s}}},
        "chat_template_kwargs": lambda s: {"chat_template_kwargs": {"x": s}},
        "response_format.json_schema.name": lambda s: {"response_format": {"type": "json_schema", "json_schema": {
            "name": s, "schema": SCHEMA}}},
        "structured_outputs.regex": lambda s: {"structured_outputs": {"regex": s}},
        "stop": lambda s: {"stop": s}, "user": lambda s: {"user": s},
    },
}
STRING_CASES = [(path, field, s) for path, fields in STRING_FIELDS.items() for field in fields for s in HOSTILE_STRINGS]


@pytest.mark.parametrize("path,field,hostile", STRING_CASES,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{ascii(s)[:12]}" for p, f, s in STRING_CASES])
def test_a_hostile_string_in_any_field_is_never_a_server_error(server, path, field, hostile):
    base = {"model": served_model(server), "max_tokens": 3}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    body = json.dumps({**base, **STRING_FIELDS[path][field](hostile)})  # ensure_ascii: "\ud800" escapes
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if any(0xD800 <= ord(c) <= 0xDFFF for c in hostile):  # nothing can encode it: refused, naming where
        assert r.status_code == 400, r.text[:300]
        assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b'"\xed\xa0\x80"', b'"\xc0\xaf"', b'"\xff\xfe"', b'"a\x00b"'],
                         ids=["utf8-of-a-surrogate", "overlong-slash", "not-utf8", "raw-nul"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_that_is_not_utf8_is_a_4xx(server, path, raw):
    if "chat" in path:
        body = b'{"max_tokens": 3, "messages": [{"role": "user", "content": ' + raw + b'}]}'
    else:
        body = b'{"max_tokens": 3, "prompt": ' + raw + b'}' if path != "/tokenize" else b'{"prompt": ' + raw + b'}'
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    status, body = health(server)
    assert status == 200 and pid_of(server, "scheduler") == server.first_scheduler_pid
