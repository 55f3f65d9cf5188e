"""The transformers backend: a decoder-only causal LM run by transformers' own modeling code over the paged cache.

pagedserve writes a few families itself (models/causal_lm.py); any other decoder-only ``*ForCausalLM``
transformers can build runs here, the way vLLM's Transformers backend (``--model-impl transformers``)
runs them: transformers' modules, with pagedserve's paged attention registered in its
``AttentionInterface`` under ``ATTENTION_NAME``. A step's ragged batch goes in as one sequence
(batch 1, T tokens) with the engine's positions as ``position_ids``; each attention layer writes its
keys and values into its layer of the paged cache and attends through ``attention.attend``, the
dispatch the native layers use (native CPU kernels, SDPA chunks, Triton), so prefix caching, chunked
prefill and mixed prefill/decode steps behave as they do there. The head is the model's own (its
logit scaling or soft-capping), run over the rows the runner asks for: the sampled ones.

What a model needs is learned from the model itself at start, by ``_probe``: two short sequences run
packed as one and one by one, through an attention that records every call and attends within each
sequence. The model is refused, in one line saying why, when its attention does not go through the
interface, when one sequence's outputs depend on the other's outside attention (recurrent,
convolutional or state-space layers), when a layer asks for what the kernels cannot do (logit
soft-capping, non-causal or cross attention, layers of different head counts), or when the
probe's logits are not the model's own with its own attention. Keys and values of different head
sizes (latent attention's, or layers of different sizes) share the cache at the largest size, the
smaller padded with zeros.
Tensor parallelism is refused (one rank holds the whole model).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.protocol.model_identity import config_identity
from pagedserve.worker_proc.attention import attend
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.worker_proc.input_batch import ForwardBatch
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError
from pagedserve.worker_proc.models.family import Family
from pagedserve.worker_proc.prefill_attention import with_sink_key
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

ATTENTION_NAME = "pagedserve_paged"
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
PROBE_LENGTHS = (5, 3)
# The probe's logits may differ from the reference's by this share of the largest logit: float32
# differs in rounding only; half precision in matmul orders.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_PROBE_TOLERANCE = 5e-2


def _causal_lm_class(config: Any) -> type:
    """transformers' class for config.json's architecture, if it is a decoder-only causal LM it knows."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = getattr(config, "architectures", None) or []
    known = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for name in ((names,) if isinstance(names, str) else names)}
    arch = next((a for a in architectures if a in known), None)
    if arch is None:
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
        raise UnsupportedModelError(
            f"the transformers backend runs decoder-only causal LMs, and {architectures or config.model_type!r} "
            f"is not one of transformers' causal-LM classes"
            + (f" (its causal LM is {default}: set architectures to it)" if isinstance(default, str) else ""))
    if config.get_text_config() is not config:
        raise UnsupportedModelError(f"{arch} is a multimodal model; the transformers backend runs text decoders only")
    return getattr(transformers, arch)


def load_backend_spec(model_dir: str | Path) -> ModelSpec:
    """The model's shape from its config, for the transformers backend; refuses what the config alone shows
    it cannot run. The backend's probe confirms the cache's shape from the model's own attention calls."""
    from transformers import AutoConfig

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise UnsupportedModelError(f"{config_path} not found: is {model_dir!r} an HF model directory?")
    config = AutoConfig.from_pretrained(str(model_dir))
    arch = _causal_lm_class(config).__name__
    layer_types = list(_read(config, "layer_types") or [])
    others = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if others:
        raise UnsupportedModelError(f"{arch} has {', '.join(others)} layers: the transformers backend runs attention "
                                    f"layers only (no recurrent, state-space, linear or chunked attention)")
    num_layers = int(_read(config, "num_hidden_layers") or 0)
    num_heads = int(_read(config, "num_attention_heads") or 0)
    hidden = int(_read(config, "hidden_size") or 0)
    if not (num_layers and num_heads and hidden):
        raise UnsupportedModelError(f"{arch}'s config names no num_hidden_layers, num_attention_heads or hidden_size")
    num_kv_heads = int(_read(config, "num_key_value_heads") or num_heads)
    head_dim = int(_read(config, "head_dim") or hidden // num_heads)
    window = _read(config, "sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types) \
        if len(layer_types) == num_layers and window else (None,) * num_layers
    return ModelSpec(
        architecture=arch,
        model_id=f"{arch}:{hashlib.sha256(config_identity(config_path)).hexdigest()[:16]}:transformers",
        hidden_size=hidden, intermediate_size=_largest(_read(config, "intermediate_size")) or 4 * hidden,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        vocab_size=int(config.vocab_size), rms_norm_eps=0.0, qkv_bias=False, o_bias=False, mlp_bias=False,
        tie_word_embeddings=bool(_read(config, "tie_word_embeddings")),
        max_position_embeddings=int(_read(config, "max_position_embeddings") or 2048),
        layer_sliding_windows=windows, hf_config=config,
        family=Family())  # transformers' own modules load the checkpoint: no names of ours


def _read(config: Any, name: str) -> Any:
    """A config field, or None where the config has none or keeps it per layer (Gemma 4's head_dim): the
    probe reads the true sizes off the model's attention calls."""
    try:
        value = getattr(config, name, None)
    except Exception:
        return None
    return _largest(value) if isinstance(value, (list, tuple)) and name != "layer_types" else value


def _largest(value: Any) -> int:
    """A size some configs give per layer (Gemma 3n's intermediate_size) as one number."""
    return int(max(value) if isinstance(value, (list, tuple)) else value or 0)


def _paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                             sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, heads, T, dim], key/value [1, kv_heads, T, dim]
    -> ([1, T, heads, dim], no weights). The mask is never built for this implementation (masking_utils
    skips implementations it has no mask function for): causality and windows come from the batch."""
    owner = module.__dict__.get("_pagedserve_owner")
    if owner is None:
        raise RuntimeError(f"{type(module).__name__} runs {ATTENTION_NAME!r} attention outside the transformers backend")
    return owner.attention(module, query, key, value, scaling, sliding_window, softcap, kwargs), None


@dataclass(slots=True)
class _Call:
    """One attention call the probe saw."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    cross: bool  # keys of another length than the queries
    sliding_window: Optional[int]
    unsupported: list[str]


@dataclass(frozen=True, slots=True)
class _PagedLayer:
    """An attention module's layer of the cache, its window where the call names none, its values' size."""

    index: int
    sliding_window: Optional[int]
    value_dim: int


@dataclass(slots=True)
class _Probe:
    """Attention within each segment of the flattened tokens, recording every call."""

    segments: list[tuple[int, int]]
    calls: list[_Call] = field(default_factory=list)

    def attend(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               window: Optional[int], softcap: Optional[float], extra: dict) -> torch.Tensor:
        unsupported = []
        if softcap:
            unsupported.append(f"attention logit soft-capping ({softcap})")
        sinks = _sinks(module, extra)
        if getattr(module, "is_causal", True) is False:
            unsupported.append("non-causal attention")
        if window is not None and not isinstance(window, int):
            unsupported.append(f"a sliding window of {window!r}")
            window = None
        cross = key.shape[2] != query.shape[2]
        self.calls.append(_Call(module, query.shape[1], key.shape[1], key.shape[3], value.shape[3], cross, window,
                                unsupported))
        out = query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3])
        if cross:
            return out
        for start, end in self.segments:
            n = end - start
            positions = torch.arange(n, device=query.device)
            visible = positions[None, :] <= positions[:, None]
            if window:
                visible &= (positions[:, None] - positions[None, :]) < window
            q, k, v = (t[:, :, start:end].float() for t in (query, key, value))
            mask = visible
            if sinks is not None:
                bias = torch.zeros(visible.shape, device=query.device).masked_fill_(~visible, float("-inf"))
                k, v, mask = with_sink_key(k, v, bias, sinks.reshape(1, -1, 1, 1))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            out[0, start:end] = o[0].transpose(0, 1).to(out.dtype)
        return out


def _sinks(module: nn.Module, extra: dict) -> Optional[torch.Tensor]:
    """The layer's attention sinks (gpt-oss passes ``s_aux``), float32 [heads], or None."""
    sinks = extra.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    return None if sinks is None else sinks.detach().float()


@functools.cache
def _hidden_only_output() -> type:
    """A decoder's output holding only last_hidden_state; any other field a head reads is None."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class HiddenOnly(BaseModelOutputWithPast):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return HiddenOnly


class _NoPositionTable:
    """The runner's rotary hooks: transformers computes its rotary embeddings from position_ids each step."""

    def ensure_positions(self, max_positions: int) -> None:
        pass

    def check_positions(self, low: int, high: int) -> None:
        if low < 0:
            raise IndexError("a negative position")


@dataclass(frozen=True, slots=True)
class _HeadOnly:
    """What the worker's log reads of a model's lm_head (no native panels or packed copy here)."""

    panels: None = None
    packed: None = None
    gemv: bool = False
    gemv_panels: None = None


class TransformersCausalLM:
    """The model runner's model interface (forward, compute_logits, final_norm) over a transformers model."""

    def __init__(self, model_dir: str, spec: ModelSpec, shard: TensorParallelShard, device: torch.device,
                 dtype: torch.dtype, elementwise: Any = None):
        if shard.size > 1:
            raise UnsupportedModelError(f"the transformers backend runs on one device: tensor-parallel size "
                                        f"{shard.size} is not supported for {spec.architecture} (use 1)")
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
        config = spec.hf_config.__class__.from_dict(spec.hf_config.to_dict())
        kwargs = {"device_map": {"": str(device)}} if device.type != "cpu" else {}
        try:
            self.hf = _causal_lm_class(config).from_pretrained(model_dir, config=config, dtype=dtype,
                                                               attn_implementation=ATTENTION_NAME, **kwargs).eval()
        except (ValueError, ImportError, KeyError, TypeError) as exc:
            raise UnsupportedModelError(f"transformers cannot load {spec.architecture} from {model_dir}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        self.device, self.dtype = device, dtype
        self.elementwise = TorchElementwise()  # transformers' own ops run the norms and rotary
        self.rotary, self.lm_head = _NoPositionTable(), _HeadOnly()
        for module in self.hf.modules():
            module._pagedserve_owner = self
        self._probe: Optional[_Probe] = None
        self._step: Optional[tuple[ForwardBatch, torch.Tensor, ModuleType]] = None
        self.decoder, self._stand_aside = _decoder_of(self.hf)
        if self.decoder is None:
            raise UnsupportedModelError(f"{spec.architecture} has no decoder apart from its head")
        self._decoder_forward = self.decoder.forward
        with torch.inference_mode():
            self._layers, self.spec = self._check(spec)

    # ------------------------------------------------------------------ the probe

    def _run(self, ids: torch.Tensor, positions: torch.Tensor,
             segments: list[tuple[int, int]]) -> tuple[torch.Tensor, list[_Call]]:
        """The whole causal LM's logits [T, vocab] over tokens attending within each segment, and its
        attention calls."""
        probe = self._probe = _Probe(segments)
        try:
            return self.hf(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0].float(), \
                probe.calls
        finally:
            self._probe = None

    def _check(self, spec: ModelSpec) -> tuple[dict[nn.Module, _PagedLayer], ModelSpec]:
        name = spec.architecture
        generator = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, spec.vocab_size, (n,), generator=generator).to(self.device) for n in PROBE_LENGTHS]
        ids = torch.cat(seqs)
        positions = torch.cat([torch.arange(n, device=self.device) for n in PROBE_LENGTHS])
        bounds = [0]
        for n in PROBE_LENGTHS:
            bounds.append(bounds[-1] + n)
        segments = list(zip(bounds, bounds[1:]))
        try:
            packed, calls = self._run(ids, positions, segments)
            alone = [self._run(s, torch.arange(len(s), device=self.device), [(0, len(s))])[0] for s in seqs]
            reference = self._own_attention_logits(seqs[0])
        except Exception as exc:  # what the model needs that the flattened batch does not give it
            raise UnsupportedModelError(f"{name} does not run on the flattened batch of the transformers backend: "
                                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        if not calls:
            raise UnsupportedModelError(f"{name}'s attention does not go through transformers' AttentionInterface, "
                                        f"so the transformers backend cannot give it the paged cache")
        problems = sorted({p for c in calls for p in c.unsupported}
                          | ({"cross-attention"} if any(c.cross for c in calls) else set()))
        if problems:
            raise UnsupportedModelError(f"{name} asks for {', '.join(problems)}, which pagedserve's attention "
                                        f"kernels do not compute")
        if len({id(c.module) for c in calls}) != len(calls):
            raise UnsupportedModelError(f"{name} runs an attention module more than once per forward")
        heads = {(c.num_heads, c.num_kv_heads) for c in calls}
        if len(heads) > 1:
            raise UnsupportedModelError(f"{name}'s attention layers differ in query or KV heads {sorted(heads)}: "
                                        f"the paged cache holds one shape")
        num_heads, num_kv_heads = heads.pop()
        # The cache's head size is the largest key or value size of any layer; the smaller are padded with zeros.
        head_dim = max(max(c.head_dim, c.value_dim) for c in calls)
        tolerance = self._tolerance()
        for (start, end), own in zip(segments, alone):
            if not _close(packed[start:end], own, tolerance):
                raise UnsupportedModelError(
                    f"{name}'s tokens change other sequences' outputs outside attention (recurrent, "
                    f"convolutional or state-space layers, or positions not read from position_ids): "
                    f"the transformers backend batches sequences as one")
        if not _close(alone[0], reference, tolerance):
            raise UnsupportedModelError(
                f"{name}'s outputs with paged attention are not its own (its attention reads a mask or "
                f"arguments that pagedserve's kernels do not, or it numbers positions its own way): "
                f"refused rather than computed wrongly")
        self._probe = _Probe(segments)
        try:
            hidden = self._decoder_hidden(ids[None], positions[None])
        finally:
            self._probe = None
        if not _close(self.compute_logits(hidden), packed, tolerance):
            raise UnsupportedModelError(f"{name}'s logits are not its head's over its base model's output")
        windows = [c.sliding_window if c.sliding_window is not None else
                   (spec.layer_sliding_windows[i] if len(calls) == spec.num_layers else None)
                   for i, c in enumerate(calls)]
        layers = {c.module: _PagedLayer(i, windows[i], c.value_dim) for i, c in enumerate(calls)}
        true_spec = _replace(spec, num_layers=len(calls), num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, layer_sliding_windows=tuple(windows))
        return layers, true_spec

    def _own_attention_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's logits with its own (eager) attention: what the probe's must equal."""
        self.hf.set_attn_implementation("eager")
        try:
            positions = torch.arange(len(ids), device=ids.device)[None]
            return self.hf(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0].float()
        finally:
            self.hf.set_attn_implementation(ATTENTION_NAME)

    def _tolerance(self) -> float:
        return PROBE_TOLERANCE.get(self.dtype, HALF_PROBE_TOLERANCE)

    # ------------------------------------------------------------------ the model runner's interface

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: Optional[float], window: Optional[int], softcap: Optional[float],
                  extra: dict) -> torch.Tensor:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if self._probe is not None:
            return self._probe.attend(module, query, key, value, scale, window, softcap, extra)
        layer = self._layers[module]
        batch, kv_cache, ops = self._step
        k_cache, v_cache = kv_cache[layer.index, 0], kv_cache[layer.index, 1]
        size = k_cache.shape[-1]
        if key.shape[-1] < size:  # zeros add nothing to q . k (the scale is the model's own, not the padded size's)
            query, key = (F.pad(t, (0, size - key.shape[-1])) for t in (query, key))
        if value.shape[-1] < size:
            value = F.pad(value, (0, size - value.shape[-1]))
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, dim]
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = attend(ops, q, k, v, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                     scale, window if window is not None else layer.sliding_window, batch.attention_plan,
                     sinks=_sinks(module, extra))
        return out[None, :, :, :layer.value_dim]

    def _decoder_hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._decoder_forward(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """Final hidden states [T, hidden] (after the model's final norm), or only the rows
        ``batch.output_rows`` names. Every layer runs every row: the last is not pruned here."""
        self._step = (batch, kv_cache, ops)
        try:
            hidden = self._decoder_hidden(batch.input_ids[None], batch.positions[None])
        finally:
            self._step = None
        return hidden if batch.output_rows is None else hidden[batch.output_rows.rows]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """forward()'s rows are already the model's last_hidden_state."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of forward()'s rows, by the causal LM's own forward with its decoder
        standing aside (it returns ``hidden``): whatever the head does (scaling, soft-capping) is its own."""
        output = _hidden_only_output()(last_hidden_state=hidden[None])
        for module in self._stand_aside:
            module.forward = lambda *args, **kwargs: output
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            return self.hf(input_ids=dummy, use_cache=False, logits_to_keep=0).logits[0].float()
        finally:
            for module in self._stand_aside:
                del module.forward


def _decoder_of(model: nn.Module) -> tuple[Optional[nn.Module], list[nn.Module]]:
    """(the module whose last_hidden_state is the head's input, the modules the causal LM's forward may call
    for it: the base model, and the decoder inside it where the LM calls that (OPT's model.decoder))."""
    head = model.get_output_embeddings()
    candidates = [model.base_model, getattr(model, "model", None)]
    base = next((m for m in candidates if isinstance(m, nn.Module) and m is not model and m is not head), None)
    if base is None:
        return None, []
    inner = base.get_decoder() if hasattr(base, "get_decoder") else base
    nested = isinstance(inner, nn.Module) and inner is not base and inner is not head
    return base, [base, inner] if nested else [base]


def _close(ours: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> bool:
    if ours.shape != theirs.shape or not torch.isfinite(ours).all():
        return False
    return bool((ours - theirs).abs().max() <= tolerance * max(1.0, float(theirs.abs().max())))


def _replace(spec: ModelSpec, **changes) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)
