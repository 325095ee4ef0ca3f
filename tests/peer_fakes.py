"""Fakes shared by the peer-layer unit tests: small models, policies bound without a network, a
fake progress tracker and a fake averaging backend for the round driver."""

from __future__ import annotations

import time

import torch

from swarmgrad.averaging.report import RoundReport
from swarmgrad.peer.backends import RoundOutcome
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.progress import LocalProgress, PeerProgress, SwarmProgress
from swarmgrad.peer.strategies.registry import make_policy

# ---- fakes ------------------------------------------------------------------------------------------


class FakeTracker:
    """What policies and the driver use of a ProgressTracker; ``others`` are the other peers."""

    def __init__(self, others: tuple[PeerProgress, ...] = (), other_settings: tuple[str, ...] = ()):
        self.local = LocalProgress()
        self.others, self.other_settings = others, other_settings
        self.averaging_set: list[bool] = []
        self.met_in_rounds: list[tuple[int, list[str]]] = []

    def add(self, samples: int) -> None:
        self.local.add(samples)

    def fresh(self) -> SwarmProgress:
        me = PeerProgress("me", self.local.epoch, float(self.local.samples), float(self.local.steps), 0.0,
                          self.local.averaging)
        return SwarmProgress((me, *self.others), taken_at=time.monotonic(), other_settings=self.other_settings)

    def ahead_of(self, epoch: int) -> list[str]:
        return self.fresh().ahead(epoch)

    def rejoin_from(self, epoch: int) -> list[str]:
        return self.fresh().rejoin(epoch)

    def others_at(self, epoch: int) -> list[str]:
        return [peer.peer_id for peer in self.others if peer.epoch == epoch]

    def met(self, epoch: int, members) -> None:
        self.met_in_rounds.append((epoch, list(members)))

    def set_averaging(self, averaging: bool) -> None:
        self.local.averaging = averaging
        self.averaging_set.append(averaging)

    def next_epoch(self, epoch: int, steps: int = 0, samples: int = 0) -> None:
        self.local.epoch, self.local.samples, self.local.steps, self.local.averaging = epoch, samples, steps, False


class FakeBackend:
    """Averaging without a network: each call takes the next of ``outcomes`` (True: the round succeeds
    and the average is ``average`` or the contribution itself; its owners left out ``rejected_share``
    of the contribution; ``retried``: attempt -> the attempt its report says the others went on to);
    records what it was asked."""

    in_turn_wait = 60.0  # its rounds end at once
    writing_in_place = False

    def __init__(self, contribution: torch.Tensor, outcomes: list[bool], average: torch.Tensor | None = None,
                 on_call=None, rejected_share: float = 0.0, retried: dict[int, int] | None = None):
        self.contribution, self.outcomes, self.fixed_average, self.on_call = contribution, list(outcomes), average, on_call
        self.rejected_share, self.retried = rejected_share, retried or {}
        self.calls: list[dict] = []

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on=lambda: False) -> RoundOutcome:
        self.calls.append({"epoch": epoch, "attempt": attempt, "weight": weight, "expected": expected_peers,
                           "values": self.contribution.clone(), "moved_on": moved_on})
        if self.on_call is not None:
            self.on_call(len(self.calls))
        ok = self.outcomes.pop(0)
        average = self.fixed_average if self.fixed_average is not None else self.contribution
        report = RoundReport("moshpit", attempt, ok=ok, rejected_share=self.rejected_share if ok else 0.0,
                             retried=0 if ok else self.retried.get(attempt, 0))
        return RoundOutcome(ok, average if ok else None, report)


def model_and_optimizer(seed: int = 0, lr: float = 0.1, kind: str = "sgd"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    if kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer


def attach(strategy, model, optimizer, tracker=None, averaging=None):
    """The policy of ``strategy`` (a DiLoCo/SyncSGD/GossipSGD setting), bound without a network."""
    config = RunConfig(strategy=strategy, **({"averaging": averaging} if averaging is not None else {}))
    return make_policy(config, model, optimizer, tracker or FakeTracker())


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
