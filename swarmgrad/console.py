"""Terminal output shared by CLI commands: member tables, JSON, one-line errors."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table

from swarmgrad.dht.membership import Member

stdout = Console()
stderr = Console(stderr=True)


def print_json(obj: Any) -> None:
    """One JSON document (or JSON line) on stdout, for scripts."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def short_id(peer_id: str) -> str:
    return f"{peer_id[:6]}…{peer_id[-6:]}" if len(peer_id) > 14 else peer_id


def ago(timestamp: float, now: float | None = None) -> str:
    seconds = max(0.0, (time.time() if now is None else now) - timestamp)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def members_table(members: Iterable[Member], title: str | None = None) -> Table:
    table = Table(title=title)
    for column in ("peer", "address", "reach", "role", "step", "samples/s", "epsilon", "last seen"):
        # on a narrow terminal the long multiaddr folds; every other cell stays whole
        table.add_column(column, justify="right" if column in ("step", "samples/s", "epsilon") else "left",
                         overflow="fold" if column == "address" else "ellipsis", no_wrap=column != "address")
    now = time.time()
    for member in members:
        table.add_row(
            short_id(member.peer_id),
            member.maddrs[0] if member.maddrs else "(client)",
            member.reachability + (" (paused)" if member.paused else ""),
            member.role,
            str(member.step),
            f"{member.samples_per_second:.1f}",
            "-" if member.epsilon is None else f"{member.epsilon:.2f}",
            ago(member.last_seen, now),
        )
    return table
