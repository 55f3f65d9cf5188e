"""Whose share a request counts against (``--scheduling-policy fair``, per-tenant metrics).

The first that is present wins:

1. the header the operator names with ``--tenant-header`` (a gateway that authenticated the
   caller sets it, so it is the most trustworthy source);
2. the request's ``user`` field (OpenAI's end-user id: the users of one application that
   share one API key are told apart); on ``/v1/messages``, Anthropic's ``metadata.user_id``
   (its translation carries it as ``user``; early_shed.py reads it from the body);
3. the API key the request bears (``Authorization: Bearer``), as ``key-`` and a hash of it, so
   a key never reaches stats, metrics or traces;
4. otherwise "" (one anonymous tenant).

A name longer than the protocol allows is replaced by a hash of it, so it still names one tenant.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from pagedserve.protocol.priority import MAX_TENANT_CHARS


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _bounded(name: str) -> str:
    return name if len(name) <= MAX_TENANT_CHARS else "sha256-" + _digest(name)


def tenant_of(headers, user: Optional[str], tenant_header: Optional[str]) -> str:
    """``headers``: the request's (case-insensitive mapping)."""
    if tenant_header:
        named = headers.get(tenant_header, "").strip()
        if named:
            return _bounded(named)
    if user:
        return _bounded(user)
    scheme, _, key = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key-" + _digest(key.strip())
    return ""
