"""Synchronous data parallelism over a swarm: accumulate gradients until the swarm together has
seen ``target_batch_size`` samples, average them (weighted by samples), and step."""

from __future__ import annotations

from typing import Any

import torch

from swarmgrad.averaging import Averager
from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.base import Strategy, StrategyContext, SwarmStepOutcome, cpu_buffers


class SyncSGD(Strategy):
    """The hivemind Optimizer idea: one optimizer step per ``target_batch_size`` samples swarm-wide."""

    name = "sync"
    averagings = ("moshpit",)
    local_optimizer = False  # every peer steps the same optimizer with the swarm's gradient

    def __init__(self, target_batch_size: int = 4096):
        if not 1 <= target_batch_size <= 10**9:
            raise ConfigError(f"sync: target_batch_size must be within 1..1e9, got {target_batch_size}")
        self.target_batch_size = target_batch_size
        self.averager: Averager | None = None
        self._is_mean = False  # accumulated holds a sum until the epoch's swarm step divides it

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "target_batch_size": self.target_batch_size}

    async def open(self, ctx: StrategyContext) -> None:
        await super().open(ctx)
        self.params = ctx.params
        self.accumulated = cpu_buffers(self.params)  # sum of batch_size * mean gradient
        self.averager = self.moshpit_averager({f"grad{i}": g for i, g in enumerate(self.accumulated)})
        await self.averager.__aenter__()

    def averagers(self) -> list[Any]:
        return [self.averager] if self.averager is not None else []

    @torch.no_grad()
    def after_backward(self, batch_size: int) -> bool:
        for param, total in zip(self.params, self.accumulated):
            if param.grad is not None:
                total.add_(param.grad.detach().to("cpu", torch.float32), alpha=batch_size)
            param.grad = None
        self.ctx.tracker.add(batch_size)
        return self.epoch_due(self.ctx.tracker.local.epoch, samples=self.target_batch_size)

    async def swarm_step(self, epoch: int, attempt: int) -> SwarmStepOutcome:
        assert self.averager is not None
        samples = self.ctx.tracker.local.samples
        self._to_mean(samples)
        report = await self.moshpit_round(self.averager, samples, epoch, attempt)
        if report.ok:
            self._apply()
        return SwarmStepOutcome(report.ok, report)

    def solo_step(self) -> None:
        self._to_mean(self.ctx.tracker.local.samples)
        self._apply()

    def _to_mean(self, samples: int) -> None:
        """From the sum of batch_size * gradient to this peer's mean gradient, once per epoch."""
        if not self._is_mean and samples > 0:
            for total in self.accumulated:
                total.div_(samples)
        self._is_mean = True

    @torch.no_grad()
    def _apply(self) -> None:
        for param, mean in zip(self.params, self.accumulated):
            param.grad = mean.to(param.device, param.dtype)
        self.ctx.optimizer.step()
        self.ctx.optimizer.zero_grad(set_to_none=True)
        for total in self.accumulated:
            total.zero_()
        self._is_mean = False

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        for total in self.accumulated:  # gradients of the old parameters are of no use now
            total.zero_()
        self._is_mean = False
