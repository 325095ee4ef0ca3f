"""Synchronous data parallelism over a swarm: accumulate gradients until the swarm together has
seen ``target_batch_size`` samples, average them (weighted by samples), and step."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from swarmgrad.peer.strategies.base import WEIGHT_SLACK, Policy, ProgressCounter, StrategySettings, no_grad

if TYPE_CHECKING:
    import torch


class SyncSGD(StrategySettings):
    """Synchronous data parallelism: one optimizer step per ``target_batch_size`` samples swarm-wide."""

    averagings: ClassVar[tuple[str, ...]] = ("moshpit",)

    name: Literal["sync"] = "sync"
    target_batch_size: int = pydantic.Field(4096, ge=1, le=10**9, description="Swarm-wide samples per step.")

    def make_policy(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: ProgressCounter,
                    synchronous: bool) -> SyncPolicy:
        return SyncPolicy(self, model, optimizer, progress, synchronous=synchronous)


class SyncPolicy(Policy):
    """The hivemind Optimizer idea: one optimizer step per ``target_batch_size`` samples swarm-wide.
    The contribution accumulates ``batch_size * gradient`` until the round divides it into a mean."""

    name = "sync"
    averages = "grad"
    local_optimizer = False  # every peer steps the same optimizer with the swarm's gradient

    def __init__(self, settings: SyncSGD, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self._is_mean = False  # the contribution holds a sum until the epoch's round divides it

    def weight_cap(self, batch_size: int | None) -> float | None:
        # one peer's epoch holds at most the swarm's target (plus its last batch): no batch size needed
        return WEIGHT_SLACK * self.settings.target_batch_size

    @no_grad
    def after_backward(self, batch_size: int) -> bool:
        import torch

        for param, total in zip(self.params, self.layout.views(self.contribution)):
            if param.grad is not None:
                total.add_(param.grad.detach().to("cpu", torch.float32), alpha=batch_size)
            param.grad = None
        self.progress.add(batch_size)
        return self.epoch_due(samples=self.settings.target_batch_size)

    def prepare(self) -> None:
        """From the sum of batch_size * gradient to this peer's mean gradient, once per epoch."""
        samples = self.weight()
        if not self._is_mean and samples > 0:
            self.contribution.div_(samples)
        self._is_mean = True

    @no_grad
    def apply(self, average: torch.Tensor) -> None:
        for param, mean in zip(self.params, self.layout.views(average)):
            param.grad = mean.to(param.device, param.dtype)  # the optimizer only reads it; dropped right after
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.contribution.zero_()
        self._is_mean = False

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.contribution.zero_()  # gradients of the old parameters are of no use now
        self._is_mean = False
