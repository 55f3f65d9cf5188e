"""The base of every wire message (protocol/messages.py), apart so that a message kept in its own
module (scheduler_stats.py) shares it without importing messages.py back."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True, omit_defaults=False):
    """Base of every message; the class name is the wire tag."""
