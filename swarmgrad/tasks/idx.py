"""IDX files (the MNIST / Fashion-MNIST format), read with numpy in one pass, gzip or raw.

Layout: two zero bytes, a type code, the number of dimensions, then each dimension as a big-endian
uint32, then the values, big-endian, row-major. Every field is checked so that a corrupt or
truncated download fails here with a clear message instead of as a shape error deep in training.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from swarmgrad.errors import ConfigError

# IDX type code -> numpy dtype (big-endian where it matters).
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
GZIP_MAGIC = b"\x1f\x8b"


def read_idx_bytes(path: Path) -> bytes:
    """The file's decoded bytes; gzip is detected from its magic bytes, not its name."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read IDX file {path}: {error.strerror or error}") from error
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as error:
        raise ConfigError(
            f"IDX file {path} is a corrupt or truncated gzip file ({error}); delete it and reinstall or re-download it"
        ) from error


def parse_idx(data: bytes | bytearray, source: str = "<bytes>", expect_ndim: int | None = None) -> np.ndarray:
    """Parse IDX bytes into a numpy array of native byte order."""
    if len(data) < 4:
        raise ConfigError(f"IDX file {source} is truncated: {len(data)} bytes, not even a header")
    zero, type_code, ndim = struct.unpack(">HBB", data[:4])
    magic = int.from_bytes(data[:4], "big")
    if zero != 0 or type_code not in IDX_DTYPES:
        raise ConfigError(f"{source} is not an IDX file: bad magic number 0x{magic:08x}")
    if ndim == 0 or (expect_ndim is not None and ndim != expect_ndim):
        wanted = f"{expect_ndim}" if expect_ndim is not None else "at least 1"
        raise ConfigError(f"IDX file {source} has magic 0x{magic:08x} ({ndim} dimensions), expected {wanted}")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise ConfigError(f"IDX file {source} is truncated inside its header")
    dims = struct.unpack(f">{ndim}I", data[4:header_size])
    dtype = IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_size
    if actual != expected:
        state = "truncated" if actual < expected else "longer than its header says"
        raise ConfigError(
            f"IDX file {source} is {state}: header declares shape {tuple(dims)} ({expected} bytes of data), "
            f"found {actual}"
        )
    # A bytearray keeps the array writable, so torch.from_numpy can share it without a warning.
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    array = np.frombuffer(buffer, dtype=dtype, offset=header_size).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=False)


def read_idx(path: str | Path, expect_ndim: int | None = None) -> np.ndarray:
    path = Path(path)
    return parse_idx(read_idx_bytes(path), str(path), expect_ndim)
