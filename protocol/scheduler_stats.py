"""A replica's periodic counters for the frontend (/health, /metrics, the router) and the
interval log: the widest message, and the one that grows with every feature that counts."""

from __future__ import annotations

from pagedserve.protocol.msg_base import Msg


class SchedulerStats(Msg):
    replica: int
    state: str  # "starting" | "ready" | "recovering" | "draining" | "failed" | "placing" (from the supervisor; "placing": Ray is finding it a node)
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_copied: int = 0
    num_blocks_zeroed: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    recomputed_tokens: int = 0
    num_finished: int = 0
    worker_forward_time_s: float = 0.0
    worker_idle_time_s: float = 0.0
    worker_restarts: int = 0
    max_model_len: int = 0
    block_size: int = 0
    pid: int = 0  # the scheduler's: a new pid means a restarted replica that lost every request
    cache_events_sent: int = 0  # PrefixCacheEvents sent by this pid so far (the next one's seq)
    scheduling_policy: str = ""  # --scheduling-policy (for /health and the interval log)
    # Under the priority policy: requests per priority (empty under fcfs, where all are 0)
    num_waiting_by_priority: dict[int, int] = {}
    num_running_by_priority: dict[int, int] = {}
    generation_tokens_by_priority: dict[int, int] = {}
    # Per tenant (AddRequest.tenant; "" for none): only tenants with a request seen since start
    num_waiting_by_tenant: dict[str, int] = {}
    num_running_by_tenant: dict[str, int] = {}
    generation_tokens_by_tenant: dict[str, int] = {}
    tenant_service: dict[str, float] = {}  # under fair: each tenant's virtual token counter
    num_queue_time_expired: int = 0  # ended waiting for a first token past their limit
    num_deadline_expired: int = 0  # ended at their deadline_s with the tokens so far
    deadline_misses_by_priority: dict[int, int] = {}  # both of the above, by priority
    deadline_misses_by_tenant: dict[str, int] = {}
    num_requests_shed: int = 0  # refused by --max-waiting-requests here (the frontend sheds most)
    structured_output_requests: int = 0  # admitted requests constrained by a grammar
    structured_output_mask_time_s: float = 0.0  # filling their bitmasks, summed over steps
    spec_decode_num_drafts: int = 0  # verifications: one sequence's proposals of one step
    spec_decode_num_draft_tokens: int = 0  # proposals verified
    spec_decode_num_accepted_tokens: int = 0  # proposals accepted
    spec_decode_num_accepted_tokens_per_pos: list[int] = []  # accepted at proposal position 0, 1, ...
    # LoRA (--enable-lora): adapters with a running / waiting request, as vLLM's vllm:lora_requests_info labels
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    max_lora: int = 0  # --max-loras: adapters one step may hold (0: LoRA off)
    generation_tokens_by_lora: dict[str, int] = {}  # tokens generated per adapter since start
