"""A peer's whole state as one byte buffer: named CPU tensors laid out at 8-byte offsets, a version
and small metadata (``StateSnapshot``), and the ``PART_BYTES`` parts it travels in.

A donor serves its snapshots (state/server.py); a joiner fetches one in parts and checks it
(state/transfer.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import msgpack
import torch

from swarmgrad.errors import SwarmgradError
from swarmgrad.net.wire import FrameError

# small enough that a peer keeping its optimizer state skips the parts holding it even in a state
# of a few MB, large enough that a part's round trip is a small share of its transfer
PART_BYTES = 1024 * 1024
ALIGNMENT = 8  # bytes; the largest element size we carry
MAX_DESCRIPTION_BYTES = 16 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 * 1024 * 1024  # a joiner's default: it makes the tensors it takes (and does not hold) up front
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


class StateTransferError(SwarmgradError):
    """No donor could hand over a complete, valid state."""


class StateTooLarge(StateTransferError):
    """A donor's state is larger than this peer agreed to download: this peer's limit, no donor's fault."""

    def __init__(self, nbytes: int, max_bytes: int):
        super().__init__(f"the state is {nbytes} bytes ({nbytes / 2**30:.1f} GiB), above this peer's limit of "
                         f"{max_bytes} bytes ({max_bytes / 2**30:.1f} GiB); raise download_state's max_bytes "
                         f"to take it")
        self.nbytes, self.max_bytes = nbytes, max_bytes


@dataclass(frozen=True)
class StateSnapshot:
    """Named CPU tensors packed in one byte buffer, a version (higher is fresher) and JSON-like metadata."""

    version: int
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # name, dtype, shape
    meta: dict[str, Any]
    data: torch.Tensor  # uint8, all tensors' bytes in spec order

    @classmethod
    def capture(cls, version: int, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any] | None = None) -> StateSnapshot:
        """A copy of ``tensors`` (any device), safe to serve while training goes on."""
        specs = specs_of(tensors)
        offsets, total = layout(specs)
        data = torch.zeros(total, dtype=torch.uint8)
        for (start, length), tensor in zip(offsets, tensors.values()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            data[start : start + length].copy_(flat)
        return cls(version, tuple(specs), dict(meta or {}), data)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def digest(self) -> str:
        """Identifies the layout (names, dtypes, shapes), not the values: donors with equal digests lay
        their bytes out alike, so their parts and sketches compare part by part (values agree only up
        to a tolerance: ``agreeing``)."""
        return layout_digest(self.specs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views into ``data`` with their names, dtypes and shapes."""
        offsets, _ = layout(self.specs)
        return {name: self.data[start : start + length].view(DTYPES[dtype]).reshape(shape)
                for (name, dtype, shape), (start, length) in zip(self.specs, offsets)}

    def read_part(self, index: int) -> torch.Tensor:
        """The bytes of part ``index``, as served (the one place a donor reads its snapshot's data)."""
        return part_of(self.data, index)

    def describe(self) -> bytes:
        return describe_state(self.specs, self.meta)

    def still_current(self) -> bool:
        return True  # a copy: nothing changes it

    frozen = False  # a copy made to serve: kept as the latest few are (state/served.py's frozen ones only while read)
    stale = False

    def can_read_past(self, step: Any) -> bool:
        return True  # nothing here moves

    def retire(self, readers: int, step: Any = None) -> bool:
        """Nothing to do: a snapshot is a copy (state/served.py's states are not)."""
        return False

    def held_bytes(self) -> int:
        return self.nbytes


Specs = tuple[tuple[str, str, tuple[int, ...]], ...]  # name, dtype, shape


def specs_of(tensors: Mapping[str, torch.Tensor]) -> Specs:
    """The layout's specs of named tensors; ValueError for a dtype a state cannot carry."""
    specs = []
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"state tensor {name!r} has unsupported dtype {dtype}")
        specs.append((name, dtype, tuple(tensor.shape)))
    return tuple(specs)


def layout_digest(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> str:
    described = msgpack.packb([[n, d, list(s)] for n, d, s in specs], use_bin_type=True)
    return hashlib.sha256(described).hexdigest()[:32]


def describe_state(specs: Sequence[tuple[str, str, tuple[int, ...]]], meta: dict[str, Any]) -> bytes:
    """What a donor says of a state before its parts: the specs and the metadata."""
    return msgpack.packb({"specs": [[n, d, list(s)] for n, d, s in specs], "meta": meta}, use_bin_type=True)


def element_size(dtype: str) -> int:
    return torch.empty(0, dtype=DTYPES[dtype]).element_size()


def layout(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each tensor in the byte buffer, and its total size. Offsets are
    multiples of 8, so every tensor can be viewed in place as its own dtype."""
    offsets, position = [], 0
    for _, dtype, shape in specs:
        length = math.prod(shape) * element_size(dtype)
        offsets.append((position, length))
        position += -(-length // ALIGNMENT) * ALIGNMENT
    return offsets, position


def parse_description(payload: bytes, nbytes: int) -> tuple[tuple, dict]:
    try:
        described = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        specs = tuple(
            (str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in described["specs"]
        )
        meta = described["meta"]
    except Exception as error:
        raise FrameError(f"state description is malformed: {error}") from None
    if not isinstance(meta, dict):
        raise FrameError("state metadata must be a map")
    for name, dtype, shape in specs:
        if dtype not in DTYPES or any(d < 0 for d in shape):
            raise FrameError(f"state tensor {name!r}: bad dtype {dtype!r} or shape {shape}")
    if layout(specs)[1] != nbytes:
        raise FrameError(f"state description adds up to {layout(specs)[1]} bytes, the donor claims {nbytes}")
    return specs, meta


def names_in(specs: Sequence[tuple[str, str, tuple[int, ...]]], parts: Sequence[int]) -> list[str]:
    """The tensors with bytes in ``parts``."""
    offsets, _ = layout(specs)
    wanted = set(parts)
    return [name for (name, _, _), (start, length) in zip(specs, offsets)
            if length and wanted & set(range(start // PART_BYTES, (start + length - 1) // PART_BYTES + 1))]


def parts_holding(specs: Sequence[tuple[str, str, tuple[int, ...]]], keep: Callable[[str], bool] | None) -> list[int]:
    """Indices of the ``PART_BYTES`` parts that hold the tensors ``keep`` accepts (all, without it)."""
    offsets, total = layout(specs)
    if keep is None:
        return list(range(math.ceil(total / PART_BYTES)))
    parts: set[int] = set()
    for (name, _, _), (start, length) in zip(specs, offsets):
        if length and keep(name):
            parts.update(range(start // PART_BYTES, (start + length - 1) // PART_BYTES + 1))
    return sorted(parts)


def part_of(data: torch.Tensor, index: int) -> torch.Tensor:
    """Part ``index`` of a state's byte buffer ``data`` (a view)."""
    return data[index * PART_BYTES : (index + 1) * PART_BYTES]


def part_count(nbytes: int) -> int:
    """How many ``PART_BYTES`` parts a state of ``nbytes`` travels in."""
    return math.ceil(nbytes / PART_BYTES)


def overlaps(specs: Specs, offsets: list[tuple[int, int]], start: int,
             length: int) -> Iterator[tuple[str, int, int, int]]:
    """(name, offset, lo, hi) for each tensor of the layout holding bytes in ``[start, start + length)``:
    it starts at ``offset`` and holds the layout's bytes ``[lo, hi)`` of that range."""
    for (name, _, _), (offset, size) in zip(specs, offsets):
        lo, hi = max(start, offset), min(start + length, offset + size)
        if lo < hi:
            yield name, offset, lo, hi


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (a view: writing it writes the tensor)."""
    return tensor.detach().reshape(-1).view(torch.uint8)
