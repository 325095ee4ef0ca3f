"""Local SGD with parameter averaging every ``every`` steps: by push-sum gossip (no barrier,
Stochastic Gradient Push, arXiv 1811.10792) or by moshpit rounds (Moshpit SGD, arXiv 2103.03239)."""

from __future__ import annotations

from typing import Any

import torch

from swarmgrad.averaging import Averager, GossipAverager
from swarmgrad.errors import ConfigError
from swarmgrad.peer.settings import Gossip
from swarmgrad.peer.strategies.base import Strategy, StrategyContext, SwarmStepOutcome, cpu_buffers


class GossipSGD(Strategy):
    """Every step is a local optimizer step; every ``every`` steps the parameters are averaged."""

    name = "gossip"
    averagings = ("gossip", "moshpit")

    def __init__(self, every: int = 4):
        if not 1 <= every <= 1_000_000:
            raise ConfigError(f"gossip: every must be within 1..1000000, got {every}")
        self.every = every
        self.gossip: GossipAverager | None = None
        self.moshpit: Averager | None = None
        self._since = 0

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "every": self.every}

    @property
    def synchronous(self) -> bool:  # type: ignore[override]
        return self.moshpit is not None  # gossip has no shared epochs; moshpit rounds do

    async def open(self, ctx: StrategyContext) -> None:
        await super().open(ctx)
        self.params = ctx.params
        self.values = cpu_buffers(self.params)  # what the averaging layer reads and writes
        named = {f"param{i}": v for i, v in enumerate(self.values)}
        if isinstance(ctx.averaging, Gossip):
            self.gossip = GossipAverager(ctx.node, ctx.run_id, named, weight=1.0, codec=ctx.compression,
                                         fanout=ctx.averaging.fanout, push_timeout=ctx.averaging.push_timeout,
                                         direct=ctx.direct, trusted_network=ctx.trusted_network, privacy=ctx.privacy)
            await self.gossip.__aenter__()
        else:
            self.moshpit = self.moshpit_averager(named)
            await self.moshpit.__aenter__()

    def averagers(self) -> list[Any]:
        return [a for a in (self.gossip, self.moshpit) if a is not None]

    def after_backward(self, batch_size: int) -> bool:
        self.ctx.optimizer.step()
        self.ctx.optimizer.zero_grad(set_to_none=True)
        self.ctx.tracker.add(batch_size)
        self._since += 1
        if self.gossip is not None:
            return self._since >= self.every
        return self.epoch_due(self.ctx.tracker.local.epoch, mean_steps=self.every)

    async def swarm_step(self, epoch: int, attempt: int) -> SwarmStepOutcome:
        self._since = 0
        self._copy_out()
        if self.gossip is not None:
            report = await self.gossip.step()
            self._copy_in()
            return SwarmStepOutcome(report.error is None, report)
        assert self.moshpit is not None
        moshpit_report = await self.moshpit_round(self.moshpit, self.ctx.tracker.local.samples, epoch, attempt)
        if moshpit_report.ok:
            self._copy_in()
        return SwarmStepOutcome(moshpit_report.ok, moshpit_report)

    @torch.no_grad()
    def _copy_out(self) -> None:
        for param, value in zip(self.params, self.values):
            value.copy_(param.detach())

    @torch.no_grad()
    def _copy_in(self) -> None:
        for param, value in zip(self.params, self.values):
            param.copy_(value)
