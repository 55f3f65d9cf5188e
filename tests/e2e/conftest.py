"""The session's shared deployments, one of each, started on first use and stopped at the end:

- `shared_server`: `pagedserve serve` on the qwen2 demo model, near-default settings;
- `shared_llm`: the offline `LLM` on the same model, as vLLM's quickstart builds one;
- `deployment` (and `env`, which resets it): a real frontend in front of two scripted fake
  replicas (support/frontend_harness.py);
- `thinking_deployment` (and `thinking_env`): a frontend with --reasoning-parser qwen3 and hermes
  tool calls before one fake replica, on a demo model whose template reads enable_thinking; for
  the chat, Responses and Anthropic surfaces;
- `thinking_server`: `pagedserve serve --reasoning-parser qwen3` on that thinking demo model (a real
  engine: a grammar that starts after the thinking, reasoning token counts).

A test that only sends requests uses these. A test that needs its own settings (a tight cache,
recording, faults, kills, its own model) starts its own deployment: one that changes a shared
one's state would change what the tests after it see. Their settings are in
support/shared_deployments.py, where the tests that assert on them read them too.
"""

from __future__ import annotations

import pytest

from support.frontend_harness import MAX_MODEL_LEN, fake_deployment
from support.server import Server
from support.shared_deployments import LLM_OPTIONS, SERVER_ARGS


@pytest.fixture(scope="session")
def shared_server(model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2"), SERVER_ARGS).start(tmp_path_factory.mktemp("shared-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def thinking_server(model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2", thinking_template=True), [*SERVER_ARGS, "--reasoning-parser", "qwen3"])
    srv.start(tmp_path_factory.mktemp("thinking-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def shared_llm(model_factory):
    from pagedserve import LLM

    with LLM(model_factory("qwen2"), **LLM_OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, model_factory):
    """One frontend (2 replicas, API key, 1 s replica timeout) shared by the frontend tests."""
    with fake_deployment(tmp_path_factory, model_factory("qwen2"), 2, MAX_MODEL_LEN) as deployed:
        yield deployed


@pytest.fixture
def env(deployment):
    """The shared deployment, with both fake replicas reset to their defaults."""
    frontend, fakes, tokenizer = deployment
    for fake in fakes:
        fake.mode, fake.reply_text, fake.stats_fields, fake.heartbeat = (
            "finish", "Hello, world! How are you today?", {}, True)
    frontend.wait_until(lambda r: r.status_code == 200 and all(
        x["live"] and x["num_running"] == 0 for x in r.json()["replicas"]))
    return frontend, fakes, tokenizer


@pytest.fixture(scope="session")
def thinking_deployment(tmp_path_factory, model_factory):
    with fake_deployment(tmp_path_factory, model_factory("qwen2", thinking_template=True), 1, 1024, extra_args=[
            "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as deployed:
        yield deployed


@pytest.fixture
def thinking_env(thinking_deployment):
    """The thinking deployment, its fake replica answering plain text again."""
    frontend, (fake,), tokenizer = thinking_deployment
    fake.mode, fake.reply_text = "finish", "Hello, world! How are you today?"
    return frontend, fake, tokenizer
