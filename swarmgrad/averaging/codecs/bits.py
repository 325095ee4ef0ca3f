"""b-bit codes packed into bytes, first code in the lowest bits, and back: `pack` for b in 1, 2, 4, 8
(fast), `pack_fields` for any width (the low bits of positions).

`count` codes take ceil(count * b / 8) bytes; the unused high bits of the last byte are zero, and
`unpack` refuses a payload where they are not, so every tensor has exactly one encoding.
"""

from __future__ import annotations

import numpy as np

from .base import CodecError

__all__ = ["CODE_BITS", "byte_table", "lookup", "pack", "pack_fields", "packed_size", "unpack", "unpack_fields"]

CODE_BITS = (1, 2, 4, 8)


def packed_size(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack(codes: np.ndarray, bits: int) -> bytes:
    """uint8 codes, each < 2**bits, packed into bytes."""
    if bits == 8:
        return codes.tobytes()
    per_byte = 8 // bits
    padded = np.zeros(packed_size(codes.size, bits) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    lanes = padded.reshape(-1, per_byte)
    out = lanes[:, 0].copy()
    for lane in range(1, per_byte):
        out |= lanes[:, lane] << (bits * lane)
    return out.tobytes()


def unpack(buffer: bytes, count: int, bits: int) -> np.ndarray:
    """The `count` codes of a buffer of exactly packed_size(count, bits) bytes (the caller checked
    its length); CodecError if the padding bits are not zero."""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if bits == 8:
        return raw
    per_byte, mask = 8 // bits, (1 << bits) - 1
    codes = np.empty((raw.size, per_byte), dtype=np.uint8)
    for lane in range(per_byte):
        np.bitwise_and(raw >> (bits * lane), mask, out=codes[:, lane])
    codes = codes.reshape(-1)
    if codes[count:].any():
        raise CodecError(f"the padding bits after {count} {bits}-bit codes must be zero")
    return codes[:count]


def byte_table(values: np.ndarray, bits: int) -> np.ndarray:
    """For each byte, the ``values`` of the 8 / bits codes it packs, first code first: (256, 8 / bits)."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    every_byte = np.arange(256)
    return np.stack([values[(every_byte >> (bits * lane)) & mask] for lane in range(per_byte)], axis=1)


def lookup(buffer: bytes, count: int, bits: int, table: np.ndarray) -> np.ndarray:
    """``values[code]`` for the `count` codes of a buffer of exactly packed_size(count, bits) bytes, where
    ``table`` is ``byte_table(values, bits)``: one gather a byte instead of a pass per code in it and one
    to look the codes up (3x faster at 2 bits, 11x at 1); a fresh array the caller may overwrite. CodecError if
    the padding bits are not zero, as ``unpack``."""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    tail = count % (8 // bits)  # codes in the last byte, where it is not full
    if tail and raw.size and int(raw[-1]) >> (bits * tail):
        raise CodecError(f"the padding bits after {count} {bits}-bit codes must be zero")
    return table.take(raw, axis=0).reshape(-1)[:count]  # take: 7x faster than table[raw]


def pack_fields(values: np.ndarray, width: int) -> bytes:
    """Non-negative ints, each < 2**width (any width up to 32), as width-bit fields, lowest bit first."""
    if width == 0 or values.size == 0:
        return b""
    fields = (values.astype(np.int64)[:, None] >> np.arange(width)) & 1
    return np.packbits(fields.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def unpack_fields(buffer: bytes, count: int, width: int) -> np.ndarray:
    """`count` width-bit fields from a buffer of exactly packed_size(count, width) bytes, as int64;
    CodecError if the padding bits are not zero."""
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), bitorder="little")
    if bits[count * width :].any():
        raise CodecError(f"the padding bits after {count} {width}-bit fields must be zero")
    return bits[: count * width].reshape(count, width).astype(np.int64) @ (np.int64(1) << np.arange(width))
