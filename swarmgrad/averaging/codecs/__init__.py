"""Tensor codecs for the averaging engine: how one named tensor is turned into bytes and back.

    codec = get_codec("topk:0.01")
    feedback = ErrorFeedback(codec)                 # one per peer; keeps what lossy codecs drop
    encoded = feedback.encode("layer1.weight", update)
    frame = encoded.to_msgpack()                    # plain types: msgpack.packb(frame)
    ...
    tensor = codec.decode(Encoded.from_msgpack(msgpack.unpackb(data)), max_elements=limit)
    feedback.commit()  # or feedback.discard() when the round failed

A spec is "name" or "name:parameter"; CODEC_NAMES lists the names. A codec is a `base.Codec` subclass
with a `name` in any module of this package, found on first use: its `from_param` says what its
parameter is (e.g. `sparse[:fraction[:bits]]`) and its `order` where CODEC_NAMES lists it, so a new
codec is one new module.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from .base import DEFAULT_MAX_ELEMENTS, FLOAT_DTYPES, Codec, CodecError, Encoded
from .feedback import ErrorFeedback

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_MAX_ELEMENTS",
    "FLOAT_DTYPES",
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "get_codec",
]


@functools.cache
def _codecs() -> dict[str, type[Codec]]:
    """Every codec a spec may name, by name, in `order`. Built on first use rather than on import, so
    a module put on this package's __path__ before then counts too (test_codecs.py)."""
    found: dict[str, type[Codec]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        # defined here (not imported from a sibling), named (not a shared base), chosen by specs
        defined = (value for value in vars(module).values()
                   if isinstance(value, type) and issubclass(value, Codec) and value.__module__ == module.__name__
                   and "name" in vars(value) and not value.helper)
        for codec in defined:
            if found.setdefault(codec.name, codec) is not codec:
                raise RuntimeError(f"two codecs are named {codec.name!r}: {found[codec.name]} and {codec}")
    return dict(sorted(found.items(), key=lambda item: item[1].order))


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "CODEC_NAMES":  # found on first use, like get_codec's codecs
        return tuple(_codecs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_codec(spec: str) -> Codec:
    """Parse "name" or "name:param" (see the module docstring); CodecError says what is accepted."""
    if not isinstance(spec, str):
        raise CodecError(f"codec spec must be a string, got {type(spec).__name__}")
    name, sep, param = spec.strip().partition(":")
    codecs = _codecs()
    if name not in codecs:
        raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(codecs)}")
    try:
        return codecs[name].from_param(param if sep else None)
    except CodecError:
        raise  # the codec's own check says what is wrong
    except ValueError:
        raise CodecError(f"bad parameter {param!r} for codec {name!r} (spec {spec!r})") from None
