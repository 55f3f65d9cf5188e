"""The offline Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

It reuses the serving loop and swaps only the I/O: the same scheduler and worker
processes the supervisor starts (same command lines, a private run dir) and no HTTP
frontend; this object plays the frontend over the protocol. It binds the frontend's
output socket, pushes AddRequests to the schedulers and collects RequestDeltas until every
request finished; text follows the HTTP frontend's rules (offline/outputs.py).

It never waits without end: every input is checked before anything is sent
(offline/inputs.py), a dead or hung scheduler raises EngineDiedError, dead workers are
replaced as ``serve`` replaces them (offline/supervision.py), and ``generate`` takes a timeout.
Replica choice (``router``, cache-aware included) and a silent replica's lost requests (they end
with finish_reason "error") are the HTTP frontend's, from the same engine session
(client/engine_session.py). Calls from several threads take turns.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import zmq

from pagedserve.deploy.children import Child
from pagedserve.deploy.launcher import Launcher, StartupError
from pagedserve.offline.chat import Conversation, chat_prompt_tokenizer, render_conversations
from pagedserve.offline.embed import (
    EmbeddingFailed, EmbeddingRequestOutput, PendingEmbedding, PoolingParams, PoolingRequestOutput,
    as_pooling_params_list)
from pagedserve.offline.engine_options import offline_config
from pagedserve.offline.lora import LoRARequest, LoRARequests, as_lora_list, new_adapters
from pagedserve.offline.inputs import (
    Prompt, SamplingParams, as_params_list, as_per_prompt, as_priority_list, as_prompt_list, check_engine_limits,
    prompt_text, prompt_token_ids)
from pagedserve.offline.outputs import CompletionOutput, PendingRequest, RequestOutput, progress_bar
from pagedserve.offline.supervision import EngineDiedError, Supervision
from pagedserve.offline.structured import StructuredOutputsParams
from pagedserve.protocol import messages as m
from pagedserve.client.detokenizer import TextDecoder
from pagedserve.client.engine_session import EngineSession, InFlight, Lost
from pagedserve.client.router import Router
from pagedserve.client.routing_policy import Decision, RoutingPolicy
from pagedserve.client.generation_defaults import load_generation_defaults
from pagedserve.client.lora_adapters import AdapterRegistry
from pagedserve.client.model_files import eos_token_ids, vocab_size
from pagedserve.client.pooling import Matryoshka, pooler_settings
from pagedserve.runtime.options import lora_module
from pagedserve.protocol.priority import priority_refusal
from pagedserve.protocol.validate import InvalidField, check_request
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineDiedError",
           "PoolingParams", "EmbeddingRequestOutput", "PoolingRequestOutput", "LoRARequest"]

WATCH_INTERVAL_S = 0.5  # how often generate looks at the processes, whatever arrives meanwhile


def _stop_processes(launcher: Launcher, ctx: zmq.Context, run_dir: str) -> None:
    """Also the finalizer of an LLM that was never closed: takes no reference to it."""
    launcher.stop()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


class LLM:
    """Start one engine (schedulers + workers, no frontend) for ``model``; close() stops it.

    Keyword options are ``pagedserve serve``'s (ServeConfig fields): num_gpu_blocks,
    max_num_seqs, max_num_batched_tokens, block_size, preemption_mode, data_parallel_size, ...;
    those only ``serve`` uses are refused (offline/engine_options.py). ``task="embed"`` (or vLLM's
    ``runner="pooling"``) makes an embedding engine for ``embed()`` and ``encode()``.
    ``router``: least-loaded (default), round-robin or cache-aware (with ``router_balance_abs`` /
    ``_rel``) over the replicas, as ``serve``'s frontend routes; ``replica_timeout_s`` as it applies it;
    ``scheduler_timeout_s``, ``max_restarts`` and ``restart_window_s`` as supervision.py applies them.
    ``enable_lora=True`` (with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``) serves LoRA adapters:
    ``generate(..., lora_request=LoRARequest(name, id, path))``; ``lora_modules`` (serve's NAME=PATH
    items) registers adapters at start, with ids 1, 2, ... in the order given (offline/lora.py).
    """

    def __init__(self, model: str, *, log_level: str = "WARNING", startup_timeout_s: float = 600.0,
                 **engine_options):
        self.config = offline_config(model, log_level, engine_options)
        model = self.config.model  # a GGUF file's: the model directory made of it (deploy/gguf_model_dir.py)
        # Two threads' calls would read each other's outputs off the one socket: calls take turns
        self._lock = threading.Lock()
        self.pooler = pooler_settings(self.config.pooling_type, self.config.pooler_config)
        if self.config.task == "embed":  # a sentence-transformers model's own pooler, as served
            self.pooler = self.pooler.under_model_defaults(model)
        # First: on CPU the launcher's fork server loads torch meanwhile (deploy/fork_client.py)
        self._ctx = zmq.Context()
        self.run_dir = str(make_run_dir(self.config.run_dir_parent))
        ep = Endpoints(self.run_dir)
        self._ready = Receiver(self._ctx, ep.supervisor(), m.ToSupervisor)
        self._launcher = Launcher(self.config, self.run_dir, self._ready)
        self._finalizer = weakref.finalize(self, _stop_processes, self._launcher, self._ctx, self.run_dir)
        try:
            self._start_engine(model, startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start_engine(self, model: str, startup_timeout_s: float) -> None:
        from transformers import AutoTokenizer  # heavy: only the LLM object needs it

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.eos_token_ids = eos_token_ids(Path(model), self.tokenizer)
        self.vocab_size = vocab_size(Path(model), self.tokenizer)
        # per skip_special_tokens (vLLM's): special tokens are not text unless asked for
        self._decoders = {skip: TextDecoder(self.tokenizer, skip) for skip in (True, False)}
        self.generation_defaults = load_generation_defaults(self.config.generation_config, self.config.model)
        self._chat_tokenizers: dict[Optional[str], object] = {}  # per chat_template, made on first chat()
        self._ids = itertools.count()
        ep = Endpoints(self.run_dir)
        self._outputs = Receiver(self._ctx, ep.frontend_outputs(), m.SchedulerToFrontend)
        self._inputs = [Sender(self._ctx, ep.scheduler_inputs(r)) for r in range(self.config.data_parallel_size)]
        # Patient: it replaces dead workers itself, so a recovering replica keeps its requests
        self._session = EngineSession(Router(
            self.config.data_parallel_size, self.config.replica_timeout_s,
            RoutingPolicy(self.config.router, self.config.router_balance_abs, self.config.router_balance_rel),
            patient=True))
        # The engine's adapters (offline/lora.py); the --lora-modules ones read before any process starts
        self.adapters = AdapterRegistry(model, self.config.max_lora_rank) if self.config.enable_lora else None
        for item in self.config.lora_modules or ():
            name, path = lora_module(item)
            self.adapters.add(name, self.adapters.read(name, path))
        self._start(startup_timeout_s)
        self._send_adapters(list(self.adapters or ()))
        ready_at = time.monotonic()  # silence counts from ready
        for replica in range(self.config.data_parallel_size):
            self._session.heard(replica, ready_at)
        self._supervision = Supervision(self.config, self._launcher, self._session)

    # ------------------------------------------------------------------ processes

    @property
    def _children(self) -> list[Child]:
        return self._launcher.children()

    def _start(self, timeout_s: float) -> None:
        for replica in range(self.config.data_parallel_size):
            self._launcher.spawn_scheduler(replica)
            self._launcher.spawn_workers(replica)
        try:
            self._launcher.wait_ready(self._launcher.expected(), timeout_s)
        except StartupError as exc:
            raise EngineDiedError(str(exc)) from None

    def _send_adapters(self, adapters: list[m.LoRAAdapter]) -> None:
        """Registered with every replica, ahead of any request that names them."""
        for adapter in adapters:
            for sender in self._inputs:
                sender.send(m.LoadLoRA(adapter))

    @property
    def worker_restarts(self) -> int:
        return self._supervision.worker_restarts

    @property
    def stats(self) -> dict[int, m.SchedulerStats]:
        """The latest SchedulerStats of each replica heard from."""
        return {r.replica: r.stats for r in self._session.router.replicas if r.stats is not None}

    def _watch(self) -> None:
        """A dead or hung scheduler ends the LLM; dead workers are replaced (asked or not)."""
        self._supervision.watch(self._ready.recv_nowait(), time.monotonic())

    def _place(self, add: m.AddRequest) -> Decision:
        """The replica ``add`` goes to, by the LLM's ``router``; with every replica silent, one of
        them all the same (its requests are lost once it has been silent ``replica_timeout_s``)."""
        seed = self.adapters.seed(add.lora_name) if self.adapters is not None else 0
        return self._session.choose(add.prompt_token_ids, time.monotonic(), add.priority, seed,  # type: ignore[return-value]
                                    even_if_none_live=True)

    def _send(self, request: InFlight, add: m.AddRequest) -> None:
        self._inputs[request.replica].send(add)
        self._session.track(request)

    def pids(self) -> list[int]:
        return [c.popen.pid for c in self._children]

    def close(self) -> None:
        """Stop every process this LLM started and remove its run dir."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    @contextmanager
    def _turn(self, timeout: Optional[float]) -> Iterator[Optional[float]]:
        """Holds the LLM for one public call; yields its deadline (the wait for the turn counts). What
        the call leaves in flight (it raised, or timed out) is aborted, so the next call's session
        holds only its own requests."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"another call held this LLM for the whole timeout ({timeout:g}s)")
        try:
            if not self._finalizer.alive:
                raise RuntimeError("this LLM is closed")
            yield deadline
        finally:
            abandoned = self._session.lose_all("abandoned by its call")
            if abandoned is not None and self._finalizer.alive:
                self._abort(abandoned.requests)  # the engine frees what it still holds for them
            self._lock.release()

    # ------------------------------------------------------------------ generate

    def _token_ids(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer.encode)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use without SamplingParams: the --generation-config
        defaults (``generation_config="auto"``: the model dir's generation_config.json)."""
        return SamplingParams(**self.generation_defaults.as_dict())

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 *, use_tqdm: Union[bool, Callable[..., Any]] = True, timeout: Optional[float] = None,
                 priority: Optional[Sequence[int]] = None, max_queue_time_s=None, deadline_s=None,
                 tenant=None, lora_request: LoRARequests = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order; returns when all have finished.

        Prompts: strings, token-id lists, ``{"prompt": str}`` or ``{"prompt_token_ids": ids}``.
        ``priority``: one integer per prompt, lower first (vLLM's), only with
        ``scheduling_policy="priority"`` or ``"deadline"``.
        ``max_queue_time_s``, ``deadline_s`` (seconds from arrival) and ``tenant`` (fair share): one
        value for every prompt or a list of one per prompt, as the HTTP fields. A request past its
        first-token limit ends with ``finish_reason="error"`` and its ``error``; one past its
        deadline with ``finish_reason="length"`` and the tokens so far.
        ``use_tqdm``: a progress bar, or a callable that builds one from tqdm's keywords (vLLM's).
        ``lora_request``: a LoRARequest for every prompt, or a list of one per prompt (None: the base
        model); needs ``LLM(..., enable_lora=True)``. A new adapter is read and judged first (ValueError
        naming the reason) and registered with the engine before its requests are sent.
        Raises ValueError (naming the field) before sending anything if any input is out of
        range or past the engine's limits (``max_logprobs``, ``max_num_seqs``), TimeoutError after
        ``timeout`` seconds (what was in flight is aborted; waiting for another thread's call
        counts), and EngineDiedError if a scheduler dies or hangs.
        """
        prompts = as_prompt_list(prompts)
        per_prompt = {"priority": as_priority_list(priority, len(prompts)),
                      "max_queue_time_s": as_per_prompt("max_queue_time_s", max_queue_time_s, len(prompts), float),
                      "deadline_s": as_per_prompt("deadline_s", deadline_s, len(prompts), float),
                      "tenant": as_per_prompt("tenant", tenant, len(prompts), str)}
        loras = as_lora_list(lora_request, len(prompts), self.adapters is not None)
        with self._turn(timeout) as deadline:
            return self._generate(prompts, [prompt_text(p) for p in prompts], sampling_params,
                                  use_tqdm, deadline, per_prompt, loras)

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             *, use_tqdm: Union[bool, Callable[..., Any]] = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None, timeout: Optional[float] = None,
             lora_request: LoRARequests = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of them, rendered by the model's chat template exactly as ``/v1/chat/completions``
        renders it; one RequestOutput per conversation, its ``prompt`` the rendered text.
        ``chat_template``: this call's; None takes the LLM's (``LLM(chat_template=...)``, else the model's).
        ``lora_request``: as ``generate``'s, one per conversation."""
        template = self.config.chat_template if chat_template is None else chat_template
        prompt_ids = render_conversations(self._chat_tokenizer(template), messages,
                                          add_generation_prompt, continue_final_message, chat_template_kwargs)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
        loras = as_lora_list(lora_request, len(prompt_ids), self.adapters is not None)
        with self._turn(timeout) as deadline:
            return self._generate(prompt_ids, texts, sampling_params, use_tqdm, deadline, loras=loras)

    def _chat_tokenizer(self, chat_template: Optional[str]):
        if chat_template not in self._chat_tokenizers:
            self._chat_tokenizers[chat_template] = chat_prompt_tokenizer(self.config.model, chat_template)
        return self._chat_tokenizers[chat_template]

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]],
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              *, use_tqdm: Union[bool, Callable[..., Any]] = True,
              timeout: Optional[float] = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one EmbeddingRequestOutput per prompt, in input order, each
        ``.outputs.embedding`` the pooled, L2-normalised final hidden state (``task="embed"``)."""
        if self.config.task != "embed":
            raise ValueError('LLM.embed needs an embedding engine: LLM(model, task="embed") (vLLM: runner="pooling")')
        prompts = as_prompt_list(prompts)
        model_config = json.loads((Path(self.config.model) / "config.json").read_text())
        params = as_pooling_params_list(pooling_params, len(prompts), Matryoshka.of(model_config),
                                        int(model_config.get("hidden_size") or 0))
        with self._turn(timeout) as deadline:
            adds = [self._pooling_request(i, prompt) for i, prompt in enumerate(prompts)]
            self._watch()
            requests = []
            for i, (add, p) in enumerate(zip(adds, params)):
                requests.append(PendingEmbedding(i, add, self._place(add), p, self.pooler.normalize))
                self._send(requests[-1], add)
            results: list[Optional[EmbeddingRequestOutput]] = [None] * len(prompts)
            self._collect(results, use_tqdm, deadline)
        for request in requests:
            if request.error is not None:
                raise EmbeddingFailed(f"prompt {request.index}: {request.error}")
        return results  # type: ignore[return-value]

    def encode(self, prompts: Union[Prompt, Sequence[Prompt]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               *, use_tqdm: Union[bool, Callable[..., Any]] = True,
               timeout: Optional[float] = None) -> list[PoolingRequestOutput]:
        """vLLM's pooling API: one PoolingRequestOutput per prompt, ``.outputs.data`` the vector
        ``embed`` gives as a float32 tensor. Only an embedding engine pools (``task="embed"``)."""
        if self.config.task != "embed":
            raise ValueError('LLM.encode is vLLM\'s pooling API and needs an embedding engine: LLM(model, '
                             'task="embed") (vLLM: runner="pooling"). This LLM generates: use LLM.generate '
                             '(or LLM.get_tokenizer().encode for token ids)')
        return [out.as_pooling_output()
                for out in self.embed(prompts, pooling_params, use_tqdm=use_tqdm, timeout=timeout)]

    def _pooling_request(self, index: int, prompt: Prompt) -> m.AddRequest:
        ids = self._token_ids(prompt)
        if len(ids) > self.config.max_model_len:
            raise InvalidField("prompt_token_ids", f"{len(ids)} tokens exceed max_model_len="
                                                   f"{self.config.max_model_len} (prompt {index})")
        try:
            add = m.AddRequest(request_id=f"offline-{next(self._ids)}", prompt_token_ids=ids,
                               sampling=m.SamplingParams(max_tokens=1), pooling=self.pooler.pooling_type)
            check_request(add, self.vocab_size)
        except InvalidField as exc:
            raise InvalidField(exc.field, f"{exc.reason} (prompt {index})") from None
        return add

    def _generate(self, prompts: list, prompt_texts: list[Optional[str]], sampling_params, use_tqdm,
                  deadline: Optional[float], per_prompt=None,
                  loras: Sequence[Optional[LoRARequest]] = ()) -> list[RequestOutput]:
        if self.config.task == "embed":
            raise ValueError("this LLM computes embeddings (task=\"embed\"): use LLM.embed")
        params = as_params_list(self.get_default_sampling_params() if sampling_params is None else sampling_params,
                                len(prompts))
        wire = {id(sp): sp.to_protocol() for sp in params}  # checked as they are now, once per object
        per_prompt = per_prompt or {}
        names = [lora.lora_name if lora is not None else "" for lora in loras] or [""] * len(prompts)
        requests = [self._request(i, prompt, sp, wire[id(sp)], lora_name=names[i],
                                  **{k: v[i] for k, v in per_prompt.items()})
                    for i, (prompt, sp) in enumerate(zip(prompts, params))]
        if self.adapters is not None:
            self._send_adapters(new_adapters(self.adapters, loras))
        self._watch()
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        for i, (add, sp) in enumerate(zip(requests, params)):
            out = RequestOutput(add.request_id, add.prompt_token_ids,
                                [CompletionOutput(k, "", [], None) for k in range(sp.n)],
                                arrival_time=time.perf_counter(), prompt=prompt_texts[i])
            decoder = self._decoders[sp.skip_special_tokens]
            self._send(PendingRequest(i, out, self._place(add), decoder, sp.stop, sp.stop_token_ids, sp.min_tokens,
                                      add.lora_name), add)
        self._collect(results, use_tqdm, deadline)
        return results  # type: ignore[return-value]

    def _request(self, index: int, prompt: Prompt, sp: SamplingParams, sampling: m.SamplingParams,
                 priority: int = 0, max_queue_time_s: Optional[float] = None, deadline_s: Optional[float] = None,
                 tenant: Optional[str] = None, lora_name: str = "") -> m.AddRequest:
        refusal = priority_refusal(self.config.scheduling_policy, priority)
        if refusal is not None:
            raise InvalidField("priority", f"{refusal} (prompt {index})")
        ids = self._token_ids(prompt)
        if len(ids) + 1 > self.config.max_model_len:  # vLLM raises here too, before anything is sent
            raise InvalidField("prompt_token_ids", f"the prompt has {len(ids)} tokens; with at least one generated "
                                                   f"token that exceeds max_model_len={self.config.max_model_len} "
                                                   f"(prompt {index})")
        try:
            check_engine_limits(sp, self.config.max_logprobs, self.config.max_num_seqs)
            add = m.AddRequest(request_id=f"offline-{next(self._ids)}", prompt_token_ids=ids,
                               sampling=sampling, eos_token_ids=self.eos_token_ids, priority=priority,
                               max_queue_time_s=max_queue_time_s, deadline_s=deadline_s, tenant=tenant or "",
                               lora_name=lora_name)
            check_request(add, self.vocab_size)
        except InvalidField as exc:
            raise InvalidField(exc.field, f"{exc.reason} (prompt {index})") from None
        return add

    def _collect(self, results: list, use_tqdm, deadline: Optional[float]) -> None:
        """Every request in the session (this call's: calls take turns) to its result in ``results``."""
        session = self._session
        bar = progress_bar(use_tqdm, len(session), "generate")
        generated, started, next_watch = 0, time.perf_counter(), time.monotonic() + WATCH_INTERVAL_S
        try:
            while len(session):
                if time.monotonic() >= next_watch:
                    self._watch()
                    for lost in session.failed(time.monotonic()):
                        self._end_lost(lost, results, bar)
                    next_watch = time.monotonic() + WATCH_INTERVAL_S
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"generate timed out with {len(session)} request(s) unfinished")
                msg = self._outputs.recv(timeout_ms=100)
                if isinstance(msg, m.RequestOutputs):
                    session.heard(msg.replica, time.monotonic())
                    for delta in m.iter_deltas(msg):
                        request = session.on_delta(delta)
                        if request is not None:
                            generated += self._deliver(request, delta, results, bar)
                    bar.set_postfix_str(f"{generated / max(time.perf_counter() - started, 1e-9):.0f} tok/s",
                                        refresh=False)
                elif isinstance(msg, m.SchedulerStats):
                    lost = session.on_stats(msg, time.monotonic())
                    if lost is not None:  # a new scheduler process: never one this LLM started, but said so
                        self._end_lost(lost, results, bar)
                elif isinstance(msg, m.PrefixCacheEvents):
                    session.on_cache_events(msg)
        finally:
            bar.close()

    def _deliver(self, request, delta: m.RequestDelta, results: list, bar) -> int:
        """Applies one delta to its request; returns the tokens it added."""
        added = request.apply(delta, time.perf_counter())
        if request.finished:
            if request.ended_by_stop_string:  # the scheduler still runs it
                self._inputs[request.replica].send(m.AbortRequest([delta.request_id]))
            self._session.forget(request)  # if it has not (an error for sample 0 alone ends every sample)
            results[request.index] = request.output
            bar.update(1)
        return added

    def _end_lost(self, lost: Lost, results: list, bar) -> None:
        """End ``lost``'s requests with finish_reason "error", as the HTTP frontend ends them, and abort
        them in case the replica comes back."""
        self._abort(lost.requests)
        for request in lost.requests:
            request.apply(m.RequestDelta(request.request_id, 0, [], "error", error_kind="engine",
                                         error=f"{lost.reason}; the request was lost"), time.perf_counter())
            results[request.index] = request.output
            bar.update(1)

    def _abort(self, requests: Sequence[InFlight]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request in requests:
            by_replica.setdefault(request.replica, []).append(request.request_id)
        for replica, ids in by_replica.items():
            self._inputs[replica].send(m.AbortRequest(ids))

    def refresh_stats(self, timeout_s: float = 2.0) -> dict[int, m.SchedulerStats]:
        """The next stats message of every replica: sent after the last step generate() saw."""
        with self._turn(timeout_s) as deadline:
            fresh: set[int] = set()
            while len(fresh) < len(self._inputs) and time.monotonic() < deadline:
                msg = self._outputs.recv(timeout_ms=100)
                if isinstance(msg, m.SchedulerStats):
                    self._session.on_stats(msg, time.monotonic())
                    fresh.add(msg.replica)
        return self.stats
