"""Encoded tensors in wire frames: codec metadata in the header, the codec's bytes as the payload."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Mapping

import torch

from swarmgrad.averaging.codecs import Codec, CodecError, Encoded
from swarmgrad.averaging.codecs.base import check_finite
from swarmgrad.net.wire import FrameError, field


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
        whole = size == len(payload) and isinstance(payload, bytes)
        parts[name] = payload if whole else bytes(view[offset : offset + size])
        offset += size
    try:
        return Encoded.from_msgpack({**enc, "parts": parts})
    except CodecError as error:
        raise FrameError(f"bad encoded tensor: {error}") from None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy and without ``Tensor.numpy()``, which marks
    the tensor's storage as never resizable again (a DiLoCo policy gives its contribution's memory
    back between rounds: peer/strategies/base.py). The view keeps the tensor object alive; whoever
    frees its storage does so only after the view is used (the round is over)."""
    array = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    array._tensor = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def encode_chunk(
    codec: Codec, values: torch.Tensor, *, known_finite: bool = False
) -> tuple[dict[str, Any], bytes | memoryview]:
    """A tensor as frame fields and payload. Raw float32 goes out as a view of the tensor's own
    memory (no copy); the caller keeps the tensor unchanged until the frame is sent.
    ``known_finite`` skips the NaN/Inf check for values the caller has already checked."""
    if codec.name != "none" or values.dtype != torch.float32 or not values.is_contiguous():
        return encoded_to_frame(codec.encode(values))
    if not known_finite:
        check_finite(values, "tensor to send")
    header = {"codec": "none", "shape": list(values.shape), "dtype": "float32", "meta": {}}
    payload = byte_view(values)
    return {"enc": header, "sizes": [["data", len(payload)]]}, payload


def decode_chunk(codec: Codec, header: Mapping[str, Any], payload: bytes | bytearray, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a frame's tensor against the expected codec and shape, then decode it (flat float32).

    Raw float32 is returned as a view of the received buffer (no copy).
    """
    if codec.name == "none":
        return _raw_values(header, payload, shape)
    encoded = _expected(codec, header, payload, shape)
    try:
        return codec.decode(encoded, max_elements=max(1, _numel(shape))).reshape(-1)
    except CodecError as error:
        raise FrameError(str(error)) from None


def check_chunk(codec: Codec, header: Mapping[str, Any], payload: bytes | bytearray, shape: tuple[int, ...]) -> None:
    """FrameError wherever ``decode_chunk`` would raise, without decoding where the codec need not
    (``Codec.check``): for frames kept as they are and decoded when they are used."""
    if codec.name == "none":
        _raw_values(header, payload, shape)
        return
    encoded = _expected(codec, header, payload, shape)
    try:
        codec.check(encoded, max_elements=max(1, _numel(shape)))
    except CodecError as error:
        raise FrameError(str(error)) from None


def _raw_values(header: Mapping[str, Any], payload: bytes | bytearray, shape: tuple[int, ...]) -> torch.Tensor:
    check_raw_header(header, len(payload), shape)
    values = _view_float32(payload)
    try:
        check_finite(values, "received tensor")
    except CodecError as error:
        raise FrameError(str(error)) from None
    return values


def _expected(codec: Codec, header: Mapping[str, Any], payload: bytes | bytearray, shape: tuple[int, ...]) -> Encoded:
    encoded = encoded_from_frame(header, payload)
    if encoded.shape != shape or encoded.dtype != "float32" or encoded.codec != codec.name:
        raise FrameError(
            f"tensor is {encoded.codec}/{encoded.dtype}{list(encoded.shape)}, expected {codec.name}/float32{list(shape)}"
        )
    return encoded


def check_raw_header(header: Mapping[str, Any], payload_length: int, shape: tuple[int, ...]) -> None:
    """Everything about a raw float32 frame except its values, before its payload is read."""
    encoded = encoded_from_frame({**header, "sizes": []}, b"")  # types of codec, shape, dtype, meta
    if encoded.codec != "none" or encoded.shape != shape or encoded.dtype != "float32" or encoded.meta:
        raise FrameError(f"tensor is {encoded.codec}/{encoded.dtype}{list(encoded.shape)}, expected none/float32{list(shape)}")
    expected = 4 * _numel(shape)
    if field(header, "sizes", list) != [["data", expected]] or payload_length != expected:
        raise FrameError(f"raw tensor of shape {list(shape)} must carry exactly {expected} payload bytes")


def _view_float32(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    if not len(payload):
        return torch.empty(0)
    with warnings.catch_warnings():  # torch warns that bytes are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.float32)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
