"""Encoded tensors in wire frames: codec metadata in the header, the codec's bytes as the payload."""

from __future__ import annotations

from typing import Any, Mapping

from swarmgrad.averaging.codecs import CodecError, Encoded
from swarmgrad.averaging.wire import FrameError, field


def encoded_to_frame(encoded: Encoded) -> tuple[dict[str, Any], bytes]:
    """Header fields and one payload holding every part back to back (no copy for one part)."""
    sizes = [[name, len(part)] for name, part in encoded.parts.items()]
    payload = next(iter(encoded.parts.values())) if len(encoded.parts) == 1 else b"".join(encoded.parts.values())
    header = {"codec": encoded.codec, "shape": list(encoded.shape), "dtype": encoded.dtype, "meta": encoded.meta}
    return {"enc": header, "sizes": sizes}, payload


def encoded_from_frame(header: Mapping[str, Any], payload: bytes) -> Encoded:
    """Rebuild an Encoded from a frame, checking that the declared part sizes match the payload."""
    enc = field(header, "enc", dict)
    sizes = field(header, "sizes", list)
    if len(sizes) > 8 or not all(
        isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and type(item[1]) is int and item[1] >= 0
        for item in sizes
    ):
        raise FrameError("frame field 'sizes' must be a short list of [name, byte count] pairs")
    if sum(size for _, size in sizes) != len(payload):
        raise FrameError(f"frame declares {sum(s for _, s in sizes)} payload bytes but carries {len(payload)}")
    parts, offset, view = {}, 0, memoryview(payload)
    for name, size in sizes:
        parts[name] = payload if size == len(payload) else bytes(view[offset : offset + size])
        offset += size
    try:
        return Encoded.from_msgpack({**enc, "parts": parts})
    except CodecError as error:
        raise FrameError(f"bad encoded tensor: {error}") from None
