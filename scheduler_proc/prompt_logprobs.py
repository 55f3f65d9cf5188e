"""Prompt logprobs on the scheduler's side: the chunks the workers send, joined per request.

A step's result holds, per request that asked, the prompt positions its chunk computed. They
are appended to the request's list in prompt order; positions it already holds (a chunk
recomputed after a recompute-preemption) are dropped, so the frontend gets each position
once, with each sample's first token. A request whose list is complete is sent to the
workers without ``prompt_logprobs`` when it is recomputed, so they do not compute it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from msgspec.structs import replace

from pagedserve.protocol.messages import PromptLogprobs, SamplingParams

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Request, Sequence


class PromptLogprobsMismatch(ValueError):
    """Prompt logprobs in a step result that do not fit what the step computed."""


def merge(step: int, chunks: dict[str, PromptLogprobs], seqs: dict[str, "Sequence"]) -> None:
    """Append each chunk to its request's prompt logprobs; ``seqs``: the step's sequences by id."""
    for seq_id, chunk in chunks.items():
        seq = seqs.get(seq_id)
        if seq is None or seq.request.sampling.prompt_logprobs is None:
            raise PromptLogprobsMismatch(f"step {step}: prompt logprobs for {seq_id!r}, which did not ask "
                                         "for them in this step")
        request = seq.request
        if chunk.end > request.num_prompt_tokens:
            raise PromptLogprobsMismatch(f"step {step}: prompt logprobs for {seq_id!r} up to token {chunk.end} "
                                         f"of a {request.num_prompt_tokens}-token prompt")
        if any(len(top) > request.sampling.prompt_logprobs for top in chunk.top_logprobs):
            raise PromptLogprobsMismatch(f"step {step}: more prompt alternatives for {seq_id!r} than it asked for")
        held = request.prompt_logprobs
        have = held.end if held is not None else 1
        if chunk.start > have:
            raise PromptLogprobsMismatch(f"step {step}: prompt logprobs for {seq_id!r} from token {chunk.start}, "
                                         f"but tokens before it are missing (have up to {have})")
        skip = have - chunk.start
        if skip >= len(chunk.logprobs):
            continue  # all recomputed: already held
        if held is None:
            request.prompt_logprobs = chunk if skip == 0 else PromptLogprobs(
                have, chunk.logprobs[skip:], chunk.ranks[skip:], chunk.top_logprobs[skip:])
        else:
            held.logprobs += chunk.logprobs[skip:]
            held.ranks += chunk.ranks[skip:]
            held.top_logprobs += chunk.top_logprobs[skip:]


def complete(request: "Request") -> PromptLogprobs:
    """The request's prompt logprobs, all of them: for a sample's first delta."""
    held = request.prompt_logprobs
    if held is None:
        held = request.prompt_logprobs = PromptLogprobs(1, [], [], [])
    if held.end != max(request.num_prompt_tokens, 1):
        raise PromptLogprobsMismatch(f"request {request.request_id!r} sampled with prompt logprobs of tokens "
                                     f"[1, {held.end}) of a {request.num_prompt_tokens}-token prompt")
    return held


def sampling_to_send(request: "Request", sampling: SamplingParams) -> SamplingParams:
    """``sampling`` for the workers: without prompt_logprobs once all of them are held."""
    held: Optional[PromptLogprobs] = request.prompt_logprobs
    if sampling.prompt_logprobs is None or held is None or held.end < request.num_prompt_tokens:
        return sampling
    return replace(sampling, prompt_logprobs=None)
