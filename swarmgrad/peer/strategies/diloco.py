"""DiLoCo (arXiv 2311.08105): H local steps with the inner optimizer, then average the pseudo-gradient
(start - now) across the swarm and take an outer Nesterov step from the common start."""

from __future__ import annotations

from typing import Any

import torch

from swarmgrad.averaging import Averager
from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.base import Strategy, StrategyContext, SwarmStepOutcome, cpu_buffers


class DiLoCo(Strategy):
    """``inner_steps``: local steps per peer between swarm steps, on average over the peers of an
    epoch (a fast peer takes more, a slow one fewer, and their pseudo-gradients are weighted by
    the samples behind them). The outer optimizer is SGD with Nesterov momentum, as in the paper."""

    name = "diloco"
    averagings = ("moshpit",)

    def __init__(self, inner_steps: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9):
        if not 1 <= inner_steps <= 1_000_000:
            raise ConfigError(f"diloco: inner_steps must be within 1..1000000, got {inner_steps}")
        if not 0 < outer_lr <= 10:
            raise ConfigError(f"diloco: outer_lr must be within (0, 10], got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ConfigError(f"diloco: outer_momentum must be within [0, 1), got {outer_momentum}")
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.averager: Averager | None = None

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "inner_steps": self.inner_steps, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum}

    async def open(self, ctx: StrategyContext) -> None:
        await super().open(ctx)
        self.params = ctx.params
        self.start = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.delta = cpu_buffers(self.params)
        self.momentum = cpu_buffers(self.params)
        self.averager = self.moshpit_averager({f"delta{i}": d for i, d in enumerate(self.delta)})
        await self.averager.__aenter__()

    def averagers(self) -> list[Any]:
        return [self.averager] if self.averager is not None else []

    def after_backward(self, batch_size: int) -> bool:
        self.ctx.optimizer.step()
        self.ctx.optimizer.zero_grad(set_to_none=True)
        self.ctx.tracker.add(batch_size)
        return self.epoch_due(self.ctx.tracker.local.epoch, mean_steps=self.inner_steps)

    async def swarm_step(self, epoch: int, attempt: int) -> SwarmStepOutcome:
        assert self.averager is not None
        with torch.no_grad():
            for start, param, delta in zip(self.start, self.params, self.delta):
                torch.sub(start, param.detach().to("cpu", torch.float32), out=delta)
        report = await self.moshpit_round(self.averager, self.ctx.tracker.local.samples, epoch, attempt)
        if report.ok:
            self._outer_step()
        return SwarmStepOutcome(report.ok, report)

    def solo_step(self) -> None:
        with torch.no_grad():
            for start, param, delta in zip(self.start, self.params, self.delta):
                torch.sub(start, param.detach().to("cpu", torch.float32), out=delta)
        self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> None:
        """start <- start - lr * (delta + mu * m), m <- mu * m + delta (torch SGD's Nesterov form)."""
        for start, param, delta, momentum in zip(self.start, self.params, self.delta, self.momentum):
            momentum.mul_(self.outer_momentum).add_(delta)
            start.sub_(delta.add(momentum, alpha=self.outer_momentum), alpha=self.outer_lr)
            param.copy_(start)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # snapshots are taken right after an outer step, when start == params: only momentum is extra
        return {f"momentum/{i}": m for i, m in enumerate(self.momentum)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        with torch.no_grad():
            for start, param in zip(self.start, self.params):  # the state's parameters are the new start
                start.copy_(param.detach())
