"""DiLoCo (arXiv 2311.08105): H local steps with the inner optimizer, then average the pseudo-gradient
(start - now) across the swarm and take an outer Nesterov step from the common start."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from swarmgrad.peer.strategies.base import WEIGHT_SLACK, Policy, ProgressCounter, StrategySettings, no_grad

if TYPE_CHECKING:
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
        self.start = self.layout.zeros()
        self.copy_params_into(self.start)
        self.momentum = self.layout.zeros()
        # a round in flight (overlap.py): start, momentum and the contribution from before its launch
        self._before_launch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def weight_cap(self, batch_size: int | None) -> float | None:
        return None if batch_size is None else WEIGHT_SLACK * self.settings.inner_steps * batch_size

    def after_backward(self, batch_size: int) -> bool:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.add(batch_size)
        return self.epoch_due(steps=self.settings.inner_steps)

    @no_grad
    def prepare(self) -> None:
        import torch

        for start, param, delta in zip(self.layout.views(self.start), self.params,
                                       self.layout.views(self.contribution)):
            torch.sub(start, param.detach().to("cpu", torch.float32), out=delta)

    @no_grad
    def apply(self, average: torch.Tensor) -> None:
        """start <- start - lr * (delta + mu * m), m <- mu * m + delta (torch SGD's Nesterov form)."""
        import torch

        lr, mu = self.settings.outer_lr, self.settings.outer_momentum
        torch.add(average, self.momentum, alpha=mu, out=self.momentum)
        self.start.add_(average, alpha=-lr).add_(self.momentum, alpha=-lr * mu)
        self.copy_into_params(self.start)

    @property
    def overlap_steps(self) -> int:
        return self.settings.inner_steps

    @no_grad
    def launch(self) -> torch.Tensor:
        """Eager (arXiv 2502.12996): the outer step is taken at once on this peer's own
        pseudo-gradient, standing in for the swarm's until the round lands, so the next inner phase
        starts near where the swarm's step will put it. Returns the contribution as sent."""
        self.prepare()
        sent = self.contribution.clone()
        self._before_launch = (self.start.clone(), self.momentum.clone(), sent)
        self.apply(sent)
        return sent

    @no_grad
    def land(self, average: torch.Tensor) -> Callable[[], None]:
        """The outer step on the swarm's ``average`` in place of the provisional one: the progress
        made since the launch is put aside, the step taken from the start before it (the parameters
        are then the new start, for the state joiners download), and the returned call puts that
        progress back on top."""
        progress = self._undo_launch()
        self.apply(average)

        @no_grad
        def keep_local_progress() -> None:
            for param, delta in zip(self.params, self.layout.views(progress)):
                param.add_(delta.to(param.device, param.dtype))

        return keep_local_progress

    @no_grad
    def withdraw(self) -> None:
        """The launch never happened: start and momentum as they were, the parameters where they
        were sent from plus the progress made since."""
        start, _, sent = self._before_launch
        progress = self._undo_launch()
        self.copy_into_params(progress.add_(start).sub_(sent))

    def _undo_launch(self) -> torch.Tensor:
        """Restores start and momentum from before the launch; returns params - provisional start."""
        start, momentum, _ = self._before_launch
        self._before_launch = None
        progress = self.layout.zeros()
        self.copy_params_into(progress)
        progress.sub_(self.start)
        self.start.copy_(start)
        self.momentum.copy_(momentum)
        return progress

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # snapshots are taken right after an outer step, when start == params: only momentum is extra
        return {f"momentum/{i}": m for i, m in enumerate(self.layout.views(self.momentum))}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.copy_params_into(self.start)  # the state's parameters are the new start
