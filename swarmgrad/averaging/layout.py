"""How a set of named tensors is laid out for averaging: a schema, a chunk grid, and parts.

All tensors are flattened into one float32 vector. The vector is cut into *chunks* along a grid
that depends only on the schema (never on the group), so per-chunk state such as error-feedback
residuals stays valid from one round to the next whatever group a peer lands in. A chunk inside
one matrix keeps a 2-D view (whole rows), so matrix codecs like PowerSGD see real rows; small
tensors are packed together into flat chunks. A group then gives each member one contiguous run
of chunks (its *part*), sized by the member's bandwidth share.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Sequence

import msgpack
import torch

from swarmgrad.errors import ConfigError

_AVERAGER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32: large frames, still enough chunks to pipeline 100 MB
MIN_MATRIX_ELEMENTS = 4096  # smaller matrices are packed flat with their neighbours


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # offset in the flat vector
    length: int
    view: tuple[int, ...]  # shape the codec sees: (rows, cols) inside a matrix, else (length,)


class Schema:
    """Names, shapes and dtypes of the tensors a group averages; identical on every member."""

    def __init__(self, specs: Sequence[TensorSpec], chunk_elements: int = CHUNK_ELEMENTS):
        self.specs = tuple(specs)
        self.chunk_elements = chunk_elements
        self.total = sum(spec.numel for spec in self.specs)
        self.chunks = _chunk_grid(self.specs, chunk_elements)
        described = [[s.name, list(s.shape), s.dtype] for s in self.specs] + [chunk_elements]
        self.digest = hashlib.sha256(msgpack.packb(described)).hexdigest()[:32]

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, torch.Tensor]], chunk_elements: int = CHUNK_ELEMENTS) -> Schema:
        specs = [TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]
        return cls(specs, chunk_elements)

    def flatten_into(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            out[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n
        return out

    def unflatten_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in tensors:
                n = tensor.numel()
                tensor.copy_(flat[offset : offset + n].view(tensor.shape))
                offset += n


def _chunk_grid(specs: Sequence[TensorSpec], limit: int) -> tuple[Chunk, ...]:
    chunks: list[Chunk] = []
    flat_start = flat_end = 0  # pending run of small tensors, packed flat

    def add(start: int, length: int, view: tuple[int, ...]) -> None:
        chunks.append(Chunk(len(chunks), start, length, view))

    def flush_flat() -> None:
        nonlocal flat_start
        while flat_start < flat_end:
            length = min(limit, flat_end - flat_start)
            add(flat_start, length, (length,))
            flat_start += length

    offset = 0
    for spec in specs:
        numel = spec.numel
        cols = numel // spec.shape[0] if len(spec.shape) >= 2 and spec.shape[0] else 0
        if cols and numel >= MIN_MATRIX_ELEMENTS and cols <= limit:
            flush_flat()
            rows_per_chunk = limit // cols  # >= 1: cols <= limit
            for row in range(0, spec.shape[0], rows_per_chunk):
                rows = min(rows_per_chunk, spec.shape[0] - row)
                add(offset + row * cols, rows * cols, (rows, cols))
            flat_start = flat_end = offset + numel
        else:
            flat_end = offset + numel
            while flat_end - flat_start >= limit:  # emit full flat chunks; keep the tail pending
                add(flat_start, limit, (limit,))
                flat_start += limit
        offset += numel
    flush_flat()
    return tuple(chunks)


def assign_parts(chunks: Sequence[Chunk], shares: Sequence[float]) -> list[range]:
    """Contiguous runs of chunk indices, one per member, sized by share (0 share: no part)."""
    total_share = sum(shares)
    if not chunks or total_share <= 0:
        return [range(0) for _ in shares]
    total = sum(chunk.length for chunk in chunks)
    parts, start, cumulative_share, position = [], 0, 0.0, 0
    for member, share in enumerate(shares):
        cumulative_share += share
        boundary = total * cumulative_share / total_share
        end = start
        last = member == len(shares) - 1
        while end < len(chunks) and (last or position + chunks[end].length / 2 <= boundary) and share > 0:
            position += chunks[end].length
            end += 1
        parts.append(range(start, end))
        start = end
    return parts


def check_averager_name(name: str) -> str:
    """An averager's name goes into its protocol names and round keys: keep it short and plain."""
    if not isinstance(name, str) or not _AVERAGER_NAME.fullmatch(name):
        raise ConfigError(f"averager name {name!r}: use 1-32 letters, digits, '_' or '-'")
    return name

