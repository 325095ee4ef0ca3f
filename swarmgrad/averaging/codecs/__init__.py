"""Tensor codecs for the averaging engine: how one named tensor is turned into bytes and back.

    codec = get_codec("topk:0.01")
    feedback = ErrorFeedback(codec)                 # one per peer; keeps what lossy codecs drop
    encoded = feedback.encode("layer1.weight", update)
    frame = encoded.to_msgpack()                    # plain types: msgpack.packb(frame)
    ...
    tensor = codec.decode(Encoded.from_msgpack(msgpack.unpackb(data)), max_elements=limit)
    feedback.commit()  # or feedback.discard() when the round failed

Specs: none | fp16 | bf16 | int8[:block] | q4[:block] | q2[:block] | sign[:block] | topk[:fraction] |
sparse[:fraction[:bits]] | powersgd[:rank]. `nonzero` only carries `sparse` averages back.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import DEFAULT_MAX_ELEMENTS, FLOAT_DTYPES, Codec, CodecError, Encoded
from .cast import BFloat16Codec, Float16Codec, RawCodec
from .feedback import ErrorFeedback
from .int8 import Int8Codec
from .lowbit import Q2Codec, Q4Codec
from .nonzero import NonzeroCodec
from .powersgd import PowerSGDCodec
from .sign import SignCodec
from .sparse import SparseCodec
from .topk import TopKCodec

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_MAX_ELEMENTS",
    "FLOAT_DTYPES",
    "BFloat16Codec",
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "Float16Codec",
    "Int8Codec",
    "NonzeroCodec",
    "PowerSGDCodec",
    "Q2Codec",
    "Q4Codec",
    "RawCodec",
    "SignCodec",
    "SparseCodec",
    "TopKCodec",
    "get_codec",
]


def _int_param(text: str) -> int:
    if not text.isdigit():  # int() would also take "+4", " 4", "4_0"
        raise ValueError(text)
    return int(text)


def _float_param(text: str) -> float:
    value = float(text)
    if value != value:  # NaN passes no range check by accident
        raise ValueError(text)
    return value


def _sparse_params(text: str) -> tuple[float, int] | tuple[float]:
    """A sparse spec's parameters: "fraction" or "fraction:bits"."""
    fraction, sep, bits = text.partition(":")
    return (_float_param(fraction), _int_param(bits)) if sep else (_float_param(fraction),)


def _sparse(params: tuple[float, int] | tuple[float] = ()) -> SparseCodec:
    return SparseCodec(*params)


# name -> (factory, parser of the optional ":param"; None when the codec takes no parameter)
_REGISTRY: dict[str, tuple[Callable[..., Codec], Callable[[str], object] | None]] = {
    RawCodec.name: (RawCodec, None),
    Float16Codec.name: (Float16Codec, None),
    BFloat16Codec.name: (BFloat16Codec, None),
    Int8Codec.name: (Int8Codec, _int_param),
    Q4Codec.name: (Q4Codec, _int_param),
    Q2Codec.name: (Q2Codec, _int_param),
    SignCodec.name: (SignCodec, _int_param),
    TopKCodec.name: (TopKCodec, _float_param),
    SparseCodec.name: (_sparse, _sparse_params),
    PowerSGDCodec.name: (PowerSGDCodec, _int_param),
}
CODEC_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_codec(spec: str) -> Codec:
    """Parse "name", "name:param" or (sparse) "name:param:param" (see the module docstring); CodecError says what is accepted."""
    if not isinstance(spec, str):
        raise CodecError(f"codec spec must be a string, got {type(spec).__name__}")
    name, sep, param = spec.strip().partition(":")
    if name not in _REGISTRY:
        raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    factory, parse = _REGISTRY[name]
    if not sep:
        return factory()
    if parse is None:
        raise CodecError(f"codec {name!r} takes no parameter, got {spec!r}")
    try:
        value = parse(param)
    except ValueError:
        raise CodecError(f"bad parameter {param!r} for codec {name!r} (spec {spec!r})") from None
    return factory(value)  # the codec range-checks its parameter and raises CodecError
