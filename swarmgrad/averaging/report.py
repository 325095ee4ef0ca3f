"""What one averaging step did, for both backends: a moshpit group round (moshpit.py) or a push-sum
gossip step (gossip.py). One type, so the peer counts rounds, traffic and suspicions the same way
whichever backend the run uses; the fields only one backend fills say which in their metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

RoundKind = Literal["moshpit", "gossip"]

MOSHPIT = {"kind": "moshpit"}
GOSSIP = {"kind": "gossip"}
_LISTS = ("group", "contributors", "transports", "pushed_to", "failed", "observed")  # too long for a summary


@dataclass
class RoundReport:
    """``ok``: moshpit, the group's average was applied; gossip, the step merged and pushed (some pushes
    may still have failed: ``failed``). A report that is not ok changed nothing but what gossip merged."""

    kind: RoundKind
    round_index: int  # moshpit: the round this step averaged for; gossip: the averager's step count
    ok: bool = False
    error: str | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    privacy: dict | None = None  # epsilon spent so far etc., when privacy is on
    # peer -> what it did wrong, each once: moshpit, what this peer saw as an owner ("weight cut",
    # "clipped"); gossip, senders whose push was clipped. Counted toward bans (net/accountability.py)
    suspicions: dict[str, list[str]] = field(default_factory=dict)
    # moshpit: whose contributions to this peer's part it aggregated (a clean round for those not
    # suspected); empty for gossip, whose pushes are too frequent to clear a score with
    observed: list[str] = field(default_factory=list)

    key: str = field(default="", metadata=MOSHPIT)  # the round's DHT key
    group: list[str] = field(default_factory=list, metadata=MOSHPIT)  # whom it met, itself included
    contributors: list[str] = field(default_factory=list, metadata=MOSHPIT)  # members whose part arrived
    allreduce_seconds: float = field(default=0.0, metadata=MOSHPIT)  # of ``seconds``: the all-reduce, not matchmaking
    transports: dict[str, str] = field(default_factory=dict, metadata=MOSHPIT)  # groupmate -> direct or libp2p
    # of this peer's contribution, the share the owners' rules left out (the average holds the rest)
    rejected_share: float = field(default=0.0, metadata=MOSHPIT)
    # the attempt the others went on to, having left this round's key (0: none); the caller follows
    retried: int = field(default=0, metadata=MOSHPIT)

    pushed_to: list[str] = field(default_factory=list, metadata=GOSSIP)  # peers that accepted our push
    failed: list[str] = field(default_factory=list, metadata=GOSSIP)  # peers we could not push to
    merged: int = field(default=0, metadata=GOSSIP)  # pushes merged into the local tensors
    clipped: int = field(default=0, metadata=GOSSIP)  # of those, pushes whose change was clipped to τ
    weight: float = field(default=0.0, metadata=GOSSIP)  # this peer's push-sum weight after the step

    @property
    def peers(self) -> list[str]:
        """The peers this step exchanged tensors with: the group, or those that took the push."""
        return self.group if self.kind == "moshpit" else self.pushed_to

    def summary(self) -> dict[str, Any]:
        """This kind's scalar fields and the number of peers met (``PeerStatus.last_report``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata.get("kind", self.kind) == self.kind and f.name not in _LISTS} | {"peers": len(self.peers)}
