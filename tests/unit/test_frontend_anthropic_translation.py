"""/v1/messages fields as a user of Anthropic's client sees them, over the real app in process (no
replica: the prompt is checked through /v1/messages/count_tokens and /tokenize, the tenant through
the 429 a full deployment answers and its /metrics): a prefill continued, tool results that are errors
refused, thinking blocks sent back shown to the template, the fields of another variant refused,
``metadata.user_id`` as the tenant. The replies over HTTP: e2e/test_frontend_anthropic.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.anthropic_schema import MessagesRequest
from pagedserve.frontend_proc.app import build_app
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.reasoning import get_reasoning_parser
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig
from pagedserve.protocol.messages import SchedulerStats
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir

LIMIT = 2
USER = {"role": "user", "content": "Weather in Oslo?"}
PREFILL = [USER, {"role": "assistant", "content": "The weather is"}]
NO_THINKING = {"type": "disabled"}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
THOUGHT = {"type": "thinking", "thinking": "The tool knows.", "signature": ""}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def thinking_tokenizer(model_factory) -> PromptTokenizer:
    return PromptTokenizer(Path(model_factory("qwen2", thinking_template=True)))


@pytest.fixture(scope="module")
def plain_tokenizer(model_factory) -> PromptTokenizer:
    return PromptTokenizer(Path(model_factory("qwen2")))


def _serve(tokenizer: PromptTokenizer, tmp_path, requests, reasoning: bool = False,
           door: bool = False) -> tuple[list[httpx.Response], str]:
    """``requests`` ((path, body) each) through the app; the answers, and /metrics after them. The
    one replica is full, so a generation the app accepts gets submit()'s 429 at once (there is no
    replica to answer it); ``door``: early_shed.py's 429 first, before the app reads the body."""
    async def run():
        router = Router(1, timeout_s=60.0)
        router.update(SchedulerStats(replica=0, state="ready", pid=10, num_running=1, num_waiting=LIMIT))
        engine = EngineClient(Endpoints(make_run_dir(str(tmp_path))), router, LIMIT)
        metrics = FrontendMetrics(router, "m")
        serving = Serving(["m"], 1024, engine, tokenizer, metrics, tool_calling=ToolCallingConfig(True, "hermes"),
                          reasoning_parser=get_reasoning_parser("qwen3") if reasoning else None)
        app = build_app(serving, router, metrics, None)
        if not door:
            app.user_middleware.clear()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
                answers = [await client.post(path, json={"model": "m", **body}) for path, body in requests]
                return answers, (await client.get("/metrics")).text
        finally:
            await engine.close()

    return asyncio.run(run())


def _counted(tokenizer, tmp_path, body, reasoning: bool = False) -> httpx.Response:
    (answer,), _ = _serve(tokenizer, tmp_path, [("/v1/messages/count_tokens", body)], reasoning)
    return answer


def _refusal(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"
    return answer.json()["error"]["message"]


def _tokenized(tokenizer, tmp_path, messages, **options) -> list[int]:
    (answer,), _ = _serve(tokenizer, tmp_path, [("/tokenize", {"messages": messages, **options})])
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(plain_tokenizer, tmp_path):
    continued = _tokenized(plain_tokenizer, tmp_path, PREFILL, add_generation_prompt=False,
                           continue_final_message=True)
    assert plain_tokenizer.tokenizer.decode(continued).endswith("assistant\nThe weather is")
    counted = _counted(plain_tokenizer, tmp_path, {"messages": PREFILL})
    assert counted.json() == {"input_tokens": len(continued)}
    chat = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": PREFILL}).chat()
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    # an assistant's tool use last is no text to continue: a new turn, as before
    after_call = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "tools": TOOLS, "messages": [
        USER, {"role": "assistant", "content": [TOOL_USE]}]}).chat()
    assert (after_call.add_generation_prompt, after_call.continue_final_message) == (True, False)


def test_a_prefill_ending_in_whitespace_or_while_the_model_thinks_is_refused(thinking_tokenizer, tmp_path):
    spaced = [USER, {"role": "assistant", "content": [{"type": "text", "text": "The weather is \n"}]}]
    answers, _ = _serve(thinking_tokenizer, tmp_path, [
        ("/v1/messages", {"max_tokens": 8, "messages": spaced, "thinking": NO_THINKING}),
        ("/v1/messages/count_tokens", {"messages": spaced, "thinking": NO_THINKING}),
        ("/v1/messages", {"max_tokens": 8, "messages": PREFILL}),
        ("/v1/messages/count_tokens", {"messages": PREFILL, "thinking": NO_THINKING})], reasoning=True)
    assert "messages[1]: final assistant content cannot end with trailing whitespace" in _refusal(answers[0])
    assert "trailing whitespace" in _refusal(answers[1])
    assert 'send thinking {"type": "disabled"}' in _refusal(answers[2])
    assert answers[3].status_code == 200, answers[3].text


@pytest.mark.parametrize("is_error", [False, None])
def test_a_tool_result_that_is_no_error_is_served(plain_tokenizer, tmp_path, is_error):
    messages = [USER, {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{**RESULT, "is_error": is_error}]}]
    assert _counted(plain_tokenizer, tmp_path, {"messages": messages}).status_code == 200


def test_a_tool_result_that_is_an_error_is_refused_by_name(plain_tokenizer, tmp_path):
    messages = [USER, {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{**RESULT, "is_error": True}]}]
    (answer,), _ = _serve(plain_tokenizer, tmp_path, [
        ("/v1/messages", {"max_tokens": 8, "messages": messages})])
    assert "messages[2].content[0].is_error is not supported" in _refusal(answer)


def test_thinking_blocks_sent_back_reach_a_template_that_shows_them(thinking_tokenizer, tmp_path):
    messages = [USER, {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "Looking."}, TOOL_USE]},
                {"role": "user", "content": [RESULT]}]
    chat_messages = [USER, {"role": "assistant", "content": "Looking.", "reasoning_content": "The tool knows.",
                            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"}]
    tokens = _tokenized(thinking_tokenizer, tmp_path, chat_messages, chat_template_kwargs={"enable_thinking": False})
    assert "<think>\nThe tool knows.\n</think>" in thinking_tokenizer.tokenizer.decode(tokens)
    counted = _counted(thinking_tokenizer, tmp_path, {"messages": messages, "thinking": NO_THINKING}, reasoning=True)
    assert counted.json() == {"input_tokens": len(tokens)}


def test_thinking_blocks_a_template_cannot_show_or_read_are_refused_by_name(plain_tokenizer, tmp_path):
    shown = [USER, {"role": "assistant", "content": [THOUGHT, TOOL_USE]}, {"role": "user", "content": [RESULT]}]
    redacted = [USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"}, TOOL_USE]},
                {"role": "user", "content": [RESULT]}]
    answers, _ = _serve(plain_tokenizer, tmp_path, [
        ("/v1/messages", {"max_tokens": 8, "system": "Be brief.", "messages": shown}),  # system: chat's 0th
        ("/v1/messages/count_tokens", {"messages": redacted}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [THOUGHT]}]})])
    assert _refusal(answers[0]).startswith("messages[1].content: thinking blocks: the chat template does not show")
    assert "messages[1].content[0]: redacted_thinking blocks are not supported" in _refusal(answers[1])
    assert "thinking blocks belong to assistant messages" in _refusal(answers[2])


@pytest.mark.parametrize("fields,named", [
    ({"tool_choice": {"type": "auto", "name": "zzz"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}}, "tool_choice.disable_parallel_tool_use"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
    ({"metadata": {"user_id": "u", "foo": 1}}, "metadata.foo")])
def test_a_key_that_is_not_part_of_its_variant_is_refused_by_name(thinking_tokenizer, tmp_path, fields, named):
    (answer,), _ = _serve(thinking_tokenizer, tmp_path, [
        ("/v1/messages", {"max_tokens": 8, "messages": [USER], "tools": TOOLS, **fields})])
    assert f"{named} is not supported" in _refusal(answer)


def test_each_variants_own_keys_are_still_served():
    chat = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [USER], "tools": TOOLS,
                                           "tool_choice": {"type": "tool", "name": "get_weather",
                                                           "disable_parallel_tool_use": True}}).chat()
    assert (chat.tool_choice.function.name, chat.parallel_tool_calls) == ("get_weather", False)
    chat = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [USER],
                                           "thinking": NO_THINKING, "metadata": {"user_id": "u1"}}).chat()
    assert (chat.chat_template_kwargs, chat.user) == ({"enable_thinking": False}, "u1")


@pytest.mark.parametrize("door", [True, False])
def test_metadata_user_id_names_the_tenant_at_the_door_and_behind_it(plain_tokenizer, tmp_path, door):
    body = {"max_tokens": 8, "messages": [USER], "metadata": {"user_id": "team-a"}}
    answers, metrics = _serve(plain_tokenizer, tmp_path, [("/v1/messages", body)], door=door)
    assert answers[0].status_code == 429 and answers[0].json()["error"]["type"] == "rate_limit_error"
    assert 'pagedserve_requests_shed_by_tenant_total{model_name="m",tenant="team-a"} 1.0' in metrics
