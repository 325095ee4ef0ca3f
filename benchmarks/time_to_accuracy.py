"""Time to accuracy on an emulated internet: swarmgrad against hivemind and the compute-only ideal.

    sudo .venv/bin/python benchmarks/time_to_accuracy.py [--systems swarmgrad,gossip,hivemind,compute-only]
        [--scenario benchmarks/scenarios/time-to-accuracy.toml] [--duration S] [--quick]
        [--out DIR] [--json]

Every system trains the scenario's swarm (by default 8 peers, the 5M-parameter CNN on
Fashion-MNIST, 10-100 Mbit/s links with 20-80 ms round trips and 0.5% loss, one peer 3x slower,
one killed at 72 s and a new one joining at 120 s: 30% and 50% of a 240 s run, swarmgrad's time
to 88% on a loaded 2-core machine; the budget is 720 s) in the swarm lab, one system after
the other in this one invocation, each on a fresh emulated network built from the same links:

- ``swarmgrad``: DiLoCo + moshpit + int8, the scenario as written;
- ``gossip``: swarmgrad's GossipSGD with push-sum gossip, int8, parameters averaged every
  ``--gossip-every`` local steps;
- ``hivemind``: ``hivemind.Optimizer`` (benchmarks/hivemind_peer.py) with its documented
  collaborative settings (``use_local_updates=True``, 3 s matchmaking) and fp16 compression of
  gradients and state; an epoch is as many samples as a swarmgrad DiLoCo epoch of the initial peers;
- ``compute-only``: swarmgrad's DiLoCo run again on unshaped links (no rate limit, delay or loss):
  the same peers, compute and churn, with the network's cost taken away.

Peer 0 evaluates on the full test set once per epoch and stops its system's run at the target
accuracy (or at the budget). Reported per system: seconds to 85% and 88% (counted from the moment
the initial peers found each other), final and best accuracy, bytes each peer sent and received
(the kernel's counters of its link: headers, DHT and retransmissions included, the same measure
for both libraries), and the ratios the issue sets targets for: hivemind's time over swarmgrad's
(>= 3) and swarmgrad's over compute-only (<= 1.5). A system that does not reach 88% in its budget
gives a bound (its budget) rather than a time. The accuracy curves of all systems go to one PNG,
everything to a JSON file.

``--quick`` runs a seconds-long variant (the lab's quick scenario: digits, 3 peers) to check the
harness. Needs root, like the lab.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from rich.console import Console
from rich.table import Table

from swarmgrad.demo.summary import TARGETS, seconds_to
from swarmgrad.errors import SwarmgradError
from swarmgrad.lab.driver import BOOTSTRAP_PORT, Lab, LabPeer
from swarmgrad.lab.network import EmulatedNetwork, LinkSpec, check_requirements
from swarmgrad.lab.scenario import Scenario, load_scenario

SCENARIO = Path(__file__).with_name("scenarios") / "time-to-accuracy.toml"
HIVEMIND_RUNNER = Path(__file__).with_name("hivemind_peer.py")
SYSTEMS = ("swarmgrad", "gossip", "hivemind", "compute-only")
HIVEMIND_TARGET_RATIO = 3.0  # hivemind's time to 88% over swarmgrad's: at least this
COMPUTE_TARGET_RATIO = 1.5  # swarmgrad's time to 88% over compute-only's: at most this
QUICK_ACCURACY = (0.85, 0.9)  # digits: the quick run times these instead
MB = 1e6
NOMINAL_RUN = 240.0  # seconds: "the run" the scenario's churn times are 30% and 50% of
UNSHAPED = LinkSpec(math.inf, math.inf, 0.0, 0.0)


class HivemindLab(Lab):
    """The lab running ``hivemind_peer.py`` (hivemind.Optimizer) peers, which report swarmgrad's events."""

    def __init__(self, *args: Any, target_batch_size: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.target_batch_size = target_batch_size
        self.title = f"hivemind lab {self.scenario.name}: {len(self.specs)} peers, {self.scenario.task}, fp16"

    def bootstrap_command(self, address: str) -> list[str]:
        return [sys.executable, str(HIVEMIND_RUNNER), "bootstrap", "--host", address, "--port", str(BOOTSTRAP_PORT)]

    def peer_command(self, peer: LabPeer, *, max_seconds: float, wait_peers: int) -> list[str]:
        config = self.peer_config(peer, max_seconds=max_seconds, wait_peers=wait_peers)
        argv = [
            sys.executable, str(HIVEMIND_RUNNER), "peer", self.scenario.task, "--run-id", config.run_id,
            "--host", config.network.host, "--initial-peers", *config.network.initial_peers,
            "--identity", str(config.network.identity_path), "--threads", str(config.compute.threads),
            "--shard", str(config.data.shard), "--num-shards", str(config.data.num_shards),
            "--slowdown", f"{config.compute.slowdown:g}", "--max-seconds", f"{config.stop.max_seconds:.1f}",
            "--wait-peers", str(config.connection.wait_peers), "--wait", f"{config.connection.wait:g}",
            "--target-batch-size", str(self.target_batch_size), "--eval-every", f"{config.evaluation.every:g}",
        ]
        for key, value in (self.scenario.task_options or {}).items():
            argv += ["--task-option", f"{key}={value}"]
        if self.scenario.batch_size is not None:
            argv += ["--batch-size", str(self.scenario.batch_size)]
        if not config.evaluation.final:
            argv.append("--no-final-eval")
        if config.evaluation.batches is not None:
            argv += ["--eval-batches", str(config.evaluation.batches)]
        if config.stop.target_accuracy is not None:
            argv += ["--target-accuracy", f"{config.stop.target_accuracy:g}"]
        return argv


class ComputeOnlyLab(Lab):
    """The same peers and churn on links with no rate limit, delay or loss."""

    def links(self) -> list[LinkSpec]:
        return [UNSHAPED] * (len(self.specs) + 1)


@dataclass
class Options:
    scenario: Scenario
    systems: tuple[str, ...]
    gossip_every: int
    out: Path
    targets: tuple[float, ...]


def batch_size(scenario: Scenario) -> int:
    from swarmgrad.tasks import get_task

    return scenario.batch_size or int(get_task(scenario.task).default_hparams.get("batch_size", 64))


def make_lab(system: str, options: Options, run_dir: Path) -> Lab:
    scenario = options.scenario
    if system == "gossip":
        gossip = scenario.model_copy(update={"strategy": "gossip", "averaging": "gossip", "inner_steps": None,
                                             "gossip_every": options.gossip_every})
        return Lab(gossip, run_dir, json_output=False)
    if system == "hivemind":
        initial = sum(1 for spec in scenario.expanded_peers() if spec.start)
        epoch_samples = initial * scenario.run_config.strategy.inner_steps * batch_size(scenario)
        return HivemindLab(scenario, run_dir, json_output=False, target_batch_size=epoch_samples)
    if system == "compute-only":
        return ComputeOnlyLab(scenario, run_dir, json_output=False)
    return Lab(scenario, run_dir, json_output=False)


def run_system(system: str, options: Options, console: Console, label: str | None = None) -> dict[str, Any]:
    """One system's whole lab run; a failure becomes an ``error`` in its result, not an exception.
    ``label`` names the run in logs and the result (default: ``system``)."""
    label = label or system
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-tta-{label}-"))
    lab = make_lab(system, options, run_dir)
    lab.prepare()
    console.log(f"{label}: {len(lab.specs)} peers, logs in {run_dir}")
    started = time.time()
    traffic: list[tuple[int, int]] = []
    error = None
    try:
        with EmulatedNetwork(lab.links(), mtu=options.scenario.mtu) as net:
            lab.run(net)
            traffic = [net.traffic(i) for i in range(len(lab.specs))]
    except SwarmgradError as failure:
        error = str(failure)
    summary = lab.summary(run_dir / "accuracy.png")
    started_peers = [i for i, peer in enumerate(lab.peers) if peer.generation > 0]
    sent = [traffic[i][0] for i in started_peers] if traffic else []
    received = [traffic[i][1] for i in started_peers] if traffic else []
    result = {
        "system": label,
        "error": error,
        # from the curve: the summary only times the demo's TARGETS
        "seconds_to": {f"{t:g}": seconds_to(summary["evals"], t) for t in options.targets},
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "training_seconds": summary["training_seconds"],
        "formation_seconds": summary["formation_seconds"],
        "wall_seconds": round(time.time() - started, 1),
        "ended_by": summary["ended_by"],
        "curve": [[record["t"], record["accuracy"]] for record in summary["evals"]],
        "mb_sent_per_peer": round(sum(sent) / len(sent) / MB, 2) if sent else None,
        "mb_received_per_peer": round(sum(received) / len(received) / MB, 2) if received else None,
        "mb_sent_by_peer": [round(value / MB, 2) for value in sent],
        "mb_sent_per_round": mb_sent_per_round(summary["peers"].values()),
        "rounds_ok": {p["index"]: p["rounds_ok_total"] for p in summary["lab_peers"]},
        "state_downloads": {p["index"]: p["state_downloads"] for p in summary["lab_peers"]},
        "faults": summary["faults"],
        "nan_seen": summary["nan_seen"],
        "hung_rounds": summary["hung_rounds"],
        "logs": str(run_dir),
    }
    reached = result["seconds_to"][f"{options.targets[-1]:g}"]
    console.log(f"{label}: {options.targets[-1]:.0%} " + (f"at {reached:.0f} s" if reached is not None else
                f"not reached in {result['training_seconds']:.0f} s") + f", final {result['final_accuracy']}")
    return result


def mb_sent_per_round(peers: Iterable[dict[str, Any]]) -> float | None:
    """What a peer's averaging rounds sent, per round, averaged over the peers that averaged: the
    links' totals above also carry the DHT and state downloads, which a short run's few rounds drown in."""
    per_round = [peer["bytes_sent"] / peer["rounds_ok"] for peer in peers if peer["rounds_ok"] > 0]
    return round(sum(per_round) / len(per_round) / MB, 4) if per_round else None


def time_or_bound(result: dict[str, Any] | None, target: float) -> tuple[float | None, bool]:
    """(seconds to ``target``, exact?): a run that did not reach it is bounded below by its training time."""
    if result is None or result["error"] is not None:
        return None, False
    reached = result["seconds_to"].get(f"{target:g}")
    if reached is not None:
        return reached, True
    return result["training_seconds"], False


def ratios(results: dict[str, dict[str, Any]], target: float, *, ours_system: str = "swarmgrad",
           compute_target: float = COMPUTE_TARGET_RATIO) -> dict[str, Any]:
    """hivemind / swarmgrad and swarmgrad / compute-only times to ``target``, with their targets;
    ``ours_system`` is the key of swarmgrad's result, ``compute_target`` the bound on the second ratio."""
    ours, ours_exact = time_or_bound(results.get(ours_system), target)
    hivemind, hivemind_exact = time_or_bound(results.get("hivemind"), target)
    ideal, ideal_exact = time_or_bound(results.get("compute-only"), target)
    out: dict[str, Any] = {}
    if ours and ours_exact and hivemind:
        value = hivemind / ours
        out["hivemind_over_swarmgrad"] = {"value": round(value, 2), "lower_bound": not hivemind_exact,
                                          "target": HIVEMIND_TARGET_RATIO, "met": value >= HIVEMIND_TARGET_RATIO}
    if ours and ideal and ideal_exact:
        value = ours / ideal
        out["swarmgrad_over_compute_only"] = {"value": round(value, 2), "lower_bound": not ours_exact,
                                              "target": compute_target,
                                              "met": ours_exact and value <= compute_target}
    return out


def render(results: dict[str, dict[str, Any]], targets: tuple[float, ...], title: str) -> Table:
    table = Table(title=title)
    for column in ("system", *(f"to {t:.0%} (s)" for t in targets), "final acc", "best acc", "MB sent/peer",
                   "MB recv/peer", "ended by"):
        table.add_column(column, justify="left" if column in ("system", "ended by") else "right")
    for system, result in results.items():
        if result["error"] is not None:
            table.add_row(system, *["-"] * (len(targets) + 4), f"[red]error: {result['error'][:60]}[/red]")
            continue
        times = [result["seconds_to"].get(f"{t:g}") for t in targets]
        table.add_row(system, *(f"{v:.0f}" if v is not None else f"> {result['training_seconds']:.0f}" for v in times),
                      _fmt(result["final_accuracy"], 4), _fmt(result["best_accuracy"], 4),
                      _fmt(result["mb_sent_per_peer"], 1), _fmt(result["mb_received_per_peer"], 1), result["ended_by"])
    return table


def ratio_lines(found: dict[str, Any], ours: str = "swarmgrad") -> list[str]:
    lines = []
    for name, label, sense in (("hivemind_over_swarmgrad", f"hivemind / {ours} time", ">="),
                               ("swarmgrad_over_compute_only", f"{ours} / compute-only time", "<=")):
        if name not in found:
            lines.append(f"{label}: - (a run is missing, failed, or did not reach the target)")
            continue
        ratio = found[name]
        bound = ">= " if ratio["lower_bound"] else ""
        verdict = "[green]met[/green]" if ratio["met"] else "[red]not met[/red]"
        lines.append(f"{label}: {bound}{ratio['value']:.2f} (target {sense} {ratio['target']:g}): {verdict}")
    return lines


def plot(results: dict[str, dict[str, Any]], targets: tuple[float, ...], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for system, result in results.items():
        if result["curve"]:
            seconds, accuracy = zip(*result["curve"])
            axes.plot(seconds, accuracy, marker=".", label=system)
    for target in targets:
        axes.axhline(target, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("seconds since the swarm formed")
    axes.set_ylabel("test accuracy (peer 0)")
    axes.set_ylim(max(0.0, min(targets) - 0.25), 1.0)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--scenario", default=str(SCENARIO), help="lab scenario TOML (peers, links, churn)")
    parser.add_argument("--duration", type=float, default=None, help="each system's training budget, seconds")
    parser.add_argument("--gossip-every", type=int, default=50, help="gossip: local steps between averagings")
    parser.add_argument("--quick", action="store_true", help="a seconds-long check of the harness (digits, 3 peers)")
    parser.add_argument("--out", default=".", help="directory for time-to-accuracy.png and .json")
    parser.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    args = parser.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown system(s) {', '.join(sorted(unknown))}; pick from {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    try:
        check_requirements()
        scenario = load_scenario(args.scenario)
        if args.quick or args.duration is not None:
            scenario = scenario.adjusted(duration=args.duration, quick=args.quick)
    except SwarmgradError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    options = Options(scenario, tuple(s for s in SYSTEMS if s in args.systems.split(",")), args.gossip_every,
                      Path(args.out).resolve(), QUICK_ACCURACY if args.quick else TARGETS)
    options.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for system in options.systems:
        results[system] = run_system(system, options, console)
    found = ratios(results, options.targets[-1])
    title = (f"time to accuracy: {scenario.name}, {len(scenario.expanded_peers())} peers, {scenario.task}, "
             f"budget {scenario.duration:g} s")
    figure = plot(results, options.targets, options.out / "time-to-accuracy.png", title)
    report = {"scenario": scenario.model_dump(mode="json"), "systems": results, "ratios": found,
              "targets": list(options.targets), "plot": str(figure)}
    json_path = options.out / "time-to-accuracy.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        out = Console(width=max(Console().width, 150))
        out.print(render(results, options.targets, title))
        for line in ratio_lines(found):
            out.print(line)
        out.print(f"curves: {figure}; everything: {json_path}")
    return 1 if any(result["error"] for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
