"""Chaos report: a swarm that loses 3 of its 8 peers at random times and gets 2 of them back,
against the same swarm without faults, in one invocation.

    sudo .venv/bin/python benchmarks/chaos.py [--seed N] [--duration S] [--quick] [--out DIR] [--json]

Both runs use the scenario ``benchmarks/scenarios/chaos.toml`` (8 peers on lossy 10-100 Mbit/s
links, DiLoCo + moshpit + int8 on Fashion-MNIST) for the same fixed duration, so their final
accuracies compare at equal time. The chaotic run adds, drawn from ``--seed``: 3 kills (peers
1..7) at times uniform in 15%..55% of the duration, and restarts of 2 of the killed peers
10%..25% of the duration after their kill. A restarted peer comes back with its identity and
checkpoint directory, as a volunteer whose machine rebooted would.

Checks, each printed with the faults table:
- no round hung: no running peer went silent for 3x its round deadline (the lab's watch);
- no NaN: every loss any peer reported was finite;
- every restarted peer caught up (downloaded the swarm's state or ended within an epoch of it)
  and every kill left the others averaging;
- the chaotic run's final accuracy is within 1 point of the fault-free run's.

``--quick`` shrinks both runs to the lab's quick form (digits, 3 peers, seconds). Needs root.
Exit status 0 when every check passes, 1 when one fails, 2 on bad arguments or a lab that
cannot start.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from _harness import checks_table
from rich.console import Console

from swarmgrad.errors import SwarmgradError
from swarmgrad.lab.driver import run_lab
from swarmgrad.lab.network import check_requirements
from swarmgrad.lab.scenario import Scenario, load_scenario, validate_scenario

SCENARIO = Path(__file__).with_name("scenarios") / "chaos.toml"
KILLS, RESTARTS = 3, 2
KILL_WINDOW = (0.15, 0.55)  # of the duration
RESTART_DELAY = (0.10, 0.25)  # of the duration, after the kill
ACCURACY_TOLERANCE = 0.01


def with_faults(scenario: Scenario, seed: int) -> Scenario:
    """``scenario`` plus 3 kills at random times and restarts of 2 of the killed peers."""
    rng = random.Random(seed)
    duration = scenario.duration
    victims = rng.sample(range(1, len(scenario.expanded_peers())), KILLS)
    churn: list[dict[str, Any]] = []
    for peer in victims:
        churn.append({"at": round(rng.uniform(*KILL_WINDOW) * duration, 1), "action": "kill", "peer": peer})
    for kill in rng.sample(churn, RESTARTS):
        churn.append({"at": round(kill["at"] + rng.uniform(*RESTART_DELAY) * duration, 1), "action": "restart",
                      "peer": kill["peer"]})
    data = scenario.model_dump()
    data.update(name=f"{scenario.name}-faults", churn=churn)
    return validate_scenario(data, source=f"chaos schedule (seed {seed})")


def without_faults(scenario: Scenario) -> Scenario:
    data = scenario.model_dump()
    data.update(name=f"{scenario.name}-fault-free", churn=[])
    return validate_scenario(data, source="fault-free twin")


def run(scenario: Scenario, out: Path, label: str) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-chaos-{label}-"))
    return run_lab(scenario, json_output=False, plot_path=out / f"chaos-{label}.png", run_dir=run_dir)


def checks(chaotic: dict[str, Any], calm: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's verdicts, each with what it saw."""
    faults = chaotic["faults"]
    restarts = [f for f in faults if f["action"] == "restart"]
    kills = [f for f in faults if f["action"] == "kill"]
    final, reference = chaotic["final_accuracy"], calm["final_accuracy"]
    gap = None if final is None or reference is None else reference - final
    return [
        {"check": "no round hung past its deadline", "ok": chaotic["hung_rounds"] == 0 and calm["hung_rounds"] == 0,
         "seen": f"{chaotic['hung_rounds']} hung (fault-free run: {calm['hung_rounds']})"},
        {"check": "no NaN in any model", "ok": not chaotic["nan_seen"] and not calm["nan_seen"],
         "seen": f"NaN loss reports: {len(chaotic['nan_reports'])} (fault-free run: {len(calm['nan_reports'])})"},
        {"check": "every kill left the others averaging", "ok": bool(kills) and all(f["ok"] for f in kills),
         "seen": f"{sum(bool(f['ok']) for f in kills)} of {len(kills)}"},
        {"check": "restarted peers caught up", "ok": bool(restarts) and all(f["ok"] for f in restarts),
         "seen": f"{sum(bool(f['ok']) for f in restarts)} of {len(restarts)}"},
        {"check": f"final accuracy within {ACCURACY_TOLERANCE * 100:g} point of the fault-free run",
         "ok": gap is not None and gap <= ACCURACY_TOLERANCE,
         "seen": f"{_pct(final)} with faults, {_pct(reference)} without"},
    ]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="draws the victims and fault times (default: random)")
    parser.add_argument("--scenario", default=str(SCENARIO), help="the swarm, without faults (TOML)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of training in each run")
    parser.add_argument("--quick", action="store_true", help="a seconds-long check of the harness (digits, 3 peers)")
    parser.add_argument("--out", default=".", help="directory for chaos.json and the two runs' plots")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout after the tables")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    out = Path(args.out).resolve()
    try:
        check_requirements()
        base = load_scenario(args.scenario)
        if args.duration is not None:
            base = base.adjusted(duration=args.duration)
        chaotic = with_faults(base, seed)
        if args.quick:
            chaotic = chaotic.adjusted(quick=True)
            base = base.adjusted(quick=True)
        calm = without_faults(base)
        out.mkdir(parents=True, exist_ok=True)
        console.log(f"seed {seed}: " + ", ".join(f"{c.action} peer {c.peer} at {c.at:.0f} s" for c in chaotic.schedule()))
        calm_summary = run(calm, out, "fault-free")
        chaos_summary = run(chaotic, out, "faults")
    except SwarmgradError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    verdicts = checks(chaos_summary, calm_summary)
    Console(width=max(Console().width, 150)).print(checks_table("chaos checks", verdicts))
    report = {"seed": seed, "scenario": chaotic.model_dump(mode="json"), "checks": verdicts,
              "faults": chaos_summary["faults"], "with_faults": chaos_summary, "fault_free": calm_summary}
    (out / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if all(verdict["ok"] for verdict in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
