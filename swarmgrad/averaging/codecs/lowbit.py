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

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .bits import byte_table, lookup, pack, packed_size, unpack
from .blocks import BlockCodec, absmax, blocks

__all__ = ["Q2Codec", "Q4Codec"]

# Divides by max(absmax, floor) so that L / absmax stays finite for subnormal blocks.
_SCALE_FLOOR = 2.0**-100
DEFAULT_BLOCK = 64


def levels(bits: int) -> np.ndarray:
    """Cell centres in units of the block's absmax: (2q + 1 - L) / L for q in 0..L-1, all inside (-1, 1)."""
    count = 1 << bits
    return ((2 * np.arange(count) + 1 - count) / count).astype(np.float32)


_Q2_TABLE = byte_table(levels(2), 2)


@dataclass(frozen=True, repr=False)
class _BlockQuantCodec(BlockCodec):
    block_size: int = DEFAULT_BLOCK

    bits: ClassVar[int]
    scale_part: ClassVar[str] = "absmax"
    # what it drops is at most m / L of its block's absmax m (feedback.py: 2 bytes an element)
    residual_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def code_bytes(self, numel: int) -> int:
        return packed_size(numel, self.bits)

    def code_values(self, codes: bytes, numel: int) -> np.ndarray:
        # every level is inside (-1, 1), so level * absmax is finite. At 2 bits a byte's four levels
        # come from one table row (3x faster; q2 rounds were CPU-bound at 201M); at 4 bits the
        # affine form is faster: level q is q * 2/L + (1 - L)/L, both dyadic, so levels()'s values
        # to the bit either way
        if self.bits == 2:
            return lookup(codes, numel, self.bits, _Q2_TABLE)
        count = 1 << self.bits
        values = unpack(codes, numel, self.bits).astype(np.float32)
        values *= np.float32(2 / count)
        values += np.float32((1 - count) / count)
        return values

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        half = (1 << self.bits) // 2
        q = torch.empty(flat.numel(), dtype=torch.uint8)
        maxima, start = [], 0
        for piece in blocks(flat, self.block_size):
            largest = absmax(piece)
            # cell index floor((x / m + 1) * L / 2); x = m lands on L, one past the top cell
            scaled = piece * (half / largest.clamp_min(_SCALE_FLOOR)).unsqueeze(1)
            cells = scaled.add_(half).floor_().clamp_(0, 2 * half - 1)
            q[start : start + piece.numel()].view(piece.shape).copy_(cells)
            maxima.append(largest)
            start += piece.numel()
        maximum = torch.cat(maxima) if maxima else torch.empty(0)
        return {"absmax": maximum.numpy().tobytes(), "q": pack(q.numpy(), self.bits)}, {"block": self.block_size}


@dataclass(frozen=True, repr=False)
class Q4Codec(_BlockQuantCodec):
    name: ClassVar[str] = "q4"
    order: ClassVar[int] = 50
    bits: ClassVar[int] = 4


@dataclass(frozen=True, repr=False)
class Q2Codec(_BlockQuantCodec):
    name: ClassVar[str] = "q2"
    order: ClassVar[int] = 60
    bits: ClassVar[int] = 2
