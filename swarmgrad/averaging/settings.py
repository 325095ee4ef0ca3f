"""How a run's peers average: moshpit groups or push-sum gossip, and with which codec.

These are run-level settings (every peer of a run must share them: they are part of the round key)
and the only place their defaults are written.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union, get_args

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.settings import SettingsModel, flag

DEFAULT_COMPRESSION = "int8"  # ~4x smaller than fp32 at a tiny error, with error feedback where lossy
# how a part's owner combines the contributions it received (robust.py has the rules). Any peer of a
# public run may lie, so the default bounds what one contribution can do; gossip's counterpart of
# centered-clip is clipped gossip (one push moves a peer by at most τ), and it has no trimmed mean.
Aggregator = Literal["mean", "centered-clip", "trimmed-mean"]
AGGREGATORS: tuple[str, ...] = get_args(Aggregator)
DEFAULT_AGGREGATOR: Aggregator = "centered-clip"
GOSSIP_AGGREGATORS = ("mean", "centered-clip")


class Moshpit(SettingsModel):
    """Rounds of group all-reduce, regrouping every round (the peers of a round meet in groups of
    ``group_size``; with fewer peers than that, everyone meets in one group)."""

    kind: Literal["moshpit"] = "moshpit"
    group_size: Annotated[int, pydantic.Field(ge=2, le=1024)] = pydantic.Field(16, description="Peers per group.")
    min_group_size: Annotated[int, pydantic.Field(ge=2, le=1024)] = pydantic.Field(
        2, description="Fewest peers a group averages with.")
    matchmaking_seconds: Annotated[float, pydantic.Field(ge=0.05, le=600)] = pydantic.Field(
        2.0, description="Seconds a round's matchmaking waits for peers to declare themselves.")
    round_timeout: Optional[Annotated[float, pydantic.Field(ge=1, le=3600)]] = pydantic.Field(
        None, description="Seconds a round may take (default: from the measured rounds).")

    @pydantic.model_validator(mode="after")
    def _check(self) -> Moshpit:
        if self.min_group_size > self.group_size:
            raise ConfigError(f"moshpit: need min_group_size <= group_size, got {self.min_group_size} and "
                              f"{self.group_size}")
        return self


class Gossip(SettingsModel):
    """Asynchronous push-sum gossip: no rounds, no barrier; each push goes to ``fanout`` peers."""

    kind: Literal["gossip"] = "gossip"
    fanout: Annotated[int, pydantic.Field(ge=1, le=16)] = pydantic.Field(
        1, description="Peers each push goes to.", json_schema_extra=flag("gossip-fanout"))
    push_timeout: Annotated[float, pydantic.Field(ge=1, le=600)] = pydantic.Field(
        30.0, description="Seconds one push may take.", json_schema_extra=flag("gossip-push-timeout"))


Averaging = Annotated[Union[Moshpit, Gossip], pydantic.Field(discriminator="kind")]


def check_aggregator(name: str, averaging: str = "moshpit") -> str:
    """An aggregator name, validated for ``averaging`` (moshpit or gossip), as one ConfigError."""
    allowed = GOSSIP_AGGREGATORS if averaging == "gossip" else AGGREGATORS
    if name not in allowed:
        why = " (gossip has no group to trim: centered-clip is clipped gossip there)" if name in AGGREGATORS else ""
        raise ConfigError(f"aggregator must be one of {', '.join(allowed)} for {averaging} averaging, got {name!r}{why}")
    return name


def check_codec(spec: str) -> str:
    """A codec spec (none, fp16, bf16, int8[:block], q4[:block], q2[:block], topk[:fraction],
    sparse[:fraction[:bits]], powersgd[:rank]), validated."""
    from swarmgrad.averaging.codecs import get_codec  # torch: only when a spec is checked

    try:
        get_codec(spec)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return spec
