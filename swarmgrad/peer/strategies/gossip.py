"""Local SGD with parameter averaging every ``every`` steps: by push-sum gossip (no barrier,
Stochastic Gradient Push, arXiv 1811.10792) or by moshpit rounds (Moshpit SGD, arXiv 2103.03239)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from swarmgrad.peer.strategies.base import WEIGHT_SLACK, Policy, ProgressCounter, StrategySettings, no_grad
from swarmgrad.settings import flag

if TYPE_CHECKING:
    import torch


class GossipSGD(StrategySettings):
    """Local steps; every ``every`` steps the parameters are averaged (gossip or moshpit)."""

    averagings: ClassVar[tuple[str, ...]] = ("gossip", "moshpit")

    name: Literal["gossip"] = "gossip"
    every: int = pydantic.Field(4, ge=1, le=1_000_000,
                                description="Local steps between parameter averaging.",
                                json_schema_extra=flag("gossip-every"))

    def make_policy(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: ProgressCounter,
                    synchronous: bool) -> GossipPolicy:
        return GossipPolicy(self, model, optimizer, progress, synchronous=synchronous)


class GossipPolicy(Policy):
    """Every step is a local optimizer step; every ``every`` steps the parameters are averaged.
    With gossip averaging there are no shared epochs (``synchronous`` is False)."""

    name = "gossip"
    averages = "params"

    def __init__(self, settings: GossipSGD, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self._since = 0

    def weight_cap(self, batch_size: int | None) -> float | None:
        # moshpit rounds of parameters, every `every` steps (gossip weighs pushes by push-sum mass instead)
        return None if batch_size is None else WEIGHT_SLACK * self.settings.every * batch_size

    def after_backward(self, batch_size: int) -> bool:
        if not self.inner_step(batch_size):
            return False
        self._since += 1
        if not self.synchronous:
            return self._since >= self.settings.every
        return self.epoch_due(steps=self.settings.every)

    def prepare(self) -> None:
        self._since = 0
        self.copy_params_into(self.contribution)

    @no_grad
    def apply(self, average: torch.Tensor) -> None:
        self.copy_into_params(average)

    def solo(self) -> None:
        """Alone, the parameters are already the average: nothing to do."""
