"""--reasoning-parser qwen3 on a real engine (the thinking demo model, whose </think> is one token),
through the official clients: the grammar of response_format / text.format / a forced tool starts
after the thinking, which stays the free text the model writes without one, and reasoning_tokens
counts the output tokens through </think>, in chat (streamed or not) and Responses. A recorded
trace of such a request replays exactly.

The random model closes its thinking by chance: the test takes the first of a fixed list of
prompts whose greedy output does so after a few tokens, with room left for an answer."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from pagedserve.protocol.codec import Decoder
from pagedserve.protocol.messages import SchedulerOutput, SchedulerToWorker
from pagedserve.protocol.trace import read_trace
from pagedserve.scheduler_proc.replay import replay_scheduler
from pagedserve.tools.replay import replay_workers

from support.greedy import client as openai_client
from support.server import Server
from support.shared_deployments import SERVER_ARGS
from support.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow
PERSON = SCHEMAS["person"]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 400


def _user(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _question_whose_thinking_ends(openai, model: str, **chat_fields) -> tuple[str, str, int]:
    """(question, its greedy thinking, the tokens through </think>) for the first fixed question
    whose greedy thinking ends after 3 to 40 tokens, asked with ``chat_fields``."""
    for i in range(40):
        question = f"Question {i}: what is {i} + {i}?"
        reply = openai.chat.completions.create(model=model, messages=_user(question), max_tokens=60, temperature=0,
                                               logprobs=True, **chat_fields)
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
        if "</think>" in tokens[3:40] and reply.choices[0].message.reasoning_content:
            # the model wrote </think> as one token
            return question, reply.choices[0].message.reasoning_content, tokens.index("</think>") + 1
    pytest.fail("no question's greedy thinking ended: the demo model changed")


@pytest.fixture(scope="module")
def thinking(thinking_server):
    """(openai client, model, a question whose greedy thinking ends, that thinking, its token count)."""
    openai = openai_client(thinking_server)
    model = openai.models.list().data[0].id
    return openai, model, *_question_whose_thinking_ends(openai, model)


def test_the_json_schema_applies_after_the_thinking_which_stays_free_streamed_or_not(thinking):
    openai, model, question, free_thinking, thinking_tokens = thinking
    reply = openai.chat.completions.create(model=model, messages=_user(question), max_tokens=MAX_TOKENS,
                                           temperature=0, response_format=FORMAT)
    message = reply.choices[0].message
    assert message.reasoning_content == free_thinking  # the mask left the thinking alone
    jsonschema.validate(json.loads(message.content), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    reasoning, content, usage = "", "", None
    for chunk in openai.chat.completions.create(model=model, messages=_user(question), max_tokens=MAX_TOKENS,
                                                temperature=0, response_format=FORMAT, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    assert usage.completion_tokens == reply.usage.completion_tokens


def test_without_a_format_the_answer_after_the_thinking_is_not_json(thinking):
    """The control for the test above: the same thinking, and an answer only the grammar makes valid."""
    openai, model, question, free_thinking, thinking_tokens = thinking
    reply = openai.chat.completions.create(model=model, messages=_user(question), max_tokens=60, temperature=0)
    assert reply.choices[0].message.reasoning_content == free_thinking
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking_tokens


def test_responses_text_format_and_reasoning_tokens(thinking):
    openai, model, question, free_thinking, thinking_tokens = thinking
    response = openai.responses.create(model=model, input=question, max_output_tokens=MAX_TOKENS, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                        "strict": True}})
    (reasoning,) = [item for item in response.output if item.type == "reasoning"]
    assert reasoning.content[0].text == free_thinking
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.usage.output_tokens_details.reasoning_tokens == thinking_tokens
    final = None
    for event in openai.responses.create(model=model, input=question, max_output_tokens=12, temperature=0,
                                         stream=True):
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    # cut inside the thinking: every output token was thinking
    assert final.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens == 12


def test_an_anthropic_forced_tool_is_valid_after_the_thinking(thinking, thinking_server):
    openai, model, _, _, _ = thinking
    tool = {"type": "function", "function": {"name": "record", "parameters": PERSON}}
    question, free_thinking, _ = _question_whose_thinking_ends(  # its prompt lists the tool
        openai, model, tools=[tool], tool_choice={"type": "function", "function": {"name": "record"}})
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     tools=[{"name": "record", "input_schema": PERSON}],
                                     tool_choice={"type": "tool", "name": "record"}, messages=_user(question))
    assert message.content[0].type == "thinking" and message.content[0].thinking == free_thinking
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "record" and message.stop_reason == "tool_use"
    jsonschema.validate(use.input, PERSON)


def test_a_trace_of_a_grammar_after_the_thinking_replays_exactly_both_ways(thinking, model_factory, tmp_path):
    # The shared server found the question on the same weights and settings, and greedy tokens do
    # not depend on recording: the trace holds only this request, so both replays stay short.
    _, _, question, _, thinking_tokens = thinking
    model = model_factory("qwen2", thinking_template=True)
    path = tmp_path / "thinking.trace"
    srv = Server(model, [*SERVER_ARGS, "--reasoning-parser", "qwen3", "--record-trace", str(path)]).start(tmp_path)
    try:
        openai = openai_client(srv)
        name = openai.models.list().data[0].id
        reply = openai.chat.completions.create(model=name, messages=_user(question), max_tokens=MAX_TOKENS,
                                               temperature=0, response_format=FORMAT)
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    finally:
        srv.stop()
    to_worker = Decoder(SchedulerToWorker)
    masked = sum(isinstance(msg, SchedulerOutput) and msg.grammar is not None
                 for direction, payload in read_trace(str(path)).records if direction == "to_worker"
                 for msg in [to_worker.decode(payload)])
    # one masked step per token sampled after </think>, none while thinking
    assert masked == reply.usage.completion_tokens - thinking_tokens > 0
    report = replay_scheduler(str(path))
    assert report.ok, report.mismatch
    steps, tokens = replay_workers(str(path), model, "cpu", num_threads=1)
    assert steps == report.steps and tokens > thinking_tokens
