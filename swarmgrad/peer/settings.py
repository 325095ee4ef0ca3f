"""How a peer averages: moshpit groups or push-sum gossip. Small validated settings objects."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Union

from swarmgrad.errors import ConfigError


@dataclass(frozen=True)
class Moshpit:
    """Rounds of group all-reduce, regrouping every round (the peers of a round meet in groups of
    ``group_size``; with fewer peers than that, everyone meets in one group)."""

    group_size: int = 16
    min_group_size: int = 2
    matchmaking_seconds: float = 2.0
    round_timeout: float | None = None

    kind = "moshpit"

    def __post_init__(self) -> None:
        if not 2 <= self.min_group_size <= self.group_size <= 1024:
            raise ConfigError(f"moshpit: need 2 <= min_group_size <= group_size <= 1024, got "
                              f"{self.min_group_size} and {self.group_size}")
        if not 0.05 <= self.matchmaking_seconds <= 600:
            raise ConfigError(f"moshpit: matchmaking_seconds must be within 0.05..600, got {self.matchmaking_seconds}")
        if self.round_timeout is not None and not 1 <= self.round_timeout <= 3600:
            raise ConfigError(f"moshpit: round_timeout must be within 1..3600 s, got {self.round_timeout}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True)
class Gossip:
    """Asynchronous push-sum gossip: no rounds, no barrier; each push goes to ``fanout`` peers."""

    fanout: int = 1
    push_timeout: float = 30.0

    kind = "gossip"

    def __post_init__(self) -> None:
        if not 1 <= self.fanout <= 16:
            raise ConfigError(f"gossip: fanout must be within 1..16, got {self.fanout}")
        if not 1 <= self.push_timeout <= 600:
            raise ConfigError(f"gossip: push_timeout must be within 1..600 s, got {self.push_timeout}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


Averaging = Union[Moshpit, Gossip]


def averaging_from_dict(data: dict[str, Any]) -> Averaging:
    """The inverse of ``to_dict`` (run manifests carry it)."""
    options = {key: value for key, value in data.items() if key != "kind"}
    kinds = {"moshpit": Moshpit, "gossip": Gossip}
    if data.get("kind") not in kinds:
        raise ConfigError(f"unknown averaging {data.get('kind')!r}; choose one of {', '.join(kinds)}")
    try:
        return kinds[data["kind"]](**options)
    except TypeError as error:
        raise ConfigError(f"averaging {data['kind']}: {error}") from None
