"""Trace files: every frame a scheduler exchanged, in order, for replay and debugging.

Layout: the magic line ``PAGEDSERVE-TRACE\\n``, then records of
``u32 length | u32 crc32 | msgpack [direction, payload bytes]``. The first records are
``meta`` (a msgpack map: protocol version, model id, config) and ``hello`` (the rank-0
WorkerHello frame). Directions afterwards: ``from_frontend``, ``to_worker``,
``from_worker`` (protocol frames, byte for byte) and ``fail_all`` (payload: the reason,
when the scheduler failed its requests after losing a worker). Each record is written
with one write and flushed, so a crash tears at most the last record, which the reader
detects and reports while everything before it stays readable.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec

from pagedserve.protocol.codec import PROTOCOL_VERSION, encode

TRACE_MAGIC = b"PAGEDSERVE-TRACE\n"
_RECORD_HEADER = struct.Struct("<II")
_MAX_RECORD = 256 * 1024 * 1024
DIRECTIONS = ("meta", "hello", "from_frontend", "to_worker", "from_worker", "fail_all")


class TraceError(ValueError):
    """A trace that cannot be used; the message says what is wrong and where."""


class TraceWriter:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "wb")
        self.file.write(TRACE_MAGIC)
        self.file.flush()
        self._enc = msgspec.msgpack.Encoder()

    def write_header(self, hello: Any, init: Any, config: dict) -> None:
        meta = {"protocol_version": PROTOCOL_VERSION, "model_id": hello.model_id,
                "device": hello.device, "config": config}
        self.append("meta", self._enc.encode(meta))
        self.append("hello", encode(hello))

    def append(self, direction: str, payload: bytes) -> None:
        body = self._enc.encode((direction, payload))
        self.file.write(_RECORD_HEADER.pack(len(body), zlib.crc32(body)) + body)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass
class Trace:
    path: str
    meta: dict
    records: list[tuple[str, bytes]]  # (direction, payload) after meta and hello
    hello_frame: bytes
    torn_tail: str | None = None  # why the last record could not be read, if it could not
    warnings: list[str] = field(default_factory=list)


def _iter_records(data: bytes, path: str) -> Iterator[tuple[str, bytes] | str]:
    dec = msgspec.msgpack.Decoder(tuple[str, bytes])
    pos = len(TRACE_MAGIC)
    index = 0
    while pos < len(data):
        if pos + _RECORD_HEADER.size > len(data):
            yield f"torn record {index} at byte {pos}: header cut short (crash while writing?)"
            return
        length, crc = _RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + _RECORD_HEADER.size : pos + _RECORD_HEADER.size + length]
        if length > _MAX_RECORD or len(body) < length:
            yield f"torn record {index} at byte {pos}: {len(body)} of {length} bytes present"
            return
        if zlib.crc32(body) != crc:
            raise TraceError(f"{path}: record {index} at byte {pos} is corrupt (checksum mismatch)")
        try:
            direction, payload = dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TraceError(f"{path}: record {index} at byte {pos} is not a trace record: {exc}") from None
        if direction not in DIRECTIONS:
            raise TraceError(f"{path}: record {index} has unknown direction {direction!r}")
        yield direction, payload
        pos += _RECORD_HEADER.size + length
        index += 1


def read_trace(path: str) -> Trace:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    if not data.startswith(TRACE_MAGIC):
        raise TraceError(f"{path} is not a pagedserve trace (bad magic)")
    records: list[tuple[str, bytes]] = []
    torn = None
    for item in _iter_records(data, path):
        if isinstance(item, str):
            torn = item
        else:
            records.append(item)
    if len(records) < 2 or records[0][0] != "meta" or records[1][0] != "hello":
        raise TraceError(f"{path}: the trace has no header (meta and hello records); nothing was recorded?")
    try:
        meta = msgspec.msgpack.decode(records[0][1])
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: unreadable meta record: {exc}") from None
    version = meta.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise TraceError(f"{path} was recorded with protocol version {version}; "
                         f"this build speaks {PROTOCOL_VERSION} and cannot replay it")
    return Trace(path=path, meta=meta, records=records[2:], hello_frame=records[1][1], torn_tail=torn)
