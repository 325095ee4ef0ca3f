"""Training strategies as policies (one class per aggregation policy), built from their settings."""

from __future__ import annotations

import torch

from swarmgrad.peer.config import DiLoCo, GossipSGD, RunConfig, SyncSGD
from swarmgrad.peer.strategies.base import FlatLayout, Policy, ProgressCounter
from swarmgrad.peer.strategies.diloco import DiLoCoPolicy
from swarmgrad.peer.strategies.gossip import GossipPolicy
from swarmgrad.peer.strategies.sync import SyncPolicy

POLICIES: dict[type, type[Policy]] = {DiLoCo: DiLoCoPolicy, SyncSGD: SyncPolicy, GossipSGD: GossipPolicy}


def make_policy(config: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                progress: ProgressCounter) -> Policy:
    """The policy of ``config.strategy``; gossip averaging makes it asynchronous (no shared epochs)."""
    synchronous = config.averaging.kind != "gossip"
    return POLICIES[type(config.strategy)](config.strategy, model, optimizer, progress, synchronous=synchronous)


__all__ = ["POLICIES", "DiLoCoPolicy", "FlatLayout", "GossipPolicy", "Policy", "ProgressCounter", "SyncPolicy",
           "make_policy"]
