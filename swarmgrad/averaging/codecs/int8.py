"""Blockwise absmax int8 quantisation.

The flat tensor is cut into blocks of `block_size` elements (the last one may be shorter). Per
block: scale = max(absmax, 2^-100) / 127, stored as float32, and q = round(x / scale) in
[-127, 127]. Decoding is q * scale, so per element

    |x - decoded| <= scale / 2 = max(absmax_block, 2^-100) / 254   (+ absmax_block * 2^-22 of fp32 rounding)

The 2^-100 floor keeps 127/absmax finite for all-zero or subnormal blocks (they decode to ~0).
Payload: 1 byte per element + 4 bytes per block (ratio ~3.98 at the default block of 1024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import array_from
from .blocks import FLOAT32_MAX, BlockCodec, absmax, blocks

__all__ = ["Int8Codec"]

_SCALE_FLOOR = 2.0**-100


@dataclass(frozen=True, repr=False)
class Int8Codec(BlockCodec):
    block_size: int = 1024

    name: ClassVar[str] = "int8"
    order: ClassVar[int] = 40
    # what it drops is at most half a step of 1/127 of a block's largest value (feedback.py)
    residual_dtype: ClassVar[torch.dtype] = torch.bfloat16
    # a decoded value is q * scale with |q| <= 128 (a hostile sender may use -128): keep it finite
    max_scale: ClassVar[float] = FLOAT32_MAX / 128

    def code_bytes(self, numel: int) -> int:
        return numel

    def code_values(self, codes: bytes, numel: int) -> np.ndarray:
        return array_from(codes, np.int8)

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        q = torch.empty(flat.numel(), dtype=torch.int8)
        scales, start = [], 0
        for piece in blocks(flat, self.block_size):
            largest = absmax(piece).clamp_min_(_SCALE_FLOOR)
            scaled = piece * (127.0 / largest).unsqueeze(1)
            q[start : start + piece.numel()].view(piece.shape).copy_(scaled.round_())
            scales.append(largest.div_(127.0))
            start += piece.numel()
        scale = torch.cat(scales) if scales else torch.empty(0)
        return {"scale": scale.numpy().tobytes(), "q": q.numpy().tobytes()}, {"block": self.block_size}
