"""What a lab shows and reports beyond the demo's: its live table, each fault's outcome, its summary and the
printed report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from swarmgrad.console import short_id, stdout
from swarmgrad.demo.summary import TARGETS, summarize

if TYPE_CHECKING:
    from swarmgrad.demo.events import RunLog
    from swarmgrad.lab.network import EmulatedNetwork
    from swarmgrad.lab.peers import LabPeer
    from swarmgrad.lab.scenario import ChurnEvent, PeerSpec, Scenario

CAUGHT_UP_EPOCHS = 1
START_MARK = "--- start "  # in a peer's log: one section per start


class Lab(Protocol):
    """What the report reads of a running lab (driver.py's ``Lab``): named here so that the driver,
    which calls the report, is not imported back by it."""

    scenario: Scenario
    title: str
    run_id: str
    run_dir: Path
    specs: list[PeerSpec]
    schedule: list[ChurnEvent]
    created: float
    t0: float | None
    done_index: int | None
    ended_at: float | None
    ended_by: str
    log: RunLog
    peers: list[LabPeer]
    faults: list[dict]
    nan_reports: list[dict]
    hangs: list[dict]
    net: EmulatedNetwork | None

    def elapsed(self, now: float | None = None) -> float: ...

    def judge_faults(self) -> None: ...


def render_lab(lab: Lab) -> Any:
    """The demo's dashboard, the lab's own table of links and processes, and what comes next."""
    from rich.console import Group
    from rich.text import Text

    from swarmgrad.demo.dashboard import render_dashboard

    parts = [render_dashboard(lab.log, title=lab.title), lab_table(lab)]
    upcoming = lab.schedule[lab.done_index or 0:]
    if lab.t0 is None:
        parts.append(Text(f"starting {len(lab.specs)} peers and a bootstrap node on the emulated network "
                          f"({time.time() - lab.created:.0f} s)"))
    elif upcoming:
        event = upcoming[0]
        parts.append(Text(f"next churn: {event.action} peer {event.peer} in "
                          f"{max(0.0, event.at - lab.elapsed()):.0f} s"))
    return Group(*parts)

def lab_table(lab: Lab) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for column in ("#", "peer", "link up/down, delay, loss", "slow", "process"):
        table.add_column(column, no_wrap=True)
    for peer in lab.peers:
        state = peer.state if peer.generation <= 1 else f"{peer.state} (start {peer.generation})"
        if peer.state == "exited" and peer.process is not None:
            state += f" rc={peer.process.returncode}"
        label = f" {peer.spec.label}" if peer.spec.label else ""
        table.add_row(str(peer.index), short_id(peer.peer_id), peer.spec.describe() + label,
                      f"{peer.spec.slowdown:g}x", state)
    return table


def judge_faults(lab: Lab) -> None:
    """Fill in each applied churn event's outcome from what the peers reported afterwards."""
    end = lab.ended_at or time.time()
    for record in lab.faults:
        if record["outcome"] is not None:
            continue
        peer = lab.peers[record["peer"]]
        at = lab.t0 + record["at"] if lab.t0 is not None else end
        if record["action"] == "kill":
            survivors = record.pop("survivors", {})
            growth = {index: lab.peers[index].rounds_total - before for index, before in survivors.items()}
            after = [h["t"] for p in lab.peers if p.index in survivors for h in p.history
                     if h["t"] > at and h["rounds_total"] > survivors[p.index]]
            grew = sorted(index for index, delta in growth.items() if delta > 0)
            record.update(rounds_after=sum(growth.values()),
                          first_round_after=None if not after else round(min(after) - at, 1))
            if grew:
                record.update(ok=True, outcome=f"others kept averaging: +{sum(growth.values())} rounds "
                              f"(peers {', '.join(map(str, grew))}), first {min(after) - at:.0f} s after")
            elif not survivors:
                record.update(ok=False, outcome="no other peer was running")
            else:
                record.update(ok=False, outcome=f"no averaging round after it ({end - at:.0f} s left)")
        else:
            reports = [h for h in peer.history if h["generation"] == record["generation"]]
            swarm = final_swarm_epoch(lab, exclude=peer)
            if not reports:
                error = generation_error(peer.log_path, record["generation"])
                record.update(ok=False, outcome=f"never reported: {error or f'see {peer.log_path}'}")
                continue
            first, last = reports[0]["epoch"], reports[-1]["epoch"]
            downloads = max(h["state_downloads"] for h in reports)
            rounds = reports[-1]["rounds_total"] - reports[0]["rounds_total"]
            close = swarm is not None and abs(last - swarm) <= CAUGHT_UP_EPOCHS
            record.update(epoch_start=first, epoch_end=last, swarm_epoch_end=swarm, state_downloads=downloads,
                          rounds_ok=rounds, ok=bool(downloads >= 1 or close))
            # rounds too: a peer that only ever downloads the swarm's state keeps up without helping
            numbers = f"epoch {first} -> {last}, swarm at {'-' if swarm is None else swarm}, " \
                      f"{downloads} state download{'s' if downloads != 1 else ''}, " \
                      f"{rounds} round{'s' if rounds != 1 else ''} ok"
            record["outcome"] = ("caught up: " if record["ok"] else "behind: ") + numbers
            error = generation_error(peer.log_path, record["generation"])
            exited = peer.exited_at.get(record["generation"])
            if error and exited is not None and exited <= end:
                # caught up, then failed while the run went on: that is what a user wants to know
                record.update(ok=False, error=error, outcome=record["outcome"] + f"; then {error}")
            elif error:  # failed while the lab stopped everyone (its donors left): noted, not judged
                record.update(error=error, outcome=record["outcome"] + f"; while stopping: {error}")
    for event in lab.schedule[lab.done_index or 0:]:
        lab.faults.append({"at": round(event.at, 1), "scheduled_at": round(event.at, 1), "action": event.action,
                            "peer": event.peer, "peer_id": lab.peers[event.peer].peer_id, "ok": None,
                            "outcome": f"not reached: the run ended at {lab.elapsed(end):.0f} s"})

def final_swarm_epoch(lab: Lab, exclude: LabPeer) -> int | None:
    """The highest epoch the other peers reported (the run's end, or when each stopped)."""
    epochs = [p.last_progress_epoch for p in lab.peers if p is not exclude and p.last_progress_epoch is not None]
    return max(epochs, default=None)


def lab_summary(lab: Lab, plot_path: Path) -> dict:
    """The demo's summary of the run plus the lab's own (see :mod:`swarmgrad.lab.driver`); draws the plot."""
    from swarmgrad.demo.plot import plot_run

    lab.judge_faults()
    summary = summarize(lab.log, targets=TARGETS)
    plot = plot_run(lab.log, plot_path, lab.title, targets=TARGETS)
    end = lab.ended_at or time.time()
    scenario = lab.scenario
    run = scenario.run_config
    summary.update({
        "scenario": {"name": scenario.name, "description": scenario.description, "task": scenario.task,
                     "duration": scenario.duration, "target_accuracy": scenario.target_accuracy,
                     "strategy": run.strategy.name, "averaging": run.averaging.kind,
                     "compression": run.compression, "inner_steps": getattr(run.strategy, "inner_steps", None),
                     "num_peers": len(lab.specs), "mtu": lab.net.mtu if lab.net else None},
        "run_id": lab.run_id,
        "lab_peers": [{"index": p.index, "peer_id": p.peer_id, "link": p.spec.describe(),
                       "slowdown": p.spec.slowdown, "label": p.spec.label, "state": p.state,
                       "starts": p.generation, "rounds_ok_total": p.rounds_total,
                       "state_downloads": p.history[-1]["state_downloads"] if p.history else 0,
                       "exit_code": None if p.process is None else p.process.returncode,
                       "error": generation_error(p.log_path, p.generation)} for p in lab.peers],
        "faults": lab.faults,
        "nan_seen": bool(lab.nan_reports),
        "nan_reports": lab.nan_reports,
        "hung_rounds": len(lab.hangs),
        "hangs": lab.hangs,
        "ended_by": lab.ended_by,
        "formation_seconds": None if lab.t0 is None else round(lab.t0 - lab.created, 3),
        "training_seconds": round(lab.elapsed(end), 3),
        "total_seconds": round(time.time() - lab.created, 3),
        "time_to_85": summary["seconds_to"].get("0.85"),
        "time_to_88": summary["seconds_to"].get("0.88"),
        "plot": str(plot),
        "logs": str(lab.run_dir),
    })
    return summary


def print_report(summary: dict) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    if summary["faults"]:
        table = Table(title="faults", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("at", "action", "peer", "outcome"):
            table.add_column(column, justify="right" if column in ("at", "peer") else "left")
        for fault in summary["faults"]:
            style = {True: "green", False: "red"}.get(fault["ok"], "yellow")
            table.add_row(f"{fault['at']:.0f} s", fault["action"], str(fault["peer"]),
                          f"[{style}]{escape(fault['outcome'])}[/]")
        stdout.print(table)
    final = summary.get("final_accuracy")
    per_epoch = summary.get("bytes_sent_per_peer_per_epoch")
    stdout.print(f"{summary['scenario']['name']}: final held-out accuracy {'-' if final is None else f'{final:.4f}'}; "
                 f"85% after {_seconds(summary['time_to_85'])}, 88% after {_seconds(summary['time_to_88'])} of "
                 f"training; {summary['training_seconds']:.0f} s training, {summary['total_seconds']:.0f} s in all "
                 f"({summary['ended_by']})")
    stdout.print(f"sent per peer per epoch: {'-' if per_epoch is None else f'{per_epoch / 1e6:.2f} MB'}; "
                 f"NaN loss: {'yes' if summary['nan_seen'] else 'no'}; hung peers: {summary['hung_rounds']}")
    stdout.print(f"plot: {summary['plot']}   logs: {summary['logs']}")


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def generation_error(path: Path, generation: int) -> str | None:
    """The last one-line ``error: ...`` that start ``generation`` of a peer wrote to its log, if any."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    sections = text.split(START_MARK)  # [before the first start, start 1, start 2, ...]
    if generation < 1 or generation >= len(sections):
        return None
    errors = [line.strip() for line in sections[generation].splitlines() if line.startswith("error:")]
    return errors[-1] if errors else None
