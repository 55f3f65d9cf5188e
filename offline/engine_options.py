"""Which ``pagedserve serve`` options ``LLM(...)`` takes, and the ServeConfig it builds of them.

The LLM hands the scheduler's and workers' options to those processes and itself plays the
frontend and the supervisor, reading the few of their options it has a use for (OFFLINE_READS).
Any other serve option (the HTTP server's, the multi-node and Ray layouts) would be accepted and do nothing, so a value other than its default is refused,
in one error naming each, before any process starts. A new serve option is refused here until
the offline LLM reads it.
"""

from __future__ import annotations

from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.runtime import options as opts

# Frontend and supervision options the offline LLM reads itself; the rest reach its children.
OFFLINE_READS = frozenset({
    "chat_template", "max_logprobs", "generation_config", "task", "pooling_type", "pooler_config",
    "data_parallel_size", "router", "router_balance_abs", "router_balance_rel", "replica_timeout_s", "scheduler_timeout_s", "max_restarts",
    "restart_window_s", "run_dir_parent", "max_model_len", "scheduling_policy", "log_level", "lora_modules",
    "load_format", "tokenizer"})  # a GGUF's: read where ServeConfig makes its model directory
# Options the offline LLM could pass on or read but refuses, and why.
REFUSED = {
    "max_waiting_requests": "serve's load shedding: generate() hands the engine its whole batch at once, "
                            "so the limit would refuse most of a batch instead of queueing it",
    "reasoning_parser": "the offline LLM returns the whole output as text, and its grammars "
                        "(structured_outputs) cannot start after the thinking as serve's chat path does",
}


def unused_options() -> list[str]:
    passed_on = {o.name for o in opts.OPTIONS if o.to & {opts.SCHEDULER, opts.WORKER}}
    return sorted(({o.name for o in opts.OPTIONS} - passed_on - OFFLINE_READS) | set(REFUSED))


def offline_config(model: str, log_level: str, engine_options: dict) -> ServeConfig:
    """``LLM(model, **engine_options)``'s config; ConfigError (a ValueError) names each option
    the offline LLM would not honour."""
    options = dict(engine_options)
    if "runner" in options:  # vLLM's spelling of the task
        options["task"] = options.pop("runner")
    given = [name for name in unused_options()
             if name in options and options[name] != opts.BY_NAME[name].default]
    plain = [name for name in given if name not in REFUSED]
    reasons = ([f"{', '.join(plain)} (only `pagedserve serve` uses them)"] if plain else []) + [
        f"{name} ({REFUSED[name]})" for name in given if name in REFUSED]
    if reasons:
        raise ConfigError(f"the offline LLM does not use these options, so they would do nothing here: "
                          f"{'; '.join(reasons)}. Drop them, or serve the model with `pagedserve serve`")
    # The HTTP frontend's router (client/engine_session.py), least-loaded unless asked: a generate()
    # batch is placed before any of its blocks is cached, so cache-aware pays only across calls
    options["router"] = options.get("router") or "least-loaded"
    return ServeConfig(model=str(model), log_level=log_level, **options)
