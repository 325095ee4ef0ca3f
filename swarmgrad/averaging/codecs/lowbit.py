"""Blockwise absmax 4-bit and 2-bit quantisation (`q4`, `q2`).

Like int8, the flat tensor is cut into blocks of `block_size` elements (the last one may be
shorter) with one float32 absmax m per block. With L = 2^bits levels, [-m, m] is cut into L equal
cells and an element is sent as the index q of its cell and decoded to the cell's centre,
m * (2q + 1 - L) / L (mid-rise: no level is wasted on zero, which matters at 2 bits). Per element

    |x - decoded| <= m / L      (q4: m/16, q2: m/4; + m * 2^-22 of fp32 rounding)

for m >= 2^-100 (smaller blocks are scaled by 2^100 at most, and decode within 2^-99 of x). An
all-zero block has m = 0 and decodes to exact zeros. Payload: bits/8 bytes per element + 4 per
block, e.g. q4 at the default block of 64: 0.5625 bytes (7.1x), q2: 0.3125 bytes (12.8x).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, CodecError, array_from, meta_int, tensor_from
from .bits import pack, packed_size, unpack

__all__ = ["Q2Codec", "Q4Codec"]

# Divides by max(absmax, floor) so that L / absmax stays finite for subnormal blocks.
_SCALE_FLOOR = 2.0**-100
MAX_BLOCK_SIZE = 1 << 24
DEFAULT_BLOCK = 64


def levels(bits: int) -> np.ndarray:
    """Cell centres in units of the block's absmax: (2q + 1 - L) / L for q in 0..L-1, all inside (-1, 1)."""
    count = 1 << bits
    return ((2 * np.arange(count) + 1 - count) / count).astype(np.float32)


@dataclass(frozen=True, repr=False)
class _BlockQuantCodec(Codec):
    block_size: int = DEFAULT_BLOCK

    lossy: ClassVar[bool] = True
    bits: ClassVar[int]
    meta_keys: ClassVar[frozenset[str]] = frozenset({"block"})

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise CodecError(f"{self.name} block size must be an int in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")

    @property
    def spec(self) -> str:
        return self.name if self.block_size == DEFAULT_BLOCK else f"{self.name}:{self.block_size}"

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {"block": self.block_size}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        block = meta_int(meta, "block", 1, MAX_BLOCK_SIZE)
        return {"absmax": 4 * -(-numel // block), "q": packed_size(numel, self.bits)}

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        numel, block, half = flat.numel(), self.block_size, (1 << self.bits) // 2
        full = numel // block * block
        # Full blocks as one (blocks, block) matrix; the short tail as a second 1-row matrix.
        pieces = [flat[:full].view(-1, block)] if full else []
        if full < numel:
            pieces.append(flat[full:].view(1, -1))
        q = torch.empty(numel, dtype=torch.uint8)
        maxima, start = [], 0
        for piece in pieces:
            absmax = torch.maximum(piece.amax(dim=1), piece.amin(dim=1).neg_())  # both propagate NaN
            if not bool(torch.isfinite(absmax).all()):
                raise CodecError("cannot encode a tensor with NaN or Inf values")
            # cell index floor((x / m + 1) * L / 2); x = m lands on L, one past the top cell
            scaled = piece * (half / absmax.clamp_min(_SCALE_FLOOR)).unsqueeze(1)
            cells = scaled.add_(half).floor_().clamp_(0, 2 * half - 1)
            q[start : start + piece.numel()].view(piece.shape).copy_(cells)
            maxima.append(absmax)
            start += piece.numel()
        absmax = torch.cat(maxima) if maxima else torch.empty(0)
        return {"absmax": absmax.numpy().tobytes(), "q": pack(q.numpy(), self.bits)}, {"block": block}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        block = int(meta["block"])
        absmax = tensor_from(parts["absmax"], torch.float32)  # small: one float per block
        if absmax.numel():
            low, high = (float(value) for value in torch.aminmax(absmax))
            if not (0.0 <= low and high <= float(torch.finfo(torch.float32).max)):  # NaN fails both
                raise CodecError(f"{self.name} block maxima must be finite and not negative")
        # every level is inside (-1, 1), so level * absmax is finite: no pass over the output
        values = levels(self.bits)[unpack(parts["q"], numel, self.bits)]
        out = torch.empty(numel, dtype=torch.float32)
        out_np, absmax_np = out.numpy(), array_from(parts["absmax"], np.float32)
        full = numel // block * block
        if full:
            np.multiply(values[:full].reshape(-1, block), absmax_np[: full // block, None],
                        out=out_np[:full].reshape(-1, block))
        if full < numel:
            np.multiply(values[full:], absmax_np[-1], out=out_np[full:])
        return out


@dataclass(frozen=True, repr=False)
class Q4Codec(_BlockQuantCodec):
    name: ClassVar[str] = "q4"
    bits: ClassVar[int] = 4


@dataclass(frozen=True, repr=False)
class Q2Codec(_BlockQuantCodec):
    name: ClassVar[str] = "q2"
    bits: ClassVar[int] = 2
