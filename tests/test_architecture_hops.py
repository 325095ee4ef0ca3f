"""docs/architecture.md's hop table is the path a real round takes: re-trace one (two peers on loopback,
scripts/trace_round.py) and compare. After a change to that path, `python scripts/trace_round.py`
rewrites the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_tracer():
    spec = importlib.util.spec_from_file_location("trace_round", ROOT / "scripts" / "trace_round.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def hop_path(table: str) -> list[list[str]]:
    """The table's rows without their functions column: which functions a hop enters can depend on
    timing (a matchmaking read that saw every member at once calls fewer: CI's loaded run added
    `Patience.waits_for` and `Attendance.probing`), the hops themselves do not."""
    rows = [line.split(" | ") for line in table.splitlines()]
    return [row[:2] + row[3:] if len(row) > 3 else row for row in rows]


def test_the_documented_hop_table_is_the_traced_round() -> None:
    tracer = load_tracer()
    documented = tracer.document_table(tracer.DOCUMENT.read_text())
    assert documented, "docs/architecture.md has no hop table between the markers"
    for _ in range(2):  # a second trace, so that one round's timing (a group not found) is not a failure
        table = tracer.hops(tracer.trace_round())
        traced = tracer.render(table)
        if hop_path(traced) == hop_path(documented):
            break
    assert hop_path(traced) == hop_path(documented), "the round's path changed: run `python scripts/trace_round.py`"
    assert not tracer.stale_notes(table), "NOTES in scripts/trace_round.py names hops the round no longer takes"
    served = [hop for hop in table if hop.module == "state.served" and "ServedState.__init__" in hop.functions]
    kept = [hop for hop in table if hop.module == "state.server" and "StateServer.publish_result" in hop.functions]
    assert served and kept, "the table must say where the state joiners take is published and the result kept"
