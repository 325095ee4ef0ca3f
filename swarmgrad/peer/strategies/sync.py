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
    ``batch_size * gradient`` accumulates where the gradients are (the device), and crosses to the
    host once per epoch, when the round divides it into this peer's mean."""

    name = "sync"
    averages = "grad"
    local_optimizer = False  # every peer steps the same optimizer with the swarm's gradient

    def __init__(self, settings: SyncSGD, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self._sums: list[torch.Tensor] | None = None  # on the parameters' device, made on the first step

    def weight_cap(self, batch_size: int | None) -> float | None:
        # one peer's epoch holds at most the swarm's target (plus its last batch): no batch size needed
        return WEIGHT_SLACK * self.settings.target_batch_size

    @no_grad
    def after_backward(self, batch_size: int) -> bool:
        import torch

        if not self.gradients_usable():
            return False
        if self._sums is None:
            self._sums = [torch.zeros_like(param, dtype=torch.float32) for param in self.params]
        for param, total in zip(self.params, self._sums):
            if param.grad is not None:
                total.add_(param.grad, alpha=batch_size)
            param.grad = None
        self.progress.add(batch_size)
        return self.epoch_due(samples=self.settings.target_batch_size)

    @no_grad
    def prepare(self) -> None:
        """This peer's mean gradient of the epoch (idempotent: the sums stay until ``apply``)."""
        contribution = self.contribution
        if self._sums is None:
            contribution.zero_()
            return
        self.boundary.read(self._sums, lambda offset, chunk: contribution[offset:offset + len(chunk)].copy_(chunk))
        samples = self.weight()
        if samples > 0:
            contribution.div_(samples)

    @no_grad
    def apply(self, average: torch.Tensor) -> None:
        import torch

        grads = [torch.empty_like(param) for param in self.params]
        self.boundary.write(grads, lambda offset, numel: average[offset:offset + numel])
        for param, grad in zip(self.params, grads):
            param.grad = grad  # the optimizer only reads it; dropped right after
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._forget_sums()

    def _forget_sums(self) -> None:
        for total in self._sums or []:
            total.zero_()
        self.contribution.zero_()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self._forget_sums()  # gradients of the old parameters are of no use now
