"""``LLM(...)``'s own options at work: its ``chat_template`` renders chat() when the call gives
none, ``max_logprobs`` bounds logprobs and prompt_logprobs before anything is sent,
``restart_window_s`` is the window ``max_restarts`` counts in (serve's rule), and a replica
that falls silent (SIGSTOP) loses its requests after ``replica_timeout_s`` and ends the LLM after
``scheduler_timeout_s``, so that no call waits without end. Each waits on results, never sleeps."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.offline.llm import LLM, EngineDiedError, SamplingParams

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for m in messages %}CUSTOM[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}CUSTOM[assistant]:{% endif %}")
HELLO = [{"role": "user", "content": "Hello"}]
SMALL = dict(num_gpu_blocks=64, max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def custom_llm(model):
    """Its own settings; the restart test (last) kills its workers, which the LLM replaces."""
    with LLM(model, chat_template=TEMPLATE, max_logprobs=2, router="round-robin", max_restarts=1,
             restart_window_s=0.5, **SMALL) as engine:
        yield engine


def _scheduler(llm: LLM):
    return next(c for c in llm._children if c.role == "scheduler")


def test_chat_renders_with_the_llms_chat_template_unless_the_call_gives_one(custom_llm):
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    assert custom_llm.chat(HELLO, greedy, use_tqdm=False)[0].prompt == "CUSTOM[user]: Hello\nCUSTOM[assistant]:"
    own = custom_llm.chat(HELLO, greedy, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")[0]
    assert own.prompt == "Hello!"


def test_max_logprobs_bounds_logprobs_and_prompt_logprobs_before_anything_is_sent(custom_llm):
    started = time.monotonic()
    with pytest.raises(ValueError, match="^logprobs: Requested sample logprobs of 3, which is greater than max of 2"):
        custom_llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False, timeout=30)
    with pytest.raises(ValueError, match="^prompt_logprobs: Requested prompt logprobs of 3, which is greater"):
        custom_llm.generate("Hello", SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False, timeout=30)
    assert time.monotonic() - started < 5
    out = custom_llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0, logprobs=2, prompt_logprobs=2),
                              use_tqdm=False, timeout=30)[0]
    assert all(2 <= len(table) <= 3 for table in out.outputs[0].logprobs + out.prompt_logprobs[1:])


def test_workers_dying_more_than_max_restarts_times_but_not_within_restart_window_s_are_replaced(custom_llm):
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    replaced_by = None
    for kill in (1, 2):  # max_restarts=1: the second death is allowed only because the window has passed
        # the window (0.5 s) counts from when the first death was seen, at the latest when its call returned:
        # requests keep running on the replacement until it has passed
        while replaced_by is not None and time.monotonic() - replaced_by <= 0.5:
            custom_llm.generate([[5, 6, 7]], greedy, use_tqdm=False, timeout=60)
        worker = next(c for c in custom_llm._children if c.role == "worker")
        worker.popen.kill()
        worker.popen.wait(timeout=10)
        # Requests the dead worker held end with "error"; the next call runs on its replacement
        custom_llm.generate([[5, 6, 7]], greedy, use_tqdm=False, timeout=60)
        assert [o.finish_reason for o in custom_llm.generate([[5, 6, 7]], greedy, use_tqdm=False, timeout=60)] \
            == ["length"]
        assert custom_llm.worker_restarts == kill and worker not in custom_llm._children
        replaced_by = time.monotonic()


def test_a_silent_replica_loses_its_requests_then_ends_the_llm_as_hung(model):
    llm = LLM(model, replica_timeout_s=1.0, scheduler_timeout_s=4.0, **SMALL)
    scheduler = _scheduler(llm)
    calls = ThreadPoolExecutor(max_workers=1)
    short = SamplingParams(max_tokens=2)
    try:
        os.kill(scheduler.popen.pid, signal.SIGSTOP)
        (out,) = calls.submit(llm.generate, "Hello", short, use_tqdm=False).result(timeout=30)  # no timeout given
        assert out.finish_reason == "error" and "replica_timeout_s" in out.outputs[0].error
        os.kill(scheduler.popen.pid, signal.SIGCONT)
        llm.refresh_stats(timeout_s=30)  # heard from again
        assert calls.submit(llm.generate, "Hello", short, use_tqdm=False).result(timeout=30)[0].finish_reason \
            == "length"

        os.kill(scheduler.popen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        with pytest.raises(EngineDiedError, match="silent.*scheduler_timeout_s=4"):
            while time.monotonic() < deadline:  # each call ends its requests with an error until it gives up
                calls.submit(llm.generate, "Hello", short, use_tqdm=False).result(timeout=30)
        assert scheduler.popen.poll() is not None  # killed, so the next call fails at once
        with pytest.raises(EngineDiedError, match="exited"):
            calls.submit(llm.generate, "Hello", short, use_tqdm=False).result(timeout=10)
    finally:
        if scheduler.popen.poll() is None:
            scheduler.popen.kill()  # a stuck call (the bug) sees it exit and returns
        calls.shutdown(wait=True)
        llm.close()


def test_cache_aware_routing_sends_each_next_request_to_the_replica_that_cached_its_prefix(model):
    """The HTTP frontend's router, in the offline LLM: one request at a time would alternate between
    two idle replicas under least-loaded; cache-aware keeps a shared prefix where it is cached."""
    system = list(range(5, 69))  # 64 tokens: whole blocks at any block size up to 64
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(model, data_parallel_size=2, router="cache-aware", enable_prefix_caching=True, **SMALL) as llm:
        for turn in range(5):
            assert llm.generate([system + [70 + turn]], greedy, use_tqdm=False, timeout=60)[0].finish_reason \
                == "length"
        stats = llm.refresh_stats(timeout_s=30)
    assert sorted(s.num_finished for s in stats.values()) == [0, 5]
    holder = next(s for s in stats.values() if s.num_finished == 5)
    assert holder.prefix_cache_hits >= 4 * 48  # each later turn found (most of) the prefix cached
