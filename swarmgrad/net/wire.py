"""Wire frames: a small msgpack header plus an optional raw payload, length-prefixed.

    [u32 header length][u32 payload length][msgpack header][payload bytes]

The header says what the frame is (``"t"``) and carries small fields; bulk tensor bytes travel
in the payload, so they are never copied through msgpack. Both lengths are checked against the
reader's limits *before* anything is read or allocated (architecture.md, invariant 'bad input touches no state'): a peer
that claims a terabyte gets an error, not an allocation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack

WIRE_VERSION = 1
PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


class FrameError(ValueError):
    """A frame is malformed, oversized or not what the protocol expects here."""


class RemoteError(RuntimeError):
    """The other side answered with an error frame."""


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes = b""

    @property
    def kind(self) -> str:
        return self.header["t"]


def pack_prefix_and_header(header: Mapping[str, Any], payload_length: int) -> bytes:
    packed = msgpack.packb({"v": WIRE_VERSION, **header}, use_bin_type=True)
    if len(packed) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(len(packed), payload_length) + packed


def check_lengths(header_length: int, payload_length: int, max_payload: int) -> None:
    if header_length == 0 or header_length > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {header_length} bytes is outside 1..{MAX_HEADER_BYTES}")
    if payload_length > max_payload:
        raise FrameError(f"frame payload of {payload_length} bytes exceeds the limit of {max_payload}")


def parse_header(data: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except Exception as error:
        raise FrameError(f"frame header is not msgpack: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise FrameError("frame header must be a map with a string field 't'")
    if header.get("v") != WIRE_VERSION:
        raise FrameError(f"unsupported wire version {header.get('v')!r} (this peer speaks {WIRE_VERSION})")
    if header["t"] == "error":
        raise RemoteError(str(header.get("message", "unspecified error"))[:500])
    return header


def error_header(message: str) -> dict[str, Any]:
    return {"t": "error", "message": message[:500]}


# ---- typed field access: every field of a peer's header is checked before use ---------------


def field(header: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if kind is float and type(value) is int:  # msgpack may pack a whole float as an int
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise FrameError(f"frame field {name!r} must be {expected}, got {type(value).__name__}")
    return value


def int_field(header: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = field(header, name, int)
    if not low <= value <= high:
        raise FrameError(f"frame field {name!r}={value} is outside {low}..{high}")
    return value


def expect_kind(frame: Frame, kind: str) -> Frame:
    if frame.kind != kind:
        raise FrameError(f"expected a {kind!r} frame, got {frame.kind!r}")
    return frame
