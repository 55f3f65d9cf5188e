"""Typed messages: the only vocabulary two kinds of pagedserve process share.

Each channel has its own tagged union (see the bottom of this file), so a frame that is
valid on one socket is rejected on another. Field names follow vLLM's where one exists.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

import msgspec

from pagedserve.protocol.sampling_params import (  # noqa: F401  (re-exported: one vocabulary)
    INT64_MIN, INT64_MAX, MAX_TOKEN_ID, MAX_COUNT, MAX_N, MAX_TEMPERATURE,
    MAX_REQUEST_ID_CHARS, MAX_TOP_LOGPROBS, MAX_LOGIT_BIAS, TokenId, Seed, StructuredOutputs, SamplingParams)
from pagedserve.protocol.priority import MAX_LIMIT_S, MAX_TENANT_CHARS, PRIORITY_MAX, PRIORITY_MIN
from pagedserve.protocol.pooling import PooledChunk, PoolingType  # noqa: F401  (re-exported)
from pagedserve.protocol.msg_base import Msg
from pagedserve.protocol.scheduler_stats import SchedulerStats  # noqa: F401  (re-exported: one vocabulary)


LimitS = Annotated[float, msgspec.Meta(gt=0, le=MAX_LIMIT_S)]
MAX_LORA_NAME_CHARS = 256


# ------------------------------------------------------------ frontend -> scheduler


class AddRequest(Msg):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    sampling: SamplingParams
    eos_token_ids: list[TokenId] = []
    # Lower runs first (vLLM's); only under --scheduling-policy priority may it be non-zero
    # (protocol/priority.py). 32-bit, as vLLM's is in practice.
    priority: Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    # Seconds from arrival (protocol/priority.py): the wait for a first token (the smaller of this
    # and --max-queue-time-s), and the whole generation; None: no limit of its own.
    max_queue_time_s: Optional[LimitS] = None
    deadline_s: Optional[LimitS] = None
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_CHARS)] = ""  # whose share it counts against (fair)
    # An embedding request (protocol/pooling.py): its prompt is computed, pooled and returned in
    # RequestDelta.embedding; nothing is sampled. None: a generation request.
    pooling: Optional[PoolingType] = None
    # The LoRA adapter that computes this request (a LoadLoRA's name); "": the base model.
    lora_name: Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)] = ""


class LoRAAdapter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One adapter as every process names it (protocol/lora_adapter.py reads its files)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_NAME_CHARS)]
    lora_id: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]  # vLLM's lora_int_id: fixed for the name's life
    path: str  # the resolved adapter directory
    digest: str  # AdapterSpec.digest when the frontend accepted it: a worker refuses other bytes


class LoadLoRA(Msg):
    """Register an adapter (startup's --lora-modules, or POST /v1/load_lora_adapter): requests
    may name it from now on. Registering a name again with another digest replaces it."""

    adapter: LoRAAdapter


class UnloadLoRA(Msg):
    """Forget an adapter. The frontend sends it only when none of its requests is in flight; a
    request that still names it later ends with an invalid_request error."""

    name: str


class AbortRequest(Msg):
    request_ids: list[str]


class Drain(Msg):
    """Stop admitting new requests; finish what is in flight."""


class FrontendStarted(Msg):
    """A frontend's first message to each replica. After a restart, every request the replica
    still holds came from the frontend that died: nobody reads its tokens, and its sequences
    would keep seats and blocks new clients wait for (503 queue_timeout), so they are aborted."""


# ------------------------------------------------------------ scheduler -> frontend


class PromptLogprobs(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Logprobs of consecutive prompt tokens ``start, start + 1, ...``: token ``i``'s logprob
    under the model's distribution at position ``i - 1`` (so ``start >= 1``; the first prompt
    token has none). Parallel lists, one entry per token."""

    start: Annotated[int, msgspec.Meta(ge=1)]
    logprobs: list[float]
    ranks: list[int]  # 1 + how many tokens are more likely than the prompt token
    top_logprobs: list[list[tuple[int, float]]]  # per token, its prompt_logprobs best alternatives

    def __post_init__(self) -> None:
        if not len(self.logprobs) == len(self.ranks) == len(self.top_logprobs):
            raise ValueError(f"prompt logprobs of {len(self.logprobs)} tokens with {len(self.ranks)} ranks "
                             f"and {len(self.top_logprobs)} alternatives lists")

    @property
    def end(self) -> int:
        """One past the last prompt token covered."""
        return self.start + len(self.logprobs)

    def per_token(self, prompt: list[int], k: int) -> list[list[tuple[int, float, int]]]:
        """Per covered prompt token: (token id, logprob, rank) of the prompt token, then of its
        ``k`` best alternatives (ranks 1..k), as every output format renders them."""
        return [[(prompt[self.start + i], logprob, rank),
                 *((token, lp, r) for r, (token, lp) in enumerate(top[:k], start=1))]
                for i, (logprob, rank, top) in enumerate(zip(self.logprobs, self.ranks, self.top_logprobs))]


class RequestDelta(Msg, gc=False):  # holds only scalars and int lists: no cycles possible
    request_id: str
    index: int  # which of the n parallel samples
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None
    # "invalid_request" (-> 400) | "overloaded" (-> 429) | "queue_timeout" (-> 503) | "engine" (-> 5xx)
    error_kind: Optional[str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: Optional[list[float]] = None
    stop_token_id: Optional[int] = None
    # Per new token, its top-k alternatives (token id, logprob), best first; with top_logprobs > 0.
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    # With prompt_logprobs, on each sample's first delta: prompt tokens 1.. (start 1), all of them.
    prompt_logprobs: Optional[PromptLogprobs] = None
    # An embedding request's one delta: the pooled hidden state, float32 little-endian, not normalised.
    embedding: Optional[bytes] = None


class RequestOutputs(Msg, gc=False):
    """One step's news for the frontend.

    The plain case (one more token for a sample that goes on, no logprobs) travels as three
    parallel lists, one entry per sample, so a step of thousands of decodes is three lists
    and not thousands of structs. Everything else (ends, errors, logprobs) is a
    ``RequestDelta``. A receiver applies the token lists first, then ``deltas``:
    ``iter_deltas`` does exactly that.
    """

    replica: int
    step: int
    deltas: list[RequestDelta]
    token_request_ids: list[str] = []
    token_indices: list[int] = []  # which of the request's n samples
    token_ids: list[int] = []


def iter_deltas(outputs):
    """Every delta of ``outputs`` (a RequestOutputs, or anything with its four delta fields,
    like the scheduler's StepOutputs) as a ``RequestDelta``, in the order they must be applied."""
    for request_id, index, token in zip(outputs.token_request_ids, outputs.token_indices, outputs.token_ids):
        yield RequestDelta(request_id, index, [token])
    yield from outputs.deltas


class PrefixCacheEvents(Msg, gc=False):  # holds only scalars and int lists: no cycles possible
    """Blocks that entered (``stored``) or left (``removed``) a replica's prefix cache since
    the previous message, named by their chain hash (protocol/block_hash.py), for the
    frontend's cache-aware router. Each block appears at most once, with its latest state.

    Sent before the step's RequestOutputs and before every SchedulerStats on the same
    socket, so a request's final delta never overtakes the naming of its blocks. ``seq``
    counts one scheduler process's messages from 0; a receiver that sees a gap, or a
    SchedulerStats whose ``cache_events_sent`` differs from what it received, forgets
    that replica's blocks rather than trust a partial view.
    """

    replica: int
    pid: int
    seq: int
    reset: bool = False  # forget every block known for this replica before applying this
    stored: list[int] = []
    removed: list[int] = []


class ProcessInfo(msgspec.Struct, forbid_unknown_fields=True):
    role: str  # "frontend" | "scheduler" | "worker"
    replica: int  # -1 for the frontend
    rank: int
    pid: int
    alive: bool
    node: str = ""  # the Ray node id the process runs on (Ray backend); "" when local


class ProcessTable(Msg):
    """Supervisor -> frontend, about once a second: every child it runs, for /health."""

    supervisor_pid: int
    processes: list[ProcessInfo]
    replica_restarts: list[int]  # restarts per replica in the current restart window
    failed_replicas: list[int]


# ------------------------------------------------------------ scheduler <-> worker


class WorkerHello(Msg):
    """First message of a worker: who it is and how many KV blocks would fit."""

    rank: int
    pid: int
    device: str
    model_id: str  # architecture + hash of config.json
    num_layers: int
    block_bytes: int  # bytes of one block across all layers, K and V, on this rank
    max_gpu_blocks: int  # what fits in the memory this worker may use
    hostname: str = ""  # where ``pid`` lives: a scheduler watches only pids on its own node
    vocab_size: int = 0  # embedding rows: a token id at or above it is refused at admission; 0: unknown
    # each layer's attention window (0: the layer reads every position before it); []: not said.
    # Where all layers have one, the scheduler frees blocks behind it (scheduler_proc/sliding_window.py).
    layer_windows: list[int] = []
    # how it computes, for a trace's replay to compute the same way ("" / False: not said)
    dtype: str = ""
    enforce_eager: bool = False


    @property
    def hybrid_kv(self) -> bool:
        """Whether its cache is laid out in KV groups (``GroupedWorkerHello``)."""
        return False


class GroupedWorkerHello(WorkerHello):
    """The hello of a worker whose cache is laid out in KV groups (protocol/kv_groups.py of its
    ``layer_windows``): its steps must carry a block table per group (``GroupedSchedulerOutput``).
    Its own message, so that every other worker says hello in the very bytes it always has."""

    @property
    def hybrid_kv(self) -> bool:
        return True


class WorkerInit(Msg):
    """The scheduler's answer to every worker's hello: the cache to build."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int  # rotary positions to precompute
    seed: int


class WorkerReady(Msg):
    rank: int
    num_gpu_blocks: int
    num_cpu_blocks: int


class NewRequestData(Msg):
    """A request the workers do not know yet (or resume after preemption), in full."""

    req_id: str
    token_ids: list[int]  # prompt followed by outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens with KV before this step: the first scheduled token's position
    num_scheduled_tokens: int
    sampling: SamplingParams
    samples: bool  # sample a token after this step (False: a prompt chunk, or a parent's prompt[:-1])
    pooling: Optional[PoolingType] = None  # an embedding request: pool its hidden states, never sample
    # vLLM's min_tokens: its stop tokens (stop_token_ids, and EOS unless ignore_eos), which the sampler
    # masks while the sample has fewer than sampling.min_tokens outputs; [] without min_tokens.
    min_tokens_stop_ids: list[int] = []


class CachedRequestData(Msg, gc=False):  # holds only scalars and int lists: no cycles possible
    """A request the workers already hold that is not a plain decode (a prefill chunk going on,
    a fresh fork, a decode that left the lane this step): only what changed since its last step."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since the workers last saw it
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # tokens with KV before this step: the first scheduled token's position
    num_scheduled_tokens: int
    samples: bool  # sample a token after this step


class DecodeBatch(Msg, gc=False):
    """Requests the workers hold that each compute exactly one token, the one sampled for them
    in the step before, and all sample. Parallel lists, one entry per request: the bulk of a
    busy step costs a few lists instead of a struct per request."""

    req_ids: list[str]
    num_computed_tokens: list[int]  # tokens with KV before this step; the new token's position
    # Appended to each request's tokens, then computed. PLACEHOLDER_TOKEN (protocol/step_state.py):
    # the token the worker sampled for this request in its previous step, still in flight to the
    # scheduler when it sent this step (overlapped scheduling).
    token_ids: list[int]
    new_blocks: list[tuple[int, int]]  # (index into req_ids, device block appended to its table)


class GrammarBitmask(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The allowed next tokens of a step's grammar-constrained entries, one row each.

    ``bitmask`` holds ``len(req_ids)`` rows of ``words_per_row`` little-endian int32 words;
    bit ``t % 32`` of word ``t // 32`` set means token ``t`` may be sampled. Every id names
    an entry of the step that samples; its row is applied to its logits before sampling.
    """

    req_ids: list[str]
    words_per_row: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    bitmask: bytes

    def __post_init__(self) -> None:
        expected = 4 * self.words_per_row * len(self.req_ids)
        if len(self.bitmask) != expected:
            raise ValueError(f"grammar bitmask of {len(self.bitmask)} bytes for {len(self.req_ids)} rows "
                             f"of {self.words_per_row} words (expected {expected})")
        if len(set(self.req_ids)) != len(self.req_ids):
            raise ValueError("grammar bitmask names a request twice")


class SchedulerOutput(Msg):
    """One step: the same bytes go to every worker of the replica.

    Batch order: new requests, cached requests, then decodes. ``StepResult.req_ids`` lists,
    in that order, exactly the entries that sample: new and cached ones flagged ``samples``,
    and every decode. protocol/step_state.py applies a step to the per-request state.
    """

    step: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    decodes: DecodeBatch
    finished_req_ids: list[str]  # finished, aborted or preempted: drop their state
    blocks_to_swap_out: list[tuple[int, int]]  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]]  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]]  # (src device block, dst device block)
    new_block_ids_to_zero: list[int]
    total_num_scheduled_tokens: int
    grammar: Optional[GrammarBitmask] = None  # masks of the constrained entries that sample
    now_s: float = 0.0  # the scheduler's clock for the step's time-based decisions, replayed as recorded
    # Speculative decoding (protocol/speculative.py), by request id: proposals a sampling entry computes
    # after its tokens, each scored and sampled after (StepResult.num_accepted_tokens; counted in the total).
    spec_token_ids: dict[str, list[int]] = {}
    # draft_model: the entries the draft model computes too, by id, with how many tokens it proposes after the sample.
    draft_tokens: dict[str, int] = {}


class GroupedSchedulerOutput(SchedulerOutput):
    """A step of a hybrid model (protocol/kv_groups.py, the hello's ``hybrid_kv``): a block table
    per KV group. ``block_ids`` / ``new_block_ids`` / ``new_blocks`` are the global group's; this
    adds, by request id, each local group's blocks appended to its table (a new request: its
    whole tables), which always stay as long as the global one. A request absent gained none.
    Its own message, so that a model with one group sends the very bytes it always has."""

    window_block_ids: dict[str, list[list[int]]] = {}


class LoRASlot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    slot: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
    adapter: LoRAAdapter


class LoRAStep(Msg):
    """The adapter changes of step ``step``, sent just before its SchedulerOutput, only when a
    step has some (a deployment without LoRA never sends one, so its frames are unchanged).

    A worker applies them before that step's forward: ``forget`` first, then ``loads`` (the slot
    now holds that adapter, replacing what it held), and reads ``prefetch`` into its host cache
    in the background. ``request_slots`` gives the slot of each of the step's new requests that
    uses an adapter (absent: the base model); a request keeps its slot until it finishes or is
    preempted, because the scheduler never reassigns a slot an admitted request uses.
    """

    step: int
    loads: list[LoRASlot] = []
    prefetch: list[LoRAAdapter] = []
    forget: list[str] = []  # adapter names: drop from the host cache and any slot
    request_slots: dict[str, int] = {}


class StepResult(Msg):
    step: int
    rank: int
    req_ids: list[str]  # requests that sampled a token this step, in batch order
    sampled_token_ids: list[int]
    logprobs: Optional[list[float]] = None
    error: Optional[str] = None
    forward_time_s: float = 0.0
    idle_time_s: float = 0.0  # since the previous result was sent
    # Per sampled request: its top_logprobs alternatives (token id, logprob of the unmodified
    # distribution), best first; [] for a request that asked for none. None: nobody asked.
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    # By request id: the prompt logprobs this step's chunk computed. None: none this step.
    prompt_logprobs: Optional[dict[str, PromptLogprobs]] = None
    # By request id, for every entry of SchedulerOutput.spec_token_ids: how many of its proposals
    # were accepted (a prefix). Its ``sampled_token_ids`` entry is the token sampled after them,
    # so the request's new tokens are its accepted proposals followed by that token.
    num_accepted_tokens: dict[str, int] = {}
    draft_token_ids: dict[str, list[int]] = {}  # draft_model: proposals after the sample (SchedulerOutput.draft_tokens)
    # By request id: what this step's chunk adds to each pooling request's embedding. None: none.
    pooled: Optional[dict[str, PooledChunk]] = None


# ------------------------------------------------------------ any process -> supervisor


class ProcessReady(Msg):
    role: str  # "frontend" | "scheduler" | "worker"
    replica: int
    rank: int
    pid: int


class RestartWorkers(Msg):
    """Scheduler -> supervisor: my workers died or hung; give me fresh ones."""

    replica: int
    reason: str


class Heartbeat(Msg):
    """Scheduler -> supervisor, with every stats tick: alive *and* making progress."""

    role: str
    replica: int
    pid: int


# ------------------------------------------------------------ one union per channel

FrontendToScheduler = Union[AddRequest, AbortRequest, Drain, FrontendStarted, LoadLoRA, UnloadLoRA]
SchedulerToFrontend = Union[RequestOutputs, SchedulerStats, PrefixCacheEvents, ProcessTable]
SchedulerToWorker = Union[WorkerInit, SchedulerOutput, GroupedSchedulerOutput, LoRAStep]
WorkerToScheduler = Union[WorkerHello, GroupedWorkerHello, WorkerReady, StepResult]
ToSupervisor = Union[ProcessReady, RestartWorkers, Heartbeat]
