"""A checkpoint's quantization, read once from config.json's ``quantization_config``: what the
serve command refuses at start (before any process runs) and what the worker loads by.

Three methods are read (vLLM's ``--quantization`` names), all onto the same integer layers:

- ``gptq`` (AutoGPTQ / GPTQModel): 4- or 8-bit weights in groups (or one per output channel,
  ``group_size: -1``), symmetric or not, ``desc_act`` (activation order, a ``g_idx`` per input) or not,
  in ``checkpoint_format`` ``gptq`` (v1: zero points stored less one) or ``gptq_v2``; the other
  checkpoint formats (marlin, bitblas, ...), per-module overrides (``dynamic``) and
  packing words other than int32 are refused. Activation order under tensor parallelism is refused: a
  rank's slice of o_proj's / down_proj's inputs would hold parts of many groups.
- ``awq`` (AutoAWQ's ``version: gemm`` packing, as the hub ships it): 4-bit weights in groups with zero
  points; ``gemv``, ``gemv_fast``, ``marlin``, ``exllama``, llm-awq's own backend and AWQ without zero
  points are refused.
- ``compressed-tensors`` (llm-compressor's format), below.

A quantized lm_head (GPTQ's ``lm_head: true``, compressed-tensors' targets without ``ignore: ["lm_head"]``)
is read from its tensors like any projection (worker_proc/models/causal_lm.py).

compressed-tensors' weight schemes here: integer weights of 4 or 8 bits, per output channel or
in groups along the input, symmetric or (4-bit, 8-bit weight-only) asymmetric, stored
``pack-quantized`` (int32 words) or ``int-quantized`` / ``naive-quantized`` (int8); activations
unquantized (weight-only, W4A16 / W8A16) or int8 per token, dynamic and symmetric, on int8
per-channel symmetric weights (W8A8); and ``float-quantized`` FP8 (float8_e4m3fn weights with a scale per
output channel or per tensor, symmetric), its activations unquantized, dynamic per token (the FP8_DYNAMIC
preset) or static per tensor (FP8, an ``input_scale`` per layer). Everything else (other floating-point
formats, activation ordering, other static activation scales, a quantized KV cache, sparsity, transforms,
several schemes in one model) is refused in one line naming the field, as is a config that is not what
the library writes (a corrupt one). Pure Python, no torch: ``deploy/serve_config.py`` checks a
model before starting anything, with the shapes its tensor-parallel slices would cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = ("compressed-tensors", "gptq", "awq")  # --quantization's choices
# Formats a family's own loader dequantizes at load (the model then computes in its dtype): gpt-oss's
# experts in MXFP4 (worker_proc/models/gpt_oss.py), as the hub ships them.
DEQUANTIZED_AT_LOAD = {"mxfp4": ("GptOssForCausalLM",)}
PACKED, INT8_FORMATS, FLOAT8_FORMAT = "pack-quantized", ("int-quantized", "naive-quantized"), "float-quantized"
GROUP_SIZES_INT4 = (32, 64, 128, 256)  # torch's int4 weight op takes these
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point less one (AutoGPTQ's historical offset); v2 as is
AWQ_GEMM = "gemm"


class QuantizationConfigError(ValueError):
    """The checkpoint's quantization cannot be served; the message is one line saying why."""


@dataclass(frozen=True, slots=True)
class QuantizationSpec:
    """One scheme for every quantized linear layer of the model (those ``ignore`` names stay float)."""
    method: str
    format: str  # pack-quantized | int-quantized | naive-quantized; gptq | gptq_v2; gemm (awq)
    bits: int  # weight bits: 4 or 8
    group_size: Optional[int]  # None: one scale per output channel
    symmetric: bool
    dynamic_int8_activations: bool  # W8A8: int8 x int8 -> int32, activations scaled per token
    act_order: bool = False  # GPTQ's desc_act: groups follow a g_idx per input, not the inputs' order
    float8: bool = False  # FP8 (float8_e4m3fn) weights, a scale per output channel or per tensor
    float8_activations: Optional[str] = None  # FP8 activations: "token" (dynamic) or "tensor" (static input_scale)

    @property
    def name(self) -> str:
        if self.float8:
            acts = {"token": "A8 per token", "tensor": "A8 static per tensor", None: "A16"}[self.float8_activations]
            return f"{self.method} FP8 W8{acts} ({self.format})"
        act = "A8" if self.dynamic_int8_activations else "A16"
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        order = " desc_act" if self.act_order else ""
        return (f"{self.method} W{self.bits}{act} {group}{'' if self.symmetric else ' asymmetric'}{order} "
                f"({self.format})")

    @property
    def inputs_packed(self) -> bool:
        """Whether the inputs of a row are packed into int32 words (a rank's slice of them must hold whole words)."""
        return self.format == PACKED or self.method == "gptq"


def gpu_serves(spec: QuantizationSpec) -> bool:
    """Whether a GPU runs this scheme: FP8 (torch._scaled_mm) and weight-only int4 / int8 of compressed-tensors,
    GPTQ and AWQ (kernels/quantized_gemm.py, Triton); W8A8 int8 and GGUF's types run on CPU only."""
    return spec.float8 or (spec.method in METHODS and not spec.dynamic_int8_activations and spec.bits in (4, 8))


def _fail(message: str) -> QuantizationConfigError:
    return QuantizationConfigError(f"quantization_config: {message}")


def _args(config: dict, key: str) -> Optional[dict]:
    args = config.get(key)
    if args is not None and not isinstance(args, dict):
        raise _fail(f"{key} must be an object, got {type(args).__name__}")
    return args


def _one_scheme(qc: dict) -> tuple[dict, str]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise _fail("config_groups must be an object of schemes")
    schemes = list(groups.values())
    first = {k: v for k, v in schemes[0].items() if k != "targets"}
    if any({k: v for k, v in s.items() if k != "targets"} != first for s in schemes[1:]):
        raise _fail("several schemes in one model (mixed precision) are not supported")
    for scheme in schemes:
        targets = scheme.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise _fail("each scheme's targets must be a list of names")
        if any(t != "Linear" and "proj" not in t and "lm_head" not in t for t in targets):
            raise _fail(f"targets {targets} are not supported (only Linear layers)")
    fmt = schemes[0].get("format") or qc.get("format")
    if not isinstance(fmt, str):
        raise _fail("no format")
    return schemes[0], fmt


def _dequantized_at_load(model_config: dict, method: str, requested: Optional[str]) -> None:
    """None (nothing for the linear layers to run quantized) where the model's family dequantizes
    ``method`` itself; a one-line refusal for any other architecture, or another --quantization."""
    families = DEQUANTIZED_AT_LOAD[method]
    if not any(a in families for a in model_config.get("architectures") or []):
        raise _fail(f"quant_method {method!r} is served for {', '.join(families)} only (its experts are "
                    f"dequantized at load)")
    if requested is not None:
        raise QuantizationConfigError(f"--quantization {requested} does not match the checkpoint's "
                                      f"quant_method {method!r}")
    return None


def parse_quantization_config(model_config: dict, requested: Optional[str] = None) -> Optional[QuantizationSpec]:
    """The checkpoint's scheme (None: not quantized). ``requested``: ``--quantization``, which must
    name the checkpoint's own method. Raises QuantizationConfigError (one line)."""
    qc = model_config.get("quantization_config")
    if requested is not None and requested not in METHODS:
        raise QuantizationConfigError(f"--quantization {requested!r} is not supported (choose one of "
                                      f"{', '.join(METHODS)})")
    if qc is None:
        if requested is not None:
            raise QuantizationConfigError(f"--quantization {requested}: the checkpoint is not quantized "
                                          f"(config.json has no quantization_config)")
        return None
    if not isinstance(qc, dict):
        raise _fail(f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method in DEQUANTIZED_AT_LOAD:
        return _dequantized_at_load(model_config, method, requested)
    if method not in METHODS:
        raise _fail(f"quant_method {method!r} is not supported (supported: {', '.join(METHODS)})")
    if requested is not None and requested != method:
        raise QuantizationConfigError(f"--quantization {requested} does not match the checkpoint's "
                                      f"quant_method {method!r}")
    if method == "gptq":
        return _gptq_spec(qc)
    if method == "awq":
        return _awq_spec(qc)
    return _compressed_tensors_spec(qc)


def _compressed_tensors_spec(qc: dict) -> QuantizationSpec:
    method = qc["quant_method"]
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if qc.get(key):
            raise _fail(f"{key}: {what} is not supported")
    scheme, fmt = _one_scheme(qc)
    weights, inputs = _args(scheme, "weights"), _args(scheme, "input_activations")
    if _args(scheme, "output_activations") is not None:
        raise _fail("output_activations: quantized outputs are not supported")
    if weights is None:
        raise _fail("the scheme quantizes no weights")
    bits, group, strategy = weights.get("num_bits"), weights.get("group_size"), weights.get("strategy")
    symmetric = weights.get("symmetric", True)
    if weights.get("type", "int") == "float":
        return _float8_spec(method, fmt, weights, inputs)
    if weights.get("type", "int") != "int":
        raise _fail(f"weights of type {weights.get('type')!r} are not supported (int or float)")
    if bits not in (4, 8):
        raise _fail(f"{bits!r}-bit weights are not supported (4 or 8)")
    if not isinstance(symmetric, bool):
        raise _fail(f"weights.symmetric must be true or false, got {symmetric!r}")
    if weights.get("dynamic"):
        raise _fail("dynamic weight scales are not supported")
    if weights.get("actorder") not in (None, "static", "weight"):
        raise _fail(f"activation ordering {weights.get('actorder')!r} is not supported")
    if strategy == "channel":
        if group is not None:
            raise _fail(f"weights.group_size {group!r} with the channel strategy")
    elif strategy == "group":
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise _fail(f"weights.group_size must be a positive integer, got {group!r}")
        if bits == 4 and group not in GROUP_SIZES_INT4:
            raise _fail(f"int4 groups of {group} are not supported (torch's int4 op takes "
                        f"{', '.join(map(str, GROUP_SIZES_INT4))})")
        if bits == 8 and group % 4:
            raise _fail(f"int8 groups of {group} are not whole int32 words")
    else:
        raise _fail(f"weights.strategy {strategy!r} is not supported (channel or group)")
    if fmt == PACKED:
        pass
    elif fmt in INT8_FORMATS:
        if bits != 8:
            raise _fail(f"format {fmt} holds 8-bit weights, not {bits}-bit")
    else:
        raise _fail(f"format {fmt!r} is not supported ({PACKED}, {', '.join(INT8_FORMATS)})")
    dynamic = False
    if inputs is not None:
        ok = (inputs.get("type", "int") == "int" and inputs.get("num_bits") == 8 and inputs.get("strategy") == "token"
              and inputs.get("dynamic") is True and inputs.get("symmetric", True) is True)
        if not ok:
            raise _fail("input_activations: only int8, per token, dynamic, symmetric is supported")
        if not (bits == 8 and strategy == "channel" and symmetric):
            raise _fail("int8 activations need int8 per-channel symmetric weights (W8A8)")
        dynamic = True
    return QuantizationSpec(method, fmt, bits, group if strategy == "group" else None, symmetric, dynamic)


def _float8_spec(method: str, fmt: str, weights: dict, inputs: Optional[dict]) -> QuantizationSpec:
    """compressed-tensors' FP8 presets: float8_e4m3fn weights, symmetric, per output channel or per tensor;
    activations unquantized, float8 per token (dynamic) or per tensor (static)."""
    if weights.get("num_bits") != 8:
        raise _fail(f"{weights.get('num_bits')!r}-bit float weights are not supported (8: float8_e4m3fn)")
    if weights.get("symmetric", True) is not True:
        raise _fail("asymmetric float8 weights are not supported")
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("group_size") is not None:
        raise _fail(f"float8 weights.strategy {weights.get('strategy')!r} is not supported (channel or tensor)")
    if weights.get("dynamic"):
        raise _fail("dynamic weight scales are not supported")
    if fmt != FLOAT8_FORMAT:
        raise _fail(f"format {fmt!r} does not hold float8 weights ({FLOAT8_FORMAT})")
    activations = None
    if inputs is not None:
        if inputs.get("type") != "float" or inputs.get("num_bits") != 8 or inputs.get("symmetric", True) is not True:
            raise _fail("input_activations: with float8 weights only float8, symmetric is supported")
        activations = inputs.get("strategy")
        if (activations, inputs.get("dynamic")) not in (("token", True), ("tensor", False)):
            raise _fail(f"input_activations: float8 {activations!r} with dynamic {inputs.get('dynamic')!r} is not "
                        f"supported (per token dynamic, or per tensor static)")
    return QuantizationSpec(method, fmt, 8, None, True, False, float8=True, float8_activations=activations)


def _field(qc: dict, key: str, kind: type, default, *aliases: str):
    """``qc[key]`` (or the first alias present, an older writer's name), of ``kind`` (bool is no int)."""
    present = [k for k in (key, *aliases) if k in qc and qc[k] is not None]
    if not present:
        return default
    value = qc[present[0]]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(f"{present[0]} must be {'true or false' if kind is bool else kind.__name__}, got {value!r}")
    return value


def _group_size(qc: dict, bits: int, *aliases: str) -> Optional[int]:
    """``group_size`` (None: -1, one group a row, a scale per output channel)."""
    group = _field(qc, "group_size", int, None, *aliases)
    if group is None:
        raise _fail("no group_size")
    if group == -1:
        return None
    if group < 1:
        raise _fail(f"group_size must be positive or -1, got {group}")
    if bits == 4 and group not in GROUP_SIZES_INT4:
        raise _fail(f"int4 groups of {group} are not supported (torch's int4 op takes "
                    f"{', '.join(map(str, GROUP_SIZES_INT4))}, or -1)")
    return group


def _gptq_spec(qc: dict) -> QuantizationSpec:
    """AutoGPTQ's / GPTQModel's config: what changes how the tensors are read is checked; the rest
    (damp_percent, true_sequential, ...) only said how the weights were found."""
    bits = _field(qc, "bits", int, None)
    if bits not in (4, 8):
        raise _fail(f"{bits!r}-bit GPTQ weights are not supported (4 or 8)")
    group = _group_size(qc, bits)
    formats = {k: qc[k] for k in ("checkpoint_format", "format") if qc.get(k) is not None}
    if len(set(map(str, formats.values()))) > 1:
        raise _fail(f"checkpoint_format {formats['checkpoint_format']!r} and format {formats['format']!r} disagree")
    fmt = next(iter(formats.values()), "gptq")
    if _field(qc, "is_marlin_format", bool, False):
        fmt = "marlin"
    if fmt not in GPTQ_FORMATS:
        raise _fail(f"GPTQ checkpoint_format {fmt!r} is not supported ({', '.join(GPTQ_FORMATS)}: the int32 packing)")
    _field(qc, "lm_head", bool, False)  # true: lm_head.qweight is read like any projection (models/causal_lm.py)
    if _field(qc, "pack_dtype", str, "int32") != "int32":
        raise _fail(f"pack_dtype {qc['pack_dtype']!r} is not supported (int32)")
    if qc.get("dynamic"):
        raise _fail("dynamic: per-module GPTQ overrides are not supported")
    desc_act, static_groups = _field(qc, "desc_act", bool, False), _field(qc, "static_groups", bool, False)
    # static groups are fixed in the inputs' own order before the columns are visited by activation order
    return QuantizationSpec("gptq", fmt, bits, group, _field(qc, "sym", bool, True), False,
                            act_order=desc_act and not static_groups and group is not None)


def _awq_spec(qc: dict) -> QuantizationSpec:
    """AutoAWQ's config (transformers' AwqConfig names; AutoAWQ's w_bit / q_group_size too)."""
    bits = _field(qc, "bits", int, None, "w_bit")
    if bits != 4:
        raise _fail(f"{bits!r}-bit AWQ weights are not supported (4)")
    version = _field(qc, "version", str, AWQ_GEMM).lower()
    if version != AWQ_GEMM:
        raise _fail(f"AWQ version {version!r} is not supported ({AWQ_GEMM}: AutoAWQ's GEMM packing)")
    backend = _field(qc, "backend", str, "autoawq").lower()
    if backend != "autoawq":
        raise _fail(f"AWQ backend {backend!r} is not supported (autoawq's packing)")
    if not _field(qc, "zero_point", bool, True):
        raise _fail("zero_point: false (AWQ without zero points) is not supported")
    not_converted = qc.get("modules_to_not_convert")
    if not_converted is not None and not (isinstance(not_converted, list) and all(isinstance(m, str)
                                                                                  for m in not_converted)):
        raise _fail(f"modules_to_not_convert must be a list of names, got {not_converted!r}")
    return QuantizationSpec("awq", AWQ_GEMM, bits, _group_size(qc, bits, "q_group_size"), False, False)


def check_shapes(spec: QuantizationSpec, in_features: dict[str, int], tp_size: int) -> None:
    """Each quantized projection's inputs (by name) divide into whole groups, and so does each
    rank's slice of a row-parallel one (o_proj, down_proj: their inputs are split ``tp_size``
    ways). Raises QuantizationConfigError naming the first that does not."""
    if spec.act_order and tp_size > 1:
        raise _fail("desc_act (activation order) with --tensor-parallel-size > 1 is not supported: a rank's "
                    "slice of o_proj's and down_proj's inputs would hold parts of many groups")
    # per channel, a rank's int4 inputs still divide into the kernels' groups of 32 (quantized_linear._pick_group)
    unit = spec.group_size or (32 if spec.bits == 4 else 4 if spec.inputs_packed else 1)
    for name, k in in_features.items():
        if spec.bits == 4 and spec.group_size is None and k % 32:
            raise _fail(f"{name} has {k} inputs: per-channel int4 takes multiples of 32")
        if spec.group_size and k % spec.group_size:
            raise _fail(f"{name} has {k} inputs, not a multiple of group_size {spec.group_size}")
        if name in ("o_proj", "down_proj") and tp_size > 1 and (k % tp_size or (k // tp_size) % unit):
            cut = "group" if spec.group_size else "packed word" if spec.bits == 8 else "block"
            raise _fail(f"{name}'s {k} inputs split {tp_size} ways cut a {cut} ({unit} values); pick another "
                        f"--tensor-parallel-size")


def projection_inputs(model_config: dict) -> dict[str, int]:
    """The inputs of each projection of a Llama-family layer, from config.json."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    inter = int(model_config["intermediate_size"])
    return {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim,
            "gate_proj": hidden, "up_proj": hidden, "down_proj": inter}
