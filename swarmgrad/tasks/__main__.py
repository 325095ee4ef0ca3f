"""``python -m swarmgrad.tasks TASK``: train one task in one process and time it to target accuracies.

This is the baseline the swarm demo is compared with ("one process reaches 85% in N s").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from swarmgrad.errors import SwarmgradError
from swarmgrad.tasks import get_task
from swarmgrad.tasks.train import train_locally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmgrad.tasks", description=__doc__)
    parser.add_argument("task", help="registered name (fashion-mnist, digits, charlm) or module:attribute")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seconds", type=float, default=90.0, help="stop after this much training time")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--target", type=float, action="append", default=None,
                        help="accuracy to time (repeatable); stops early once all are reached")
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations")
    parser.add_argument("--data-dir", default=None, help="fashion-mnist: directory with the IDX files")
    parser.add_argument("--batch-size", type=int, default=None, help="override the task's default batch size")
    parser.add_argument("--lr", type=float, default=None, help="override the task's default learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON summary instead of progress lines")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    targets = tuple(args.target or ())
    overrides = {key: value for key, value in (("batch_size", args.batch_size), ("lr", args.lr)) if value is not None}

    def show(metrics: dict[str, float]) -> None:
        if not args.json:
            print(f"step {int(metrics['step']):6d}  train {metrics['train_seconds']:6.1f} s  "
                  f"loss {metrics['loss']:.4f}  accuracy {metrics['accuracy']:.4f}", flush=True)

    try:
        task = get_task(args.task, data_dir=args.data_dir)
        run = train_locally(task, max_steps=args.steps, max_seconds=args.seconds, eval_every=args.eval_every,
                            targets=targets, seed=args.seed, on_eval=show, hparams=overrides)
    except SwarmgradError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = {"task": task.name, "threads": args.threads, "hparams": {**task.default_hparams, **overrides},
               "steps": run.steps, "train_seconds": round(run.train_seconds, 2), "final": run.final,
               "reached": {str(t): run.reached.get(t) for t in targets}}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{task.name}: {run.steps} steps, {run.train_seconds:.1f} s of training, "
          f"final accuracy {run.final.get('accuracy', float('nan')):.4f}")
    for target in targets:
        reached = run.reached.get(target)
        print(f"reached {target:.2%}: " + (f"step {int(reached['step'])}, {reached['train_seconds']:.1f} s of training"
                                           if reached else "no"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
