"""Grammar-constrained requests through the real scheduler, with pure objects.

The simulated worker samples like a noisy model: a random token among those its step's
bitmask allows (unpacked by the workers' own code). Whatever the batching, overlap,
preemption (swap or recompute) or n, every constrained sample must come out as text its
grammar accepts, and every unconstrained request must stream as it does alone.
"""

from __future__ import annotations

import json
import time

import pytest

from pagedserve.protocol.messages import AddRequest, SamplingParams, StructuredOutputs
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.grammar_cache import CompiledGrammarCache, GrammarBackendLoader
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.oracle import hf_tokenizer
from support.structured_schemas import CHOICES, REGEX, SCHEMAS, check_choice, check_json, check_regex
from support.grammar_sim import MaskedSamplingWorker
from support.scheduler_sim import StepDriver, assert_all_blocks_free, run_until_done

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def grammars(model_dir):
    return CompiledGrammarCache(GrammarBackendLoader(model_dir), VOCAB)


def constrained(request_id: str, spec: StructuredOutputs, eos: int, n: int = 1, max_tokens: int = 400) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[5 + i % 40 for i in range(11)],
                      sampling=SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, structured_outputs=spec),
                      eos_token_ids=[eos])


def texts_by_sample(deltas, tokenizer, eos: int) -> dict[tuple[str, int], tuple[str, str]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    for d in deltas:
        assert d.error is None, d.error
        tokens.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        if d.finish_reason:
            finish[(d.request_id, d.index)] = d.finish_reason
    return {key: (tokenizer.decode([t for t in ids if t != eos]), finish[key]) for key, ids in tokens.items()}


def check(text: str, kind: str) -> None:
    if kind in SCHEMAS:
        check_json(text, kind)
    elif kind == "regex":
        check_regex(text)
    else:
        check_choice(text)


SPECS = {
    **{name: StructuredOutputs(json=json.dumps(schema)) for name, schema in SCHEMAS.items()},
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
}


@pytest.mark.parametrize("preemption_mode, num_gpu_blocks, ahead", [
    ("swap", 400, True),  # roomy cache, overlapped scheduling
    ("swap", 44, True),  # tight cache: preempted by swap
    ("recompute", 44, False),  # tight cache: preempted by recompute
])
def test_every_constrained_sample_is_accepted_by_its_grammar(model_dir, grammars, preemption_mode,
                                                             num_gpu_blocks, ahead):
    tokenizer = hf_tokenizer(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = SchedulerConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, max_num_seqs=8,
                             max_num_batched_tokens=32, preemption_mode=preemption_mode, vocab_size=VOCAB,
                             debug_invariants=True)
    sched = Scheduler(config, grammars)
    worker = MaskedSamplingWorker(config, eos)
    kinds = {}
    for i, kind in enumerate(["person", "points", "reading", "regex", "choice", "person", "points", "regex"]):
        n = 3 if i == 1 else 1
        sched.add_request(constrained(f"{kind}-{i}", SPECS[kind], eos, n=n))
        kinds[f"{kind}-{i}"] = kind
    for i in range(2):  # long unconstrained requests press on the cache
        sched.add_request(AddRequest(request_id=f"plain-{i}", prompt_token_ids=[9] * 7,
                                     sampling=SamplingParams(max_tokens=100, ignore_eos=True), eos_token_ids=[eos]))
    deltas = run_until_done(sched, worker, ahead=ahead)
    samples = texts_by_sample(deltas, tokenizer, eos)
    assert len(samples) == 8 + 2 + 2  # the n=3 request has three samples
    for (request_id, index), (text, finish) in samples.items():
        if request_id.startswith("plain"):
            assert finish == "length"
            continue
        assert finish == "stop", (request_id, text)
        check(text, kinds[request_id])
    assert sched.stats()["structured_output_requests"] == 8
    if num_gpu_blocks < 100:
        stats = sched.stats()
        assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0
    assert_all_blocks_free(sched)


def test_constrained_requests_sit_out_steps_scheduled_ahead_while_others_stay_overlapped(model_dir, grammars):
    tokenizer = hf_tokenizer(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = SchedulerConfig(block_size=4, num_gpu_blocks=200, max_num_seqs=8, max_num_batched_tokens=64,
                             vocab_size=VOCAB)
    sched = Scheduler(config, grammars)
    worker = MaskedSamplingWorker(config, eos)
    sched.add_request(constrained("json", SPECS["person"], eos, max_tokens=400))
    for i in range(3):
        sched.add_request(AddRequest(request_id=f"plain-{i}", prompt_token_ids=[9, 10, 11],
                                     sampling=SamplingParams(max_tokens=60, ignore_eos=True), eos_token_ids=[eos]))
    driver = StepDriver(sched, worker, ahead=True)
    masked_ahead = masked_alone = 0

    def on_schedule(out):
        nonlocal masked_ahead, masked_alone
        if out.grammar is None:
            return
        assert out.grammar.req_ids == ["json"]
        # the step before it is applied: the mask was filled after the request's last token
        assert all(pending.grammar is None for pending in driver.pending)
        if driver.pending:
            masked_ahead += 1
        else:
            masked_alone += 1

    driver.on_schedule = on_schedule
    while driver.busy():
        driver.step()
    assert driver.steps_ahead > 10  # the plain requests kept overlapping
    assert masked_ahead > 3  # and the constrained one ran in steps scheduled ahead too


def test_with_ignore_eos_and_no_stop_ids_the_grammar_ends_the_sample_when_complete(model_dir, grammars):
    """xgrammar refuses an empty stop-token list: this request once crashed the scheduler process."""
    tokenizer = hf_tokenizer(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=100, max_num_seqs=4, max_num_batched_tokens=32,
                                      vocab_size=VOCAB), grammars)
    for kind in ("person", "regex"):
        sched.add_request(AddRequest(request_id=f"{kind}-0", prompt_token_ids=[5, 6, 7], eos_token_ids=[eos],
                                     sampling=SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True,
                                                             structured_outputs=SPECS[kind])))
    deltas = run_until_done(sched, MaskedSamplingWorker(sched.config, eos))
    for (request_id, _), (text, finish) in texts_by_sample(deltas, tokenizer, eos).items():
        assert finish == "stop", (request_id, text)
        check(text, request_id.split("-")[0])
    assert all(d.new_token_ids.count(eos) == 0 for d in deltas)  # no stop token was ever allowed


def test_the_time_spent_filling_masks_is_counted_within_the_run_and_each_constrained_request_once(model_dir, grammars):
    eos = hf_tokenizer(model_dir).convert_tokens_to_ids("<|im_end|>")
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=100, max_num_seqs=4, max_num_batched_tokens=32,
                                      vocab_size=VOCAB), grammars)
    sched.add_request(constrained("regex", SPECS["regex"], eos))
    sched.add_request(constrained("choice", SPECS["choice"], eos))
    started = time.perf_counter()
    run_until_done(sched, MaskedSamplingWorker(sched.config, eos))
    elapsed = time.perf_counter() - started
    stats = sched.stats()
    assert 0 < stats["structured_output_mask_time_s"] <= elapsed  # a share of the run, however fast the machine
    assert stats["structured_output_requests"] == 2


def test_a_grammar_that_cannot_compile_is_refused_at_admission_naming_the_problem(grammars):
    config = SchedulerConfig(block_size=4, num_gpu_blocks=20, max_num_seqs=4, max_num_batched_tokens=32,
                             vocab_size=VOCAB)
    sched = Scheduler(config, grammars)
    deltas = sched.add_request(constrained("bad", StructuredOutputs(regex="([a-z"), 2))
    assert deltas[0].finish_reason == "error" and deltas[0].error_kind == "invalid_request"
    assert "structured_outputs: regex cannot be compiled" in deltas[0].error
    deltas = sched.add_request(constrained("two", StructuredOutputs(regex="a", choice=["b"]), 2))
    assert deltas[0].error_kind == "invalid_request" and "exactly one" in deltas[0].error
    unserved = Scheduler(config)  # no tokenizer: refused, never ignored
    deltas = unserved.add_request(constrained("x", SPECS["regex"], 2))
    assert deltas[0].error_kind == "invalid_request" and "structured output" in deltas[0].error


def test_messages_after_a_first_constrained_request_wait_in_order_for_the_grammar_backend(model_dir):
    from pagedserve.protocol.messages import AbortRequest
    from pagedserve.scheduler_proc.grammar_cache import GrammarBackendLoader
    from pagedserve.scheduler_proc.grammar_gate import GrammarGate

    loader = GrammarBackendLoader(model_dir)
    gate = GrammarGate(loader)
    plain = AddRequest(request_id="plain", prompt_token_ids=[5], sampling=SamplingParams())
    json_request = constrained("json", SPECS["regex"], 2)
    abort = AbortRequest(request_ids=["json"])
    assert gate.admit([plain, json_request, abort]) == [plain]  # the loader starts in a thread
    loader.wait()
    assert loader.ready()
    assert gate.admit([plain]) == [json_request, abort, plain]
    assert gate.admit([json_request]) == [json_request]  # loaded: nothing is held any more


def test_a_grammar_compiles_in_a_thread_while_the_messages_after_it_wait_in_order(model_dir, grammars):
    """A grammar that takes seconds to compile must not hold the loop (its steps, its heartbeats):
    the gate compiles it in a thread and holds its request, and what came after, until it is
    ready; a grammar that fails is answered from the cache, not compiled again."""
    from pagedserve.protocol.messages import AbortRequest
    from pagedserve.scheduler_proc.grammar_gate import GrammarGate

    grammars.loader.wait()
    gate = GrammarGate(grammars.loader)
    gate.cache = grammars
    spec = StructuredOutputs(json=json.dumps({"type": "object", "properties": {"a": {"enum": ["gate", "kept"]}}}))
    slow = constrained("slow", spec, 2)
    plain = AddRequest(request_id="plain", prompt_token_ids=[5], sampling=SamplingParams())
    abort = AbortRequest(request_ids=["slow"])
    assert gate.admit([plain, slow, abort]) == [plain]
    gate._compiling[1].result(timeout=60)  # the thread's work, not a sleep
    assert gate.admit([plain]) == [slow, abort, plain] and grammars.known(spec)
    assert gate.admit([constrained("again", spec, 2)])[0].request_id == "again"  # compiled once
    broken = constrained("broken", StructuredOutputs(grammar='root ::= "a" rest'), 2)
    assert gate.admit([broken]) == []
    gate._compiling[1].exception(timeout=60)
    assert gate.admit([]) == [broken]
    deltas = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=64, max_model_len=128), grammars).add_request(broken)
    assert deltas[0].error_kind == "invalid_request" and "structured_outputs" in deltas[0].error
