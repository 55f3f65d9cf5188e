"""The offline Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

It reuses the serving loop and swaps only the I/O: the same scheduler and worker
processes the supervisor starts (same command lines, a private run dir) and no HTTP
frontend; this object plays the frontend over the protocol. It binds the frontend's
output socket, pushes AddRequests to the schedulers, collects RequestDeltas until every
request finished, and detokenizes with the model directory's tokenizer.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import zmq

from pagedserve.deploy.children import Child, free_tcp_port, spawn
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m
from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineDiedError"]

Prompt = Union[str, list[int]]


class EngineDiedError(RuntimeError):
    """A scheduler or worker process exited while the LLM was using it."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result; ``text`` / ``token_ids`` / ``finish_reason`` are its first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float = 0.0  # time.perf_counter() when it was sent
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # when each delta of sample 0 arrived

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason


def _eos_token_ids(model_dir: Path, tokenizer) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if value is not None:
            ids += value if isinstance(value, list) else [value]
            break
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({int(i) for i in ids})


def _stop_children(children: list[Child], ctx: zmq.Context, run_dir: str) -> None:
    """Also the finalizer of an LLM that was never closed: takes no reference to it."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + 5
    for child in children:
        child.wait_or_kill(max(0.1, deadline - time.monotonic()))
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


class LLM:
    """Start one engine (schedulers + workers, no frontend) for ``model``; close() stops it.

    Keyword options are ``pagedserve serve``'s (ServeConfig fields): num_gpu_blocks,
    max_num_seqs, max_num_batched_tokens, block_size, preemption_mode, data_parallel_size, ...
    """

    def __init__(self, model: str, *, log_level: str = "WARNING", startup_timeout_s: float = 600.0,
                 **engine_options):
        from transformers import AutoTokenizer  # heavy: only the LLM object needs it

        self.config = ServeConfig(model=str(model), log_level=log_level, **engine_options)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.eos_token_ids = _eos_token_ids(Path(model), self.tokenizer)
        self._ids = itertools.count()
        self._ctx = zmq.Context()
        self.run_dir = str(make_run_dir(self.config.run_dir_parent))
        ep = Endpoints(self.run_dir)
        self._children: list[Child] = []
        self._finalizer = weakref.finalize(self, _stop_children, self._children, self._ctx, self.run_dir)
        self._ready = Receiver(self._ctx, ep.supervisor(), m.ToSupervisor)
        self._outputs = Receiver(self._ctx, ep.frontend_outputs(), m.SchedulerToFrontend)
        replicas = range(self.config.data_parallel_size)
        self._inputs = [Sender(self._ctx, ep.scheduler_inputs(r)) for r in replicas]
        self.stats: dict[int, m.SchedulerStats] = {}  # latest per replica
        self._in_flight = [0 for _ in replicas]
        try:
            self._start(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes

    def _start(self, timeout_s: float) -> None:
        cfg, tp = self.config, self.config.tensor_parallel_size
        expected = set()
        for replica in range(cfg.data_parallel_size):
            self._children.append(spawn("scheduler", replica, 0, cfg.scheduler_cmd(self.run_dir, replica)))
            dist_init = f"tcp://127.0.0.1:{free_tcp_port()}" if tp > 1 else None
            for rank in range(tp):
                self._children.append(
                    spawn("worker", replica, rank, cfg.worker_cmd(self.run_dir, replica, rank, dist_init)))
                expected.add(("worker", replica, rank))
            expected.add(("scheduler", replica, 0))
        deadline = time.monotonic() + timeout_s
        while expected:
            self._check_children()
            if time.monotonic() > deadline:
                raise EngineDiedError(f"engine not ready after {timeout_s:.0f}s: {sorted(expected)}")
            msg = self._ready.recv(timeout_ms=200)
            if isinstance(msg, m.ProcessReady):
                expected.discard((msg.role, msg.replica, msg.rank))

    def _check_children(self) -> None:
        for child in self._children:
            if child.popen.poll() is not None:
                raise EngineDiedError(f"{child.name} exited with code {child.popen.returncode}")

    def pids(self) -> list[int]:
        return [c.popen.pid for c in self._children]

    def close(self) -> None:
        """Stop every process this LLM started and remove its run dir."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # ------------------------------------------------------------------ generate

    def encode(self, prompt: Prompt) -> list[int]:
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: Sequence[Prompt], sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order; returns when all have finished."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        params = [sampling or SamplingParams()] * len(prompts) if not isinstance(sampling, (list, tuple)) \
            else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        pending: dict[str, tuple[int, RequestOutput, list[bool], int]] = {}  # index, output, done, replica
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            rid = f"offline-{next(self._ids)}"
            out = RequestOutput(rid, self.encode(prompt), [
                CompletionOutput(k, "", [], None) for k in range(sp.n)], arrival_time=time.perf_counter())
            replica = min(range(len(self._inputs)), key=self._in_flight.__getitem__)
            self._in_flight[replica] += 1
            pending[rid] = (i, out, [False] * sp.n, replica)
            self._inputs[replica].send(m.AddRequest(request_id=rid, prompt_token_ids=out.prompt_token_ids,
                                                    sampling=sp, eos_token_ids=self.eos_token_ids,
                                                    arrival_time=time.time()))
        self._collect(pending, results, use_tqdm)
        return results  # type: ignore[return-value]

    def _collect(self, pending: dict, results: list, use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), desc="generate", unit="req", disable=not use_tqdm)
        generated, started = 0, time.perf_counter()
        try:
            while pending:
                msg = self._outputs.recv(timeout_ms=1000)
                if msg is None:
                    self._check_children()
                    continue
                if isinstance(msg, m.SchedulerStats):
                    self.stats[msg.replica] = msg
                if not isinstance(msg, m.RequestOutputs):
                    continue
                now = time.perf_counter()
                for delta in m.iter_deltas(msg):
                    entry = pending.get(delta.request_id)
                    if entry is None:
                        continue
                    index, out, done, replica = entry
                    sample = out.outputs[delta.index]
                    sample.token_ids += delta.new_token_ids
                    generated += len(delta.new_token_ids)
                    if delta.index == 0 and delta.new_token_ids:
                        out.first_token_time = out.first_token_time or now
                        out.token_times.append(now)
                    if delta.finish_reason is None:
                        continue
                    sample.finish_reason, sample.error = delta.finish_reason, delta.error
                    sample.text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                    done[delta.index] = True
                    if all(done):
                        out.finish_time = now
                        results[index] = out
                        del pending[delta.request_id]
                        self._in_flight[replica] -= 1
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / max(now - started, 1e-9):.0f} tok/s", refresh=False)
        finally:
            bar.close()
            if pending:  # interrupted: free what the engine still holds for them
                by_replica: dict[int, list[str]] = {}
                for rid, (_i, _o, _d, replica) in pending.items():
                    by_replica.setdefault(replica, []).append(rid)
                    self._in_flight[replica] -= 1
                for replica, ids in by_replica.items():
                    self._inputs[replica].send(m.AbortRequest(ids))

    def refresh_stats(self, timeout_s: float = 2.0) -> dict[int, m.SchedulerStats]:
        """The next stats message of every replica: sent after the last step generate() saw."""
        deadline = time.monotonic() + timeout_s
        fresh: set[int] = set()
        while len(fresh) < len(self._inputs) and time.monotonic() < deadline:
            msg = self._outputs.recv(timeout_ms=100)
            if isinstance(msg, m.SchedulerStats):
                self.stats[msg.replica] = msg
                fresh.add(msg.replica)
        return self.stats
