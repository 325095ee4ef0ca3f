"""Element-wise codecs: raw float32 (`none`) and casts to float16 / bfloat16.

Error bounds (x finite, round to nearest):
- none: exact.
- fp16: |x| <= 65504: |err| <= 2^-11 |x| + 2^-25 (the additive term covers fp16 subnormals);
  larger magnitudes are clamped to +-65504 instead of becoming inf.
- bf16: |err| <= 2^-8 |x| (+ 2^-134 for fp32-subnormal inputs); the range is fp32's, clamped
  to +-bf16 max at the very top.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, CodecError, check_finite, tensor_from

__all__ = ["RawCodec", "Float16Codec", "BFloat16Codec"]


def _finite_range(flat: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty tensor, raising on NaN/Inf; one pass, no temporary."""
    low, high = (value.item() for value in torch.aminmax(flat))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CodecError("cannot encode a tensor with NaN or Inf values")
    return low, high


@dataclass(frozen=True, repr=False)
class RawCodec(Codec):
    """float32 bytes as they are: the lossless baseline."""

    name: ClassVar[str] = "none"
    lossy: ClassVar[bool] = False
    order: ClassVar[int] = 10

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        return {"data": 4 * numel}

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        check_finite(flat, "tensor to encode")
        return {"data": flat.numpy().tobytes()}, {}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        out = tensor_from(parts["data"], torch.float32)
        check_finite(out, "none payload")
        return out


class _CastCodec(Codec):
    """Shared body of fp16/bf16: clamp only when the range demands it, cast, ship 2 bytes/element."""

    lossy: ClassVar[bool] = True
    wire_dtype: ClassVar[torch.dtype]

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        return {"data": 2 * numel}

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        if flat.numel() == 0:
            return {"data": b""}, {}
        limit = torch.finfo(self.wire_dtype).max
        low, high = _finite_range(flat)
        if low < -limit or high > limit:  # rare: skip the extra pass when everything fits
            flat = flat.clamp(-limit, limit)
        # int16 view: numpy has no bfloat16, and the bytes are the same either way
        return {"data": flat.to(self.wire_dtype).view(torch.int16).numpy().tobytes()}, {}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        out = tensor_from(parts["data"], self.wire_dtype).float()
        check_finite(out, f"{self.name} payload")
        return out


@dataclass(frozen=True, repr=False)
class Float16Codec(_CastCodec):
    name: ClassVar[str] = "fp16"
    order: ClassVar[int] = 20
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True, repr=False)
class BFloat16Codec(_CastCodec):
    name: ClassVar[str] = "bf16"
    order: ClassVar[int] = 30
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
