"""/v1/embeddings through a real deployment served with vLLM's spelling (--runner pooling,
--override-pooler-config MEAN): the official openai client works unchanged (float and base64),
every input form embeds as transformers' hidden states pooled the same way (within 1e-4, a
prompt longer than a step included), dimensions on a Matryoshka model, a 400 for what cannot be
honoured, each task's endpoints refused on the other task's deployment, and OpenAI's published
schema fuzzed by schemathesis: no server error, conforming bodies. One deployment for the module."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from support.fault_helpers import pid_of
from support.openai_stream_schema import pin_model
from support.oracle import hf_embedding, hf_tokenizer
from support.server import Server, served_model

pytestmark = pytest.mark.slow

MATRYOSHKA = (16, 32, 64)  # a tuple: model_factory caches by its arguments
STEP_TOKENS = 64
REPO_ROOT = Path(__file__).resolve().parents[2]
OPENAI_SCHEMA = REPO_ROOT.parent / "shared" / "openai-openapi" / "openai_responses_embeddings.json"


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("qwen2", matryoshka_dimensions=MATRYOSHKA)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, ["--runner", "pooling", "--override-pooler-config", '{"pooling_type": "MEAN"}',
                             "--num-gpu-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "16",
                             "--max-num-batched-tokens", str(STEP_TOKENS), "--debug-invariants"]
                 ).start(tmp_path_factory.mktemp("embed"))
    srv.first_scheduler_pid = pid_of(srv, "scheduler")
    yield srv
    srv.stop()


def _client(srv: Server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _ids(model_dir: str, text: str) -> list[int]:
    return hf_tokenizer(model_dir).encode(text)


TEXTS = ["The food was delicious and the waiter was kind.", "hi",
         " ".join(f"word{i}" for i in range(20))]  # longer than a step's 64 tokens


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])  # None: the client asks base64 and decodes
def test_the_openai_client_embeds_texts_as_transformers_pooled_hidden_states(server, model_dir, encoding_format):
    assert len(_ids(model_dir, TEXTS[2])) > STEP_TOKENS
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = _client(server).embeddings.create(model=served_model(server), input=TEXTS, **kwargs)
    assert response.object == "list" and response.model == served_model(server)
    assert [d.index for d in response.data] == [0, 1, 2]
    for item, text in zip(response.data, TEXTS):
        vector = item.embedding
        if isinstance(vector, str):  # encoding_format="base64" explicitly: the client hands the string on
            vector = np.frombuffer(base64.b64decode(vector), "<f4")
        np.testing.assert_allclose(vector, hf_embedding(model_dir, _ids(model_dir, text), "mean"), atol=1e-4)
    num_tokens = sum(len(_ids(model_dir, t)) for t in TEXTS)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)


def test_token_ids_and_lists_of_them_embed_like_the_text_they_spell(server, model_dir):
    client = _client(server)
    ids = [_ids(model_dir, t) for t in TEXTS]
    one = client.embeddings.create(model=served_model(server), input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=served_model(server), input=ids, encoding_format="float")
    single = client.embeddings.create(model=served_model(server), input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, single.data[0].embedding, atol=1e-6)
    # null is omitted, as in every other request: floats
    unset = httpx.post(server.url + "/v1/embeddings", timeout=60, json={"input": ids[0], "encoding_format": None})
    assert unset.status_code == 200, unset.text
    np.testing.assert_allclose(unset.json()["data"][0]["embedding"], single.data[0].embedding, atol=1e-6)
    for item, prompt in zip(many.data, ids):
        np.testing.assert_allclose(item.embedding, hf_embedding(model_dir, prompt, "mean"), atol=1e-4)


def test_dimensions_truncates_then_normalises_on_a_model_that_declares_them(server, model_dir):
    response = _client(server).embeddings.create(model=served_model(server), input=TEXTS[0], dimensions=32,
                                                 encoding_format="float")
    vector = response.data[0].embedding
    assert len(vector) == 32 and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    np.testing.assert_allclose(vector, hf_embedding(model_dir, _ids(model_dir, TEXTS[0]), "mean", 32), atol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 48}, "dimensions"),  # not one of the model's Matryoshka sizes
    ({"input": "x", "normalize": False}, "normalize"),  # an undeclared field is never ignored
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, 10**6]}, "input"),  # outside the vocabulary
    ({"input": [5] * 300}, "input"),  # longer than --max-model-len 256
    ({"input": "x", "model": "text-embedding-3-small"}, "model"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


def test_generation_endpoints_are_refused_on_an_embedding_deployment(server):
    user = [{"role": "user", "content": "hi"}]
    model = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": user}),
                       ("/v1/responses", {"input": "hi"}),  # these two generated text before
                       ("/v1/messages", {"model": model, "messages": user, "max_tokens": 3})):
        for stream in (False, True):
            response = httpx.post(server.url + path, json={**body, "stream": stream}, timeout=60)
            assert response.status_code == 400, (path, response.text)
            assert "--task embed" in response.json()["error"]["message"]


def test_embeddings_are_refused_on_a_generating_deployment(shared_server):
    response = httpx.post(shared_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert response.status_code == 400
    assert "--task embed" in response.json()["error"]["message"]


def _as_floats(body: dict) -> dict:
    """A base64 body as the float body it encodes: OpenAI's own API sends base64 embeddings as
    strings, which its schema (an array of numbers) does not describe."""
    for item in body.get("data", []):
        if isinstance(item.get("embedding"), str):
            item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").tolist()
    return body


def test_openai_published_embeddings_schema_fuzzed_by_schemathesis_gets_no_server_error_and_conforming_bodies(
        server):
    if not OPENAI_SCHEMA.is_file():
        pytest.skip(f"OpenAI's schema is not at {OPENAI_SCHEMA} (../shared/openai-openapi from the repo root)")
    schemathesis = pytest.importorskip("schemathesis")
    import jsonschema
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    raw = json.loads(OPENAI_SCHEMA.read_text())
    pin_model(raw["components"]["schemas"]["CreateEmbeddingRequest"], served_model(server))
    validator = jsonschema.Draft202012Validator({**raw, "$ref": "#/components/schemas/CreateEmbeddingResponse"})
    schema = schemathesis.openapi.from_dict(raw)
    operations = [r.ok() for r in schema.get_all_operations()]
    (op,) = [o for o in operations if (o.method.upper(), o.path) == ("POST", "/embeddings")]
    server_errors, nonconforming, statuses = [], [], []
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def call(case):
        response = case.call(base_url=server.url + "/v1", timeout=60)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            server_errors.append((case.body, response.status_code, response.text[:300]))
        elif response.status_code == 200:
            problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                        for e in validator.iter_errors(_as_floats(response.json()))]
            if problems:
                nonconforming.append((case.body, problems[:3]))
        elif "error" not in response.json():
            nonconforming.append((case.body, response.status_code, response.text[:300]))

    call()
    assert not server_errors, server_errors[:3]
    assert not nonconforming, nonconforming[:3]
    assert 200 in statuses and 400 in statuses  # both sides of the schema were exercised
    assert pid_of(server, "scheduler") == server.first_scheduler_pid
