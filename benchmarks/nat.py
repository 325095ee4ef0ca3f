"""Volunteers behind NAT: the ``home-nat`` scenario against the same swarm with no NAT, in one invocation.

    sudo .venv/bin/python benchmarks/nat.py [--quick] [--duration S] [--out DIR] [--json]

``home-nat`` is 8 peers on home broadband, 2 public and 6 behind NAT routers (4 home, 1 symmetric,
1 carrier-grade; swarmgrad/lab/nat.py). Its twin has the same links and no routers. For each NAT
type the table gives the peers' share of rounds averaged after the first minute (per peer: rounds
it averaged / epochs it went through; the smallest over the type's peers), the rounds a peer sat
out because nobody in its group could be dialled, and its state downloads; then the time to the
target accuracy of both runs and their ratio.

Checks (exit 1 if one fails): every peer of every NAT type averages in at least 90% of its rounds
after the first minute; no round failed for reachability; time to the target within 1.25x of the
twin's. ``--quick``: digits, one public peer and one of each NAT type, 75 s, no target (the
first 15 s are left out instead of a minute), and no twin (with no target it only fills a column). Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from _harness import checks_table
from rich.console import Console
from rich.table import Table

from swarmgrad.errors import SwarmgradError
from swarmgrad.lab.driver import run_lab
from swarmgrad.lab.network import check_requirements
from swarmgrad.lab.scenario import QUICK_INNER_STEPS, QUICK_TASK, Scenario, load_scenario, validate_scenario

MIN_SHARE, MAX_RATIO = 0.90, 1.25
# quick: 60 s counted, at least 3 epochs of 1500 digits steps (5-9 s each on 2 loaded cores, 15 s seen in CI)
WARMUP_S, QUICK_WARMUP_S, QUICK_DURATION_S = 60.0, 15.0, 75.0
DURATION_S = 180.0  # each run: a minute of warm-up, two of rounds counted, 88% reached well before


def without_nat(scenario: Scenario) -> Scenario:
    data = scenario.model_dump()
    data.update(name=f"{scenario.name}-no-nat", peers=[{**peer, "nat": "none"} for peer in data["peers"]])
    return validate_scenario(data, source="the scenario without NAT")


def quick(scenario: Scenario) -> Scenario:
    """One public peer and one peer of each NAT type, on the scenario's links, training digits."""
    peers = scenario.expanded_peers()
    keep = [next(p for p in peers if p.nat == kind) for kind in ("none", "home", "symmetric", "cgnat")]
    data = scenario.model_dump()
    data.update(task=QUICK_TASK, inner_steps=QUICK_INNER_STEPS, duration=QUICK_DURATION_S, target_accuracy=None,
                peers=[p.model_dump() for p in keep])
    return validate_scenario(data, source="the quick NAT scenario")


def round_shares(run_dir: Path, warmup: float) -> dict[int, dict[str, float]]:
    """Per lab peer, from its progress events after ``warmup`` seconds of its own training: rounds
    averaged, epochs gone through, rounds sat out for reachability, state downloads.

    Only epochs every peer reached count: when the run's clock stops, the fastest peer's last round
    finds the others already stopped ("no group"), which no NAT caused."""
    events = [event for event in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
              if event.get("event") == "progress" and event.get("lab_start") == 1]
    reached: dict[int, int] = {}
    for event in events:
        reached[event["lab_peer"]] = max(reached.get(event["lab_peer"], 0), event["epoch"])
    common = min(reached.values(), default=0)
    first: dict[int, dict] = {}
    last: dict[int, dict] = {}
    started: dict[int, float] = {}
    for event in events:
        index = event["lab_peer"]
        started.setdefault(index, event["t"])
        if event["t"] - started[index] >= warmup and event["epoch"] <= common:
            first.setdefault(index, event)
            last[index] = event
    shares = {}
    for index, end in last.items():
        start = first[index]
        epochs = end["epoch"] - start["epoch"]
        rounds = end["rounds_ok"] - start["rounds_ok"]
        shares[index] = {"rounds": rounds, "epochs": epochs, "share": rounds / epochs if epochs else 0.0,
                         "unreachable": end.get("rounds_unreachable", 0),
                         "downloads": end["state_downloads"] - start["state_downloads"]}
    return shares


def by_nat(scenario: Scenario, shares: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    peers = scenario.expanded_peers()
    groups: dict[str, list[int]] = defaultdict(list)
    for index, peer in enumerate(peers):
        groups[peer.nat].append(index)
    rows = []
    for nat in ("none", "home", "symmetric", "cgnat"):
        found = [shares[i] for i in groups.get(nat, []) if i in shares]
        if not groups.get(nat):
            continue
        rows.append({"nat": nat, "peers": len(groups[nat]), "reported": len(found),
                     "min_share": min((s["share"] for s in found), default=0.0),
                     "rounds": sum(s["rounds"] for s in found), "epochs": sum(s["epochs"] for s in found),
                     "unreachable": sum(s["unreachable"] for s in found),
                     "downloads": sum(s["downloads"] for s in found)})
    return rows


def run(scenario: Scenario, out: Path, label: str, warmup: float) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-nat-{label}-"))
    summary = run_lab(scenario, json_output=False, plot_path=out / f"nat-{label}.png", run_dir=run_dir)
    summary["by_nat"] = by_nat(scenario, round_shares(run_dir, warmup))
    return summary


def checks(natted: dict[str, Any], plain: dict[str, Any], target: float | None) -> list[dict[str, Any]]:
    rows = natted["by_nat"]
    verdicts = [{"check": f"every {row['nat']} peer averages in >= {MIN_SHARE:.0%} of its rounds after warm-up",
                 "ok": row["reported"] == row["peers"] and row["min_share"] >= MIN_SHARE,
                 "seen": f"lowest {row['min_share']:.0%} ({row['rounds']} of {row['epochs']} epochs)"} for row in rows]
    unreachable = sum(row["unreachable"] for row in rows)
    verdicts.append({"check": "no round failed for reachability", "ok": unreachable == 0,
                     "seen": f"{unreachable} round(s) sat out"})
    if target is not None:
        key = f"time_to_{round(target * 100)}"
        mine, reference = natted.get(key), plain.get(key)
        ratio = None if mine is None or not reference else mine / reference
        verdicts.append({"check": f"time to {target:.0%} within {MAX_RATIO}x of the swarm without NAT",
                         "ok": ratio is not None and ratio <= MAX_RATIO,
                         "seen": f"{_seconds(mine)} behind NAT, {_seconds(reference)} without: "
                                 f"{'-' if ratio is None else f'{ratio:.2f}x'}"})
    return verdicts


def render(natted: dict[str, Any], plain: dict[str, Any], verdicts: list[dict[str, Any]]) -> list[Table]:
    table = Table(title="rounds averaged after warm-up, per NAT type", title_justify="left")
    for column in ("NAT", "peers", "lowest share", "rounds / epochs", "sat out (reach)", "state downloads",
                   "without NAT: lowest share"):
        table.add_column(column)
    plain_rows = {row["nat"]: row for row in plain["by_nat"]}
    plain_all = min((row["min_share"] for row in plain["by_nat"]), default=0.0)
    for row in natted["by_nat"]:
        table.add_row(row["nat"], str(row["peers"]), f"{row['min_share']:.0%}", f"{row['rounds']} / {row['epochs']}",
                      str(row["unreachable"]), str(row["downloads"]),
                      f"{plain_rows.get(row['nat'], {}).get('min_share', plain_all):.0%}" if plain_rows else "-")
    return [table, checks_table("NAT checks", verdicts)]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="home-nat", help="the swarm behind NAT (built-in name or TOML)")
    parser.add_argument("--duration", type=float, default=None,
                        help=f"seconds of training in each run (default {DURATION_S:g}; both run it whole)")
    parser.add_argument("--quick", action="store_true", help="digits, one peer per NAT type, 75 s: a CI check")
    parser.add_argument("--out", default=".", help="directory for nat.json and the two runs' plots")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout after the tables")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    out = Path(args.out).resolve()
    try:
        check_requirements()
        natted = load_scenario(args.scenario)
        target = None if args.quick else natted.target_accuracy
        natted = quick(natted) if args.quick else natted.adjusted(duration=args.duration or DURATION_S)
        # both runs train for the whole duration: a run stopped at the target leaves no rounds
        # after the warm-up to count; the time to the target is read from the evaluations
        natted = validate_scenario({**natted.model_dump(), "target_accuracy": None}, source="the NAT benchmark")
        plain = without_nat(natted)
        out.mkdir(parents=True, exist_ok=True)
        warmup = QUICK_WARMUP_S if args.quick else WARMUP_S
        console.log(f"{natted.name}: {len(natted.expanded_peers())} peers, "
                    f"{sum(p.nat != 'none' for p in natted.expanded_peers())} behind NAT"
                    + ("" if args.quick else "; then the same without NAT"))
        natted_summary = run(natted, out, "behind-nat", warmup)
        # the quick check has no target, so the twin would only fill a reference column: CI time is short
        plain_summary = run(plain, out, "no-nat", warmup) if not args.quick else {"by_nat": [], "skipped": "--quick"}
    except SwarmgradError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    verdicts = checks(natted_summary, plain_summary, target)
    wide = Console(width=max(Console().width, 150))
    for table in render(natted_summary, plain_summary, verdicts):
        wide.print(table)
    report = {"scenario": natted.model_dump(mode="json"), "checks": verdicts, "behind_nat": natted_summary,
              "without_nat": plain_summary}
    (out / "nat.json").write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if all(verdict["ok"] for verdict in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
