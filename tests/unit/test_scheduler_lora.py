"""LoRA adapters on the scheduler's side (scheduler_proc/lora_slots.py), through the real Scheduler
and a simulated worker that checks every KV slot, with a model of the workers' adapter slots that
fails whenever a step would compute a request with weights other than its adapter's."""

from __future__ import annotations

import hashlib
import random

import pytest

from pagedserve.protocol import messages as m
from pagedserve.protocol.block_hash import adapter_seed, prefix_block_hashes
from pagedserve.protocol.codec import Decoder, encode
from pagedserve.protocol.messages import LoRAAdapter, LoRAStep, SchedulerOutput
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.protocol.trace import TraceWriter
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.scheduler_proc.frontend_inputs import apply_frontend_message
from pagedserve.scheduler_proc.replay import replay_scheduler
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request

POLICIES = ["fcfs", "priority", "deadline", "fair"]


def adapter(name: str, version: int = 0) -> LoRAAdapter:
    digest = hashlib.sha256(f"{name}:{version}".encode()).hexdigest()
    return LoRAAdapter(name, lora_id=1 + sum(map(ord, name)), path=f"/adapters/{name}", digest=digest)


def lora_request(rid: str, prompt: list[int], lora: str = "", **sampling) -> m.AddRequest:
    msg = request(rid, prompt, **sampling)
    msg.lora_name = lora
    return msg


def config(**overrides) -> SchedulerConfig:
    settings = dict(block_size=4, num_gpu_blocks=128, max_num_seqs=16, max_num_batched_tokens=64,
                    enable_lora=True, max_loras=4, debug_invariants=True)
    settings.update(overrides)
    return SchedulerConfig(**settings)


class SlotModel:
    """The workers' adapter slots, as the contract has them: a LoRAStep before its SchedulerOutput
    (forget, then loads, before the forward); each new request's slot from ``request_slots``. Fails
    when a request is computed with a slot not holding its adapter (or one at all, for the base
    model), or when a load replaces the adapter of a slot a request the workers hold computes with."""

    def __init__(self, adapter_of: dict[str, str]):
        self.adapter_of = adapter_of  # request id -> adapter name ("" base)
        self.slots: dict[int, LoRAAdapter] = {}
        self.held: dict[str, int] = {}  # sequence id -> slot, while the workers hold it
        self.steps: dict[int, LoRAStep] = {}  # scheduled, not yet applied
        self.applied: list[LoRAStep] = []
        self.slot_history: dict[str, list[int]] = {}  # sequence id -> the slot of each arrival

    def scheduled(self, sched: Scheduler, out: SchedulerOutput) -> None:
        lora_step = sched.take_lora_step()
        if lora_step is not None:
            assert lora_step.step == out.step
            self.steps[out.step] = lora_step

    def run(self, out: SchedulerOutput) -> None:
        for seq_id in out.finished_req_ids:
            self.held.pop(seq_id, None)
        lora_step = self.steps.pop(out.step, None)
        if lora_step is not None:
            self.applied.append(lora_step)
            for name in lora_step.forget:
                self.slots = {slot: a for slot, a in self.slots.items() if a.name != name}
            for load in lora_step.loads:
                users = [s for s, slot in self.held.items() if slot == load.slot]
                assert not users, f"step {out.step}: slot {load.slot} reloaded while {users} compute with it"
                self.slots[load.slot] = load.adapter
            new_ids = {r.req_id for r in out.new_requests}
            assert set(lora_step.request_slots) <= new_ids, f"step {out.step}: slots for requests not new"
        request_slots = lora_step.request_slots if lora_step is not None else {}
        for new in out.new_requests:
            name = self.adapter_of[new.req_id.split("/")[0]]
            assert (new.req_id in request_slots) == bool(name), f"step {out.step}: {new.req_id} ({name!r})"
            if name:
                self.held[new.req_id] = request_slots[new.req_id]
                self.slot_history.setdefault(new.req_id, []).append(request_slots[new.req_id])
        for seq_id in [r.req_id for r in out.new_requests] + [r.req_id for r in out.cached_requests] \
                + list(out.decodes.req_ids):
            name = self.adapter_of[seq_id.split("/")[0]]
            if name:
                slot = self.held[seq_id]
                assert self.slots[slot].name == name, f"step {out.step}: {seq_id} of {name!r} computes with {slot}"


class LoRARun:
    """A Scheduler, the simulated worker and the slot model, stepped as the engine does."""

    def __init__(self, ahead: bool = False, adapters=("a", "b", "c", "d", "e", "f"), proposer=None, **overrides):
        self.config = config(**overrides)
        self.turn = 0
        self.sched = Scheduler(self.config, clock=lambda: float(self.turn), proposer=proposer)
        self.adapter_of: dict[str, str] = {}
        self.model = SlotModel(self.adapter_of)
        worker = SimWorker(self.config, counting_tokens())
        run = worker.step

        def step(out):
            self.model.run(out)
            return run(out)

        worker.step = step
        self.driver = StepDriver(self.sched, worker, ahead)
        self.driver.on_schedule = lambda out: self.model.scheduled(self.sched, out)
        self.started: dict[str, int] = {}  # request id -> the turn its first sequence was scheduled
        self.finished: dict[str, int] = {}
        self.steps: list[SchedulerOutput] = []
        for name in adapters:
            self.sched.register_lora(adapter(name))

    def add(self, rid: str, lora: str = "", prompt=None, **sampling) -> list:
        self.adapter_of[rid] = lora
        sampling.setdefault("max_tokens", 6)
        sampling.setdefault("ignore_eos", True)
        return self.sched.add_request(lora_request(rid, prompt or [10 + len(rid), 11, 12, 13, 14], lora, **sampling))

    def step(self) -> SchedulerOutput:
        out, _, outputs = self.driver.step()
        self.steps.append(out)
        for r in out.new_requests:
            self.started.setdefault(r.req_id.split("/")[0], self.turn)
        for d in [*self.driver.timed_out, *outputs]:
            assert d.error is None, d
            if d.finish_reason:
                self.finished[d.request_id] = self.turn
        self.driver.timed_out.clear()
        self.turn += 1
        return out

    def run_until_done(self, max_turns: int = 2000) -> None:
        while self.driver.busy():
            assert self.turn < max_turns, self.sched.stats()
            self.step()
        assert_all_blocks_free(self.sched)
        assert self.sched.lora.slot_refs == [0] * self.config.max_loras


# ---------------------------------------------------------------- a mixed batch


def test_one_step_holds_four_adapters_and_the_base_model_each_request_with_its_slot():
    run = LoRARun()
    for i, name in enumerate(["a", "b", "", "c", "d", "a", ""]):
        assert run.add(f"r{i}", name) == []
    out = run.step()
    assert len(out.new_requests) == 7
    [lora_step] = run.model.applied
    assert lora_step.step == out.step
    assert sorted(load.adapter.name for load in lora_step.loads) == ["a", "b", "c", "d"]
    assert sorted(load.slot for load in lora_step.loads) == [0, 1, 2, 3]
    slot_of = {load.adapter.name: load.slot for load in lora_step.loads}
    assert lora_step.request_slots == {"r0": slot_of["a"], "r1": slot_of["b"], "r3": slot_of["c"],
                                       "r4": slot_of["d"], "r5": slot_of["a"]}  # the base model's: absent
    assert [a.name for a in lora_step.prefetch] == ["a", "b", "c", "d", "e", "f"]  # registered before
    run.run_until_done()


def test_all_samples_of_a_request_share_its_adapter_slot():
    run = LoRARun()
    run.add("r0", "b", n=3, max_tokens=5)
    run.run_until_done()
    slots = {seq_id: history for seq_id, history in run.model.slot_history.items()}
    assert set(slots) >= {"r0/0", "r0/1", "r0/2"}
    assert len({slot for history in slots.values() for slot in history}) == 1


def test_without_lora_no_step_carries_a_lora_step_and_no_request_may_name_an_adapter():
    sched = Scheduler(config(enable_lora=False))
    [error] = sched.add_request(lora_request("r0", [1, 2, 3], "a"))
    assert error.finish_reason == "error" and error.error_kind == "invalid_request"
    assert "'a'" in error.error and "--enable-lora" in error.error
    sched.add_request(lora_request("r1", [1, 2, 3]))
    sched.schedule()
    assert sched.take_lora_step() is None and sched.lora is None
    assert "max_lora" not in sched.stats()
    assert not sched.has_lora_changes() and sched.lora_adapters() == []  # the engine asks both of any scheduler


# ---------------------------------------------------------------- the limit, without starvation


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_fifth_adapter_starts_within_a_bound_while_the_resident_four_keep_flowing(policy, ahead):
    """Four resident adapters, each with a request arriving every turn and each request running
    10 tokens: their slots never free on their own. A request of a fifth adapter waits, then one
    resident adapter drains (nothing new of it starts) and it takes that slot; the other three
    keep starting requests every turn meanwhile."""
    run = LoRARun(ahead=ahead, scheduling_policy=policy, max_num_seqs=64, num_gpu_blocks=512,
                  max_num_batched_tokens=256)
    resident = ["a", "b", "c", "d"]
    started_by_turn: dict[int, set[str]] = {}
    for turn in range(60):
        for name in resident:
            run.add(f"{name}{turn}", name, max_tokens=10)
        if turn == 5:
            run.add("late", "e", max_tokens=10)
        run.step()
        started_by_turn[run.turn - 1] = {run.adapter_of[r] for r, t in run.started.items() if t == run.turn - 1}
    assert "late" in run.started
    waited = run.started["late"] - 5
    assert waited <= 10 + 3, f"the fifth adapter waited {waited} turns"  # the drained one's last run + a step or two
    flowing = [t for t in range(6, run.started["late"]) if len(started_by_turn[t] & set(resident)) >= 3]
    assert len(flowing) >= run.started["late"] - 6 - 1, started_by_turn  # three of four kept starting
    run.run_until_done()


def test_requests_waiting_for_a_slot_start_first_come_first_served():
    run = LoRARun(max_loras=2, max_num_seqs=32, num_gpu_blocks=256, max_num_batched_tokens=128)
    for turn in range(40):
        for name in ("a", "b"):
            run.add(f"{name}{turn}", name, max_tokens=6)
        if turn == 2:
            run.add("e-first", "e", max_tokens=6)
        if turn == 3:
            run.add("f-second", "f", max_tokens=6)
        run.step()
    assert run.started["e-first"] < run.started["f-second"], run.started
    assert run.started["f-second"] - 3 <= 2 * (6 + 3)
    run.run_until_done()


def test_a_base_model_request_behind_one_waiting_for_a_slot_starts_at_once():
    run = LoRARun(max_loras=1, max_num_seqs=8)
    run.add("a0", "a", max_tokens=20)
    run.step()
    run.add("b0", "b", max_tokens=3)  # no slot: waits for a's
    run.add("base", "", max_tokens=3)
    run.add("a1", "a", max_tokens=3)  # a is being drained for b: waits too
    run.step()
    assert run.started.get("base") == 1 and "b0" not in run.started and "a1" not in run.started
    assert run.sched.stats()["waiting_lora_adapters"] == ["a", "b"]
    run.run_until_done()
    assert run.started["a0"] < run.started["b0"] < run.started["a1"]  # a1 after b0, who waited first


def test_requests_behind_one_waiting_for_a_slot_start_in_their_own_arrival_order():
    run = LoRARun(max_loras=1, max_num_seqs=2)
    run.add("a0", "a", max_tokens=20)
    run.step()
    run.add("b0", "b", max_tokens=3)  # no slot: set aside
    run.add("base1", "", max_tokens=3)
    run.add("base2", "", max_tokens=3)
    run.step()  # one seat left: the older of the two behind b0
    assert "base1" in run.started and "base2" not in run.started and "b0" not in run.started
    run.run_until_done()
    assert run.started["base1"] < run.started["base2"]


def test_the_adapter_drained_for_a_waiting_one_is_the_least_recently_admitted_never_the_one_just_loaded():
    run = LoRARun(max_loras=2, max_num_seqs=16)
    run.add("a0", "a", max_tokens=4)
    run.add("b0", "b", max_tokens=30)
    run.add("b1", "b", max_tokens=30)  # b holds more references than c will
    run.step()
    run.add("c0", "c", max_tokens=30)  # waits: a, admitted first, drains and frees first
    run.add("d0", "d", max_tokens=30)  # waits behind c
    while "c0" not in run.started:
        run.step()
    run.add("c1", "c", max_tokens=4)  # c was just loaded: b drains for d, c keeps starting requests
    run.step()
    assert "c1" in run.started and "d0" not in run.started
    assert run.sched.lora.slot_adapter[run.sched.lora.draining] == adapter("b")
    run.run_until_done()
    assert run.started["d0"] <= run.started["c0"] + 30 + 2


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_a_referenced_slot_is_never_reloaded_under_preemption(mode, seed):
    """A small cache and more adapters than slots: sequences are preempted again and again. The
    slot model fails if a load hits a slot a held request computes with; under swap every
    request comes back to the slot it left (never reloaded while it was out)."""
    rng = random.Random(seed)
    run = LoRARun(ahead=bool(seed % 2), max_loras=2, num_gpu_blocks=24, num_cpu_blocks=96, max_num_seqs=6,
                  max_num_batched_tokens=32, preemption_mode=mode,
                  scheduling_policy=POLICIES[seed % len(POLICIES)])
    for i in range(24):
        name = rng.choice(["", "a", "b", "c", "d"])
        n = rng.choice([1, 1, 2])
        run.add(f"r{i}", name, prompt=[rng.randrange(20, 90) for _ in range(rng.randrange(3, 40))],  # some chunked
                max_tokens=rng.randrange(4, 24), n=n)
        if i % 3 == 2:
            run.step()
    run.run_until_done()
    stats = run.sched.stats()
    assert stats[f"num_preemptions_{mode}"] > 0, stats
    assert any(r.num_computed_tokens + r.num_scheduled_tokens < len(r.token_ids) - 1
               for out in run.steps for r in out.new_requests), "no prompt was chunked"
    assert len(run.finished) == 24
    if mode == "swap":
        moved = {seq_id: h for seq_id, h in run.model.slot_history.items() if len(set(h)) > 1}
        assert not moved, f"swapped sequences came back to another slot: {moved}"


def test_speculative_decoding_runs_on_each_requests_adapter_with_the_slots_held():
    """Prompt-lookup proposals are verified by the request's own adapter: the slot rules hold."""
    class RightGuess:  # proposes the simulated worker's next tokens
        def propose(self, tokens, max_tokens: int) -> list[int]:
            return [1000 + len(tokens) + j for j in range(max_tokens)]

    run = LoRARun(ahead=True, max_loras=2, speculative=SpeculativeConfig("ngram", 3, 4, 1), proposer=RightGuess())
    for i, name in enumerate(["a", "b", "c", "", "a", "c"]):
        run.add(f"r{i}", name, max_tokens=12)
    run.run_until_done()
    assert len(run.finished) == 6
    assert run.sched.stats()["spec_decode_num_drafts"] > 0


# ---------------------------------------------------------------- the prefix cache


def test_prefix_cache_blocks_are_never_shared_across_adapters():
    run = LoRARun(enable_prefix_caching=True)
    prompt = list(range(100, 113))  # three full blocks of 4, and a token
    run.add("a0", "a", prompt=prompt, max_tokens=2)
    run.run_until_done()
    hits = {}
    for rid, name in (("b0", "b"), ("base", ""), ("a1", "a")):
        run.add(rid, name, prompt=prompt, max_tokens=2)
        [new] = run.step().new_requests
        hits[rid] = new.num_computed_tokens
        run.run_until_done()
    assert hits == {"b0": 0, "base": 0, "a1": 12}


def test_blocks_are_named_as_the_router_names_them_for_each_adapter():
    """The cache events the router reads carry the hashes it computes with the adapter's seed."""
    run = LoRARun(enable_prefix_caching=True)
    prompt = list(range(200, 209))  # two full blocks of 4, and a token
    run.add("c0", "c", prompt=prompt, max_tokens=2)
    run.run_until_done()
    _, _, stored, _ = run.sched.cache_events.drain()
    seeded = prefix_block_hashes(prompt, 4, seed=adapter_seed(adapter("c").digest))
    assert seeded and set(seeded) <= set(stored)
    assert not set(prefix_block_hashes(prompt, 4)) & set(stored)


# ---------------------------------------------------------------- the registry


def test_an_unknown_adapter_is_refused_at_once_naming_it():
    run = LoRARun(adapters=("a",))
    [error] = run.add("r0", "nope")
    assert (error.finish_reason, error.error_kind) == ("error", "invalid_request")
    assert "'nope'" in error.error and "not loaded" in error.error
    assert not run.sched.has_unfinished()


def test_an_embedding_request_naming_an_adapter_is_refused():
    run = LoRARun(adapters=("a",))
    msg = lora_request("e0", [1, 2, 3], "a")
    msg.pooling = "mean"
    [error] = run.sched.add_request(msg)
    assert error.error_kind == "invalid_request" and "embedding" in error.error and "'a'" in error.error


def test_unloading_ends_the_waiting_requests_of_it_finishes_the_running_then_the_workers_forget_it():
    run = LoRARun(max_loras=1, max_num_seqs=1, adapters=("a",))
    run.add("running", "a", max_tokens=6)
    run.step()
    run.add("waiting", "a", max_tokens=6)  # no seat: waits
    deltas, _ = apply_frontend_message(run.sched, m.UnloadLoRA("a"), False)
    [error] = deltas
    assert (error.request_id, error.finish_reason, error.error_kind) == ("waiting", "error", "invalid_request")
    assert "'a'" in error.error and "unloaded" in error.error
    [refused] = run.add("after", "a")
    assert "not loaded" in refused.error
    while run.sched.has_unfinished():
        run.step()
        forgets = [name for s in run.model.applied for name in s.forget]
        assert not forgets or "running" in run.finished  # told to forget only after the last one ended
    assert run.sched.has_lora_changes()  # the engine steps for it, idle or not
    run.step()
    assert [name for s in run.model.applied for name in s.forget] == ["a"]
    assert run.sched.lora.slot_adapter == [None]


def test_load_lora_prefetches_it_at_the_next_step_and_reregistering_with_new_weights_moves_waiting_requests():
    run = LoRARun(max_loras=1, adapters=())
    apply_frontend_message(run.sched, m.LoadLoRA(adapter("a")), False)
    run.add("a0", "a", max_tokens=8)
    run.step()
    [first] = run.model.applied
    assert [a.name for a in first.prefetch] == ["a"] and first.loads[0].adapter == adapter("a")
    run.sched.register_lora(adapter("a"))  # the same digest again: nothing changes
    assert run.sched.take_lora_step() is None
    run.add("a1", "a", max_tokens=2, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    run.sched.register_lora(adapter("a", version=2))  # new weights under the name
    waiting = run.sched.requests["a1"]
    assert waiting.lora == adapter("a", version=2)  # it had not started: computed by the new weights
    assert waiting.prefix_seed == adapter_seed(adapter("a", version=2).digest)
    assert run.sched.requests["a0"].lora == adapter("a")  # started: finishes with the old ones
    run.run_until_done()
    loads = [load.adapter for s in run.model.applied for load in s.loads]
    assert loads == [adapter("a"), adapter("a", version=2)]
    assert not [name for s in run.model.applied for name in s.forget]  # the name lives on


# ---------------------------------------------------------------- worker restarts


def test_after_the_workers_are_replaced_every_adapter_and_every_occupied_slot_is_sent_again():
    run = LoRARun(max_loras=2)
    run.add("r0", "a")
    run.add("r1", "c")
    run.step()
    slots = list(run.sched.lora.slot_adapter)
    run.sched.fail_all("worker died")
    run.sched.add_request(lora_request("r2", [1, 2, 3]))
    out = run.sched.schedule()
    resent = run.sched.take_lora_step()
    assert resent.step == out.step
    assert [a.name for a in resent.prefetch] == ["a", "b", "c", "d", "e", "f"]
    assert [(load.slot, load.adapter) for load in resent.loads] == [(i, a) for i, a in enumerate(slots)]
    successor = Scheduler(run.config, lora_adapters=run.sched.lora_adapters())  # a new cache size
    successor.add_request(lora_request("r3", [1, 2, 3]))
    successor.schedule()
    assert [a.name for a in successor.take_lora_step().prefetch] == ["a", "b", "c", "d", "e", "f"]


# ---------------------------------------------------------------- stats


def test_stats_name_the_running_and_waiting_adapters_and_count_their_tokens():
    run = LoRARun(max_loras=1, adapters=("a", "b"))
    run.add("a0", "a", max_tokens=4)
    run.step()
    run.add("b0", "b", max_tokens=3)
    run.step()
    stats = run.sched.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"], stats["max_lora"]) == (["a"], ["b"], 1)
    run.run_until_done()
    assert run.sched.stats()["generation_tokens_by_lora"] == {"a": 4, "b": 3}
    m.SchedulerStats(replica=0, state="ready", **run.sched.stats())  # the wire message takes them


# ---------------------------------------------------------------- trace replay

HELLO = m.WorkerHello(rank=0, pid=1, device="cpu", model_id="test", num_layers=2, block_bytes=4096,
                      max_gpu_blocks=64)


def record(path: str, restart: bool = False, tamper=None) -> None:
    """A run recorded as the engine loop records it: frontend frames, each step's LoRAStep (when it
    has one) then its SchedulerOutput, the results, and a worker restart (fail_all, WorkerInit)."""
    cfg = EngineConfig(run_dir="", block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                       enable_lora=True, max_loras=2, enable_prefix_caching=True, debug_invariants=True)
    init = m.WorkerInit(block_size=4, num_gpu_blocks=24, num_cpu_blocks=0, max_model_len=128, seed=0)
    writer = TraceWriter(path)
    writer.write_header(HELLO, init, cfg.trace_config())
    writer.append("to_worker", encode(init))
    sched = Scheduler(cfg.scheduler_config(init.num_gpu_blocks, init.num_cpu_blocks))
    worker = SimWorker(sched.config, counting_tokens())
    rng = random.Random(7)
    inputs = [m.LoadLoRA(adapter(name)) for name in "abc"]
    inputs += [lora_request(f"r{i}", [rng.randrange(20, 60) for _ in range(rng.randrange(3, 12))],
                            rng.choice(["", "a", "b", "c"]), max_tokens=rng.randrange(2, 12), ignore_eos=True)
               for i in range(12)]
    inputs.insert(9, m.UnloadLoRA("c"))
    for turn in range(400):
        for msg in inputs[turn * 3:turn * 3 + 3]:
            writer.append("from_frontend", encode(msg))
            apply_frontend_message(sched, msg, False)
        if restart and turn == 4:
            writer.append("fail_all", b"worker died")
            sched.fail_all("worker died")
            worker = SimWorker(sched.config, counting_tokens())
            writer.append("to_worker", encode(init))
        if not sched.has_unfinished() and turn * 3 >= len(inputs):
            break
        out = sched.schedule(float(turn))
        lora_step = sched.take_lora_step()
        if lora_step is not None:
            writer.append("to_worker", encode(tamper(lora_step) if tamper else lora_step))
        writer.append("to_worker", encode(out))
        result = worker.step(out)
        writer.append("from_worker", encode(result))
        sched.update_from_output(out, result)
    writer.close()


@pytest.mark.parametrize("restart", [False, True], ids=["steady", "worker-restart"])
def test_a_trace_with_lora_frames_replays_every_lora_step_byte_for_byte(tmp_path, restart):
    path = str(tmp_path / "lora.trace")
    record(path, restart)
    frames = [Decoder(m.SchedulerToWorker).decode(p) for d, p in _records(path) if d == "to_worker"]
    lora_steps = [f for f in frames if isinstance(f, LoRAStep)]
    assert any(s.loads for s in lora_steps) and any(s.request_slots for s in lora_steps)
    if restart:  # the new workers get the registered adapters again, not the unloaded one
        resent = [s for s in lora_steps if s.step >= 5 and s.prefetch]  # turn 4 schedules step 5
        assert resent and [a.name for a in resent[0].prefetch] == ["a", "b"]
    else:
        assert any(s.forget == ["c"] for s in lora_steps)
    report = replay_scheduler(path)
    assert report.ok, report.mismatch
    assert report.steps == sum(isinstance(f, SchedulerOutput) for f in frames)


def test_a_replay_names_a_lora_step_that_differs_from_the_recorded_one(tmp_path):
    path = str(tmp_path / "tampered.trace")

    def shift_slots(lora_step: LoRAStep) -> LoRAStep:
        lora_step.request_slots = {rid: slot + 1 for rid, slot in lora_step.request_slots.items()}
        return lora_step

    record(path, tamper=shift_slots)
    report = replay_scheduler(path)
    assert not report.ok and "LoRAStep" in report.mismatch and "request_slots" in report.mismatch


def _records(path: str):
    from pagedserve.protocol.trace import read_trace
    return read_trace(path).records


# ---------------------------------------------------------------- the engine loop


def test_the_engine_sends_each_lora_step_right_before_its_step_and_records_both(tmp_path):
    """The real engine loop over real sockets in one process, a simulated worker on a thread: a
    LoRAStep reaches the worker just before the SchedulerOutput of its step (async scheduling on),
    adapters registered while idle go out at once, and the recorded trace replays byte for byte."""
    import os
    import threading

    import zmq

    from pagedserve.protocol.worker_link import SchedulerLink
    from pagedserve.protocol.zmq_io import Endpoints, Receiver, make_run_dir
    from pagedserve.scheduler_proc.engine import EngineLoop

    ctx, run_dir, trace = zmq.Context(), make_run_dir(str(tmp_path)), str(tmp_path / "engine.trace")
    endpoints = Endpoints(run_dir)
    frontend = Receiver(ctx, endpoints.frontend_outputs(), m.SchedulerToFrontend)
    engine = EngineLoop(EngineConfig(run_dir=run_dir, enable_lora=True, max_loras=2, max_num_seqs=4, block_size=4,
                                     max_model_len=128, swap_space=0, debug_invariants=True, record_trace=trace), ctx)
    link = SchedulerLink(ctx, endpoints, replica=0, rank=0)
    frames, stop, failures = [], threading.Event(), []

    def worker() -> None:
        try:
            link.send(m.WorkerHello(0, os.getpid(), "cpu", "model", 2, 4096, 64))
            init = link.recv(timeout_ms=10_000)
            link.send(m.WorkerReady(0, init.num_gpu_blocks, init.num_cpu_blocks))
            sim = SimWorker(SchedulerConfig(block_size=4, num_gpu_blocks=init.num_gpu_blocks), counting_tokens())
            while not stop.is_set():
                msg = link.recv(timeout_ms=50)
                if msg is not None:
                    frames.append(msg)
                    if isinstance(msg, SchedulerOutput):
                        link.send(sim.step(msg))
        except Exception as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        engine.connect_workers()
        for name in ("a", "b", "c"):
            engine._handle_input(m.LoadLoRA(adapter(name)))
        assert engine.scheduler.has_lora_changes()  # what the loop asks: an idle engine still sends them
        engine.step()
        for i, name in enumerate(["a", "b", "", "c", "a", "b"]):
            engine._handle_input(lora_request(f"r{i}", [20 + i, 21, 22, 23, 24, 25], name, max_tokens=5 + i,
                                              ignore_eos=True))
        while engine.scheduler.has_unfinished() or engine.pending:
            engine.step()
    finally:
        stop.set()
        thread.join(timeout=10)
        engine.close()
        link.close()
        frontend.close()
        ctx.term()
    assert not failures, failures
    prefetch, empty = frames[:2]  # read ahead of the first request, in a step that computes nothing
    assert [a.name for a in prefetch.prefetch] == ["a", "b", "c"] and empty.total_num_scheduled_tokens == 0
    lora_steps = [(i, f) for i, f in enumerate(frames) if isinstance(f, LoRAStep)]
    assert lora_steps and any(f.loads for _, f in lora_steps)
    for i, lora_step in lora_steps:
        after = frames[i + 1]
        assert isinstance(after, SchedulerOutput) and after.step == lora_step.step
    seen_slots = {rid for _, f in lora_steps for rid in f.request_slots}
    assert seen_slots == {"r0", "r1", "r3", "r4", "r5"}
    report = replay_scheduler(trace)
    assert report.ok, report.mismatch
    assert report.steps == sum(isinstance(f, SchedulerOutput) for f in frames)
