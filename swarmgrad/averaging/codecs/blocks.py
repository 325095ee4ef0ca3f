"""What the blockwise codecs (`int8`, `q4`, `q2`, `sign`) share: the flat tensor cut into blocks of
`block_size` elements (the last one may be shorter), one float32 scale per block, and a code per
element; a decoded element is its code's value times its block's scale.

A subclass says how many bytes its codes take and how it encodes; decoding, the checks on a
received scale and the block layout live here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, CodecError, array_from, int_param, meta_int, tensor_from

MAX_BLOCK_SIZE = 1 << 24
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def blocks(flat: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Full blocks as one (blocks, block) matrix; the short tail as a second 1-row matrix."""
    full = flat.numel() // block * block
    pieces = [flat[:full].view(-1, block)] if full else []
    if full < flat.numel():
        pieces.append(flat[full:].view(1, -1))
    return pieces


def absmax(piece: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude; raises on NaN or Inf. amax and amin separately: ~20x faster than
    aminmax(dim=1) on CPU, and both propagate NaN."""
    largest = torch.maximum(piece.amax(dim=1), piece.amin(dim=1).neg_())
    if not bool(torch.isfinite(largest).all()):
        raise CodecError("cannot encode a tensor with NaN or Inf values")
    return largest


@dataclass(frozen=True, repr=False)
class BlockCodec(Codec):
    block_size: int = 64

    lossy: ClassVar[bool] = True
    meta_keys: ClassVar[frozenset[str]] = frozenset({"block"})
    scale_part: ClassVar[str] = "scale"  # the part that holds the block scales
    # the largest scale a sender may use: a decoded value is code * scale, kept finite without a
    # pass over the output
    max_scale: ClassVar[float] = FLOAT32_MAX

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise CodecError(f"{self.name} block size must be an int in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")

    @classmethod
    def from_param(cls, text: str | None) -> BlockCodec:
        """"name:block", e.g. "int8:4096"."""
        return cls() if text is None else cls(int_param(text))

    @property
    def spec(self) -> str:
        default = self.__dataclass_fields__["block_size"].default
        return self.name if self.block_size == default else f"{self.name}:{self.block_size}"

    def code_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def code_values(self, codes: bytes, numel: int) -> np.ndarray:
        """Each element's code as the multiple of its block's scale it decodes to: float32 that the
        decoder may overwrite (the decoded tensor is then made in it), or a read-only view."""
        raise NotImplementedError

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {"block": self.block_size}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        block = meta_int(meta, "block", 1, MAX_BLOCK_SIZE)
        return {self.scale_part: 4 * -(-numel // block), "q": self.code_bytes(numel)}

    def _check_values(self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int,
                      meta: Mapping[str, int | float]) -> None:
        """The scales alone: every code's value is bounded, so scales in [0, ``max_scale``] make every
        decoded value finite (one float per block read, not the block)."""
        scale = tensor_from(parts[self.scale_part], torch.float32)  # small: one float per block
        if scale.numel():
            low, high = (float(value) for value in torch.aminmax(scale))
            if not (0.0 <= low and high <= self.max_scale):  # NaN fails both comparisons
                raise CodecError(f"{self.name} block scales must be finite and in [0, {self.max_scale:.3g}]")

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        block = int(meta["block"])
        self._check_values(parts, shape, numel, meta)
        values = self.code_values(parts["q"], numel)
        # scaled where the codes' values lie when they are float32 of its own (one array, one pass less)
        out_np = values if values.dtype == np.float32 and values.flags.writeable else np.empty(numel, np.float32)
        scale_np = array_from(parts[self.scale_part], np.float32)
        full = numel // block * block
        if full:
            np.multiply(values[:full].reshape(-1, block), scale_np[: full // block, None],
                        out=out_np[:full].reshape(-1, block))
        if full < numel:
            np.multiply(values[full:], scale_np[-1], out=out_np[full:])
        return torch.from_numpy(out_np)
