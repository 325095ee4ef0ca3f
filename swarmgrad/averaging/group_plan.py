"""The plan a group agrees on before exchanging tensors (matchmaking.py, invitations.py), and its wire
form: what every member's all-reduce (allreduce.py) runs on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarmgrad.averaging.rules import RULE_NAMES
from swarmgrad.averaging.settings import MAX_GROUP
from swarmgrad.net.wire import FrameError
from swarmgrad.net.wire import field as frame_field


@dataclass(frozen=True)
class GroupPlan:
    """What a group agreed on before exchanging tensors; identical on every member."""

    round_id: str
    members: tuple[str, ...]  # peer ids, in part order
    shares: tuple[float, ...]  # bandwidth share of each member (0: owns no part)
    codec: str  # codec spec, e.g. "int8"
    schema_digest: str
    aggregator: str = "mean"  # the rule owners combine contributions by (averaging/rules/); every member uses it

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round_id, "members": list(self.members), "shares": list(self.shares),
                "codec": self.codec, "schema": self.schema_digest, "aggregator": self.aggregator}

    @classmethod
    def from_wire(cls, data: Any) -> GroupPlan:
        if not isinstance(data, dict):
            raise FrameError("group plan must be a map")
        members = frame_field(data, "members", list)
        shares = frame_field(data, "shares", list)
        if not 1 <= len(members) <= MAX_GROUP or len(shares) != len(members) or len(set(members)) != len(members):
            raise FrameError("group plan has a bad member list")
        if not all(isinstance(m, str) and len(m) < 100 for m in members):
            raise FrameError("group plan members must be peer ids")
        if not all(type(s) in (int, float) and math.isfinite(s) and 0 <= s <= 1e12 for s in shares) or sum(shares) <= 0:
            raise FrameError("group plan shares must be finite, non-negative and not all zero")
        aggregator = data.get("aggregator", "mean")  # a plan without one comes from a peer that only averages
        if aggregator not in RULE_NAMES:
            raise FrameError(f"group plan names an unknown aggregator {aggregator!r}")
        return cls(frame_field(data, "round", str), tuple(members), tuple(float(s) for s in shares),
                   frame_field(data, "codec", str), frame_field(data, "schema", str), aggregator)
