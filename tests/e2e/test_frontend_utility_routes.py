"""The routes around generation (models, tokenize, version, ping) and vLLM's command line,
as a vLLM user calls them: a real frontend process with fake schedulers."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pagedserve.protocol.version import package_version

pytestmark = pytest.mark.slow


def test_tokenize_and_detokenize_round_trip_with_the_model_tokenizer(env):
    frontend, _fakes, tokenizer = env
    with frontend.client() as http:
        got = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello, world!"}).json()
        assert got["tokens"] == tokenizer.encode("Hello, world!")
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
        text = http.post("/detokenize", json={"model": "tiny", "tokens": got["tokens"]}).json()
        assert text == {"prompt": "Hello, world!"}


def test_tokenize_messages_applies_the_chat_template_with_or_without_the_generation_prompt(env):
    frontend, _fakes, tokenizer = env
    messages = [{"role": "user", "content": "hi"}]
    with frontend.client() as http:
        with_prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        without = http.post("/tokenize", json={"messages": messages,
                                               "add_generation_prompt": False}).json()["tokens"]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert with_prompt == list(expected)
    assert len(without) < len(with_prompt) and with_prompt[:len(without)] == without


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "hi", "unknown_field": 1}, "unknown_field"),
    # read only with messages: with a prompt each would be accepted and ignored
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    # the template places the special tokens; vLLM's default with messages is false
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [10 ** 12]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_bodies_are_a_400_naming_the_field(env, path, body, param):
    frontend, _fakes, _tokenizer = env
    with frontend.client() as http:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]


def test_models_lists_every_served_name_and_each_has_its_own_card(env):
    frontend, _fakes, _tokenizer = env
    with frontend.client() as http:
        listed = http.get("/v1/models").json()["data"]
        card = http.get("/v1/models/tiny")
        missing = http.get("/v1/models/nope")
    assert [m["id"] for m in listed] == ["tiny"]
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_version_and_ping_answer_without_a_key(env):
    frontend, _fakes, _tokenizer = env
    assert httpx.get(f"{frontend.base_url}/version").json() == {"version": package_version()}
    assert httpx.get(f"{frontend.base_url}/ping").status_code == 200
    assert httpx.post(f"{frontend.base_url}/ping").status_code == 200


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_pagedserve_version_prints_the_package_version():
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"pagedserve {package_version()}"


@pytest.mark.parametrize("flag", ["--cpu-offload-gb", "--pipeline-parallel-size", "--lora-dtype"])
def test_a_vllm_flag_pagedserve_lacks_gets_one_line_saying_so(flag):
    done = _cli("serve", flag, "2")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1
    assert flag in lines[0] and "does not support" in lines[0]
