"""A grammar that starts after the thinking (``StructuredOutputs.start_after``), through the
real scheduler with pure objects: no mask row until the output has generated the end tag's
tokens in a row, a row for every sample after it, and the text after the tag accepted by the
grammar while the thinking before it is free text. The end tag here is the demo tokenizer's
six BPE pieces of ``</think>``, so a false start (a partial tag, then the tag) is exercised.
"""

from __future__ import annotations

import json

import pytest

from pagedserve.protocol.messages import AddRequest, SamplingParams, StructuredOutputs
from pagedserve.protocol.validate import InvalidField, check_fields
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.grammar_cache import CompiledGrammarCache, GrammarBackendLoader
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.oracle import hf_tokenizer
from support.structured_schemas import SCHEMAS, check_json
from support.grammar_sim import MaskedSamplingWorker
from support.scheduler_sim import assert_all_blocks_free, run_until_done

VOCAB = 512
PROMPT = [5 + i % 40 for i in range(11)]


class ThinkingWorker(MaskedSamplingWorker):
    """Constrained requests write a scripted thinking while they get no mask row, then what
    their mask allows; plain requests, random tokens. Records, per sample of a constrained
    request, (output tokens so far, whether it was masked)."""

    def __init__(self, config, eos: int, thinking: list[int]):
        self.thinking = thinking
        self.samples: dict[str, list[tuple[int, bool]]] = {}
        super().__init__(config, eos, unmasked=self.free)

    def pick(self, req_id: str, tokens: list[int]) -> int:
        if not req_id.startswith("plain"):
            self.samples.setdefault(req_id, []).append((len(tokens) - len(PROMPT), req_id in self.allowed))
        return super().pick(req_id, tokens)

    def free(self, req_id: str, tokens: list[int]) -> int:
        written = len(tokens) - len(PROMPT)
        if req_id.startswith("plain") or written >= len(self.thinking):
            return self.rng.randrange(10, VOCAB)
        return self.thinking[written]


@pytest.fixture(scope="module")
def model(model_factory):
    """(tokenizer, its end of sequence, its pieces of </think>, the grammar compiler)."""
    model_dir = model_factory("qwen2")
    tokenizer = hf_tokenizer(model_dir)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    return (tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"), end,
            CompiledGrammarCache(GrammarBackendLoader(model_dir), VOCAB))


@pytest.mark.parametrize("preemption_mode, num_gpu_blocks, ahead", [
    ("swap", 400, True),  # roomy cache, overlapped scheduling
    ("recompute", 40, False),  # tight cache: preempted by recompute, the matcher kept on the sequence
])
def test_the_mask_starts_exactly_after_the_end_tag_and_the_rest_follows_the_grammar(
        model, preemption_mode, num_gpu_blocks, ahead):
    tokenizer, eos, end, grammars = model
    assert len(end) > 2
    # free text a JSON grammar refuses, a false start (a partial tag, its first piece again), the tag
    thinking = (tokenizer.encode("I think } is not JSON", add_special_tokens=False)
                + end[:3] + end[:1] + end)
    config = SchedulerConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, max_num_seqs=8,
                             max_num_batched_tokens=32, preemption_mode=preemption_mode, vocab_size=VOCAB,
                             debug_invariants=True)
    sched = Scheduler(config, grammars)
    worker = ThinkingWorker(config, eos, thinking)
    spec = StructuredOutputs(json=json.dumps(SCHEMAS["person"]), start_after=end)
    for i in range(3):
        sched.add_request(AddRequest(request_id=f"think-{i}", prompt_token_ids=PROMPT, eos_token_ids=[eos],
                                     sampling=SamplingParams(max_tokens=300, n=2 if i == 1 else 1,
                                                             temperature=1.0, structured_outputs=spec)))
    for i in range(2):  # long unconstrained requests press on the cache
        sched.add_request(AddRequest(request_id=f"plain-{i}", prompt_token_ids=[9] * 7, eos_token_ids=[eos],
                                     sampling=SamplingParams(max_tokens=100, ignore_eos=True)))
    deltas = run_until_done(sched, worker, ahead=ahead)

    outputs: dict[tuple[str, int], list[int]] = {}
    for d in deltas:
        assert d.error is None, d.error
        outputs.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
    assert len(outputs) == 4 + 2
    for (request_id, _), ids in outputs.items():
        if request_id.startswith("think"):
            assert ids[:len(thinking)] == thinking
            check_json(tokenizer.decode([t for t in ids[len(thinking):] if t != eos]), "person")
    for seq_id, samples in worker.samples.items():
        # a recomputed sequence samples its next token again: each (position, masked) is what counts
        assert {(written, masked) for written, masked in samples} == {
            (written, written >= len(thinking)) for written, _ in samples}, seq_id
        assert (len(thinking), True) in samples and (len(thinking) - 1, False) in samples
    assert num_gpu_blocks > 100 or sched.stats()["num_preemptions_recompute"] > 0
    assert_all_blocks_free(sched)


def test_thinking_that_never_ends_is_never_masked_and_ends_by_eos_or_length(model):
    tokenizer, eos, end, grammars = model
    config = SchedulerConfig(block_size=4, num_gpu_blocks=100, max_num_seqs=4, max_num_batched_tokens=32,
                             vocab_size=VOCAB)
    sched = Scheduler(config, grammars)
    worker = ThinkingWorker(config, eos, thinking=tokenizer.encode("free text " * 4, add_special_tokens=False))
    spec = StructuredOutputs(regex="[0-9]+", start_after=end)
    sched.add_request(AddRequest(request_id="think", prompt_token_ids=PROMPT, eos_token_ids=[eos],
                                 sampling=SamplingParams(max_tokens=30, temperature=1.0, structured_outputs=spec)))
    deltas = run_until_done(sched, worker)
    assert not any(masked for _, masked in worker.samples["think"])
    assert deltas[-1].finish_reason in ("length", "stop") and all(d.error is None for d in deltas)


def test_start_after_token_ids_are_checked_against_the_vocabulary():
    msg = AddRequest(request_id="r", prompt_token_ids=[5], sampling=SamplingParams(
        structured_outputs=StructuredOutputs(json_object=True, start_after=[VOCAB + 3])))
    with pytest.raises(InvalidField, match="start_after"):
        check_fields(msg, VOCAB)
    check_fields(msg, 0)  # vocabulary unknown: no check
