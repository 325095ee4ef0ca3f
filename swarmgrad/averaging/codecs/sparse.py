"""Chunked top-k with low-bit values (`sparse`, after SparseLoCo, arXiv 2508.15706).

The flat tensor is cut into chunks of 256 elements; each chunk keeps its k = round(fraction * 256)
largest magnitudes (at least 1; a short last chunk keeps min(k, its length)). Every kept element
costs one byte of index (its offset in its chunk; offsets increase within a chunk) and `bits` bits
of value: a sign and bits - 1 bits of magnitude. The magnitudes kept in each group of 4096
elements (16 chunks) share a float32 range [lo, hi], cut into M = 2^(bits - 1) equal cells, and
decode to the centre of their cell, so for every kept element

    |x - decoded| <= (hi - lo) / (2M)      (+ hi * 2^-22 of fp32 rounding)

except in a group that kept an exact zero (a chunk with fewer than k nonzero elements): there
lo = 0 and the lowest cell decodes to 0, so zeros stay zeros and |x - decoded| < (hi - lo) / M.
Every element not kept decodes to 0: what error feedback keeps (architecture.md, invariant
'lossy codecs keep error feedback'). Payload:
1 + bits/8 bytes a kept element + 8 bytes a group; at the default 2 of 256 (0.78%) and 2 bits,
4 bytes of fp32 become 0.0117: 341x.

The average of g members' contributions is sparse on the union of their supports (up to g times
as many elements): it goes back as `nonzero` (nonzero.py) with values of the same precision
(bits), a cost that grows with g like an all-gather of the contributions would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, CodecError, check_finite, float_param, int_param, meta_int, tensor_from
from .bits import pack, packed_size, unpack
from .nonzero import VALUE_BITS, NonzeroCodec

__all__ = ["SparseCodec"]

CHUNK = 256  # an offset in a chunk fits one byte
GROUP = 4096  # elements whose kept magnitudes share one [lo, hi] range: 16 chunks
_RANGE_FLOOR = 2.0**-100  # a narrower range has one effective cell: M / range would overflow
DEFAULT_FRACTION = 1 / 128  # 2 of 256: as accurate as uncompressed DiLoCo in benchmarks/codec_diloco.py


def kept_per_chunk(fraction: float) -> int:
    return min(CHUNK, max(1, round(fraction * CHUNK)))


@dataclass(frozen=True, repr=False)
class SparseCodec(Codec):
    fraction: float = DEFAULT_FRACTION
    bits: int = 2

    name: ClassVar[str] = "sparse"
    lossy: ClassVar[bool] = True
    order: ClassVar[int] = 90
    meta_keys: ClassVar[frozenset[str]] = frozenset({"k", "bits"})

    def __post_init__(self) -> None:
        if type(self.fraction) not in (int, float) or not 0.0 < self.fraction <= 1.0:
            raise CodecError(f"sparse fraction must be a number in (0, 1], got {self.fraction!r}")
        if type(self.bits) is not int or self.bits not in VALUE_BITS:
            raise CodecError(f"sparse value bits must be one of {', '.join(map(str, VALUE_BITS))}, got {self.bits!r}")

    @classmethod
    def from_param(cls, text: str | None) -> SparseCodec:
        """"sparse:fraction" or "sparse:fraction:bits", e.g. "sparse:0.01:4"."""
        if text is None:
            return cls()
        fraction, sep, bits = text.partition(":")
        return cls(float_param(fraction), int_param(bits)) if sep else cls(float_param(fraction))

    @property
    def spec(self) -> str:
        if self.bits != 2:
            return f"{self.name}:{self.fraction!r}:{self.bits}"
        return self.name if self.fraction == DEFAULT_FRACTION else f"{self.name}:{self.fraction!r}"

    def average_codec(self) -> Codec:
        # at the contributions' precision: at 2 bits, benchmarks/codec_diloco.py measured no accuracy
        # lost against 4-bit averages, for ~20% fewer bytes
        return NonzeroCodec(self.bits)

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {"k": kept_per_chunk(self.fraction), "bits": self.bits}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        k, bits = meta_int(meta, "k", 1, CHUNK), meta_int(meta, "bits", 1, 8)
        if bits not in VALUE_BITS:
            raise CodecError(f"sparse meta['bits'] must be one of {', '.join(map(str, VALUE_BITS))}, got {bits}")
        kept = numel // CHUNK * k + min(k, numel % CHUNK)
        groups = -(-numel // GROUP)
        return {"idx": kept, "val": packed_size(kept, bits), "lo": 4 * groups, "hi": 4 * groups}

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        numel, k, bits = flat.numel(), kept_per_chunk(self.fraction), self.bits
        full = numel // CHUNK * CHUNK
        offsets = []  # per chunk, increasing: deterministic, and what decode checks
        if full:
            rows = flat[:full].view(-1, CHUNK)
            offsets.append(torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values.reshape(-1))
        if full < numel:
            tail = flat[full:]
            offsets.append(torch.topk(tail.abs(), min(k, numel - full), sorted=False).indices.sort().values)
        offset = torch.cat(offsets) if offsets else torch.empty(0, dtype=torch.long)
        positions = offset + _chunk_starts(numel, k)
        values = flat[positions]
        check_finite(values, "tensor to encode")  # NaN and Inf rank first in their chunk: kept if present
        group = torch.div(positions, GROUP, rounding_mode="floor")
        magnitude = values.abs()
        groups = -(-numel // GROUP)
        lo = torch.zeros(groups).scatter_reduce_(0, group, magnitude, "amin", include_self=False)
        hi = torch.zeros(groups).scatter_reduce_(0, group, magnitude, "amax", include_self=False)
        cells = 1 << (bits - 1)
        width = hi - lo
        inverse = torch.where(width > _RANGE_FLOOR, cells / width.clamp_min(_RANGE_FLOOR), 0.0)
        cell = (magnitude - lo[group]).mul_(inverse[group]).floor_().clamp_(0, cells - 1).to(torch.uint8)
        codes = cell | (values < 0).to(torch.uint8) << (bits - 1)
        parts = {
            "idx": offset.to(torch.uint8).numpy().tobytes(),
            "val": pack(codes.numpy(), bits),
            "lo": lo.numpy().tobytes(),
            "hi": hi.numpy().tobytes(),
        }
        return parts, {"k": k, "bits": bits}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        k, bits = int(meta["k"]), int(meta["bits"])
        offset = np.frombuffer(parts["idx"], dtype=np.uint8)
        full_chunks, tail = numel // CHUNK, numel % CHUNK
        rows = offset[: full_chunks * k].reshape(full_chunks, k)
        last = offset[full_chunks * k :]
        if not (np.all(rows[:, 1:] > rows[:, :-1]) and np.all(last[1:] > last[:-1])):
            raise CodecError("sparse indices must increase strictly within each chunk of 256")
        if last.size and int(last[-1]) >= tail:
            raise CodecError(f"sparse index {int(last[-1])} is past the last chunk's {tail} elements")
        lo, hi = tensor_from(parts["lo"], torch.float32), tensor_from(parts["hi"], torch.float32)
        check_finite(hi, "sparse ranges")
        if lo.numel() and not (float(lo.min()) >= 0.0 and bool((lo <= hi).all())):  # NaN fails
            raise CodecError("sparse ranges must have 0 <= lo <= hi")
        codes = torch.from_numpy(unpack(parts["val"], offset.size, bits).astype(np.int64))
        positions = torch.from_numpy(offset.astype(np.int64)) + _chunk_starts(numel, k)
        group = torch.div(positions, GROUP, rounding_mode="floor")
        cells = 1 << (bits - 1)
        # lo + (hi - lo) * t with t in (0, 1) stays within [lo, hi]: finite, no pass over the output
        cell = codes & (cells - 1)
        magnitude = lo[group] + (hi - lo)[group] * ((cell.float() + 0.5) / cells)
        magnitude[(cell == 0) & (lo[group] == 0)] = 0.0  # a group that kept a zero: its lowest cell is 0
        out = torch.zeros(numel, dtype=torch.float32)
        out[positions] = torch.where(codes >= cells, -magnitude, magnitude)
        return out


def _chunk_starts(numel: int, k: int) -> torch.Tensor:
    """The start of the chunk each kept element is in, in the order the offsets are sent."""
    full_chunks, tail = numel // CHUNK, numel % CHUNK
    starts = torch.arange(full_chunks, dtype=torch.long).mul_(CHUNK).repeat_interleave(k)
    return torch.cat([starts, torch.full((min(k, tail),), full_chunks * CHUNK, dtype=torch.long)])
