"""A round's result as it travelled: one frame per chunk of the run's grid, in the return codec.

With a lossy return codec every member of a group decodes the very same frames (the owners send
them; an owner keeps what it sent, allreduce.py), so those frames *are* the round's result, at the
codec's size: q2 is 0.31 bytes an element where the bfloat16 copy a donor also keeps is 2. A peer
that missed the round decodes them to exactly the float32 values the donor applied (state/results.py:
``download_result`` with a ``ResultDecoder``).

    frames = ordered_frames(allreduce.result_frames, schema)   # None unless every chunk has one
    result = ResultDecoder(schema, codec).decode(frames)       # FrameError on anything malformed

A round that does not land in its contribution (one that travelled behind the next inner phase, a
sync round) hands over a ``FramedAverage``: the frames alone, read a slice at a time, where a float32
result buffer would hold 4 bytes per element for the whole round (DESIGN's memory budget).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Callable, Iterator, Mapping, Sequence

import torch

from swarmgrad.averaging.allreduce import gather_codec_for
from swarmgrad.averaging.codecs import Codec
from swarmgrad.averaging.frames import decode_chunk
from swarmgrad.averaging.layout import Schema
from swarmgrad.net.wire import FrameError, int_field

Frame = tuple[dict, bytes]


def ordered_frames(frames: Mapping[int, Frame], schema: Schema) -> list[Frame] | None:
    """The frames in chunk order, or None unless there is exactly one for every chunk."""
    if sorted(frames) != list(range(len(schema.chunks))):
        return None
    return [frames[index] for index in range(len(schema.chunks))]


class ResultDecoder:
    """Decodes a round's result frames for one grid and round codec (the frames are in its return codec)."""

    def __init__(self, schema: Schema, codec: Codec):
        self.schema, self.codec = schema, gather_codec_for(codec)
        self._round_codec = codec
        self.frames = len(schema.chunks)
        # the most bytes one frame's payload may carry: read once per received frame, so computed once
        sizes = [self.codec.encoded_nbytes(chunk.view) for chunk in schema.chunks]
        self.max_payload = max(sizes, default=0)
        self.nbytes = sum(sizes)  # a result's payload bytes: what a replay of one round moves

    def check_header(self, index: int, header: dict) -> None:
        """Before a payload is read: the frame must be chunk ``index``'s average."""
        if header.get("t") != "avg" or int_field(header, "c", 0, self.frames - 1) != index:
            raise FrameError(f"expected the result's chunk {index}, got {header.get('t')!r} {header.get('c')!r}")

    def decode(self, frames: Sequence[Frame]) -> torch.Tensor:
        """The flat float32 result; FrameError when a frame is missing, out of order or malformed."""
        if len(frames) != self.frames:
            raise FrameError(f"a result of {len(frames)} frames, expected {self.frames}")
        result = torch.empty(self.schema.total, dtype=torch.float32)
        for index, ((header, payload), chunk) in enumerate(zip(frames, self.schema.chunks)):
            self.check_header(index, header)
            result[chunk.start : chunk.start + chunk.length] = decode_chunk(self.codec, header, payload, chunk.view)
        return result

    def framed(self, frames: Sequence[Frame], each: Callable[[torch.Tensor], None] | None = None) -> FramedAverage:
        """The result held as its frames (``FramedAverage``: no float32 copy of it), each decoded once
        here to check it, and handed to ``each`` in order where given (the digest is taken on the same
        pass: state/results.py); FrameError as ``decode``'s, or for a value that is NaN or Inf."""
        if len(frames) != self.frames:
            raise FrameError(f"a result of {len(frames)} frames, expected {self.frames}")
        for index, ((header, payload), chunk) in enumerate(zip(frames, self.schema.chunks)):
            self.check_header(index, header)
            values = decode_chunk(self.codec, header, payload, chunk.view)
            low, high = torch.aminmax(values)
            if not (math.isfinite(float(low)) and math.isfinite(float(high))):
                raise FrameError(f"the result's chunk {index} holds NaN or Inf")
            if each is not None:
                each(values.reshape(-1))
        return FramedAverage(frames, self.schema, self._round_codec)


class FramedAverage:
    """A round's average held as the frames it travelled in (checked when they arrived): ``average[a:b]``
    decodes the frames that slice covers to float32, so a reader that walks it in pieces never holds
    more than a piece. Read-only: it stands in for the flat float32 result a strategy applies."""

    def __init__(self, frames: Sequence[Frame], schema: Schema, codec: Codec):
        if len(frames) != len(schema.chunks):
            raise ValueError(f"a result of {len(frames)} frames, expected {len(schema.chunks)}")
        self.frames: Sequence[Frame] = list(frames)
        self.schema, self.codec = schema, gather_codec_for(codec)
        self._starts = [chunk.start for chunk in schema.chunks]
        self._nbytes = sum(len(payload) for _, payload in self.frames)

    def read_from(self, frames: Sequence[Frame]) -> None:
        """Read its frames from ``frames`` from now on: the same frames, kept elsewhere (state/kept.py: on
        disk), so that an average that outlives its round (an outer step a download reads past,
        state/served.py) does not keep them in memory."""
        if len(frames) != len(self.frames):
            raise ValueError(f"{len(frames)} frames to read from, expected {len(self.frames)}")
        self.frames = frames

    def numel(self) -> int:
        return self.schema.total

    def __len__(self) -> int:
        return self.schema.total

    def nbytes(self) -> int:
        """The payload bytes of its frames."""
        return self._nbytes

    def _decoded(self, index: int) -> torch.Tensor:
        header, payload = self.frames[index]
        return decode_chunk(self.codec, header, payload, self.schema.chunks[index].view)

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, float32 values) of each frame in order."""
        for index, chunk in enumerate(self.schema.chunks):
            yield chunk.start, self._decoded(index)

    def __getitem__(self, span: slice) -> torch.Tensor:
        start, stop, step = span.indices(self.schema.total)
        if step != 1:
            raise ValueError("a framed average is read in contiguous slices")
        out = torch.empty(max(0, stop - start), dtype=torch.float32)
        at, index = start, max(0, bisect_right(self._starts, start) - 1)
        while at < stop:  # each frame the slice covers, decoded once
            chunk = self.schema.chunks[index]
            lo, hi = at - chunk.start, min(stop, chunk.start + chunk.length) - chunk.start
            out[at - start : at - start + hi - lo] = self._decoded(index)[lo:hi]
            at, index = chunk.start + hi, index + 1
        return out

    def dense(self) -> torch.Tensor:
        """The whole average as one float32 tensor (4 bytes an element: only where a caller needs it whole)."""
        return self[:]
