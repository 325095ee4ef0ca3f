"""The lm task trained three ways, in one invocation: 4 swarmgrad peers, 4 ``hivemind.Optimizer`` peers
and one process with the same total compute; time to a target held-out loss and tokens per second.

    sudo .venv/bin/python benchmarks/lm_compare.py [--networks loopback,10mbit] [--systems swarmgrad,hivemind,single]
        [--size medium] [--context 64] [--batch-size 8] [--strategy diloco|sync] [--duration 600] [--target-loss 3.0]
        [--quick] [--out DIR] [--json]

- ``swarmgrad``: 4 ``swarmgrad peer lm`` processes, DiLoCo (``--inner-steps``) + moshpit + int8 (``--strategy
  sync``: a swarm step per 4 x 8 samples, the single process's batch; on loopback it reached 3.0 in 237 s
  where DiLoCo took 133: a round every step costs ~2 s of all-reduce), the task's hyperparameters (AdamW
  without decay on norms and biases, clipping) at a constant rate (no warm-up or decay: hivemind's peers
  have none);
- ``hivemind``: 4 ``hivemind.Optimizer`` peers (benchmarks/hivemind_peer.py) with the settings its
  documentation gives for local updates (``use_local_updates=True``, 3 s matchmaking, fp16), Adam at the
  task's learning rate, an epoch as many samples as a swarmgrad epoch of the 4 peers;
- ``single``: one process, batch 4 x the peers' batch, the peers' 4 torch threads but at most the
  machine's cores (``single_threads``): the 4 peers' compute without a network (run here, once; its time
  is optimisation time, evaluations not counted).

Networks (the swarm lab: root only): ``loopback``, the lab's links with no rate limit, delay or loss (a scenario's default);
``10mbit``, 10 Mbit/s each way and 10 ms one way per peer. Peer 0 evaluates every ``--eval-every``
seconds on ``--eval-batches`` held-out batches. Reported: seconds to ``--target-loss`` from the moment
the swarm formed (a run that never got there gives its budget as a bound), final and best held-out
loss, bits per byte, tokens/s per peer, MB sent per peer, and per network the ratios the issue names:
swarmgrad's time over hivemind's (bar on loopback: <= 0.5) and over the single process's (<= 1.3).

Defaults sized for a 2-core machine: medium (19.2M parameters) at context 64 and batch 8, 600 s per run,
target 3.0 (all three reach it here; 2.5 took the single process 900 s with 4 threads). Measured numbers
are in issue 37's notes. On 2 cores 4 peers share the machine that the single process has to itself:
each peer gets half a core and gives about a third of it to its rounds, so the single-process ratio
measured here is the hardware's, not the swarm's (it needs a core per peer).

``--quick``: the tiny size, context 64, 60 s per system, loopback only: checks the harness.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console
from rich.table import Table
from time_to_accuracy import HivemindLab

from swarmgrad.errors import SwarmgradError
from swarmgrad.lab.driver import Lab
from swarmgrad.lab.network import EmulatedNetwork, check_requirements
from swarmgrad.lab.scenario import Scenario, validate_scenario

PEERS = 4
NETWORKS = {"loopback": None, "10mbit": {"up_mbit": 10, "down_mbit": 10, "delay_ms": 10}}
SYSTEMS = ("swarmgrad", "hivemind", "single")
HIVEMIND_BAR = 0.5  # swarmgrad's time to the target over hivemind's: at most this (loopback)
SINGLE_BAR = 1.3  # swarmgrad's time over the single process's: at most this (loopback)
MB = 1e6
# hivemind's peers step Adam at the task's rate from the first step: so do the other two (no warm-up or decay;
# their clipping and AdamW's weight decay stay), or the comparison would time the warm-up
CONSTANT_RATE = {"warmup_steps": 0, "decay_steps": 0}
QUICK = {"size": "tiny", "context": 64, "duration": 60.0, "networks": "loopback", "inner_steps": 10,
         "eval_every": 10.0, "eval_batches": 4, "target_loss": 3.5, "single_steps_per_second": 2.0}


def scenario(args: argparse.Namespace, network: str) -> Scenario:
    link = NETWORKS[network] or {}
    strategy = args.strategy
    # sync: a swarm step per PEERS x batch samples, the single process's batch, so both take the same steps
    options = ({"target_batch_size": PEERS * args.batch_size} if strategy == "sync"
               else {"inner_steps": args.inner_steps})
    return validate_scenario({
        "name": f"lm-compare-{network}", "task": "lm", "task_options": {"size": args.size, "context": args.context},
        "duration": args.duration, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
        "strategy": strategy, "averaging": "moshpit", "compression": "int8", **options,
        "batch_size": args.batch_size, "hparams": CONSTANT_RATE, "peers": [{**link, "count": PEERS}],
    }, source="lm_compare")


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds of the earliest evaluation at or below ``target`` (``curve``: (seconds, loss), by time)."""
    return next((seconds for seconds, loss in curve if loss is not None and loss <= target), None)


def run_swarm(system: str, network: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """One lab run of ``system`` on ``network``; a failure is an ``error`` in the result."""
    spec = scenario(args, network)
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-lmcmp-{system}-{network}-"))
    if system == "hivemind":
        lab: Lab = HivemindLab(spec, run_dir, json_output=False,
                               target_batch_size=PEERS * args.inner_steps * args.batch_size)
    else:
        lab = Lab(spec, run_dir, json_output=False)
    lab.prepare()
    console.log(f"{system} on {network}: {PEERS} peers, logs in {run_dir}")
    error, traffic = None, []
    try:
        with EmulatedNetwork(lab.links(), mtu=spec.mtu) as net:
            lab.run(net)
            traffic = [net.traffic(i) for i in range(len(lab.specs))]
    except SwarmgradError as failure:
        error = str(failure)
    summary = lab.summary(run_dir / "curve.png")
    curve = [(record["t"], record["loss"]) for record in summary["evals"]]
    training = summary["training_seconds"] or math.nan
    samples = [peer["samples"] for peer in summary["peers"].values() if peer["reported"]]
    sent = [sent for sent, _ in traffic]
    return result(system, network, curve, args, error=error, training_seconds=training,
                  strategy=args.strategy if system == "swarmgrad" else "local updates",
                  tokens_per_second_per_peer=(sum(samples) / len(samples) * args.context / training) if samples else None,
                  mb_sent_per_peer=round(sum(sent) / len(sent) / MB, 1) if sent else None,
                  rounds_ok={p["index"]: p["rounds_ok_total"] for p in summary["lab_peers"]}, logs=str(run_dir))


def single_threads() -> int:
    """The single process's torch threads: the 4 peers' one each, but no more than the machine's cores.
    4 threads on 2 cores spin-wait on each other: 26 tokens/s where 2 threads train at 2,095."""
    return min(PEERS, os.cpu_count() or 1)


def run_single(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """One process with the 4 peers' batch and their threads (``single_threads``), no network: trained here."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(single_threads())
    try:
        return _train_single(args, console)
    finally:
        torch.set_num_threads(threads)


def _train_single(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from swarmgrad.tasks import get_task
    from swarmgrad.tasks.train import train_locally

    task = get_task("lm", {"size": args.size, "context": args.context})
    batch = PEERS * args.batch_size
    curve: list[tuple[float, float]] = []
    steps_per_eval = max(1, int(args.eval_every * args.single_steps_per_second))
    console.log(f"single: batch {batch}, {single_threads()} threads, an evaluation every {steps_per_eval} steps")
    run = train_locally(task, max_seconds=args.duration, eval_every=steps_per_eval, eval_batches=args.eval_batches,
                        hparams={"batch_size": batch, **CONSTANT_RATE},
                        on_eval=lambda metrics: curve.append((metrics["train_seconds"], metrics["loss"])))
    return result("single", "none", curve, args, training_seconds=run.train_seconds,
                  tokens_per_second_per_peer=run.steps * batch * args.context / run.train_seconds / PEERS,
                  threads=single_threads(),
                  mb_sent_per_peer=0.0, rounds_ok={}, logs=None)


def result(system: str, network: str, curve: list[tuple[float, float]], args: argparse.Namespace, *,
           error: str | None = None, **fields: Any) -> dict[str, Any]:
    losses = [loss for _, loss in curve if loss is not None]
    return {"system": system, "network": network, "error": error,
            "seconds_to_target": time_to_loss(curve, args.target_loss),
            "final_loss": losses[-1] if losses else None, "best_loss": min(losses) if losses else None,
            "best_bits_per_byte": min(losses) / math.log(2) if losses else None, "curve": curve, **fields}


def time_or_bound(entry: dict[str, Any] | None) -> tuple[float | None, bool]:
    if entry is None or entry["error"] is not None:
        return None, False
    if entry["seconds_to_target"] is not None:
        return entry["seconds_to_target"], True
    return entry["training_seconds"], False


def ratios(results: dict[str, dict[str, Any]], network: str) -> dict[str, Any]:
    """swarmgrad's time to the target over hivemind's and over the single process's, on ``network``."""
    ours, ours_exact = time_or_bound(results.get(f"swarmgrad/{network}"))
    out: dict[str, Any] = {}
    for other, bar in ((f"hivemind/{network}", HIVEMIND_BAR), ("single/none", SINGLE_BAR)):
        theirs, theirs_exact = time_or_bound(results.get(other))
        if ours and theirs and (ours_exact or theirs_exact):
            value = ours / theirs
            # a bound: ours not reached -> >= value; theirs not reached -> <= value
            kind = "exact" if ours_exact and theirs_exact else ("at least" if not ours_exact else "at most")
            out[f"swarmgrad_over_{other.split('/')[0]}"] = {
                "value": round(value, 2), "kind": kind, "bar": bar if network == "loopback" else None,
                "met": (value <= bar and kind != "at least") if network == "loopback" else None}
    return out


def render(results: dict[str, dict[str, Any]], target: float) -> Table:
    table = Table(title=f"lm: time to held-out loss {target:g}")
    for column in ("system", "network", "to target (s)", "final loss", "best bits/byte", "tokens/s/peer",
                   "MB sent/peer", "rounds ok"):
        table.add_column(column, justify="left" if column in ("system", "network") else "right")
    for entry in results.values():
        if entry["error"] is not None:
            table.add_row(entry["system"], entry["network"], f"[red]error: {entry['error'][:50]}[/red]")
            continue
        reached = entry["seconds_to_target"]
        table.add_row(entry["system"], entry["network"],
                      f"{reached:.0f}" if reached is not None else f"> {entry['training_seconds']:.0f}",
                      _fmt(entry["final_loss"], 3), _fmt(entry["best_bits_per_byte"], 3),
                      _fmt(entry["tokens_per_second_per_peer"], 0), _fmt(entry["mb_sent_per_peer"], 1),
                      str(sum(entry["rounds_ok"].values())) if entry["rounds_ok"] else "-")
    return table


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", default="loopback,10mbit")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--size", default="medium", help="the lm task's size (medium: 19M parameters)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per peer")
    parser.add_argument("--strategy", choices=("diloco", "sync"), default="diloco",
                        help="swarmgrad's strategy (sync: a swarm step per 4 x batch samples, the single process's)")
    parser.add_argument("--inner-steps", type=int, default=20, help="diloco's local steps per round")
    parser.add_argument("--duration", type=float, default=600.0, help="each run's training budget, seconds")
    parser.add_argument("--target-loss", type=float, default=3.0,
                        help="held-out loss, nats per byte (3.0: all three reach it in 600 s on 2 cores)")
    parser.add_argument("--eval-every", type=float, default=20.0)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--single-steps-per-second", type=float, default=0.5,
                        help="the single process evaluates every eval-every x this many steps")
    parser.add_argument("--quick", action="store_true", help="tiny, context 64, 60 s, loopback: checks the harness")
    parser.add_argument("--out", default=".")
    parser.add_argument("--json", action="store_true")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # its settings, unless given too
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for name, allowed in (("networks", NETWORKS), ("systems", SYSTEMS)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            parser.error(f"unknown {name} {', '.join(sorted(unknown))}; pick from {', '.join(allowed)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    systems, networks = args.systems.split(","), args.networks.split(",")
    try:
        if set(systems) - {"single"}:
            check_requirements()
    except SwarmgradError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for network in networks:
        for system in systems:
            if system != "single":
                results[f"{system}/{network}"] = run_swarm(system, network, args, console)
    if "single" in systems:
        results["single/none"] = run_single(args, console)
    found = {network: ratios(results, network) for network in networks}
    report = {"settings": {key: value for key, value in vars(args).items() if key not in ("json", "out")},
              "results": results, "ratios": found, "wall_seconds": round(time.time() - started, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm-compare.json").write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        Console(width=150).print(render(results, args.target_loss))
        for network, pair in found.items():
            for name, ratio in pair.items():
                bar = f" (bar <= {ratio['bar']:g}: {'met' if ratio['met'] else 'not met'})" if ratio["bar"] else ""
                console.print(f"{network}: {name} = {ratio['kind']} {ratio['value']:.2f}{bar}")
    return 1 if any(entry["error"] for entry in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
