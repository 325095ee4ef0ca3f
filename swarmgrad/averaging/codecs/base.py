"""The codec interface: `Encoded` (what goes on the wire), `Codec` (encode/decode), `CodecError`.

Every decode validates the whole `Encoded` against the shape it declares *before* allocating the
output (architecture.md, invariant 'bad input touches no state'): a peer can send us garbage, never make us allocate a
terabyte.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["CodecError", "Encoded", "Codec", "DEFAULT_MAX_ELEMENTS", "FLOAT_DTYPES", "float_param", "int_param"]

DEFAULT_MAX_ELEMENTS = 1 << 31
# dtypes an `Encoded` may declare as the original; decode always returns float32, callers cast.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Structural limits, far above anything a real codec produces, so validation stays O(1).
MAX_DIMS = 32
MAX_PARTS = 8
MAX_META = 8
MAX_NAME_LEN = 64
_FIELDS = ("codec", "shape", "dtype", "parts", "meta")


class CodecError(ValueError):
    """An encoded tensor is malformed or inconsistent, or a codec spec/input is invalid."""


@dataclass(frozen=True)
class Encoded:
    """One tensor as a codec produced it: plain types only, so it packs with msgpack as is."""

    codec: str  # codec name that produced it
    shape: tuple[int, ...]  # original tensor shape
    dtype: str  # original dtype name, e.g. "float32"
    parts: dict[str, bytes]  # raw buffers
    meta: dict[str, int | float]  # small scalars (block size, k, rank...)

    def nbytes(self) -> int:
        """Payload bytes (the sum of the parts); the small header is not counted."""
        return sum(len(part) for part in self.parts.values())

    def to_msgpack(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "parts": dict(self.parts),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_msgpack(cls, obj: object) -> Encoded:
        """Build from what msgpack.unpackb returned; raises CodecError on any wrong type or size."""
        if not isinstance(obj, Mapping):
            raise CodecError(f"encoded tensor must be a map, got {type(obj).__name__}")
        if set(obj.keys()) != set(_FIELDS):
            raise CodecError(f"encoded tensor must have exactly the fields {_FIELDS}, got {sorted(map(str, obj))}")
        shape = obj["shape"]
        if not isinstance(shape, (list, tuple)):
            raise CodecError(f"shape must be a list, got {type(shape).__name__}")
        encoded = cls(obj["codec"], tuple(shape), obj["dtype"], obj["parts"], obj["meta"])
        check_structure(encoded)
        return encoded


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is an int subclass; a bool here is always a bug


def check_structure(encoded: Encoded) -> None:
    """Type-level validation shared by from_msgpack and decode (an Encoded may be built by hand)."""
    if not isinstance(encoded, Encoded):
        raise CodecError(f"expected Encoded, got {type(encoded).__name__}")
    if not isinstance(encoded.codec, str) or not 0 < len(encoded.codec) <= MAX_NAME_LEN:
        raise CodecError(f"codec name must be a short string, got {encoded.codec!r:.80}")
    if not isinstance(encoded.dtype, str) or encoded.dtype not in FLOAT_DTYPES:
        raise CodecError(f"dtype must be one of {sorted(FLOAT_DTYPES)}, got {encoded.dtype!r:.80}")
    if not isinstance(encoded.shape, tuple) or len(encoded.shape) > MAX_DIMS:
        raise CodecError(f"shape must be a tuple of at most {MAX_DIMS} ints")
    if not all(_is_int(dim) for dim in encoded.shape):
        raise CodecError(f"shape must hold ints, got {encoded.shape!r:.120}")
    if not isinstance(encoded.parts, dict) or len(encoded.parts) > MAX_PARTS:
        raise CodecError(f"parts must be a map of at most {MAX_PARTS} buffers")
    for key, part in encoded.parts.items():
        if not isinstance(key, str) or not isinstance(part, bytes):
            raise CodecError(f"parts must map str to bytes, got {type(key).__name__} -> {type(part).__name__}")
    if not isinstance(encoded.meta, dict) or len(encoded.meta) > MAX_META:
        raise CodecError(f"meta must be a map of at most {MAX_META} numbers")
    for key, value in encoded.meta.items():
        if not isinstance(key, str) or not (_is_int(value) or type(value) is float):
            raise CodecError(f"meta must map str to int/float, got {key!r:.40} -> {type(value).__name__}")


def check_shape(shape: tuple[int, ...], max_elements: int) -> int:
    """Returns numel; every dim is bounded too, so e.g. (0, 10**30) cannot overflow torch later."""
    if any(dim < 0 or dim > max_elements for dim in shape):
        raise CodecError(f"shape {shape!r:.120} has a negative dim or one above max_elements={max_elements}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise CodecError(f"shape {shape!r:.120} has {numel} elements, above max_elements={max_elements}")
    return numel


def meta_int(meta: Mapping[str, int | float], key: str, low: int, high: int) -> int:
    value = meta[key]
    if not _is_int(value) or not low <= value <= high:
        raise CodecError(f"meta[{key!r}] must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def all_finite(tensor: torch.Tensor) -> bool:
    """One reduction pass with no temporary: a finite sum means every element is finite (NaN and
    +-inf carry into it); only where it is not (or where finite values add up past the dtype's
    range) min/max, which are NaN or +-inf iff some element is. The sum is about 4x faster than
    aminmax on CPU (16 against 69 us on 262,144 float32), and every chunk a round sends or reads is checked."""
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def check_finite(tensor: torch.Tensor, what: str) -> None:
    if not all_finite(tensor):
        raise CodecError(f"{what} has NaN or Inf values")


def as_float32(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Flat contiguous float32 CPU view of `tensor` (no copy when it already is one) and its dtype name."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"can only encode torch tensors, got {type(tensor).__name__}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:
        raise CodecError(f"can only encode float tensors ({sorted(FLOAT_DTYPES)}), got {dtype}")
    flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    return flat.contiguous(), dtype


def tensor_from(buffer: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A writable tensor copied from an immutable buffer.

    bytearray() is one memcpy; torch.frombuffer over it then shares memory without the
    'buffer is not writable' warning that wrapping `bytes` directly would raise.
    """
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype)


def array_from(buffer: bytes, dtype: type[np.generic]) -> np.ndarray:
    """A read-only numpy view of a buffer (no copy): for values only read once, e.g. int8 codes."""
    return np.frombuffer(buffer, dtype=dtype)


def int_param(text: str) -> int:
    """A spec's integer parameter (a ValueError says it is none)."""
    if not text.isdigit():  # int() would also take "+4", " 4", "4_0"
        raise ValueError(text)
    return int(text)


def float_param(text: str) -> float:
    """A spec's number parameter (a ValueError says it is none)."""
    value = float(text)
    if value != value:  # NaN passes no range check by accident
        raise ValueError(text)
    return value


class Codec(ABC):
    """Turns a float tensor into an `Encoded` and back.

    `encode` is pure. A codec with per-tensor state (PowerSGD's warm start) takes that state as
    `warm_start` and tells what to carry to the next round through `next_warm_start`;
    `ErrorFeedback` keeps it per tensor key next to the residual.
    """

    name: ClassVar[str]
    lossy: ClassVar[bool]
    # Where CODEC_NAMES (help texts, errors) lists it, lowest first: lossless and casts, block
    # quantizers by falling bits, sparsifiers, low rank; steps of 10 leave room between them.
    order: ClassVar[int]
    # A helper only carries another codec's averages back (`nonzero` for `sparse`): no spec names it.
    helper: ClassVar[bool] = False
    meta_keys: ClassVar[frozenset[str]] = frozenset()
    # how ErrorFeedback keeps this codec's residuals: bfloat16 (2 bytes an element) where a residual is
    # at most a fraction of the block it came from (the block quantizers: int8, q4, q2), so rounding
    # it to 2^-8 of itself loses at most 2^-8 of a quantization step a round, unbiased; float32 where a
    # residual builds up over rounds (sparsifiers, signs, low rank): an update added to a residual
    # hundreds of times its size would be rounded away in bfloat16
    residual_dtype: ClassVar[torch.dtype] = torch.float32

    @classmethod
    def from_param(cls, text: str | None) -> Codec:
        """The codec a spec "name:text" names (None: the spec is "name"). A ValueError says `text` is no
        parameter of this codec; the codec's own range checks raise CodecError. By default a codec
        takes no parameter."""
        if text is not None:
            raise CodecError(f"codec {cls.name!r} takes no parameter, got {f'{cls.name}:{text}'!r}")
        return cls()

    @property
    def spec(self) -> str:
        """The string `get_codec` turns back into an equal codec (what a group agrees on)."""
        return self.name

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, *, warm_start: torch.Tensor | None = None) -> Encoded:
        flat, dtype = as_float32(tensor)
        shape = tuple(int(dim) for dim in tensor.shape)
        parts, meta = self._encode(flat, shape, warm_start)
        return Encoded(self.name, shape, dtype, parts, meta)

    def average_codec(self) -> Codec:
        """The codec an all-reduce owner sends averages back with. An element-wise codec's average
        looks like its inputs, so by default the codec itself. Re-encoding is not fed back (the
        average is no single peer's), so a codec whose average is denser or of higher rank than
        what it encodes names another."""
        return self

    def next_warm_start(self, encoded: Encoded) -> torch.Tensor | None:
        """State to pass as `warm_start` when encoding the same tensor next round (None: stateless)."""
        return None

    @abstractmethod
    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], warm_start: torch.Tensor | None
    ) -> tuple[dict[str, bytes], dict[str, int | float]]:
        """Encode a flat float32 tensor of `shape`; raise CodecError on non-finite input."""

    # ---- decoding -------------------------------------------------------------------------
    def decode(self, encoded: Encoded, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
        """Validate everything, then decode to a fresh float32 tensor of `encoded.shape`."""
        numel = self._validated(encoded, max_elements)
        return self._decode(encoded.parts, encoded.shape, numel, encoded.meta).view(encoded.shape)

    def check(self, encoded: Encoded, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        """Raise CodecError wherever ``decode`` would, without the decoded tensor where the codec can
        tell from its parts (``_check_values``): a peer that keeps a round's result as the frames it
        travelled in decodes them when it applies them, and checking them on arrival by decoding
        was one more pass over the model each round."""
        numel = self._validated(encoded, max_elements)
        self._check_values(encoded.parts, encoded.shape, numel, encoded.meta)

    def _validated(self, encoded: Encoded, max_elements: int) -> int:
        """Everything about ``encoded`` but its values; its element count."""
        check_structure(encoded)
        if encoded.codec != self.name:
            raise CodecError(f"codec {self.name!r} cannot decode a tensor encoded by {encoded.codec!r:.80}")
        numel = check_shape(encoded.shape, max_elements)
        if set(encoded.meta) != self.meta_keys:
            raise CodecError(f"{self.name} meta must have keys {sorted(self.meta_keys)}, got {sorted(encoded.meta)}")
        expected = self._part_sizes(encoded.shape, numel, encoded.meta)  # also range-checks meta
        if set(encoded.parts) != set(expected):
            raise CodecError(f"{self.name} parts must be {sorted(expected)}, got {sorted(encoded.parts)}")
        for key, size in expected.items():
            if len(encoded.parts[key]) != size:
                raise CodecError(f"{self.name} part {key!r} has {len(encoded.parts[key])} bytes, expected {size}")
        return numel

    def _check_values(self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int,
                      meta: Mapping[str, int | float]) -> None:
        """CodecError where ``_decode`` would raise (non-finite values); by default by decoding."""
        self._decode(parts, shape, numel, meta)

    @abstractmethod
    def _part_sizes(self, shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]) -> dict[str, int]:
        """Exact byte length of every part for this shape and meta; CodecError on meta out of range."""

    @abstractmethod
    def _decode(
        self, parts: Mapping[str, bytes], shape: tuple[int, ...], numel: int, meta: Mapping[str, int | float]
    ) -> torch.Tensor:
        """Decode already-size-checked parts to a flat float32 tensor; CodecError on non-finite values."""

    # ---- sizes ----------------------------------------------------------------------------
    @abstractmethod
    def _meta_for(self, shape: tuple[int, ...], numel: int) -> dict[str, int | float]:
        """The meta this codec's encode writes for a tensor of `shape` (sizes depend on shape only)."""

    def encoded_nbytes(self, shape: Sequence[int]) -> int:
        """Payload bytes `encode` produces for this shape, without encoding anything."""
        dims = tuple(int(dim) for dim in shape)
        numel = math.prod(dims)
        return sum(self._part_sizes(dims, numel, self._meta_for(dims, numel)).values())

    def ratio(self, tensor: torch.Tensor) -> float:
        """fp32 bytes / encoded bytes for a tensor of this shape (1.0 for an empty tensor)."""
        encoded = self.encoded_nbytes(tensor.shape)
        return 4 * tensor.numel() / encoded if encoded else 1.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
