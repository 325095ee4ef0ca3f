"""Fakes shared by the peer-layer unit tests: small models, strategies opened without a network."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from swarmgrad.peer.progress import LocalProgress, PeerProgress, SwarmProgress
from swarmgrad.peer.strategies import DiLoCo, GossipSGD, SyncSGD
from swarmgrad.peer.strategies.base import cpu_buffers

# ---- fakes ------------------------------------------------------------------------------------------


class FakeTracker:
    """What strategies use of a ProgressTracker: ``add``, ``local`` and ``fresh()``."""

    def __init__(self, others: tuple[PeerProgress, ...] = ()):
        self.local = LocalProgress()
        self.others = others

    def add(self, samples: int) -> None:
        self.local.add(samples)

    def fresh(self) -> SwarmProgress:
        me = PeerProgress("me", self.local.epoch, float(self.local.samples), float(self.local.steps), 0.0,
                          self.local.averaging)
        return SwarmProgress((me, *self.others), taken_at=time.monotonic())


class FakeAverager:
    """Records what a moshpit round would average; ``ok`` says whether the round succeeds."""

    def __init__(self, tensors: list[torch.Tensor], ok: bool = True):
        self.tensors, self.ok = tensors, ok
        self.calls: list[dict] = []

    async def step(self, weight: float, round_index: int, expected_peers: int, attempt: int):
        self.calls.append({"weight": weight, "round": round_index, "attempt": attempt,
                           "values": [t.clone() for t in self.tensors]})
        return SimpleNamespace(ok=self.ok)


def model_and_optimizer(seed: int = 0, lr: float = 0.1, kind: str = "sgd"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    if kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer


def attach(strategy, model, optimizer, tracker=None):
    """What ``open()`` sets, without a node or an averager."""
    strategy.ctx = SimpleNamespace(model=model, optimizer=optimizer, tracker=tracker or FakeTracker())
    strategy.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if isinstance(strategy, DiLoCo):
        strategy.start = [p.detach().to("cpu", torch.float32, copy=True) for p in strategy.params]
        strategy.delta = cpu_buffers(strategy.params)
        strategy.momentum = cpu_buffers(strategy.params)
    elif isinstance(strategy, SyncSGD):
        strategy.accumulated = cpu_buffers(strategy.params)
    elif isinstance(strategy, GossipSGD):
        strategy.values = cpu_buffers(strategy.params)
    return strategy


def set_grads(params, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return grads


def train_steps(model, optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


