"""Encoded tensors in wire frames (averaging/frames.py), without the network: what a sender puts in a
frame decodes to the same tensor, and every lie in a received frame is a FrameError that names it."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.codecs.blocks import BlockCodec
from swarmgrad.averaging.frames import (
    check_chunk,
    check_raw_header,
    decode_chunk,
    encode_chunk,
    encoded_from_frame,
    encoded_to_frame,
)
from swarmgrad.net.wire import FrameError

SHAPE = (6, 5)


def values(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def raw_frame(tensor: torch.Tensor) -> tuple[dict, bytes]:
    header, payload = encode_chunk(get_codec("none"), tensor)
    return header, bytes(payload)


@pytest.mark.parametrize("spec", ["fp16", "int8:8", "topk:0.2", "powersgd:2"])
def test_an_encoded_tensor_survives_a_frame(spec):
    codec = get_codec(spec)
    encoded = codec.encode(values())
    header, payload = encoded_to_frame(encoded)
    assert header["sizes"] == [[name, len(part)] for name, part in encoded.parts.items()]
    assert len(payload) == encoded.nbytes()
    assert encoded_from_frame(header, bytes(payload)) == encoded
    decoded = decode_chunk(codec, header, bytes(payload), SHAPE)
    assert decoded.shape == (30,) and torch.equal(decoded, codec.decode(encoded).reshape(-1))


def test_a_one_part_frame_carries_the_part_itself():
    encoded = get_codec("fp16").encode(values())
    _, payload = encoded_to_frame(encoded)
    assert payload is encoded.parts["data"]  # no copy for one part
    encoded = get_codec("int8:8").encode(values())
    header, payload = encoded_to_frame(encoded)
    assert payload == encoded.parts["scale"] + encoded.parts["q"]  # several parts: back to back, in order


def test_raw_float32_goes_out_as_a_view_and_comes_back_as_one():
    tensor = values()
    header, payload = encode_chunk(get_codec("none"), tensor)
    assert isinstance(payload, memoryview) and len(payload) == 4 * tensor.numel()
    assert header == {"enc": {"codec": "none", "shape": list(SHAPE), "dtype": "float32", "meta": {}},
                      "sizes": [["data", 4 * tensor.numel()]]}
    tensor[0, 0] = 42.0  # the payload is the tensor's own memory
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[0] == 42.0
    received = bytearray(payload)
    decoded = decode_chunk(get_codec("none"), header, received, SHAPE)
    assert torch.equal(decoded, tensor.reshape(-1))
    received[:4] = torch.tensor([7.0]).numpy().tobytes()
    assert decoded[0] == 7.0  # a view of the received buffer, not a copy


def test_raw_frames_of_other_tensors_go_through_the_codec():
    codec = get_codec("none")
    for tensor in (values().t(), values().double(), values().half()):  # not contiguous / not float32
        header, payload = encode_chunk(codec, tensor)
        assert isinstance(payload, bytes)
        assert header["enc"]["shape"] == list(tensor.shape) and header["enc"]["dtype"] == str(tensor.dtype)[6:]


def test_non_finite_values_are_refused_unless_the_caller_checked_them():
    tensor = values()
    tensor[2, 3] = float("nan")
    with pytest.raises(ValueError, match="^tensor to send has NaN or Inf values$"):
        encode_chunk(get_codec("none"), tensor)
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_chunk(get_codec("fp16"), tensor)
    header, payload = encode_chunk(get_codec("none"), tensor, known_finite=True)
    with pytest.raises(FrameError, match="^received tensor has NaN or Inf values$"):
        decode_chunk(get_codec("none"), header, bytes(payload), SHAPE)


@pytest.mark.parametrize("change, message", [
    ({"codec": "fp16"}, r"tensor is fp16/float32\[6, 5\], expected none/float32\[6, 5\]"),
    ({"shape": [5, 6]}, r"tensor is none/float32\[5, 6\], expected none/float32\[6, 5\]"),
    ({"dtype": "float16"}, r"none/float16\[6, 5\], expected"),
    ({"meta": {"k": 1}}, "expected none/float32"),
    ({"shape": [6, "5"]}, "bad encoded tensor: shape must hold ints"),
])
def test_a_raw_header_that_lies_about_the_tensor_is_refused(change, message):
    header, payload = raw_frame(values())
    header = {**header, "enc": {**header["enc"], **change}}
    with pytest.raises(FrameError, match=message):
        decode_chunk(get_codec("none"), header, payload, SHAPE)


def test_a_raw_frame_must_carry_exactly_its_bytes():
    header, payload = raw_frame(values())
    for sizes, length in (([["data", 119]], 120), ([["data", 120]], 116), ([["data", 60], ["x", 60]], 120),
                          ([["other", 120]], 120)):
        with pytest.raises(FrameError, match=r"raw tensor of shape \[6, 5\] must carry exactly 120 payload bytes"):
            check_raw_header({**header, "sizes": sizes}, length, SHAPE)
    check_raw_header(header, 120, SHAPE)
    check_raw_header({**header, "enc": {**header["enc"], "shape": []}, "sizes": [["data", 4]]}, 4, ())
    with pytest.raises(FrameError, match="120 payload bytes"):
        decode_chunk(get_codec("none"), header, payload[:-4], SHAPE)
    empty_header, empty = raw_frame(torch.empty(0, 3))
    assert empty == b"" and decode_chunk(get_codec("none"), empty_header, empty, (0, 3)).numel() == 0


@pytest.mark.parametrize("sizes", [
    [["data", 60, 1]], [["data"]], [[1, 60]], [["data", "60"]], [["data", True]], [["data", -1]], [("data", 60)],
    [["p", 0]] * 9,  # more parts than any codec has
])
def test_malformed_part_sizes_are_refused(sizes):
    header, payload = encoded_to_frame(get_codec("int8:8").encode(values()))
    with pytest.raises(FrameError, match=r"^frame field 'sizes' must be a short list of \[name, byte count\] pairs$"):
        encoded_from_frame({**header, "sizes": sizes}, payload)


def test_sizes_that_are_not_a_list_are_refused_by_the_field_check():
    header, payload = encoded_to_frame(get_codec("int8:8").encode(values()))
    with pytest.raises(FrameError, match="^frame field 'sizes' must be list, got str$"):
        encoded_from_frame({**header, "sizes": "data"}, payload)


def test_parts_are_cut_where_the_sizes_say():
    """Up to 8 parts, empty ones allowed, each taken at its own offset; one part that is the whole
    payload is the payload itself (no copy)."""
    header = {"enc": {"codec": "x", "shape": [3], "dtype": "float32", "meta": {}}}
    payload = bytes(range(12))
    sizes = [["a", 2], ["b", 0], ["c", 3], ["d", 1], ["e", 2], ["f", 1], ["g", 2], ["h", 1]]
    encoded = encoded_from_frame({**header, "sizes": sizes}, payload)
    assert encoded.parts == {"a": b"\x00\x01", "b": b"", "c": b"\x02\x03\x04", "d": b"\x05", "e": b"\x06\x07",
                             "f": b"\x08", "g": b"\x09\x0a", "h": b"\x0b"}
    whole = encoded_from_frame({**header, "sizes": [["data", 12]]}, payload)
    assert whole.parts["data"] is payload


def test_declared_sizes_must_add_up_to_the_payload():
    header, payload = encoded_to_frame(get_codec("int8:8").encode(values()))
    total = len(payload)
    with pytest.raises(FrameError, match=f"frame declares {total} payload bytes but carries {total - 1}"):
        encoded_from_frame(header, payload[:-1])
    (first, n1), (second, n2) = header["sizes"]
    moved = encoded_from_frame({**header, "sizes": [[first, n1 - 4], [second, n2 + 4]]}, payload)
    assert len(moved.parts[first]) == n1 - 4 and moved.parts[second] == payload[n1 - 4:]


@pytest.mark.parametrize("change, message", [
    ({"shape": [5, 6]}, r"tensor is int8/float32\[5, 6\], expected int8/float32\[6, 5\]"),
    ({"dtype": "float16"}, r"tensor is int8/float16\[6, 5\], expected int8/float32\[6, 5\]"),
    ({"codec": "topk"}, r"tensor is topk/float32\[6, 5\], expected int8/float32\[6, 5\]"),
    ({"meta": {"block": 3}}, "bad encoded tensor|part"),
    ({"dtype": "int32"}, "bad encoded tensor: dtype must be one of"),
])
def test_a_coded_frame_that_lies_about_the_tensor_is_refused(change, message):
    codec = get_codec("int8:8")
    header, payload = encoded_to_frame(codec.encode(values()))
    header = {**header, "enc": {**header["enc"], **change}}
    with pytest.raises(FrameError, match=message):
        decode_chunk(codec, header, payload, SHAPE)


def test_a_coded_frame_with_bad_values_is_a_frame_error():
    codec = get_codec("fp16")
    header, payload = encoded_to_frame(codec.encode(values()))
    bad = bytearray(payload)
    bad[0:2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.int16).numpy().tobytes()
    with pytest.raises(FrameError, match="fp16 payload has NaN or Inf values"):
        decode_chunk(codec, header, bytes(bad), SHAPE)


def test_the_decoder_allows_exactly_the_expected_number_of_elements():
    """A coded frame is decoded with max_elements = the expected numel: a frame for a bigger tensor
    is refused for its shape before anything is allocated."""
    codec = get_codec("int8:8")
    big = torch.randn(64)
    header, payload = encoded_to_frame(codec.encode(big))
    assert decode_chunk(codec, header, payload, (64,)).numel() == 64
    with pytest.raises(FrameError, match=r"expected int8/float32\[32\]"):
        decode_chunk(codec, header, payload, (32,))


def _lies() -> list[tuple[str, dict, bytes]]:
    """Frames that decode_chunk refuses, one per way: (codec spec, header, payload)."""
    frames = []
    for spec in ("int8:8", "q2:8"):
        codec = get_codec(spec)
        header, payload = encoded_to_frame(codec.encode(values()))
        frames.append((spec, {**header, "enc": {**header["enc"], "shape": [5, 6]}}, bytes(payload)))
        scale = bytearray(payload)  # the first block's scale NaN
        scale[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
        frames.append((spec, header, bytes(scale)))
        frames.append((spec, header, bytes(payload)[:-1]))
    header, payload = encoded_to_frame(get_codec("fp16").encode(values()))
    bad = bytearray(payload)
    bad[0:2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.int16).numpy().tobytes()
    frames.append(("fp16", header, bytes(bad)))
    header, payload = raw_frame(values())
    nan = bytearray(payload)
    nan[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    frames.append(("none", header, bytes(nan)))
    return frames


@pytest.mark.parametrize("spec, header, payload", _lies())
def test_a_check_refuses_every_frame_a_decode_refuses_with_the_same_error(spec, header, payload):
    codec = get_codec(spec)
    with pytest.raises(FrameError) as decoded:
        decode_chunk(codec, header, payload, SHAPE)
    with pytest.raises(FrameError) as checked:
        check_chunk(codec, header, payload, SHAPE)
    assert str(checked.value) == str(decoded.value)


@pytest.mark.parametrize("spec", ["int8:8", "q2:8", "sign"])
def test_a_block_codecs_frame_is_checked_by_its_scales_without_decoding_it(spec, monkeypatch):
    """A peer that keeps a round's result as its frames decodes them when it applies them: the check on
    arrival reads one scale a block, not the codes (one pass over the model less a round)."""
    codec = get_codec(spec)
    header, payload = encoded_to_frame(codec.encode(values()))
    check_chunk(codec, header, bytes(payload), SHAPE)

    def decoding(*args, **kwargs):
        raise AssertionError("the check decoded the codes")

    monkeypatch.setattr(type(codec), "code_values", decoding)
    check_chunk(codec, header, bytes(payload), SHAPE)  # passes: the codes are never read
    assert isinstance(codec, BlockCodec)
    with pytest.raises(AssertionError, match="decoded the codes"):
        decode_chunk(codec, header, bytes(payload), SHAPE)
