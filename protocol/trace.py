"""Trace files: every frame a scheduler exchanged, in order, for replay and debugging.

Layout (docs/TRACES.md has the full story): the magic line ``PAGEDSERVE-TRACE v1\\n``, then
records of ``u32 length | u32 crc32(body) | u32 crc32(the 8 bytes before) | body``, the body
being msgpack ``[direction, payload bytes]``. The first records are ``meta`` (a msgpack
map: protocol version, model id, weights fingerprint, device, config) and ``hello`` (the
rank-0 WorkerHello frame). Directions afterwards: ``from_frontend``, ``to_worker``,
``from_worker`` (protocol frames) and ``fail_all`` (payload: the reason, when the scheduler
failed its requests after losing a worker).

Each record is written with one write and flushed, so a crashed process tears at most the
last record. The header checksum tells the two kinds of damage apart: a complete header
whose body runs past the end of the file is a torn tail (reported, everything before it
readable), while a bad header or body checksum anywhere is corruption (refused).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import msgspec

from pagedserve.protocol.codec import PROTOCOL_VERSION, encode
from pagedserve.protocol.model_identity import config_identity

TRACE_MAGIC = b"PAGEDSERVE-TRACE v1\n"
_MAGIC_STEM = b"PAGEDSERVE-TRACE"
_LENGTH_CRC = struct.Struct("<II")
_HEADER_CHECK = struct.Struct("<I")
HEADER_BYTES = _LENGTH_CRC.size + _HEADER_CHECK.size
_MAX_RECORD = 256 * 1024 * 1024
DIRECTIONS = ("meta", "hello", "from_frontend", "to_worker", "from_worker", "fail_all")
_FINGERPRINT_SAMPLES, _FINGERPRINT_CHUNK = 64, 4096
_record_encoder = msgspec.msgpack.Encoder()
log = logging.getLogger("pagedserve.trace")


class TraceError(ValueError):
    """A trace that cannot be used; the message says what is wrong and where."""


def weights_fingerprint(model_dir: str | os.PathLike) -> Optional[str]:
    """A cheap identity of a model's weights: config.json plus sampled bytes of each file.

    The worker's model id hashes only config.json, so two random models of one shape share
    it; this tells them apart without reading gigabytes (64 evenly spaced 4 KiB samples
    per safetensors file, whole files under 256 KiB). None if the directory has no weights.
    """
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files or not (root / "config.json").is_file():
        return None
    h = hashlib.sha256(config_identity(root / "config.json"))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            if size <= _FINGERPRINT_SAMPLES * _FINGERPRINT_CHUNK:
                h.update(f.read())
                continue
            stride = (size - _FINGERPRINT_CHUNK) // (_FINGERPRINT_SAMPLES - 1)
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(i * stride)
                h.update(f.read(_FINGERPRINT_CHUNK))
    return "sha256:" + h.hexdigest()[:16]


def frame_record(direction: str, payload: bytes) -> bytes:
    """One record, header included, exactly as it is appended to a trace file."""
    body = _record_encoder.encode((direction, payload))
    head = _LENGTH_CRC.pack(len(body), zlib.crc32(body))
    return head + _HEADER_CHECK.pack(zlib.crc32(head)) + body


class TraceWriter:
    """Appends records; an existing file at ``path`` is replaced."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.file = open(path, "wb")
            self.file.write(TRACE_MAGIC)
            self.file.flush()
        except OSError as exc:
            raise TraceError(f"cannot record a trace to {path}: {exc.strerror or exc}") from None
        self.header_written = False
        self.broken: Optional[str] = None  # why recording stopped, if it did

    def write_header(self, hello: Any, init: Any, config: dict) -> None:
        """meta + hello once; workers reconnected after a failure add only their hello."""
        if self.header_written:
            self.append("hello", encode(hello))
            return
        self.header_written = True
        model = config.get("model")
        meta = {"protocol_version": PROTOCOL_VERSION, "model_id": hello.model_id,
                "weights": weights_fingerprint(model) if model else None,
                "device": hello.device, "config": config,
                "init": msgspec.to_builtins(init)}
        self.append("meta", msgspec.msgpack.encode(meta))
        self.append("hello", encode(hello))

    def append(self, direction: str, payload: bytes) -> None:
        if self.broken:
            return
        try:
            self.file.write(frame_record(direction, payload))
            self.file.flush()
        except OSError as exc:  # a full disk must not take serving down: stop recording
            self.broken = f"{exc.strerror or exc}"
            log.error("trace %s: recording stopped: %s (the file ends in a torn record)", self.path, self.broken)

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # already reported by append


@dataclass
class Trace:
    path: str
    meta: dict
    records: list[tuple[str, bytes]]  # (direction, payload) after meta and hello
    hello_frame: bytes
    torn_tail: Optional[str] = None  # why the last record could not be read, if it could not


def _iter_records(data: bytes, path: str) -> Iterator[tuple[str, bytes] | str]:
    """Yields (direction, payload) per record, then a string if the tail is torn."""
    dec = msgspec.msgpack.Decoder(tuple[str, bytes])
    pos, index = len(TRACE_MAGIC), 0
    while pos < len(data):
        where = f"record {index} at byte {pos}"
        if not data[pos:].strip(b"\0"):
            yield f"torn {where}: {len(data) - pos} zero bytes at the end (crash while writing?)"
            return
        if pos + HEADER_BYTES > len(data):
            yield f"torn {where}: header cut short (crash while writing?)"
            return
        length, crc = _LENGTH_CRC.unpack_from(data, pos)
        (head_crc,) = _HEADER_CHECK.unpack_from(data, pos + _LENGTH_CRC.size)
        if zlib.crc32(data[pos:pos + _LENGTH_CRC.size]) != head_crc or length > _MAX_RECORD:
            raise TraceError(f"{path}: {where} is corrupt (header checksum mismatch)")
        body = data[pos + HEADER_BYTES:pos + HEADER_BYTES + length]
        if len(body) < length:
            yield f"torn {where}: {len(body)} of {length} bytes present (crash while writing?)"
            return
        if zlib.crc32(body) != crc:
            raise TraceError(f"{path}: {where} is corrupt (checksum mismatch)")
        try:
            direction, payload = dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TraceError(f"{path}: {where} is not a trace record: {exc}") from None
        if direction not in DIRECTIONS:
            raise TraceError(f"{path}: {where} has unknown direction {direction!r}")
        yield direction, payload
        pos += HEADER_BYTES + length
        index += 1


def _check_magic(data: bytes, path: str) -> None:
    if data.startswith(TRACE_MAGIC):
        return
    if data.startswith(_MAGIC_STEM):
        line = data[:64].split(b"\n", 1)[0].decode(errors="replace")
        raise TraceError(f"{path} is a trace in another format ({line!r}); "
                         f"this build reads {TRACE_MAGIC.strip().decode()!r}")
    raise TraceError(f"{path} is not a pagedserve trace (bad magic)")


def read_trace(path: str) -> Trace:
    """The whole trace, validated; raises TraceError for anything but a torn last record."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    _check_magic(data, path)
    records: list[tuple[str, bytes]] = []
    torn = None
    for item in _iter_records(data, path):
        if isinstance(item, str):
            torn = item
        else:
            records.append(item)
    if len(records) < 2 or records[0][0] != "meta" or records[1][0] != "hello":
        why = f" ({torn})" if torn else ""
        raise TraceError(f"{path}: the trace has no header (meta and hello records){why}; "
                         "the scheduler stopped before its workers connected?")
    try:
        meta = msgspec.msgpack.decode(records[0][1])
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: unreadable meta record: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise TraceError(f"{path}: the meta record is not a map with a config")
    version = meta.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise TraceError(f"{path} was recorded with protocol version {version}; "
                         f"this build speaks {PROTOCOL_VERSION} and cannot replay it")
    return Trace(path=path, meta=meta, records=records[2:], hello_frame=records[1][1], torn_tail=torn)
