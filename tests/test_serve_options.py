"""vLLM's spelling of serve options resolves to what pagedserve runs (pure config objects)."""

from __future__ import annotations

import json

import pytest

from pagedserve.deploy.serve_config import ConfigError, ServeConfig


@pytest.fixture
def model_dir(tmp_path):
    def make(dtype):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128, "dtype": dtype}))
        return str(tmp_path)
    return make


@pytest.mark.parametrize("requested, config_dtype, device, expected", [
    ("auto", "float32", "cpu", "float32"),
    ("auto", "bfloat16", "cpu", "bfloat16"),
    ("auto", "float16", "cpu", "bfloat16"),  # vLLM's CPU rule: no half-precision matmuls there
    ("auto", "float16", "cuda", "float16"),
    ("half", "float32", "cpu", "float16"),
    ("float", "bfloat16", "cpu", "float32"),
])
def test_dtype_names_resolve_as_vllm_does(model_dir, requested, config_dtype, device, expected):
    assert ServeConfig(model=model_dir(config_dtype), dtype=requested, device=device).dtype == expected


def test_served_model_names_go_to_the_frontend_and_the_first_is_the_response_name(model_dir):
    cfg = ServeConfig(model=model_dir("float32"), served_model_name=["a", "b"])
    cmd = cfg.frontend_cmd("/tmp/run")
    at = cmd.index("--served-model-name")
    assert cmd[at + 1:at + 3] == ["a", "b"]


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="chat-template"):
        ServeConfig(model=model_dir("float32"), chat_template="no-such-file.jinja")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServeConfig(model=model_dir("float32"), chat_template=str(template)).chat_template == str(template)


def test_tool_calling_flags_reach_the_frontend_and_an_unknown_parser_is_refused(model_dir):
    from pagedserve.protocol.options import TOOL_CALL_PARSERS
    from pagedserve.frontend_proc.args import parse_args
    from pagedserve.frontend_proc.tool_parsers import TOOL_PARSERS

    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)  # deploy cannot import the frontend
    cfg = ServeConfig(model=model_dir("float32"), enable_auto_tool_choice=True, tool_call_parser="hermes")
    frontend = parse_args(cfg.frontend_cmd("/tmp/run")[3:]).tool_calling
    assert (frontend.enable_auto_tool_choice, frontend.tool_call_parser) == (True, "hermes")
    with pytest.raises(ConfigError, match="hermes, llama3_json"):
        ServeConfig(model=model_dir("float32"), tool_call_parser="granite")
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ServeConfig(model=model_dir("float32"), enable_auto_tool_choice=True)


def test_the_device_defaults_to_what_torch_sees_and_sets_the_step_budget(model_dir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = ServeConfig(model=model_dir("float32"))
    assert (cpu.device, cpu.max_num_batched_tokens) == ("cpu", 1024)  # a CPU step grows with its tokens
    argv = cpu.scheduler_cmd("/tmp/run", 0)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "1024"  # the scheduler gets the resolved budget
    cuda = ServeConfig(model=model_dir("float32"), device="cuda")
    assert cuda.max_num_batched_tokens == 8192  # a GPU step's host cost hardly grows with its tokens
    assert ServeConfig(model=model_dir("float32"), device="cuda", max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="--device"):
        ServeConfig(model=model_dir("float32"), device="tpu")
