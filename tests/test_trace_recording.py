"""Recording through a real server, as the golden generator does, gives a trace that
replays exactly today: the goldens can always be regenerated from this code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedserve.deploy.replay import replay_workers
from pagedserve.deploy.trace_show import summarize_trace
from pagedserve.protocol.trace import read_trace
from pagedserve.scheduler_proc.replay import replay_scheduler

pytestmark = pytest.mark.slow

GENERATOR = Path(__file__).parent / "fixtures" / "make_golden_traces.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_golden_traces", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_trace_recorded_through_the_server_replays_exactly_both_ways(model_factory, tmp_path):
    gen = load_generator()
    entry = gen.make_golden(tmp_path, "fresh")
    path = str(tmp_path / entry["file"])
    trace = read_trace(path)
    assert trace.torn_tail is None
    assert trace.meta["config"]["enable_prefix_caching"] is True
    assert summarize_trace(trace).steps > 0
    report = replay_scheduler(path)
    assert report.ok, report.mismatch
    model = model_factory(gen.GOLDEN_MODEL["arch"], seed=gen.GOLDEN_MODEL["seed"])
    steps, tokens = replay_workers(path, model, "cpu", num_threads=1)
    assert steps == report.steps and tokens > 0
