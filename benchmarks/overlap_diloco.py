"""What an overlapped round costs DiLoCo per outer step, and the outer momentum that costs least:
offline and seeded.

    python benchmarks/overlap_diloco.py [--json] [--quick] [--task fashion-mnist-large]
        [--momenta 0.9,0.6] [--rounds 7] [--inner-steps 20] [--workers 4] [--land-after 20] [--seeds 0,1]

--workers DiLoCo workers live in this one process (no network, exact averages: the codec is beside
the point here), each with its own shard and inner optimizer (the task's defaults), all starting
from the model built under torch seed S. Two schedules per outer momentum:

- ``turn``: every inner phase ends with the round; the average is applied before training goes on;
- ``overlap``: the round of phase t travels while phase t+1 runs, as ``overlap = "on"`` does
  (peer/driver.py): at the launch each worker takes the eager outer step on its own pseudo-gradient
  (``DiLoCoPolicy.launch``), trains ``--land-after`` steps, then the swarm's average lands
  (``DiLoCoPolicy.land``: the step taken again on the average, the progress made meanwhile put back
  on top), and the phase's remaining steps run. ``--land-after`` = ``--inner-steps`` is a round as
  long as the inner phase (the bandwidth sweep at 5 Mbit/s); 14 of 20 is 10 Mbit/s's.

After each outer step the swarm's model (the common start, without local progress: what the sweep
evaluates) is scored on the task's held-out set; the table gives the mean over seeds per round.

Measured (2 seeds, fashion-mnist-large, 4 workers, 20 inner steps, outer lr 0.7; session 18):
accuracy after 5/6/7 outer steps in turn 0.841/0.854/0.865 at momentum 0.9 and 0.846/0.855/0.862
at 0.6; overlapped (landing at the end of the next phase) 0.827/0.835/0.845 at 0.9, 0.832/0.841/0.854
at 0.6 (0.834/0.841/0.853 at 0.7, 0.834/0.844/0.852 at 0.5). A round one phase late acts as momentum
of its own (asynchrony begets momentum: Mitliagkas et al., arXiv 1605.09774), so the outer momentum
tuned for rounds in turn overshoots; at 0.6 an overlapped swarm loses about half as much per step,
and rounds in turn lose nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from rich.console import Console
from rich.table import Table

from swarmgrad.peer.strategies.diloco import DiLoCo, DiLoCoPolicy
from swarmgrad.tasks import endless_batches, get_task
from swarmgrad.tasks.train import make_optimizer

SCHEDULES = ("turn", "overlap")
QUICK = {"task": "digits", "momenta": [0.9], "rounds": 3, "inner_steps": 5, "workers": 2, "seeds": [0]}


def run_schedule(task_name: str, schedule: str, momentum: float, seed: int, rounds: int, inner_steps: int,
                 workers: int, land_after: int) -> list[float]:
    """Held-out accuracy of the swarm's model after each of ``rounds`` outer steps."""
    task = get_task(task_name)
    hparams = dict(task.default_hparams)
    batch_size = int(hparams.get("batch_size", 64))
    torch.manual_seed(seed)
    model = task.make_model()
    settings = DiLoCo(inner_steps=inner_steps, outer_momentum=momentum)
    policies, streams = [], []
    for worker in range(workers):
        replica = copy.deepcopy(model)
        policies.append(DiLoCoPolicy(settings, replica, make_optimizer(replica.parameters(), hparams), None))
        streams.append(endless_batches(task.train_data(worker, workers, seed), batch_size, seed * 1000 + worker))

    def train(steps: int) -> None:
        for policy, stream in zip(policies, streams):
            policy.model.train()
            for _ in range(steps):
                inputs, targets = next(stream)
                task.loss_fn(policy.model(inputs), targets).backward()
                policy.optimizer.step()
                policy.optimizer.zero_grad(set_to_none=True)

    accuracies = []
    if schedule == "turn":
        for _ in range(rounds):
            train(inner_steps)
            for policy in policies:
                policy.prepare()
            average = torch.stack([policy.contribution for policy in policies]).mean(0)
            for policy in policies:
                policy.apply(average)
            accuracies.append(task.evaluate(policies[0].model)["accuracy"])
        return accuracies
    train(inner_steps)
    sent = [policy.launch() for policy in policies]
    for _ in range(rounds):
        train(land_after)
        average = torch.stack(sent).mean(0)
        for policy in policies:
            policy.land(average)
        accuracies.append(task.evaluate(swarm_model(policies[0]))["accuracy"])
        train(inner_steps - land_after)
        sent = [policy.launch() for policy in policies]
    return accuracies


def swarm_model(policy: DiLoCoPolicy) -> torch.nn.Module:
    """A copy of the policy's model at the swarm's new start, without the local progress on top."""
    starts = {id(param): start for param, start in zip(policy.params, policy.outer_params())}
    model = copy.deepcopy(policy.model)
    model.load_state_dict({key: starts.get(id(value), value) for key, value in
                           policy.model.state_dict(keep_vars=True).items()})
    return model


def run(task: str, momenta: list[float], rounds: int, inner_steps: int, workers: int, land_after: int,
        seeds: list[int]) -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    for momentum in momenta:
        for schedule in SCHEDULES:
            per_seed = [run_schedule(task, schedule, momentum, seed, rounds, inner_steps, workers, land_after)
                        for seed in seeds]
            rows.append({"schedule": schedule, "momentum": momentum, "per_seed": per_seed,
                         "mean": [statistics.fmean(values) for values in zip(*per_seed)]})
    return {"task": task, "rounds": rounds, "inner_steps": inner_steps, "workers": workers,
            "land_after": land_after, "seeds": seeds, "rows": rows, "seconds": time.perf_counter() - started}


def print_table(result: dict) -> None:
    table = Table(title=f"{result['task']}: {result['workers']} workers, {result['inner_steps']} inner steps, "
                        f"overlapped rounds land after {result['land_after']}; mean accuracy over seeds "
                        f"{result['seeds']}")
    table.add_column("schedule")
    table.add_column("momentum", justify="right")
    for index in range(result["rounds"]):
        table.add_column(f"step {index + 1}", justify="right")
    for row in result["rows"]:
        table.add_row(row["schedule"], f"{row['momentum']:g}", *(f"{value:.3f}" for value in row["mean"]))
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="a seconds-long run (digits, 2 workers, 3 short rounds)")
    parser.add_argument("--task", default="fashion-mnist-large")
    parser.add_argument("--momenta", default="0.9,0.6", help="comma-separated outer momenta")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--land-after", type=int, default=None,
                        help="inner steps of the next phase before an overlapped round lands (default: all of them)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated torch seeds; the mean is reported")
    args = parser.parse_args()
    options = {"task": args.task, "momenta": [float(m) for m in args.momenta.split(",")], "rounds": args.rounds,
               "inner_steps": args.inner_steps, "workers": args.workers,
               "seeds": [int(s) for s in args.seeds.split(",")]}
    if args.quick:
        options.update(QUICK)
    land_after = options["inner_steps"] if args.land_after is None else args.land_after
    if not 0 <= land_after <= options["inner_steps"]:
        parser.error(f"--land-after must lie in [0, --inner-steps], got {land_after}")
    result = run(**options, land_after=land_after)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
