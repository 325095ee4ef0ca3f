"""A round's average held as its frames (result_frames.py ``FramedAverage``): read a slice at a time,
it gives exactly what decoding the whole result gives, and a donor names and keeps it as it would
the float32 result."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.frames import encode_chunk
from swarmgrad.averaging.layout import Schema
from swarmgrad.averaging.result_frames import FramedAverage, ResultDecoder
from swarmgrad.peer.strategies.base import pieces
from swarmgrad.state.results import result_digest


def travelled(values: torch.Tensor, codec_name: str, chunk_elements: int = 1000):
    schema = Schema.of([("flat", values)], chunk_elements=chunk_elements)
    codec = get_codec(codec_name)
    frames = []
    for chunk in schema.chunks:
        header, payload = encode_chunk(codec.average_codec(), values[chunk.start : chunk.start + chunk.length].view(chunk.view))
        frames.append(({"t": "avg", "c": chunk.index, **header}, bytes(payload)))
    return schema, codec, frames


@pytest.mark.parametrize("codec_name", ["int8", "q2"])
def test_slices_of_a_framed_average_are_the_decoded_result(codec_name):
    values = torch.randn(4_321, generator=torch.Generator().manual_seed(3))
    schema, codec, frames = travelled(values, codec_name)
    whole = ResultDecoder(schema, codec).decode(frames)
    framed = FramedAverage(frames, schema, codec)
    assert framed.numel() == len(framed) == values.numel()
    assert torch.equal(framed.dense(), whole)
    for start, stop in [(0, 1), (999, 1001), (10, 3_500), (4_000, 4_321), (2_000, 2_000), (0, 4_321)]:
        assert torch.equal(framed[start:stop], whole[start:stop]), (start, stop)
    walked = torch.cat([piece for _, piece in pieces(framed)])
    assert torch.equal(walked, whole)
    assert [offset for offset, _ in pieces(framed)] == [chunk.start for chunk in schema.chunks]
    assert result_digest(framed) == result_digest(whole)
    assert framed.nbytes() == sum(len(payload) for _, payload in frames) < values.numel() * 4 / 3
    with pytest.raises(ValueError, match="contiguous"):
        framed[::2]


def test_a_framed_average_needs_every_frame():
    schema, codec, frames = travelled(torch.randn(2_500), "int8")
    with pytest.raises(ValueError, match="2 frames, expected 3"):
        FramedAverage(frames[:2], schema, codec)


@pytest.mark.parametrize("codec_name", ["int8", "q2"])
def test_received_frames_are_checked_and_named_on_one_decoding_pass(codec_name, monkeypatch):
    """A replayed round's frames are decoded once for the finite check and the digest together
    (state/results.py ``framed_and_named``): at 201M a pass over the model's size less per round."""
    import swarmgrad.averaging.result_frames as result_frames
    from swarmgrad.state.results import framed_and_named

    values = torch.randn(4_321, generator=torch.Generator().manual_seed(4))
    schema, codec, frames = travelled(values, codec_name)
    decoded = []
    real = result_frames.decode_chunk
    monkeypatch.setattr(result_frames, "decode_chunk", lambda *args: decoded.append(1) or real(*args))
    framed, named = framed_and_named(ResultDecoder(schema, codec), frames)
    assert len(decoded) == len(frames)  # each frame once
    monkeypatch.setattr(result_frames, "decode_chunk", real)
    assert named == result_digest(framed) == result_digest(ResultDecoder(schema, codec).decode(frames))
