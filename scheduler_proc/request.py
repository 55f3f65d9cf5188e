"""A request as the frontend sent it, and the sequences the scheduler runs for it.

A request with ``n == 1`` runs as one sequence whose id is the request id. A request with
``n > 1`` first runs a *parent* sequence that computes ``prompt[:-1]``; it then forks into
``n`` child sequences ``f"{request_id}/{i}"`` that share the parent's blocks and each
compute the last prompt token themselves (copy-on-write on the shared tail block).
"""

from __future__ import annotations

from array import array
from typing import Iterable

from msgspec.structs import replace

from pagedserve.protocol.block_hash import adapter_seed
from pagedserve.protocol.messages import AddRequest, SamplingParams

from pagedserve.scheduler_proc.config import MAX_PARALLEL_SAMPLES
from pagedserve.scheduler_proc.grammar import RequestGrammar
from pagedserve.scheduler_proc.speculation import SpecState

WAITING = 0
RUNNING = 1
SWAPPED = 2
FINISHED = 3

_SEED_MASK = (1 << 63) - 1
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, so i -> base + i * stride is distinct mod 2**63


def token_array(tokens: Iterable[int]) -> array:
    """Token ids as machine ints: the collector never walks them (a list of a few thousand ints
    per sequence, walked by every full collection, made the cost per step grow with N squared)."""
    return array("q", tokens)


def child_seed(base_seed: int, index: int) -> int:
    """A distinct, deterministic seed for sample ``index`` of a request seeded ``base_seed``."""
    return (base_seed + index * _SEED_STRIDE) & _SEED_MASK


def child_sampling(request: "Request", index: int) -> SamplingParams:
    """Sample ``index`` of an n > 1 request: one sample, with its own seed."""
    return replace(request.sampling, seed=child_seed(request.sampling.seed, index), n=1)


class Request:
    """What the frontend asked for; shared by the request's sequences."""

    __slots__ = (
        "request_id",
        "arrival_number",
        "sampling",
        "num_prompt_tokens",
        "stop_token_ids",
        "min_tokens",
        "max_len",
        "want_logprobs",
        "unfinished_indices",
        "sequences",
        "num_cached_tokens",
        "grammar",
        "prompt_logprobs",
        "priority",
        "arrival_time",
        "tenant",
        "max_queue_time_s",
        "deadline_s",
        "first_token_by",
        "deadline_at",
        "urgency",
        "spec_k",
        "pooling",
        "pooled",
        "lora",
        "prefix_seed",
    )

    def __init__(self, msg: AddRequest, arrival_number: int, seed: int, len_limit: int,
                 compiled_grammar=None, arrival_time: float = 0.0, spec_k: int = 0, lora=None):
        self.request_id = msg.request_id
        self.arrival_number = arrival_number
        self.priority = msg.priority  # lower first, under the priority policy (policy.py)
        # The scheduler's clock at the first step after arrival (deadlines.py stamps it): aging,
        # limits and the deadline policy's order count from it.
        self.arrival_time = arrival_time
        self.tenant = msg.tenant  # whose share it counts against (fair policy, per-tenant stats)
        self.max_queue_time_s = msg.max_queue_time_s
        self.deadline_s = msg.deadline_s
        self.first_token_by = None  # absolute clock values, or None: no limit (deadlines.py)
        self.deadline_at = None
        self.urgency = arrival_time  # the deadline policy's key: the earliest limit it has
        self.sampling: SamplingParams = msg.sampling
        if msg.sampling.seed != seed:
            self.sampling = SamplingParams(**{**_fields(msg.sampling), "seed": seed})
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        stops = set(msg.sampling.stop_token_ids)
        if not msg.sampling.ignore_eos:
            stops.update(msg.eos_token_ids)
        self.stop_token_ids = frozenset(stops)
        self.min_tokens = msg.sampling.min_tokens
        # A sequence ends with "length" once it holds this many tokens (prompt + outputs).
        self.max_len = min(self.num_prompt_tokens + msg.sampling.max_tokens, len_limit)
        self.want_logprobs = msg.sampling.logprobs
        self.unfinished_indices = set(range(msg.sampling.n))
        self.sequences: list[Sequence] = []
        self.num_cached_tokens = 0
        # When the output is constrained: the grammar each sampling sequence gets a matcher of.
        self.grammar = None if compiled_grammar is None else RequestGrammar(
            compiled_grammar, self.stop_token_ids, msg.sampling.structured_outputs.start_after)
        self.prompt_logprobs = None  # with sampling.prompt_logprobs: those received (prompt_logprobs.py)
        self.spec_k = spec_k  # proposals per step its samples may verify (speculation.py); 0: none
        self.pooling = msg.pooling  # an embedding request: computed, pooled, never sampled (pooling.py)
        self.pooled = None  # its pooled chunks so far (pooling.py)
        self.lora = None  # the LoRAAdapter that computes it (lora_slots.py); None: the base model
        self.prefix_seed = 0  # its first prefix-cache block's parent: the adapter's (protocol/block_hash.py)
        self.bind_lora(lora)

    def bind_lora(self, adapter) -> None:
        """The adapter that computes this request, and so names its prefix-cache blocks."""
        self.lora = adapter
        self.prefix_seed = 0 if adapter is None else adapter_seed(adapter.digest)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


class Sequence:
    """One stream of tokens the workers compute: its tokens, blocks and progress.

    While it is a steady decode its progress and newest tokens have one store, the decode lane's
    columns, and it is a ``LaneSequence`` (decode_lane.py), whose fields read through to them."""

    __slots__ = (
        "seq_id",
        "request",
        "index",
        "order",
        "sampling",
        "token_ids",
        "num_kv_tokens",
        "block_ids",
        "num_freed_blocks",
        "host_block_ids",
        "window_tables",
        "num_window_freed",
        "window_host_tables",
        "block_keys",
        "status",
        "is_parent",
        "shared_tail",
        "worker_knows",
        "num_tokens_sent",
        "num_blocks_sent",
        "recompute_until",
        "num_preemptions",
        # Copies of the request's stop rules, so the per-token path touches one object.
        "request_id",
        "num_prompt_tokens",
        "stop_token_ids",
        "min_len",
        "max_len",
        "want_logprobs",
        "num_cached_tokens",
        "lane",
        "lane_pos",
        "grammar",
        "spec",
        "lora_slot",
    )

    def __init__(self, seq_id: str, request: Request, index: int, token_ids: array,
                 sampling: SamplingParams, is_parent: bool):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        # FCFS key: older requests first; a request's samples in index order.
        self.order = request.arrival_number * MAX_PARALLEL_SAMPLES + index
        self.sampling = sampling
        self.token_ids = token_ids
        # Tokens with KV in the cache once every step scheduled so far has run (this step included;
        # the wire's num_computed_tokens is the count *before* a step).
        self.num_kv_tokens = 0
        self.block_ids: list[int] = []  # device block table
        # Leading table entries freed behind a sliding window: the null block (sliding_window.py).
        self.num_freed_blocks = 0
        self.host_block_ids: list[int] = []  # while swapped out
        # Hybrid models (protocol/kv_groups.py): ``block_ids`` is the global group's table, these the
        # local groups', as long as it, their leading ``num_window_freed`` entries the null block.
        self.window_tables: list[list[int]] = []
        self.num_window_freed = 0
        self.window_host_tables: list[list[int]] = []  # the local groups' live blocks while swapped out
        self.block_keys: list = []  # prefix-cache keys of the leading full computed blocks
        self.status = WAITING
        self.is_parent = is_parent  # computes prompt[:-1], then forks into n children
        self.shared_tail = False  # last block may be shared with a sibling: copy before writing
        self.worker_knows = False  # the workers hold this sequence's state
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        self.recompute_until = 0  # tokens computed before a recompute-preemption
        self.num_preemptions = 0
        self.request_id = request.request_id
        self.num_prompt_tokens = request.num_prompt_tokens
        self.stop_token_ids = request.stop_token_ids
        self.min_len = request.num_prompt_tokens + request.min_tokens  # no stop before this length
        self.max_len = request.max_len
        self.want_logprobs = request.want_logprobs
        self.num_cached_tokens = 0  # the request's prefix hits at its first admission
        self.lane = None  # the decode lane that holds it (a LaneSequence then), and its position there
        self.lane_pos = -1
        # Its own matcher (grammar.py) when constrained and sampling; a parent only computes the prompt.
        self.grammar = request.grammar.new_matcher() if request.grammar is not None and not is_parent else None
        self.spec = SpecState() if request.spec_k and not is_parent else None  # speculation.py
        self.lora_slot = -1  # the LoRA slot it holds a reference on while admitted (lora_slots.py); -1: none

    @property
    def target_len(self) -> int:
        """Tokens this sequence must compute before it can sample (or fork)."""
        return len(self.token_ids) - 1 if self.is_parent else len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token left to compute, and not a parent (which forks instead)."""
        return len(self.token_ids) - self.num_kv_tokens == 1 and not self.is_parent

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, tokens={len(self.token_ids)}, computed={self.num_kv_tokens}, "
                f"blocks={self.block_ids}, status={self.status})")
