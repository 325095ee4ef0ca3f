"""Heterogeneous swarm (issue 38, item 5): one peer 10x slower than three others, against the same
three peers alone, in one invocation.

    sudo .venv/bin/python benchmarks/heterogeneous.py [--duration S] [--task fashion-mnist] [--out DIR] [--json]

Both runs are lab swarms (``swarmgrad lab``: one network namespace per peer, unshaped links) of
``swarmgrad peer`` processes with DiLoCo's defaults (moshpit, 50 inner steps) for the same fixed
duration. The slow peer is the lab's ``slowdown = 10``: each of its local steps sleeps 9x the
time its forward and backward took. It is the last peer (peer 0 evaluates and ends the run).

Measured from every peer's ``--json`` progress events (``events.jsonl`` in each run's directory),
after a warm-up (``WARMUP`` of the duration, from the first ``ready``), over its first start:
- each fast peer's samples per second (samples trained between its first report after the
  warm-up and its last, over that time), their mean in each run, and the ratio with / without the
  slow peer: the bar is at least ``RATE_BAR`` (0.90);
- the slow peer's ``samples_averaged`` / ``samples`` (status(): the samples it sent as weight in
  rounds that succeeded, its own and those carried from a round it missed and replayed) at its
  last report: the bar is at least ``SHARE_BAR`` (0.80). The epoch still under way at the end
  has had no round yet, so this share is a slight underestimate.

On a machine with fewer cores than peers the fast peers compete for CPU: a slow peer that sleeps
frees some, so the rate ratio there also says how busy the machine was. Needs root. Exit status 0
when both bars are met, 1 when one is missed, 2 when a lab cannot start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from _harness import checks_table
from rich.console import Console
from rich.table import Table

from swarmgrad.errors import SwarmgradError
from swarmgrad.lab.driver import run_lab
from swarmgrad.lab.network import check_requirements
from swarmgrad.lab.scenario import Scenario, validate_scenario

FAST_PEERS = 3
SLOWDOWN = 10.0
RATE_BAR, SHARE_BAR = 0.90, 0.80
WARMUP = 0.2  # of the duration: formation, first rounds, the first state downloads


def scenario(slow: bool, duration: float, task: str) -> Scenario:
    """Three fast peers, and with ``slow`` a fourth one ``SLOWDOWN`` x slower; DiLoCo's defaults."""
    peers: list[dict[str, Any]] = [{"count": FAST_PEERS, "label": "fast"}]
    if slow:
        peers.append({"slowdown": SLOWDOWN, "label": "slow"})
    name = "heterogeneous-slow" if slow else "heterogeneous-even"
    return validate_scenario({"name": name, "task": task, "duration": duration, "strategy": "diloco",
                              "averaging": "moshpit", "peers": peers}, source=name)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def peer_figures(events: Iterable[dict[str, Any]], duration: float) -> dict[int, dict[str, Any]]:
    """Per lab peer (first start only): samples/s after the warm-up, and its last report's counters."""
    events = [e for e in events if e.get("lab_start", 1) == 1]
    readies = [float(e["t"]) for e in events if e.get("event") == "ready"]
    if not readies:
        return {}
    since = min(readies) + WARMUP * duration
    figures: dict[int, dict[str, Any]] = {}
    for index in sorted({int(e["lab_peer"]) for e in events}):
        reports = [e for e in events if e.get("event") == "progress" and int(e["lab_peer"]) == index]
        after = [e for e in reports if float(e["t"]) >= since]
        if not reports:
            continue
        last = reports[-1]
        rate = None
        if len(after) >= 2 and float(after[-1]["t"]) > float(after[0]["t"]):
            rate = (int(after[-1]["samples"]) - int(after[0]["samples"])) / (float(after[-1]["t"]) - float(after[0]["t"]))
        samples, averaged = int(last.get("samples", 0)), int(last.get("samples_averaged", 0))
        figures[index] = {"samples_per_second": rate, "samples": samples, "samples_averaged": averaged,
                          "averaged_share": averaged / samples if samples else None,
                          "epoch": last.get("epoch"), "rounds_ok": last.get("rounds_ok"),
                          "rounds_failed": last.get("rounds_failed"), "rounds_replayed": last.get("rounds_replayed"),
                          "state_downloads": last.get("state_downloads"), "solo_steps": last.get("solo_steps"),
                          "no_shows": sum((last.get("no_shows") or {}).values())}
    return figures


def _mean(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def verdicts(with_slow: dict[int, dict[str, Any]], without: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The two figures, their bars and whether each is met (None: not measured)."""
    fast = list(range(FAST_PEERS))
    rate_with = _mean([with_slow.get(i, {}).get("samples_per_second") for i in fast])
    rate_without = _mean([without.get(i, {}).get("samples_per_second") for i in fast])
    ratio = rate_with / rate_without if rate_with is not None and rate_without else None
    share = with_slow.get(FAST_PEERS, {}).get("averaged_share")
    return {"fast_rate_with_slow": rate_with, "fast_rate_without": rate_without,
            "fast_rate_ratio": ratio, "fast_rate_ratio_met": None if ratio is None else ratio >= RATE_BAR,
            "slow_averaged_share": share, "slow_averaged_share_met": None if share is None else share >= SHARE_BAR}


def peers_table(with_slow: dict[int, dict[str, Any]], without: dict[int, dict[str, Any]]) -> Table:
    table = Table(title="heterogeneous swarm: per peer (first start, rates after the warm-up)", title_justify="left")
    for column in ("run", "peer", "samples/s", "samples", "averaged", "share", "epoch", "rounds ok/failed",
                   "replayed", "downloads", "solo", "no-shows seen"):
        table.add_column(column, justify="right" if column not in ("run", "peer") else "left")
    for run, figures in (("with slow peer", with_slow), ("without", without)):
        for index, f in figures.items():
            rate, share = f["samples_per_second"], f["averaged_share"]
            table.add_row(run, f"{index} ({'slow' if run != 'without' and index == FAST_PEERS else 'fast'})",
                          "-" if rate is None else f"{rate:.0f}", str(f["samples"]), str(f["samples_averaged"]),
                          "-" if share is None else f"{share:.2f}", str(f["epoch"]),
                          f"{f['rounds_ok']}/{f['rounds_failed']}", str(f["rounds_replayed"]),
                          str(f["state_downloads"]), str(f["solo_steps"]), str(f["no_shows"]))
    return table


def checks(found: dict[str, Any]) -> list[dict[str, Any]]:
    ratio, share = found["fast_rate_ratio"], found["slow_averaged_share"]

    def fmt(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    return [
        {"check": f"fast peers keep >= {RATE_BAR:.0%} of their samples/s beside the slow peer",
         "ok": bool(found["fast_rate_ratio_met"]),
         "seen": f"{fmt(ratio, 2)} ({fmt(found['fast_rate_with_slow'])} vs {fmt(found['fast_rate_without'])} samples/s)"},
        {"check": f">= {SHARE_BAR:.0%} of the slow peer's samples reach an average",
         "ok": bool(found["slow_averaged_share_met"]), "seen": fmt(share, 2)},
    ]


def run(scenario: Scenario, out: Path) -> dict[int, dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-{scenario.name}-"))
    run_lab(scenario, json_output=False, plot_path=out / f"{scenario.name}.png", run_dir=run_dir)
    return peer_figures(read_events(run_dir), scenario.duration)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training in each run")
    parser.add_argument("--task", default="fashion-mnist", help="fashion-mnist or digits")
    parser.add_argument("--out", default=".", help="directory for heterogeneous.json and the runs' plots")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout after the tables")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    out = Path(args.out).resolve()
    try:
        check_requirements()
        out.mkdir(parents=True, exist_ok=True)
        without = run(scenario(False, args.duration, args.task), out)
        with_slow = run(scenario(True, args.duration, args.task), out)
    except SwarmgradError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    found = verdicts(with_slow, without)
    wide = Console(width=max(Console().width, 150))
    wide.print(peers_table(with_slow, without))
    wide.print(checks_table("heterogeneous checks", checks(found)))
    report = {"duration": args.duration, "task": args.task, "slowdown": SLOWDOWN, "fast_peers": FAST_PEERS,
              **found, "with_slow": with_slow, "without": without}
    (out / "heterogeneous.json").write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if found["fast_rate_ratio_met"] and found["slow_averaged_share_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
