"""Top-k sparsification: keep the k = ceil(fraction * numel) largest-magnitude elements.

Payload: int32 indices (sorted ascending) + float32 values, 8 bytes per kept element, so the
ratio is 1 / (2 * fraction), e.g. 50x at 1%. Kept elements decode exactly, all others to zero;
what is dropped is the error feedback's job (architecture.md, invariant 'lossy codecs keep error feedback'). Tensors are
limited to 2^31 - 1 elements by the int32 indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, CodecError, check_finite, float_param, meta_int, tensor_from
from .cast import Float16Codec

__all__ = ["TopKCodec", "top_k_indices"]

_MAX_INDEX = (1 << 31) - 1
# Below this size a plain torch.topk is fast enough and the sampling pre-pass is not worth it.
_SAMPLED_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 16


def top_k_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values of a flat non-negative tensor, in no particular order.

    torch.topk over millions of elements is slow on CPU (~60 ms for 4M at k = 1%). A strided
    sample gives a threshold that about 1.5k elements exceed; topk then runs over those
    candidates only. The result is exact: if at least k elements are >= the threshold, the k
    largest are all among them. Otherwise (an unlucky sample) fall back to the full topk.
    """
    numel = magnitude.numel()
    if numel < _SAMPLED_MIN_NUMEL or 4 * k > numel:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[:: numel // _SAMPLE_SIZE]
    want = min(sample.numel(), math.ceil(1.5 * k * sample.numel() / numel) + 8)
    threshold = torch.topk(sample, want, sorted=False).values.min()
    # "not below" rather than ">=": a NaN compares false both ways, and must stay a candidate so
    # that it ranks first and the caller's finiteness check sees it.
    candidates = torch.nonzero(torch.lt(magnitude, threshold).logical_not_()).squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


@dataclass(frozen=True, repr=False)
class TopKCodec(Codec):
    fraction: float = 0.01

    name: ClassVar[str] = "topk"
    lossy: ClassVar[bool] = True
    order: ClassVar[int] = 80
    meta_keys: ClassVar[frozenset[str]] = frozenset({"k"})

    def __post_init__(self) -> None:
        if type(self.fraction) not in (int, float) or not 0.0 < self.fraction <= 1.0:
            raise CodecError(f"topk fraction must be a number in (0, 1], got {self.fraction!r}")

    @classmethod
    def from_param(cls, text: str | None) -> TopKCodec:
        """"topk:fraction", e.g. "topk:0.01"."""
        return cls() if text is None else cls(float_param(text))

    @property
    def spec(self) -> str:
        return self.name if self.fraction == 0.01 else f"{self.name}:{self.fraction!r}"

    def average_codec(self) -> Codec:
        # Dense fp16 keeps the average of exact float32 values close to exact; `sparse` is the codec
        # whose average travels sparse (nonzero.py).
        return Float16Codec()

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        return {"k": min(numel, max(1, math.ceil(self.fraction * numel)))}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        k = meta_int(meta, "k", 0, numel)
        return {"idx": 4 * k, "val": 4 * k}

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        numel = flat.numel()
        if numel > _MAX_INDEX:
            raise CodecError(f"topk indices are int32: a tensor of {numel} elements is too large")
        k = int(self._meta_for(shape, numel)["k"])
        # NaN and Inf rank above every finite magnitude, so if any exist, a kept value shows it.
        indices = torch.sort(top_k_indices(flat.abs(), k)).values  # sorted: deterministic, cache-friendly scatter
        values = flat[indices]
        check_finite(values, "tensor to encode")
        return {"idx": indices.to(torch.int32).numpy().tobytes(), "val": values.numpy().tobytes()}, {"k": k}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        indices = tensor_from(parts["idx"], torch.int32).long()
        values = tensor_from(parts["val"], torch.float32)
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < numel):
            raise CodecError(f"topk indices must be in [0, {numel})")
        check_finite(values, "topk values")
        out = torch.zeros(numel, dtype=torch.float32)
        out[indices] = values  # a repeated index keeps one of its values: harmless, never out of range
        return out
