"""What the offline ``LLM`` refuses or normalises before any process starts: serve options it
would not honour (one error naming each), the router it cannot run, sampling parameters set
after construction, and a list of SamplingParams of the wrong length. In process: a refused
``LLM(...)`` must start nothing (the slow mark's guard in tests/conftest.py would fail it)."""

from __future__ import annotations

import json

import pytest

from pagedserve.offline.engine_options import offline_config, unused_options
from pagedserve.offline.inputs import SamplingParams, as_params_list
from pagedserve.offline.llm import LLM
from pagedserve.offline.structured import StructuredOutputsParams
from pagedserve.runtime import options as opts

HTTP_ONLY = dict(api_key="k", host="0.0.0.0", port=1, served_model_name="x", drain_timeout_s=1.0,
                 tenant_header="X-Tenant", uvicorn_log_level="debug", tool_call_parser="hermes",
                 enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                  "max_position_embeddings": 512, "torch_dtype": "float32"}))
    return str(path)


def test_serve_only_options_are_refused_in_one_error_naming_each_before_anything_starts(model):
    with pytest.raises(ValueError) as info:
        LLM(model, **HTTP_ONLY, max_waiting_requests=2, reasoning_parser="qwen3")
    message = str(info.value)
    for name in [*HTTP_ONLY, "max_waiting_requests", "reasoning_parser"]:
        assert name in message, name
    assert "whole batch" in message and "thinking" in message  # the two refusals say why
    for name in ("ray_address", "internal_host", "remote_workers", "disable_log_requests"):
        assert name in unused_options()  # supervisor-only: nothing offline reads them


def test_a_serve_only_option_at_its_default_and_the_options_offline_reads_are_accepted(model):
    config = offline_config(model, "WARNING", dict(port=opts.BY_NAME["port"].default, scheduler_timeout_s=3.0,
                                                   replica_timeout_s=1.0, restart_window_s=9.0, max_logprobs=3,
                                                   chat_template="{{ messages }}"))
    assert (config.scheduler_timeout_s, config.replica_timeout_s, config.restart_window_s) == (3.0, 1.0, 9.0)
    assert config.max_logprobs == 3 and config.router == "least-loaded"
    config = offline_config(model, "WARNING", dict(runner="pooling"))  # generation-only options: refused there
    assert config.task == "embed" and config.router == "least-loaded"


def test_router_is_serves_with_least_loaded_the_default_and_cache_aware_needs_the_prefix_cache(model):
    assert offline_config(model, "WARNING", dict(router="round-robin", data_parallel_size=2)).router == "round-robin"
    assert offline_config(model, "WARNING", dict(data_parallel_size=2)).router == "least-loaded"  # not serve's
    tuned = offline_config(model, "WARNING", dict(router="cache-aware", router_balance_abs=3, data_parallel_size=2,
                                                  enable_prefix_caching=True))
    assert (tuned.router, tuned.router_balance_abs) == ("cache-aware", 3)
    with pytest.raises(ValueError, match="cache-aware .*needs --enable-prefix-caching"):
        LLM(model, router="cache-aware", data_parallel_size=2)
    with pytest.raises(ValueError, match="router-balance-abs.*tune the cache-aware router"):
        LLM(model, router_balance_abs=3, data_parallel_size=2)


def test_fields_set_after_construction_are_checked_and_normalised_as_the_constructors():
    sp = SamplingParams(max_tokens=4)
    sp.stop_token_ids, sp.stop = None, "end"
    sp.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    wire = sp.to_protocol()
    assert wire.stop_token_ids == [] and sp.stop == ["end"] and wire.structured_outputs.choice == ["yes", "no"]
    sp.best_of = 4
    with pytest.raises(ValueError, match="^best_of"):
        sp.to_protocol()
    sp.best_of, sp.logprobs = None, "x"
    with pytest.raises(ValueError, match="^logprobs"):
        sp.to_protocol()


def test_logprobs_true_is_one_alternative_as_in_vllm():
    assert SamplingParams(logprobs=True).to_protocol().top_logprobs == 1
    assert SamplingParams(logprobs=True).logprobs == 1


def test_an_empty_list_of_sampling_params_is_a_length_mismatch_not_the_defaults():
    with pytest.raises(ValueError, match="^sampling_params: 0 SamplingParams for 2 prompts"):
        as_params_list([], 2)
