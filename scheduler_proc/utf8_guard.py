"""Keeps a constrained output valid UTF-8 where the grammar backend does not.

xgrammar (0.2.x) takes the bytes ED A0..BF xx inside a JSON string as one character: the
UTF-8 form of a UTF-16 surrogate, which RFC 3629 forbids. Decoded, those three bytes become
three U+FFFD, so a sampled string that the grammar counted as 6 characters arrives with 8 and
breaks the schema's maxLength (tests/e2e/test_e2e_api_surfaces.py sampled one from the random
test model). Every other invalid sequence tried (a lone continuation byte, an overlong form,
past U+10FFFF, a truncated character) it refuses.

So each constrained row's mask is narrowed here: no token with ED then A0..BF inside it, and,
after a token that ends in ED (a three-byte character's lead), no token that begins with
A0..BF. ED 80..9F stays open, so a grammar in the middle of that character can still finish it.
"""

from __future__ import annotations

import re

import numpy as np

_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_LEAD = 0xED


def _as_words(allowed: np.ndarray) -> np.ndarray:
    """bool per token -> int32 words, bit j of word w for token 32 w + j (the bitmask's layout)."""
    padded = np.zeros(-(-len(allowed) // 32) * 32, dtype=bool)
    padded[:len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


class Utf8Guard:
    """The two narrowings of one tokenizer's vocabulary, as bitmask words."""

    __slots__ = ("anywhere", "after_lead", "ends_in_lead")

    def __init__(self, decoded_vocab: list[bytes]):
        inside_ok = np.array([_SURROGATE.search(t) is None for t in decoded_vocab], dtype=bool)
        starts_ok = np.array([not t or not 0xA0 <= t[0] <= 0xBF for t in decoded_vocab], dtype=bool)
        self.anywhere = _as_words(inside_ok)
        self.after_lead = _as_words(inside_ok & starts_ok)
        self.ends_in_lead = frozenset(i for i, t in enumerate(decoded_vocab) if t and t[-1] == _LEAD)

    def narrow(self, rows: np.ndarray, row: int, previous_token: int | None) -> None:
        """Clear the bits of ``rows[row]`` that would make the output invalid UTF-8 after
        ``previous_token`` (None: nothing before). Words past the vocabulary stay as they are."""
        words = self.after_lead if previous_token in self.ends_in_lead else self.anywhere
        rows[row, :len(words)] &= words[:rows.shape[1]]

