"""Where a joiner's download lands (state/transfer.py): the named tensors it takes, each written
in place, not one buffer of the whole state that is then copied into them (issue 35: that buffer
was 16 bytes a parameter beside the joiner's own state, the peak of a join).

A tensor the caller hands over (``into``: a peer's outer parameters and momentum, which it resets
if the download fails) is written where it lives; any other taken tensor is made here, once, and
handed over as it is (the optimizer's moments become the optimizer's). A part that also holds bytes
of a tensor not taken (``keep``) is kept whole beside them, so a sketch of it reads what the donor
served; the alignment padding between tensors reads as zeros, as donors serve it.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.served import ServedState
from swarmgrad.state.snapshot import DTYPES, Specs, byte_view, layout, overlaps


class StateLanding:
    """The tensors of a state laid out by ``specs`` that ``keep`` accepts (all, without it), for a
    download to write part by part; ``into``: the caller's own tensors to write in place where their
    name, dtype and shape match (on the CPU, contiguous); the rest are made here."""

    def __init__(self, specs: Specs, keep: Callable[[str], bool] | None = None,
                 into: Mapping[str, torch.Tensor] | None = None):
        self.specs = specs
        self._offsets, self.nbytes = layout(specs)
        self.tensors: dict[str, torch.Tensor] = {}
        self.in_place: set[str] = set()
        for name, dtype, shape in specs:
            if keep is not None and not keep(name):
                continue
            target = (into or {}).get(name)
            if target is not None and target.dtype == DTYPES[dtype] and tuple(target.shape) == shape \
                    and target.device.type == "cpu" and target.is_contiguous():
                self.tensors[name] = target.detach()
                self.in_place.add(name)
            else:
                self.tensors[name] = torch.empty(shape, dtype=DTYPES[dtype])
        self._loose: dict[int, torch.Tensor] = {}  # parts that also hold bytes of tensors not taken

    def _span(self, index: int) -> tuple[int, int]:
        start = index * state_snapshot.PART_BYTES
        return start, min(state_snapshot.PART_BYTES, self.nbytes - start)

    def direct(self, index: int) -> memoryview | None:
        """Where part ``index`` can be received straight into: the bytes of the one taken tensor that
        holds all of it; None where it spans tensors, padding or bytes not taken (``write`` it)."""
        start, length = self._span(index)
        name, offset, lo, hi = next(overlaps(self.specs, self._offsets, start, length), ("", 0, 0, 0))
        if lo != start or hi != start + length or name not in self.tensors:
            return None
        return memoryview(byte_view(self.tensors[name]).numpy())[lo - offset : hi - offset]

    def write(self, index: int, payload: torch.Tensor) -> None:
        """Part ``index``'s bytes (uint8), into the taken tensors that hold them."""
        start, length = self._span(index)
        whole = True
        for name, offset, lo, hi in overlaps(self.specs, self._offsets, start, length):
            if name in self.tensors:
                byte_view(self.tensors[name])[lo - offset : hi - offset].copy_(payload[lo - start : hi - start])
            else:
                whole = False
        if not whole:
            self._loose[index] = payload

    def read_part(self, index: int) -> torch.Tensor:
        """Part ``index`` as it landed (a copy; padding reads as zeros)."""
        if index in self._loose:
            return self._loose[index]
        start, length = self._span(index)
        part = torch.zeros(length, dtype=torch.uint8)
        for name, offset, lo, hi in overlaps(self.specs, self._offsets, start, length):
            if name in self.tensors:
                part[lo - start : hi - start].copy_(byte_view(self.tensors[name])[lo - offset : hi - offset])
        return part

    def landed(self, version: int, meta: dict) -> ServedState:
        """The taken tensors as a state (``live``: those written in place)."""
        return ServedState(version, self.tensors, meta, live=frozenset(self.in_place))
