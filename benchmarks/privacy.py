"""Privacy-utility benchmark: a swarm with differential privacy against one process running Opacus DP-SGD.

    .venv/bin/python benchmarks/privacy.py [--epsilons 1,3,8] [--epochs 3] [--peers 4] [--data-shards N]
        [--update-noise 0.02] [--rows sample,opacus,update] [--inner-steps 50] [--quick] [--json]

fashion-mnist, the demo's model (FashionCNN, ~206k parameters), delta 1e-5, clip 1.0, Adam at the task's
lr (1e-3). Rows, each a fresh run:

- **sample** at each epsilon: ``--peers`` real ``swarmgrad peer`` processes (loopback, DiLoCo,
  moshpit, the run's defaults but ``--inner-steps 10``) with per-sample DP-SGD, created with
  ``--privacy-level sample --target-epsilon E --expected-releases S`` and stopped at ``--max-steps S``
  = epochs x shard / batch: each peer's noise is derived for its own shard's sample rate
  (batch/shard) and S steps. Beside it **opacus**: one process, Opacus's ``make_private_with_epsilon``
  (RDP accountant, Poisson sampling) on the union of the peers' shards, batch = peers x each peer's
  batch (the swarm's samples per step; or ``--opacus-batch-size``), the same epochs, model, lr and
  seed. Reported: final held-out accuracy (peers: median of their final evaluations) and epsilon as
  each accounted it (peers: the largest).
- **update**: the peers without per-sample DP, at the update-level values the
  README documents (``--privacy-clip 1.0 --privacy-noise σ --privacy-noise-shares P --min-group-size P``:
  distributed DP, each release carrying σ/sqrt(P) of the noise) for the same epochs: accuracy,
  epsilon (the averages' guarantee) and epsilon_local (one release's, seen alone).

The bar (issue 39): the swarm within 2 points of single-process DP-SGD at epsilon 3 and 8, and the
update row at 80% or more. ``--data-shards N`` (> peers) trains on the first ``peers`` of N shards only,
in both the swarm and the single process: a shorter run on less data. ``--quick`` (CI): epsilon 8,
1 epoch on 4 of 32 shards (29 steps), 5 inner steps. Progress and the table go to stderr with ``--json``, which
prints the report on stdout. Exit status 0 when every row ran, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import signal
import statistics
import sys
import time
from typing import Any

import torch
from _harness import fmt, log  # a script: its directory is on sys.path
from attacks import SWARMGRAD, Child
from rich.console import Console
from rich.table import Table

from swarmgrad.tasks import get_task

TASK = "fashion-mnist"
DELTA = 1e-5
CLIP = 1.0
BATCH = 64  # the task's batch size: each peer's
LR = 1e-3  # the task's Adam learning rate
PEER_COUNTS = ("rounds_ok", "rounds_failed", "rounds_overlapped", "rounds_replayed", "solo_steps", "state_downloads")
UPDATE_NOISE = 0.02  # the README's update-level noise_multiplier (with noise shares = peers)
GAP_POINTS = 2.0  # issue 39's bar at epsilon 3 and 8
UPDATE_BAR = 0.80
GRACE_S = 30.0


def shard_sizes(peers: int, shards: int) -> list[int]:
    task = get_task(TASK)
    return [len(task.train_data(shard, shards, 0)) for shard in range(peers)]  # type: ignore[arg-type]


# ---- one process, Opacus -------------------------------------------------------------------------

def opacus_row(epsilon: float, epochs: int, peers: int, shards: int, batch: int) -> dict[str, Any]:
    """Opacus DP-SGD on the union of the peers' shards, the swarm's samples per step as its batch."""
    from opacus import PrivacyEngine
    from torch.utils.data import ConcatDataset, DataLoader

    torch.set_num_threads(1)  # as each peer (--threads 1)
    task = get_task(TASK)
    data = ConcatDataset([task.train_data(shard, shards, 0) for shard in range(peers)])
    torch.manual_seed(0)  # the run's seed: the same initial weights as the peers'
    model = task.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=epsilon, target_delta=DELTA,
        epochs=epochs, max_grad_norm=CLIP)
    started, steps = time.monotonic(), 0
    for _ in range(epochs):
        for inputs, targets in loader:
            if len(targets) == 0:  # Poisson sampling can draw an empty batch
                continue
            optimizer.zero_grad()
            task.loss_fn(model(inputs), targets).backward()
            optimizer.step()
            steps += 1
    result = task.evaluate(model._module if hasattr(model, "_module") else model)
    return {"setting": "opacus", "target_epsilon": epsilon, "accuracy": result["accuracy"],
            "epsilon": float(engine.get_epsilon(DELTA)), "noise_multiplier": optimizer.noise_multiplier,
            "steps": steps, "seconds": time.monotonic() - started}


# ---- the swarm -----------------------------------------------------------------------------------

def swarm_row(setting: str, privacy: list[str], steps: int, peers: int, shards: int, bootstrap: str,
              target_epsilon: float | None, inner_steps: int, batch: int) -> dict[str, Any]:
    """``peers`` real peers of a run created by the first, each stopped after ``steps`` local steps."""
    run_id = f"privacy-{setting}-{secrets.token_hex(3)}"
    children = []
    started = time.monotonic()
    try:
        for shard in range(peers):
            argv = [*SWARMGRAD, "peer", TASK, "--run-id", run_id, "--initial-peers", bootstrap, "--threads", "1",
                    "--num-shards", str(shards), "--shard", str(shard), "--max-steps", str(steps),
                    "--inner-steps", str(inner_steps), "--batch-size", str(batch), "--eval-every", "0",
                    "--wait-peers", str(peers), "--wait", "120", "--json", *privacy]
            if shard == 0:
                argv.append("--create")
            children.append(Child(argv, f"{setting}{shard}"))
            if shard == 0:
                time.sleep(3.0)  # the creator publishes the manifest the others join by
        done = _wait_done(children, timeout=max(600.0, steps * peers * 1.0))
    finally:
        for child in children:
            child.stop(GRACE_S)
    finals = [event["final"]["accuracy"] for event in done if event.get("final")]
    status = [event["status"] for event in done]
    epsilons = [s["epsilon"] for s in status if isinstance(s.get("epsilon"), float)]
    local = [s["epsilon_local"] for s in status if isinstance(s.get("epsilon_local"), float)]
    if len(finals) < peers:
        crashed = [child.describe() for child in children if not child.of("done")]
        raise RuntimeError(f"{setting}: {peers - len(finals)} peer(s) gave no final accuracy\n" + "\n".join(crashed))
    return {"setting": setting, "target_epsilon": target_epsilon, "accuracy": statistics.median(finals),
            "accuracy_min": min(finals), "epsilon": max(epsilons) if epsilons else None,
            "epsilon_local": max(local) if local else None, "steps": steps,
            "rounds_ok": statistics.median(s["rounds_ok"] for s in status), "seconds": time.monotonic() - started,
            # what each peer's rounds did: where a row falls short, why (no group, replays, downloads)
            "peers": [{key: s.get(key) for key in PEER_COUNTS}
                      | {"last_error": (s.get("last_report") or {}).get("error")} for s in status]}


def _wait_done(children: list[Child], timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(child.of("done") or child.process.poll() is not None for child in children):
            break
        time.sleep(1.0)
    for child in children:
        child.drained()
    return [child.of("done")[-1] for child in children if child.of("done")]


# ---- report --------------------------------------------------------------------------------------

def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Swarm minus single process, per epsilon, in points; and the update row against its bar."""
    checks = []
    by = {(row["setting"], row.get("target_epsilon")): row for row in rows if "error" not in row}
    for (setting, epsilon), row in sorted(by.items(), key=lambda item: (item[0][0], item[0][1] or 0)):
        if setting == "sample" and ("opacus", epsilon) in by:
            gap = 100 * (by[("opacus", epsilon)]["accuracy"] - row["accuracy"])
            checks.append({"check": f"epsilon {epsilon:g}: swarm within {GAP_POINTS:g} points of Opacus",
                           "value": gap, "ok": gap <= GAP_POINTS if epsilon >= 3 else None})
        if setting == "update":
            checks.append({"check": f"update level: accuracy >= {UPDATE_BAR:.0%}", "value": row["accuracy"],
                           "ok": row["accuracy"] >= UPDATE_BAR})
    return checks


def table(rows: list[dict[str, Any]], epochs: int, peers: int) -> Table:
    out = Table(title=f"{TASK}, FashionCNN, {epochs} epoch(s), {peers} peers vs one process (delta {DELTA:g})")
    for column in ("setting", "target ε", "accuracy", "ε accounted", "ε one release", "steps", "seconds"):
        out.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        if "error" in row:
            out.add_row(row["setting"], fmt(row.get("target_epsilon"), 0), "error", row["error"][:60], "", "", "")
            continue
        out.add_row(row["setting"], "-" if row.get("target_epsilon") is None else f"{row['target_epsilon']:g}",
                    f"{100 * row['accuracy']:.1f}%", fmt(row.get("epsilon")), fmt(row.get("epsilon_local")),
                    str(row["steps"]), f"{row['seconds']:.0f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", default=None, help="comma-separated targets (default 1,3,8; --quick 8)")
    parser.add_argument("--epochs", type=int, default=None, help="passes over each peer's shard (default 3; --quick 1)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--data-shards", type=int, default=None,
                        help="split the training set this many ways; peers train the first --peers (default --peers; "
                             "--quick 32)")
    parser.add_argument("--update-noise", type=float, default=UPDATE_NOISE,
                        help=f"update row's noise_multiplier (default {UPDATE_NOISE:g}: the README's)")
    parser.add_argument("--batch-size", type=int, default=BATCH,
                        help=f"each peer's batch (default {BATCH}, the task's)")
    parser.add_argument("--opacus-batch-size", type=int, default=None,
                        help="the single process's expected batch (default: peers x --batch-size, the swarm's samples "
                             "per step)")
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="DiLoCo local steps per round (default 10, --quick 5: at the run default of 50 an epoch "
                             "of 234 steps is ~4 rounds, and the swarm ended 4-6 points under Opacus instead of 2)")
    parser.add_argument("--rows", default="sample,opacus,update",
                        help="which rows: sample (the swarm, per-sample DP), opacus (one process), update (the swarm, "
                             "update level); default all three")
    parser.add_argument("--quick", action="store_true", help="CI: epsilon 8, 1 epoch on 4 of 32 shards, 5 inner steps")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout (the table to stderr)")
    args = parser.parse_args(argv)
    try:
        epsilons = [float(e) for e in (args.epsilons or ("8" if args.quick else "1,3,8")).split(",")]
        epochs = args.epochs or (1 if args.quick else 3)
        shards = args.data_shards or (32 if args.quick else args.peers)
        # quick: 5 inner steps, so the 29 steps hold 5 rounds; at 10 only the first was whole (the peers
        # finished inside the second), and one round failing on a loaded CI host failed the row
        inner_steps = args.inner_steps or (5 if args.quick else 10)
        opacus_batch = args.opacus_batch_size or args.peers * args.batch_size
        if not 1 <= args.batch_size <= 4096 or not 1 <= opacus_batch <= 65536:
            raise ValueError("--batch-size must be within 1..4096 and --opacus-batch-size within 1..65536")
        kinds = set(args.rows.split(","))
        if not kinds or not kinds <= {"sample", "opacus", "update"}:
            raise ValueError(f"--rows must name sample, opacus and/or update, got {args.rows!r}")
        if not all(e > 0 and math.isfinite(e) for e in epsilons):
            raise ValueError(f"--epsilons must be positive, got {args.epsilons}")
        if not 2 <= args.peers <= shards or not 1 <= epochs <= 100:
            raise ValueError("need 2 <= --peers <= --data-shards and 1 <= --epochs <= 100")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sizes = shard_sizes(args.peers, shards)
    steps = epochs * min(sizes) // args.batch_size
    log(f"{args.peers} peers, shards of {min(sizes)}-{max(sizes)} samples, {steps} steps each ({epochs} epochs)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict[str, Any]] = []
    bootstrap = Child([*SWARMGRAD, "bootstrap"], "bootstrap")
    try:
        if not bootstrap.first_line.wait(60) or not bootstrap.lines:
            print(f"error: the bootstrap node gave no address\n{bootstrap.describe()}", file=sys.stderr)
            return 1
        address = bootstrap.lines[0]
        plans: list[tuple[str, float | None]] = []
        for epsilon in epsilons:
            plans += [(setting, epsilon) for setting in ("sample", "opacus") if setting in kinds]
        if "update" in kinds:
            plans.append(("update", None))
        for setting, epsilon in plans:
            log(f"{setting} {epsilon if epsilon is not None else ''}: starting")
            try:
                if setting == "opacus":
                    row = opacus_row(epsilon, epochs, args.peers, shards, opacus_batch)  # type: ignore[arg-type]
                elif setting == "sample":
                    privacy = ["--privacy-level", "sample", "--privacy-clip", str(CLIP), "--target-epsilon",
                               f"{epsilon:g}", "--expected-releases", str(steps), "--privacy-delta", f"{DELTA:g}"]
                    row = swarm_row(setting, privacy, steps, args.peers, shards, address, epsilon, inner_steps,
                                    args.batch_size)
                else:
                    privacy = ["--privacy-clip", str(CLIP), "--privacy-noise", f"{args.update_noise:g}",
                               "--privacy-noise-shares", str(args.peers), "--averaging", "moshpit",
                               "--min-group-size", str(args.peers),
                               "--privacy-delta", f"{DELTA:g}"]
                    row = swarm_row(setting, privacy, steps, args.peers, shards, address, None, inner_steps,
                                    args.batch_size)
                    row["noise_multiplier"] = args.update_noise
            except Exception as error:  # one row's failure must not lose the others
                log(f"{setting}: FAILED: {error}")
                row = {"setting": setting, "target_epsilon": epsilon, "error": str(error).splitlines()[0]}
            else:
                log(f"{setting}: accuracy {row['accuracy']:.3f}, epsilon {fmt(row.get('epsilon'))}, "
                    f"{row['seconds']:.0f} s")
            rows.append(row)
    finally:
        bootstrap.stop(5.0)
    report = {"task": TASK, "peers": args.peers, "data_shards": shards, "epochs": epochs, "steps": steps,
              "inner_steps": inner_steps, "batch_size": args.batch_size, "opacus_batch_size": opacus_batch,
              "delta": DELTA, "clip": CLIP, "rows": rows, "checks": compare(rows)}
    console = Console(stderr=args.json, width=160)
    console.print(table(rows, epochs, args.peers))
    for check in report["checks"]:
        verdict = {True: "yes", False: "NO", None: "(not a bar)"}[check["ok"]]
        console.print(f"{check['check']}: {check['value']:.3g} -> {verdict}")
    if args.json:
        print(json.dumps(report))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
