"""The nonzero elements of a mostly-zero tensor: their positions and low-bit values (`nonzero`).

This is how an owner sends back the average of `sparse` contributions, which is sparse on the
union of their supports (up to one support per member).

Positions p_0 < ... < p_{n-1} of a tensor of N elements are Elias-Fano coded: with
L = floor(log2(N / n)), the low L bits of each position go as an L-bit field ("low"), and the high
part h_i = p_i >> L as bit h_i + i of a bit vector of n + ((N - 1) >> L) bits ("high"). That is
at most 2 + log2(N / n) bits a position, e.g. 6 at 6% density where a byte per gap would be 8, and
close to the entropy of a random support. Decoding checks that positions strictly increase and
stay below N, so no duplicate or out-of-range position gets through.

Values, in position order, in groups of 64 sharing one float32 absmax m, are quantised mid-rise to
`bits` bits exactly as in lowbit.py: |x - decoded| <= m / 2^bits (+ m * 2^-22 of rounding, for
m >= 2^-100); zeros stay exact. The payload's size depends on n, so `encoded_nbytes` gives the
largest (every element nonzero), the limit a receiver allows, not the typical size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, CodecError, meta_int, tensor_from
from .bits import pack, pack_fields, packed_size, unpack, unpack_fields
from .lowbit import levels

__all__ = ["NonzeroCodec", "VALUE_BITS", "low_bits"]

VALUE_GROUP = 64  # values sharing one absmax
VALUE_BITS = (2, 4, 8)
DEFAULT_BITS = 2  # what `sparse` uses at its default 2 bits
_SCALE_FLOOR = 2.0**-100


def low_bits(count: int, numel: int) -> int:
    """L = floor(log2(numel / count)), the only low-bit width a decoder accepts (0 for no element)."""
    return (numel // count).bit_length() - 1 if count else 0


def _high_bits(count: int, numel: int) -> int:
    return count + ((numel - 1) >> low_bits(count, numel)) if count else 0


@dataclass(frozen=True, repr=False)
class NonzeroCodec(Codec):
    bits: int = DEFAULT_BITS

    name: ClassVar[str] = "nonzero"
    lossy: ClassVar[bool] = True
    helper: ClassVar[bool] = True
    meta_keys: ClassVar[frozenset[str]] = frozenset({"n", "bits"})

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in VALUE_BITS:
            raise CodecError(f"nonzero value bits must be one of {', '.join(map(str, VALUE_BITS))}, got {self.bits!r}")

    @property
    def spec(self) -> str:
        return self.name if self.bits == DEFAULT_BITS else f"{self.name}:{self.bits}"

    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        # The largest payload: every element nonzero (L = 0, 2N bits of positions); with fewer,
        # n + N / 2^L + n L <= 2N bits for the canonical L, and fewer values.
        return {"n": numel, "bits": self.bits}

    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        count, bits = meta_int(meta, "n", 0, numel), meta_int(meta, "bits", 1, 8)
        if bits not in VALUE_BITS:
            raise CodecError(f"nonzero meta['bits'] must be one of {', '.join(map(str, VALUE_BITS))}, got {bits}")
        return {
            "high": packed_size(_high_bits(count, numel), 1),
            "low": packed_size(count, low_bits(count, numel)),
            "val": packed_size(count, bits),
            "absmax": 4 * -(-count // VALUE_GROUP),
        }

    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        numel = flat.numel()
        positions = torch.nonzero(flat).squeeze(1)  # NaN and Inf are nonzero: checked below
        values = flat[positions]
        count = values.numel()
        padded = torch.zeros(-(-count // VALUE_GROUP) * VALUE_GROUP)
        padded[:count] = values
        absmax = padded.view(-1, VALUE_GROUP).abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError("cannot encode a tensor with NaN or Inf values")
        half = (1 << self.bits) // 2
        scale = (half / absmax.clamp_min(_SCALE_FLOOR)).repeat_interleave(VALUE_GROUP)[:count]
        codes = values.mul(scale).add_(half).floor_().clamp_(0, 2 * half - 1).to(torch.uint8)
        low = low_bits(count, numel)
        where = positions.numpy()
        high = np.zeros(_high_bits(count, numel), dtype=np.uint8)
        high[(where >> low) + np.arange(count)] = 1
        parts = {
            "high": np.packbits(high, bitorder="little").tobytes(),
            "low": pack_fields(where & ((1 << low) - 1), low),
            "val": pack(codes.numpy(), self.bits),
            "absmax": absmax.numpy().tobytes(),
        }
        return parts, {"n": count, "bits": self.bits}

    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        count, bits = int(meta["n"]), int(meta["bits"])
        low, length = low_bits(count, numel), _high_bits(count, numel)
        high = np.unpackbits(np.frombuffer(parts["high"], dtype=np.uint8), bitorder="little")
        if high[length:].any():
            raise CodecError(f"the padding bits after {length} nonzero position bits must be zero")
        ones = np.flatnonzero(high)
        if ones.size != count:
            raise CodecError(f"nonzero positions hold {ones.size} high parts, meta says {count}")
        where = ((ones - np.arange(count)) << low) | unpack_fields(parts["low"], count, low)
        if count and not (np.all(where[1:] > where[:-1]) and int(where[-1]) < numel):
            raise CodecError(f"nonzero positions must increase strictly and stay below {numel}")
        absmax = tensor_from(parts["absmax"], torch.float32)
        if absmax.numel():
            smallest, largest = (float(value) for value in torch.aminmax(absmax))
            if not (0.0 <= smallest and largest <= float(torch.finfo(torch.float32).max)):  # NaN fails both
                raise CodecError("nonzero value maxima must be finite and not negative")
        values = torch.from_numpy(levels(bits)[unpack(parts["val"], count, bits)])
        values.mul_(absmax.repeat_interleave(VALUE_GROUP)[:count])  # levels are inside (-1, 1): finite
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(where)] = values
        return out
