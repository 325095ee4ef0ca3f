"""Training strategies: one class per aggregation policy."""

from __future__ import annotations

from typing import Any

from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.base import Strategy, StrategyContext, SwarmStepOutcome
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.gossip import GossipSGD
from swarmgrad.peer.strategies.sync import SyncSGD

STRATEGIES: dict[str, type[Strategy]] = {"sync": SyncSGD, "diloco": DiLoCo, "gossip": GossipSGD}


def strategy_from_dict(data: dict[str, Any]) -> Strategy:
    """The inverse of ``Strategy.config()`` (run manifests carry it)."""
    options = {key: value for key, value in data.items() if key != "name"}
    if data.get("name") not in STRATEGIES:
        raise ConfigError(f"unknown strategy {data.get('name')!r}; choose one of {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[data["name"]](**options)
    except TypeError as error:
        raise ConfigError(f"strategy {data['name']}: {error}") from None


__all__ = ["STRATEGIES", "DiLoCo", "GossipSGD", "Strategy", "StrategyContext", "SwarmStepOutcome", "SyncSGD",
           "strategy_from_dict"]
