"""GPTQ's and AWQ's packed int32 tensors read as the integer layers take them (worker_proc/quantization.py):
a slice's signed values [out, in] int8, its scales [out, groups] and zero points (None when every one is
the midpoint, which the symmetric kernels take), never as a float weight.

GPTQ (AutoGPTQ / GPTQModel, ``{prefix}.qweight`` [in / (32 / bits), out]): a word holds ``32 / bits``
consecutive inputs of one output, the first in the lowest bits; ``qzeros`` [groups, out / (32 / bits)] packs
the zero points along the outputs the same way; ``scales`` [groups, out]; ``g_idx`` [in] the group of each
input. The weight is ``scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``. A v1 checkpoint
(``checkpoint_format: gptq``) stores each zero point less one; the one is added back to the unpacked value
(AutoGPTQ's qlinear_cuda.py, its Marlin repack and the exllama kernels vLLM runs: a stored 15 is 16, where
AutoGPTQ's older qlinear_cuda_old masks it to 0 and GPTQModel's whole-word addition carries into the next
one; they differ only there, a zero point v1's writer could not store).

With ``desc_act`` the groups follow ``g_idx``, not the inputs' order: the weight's inputs are put in
``argsort(g_idx)``'s order here, making each group contiguous again, and the layer gathers its activations in
the same order at every call (``input_order``: one index_select of [rows, in] a call, where a float copy of the
weight would be the other way). q, k, v (gate, up) read the same inputs, so GPTQ finds the same order for
them; fused parts whose orders differ are refused.

AWQ (AutoAWQ's GEMM, ``{prefix}.qweight`` [in, out / 8]): a word holds 8 outputs of one input in AWQ's
nibble order: the nibble at bits 4j holds output ``8c + [0, 2, 4, 6, 1, 3, 5, 7][j]``; ``qzeros``
[groups, out / 8] the same; ``scales`` [groups, out]; weight ``(q - zero) * scale``, no offset.

Tensor-parallel slices: GPTQ's outputs and AWQ's inputs are columns / rows of the packed tensors as
stored; GPTQ's inputs are whole words (and groups), AWQ's outputs the words that cover them, unpacked and
trimmed. Every shape that does not fit raises UnsupportedModelError in one line naming the tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.protocol.quantization import QuantizationSpec
from pagedserve.worker_proc.model_config import UnsupportedModelError

Part = Optional[tuple[int, int]]
AWQ_NIBBLE_OUTPUTS = (0, 2, 4, 6, 1, 3, 5, 7)  # the output of each nibble of an AWQ word, lowest first
# where each output of a word sits: its nibble index (AWQ_NIBBLE_OUTPUTS inverted)
AWQ_OUTPUT_NIBBLES = tuple(AWQ_NIBBLE_OUTPUTS.index(o) for o in range(8))


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned ``bits``-bit values (int32), lowest bits first, the values of a word
    consecutive along ``dim`` (0: [w, n] -> [w * per_word, n]; 1: [r, w] -> [r, w * per_word])."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return values.reshape(words.shape[0] * per_word, words.shape[1])
    values = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], words.shape[1] * per_word)


def _sliced(part: Part, extent: int) -> Part:
    """``part`` of a dimension of ``extent``, or None where it is all of it (one rank reads the whole tensor)."""
    return None if part is None or tuple(part) == (0, extent) else part


def _layer_parts(unsigned: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int):
    """[in, out] unsigned values, [groups, out] scales and zero points -> what the layers take: signed
    values [out, in] int8, scales [out, groups], zero points (signed, float32) or None at the midpoint, no mins."""
    mid = 1 << (bits - 1)
    q = (unsigned - mid).to(torch.int8).t().contiguous()
    zero = None if bool((zeros == mid).all()) else (zeros - mid).to(torch.float32).t().contiguous()
    return q, scales.t().contiguous(), zero, None


class _PackedReader:
    """What GPTQ's and AWQ's readers share: which projections are quantized, the scale and zero tensors' shapes."""
    mixed_as_float = False  # a fused projection half quantized is refused (compressed-tensors' rule)
    mixed_as_stack = False

    def __init__(self, source, spec: QuantizationSpec):
        self.source, self.spec = source, spec

    def spec_of(self, prefix: str) -> Optional[QuantizationSpec]:
        return self.spec if prefix + ".qweight" in self.source else None

    def _groups(self, prefix: str, k: int) -> int:
        group = self.spec.group_size
        if group is not None and k % group:
            raise UnsupportedModelError(f"{prefix} has {k} inputs, not a multiple of group_size {group}")
        return k // group if group else 1

    def _shaped(self, name: str, shape: tuple[int, int]) -> None:
        got = tuple(self.source.shape(name))
        if got != shape:
            raise UnsupportedModelError(f"{name} has shape {list(got)}, not {list(shape)}")

    def _words(self, prefix: str) -> None:
        """qweight and qzeros hold int32 words (the shifts below read nothing else)."""
        for name in (prefix + ".qweight", prefix + ".qzeros"):
            if self.source.dtype_name(name) != "I32":
                raise UnsupportedModelError(f"{name} is {self.source.dtype_name(name)}, not int32 words")

    def _group_rows(self, prefix: str, dim: int, part: Part) -> Part:
        """The scales' / zeros' rows a slice of the inputs reads (None: all; per channel, the one row serves all)."""
        group = self.spec.group_size
        if dim != 1 or part is None or group is None:
            return None
        start, end = part
        if start % group or end % group:
            raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a group of {group}")
        return start // group, end // group

    def input_order(self, prefix: str, dim: int, part: Part) -> Optional[torch.Tensor]:
        """The order the layer reads its inputs in (None: their own); only GPTQ's activation order has one."""
        return None


class GPTQReader(_PackedReader):
    def _shape(self, prefix: str) -> tuple[int, int]:
        """(out, in) of the whole weight, from ``scales`` and ``g_idx`` (or the packed rows)."""
        per_word = 32 // self.spec.bits
        words, n = self.source.shape(prefix + ".qweight")
        k = self.source.shape(prefix + ".g_idx")[0] if prefix + ".g_idx" in self.source else words * per_word
        if words * per_word != k:
            raise UnsupportedModelError(f"{prefix}.qweight has {words} rows of words, not the {-(-k // per_word)} "
                                        f"of {k} {self.spec.bits}-bit inputs")
        return n, k

    def _group_of_input(self, prefix: str, k: int) -> Optional[torch.Tensor]:
        """g_idx where it is not the inputs' own order of groups (activation order), else None."""
        if prefix + ".g_idx" not in self.source:
            return None
        g_idx = self.source.get(prefix + ".g_idx").to(torch.int64)
        group = self.spec.group_size or k
        in_order = torch.arange(k) // group
        if torch.equal(g_idx, in_order):
            return None
        if not torch.equal(g_idx.sort().values, in_order):
            raise UnsupportedModelError(f"{prefix}.g_idx does not give each group {group} inputs")
        return g_idx

    def input_order(self, prefix: str, dim: int, part: Part) -> Optional[torch.Tensor]:
        k = self._shape(prefix)[1]
        g_idx = self._group_of_input(prefix, k)
        if g_idx is None:
            return None
        if dim == 1 and _sliced(part, k) is not None:
            raise UnsupportedModelError(f"{prefix}: activation order (desc_act) with its inputs split across "
                                        f"ranks is not supported")
        return torch.argsort(g_idx, stable=True)

    def read(self, prefix: str, dim: int,
             part: Part) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], None]:
        bits, src = self.spec.bits, self.source
        per_word = 32 // bits
        self._words(prefix)
        n, k = self._shape(prefix)
        groups = self._groups(prefix, k)
        part = _sliced(part, n if dim == 0 else k)
        self._shaped(prefix + ".scales", (groups, n))
        self._shaped(prefix + ".qzeros", (groups, -(-n // per_word)))
        rows = self._group_rows(prefix, dim, part)
        if dim == 1 and part is not None:
            start, end = part
            if start % per_word or end % per_word:
                raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a packed word")
            words = src.get(prefix + ".qweight", dim=0, part=(start // per_word, end // per_word))
        else:
            words = src.get(prefix + ".qweight", dim=1, part=part)
        unsigned = unpack_words(words, bits, dim=0)
        scales = src.get(prefix + ".scales", dim=0, part=rows)
        zeros = unpack_words(src.get(prefix + ".qzeros", dim=0, part=rows), bits, dim=1)[:, :n]
        if self.spec.format == "gptq":  # v1: stored less one
            zeros = zeros + 1
        if dim == 0 and part is not None:
            scales, zeros = scales[:, part[0]:part[1]], zeros[:, part[0]:part[1]]
        order = self.input_order(prefix, dim, part)
        if order is not None:  # each group's inputs together, in the groups' order
            unsigned = unsigned.index_select(0, order)
        return _layer_parts(unsigned, scales, zeros, bits)


class AWQReader(_PackedReader):
    def read(self, prefix: str, dim: int,
             part: Part) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], None]:
        src = self.source
        self._words(prefix)
        k, words = src.shape(prefix + ".qweight")
        n = src.shape(prefix + ".scales")[-1]
        if words * 8 != n:
            raise UnsupportedModelError(f"{prefix}.qweight has {words} words a row, not one per 8 of {n} outputs")
        groups = self._groups(prefix, k)
        part = _sliced(part, n if dim == 0 else k)
        self._shaped(prefix + ".scales", (groups, n))
        self._shaped(prefix + ".qzeros", (groups, words))
        rows = self._group_rows(prefix, dim, part)
        scales = src.get(prefix + ".scales", dim=0, part=rows)
        zero_words = src.get(prefix + ".qzeros", dim=0, part=rows)
        if dim == 0 and part is not None:  # the words holding this rank's outputs, unpacked, then trimmed
            start, end = part
            first, last = start // 8, -(-end // 8)
            words_read = src.get(prefix + ".qweight", dim=1, part=(first, last))
            zero_words, keep = zero_words[:, first:last], slice(start - 8 * first, end - 8 * first)
            scales = scales[:, start:end]
        else:
            words_read, keep = src.get(prefix + ".qweight", dim=0, part=part), slice(None)
        unsigned, zeros = (self._natural(unpack_words(t, 4, dim=1))[:, keep] for t in (words_read, zero_words))
        return _layer_parts(unsigned, scales, zeros, 4)

    @staticmethod
    def _natural(values: torch.Tensor) -> torch.Tensor:
        """[rows, words * 8] in nibble order -> the outputs' own order."""
        r, c = values.shape
        return values.view(r, c // 8, 8)[:, :, list(AWQ_OUTPUT_NIBBLES)].reshape(r, c)


def packed_reader(source, spec: QuantizationSpec) -> Optional[_PackedReader]:
    """The reader of a GPTQ or AWQ checkpoint's projections (None for another method)."""
    return {"gptq": GPTQReader, "awq": AWQReader}.get(spec.method, lambda *_: None)(source, spec)
