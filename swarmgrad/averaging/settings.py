"""How a run's peers average: moshpit groups or push-sum gossip, and with which codec.

These are run-level settings (every peer of a run must share them: they are part of the round key)
and the only place their defaults are written.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import pydantic

from swarmgrad.averaging.rules import RULE_NAMES, get_rule
from swarmgrad.errors import ConfigError
from swarmgrad.settings import SettingsModel, flag

# The most members a group may have: group_size, an invitation and a group plan all read this one bound.
MAX_GROUP = 1024
DEFAULT_COMPRESSION = "int8"  # ~4x smaller than fp32 at a tiny error, with error feedback where lossy
# how contributions are combined (averaging/rules/). Any peer of a public run may lie, so the default
# bounds what one contribution can do; with gossip it is clipped gossip (one push moves a peer by at most τ)
DEFAULT_AGGREGATOR = "centered-clip"


class Moshpit(SettingsModel):
    """Rounds of group all-reduce, regrouping every round (the peers of a round meet in groups of
    ``group_size``; with fewer peers than that, everyone meets in one group)."""

    kind: Literal["moshpit"] = "moshpit"
    group_size: Annotated[int, pydantic.Field(ge=2, le=MAX_GROUP)] = pydantic.Field(16, description="Peers per group.")
    min_group_size: Annotated[int, pydantic.Field(ge=2, le=MAX_GROUP)] = pydantic.Field(
        2, description="Fewest peers a group averages with.")
    matchmaking_seconds: Annotated[float, pydantic.Field(ge=0.05, le=600)] = pydantic.Field(
        2.0, description="Seconds a round's matchmaking waits for peers to declare themselves.")
    round_timeout: Optional[Annotated[float, pydantic.Field(ge=1, le=3600)]] = pydantic.Field(
        None, description="Seconds a round may take (default: its bytes at the rate rounds measured).")

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


class Aggregation(SettingsModel):
    """How a part's owner combines the contributions it received: the ``rule`` (averaging/rules/; a
    group's members all use the same, so it is part of the round) and the most weight one contribution
    may claim (``weight_cap``, None: no cap; a peer derives it from the run's settings)."""

    rule: str = DEFAULT_AGGREGATOR
    weight_cap: Optional[Annotated[float, pydantic.Field(gt=0)]] = None

    @pydantic.field_validator("rule")
    @classmethod
    def _check_rule(cls, value: str) -> str:
        return check_aggregator(value)


def check_aggregator(name: str, averaging: str = "moshpit") -> str:
    """An aggregation rule's name (averaging/rules/), validated for ``averaging`` (moshpit or gossip:
    there the rule needs a gossip form), as one ConfigError."""
    allowed = _gossip_rules() if averaging == "gossip" else RULE_NAMES
    if name not in allowed:
        why = " (it needs a group: gossip has none)" if name in RULE_NAMES else ""
        raise ConfigError(f"aggregator must be one of {', '.join(allowed)} for {averaging} averaging, "
                          f"got {name!r}{why}")
    return name


def _gossip_rules() -> tuple[str, ...]:
    # torch: only when a gossip run's rule is checked
    return tuple(name for name in RULE_NAMES if get_rule(name).gossip() is not None)


def check_codec(spec: str) -> str:
    """A codec spec ("name" or "name:parameter"; the codecs are averaging/codecs/'s CODEC_NAMES), validated."""
    from swarmgrad.averaging.codecs import get_codec  # torch: only when a spec is checked

    try:
        get_codec(spec)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return spec
