"""What ``LLM.embed`` and ``LLM.encode`` take and return, in vLLM's shapes: ``PoolingParams``,
``EmbeddingRequestOutput`` (``.outputs.embedding``, a list of floats) and ``PoolingRequestOutput``
(``.outputs.data``, a tensor).

The pooled vector comes from the scheduler as it is; truncation (``dimensions``, Matryoshka
models only) and L2 normalisation follow the HTTP frontend's rules (client/pooling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pagedserve.client.engine_session import InFlight
from pagedserve.client.pooling import Matryoshka, finish_embedding
from pagedserve.client.routing_policy import Decision
from pagedserve.protocol import messages as m
from pagedserve.protocol.validate import InvalidField


@dataclass(slots=True)
class PoolingParams:
    """vLLM's: ``dimensions`` truncates a Matryoshka model's embedding; ``normalize`` None takes
    the deployment's (``pooler_config``; true by default)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingOutput:
    data: Any  # torch.Tensor, as vLLM's


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's: one prompt's pooling result. ``LLM.encode``'s ``outputs`` is a PoolingOutput, the
    pooled vector as a float32 tensor; ``LLM.embed`` returns the subclass below, as vLLM's."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    """``outputs`` is an EmbeddingOutput: ``outputs.embedding``, a list of floats."""

    def as_pooling_output(self) -> PoolingRequestOutput:
        """What ``LLM.encode`` returns for the same vector."""
        import torch  # only encode()'s callers pay for it

        return PoolingRequestOutput(self.request_id, PoolingOutput(torch.tensor(self.outputs.embedding,
                                                                                dtype=torch.float32)),
                                    self.prompt_token_ids, self.finished)


class EmbeddingFailed(RuntimeError):
    """The engine ended an embedding request with an error."""


def as_pooling_params_list(params: Union[PoolingParams, Sequence[PoolingParams], None], n: int,
                           matryoshka: Matryoshka, hidden_size: int) -> list[PoolingParams]:
    """One PoolingParams per prompt, each checked (ValueError naming the field)."""
    if params is None:
        params = PoolingParams()
    items = [params] * n if isinstance(params, PoolingParams) else list(params)
    if len(items) != n:
        raise InvalidField("pooling_params", f"{len(items)} pooling params for {n} prompts")
    for i, p in enumerate(items):
        if not isinstance(p, PoolingParams):
            raise InvalidField("pooling_params", f"expected PoolingParams, got {type(p).__name__} (prompt {i})")
        if p.dimensions is not None:
            refusal = matryoshka.refusal(p.dimensions, hidden_size) if isinstance(p.dimensions, int) \
                else f"dimensions must be an integer, got {p.dimensions!r}"
            if refusal is not None:
                raise InvalidField("dimensions", f"{refusal} (prompt {i})")
    return items


class PendingEmbedding(InFlight):
    """An embedding request sent and not finished (the collector's interface of PendingRequest)."""

    ended_by_stop_string = False

    def __init__(self, index: int, add: m.AddRequest, placed: Decision, params: PoolingParams, normalize: bool):
        super().__init__(add.request_id, placed.replica, 1, placed.predicted_hit_tokens)
        self.index = index
        self.prompt_token_ids = list(add.prompt_token_ids)
        self.dimensions = params.dimensions
        self.normalize = normalize if params.normalize is None else params.normalize
        self.output: Optional[EmbeddingRequestOutput] = None
        self.error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None

    def apply(self, delta: m.RequestDelta, now: float) -> int:
        if delta.embedding is not None:
            vector = finish_embedding(delta.embedding, self.dimensions, self.normalize)
            self.output = EmbeddingRequestOutput(self.request_id, EmbeddingOutput(vector.tolist()),
                                                 self.prompt_token_ids)
        elif delta.finish_reason is not None:
            self.error = delta.error or f"ended without an embedding ({delta.finish_reason})"
        return len(self.prompt_token_ids) if self.output is not None else 0
