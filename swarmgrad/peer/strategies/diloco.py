"""DiLoCo (arXiv 2311.08105): H local steps with the inner optimizer, then average the pseudo-gradient
(start - now) across the swarm and take an outer Nesterov step from the common start."""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from swarmgrad.peer.strategies.base import (
    WEIGHT_SLACK,
    Average,
    Policy,
    ProgressCounter,
    StrategySettings,
    nbytes,
    no_grad,
    pieces,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

Overlap = Literal["auto", "on", "off"]


class DiLoCo(StrategySettings):
    """DiLoCo: ``inner_steps`` local steps per peer between swarm steps (on average over the peers of
    an epoch), then the pseudo-gradients are averaged and an outer Nesterov step is taken from the
    common start."""

    averagings: ClassVar[tuple[str, ...]] = ("moshpit",)

    name: Literal["diloco"] = "diloco"
    inner_steps: int = pydantic.Field(50, ge=1, le=1_000_000,
                                      description="Local steps per peer between swarm steps.")
    outer_lr: float = pydantic.Field(0.7, gt=0, le=10, description="Outer learning rate.")
    outer_momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum, in [0, 1).")
    overlap: Overlap = pydantic.Field(
        "auto", description="Auto, on or off: a round travels while the next local steps run, its outer "
        "step applied when it is back (peer/overlap.py); auto does so where the measured rounds and local steps "
        "take comparable times (--overlap-share).")
    joiner_moments: Literal["download", "fresh"] = pydantic.Field(
        "download", description="A joiner that has no inner optimizer state yet downloads the donors' (download) "
        "or starts its own afresh (fresh): the inner optimizer's state is each peer's own, and Adam's moments are "
        "8 of a joiner's 16 bytes per parameter, so a download takes half as long.")

    def make_policy(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: ProgressCounter,
                    synchronous: bool) -> DiLoCoPolicy:
        return DiLoCoPolicy(self, model, optimizer, progress, synchronous=synchronous)


class DiLoCoPolicy(Policy):
    """The pseudo-gradient is written straight into the flat contribution (one pass), averaged from
    there, and the outer step reads the average where it landed: no other copy of it is made."""

    name = "diloco"
    averages = "delta"

    def __init__(self, settings: DiLoCo, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.fresh_optimizer_on_join = settings.joiner_moments == "fresh"
        self.start = self.layout.zeros()
        self.copy_params_into(self.start)
        self.momentum = self.layout.zeros()
        self._launched = False  # a round in flight (overlap.py): the contribution is what it sent
        # what a round in flight sent, as bfloat16, where the averager reads contributions (``launch``)
        self._sent: torch.Tensor | None = None
        self._filled = False  # the contribution buffer holds this epoch's pseudo-gradient
        self._offsets = [0, *itertools.accumulate(self.layout.numels)]  # where each parameter starts, flat

    def _new_contribution(self) -> torch.Tensor:
        """Never zeroed: ``prepare`` writes all of it before anything reads it, and a round in turn reads
        none of it (``prepare_round`` lets it go). Zeroed, its pages were touched when the peer started:
        start, momentum and it, 12 bytes a parameter before the first round, the peak of every
        big_model run in the lab (16.0-16.7 bytes a parameter at 201M, against 11-11.7 steady)."""
        import torch

        return torch.empty(self.layout.total, dtype=torch.float32)

    def weight_cap(self, batch_size: int | None) -> float | None:
        return None if batch_size is None else WEIGHT_SLACK * self.settings.inner_steps * batch_size

    def after_backward(self, batch_size: int) -> bool:
        return self.inner_step(batch_size) and self.epoch_due(steps=self.settings.inner_steps)

    @no_grad
    def prepare(self) -> None:
        import torch

        self.claim_contribution()
        start, delta = self.start, self.contribution

        def pseudo_gradient(offset: int, params: torch.Tensor) -> None:
            end = offset + len(params)
            torch.sub(start[offset:end], params, out=delta[offset:end])

        self.boundary.read(self.params, pseudo_gradient)  # formed on the host, from each piece as it arrives
        self._filled = True

    @no_grad
    def prepare_round(self) -> None:
        """A round run in turn reads its pseudo-gradient a chunk at a time (``contribution_reader``:
        the parameters do not move meanwhile), so no buffer holds it: 4 bytes per parameter less at
        the round's peak. One pass checks the parameters are finite first (the start is: it is the
        swarm's); where they are not, it is formed in full and the averager refuses to send it, as it
        would have. Each chunk read is checked again (``_read_contribution``: a difference can overflow)."""
        if not self.read_contributions:
            self.prepare()
            return
        from swarmgrad.averaging.codecs.base import all_finite

        self.release_contribution()  # the first round's too (the buffer is made with the policy)
        finite = True

        def check(offset: int, params: torch.Tensor) -> None:
            nonlocal finite
            finite = finite and all_finite(params)  # one reduction, no temporary

        self.boundary.read(self.params, check)
        if not finite:
            self.prepare()

    def contribution_reader(self) -> Callable[[int, int], torch.Tensor] | None:
        if self._sent is not None:
            return self._read_sent
        return self._read_contribution if self.read_contributions and not self._filled else None

    def _read_sent(self, offset: int, length: int) -> torch.Tensor:
        """What the round in flight sends over ``[offset, offset + length)``: the same at every attempt."""
        from swarmgrad.averaging.codecs.base import all_finite

        assert self._sent is not None
        values = self._sent[offset : offset + length].float()
        if not all_finite(values):
            raise ValueError(f"the pseudo-gradient holds NaN or Inf in [{offset}, {offset + length}); not sending it")
        return values

    @no_grad
    def _read_contribution(self, offset: int, length: int) -> torch.Tensor:
        """start - parameters over ``[offset, offset + length)`` (a chunk: part of one parameter, or
        several small ones). Once the round became a flight (``launch`` during its all-reduce, which
        read this way from its start) the parameters have taken the provisional step: what was
        sent is read from the flight's copy, taken before they moved."""
        import torch

        from swarmgrad.averaging.codecs.base import all_finite

        if self._sent is not None:
            return self._read_sent(offset, length)
        values = torch.empty(length, dtype=torch.float32)
        at, index = offset, bisect.bisect_right(self._offsets, offset) - 1
        while at < offset + length:
            within = at - self._offsets[index]
            span = min(offset + length - at, self.layout.numels[index] - within)
            torch.sub(self.start[at : at + span], self.boundary.read_span(self.params[index], within, span),
                      out=values[at - offset : at - offset + span])
            at, index = at + span, index + 1
        if not all_finite(values):  # finite parameters, but a difference past float32's range
            raise ValueError(f"the pseudo-gradient holds NaN or Inf in [{offset}, {offset + length}); not sending it")
        return values

    def release_contribution(self) -> None:
        super().release_contribution()
        self._filled = False

    @no_grad
    def apply(self, average: Average) -> None:
        """start <- start - lr * (delta + mu * m), m <- mu * m + delta (torch SGD's Nesterov form), a
        piece of the average at a time (a round's frames are decoded one by one: base.py ``pieces``)."""
        import torch

        self.outer_step_begins(self._undoable(average))
        lr, mu = self.settings.outer_lr, self.settings.outer_momentum
        for offset, mean in pieces(average):
            end = offset + len(mean)
            start, momentum = self.start[offset:end], self.momentum[offset:end]
            torch.add(mean, momentum, alpha=mu, out=momentum)
            start.add_(mean, alpha=-lr).add_(momentum, alpha=-lr * mu)
        self.copy_into_params(self.start)
        self.release_contribution()  # between rounds a DiLoCo peer holds start and momentum only

    @no_grad
    def apply_keeping_progress(self, average: Average) -> bool:
        """The outer step on ``average``, the local progress since the last one kept on top: each piece
        of the parameters gets the start's step added (4 bytes per parameter up, never read back, no
        model-sized buffer)."""
        import torch

        self.outer_step_begins()
        lr, mu = self.settings.outer_lr, self.settings.outer_momentum

        def step(offset: int, numel: int) -> torch.Tensor:
            end = offset + numel
            start, momentum, mean = self.start[offset:end], self.momentum[offset:end], average[offset:end]
            torch.add(mean, momentum, alpha=mu, out=momentum)  # as ``apply``: m <- mu m + avg
            moved = (mean + momentum * mu).mul_(-lr)  # start <- start - lr (avg + mu m)
            start.add_(moved)
            return moved

        self.boundary.write(self.params, step, add=True)
        self.release_contribution()
        return True

    def held_bytes(self) -> dict[str, int]:
        return {**super().held_bytes(), "outer_start": nbytes(self.start), "outer_momentum": nbytes(self.momentum),
                "flight": nbytes(self._sent) if self._sent is not None else 0}

    def average_in_place(self) -> bool:
        return not self._launched  # a round in flight resends what it sent, and lands on it if alone

    def _undoable(self, average: Average) -> OuterStep | None:
        """The outer step on ``average`` as a download of the state from before it can read past it
        (no copies of start and momentum kept for it): where the average is held as its frames,
        which stay as they are; a float32 average may be a buffer the next round reuses."""
        if not hasattr(average, "pieces"):
            return None
        return OuterStep(self.start, self.momentum, average, self.settings.outer_lr, self.settings.outer_momentum)

    def leave_outer_state(self) -> None:
        self.start, self.momentum = self.start.clone(), self.momentum.clone()

    @no_grad
    def reset_outer_state(self) -> None:
        self.copy_params_into(self.start)
        self.momentum.zero_()

    def outer_params(self) -> list[torch.Tensor]:
        return self.layout.views(self.start)

    @property
    def overlap_steps(self) -> int:
        return self.settings.inner_steps

    def _provisional(self, start: torch.Tensor, momentum: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """Where an outer step on ``sent`` alone would put ``start``: start - lr (sent + mu (mu m + sent))."""
        lr, mu = self.settings.outer_lr, self.settings.outer_momentum
        return start - (lr * (1 + mu)) * sent - (lr * mu * mu) * momentum

    def _slices(self, offset: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One piece (as the device boundary cuts them) of start, momentum and what the flight sent."""
        end = offset + numel
        sent = self._sent[offset:end].float() if self._sent is not None else self.contribution[offset:end]
        return self.start[offset:end], self.momentum[offset:end], sent

    @no_grad
    def launch(self, refill: bool = True) -> torch.Tensor:
        """Eager (arXiv 2502.12996): the parameters take the outer step on this peer's own
        pseudo-gradient at once, standing in for the swarm's until the round lands, so the next inner
        phase starts near where the swarm's step will put it. Start and momentum stay as they were
        (and the state served from them with them), and what was sent stays as it is until the
        round lands: no copy of any of the three. Returns what was sent. ``refill=False``:
        the contribution already holds this epoch's pseudo-gradient (a round in turn, already being
        sent, becomes a flight; the parameters have not moved since).

        Where the averager reads contributions where they live (``read_contributions``: a lossy codec, no
        privacy), what the flight sends is kept as bfloat16 instead of the float32 contribution (2 bytes
        a parameter for the whole flight, not 4: DESIGN's 16 at a round's peak), and the provisional
        step, the landing and a withdrawal all read those same values: the averager's codec rounds far
        coarser than bfloat16 does, and its error feedback carries what rounding lost."""
        from swarmgrad.averaging.codecs.base import all_finite

        if self.read_contributions and not self._filled:
            self._sent = self._pseudo_gradient_bf16()
            self.release_contribution()
            if not all_finite(self._sent):  # filled instead: the averager refuses to send it, as in turn
                self._sent = None
                self.prepare()
        elif refill or not self._filled:  # a round in turn that read its contribution lazily: formed now
            self.prepare()
        self.boundary.write(self.params, lambda offset, numel: self._provisional(*self._slices(offset, numel)))
        self._launched = True
        return self._sent if self._sent is not None else self.contribution

    def _pseudo_gradient_bf16(self) -> torch.Tensor:
        """start - parameters, as bfloat16, formed a piece at a time (no float32 buffer of it)."""
        import torch

        sent = torch.empty(self.layout.total, dtype=torch.bfloat16)

        def piece(offset: int, params: torch.Tensor) -> None:
            end = offset + len(params)
            sent[offset:end].copy_(self.start[offset:end] - params)

        self.boundary.read(self.params, piece)
        return sent

    @no_grad
    def land(self, average: Average) -> None:
        """The outer step on the swarm's ``average`` in place of the provisional one, keeping the
        progress made since the launch on top: each piece of the parameters gets the new start less
        the provisional one added, so they are never read back and no model-sized buffer is made."""
        self._check_launched()
        self.outer_step_begins(self._undoable(average))  # start and momentum step as ``apply``'s do
        lr, mu = self.settings.outer_lr, self.settings.outer_momentum

        def correction(offset: int, numel: int) -> torch.Tensor:
            """The new start less the provisional one, for one piece; start and momentum step meanwhile."""
            start, momentum, sent = self._slices(offset, numel)
            mean = average[offset:offset + numel]
            provisional = self._provisional(start, momentum, sent)
            momentum.mul_(mu).add_(mean)
            start.add_(mean, alpha=-lr).add_(momentum, alpha=-lr * mu)
            return start - provisional

        self.boundary.write(self.params, correction, add=True)  # the parameters are never read back
        self._landed()

    @no_grad
    def withdraw(self) -> None:
        """The launch never happened: the parameters where they were sent from plus the progress made
        since (start and momentum never moved)."""
        self._check_launched()

        def back(offset: int, numel: int) -> torch.Tensor:
            start, momentum, sent = self._slices(offset, numel)
            return (start - sent) - self._provisional(start, momentum, sent)

        self.boundary.write(self.params, back, add=True)
        self._landed()

    def _landed(self) -> None:
        """The flight is over: what it sent is no longer needed."""
        self._sent = None
        self.release_contribution()

    def _check_launched(self) -> None:
        if not self._launched:
            raise RuntimeError("no round was launched")
        self._launched = False

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # the served state's parameters are start's views (outer_params): only momentum is extra
        return {f"momentum/{i}": m for i, m in enumerate(self.layout.views(self.momentum))}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.copy_params_into(self.start)  # the state's parameters are the new start


class OuterStep:
    """One outer step (``apply``, ``land``) on an average held as its frames, undone on reading (state/served.py
    ``OuterStep``): with m' = mu m + avg and start' = start - lr (avg + mu m'), what start and momentum
    held before is start' + lr (avg + mu m') and (m' - avg) / mu, a piece at a time, from the live
    tensors and the frames (which the state server keeps anyway, for replays). Float rounding leaves
    it within a few ulps of the bytes it had: donors are compared up to a tolerance (state/sketch.py).
    With mu = 0 the momentum before is not needed by anyone (the next step overwrites it) and reads
    as it is now."""

    def __init__(self, start: torch.Tensor, momentum: torch.Tensor, average: Average, lr: float, mu: float):
        self.start, self.momentum = start, momentum  # the tensors this step changes
        self.average, self.lr, self.mu = average, lr, mu

    def _located(self, tensor: torch.Tensor) -> tuple[bool, int] | None:
        """(in start, flat offset) of a view of the start or the momentum this step changes."""
        for is_start, flat in ((True, self.start), (False, self.momentum)):
            if tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                return is_start, tensor.storage_offset() - flat.storage_offset()
        return None

    def covers(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.start.dtype and self._located(tensor) is not None

    @no_grad
    def before(self, piece: torch.Tensor, steps: Sequence[OuterStep]) -> torch.Tensor:  # type: ignore[override]
        located = self._located(piece)
        if located is None or any(step.start is not self.start or step.momentum is not self.momentum
                                  for step in steps):
            raise ValueError("not a view of the tensors these outer steps changed")
        is_start, offset = located
        end = offset + piece.numel()
        start = self.start[offset:end].clone() if is_start else None
        momentum = self.momentum[offset:end].clone()
        for step in reversed(steps):
            mean = step.average[offset:end]
            if start is not None:
                start.add_(mean, alpha=step.lr).add_(momentum, alpha=step.lr * step.mu)
            if step.mu:
                momentum.sub_(mean).div_(step.mu)
        return (start if start is not None else momentum).reshape(piece.shape)
