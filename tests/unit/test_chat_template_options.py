"""What a chat request's template options and tools do to its prompt (vLLM's semantics), and
what its tool_choice asks of the engine: pure frontend objects on the demo tokenizer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.tools.demo_model import build_tokenizer
from pagedserve.client.chat_template_options import ChatTemplateOptions
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig, plan_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(512).save_pretrained(path)
    return PromptTokenizer(path)


def _prompt(tokenizer: PromptTokenizer, messages: list[dict], **fields) -> str:
    if fields.get("tools"):
        fields = {"tool_choice": "none", **fields}
    body = ChatCompletionRequest(messages=messages, **fields)
    plan = plan_tool_calls(body, ToolCallingConfig())
    options = ChatTemplateOptions.from_request(body.add_generation_prompt, body.continue_final_message,
                                               body.chat_template_kwargs, plan.template_tools)
    return tokenizer.tokenizer.decode(tokenizer.encode_chat(body.messages, options))


USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_tools_are_listed_in_the_prompt_and_a_plain_chat_is_plain_chatml(tokenizer):
    assert _prompt(tokenizer, USER) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    with_tools = _prompt(tokenizer, USER, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in with_tools
    assert with_tools.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_earlier_calls_and_tool_results_are_rendered_in_the_hermes_format(tokenizer):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = _prompt(tokenizer, messages, tools=[WEATHER])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in prompt


def test_add_generation_prompt_false_leaves_off_the_assistant_header(tokenizer):
    assert _prompt(tokenizer, USER, add_generation_prompt=False) == \
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    messages = [*USER, {"role": "assistant", "content": "It is"}]
    assert _prompt(tokenizer, messages, add_generation_prompt=False, continue_final_message=True) == \
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nIt is"
    with pytest.raises(InvalidRequest, match="continue_final_message"):
        _prompt(tokenizer, messages, continue_final_message=True)  # add_generation_prompt defaults to true


def test_chat_template_kwargs_reach_the_template_and_override_the_flags(tokenizer, tmp_path):
    tokenizer.tokenizer.chat_template, saved = (
        "{% if greeting %}{{ greeting }}\n{% endif %}" + tokenizer.tokenizer.chat_template,
        tokenizer.tokenizer.chat_template)
    try:
        assert _prompt(tokenizer, USER, chat_template_kwargs={"greeting": "Bonjour"}).startswith(
            "Bonjour\n<|im_start|>user")
        assert not _prompt(tokenizer, USER, chat_template_kwargs={"add_generation_prompt": False}
                           ).endswith("assistant\n")
        with pytest.raises(InvalidRequest, match=r"does not use \['enable_thinking'\]"):
            _prompt(tokenizer, USER, chat_template_kwargs={"enable_thinking": False})
        with pytest.raises(InvalidRequest, match="tokenize"):
            _prompt(tokenizer, USER, chat_template_kwargs={"tokenize": False})
    finally:
        tokenizer.tokenizer.chat_template = saved


def _plan(config: ToolCallingConfig = ToolCallingConfig(), **fields):
    return plan_tool_calls(ChatCompletionRequest(messages=USER, **fields), config)


def test_auto_tool_choice_needs_the_server_flag_as_in_vllm():
    with pytest.raises(InvalidRequest, match="--enable-auto-tool-choice") as refused:
        _plan(tools=[WEATHER])  # no tool_choice with tools means "auto"
    assert refused.value.param == "tool_choice"
    plan = _plan(ToolCallingConfig(True, "hermes"), tools=[WEATHER])
    assert plan.parser is not None and plan.structured_outputs is None
    assert _plan(tools=[WEATHER], tool_choice="none").parser is None


def test_required_constrains_to_an_array_of_calls_of_the_given_tools():
    plan = _plan(tools=[WEATHER, CLOCK], tool_choice="required")
    schema = json.loads(plan.structured_outputs.json)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {"tz": "UTC"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(_plan(tools=[WEATHER], tool_choice="required",
                              parallel_tool_calls=False).structured_outputs.json)
    assert single["maxItems"] == 1


def test_a_named_function_constrains_to_its_arguments_schema():
    plan = _plan(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(plan.structured_outputs.json) == WEATHER["function"]["parameters"]
    with pytest.raises(InvalidRequest, match="'get_news'"):
        _plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_news"}})
    with pytest.raises(InvalidRequest, match="tool_choice needs tools"):
        _plan(tool_choice="required")


def test_a_forced_tool_choice_is_the_one_grammar_of_the_request(tokenizer):
    from pagedserve.frontend_proc.chat_request import prepare_chat
    from pagedserve.frontend_proc.response_format import ChatFormat

    def prepare(**fields):
        body = ChatCompletionRequest(messages=USER, tool_choice="required", **fields)
        return prepare_chat(body, tokenizer, ToolCallingConfig(), ChatFormat("m"))

    assert json.loads(prepare(tools=[WEATHER]).structured_outputs.json)["type"] == "array"
    with pytest.raises(InvalidRequest, match="response_format") as refused:
        prepare(tools=[WEATHER], response_format={"type": "json_object"})
    assert refused.value.param == "tool_choice"
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(InvalidRequest) as refused:
        prepare(tools=[broken])
    assert refused.value.param == "tools"


@pytest.mark.parametrize("field, value", [("functions", [WEATHER["function"]]), ("function_call", "auto")])
def test_the_deprecated_functions_fields_are_refused_pointing_at_tools(field, value):
    with pytest.raises(ValueError, match=f"{field} is the deprecated form; use tool"):
        ChatCompletionRequest(messages=USER, **{field: value})


def test_an_earlier_turns_thinking_reaches_a_template_that_shows_it_and_is_refused_by_one_that_does_not(
        tokenizer, tmp_path):
    from pagedserve.tools.demo_model import THINKING_CHAT_TEMPLATE

    path = tmp_path / "thinking"
    build_tokenizer(512, chat_template=THINKING_CHAT_TEMPLATE, think_tokens=True).save_pretrained(path)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Sunny.", "reasoning_content": "Recall the forecast."},
                {"role": "user", "content": "Tomorrow?"}]
    assert "<think>\nRecall the forecast.\n</think>\n\nSunny." in _prompt(PromptTokenizer(path), messages)
    with pytest.raises(InvalidRequest) as refused:
        _prompt(tokenizer, messages)
    assert refused.value.param == "messages[1].reasoning_content"
