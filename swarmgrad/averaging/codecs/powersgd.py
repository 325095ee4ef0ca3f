"""PowerSGD low-rank compression (Vogels et al., arXiv 1905.13727), one power iteration per round.

A tensor with >= 2 dims is viewed as the matrix M = tensor.view(shape[0], -1) (n x m). With a
warm-start Q (m x r):  P = M Q;  P = orthonormalise(P) (QR);  Q = M^T P;  send P and Q as
float32; decode P Q^T, the projection of M onto span(P). Payload 4 r (n + m) bytes.

Tensors with < 2 dims, or where r (n + m) >= n m (low rank would not be smaller), are sent as
raw float32 instead: meta {"raw": 1, "rank": 0}, lossless. Note that an engine which flattens
tensors or cuts them into 1-D slices gets only this fallback: give PowerSGD whole tensors.

State: the warm start is the Q this codec sent last round for the same tensor; reusing it makes
one iteration per round track the top singular subspace over rounds. `encode` stays pure: the
state goes in as `warm_start` and comes out of `next_warm_start(encoded)`, and `ErrorFeedback`
keeps it per tensor key (committed only with a successful round). Without a warm start (first
round, no ErrorFeedback, or a Q of the wrong shape / non-finite / all zero) Q is drawn from
N(0, 1) with a generator seeded by `seed`, so encoding is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, CodecError, Encoded, check_finite, int_param, meta_int, tensor_from
from .cast import Float16Codec

__all__ = ["PowerSGDCodec"]

MAX_RANK = 1024
_FP32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True, repr=False)
class PowerSGDCodec(Codec):
    rank: int = 4
    seed: int = 0

    name: ClassVar[str] = "powersgd"
    lossy: ClassVar[bool] = True
    order: ClassVar[int] = 100
    meta_keys: ClassVar[frozenset[str]] = frozenset({"raw", "rank"})

    def __post_init__(self) -> None:
        if type(self.rank) is not int or not 1 <= self.rank <= MAX_RANK:
            raise CodecError(f"powersgd rank must be an int in [1, {MAX_RANK}], got {self.rank!r}")
        if type(self.seed) is not int:
            raise CodecError(f"powersgd seed must be an int, got {self.seed!r}")

    @classmethod
    def from_param(cls, text: str | None) -> PowerSGDCodec:
        """"powersgd:rank", e.g. "powersgd:8"."""
        return cls() if text is None else cls(int_param(text))

    @property
    def spec(self) -> str:
        return self.name if self.rank == 4 else f"{self.name}:{self.rank}"

    def average_codec(self) -> Codec:
        # A sum of rank-r matrices has rank up to r per member; fp16 keeps it close to exact.
        return Float16Codec()

    def matrix_dims(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(n, m) when this shape is sent low-rank, None when it falls back to raw float32."""
        if len(shape) < 2:
            return None
        rows, cols = shape[0], math.prod(shape[1:])
        if self.rank * (rows + cols) >= rows * cols:
            return None
        return rows, cols

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        if self.matrix_dims(shape) is None:
            return {"raw": 1, "rank": 0}
        return {"raw": 0, "rank": self.rank}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        if meta_int(meta, "raw", 0, 1):
            meta_int(meta, "rank", 0, 0)
            return {"raw": 4 * numel}
        if len(shape) < 2:
            raise CodecError(f"powersgd low-rank payload needs a shape with >= 2 dims, got {shape}")
        rows = shape[0]
        cols = numel // rows if rows else 0
        rank = meta_int(meta, "rank", 1, min(rows, cols, MAX_RANK))
        return {"p": 4 * rows * rank, "q": 4 * cols * rank}

    def _initial_q(self, cols: int, warm_start: torch.Tensor | None) -> torch.Tensor:
        if (
            warm_start is not None
            and warm_start.shape == (cols, self.rank)
            and bool(torch.isfinite(warm_start).all())
            and bool(warm_start.any())  # an all-zero Q would give P = 0 and learn nothing
        ):
            return warm_start.detach().to(device="cpu", dtype=torch.float32)
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randn(cols, self.rank, generator=generator)

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        dims = self.matrix_dims(shape)
        if dims is None:
            check_finite(flat, "tensor to encode")
            return {"raw": flat.numpy().tobytes()}, {"raw": 1, "rank": 0}
        rows, cols = dims
        matrix = flat.view(rows, cols)
        # Both products written as (r x .) @ (. x .) and transposed back: several times faster on
        # CPU than matrix @ q and matrix.T @ p with these skinny shapes.
        p = (self._initial_q(cols, warm_start).T @ matrix.T).T
        # A NaN/Inf anywhere in M reaches its row of P (x*0 is NaN for x = Inf): checked on n*r values.
        check_finite(p, "tensor to encode")
        p = torch.linalg.qr(p).Q.contiguous()
        q = (p.T @ matrix).T.contiguous()  # = M^T P
        check_finite(q, "tensor to encode (values too large for a float32 low-rank factor)")
        return {"p": p.numpy().tobytes(), "q": q.numpy().tobytes()}, {"raw": 0, "rank": self.rank}

    def next_warm_start(self, encoded: Encoded) -> torch.Tensor | None:
        q_bytes = encoded.parts.get("q")
        if (encoded.codec != self.name or encoded.meta.get("raw") != 0 or encoded.meta.get("rank") != self.rank
                or not q_bytes or len(q_bytes) % (4 * self.rank)):
            return None
        return tensor_from(q_bytes, torch.float32).view(-1, self.rank)

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        if meta["raw"]:
            out = tensor_from(parts["raw"], torch.float32)
            check_finite(out, "powersgd raw payload")
            return out
        rank = int(meta["rank"])
        p = tensor_from(parts["p"], torch.float32).view(-1, rank)
        q = tensor_from(parts["q"], torch.float32).view(-1, rank)
        check_finite(p, "powersgd P")
        check_finite(q, "powersgd Q")
        # Cauchy-Schwarz: |(P Q^T)_ij| <= |P_i| |Q_j|, so this bound rules out overflow without a
        # pass over the n*m output (norms in float64 so they cannot overflow themselves). P and Q
        # have at least one row each: _part_sizes allows no low-rank payload with n or m = 0.
        p_norm = torch.linalg.vector_norm(p.double(), dim=1).max()
        q_norm = torch.linalg.vector_norm(q.double(), dim=1).max()
        if not float(p_norm * q_norm) < _FP32_MAX / 2:  # /2: room for float32 rounding in the matmul
            raise CodecError("powersgd factors are too large: their product would overflow float32")
        return (p @ q.T).reshape(-1)
