"""What a training strategy is: its settings (``StrategySettings``, a section of ``RunConfig``) and
its policy. The policy says what it contributes to a round (views into one flat float32 buffer, so
the averaging layer sends it from its own memory), how it applies the swarm's average, when a swarm
step is due, and what its state is. It does no networking: the ``RoundDriver`` (driver.py) runs the
rounds.

Settings and policy of a strategy live in one module, and the settings load with ``RunConfig``
(``swarmgrad --help`` reads them): so this module and the strategy modules import torch and the
DHT (through progress.py) inside the functions that use them, never at module level.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from swarmgrad.settings import SettingsModel

if TYPE_CHECKING:
    import torch

    from swarmgrad.peer.progress import SwarmProgress

# the most samples one contribution may claim, as a multiple of what the run's settings say a peer
# trains on between two rounds: a peer faster than the others does more steps, up to this many times
WEIGHT_SLACK = 4.0

Method = TypeVar("Method", bound=Callable[..., Any])


def no_grad(method: Method) -> Method:
    """``torch.no_grad()`` as a decorator that imports torch when called, not when the class is made."""

    @functools.wraps(method)
    def without_grad(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return method(*args, **kwargs)

    return without_grad  # type: ignore[return-value]


class StrategySettings(SettingsModel):
    """A strategy's run-level settings: ``RunConfig.strategy`` is one of them, told apart by ``name``
    (a ``Literal`` field each subclass defines). Each field's ``description`` is its help text."""

    name: str
    # the averaging kinds its rounds work with (averaging/settings.py); the first is its default
    averagings: ClassVar[tuple[str, ...]]

    @abstractmethod
    def make_policy(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: ProgressCounter,
                    synchronous: bool) -> Policy:
        """This strategy's policy, bound to ``model`` and ``optimizer``."""


class ProgressCounter(Protocol):
    """What a policy reads and counts of the swarm's progress (a ProgressTracker)."""

    local: object

    def add(self, samples: int) -> None: ...

    def fresh(self) -> SwarmProgress: ...


# a round's average as a policy reads it: flat float32, or the frames it travelled in, read a slice at
# a time (``average[a:b]``; averaging/result_frames.py ``FramedAverage``)
Average = Any
PIECE_ELEMENTS = 1 << 22  # a float32 average is walked this many elements at a time


def pieces(average: Average) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset, float32 values) of an average in order: a framed one frame by frame, a tensor in slices."""
    framed = getattr(average, "pieces", None)
    if framed is not None:
        yield from framed()
        return
    for start in range(0, average.numel(), PIECE_ELEMENTS):
        yield start, average[start : start + PIECE_ELEMENTS]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class FlatLayout:
    """Parameters laid end to end in one flat float32 CPU vector; ``views`` cuts a vector back up."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [math.prod(shape) for shape in self.shapes]
        self.total = sum(self.numels)

    def zeros(self) -> torch.Tensor:
        import torch

        return torch.zeros(self.total, dtype=torch.float32)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view(shape) for part, shape in zip(flat.split(self.numels), self.shapes)]


class Policy(ABC):
    """One training strategy (as in Flower's strategy objects), bound to a model and optimizer."""

    name: ClassVar[str]
    averages: ClassVar[str]  # what its rounds average, naming its averager: delta, grad or params
    # each peer steps its own inner optimizer (its state is local, not the swarm's): a peer that
    # already has one keeps it when it takes the swarm's state, and downloads only the rest
    local_optimizer: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: ProgressCounter,
                 synchronous: bool = True):
        self.model, self.optimizer, self.progress = model, optimizer, progress
        self.synchronous = synchronous  # swarm steps are numbered epochs every peer takes together
        # a joiner without optimizer state downloads none and starts its own (DiLoCo's joiner_moments)
        self.fresh_optimizer_on_join = False
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.layout = FlatLayout(self.params)
        from swarmgrad.device.boundary import DeviceBoundary

        self.boundary = DeviceBoundary.of(self.params)  # every copy between the parameters and the host
        self.contribution = self._new_contribution()  # what a round averages; the averager reads it in place
        # called before the strategy changes what ``outer_params`` and ``state_tensors`` view: the
        # state server drops a state served from them, or keeps them for its readers and says so
        # (True: the strategy goes on with copies; state/served.py), or reads past ``step`` where given
        self.before_outer_step: Callable[[Any], bool] = lambda step=None: False
        # the averager reads a round's contribution through ``contribution_reader`` (a lossy codec, no
        # privacy; assembly.py sets it): a round run in turn then holds no copy of it (DESIGN's memory budget)
        self.read_contributions = False
        # fp16's loss scaler (``Peer(grad_scaler=...)``): gradients arrive scaled, and a step whose
        # gradients overflowed is skipped: not stepped, not counted, never sent
        self.grad_scaler: torch.amp.GradScaler | None = None

    def _new_contribution(self) -> torch.Tensor:
        """The contribution buffer, zeroed (a strategy that accumulates into it relies on that)."""
        return self.layout.zeros()

    def contribution_views(self) -> dict[str, torch.Tensor]:
        """The contribution as one named view per parameter (the averaging schema keeps their shapes)."""
        return {f"{self.averages}{i}": view for i, view in enumerate(self.layout.views(self.contribution))}

    @abstractmethod
    def after_backward(self, batch_size: int) -> bool:
        """Local work after the user's backward pass (runs in the training thread). True when a swarm step is due."""

    @no_grad
    def gradients_usable(self) -> bool:
        """Unscale the last backward's gradients (with a loss scaler) and say whether they are finite.
        False: the scaler lowers its scale and the gradients are dropped; the caller skips the step.
        Without a scaler: True, and nothing is read (no device sync)."""
        import torch

        scaler = self.grad_scaler
        if scaler is None:
            return True
        from torch.amp.grad_scaler import OptState

        # the caller may have unscaled already (to clip the true gradients): unscaling twice raises
        if scaler._per_optimizer_states[id(self.optimizer)]["stage"] is not OptState.UNSCALED:
            scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        scaler.update()  # the inf checks unscale_ recorded: a lower scale after an overflow
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
        return finite

    def inner_step(self, batch_size: int) -> bool:
        """The inner optimizer's step on the last backward's gradients, counted as ``batch_size``
        samples; False when the loss scaler found them overflowed (then nothing is stepped or counted)."""
        if not self.gradients_usable():
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.add(batch_size)
        return True

    def weight(self) -> float:
        """The samples behind this peer's contribution (architecture.md, invariant 'weights are samples, bounded')."""
        return float(self.progress.local.samples)  # type: ignore[attr-defined]

    def weight_cap(self, batch_size: int | None) -> float | None:
        """The most weight a contribution to this strategy's rounds may claim: ``WEIGHT_SLACK`` x the
        samples a peer trains on between rounds by the run's settings (``batch_size``: the run's;
        None where that number needs one and there is none). Owners cut larger claims to it."""
        return None

    @abstractmethod
    def prepare(self) -> None:
        """Fill ``contribution`` for this epoch's round (idempotent: a retried round calls it again)."""

    @abstractmethod
    def apply(self, average: Average) -> None:
        """Use the swarm's average (flat, laid out like ``contribution``)."""

    def prepare_round(self) -> None:
        """Before each attempt at a round: ``prepare``, unless the averager reads the contribution where
        it lives, a chunk at a time (``contribution_reader``)."""
        self.prepare()

    def contribution_reader(self) -> Callable[[int, int], torch.Tensor] | None:
        """``(offset, length) -> float32 values`` of this round's contribution, computed where it lives,
        while the contribution buffer is not filled (``read_contributions``); None: read ``contribution``."""
        return None

    @property
    def overlap_steps(self) -> int | None:
        """Local steps per epoch when this strategy's rounds may travel behind the next inner phase
        (overlap.py); None: its rounds run in turn."""
        return None

    def held_bytes(self) -> dict[str, int]:
        """Host bytes this strategy holds beyond the model and its optimizer, by what they are for."""
        return {"contribution": self.contribution.untyped_storage().nbytes()}

    def release_contribution(self) -> None:
        """Nothing reads the contribution until the next round: give its memory back. Its views (the
        averager's included) stay valid, and ``claim_contribution`` gives them memory again. (Never
        call ``.numpy()`` on it: torch then keeps its storage for good; averaging/frames.py ``byte_view``.)"""
        self.contribution.untyped_storage().resize_(0)

    def claim_contribution(self) -> None:
        storage = self.contribution.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.total * self.contribution.element_size())

    def average_in_place(self) -> bool:
        """Whether a round's average may land in the contribution itself (nothing reads the
        contribution after it is sent, and a retry fills it again)."""
        return False

    def outer_step_begins(self, step: Any = None) -> None:
        """Before changing what ``outer_params`` and ``state_tensors`` view: where a reader keeps those
        tensors (a download, a checkpoint), continue on copies of them. ``step``: the change, where
        a reader can read past it (state/served.py ``OuterStep``): then nobody copies."""
        if self.before_outer_step(step):
            self.leave_outer_state()

    def leave_outer_state(self) -> None:
        """Replace the tensors ``outer_params`` and ``state_tensors`` view with copies (none here)."""

    def reset_outer_state(self) -> None:
        """Start the outer state afresh from the parameters, as a new peer does: after a download that
        wrote ``outer_params`` and ``state_tensors`` in place failed half way (none here)."""

    def outer_params(self) -> list[torch.Tensor] | None:
        """Views, in ``params`` order, of the parameters as the swarm's latest step left them, which
        the strategy keeps unchanged until its next one (DiLoCo's start): the state is served from
        them. None: the parameters themselves are the swarm's, and a served state copies them."""
        return None

    def apply_keeping_progress(self, average: Average) -> bool:
        """``apply`` a round this peer missed (catch_up.py replays it) and put the local progress made
        since the swarm's last step back on top, as overlap's ``land`` does: a late peer's work is
        sent in its next round instead of being overwritten. True when there was such progress to
        keep (a strategy that keeps the swarm's parameters apart: DiLoCo); here, none."""
        self.apply(average)
        return False

    # a round that travels while training goes on (peer/overlap.py; only where ``overlap_steps``):
    # ``launch`` fills the contribution and returns it as sent (it stays so until the round ends),
    # then exactly one of ``land`` (with the swarm's average; the progress made meanwhile stays on
    # top) or ``withdraw`` (the round is dropped: as if it had never been sent)
    def launch(self, refill: bool = True) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} rounds do not overlap training")

    def land(self, average: Average) -> None:
        raise NotImplementedError(f"{self.name} rounds do not overlap training")

    def withdraw(self) -> None:
        raise NotImplementedError(f"{self.name} rounds do not overlap training")

    def solo(self) -> None:
        """Finish the epoch without the swarm (nobody else is training), from local values only."""
        self.prepare()
        self.apply(self.contribution)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def expected_state(self) -> dict[str, torch.Tensor]:
        """The tensors ``load_state_tensors`` fills, by name: what a state must hold to fit."""
        return self.state_tensors()

    @no_grad
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a state's strategy tensors in; ``TrainingState`` has checked them against ``expected_state``."""
        self.outer_step_begins()
        for name, target in self.expected_state().items():
            target.copy_(tensors[name])

    def epoch_due(self, steps: float | None = None, samples: float | None = None) -> bool:
        """Common test: the swarm moved on, half the others here started averaging, or the target was
        reached (steps or samples with each claim capped, or this peer's own steps: progress.py)."""
        from swarmgrad.peer.progress import OWN_STEPS_DUE

        epoch = self.progress.local.epoch  # type: ignore[attr-defined]
        swarm = self.progress.fresh()
        if swarm.epoch > epoch or swarm.averaging_in(epoch):
            return True
        if steps is not None and (swarm.mean_steps_in(epoch) >= steps or
                                  self.progress.local.steps >= OWN_STEPS_DUE * steps):  # type: ignore[attr-defined]
            return True
        return samples is not None and swarm.samples_in(epoch) >= samples

    @no_grad
    def copy_params_into(self, flat: torch.Tensor) -> None:
        self.boundary.read(self.params, lambda offset, chunk: flat[offset:offset + len(chunk)].copy_(chunk))

    @no_grad
    def copy_into_params(self, flat: torch.Tensor) -> None:
        self.boundary.write(self.params, lambda offset, numel: flat[offset:offset + numel])
