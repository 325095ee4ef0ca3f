"""The state a donor serves, read from the tensors it trains with instead of a copy made after every
round (architecture.md, invariant 'joining is cheap'; DESIGN's memory budget).

A ``ServedState`` names tensors laid out as a ``StateSnapshot`` would be (same specs, parts and
digest), but holds them where they are: the strategy's outer parameters and momentum, which stay put
until the next outer step, and the inner optimizer's moments, which are this peer's own (never
compared between donors) and served as they are when asked. Only what the owner changes between
outer steps (buffers, parameters that are not kept elsewhere) is copied when it is captured.

Before the owner changes its live tensors it calls ``retire``: a state that a download (or a
checkpoint being written) still reads keeps them, and the owner goes on with copies (the peak of a
download, never the steady state): nothing a reader already holds ever changes. Any other state
is marked stale and no longer served. Where the change is an outer step the owner can undo on
reading (``OuterStep``: DiLoCo's, on an average held as its frames), a state that downloads read
keeps reading the live tensors past it instead, and no copy is made (issue 35: the copies were 8
bytes a parameter on every donor, for as long as a download ran across an outer step).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.snapshot import byte_view, describe_state, layout, layout_digest, overlaps, specs_of


class OuterStep(Protocol):
    """A change its owner is about to make to live tensors in place, which a state served from before
    it reads past: ``before(piece, steps)`` is ``piece`` (a view of a live tensor the step ``covers``)
    as it was before ``steps`` (consecutive, oldest first, this one the last)."""

    def covers(self, tensor: torch.Tensor) -> bool: ...

    def before(self, piece: torch.Tensor, steps: Sequence[OuterStep]) -> torch.Tensor: ...


class ServedState:
    """Named tensors served in ``PART_BYTES`` parts, without one buffer that holds them all: on the CPU,
    except live ones ``keep_live`` names (a GPU peer's optimizer moments, copied a part at a time when read).

    ``live``: the names of tensors the owner holds and changes in place (the rest are copies this state
    owns); ``keep_live`` says which live ones a freeze leaves as they are (the optimizer's moments:
    they change at every inner step, are this peer's own and never compared between donors)."""

    def __init__(self, version: int, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any] | None = None,
                 live: frozenset[str] = frozenset(), keep_live: Callable[[str], bool] = lambda name: False):
        for name, tensor in tensors.items():
            on_device = tensor.device.type != "cpu"  # the optimizer's moments on a GPU: read when asked
            if not tensor.is_contiguous() or (on_device and not (name in live and keep_live(name))):
                raise ValueError(f"state tensor {name!r} must be contiguous, and on the CPU unless live and kept so")
        self.version, self.specs, self.meta = version, specs_of(tensors), dict(meta or {})
        self._tensors = dict(tensors)
        self._live = set(live)
        self._owned = set(self._tensors) - self._live  # copies this state made (or was handed)
        self._keep_live = keep_live  # live tensors a freeze does not copy (the optimizer's: never compared)
        self._offsets, self.nbytes = layout(self.specs)
        self.stale = False  # the owner changed its live tensors: nothing of it may be served any more
        self.frozen = False  # the owner left its tensors to the readers, or stepped past them: kept only while read
        self._steps: list[OuterStep] = []  # the owner's steps since: read past (``OuterStep``)

    @property
    def digest(self) -> str:
        return layout_digest(self.specs)

    def describe(self) -> bytes:
        return describe_state(self.specs, self.meta)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors, by name (views of the live ones: copy what must outlive the next outer step;
        once the owner stepped past them, ``still_current`` is False and only ``read`` is this state)."""
        return dict(self._tensors)

    def still_current(self) -> bool:
        """Whether the tensors ``tensors()`` handed out still hold this version (a checkpoint written
        from them in the background is whole only if so; the optimizer's change at every step)."""
        return not self.stale and not self._steps

    def read(self, start: int, length: int) -> torch.Tensor:
        """A copy of bytes ``[start, start + length)`` of the layout, at most a part (a live tensor may
        change once the caller yields: what it sends is what it read)."""
        if not 0 <= start <= start + length <= self.nbytes or length > state_snapshot.PART_BYTES:
            raise ValueError(f"bytes [{start}, {start + length}) are outside the state or longer than a part")
        target = torch.zeros(length, dtype=torch.uint8)  # zeros: the alignment padding between tensors
        for name, offset, lo, hi in overlaps(self.specs, self._offsets, start, length):
            tensor = self._tensors[name]
            if self._steps and self._moves(name):  # the owner stepped on: read what it held before
                size = tensor.element_size()
                piece = tensor.detach().reshape(-1)[(lo - offset) // size : (hi - offset) // size]
                target[lo - start : hi - start].copy_(byte_view(self._steps[-1].before(piece, self._steps)))
            else:
                target[lo - start : hi - start].copy_(byte_view(tensor)[lo - offset : hi - offset])
        return target

    def _moves(self, name: str) -> bool:
        """A live tensor the owner changes at an outer step (the optimizer's moments are left to move)."""
        return name in self._live and not self._keep_live(name)

    def can_read_past(self, step: OuterStep) -> bool:
        """Whether every live tensor ``step`` changes here is one it can undo on reading."""
        return self.stale or all(step.covers(self._tensors[name]) for name in self._live if self._moves(name))

    def read_part(self, index: int) -> torch.Tensor:
        """The bytes of part ``index``, as served (a copy: see ``read``)."""
        size = state_snapshot.PART_BYTES
        start = index * size
        return self.read(start, min(size, self.nbytes - start))

    def retire(self, readers: int, step: OuterStep | None = None) -> bool:
        """The owner is about to change its live tensors. With ``readers`` (downloads, a checkpoint)
        this state keeps what they read: by reading past ``step`` where given (the owner checked
        ``can_read_past``) or, where it already read past earlier steps, by copying what they held;
        else it keeps the tensors themselves and True says so: the owner must go on with copies of its
        own and leave these alone (the optimizer's moments excepted: they change at every step, are
        this peer's own and are never compared between donors). Without readers, the state is stale:
        no longer served."""
        moving = [name for name in self._live if self._moves(name)]
        if self.stale or not moving:
            return False
        if readers <= 0:
            self.stale = True
            return False
        if step is not None:
            self._steps.append(step)
            self.frozen = True
            return False
        copied = bool(self._steps)
        if copied:  # a change it cannot read past: copies of what it held, made before the change
            for name in moving:
                self._tensors[name] = self._steps[-1].before(self._tensors[name].detach().reshape(-1),
                                                             self._steps).reshape(self._tensors[name].shape)
            self._steps.clear()
        self._live.difference_update(moving)
        self._owned.update(moving)
        self.frozen = True
        return not copied

    def held_bytes(self) -> int:
        """Host bytes this state holds of its own (copies), not counting the live tensors it reads."""
        return sum(self._tensors[name].numel() * self._tensors[name].element_size() for name in self._owned)

