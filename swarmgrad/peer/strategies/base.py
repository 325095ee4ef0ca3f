"""What every training strategy gives the Peer: local work per batch, a swarm step when due, its state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from swarmgrad.averaging import Averager, AveragingReport, GossipReport
from swarmgrad.averaging.privacy import Privacy
from swarmgrad.dht.node import SwarmNode
from swarmgrad.errors import ConfigError
from swarmgrad.peer.progress import ProgressTracker
from swarmgrad.peer.settings import Averaging, Moshpit


@dataclass
class StrategyContext:
    """What the Peer hands a strategy when it opens."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    node: SwarmNode
    run_id: str
    tracker: ProgressTracker
    averaging: Averaging
    compression: str
    privacy: Privacy | None  # update-level privacy, applied by the averaging layer
    direct: bool = True
    trusted_network: bool = False

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]


@dataclass
class SwarmStepOutcome:
    """``applied``: the swarm's average was used. False: the round failed and nothing changed."""

    applied: bool
    report: AveragingReport | GossipReport | None = None


class Strategy(ABC):
    """One aggregation policy (as in Flower's strategy objects)."""

    name: ClassVar[str]
    averagings: ClassVar[tuple[str, ...]]  # averaging kinds this strategy works with
    synchronous: ClassVar[bool] = True  # swarm steps are numbered epochs that every peer takes together
    # each peer steps its own inner optimizer (its state is local, not the swarm's): a peer that
    # already has one keeps it when it takes the swarm's state, and downloads only the rest
    local_optimizer: ClassVar[bool] = True

    ctx: StrategyContext

    def check(self, averaging: Averaging) -> None:
        if averaging.kind not in self.averagings:
            raise ConfigError(f"strategy {self.name} does not work with {averaging.kind} averaging; "
                              f"use {' or '.join(self.averagings)}")

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Settings for the run manifest; ``strategy_from_dict`` reverses it."""

    async def open(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    async def close(self) -> None:
        """Release what ``open`` took: the averagers it entered."""
        for averager in self.averagers():
            await averager.__aexit__(None, None, None)

    @abstractmethod
    def after_backward(self, batch_size: int) -> bool:
        """Local work after the user's backward pass (runs in the training thread). True when a swarm step is due."""

    @abstractmethod
    async def swarm_step(self, epoch: int, attempt: int) -> SwarmStepOutcome:
        """Average with the swarm and apply the result; on failure change nothing."""

    def averagers(self) -> list[Any]:
        """The averagers this strategy opened (for the peer's privacy accounting)."""
        return []

    def solo_step(self) -> None:
        """Finish the epoch without the swarm (nobody else is training), from local values only."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def expected_state(self) -> dict[str, torch.Tensor]:
        """The tensors ``load_state_tensors`` fills, by name: what a state must hold to fit."""
        return self.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a state's strategy tensors in; ``TrainingState`` has checked them against ``expected_state``."""
        with torch.no_grad():
            for name, target in self.expected_state().items():
                target.copy_(tensors[name])

    def epoch_due(self, epoch: int, mean_steps: float | None = None, samples: float | None = None) -> bool:
        """Common test: the swarm moved on, somebody started averaging, or the target was reached."""
        swarm = self.ctx.tracker.fresh()
        if swarm.epoch > epoch or swarm.averaging_in(epoch):
            return True
        if mean_steps is not None and swarm.mean_steps_in(epoch) >= mean_steps:
            return True
        return samples is not None and swarm.samples_in(epoch) >= samples

    def moshpit_averager(self, tensors: dict[str, torch.Tensor]) -> Averager:
        settings = self.ctx.averaging
        assert isinstance(settings, Moshpit)
        return Averager(
            self.ctx.node, self.ctx.run_id, tensors, group_size=settings.group_size,
            min_group_size=settings.min_group_size, codec=self.ctx.compression,
            matchmaking_seconds=settings.matchmaking_seconds, round_timeout=settings.round_timeout,
            direct=self.ctx.direct, trusted_network=self.ctx.trusted_network, privacy=self.ctx.privacy,
        )

    async def moshpit_round(self, averager: Averager, weight: float, epoch: int, attempt: int) -> AveragingReport:
        # peers still finishing the previous round will be here in a moment: count them too
        swarm = self.ctx.tracker.fresh()
        expected = len(swarm.at(epoch)) + len(swarm.at(epoch - 1))
        return await averager.step(weight=max(weight, 1e-6), round_index=epoch, expected_peers=expected,
                                   attempt=attempt)


def cpu_buffers(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Float32 CPU tensors shaped like ``params``: what the averaging layer reads and writes."""
    return [torch.zeros(p.shape, dtype=torch.float32) for p in params]
