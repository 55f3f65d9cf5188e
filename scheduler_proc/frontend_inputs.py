"""How a frontend message changes the scheduler: shared by the engine loop and trace replay."""

from __future__ import annotations

import logging

from pagedserve.protocol import messages as m

log = logging.getLogger("pagedserve.scheduler")


def apply_frontend_message(sched, msg, draining: bool) -> tuple[list[m.RequestDelta], bool]:
    """Returns the deltas to send back and whether the replica is now draining."""
    if isinstance(msg, m.AddRequest):
        if draining:
            return [m.RequestDelta(request_id=msg.request_id, index=0, new_token_ids=[], finish_reason="error",
                                   error="the server is shutting down", error_kind="engine")], draining
        return sched.add_request(msg), draining
    if isinstance(msg, m.AbortRequest):
        return sched.abort_requests(msg.request_ids), draining
    if isinstance(msg, (m.LoadLoRA, m.UnloadLoRA)):
        if sched.lora is None:  # a frontend started with --enable-lora beside a scheduler without it
            log.warning("ignoring %s: this scheduler was started without --enable-lora", type(msg).__name__)
            return [], draining
        if isinstance(msg, m.LoadLoRA):
            sched.register_lora(msg.adapter)
            return [], draining
        return sched.unregister_lora(msg.name), draining
    if isinstance(msg, m.Drain):
        return [], True
    if isinstance(msg, m.FrontendStarted):
        sched.abort_requests(list(sched.requests))  # their deltas would reach nobody: not sent
        return [], draining
    return [], draining
