"""Single-process training of a task: the reference the swarm is measured against, and a smoke test."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from swarmgrad.errors import ConfigError
from swarmgrad.tasks.base import Task, endless_batches

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


def make_optimizer(params: Any, hparams: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer a task's ``default_hparams`` (or overrides of them) name.

    Hyperparameters read here and by ``make_schedule`` / ``clip_gradients`` (their one definition):
    ``optimizer`` (adam, adamw, sgd), ``lr``, ``weight_decay``, ``momentum`` (sgd),
    ``decay_norms_and_biases`` (default true; false keeps weight decay off every parameter of
    fewer than 2 dimensions: norms' gains and biases, as GPT training does), ``warmup_steps`` and
    ``decay_steps`` (linear warm-up, then a cosine from ``lr`` to ``min_lr_ratio`` x ``lr`` over
    ``decay_steps``; 0 = none), ``grad_clip`` (the gradients' largest global L2 norm; 0 = none).
    """
    name = str(hparams.get("optimizer", "adam")).lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    decay = float(hparams.get("weight_decay", 0.0))
    kwargs: dict[str, Any] = {"lr": float(hparams.get("lr", 1e-3)), "weight_decay": decay}
    if name == "sgd":
        kwargs["momentum"] = float(hparams.get("momentum", 0.9))
    if not hparams.get("decay_norms_and_biases", True):
        params = list(params)
        params = [{"params": [p for p in params if p.ndim >= 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        params = [group for group in params if group["params"]]
    return OPTIMIZERS[name](params, **kwargs)


def make_schedule(optimizer: torch.optim.Optimizer, hparams: dict[str, Any]) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Warm-up and cosine decay of the learning rate per local step (``make_optimizer`` says which
    hyperparameters); None when the task asks for neither."""
    warmup, decay = int(hparams.get("warmup_steps", 0)), int(hparams.get("decay_steps", 0))
    floor = float(hparams.get("min_lr_ratio", 0.1))
    if warmup < 0 or decay < 0 or not 0 <= floor <= 1:
        raise ConfigError(f"warmup_steps and decay_steps must be >= 0 and min_lr_ratio in [0, 1]; "
                          f"got {warmup}, {decay}, {floor}")
    if not warmup and not decay:
        return None

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not decay:
            return 1.0
        progress = min(1.0, (step - warmup) / decay)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(params: Any, hparams: dict[str, Any]) -> None:
    """Scale the gradients down to a global L2 norm of ``grad_clip`` at most (0 or absent: untouched)."""
    limit = float(hparams.get("grad_clip", 0.0))
    if limit > 0:
        torch.nn.utils.clip_grad_norm_(params, limit)


@dataclass
class LocalRun:
    """What ``train_locally`` saw: evaluations over time and when each target accuracy was first met."""

    steps: int = 0
    train_seconds: float = 0.0  # optimisation only; evaluations are not counted
    history: list[dict[str, float]] = field(default_factory=list)
    reached: dict[float, dict[str, float]] = field(default_factory=dict)  # target -> {step, train_seconds, wall}

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1] if self.history else {}


def train_locally(task: Task, *, max_steps: int | None = None, max_seconds: float | None = None,
                  eval_every: int = 200, targets: tuple[float, ...] = (), seed: int = 0,
                  eval_batches: int | None = None, hparams: dict[str, Any] | None = None,
                  on_eval: Callable[[dict[str, float]], None] | None = None) -> LocalRun:
    """Train ``task``'s model on the whole training set in this process, evaluating every ``eval_every`` steps.

    Stops at ``max_steps``, after ``max_seconds`` of training, or once every target accuracy is met.
    """
    if max_steps is None and max_seconds is None:
        raise ConfigError("train_locally needs max_steps or max_seconds (a target may never be reached)")
    settings = {**task.default_hparams, **(hparams or {})}
    torch.manual_seed(seed)
    model = task.make_model()
    optimizer = make_optimizer(model.parameters(), settings)
    schedule = make_schedule(optimizer, settings)
    stream = endless_batches(task.train_data(0, 1, seed), int(settings.get("batch_size", 64)), seed)
    run, started = LocalRun(), time.perf_counter()

    def evaluate() -> None:
        metrics = {**task.evaluate(model, max_batches=eval_batches), "step": float(run.steps),
                   "train_seconds": run.train_seconds, "wall_seconds": time.perf_counter() - started}
        run.history.append(metrics)
        for target in targets:
            if target not in run.reached and metrics["accuracy"] >= target:
                run.reached[target] = {key: metrics[key] for key in ("step", "train_seconds", "wall_seconds")}
        if on_eval:
            on_eval(metrics)

    model.train()
    while True:
        done = ((max_steps is not None and run.steps >= max_steps)
                or (max_seconds is not None and run.train_seconds >= max_seconds)
                or (targets and len(run.reached) == len(targets)))
        if done:
            break
        tick = time.perf_counter()
        for _ in range(eval_every if max_steps is None else min(eval_every, max_steps - run.steps)):
            inputs, labels = next(stream)
            optimizer.zero_grad(set_to_none=True)
            task.loss_fn(model(inputs), labels).backward()
            clip_gradients(model.parameters(), settings)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            run.steps += 1
            if max_seconds is not None and run.train_seconds + time.perf_counter() - tick >= max_seconds:
                break  # the budget holds between evaluations too (eval_every may be far off)
        run.train_seconds += time.perf_counter() - tick
        evaluate()
    return run
