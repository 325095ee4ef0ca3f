"""What ``swarmgrad peer`` runs: a built-in (or ``module:attribute``) task trained by a Peer, with
evaluations, stop conditions and progress events.

Run options (what every peer of a run must share) come from flags when the run is created and
from the run's manifest when a volunteer joins; local options (shard, threads, stop conditions,
network) are each peer's own.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer.manifest import RunManifest, check_compatible, read_manifest, wait_for_manifest
from swarmgrad.peer.peer import Peer
from swarmgrad.peer.settings import averaging_from_dict
from swarmgrad.peer.strategies import strategy_from_dict
from swarmgrad.runtime import run
from swarmgrad.tasks import Task, get_task
from swarmgrad.tasks.base import endless_batches
from swarmgrad.tasks.train import make_optimizer

logger = logging.getLogger(__name__)

DEFAULT_RUN_OPTIONS: dict[str, Any] = {
    "strategy": {"name": "diloco", "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9},
    "averaging": {"kind": "moshpit"},
    "compression": "int8",
    "privacy": None,
    "hparams": {},
    "seed": 0,
}
PROGRESS_EVERY = 1.0

Emit = Callable[[dict[str, Any]], None]


@dataclass
class LocalOptions:
    """Each peer's own choices: which data, how long, where to keep checkpoints."""

    shard: int | None = None
    num_shards: int | None = None
    data_dir: str | None = None
    max_seconds: float | None = None
    max_steps: int | None = None
    target_accuracy: float | None = None
    eval_every: float = 10.0  # seconds between held-out evaluations; 0 = only at the end
    eval_batches: int | None = None
    final_eval: bool = True
    checkpoint_dir: Path | None = None
    threads: int | None = None
    trusted_network: bool = False
    progress_refresh: float = 1.0
    wait_peers: int = 1  # wait until this many peers train in the run before starting
    slowdown: float = 1.0  # emulate slower hardware: each local step takes this many times longer
    wait_seconds: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_run(config: NodeConfig, run_id: str, task: str | None, create: bool,
                explicit: dict[str, Any], wait_seconds: float) -> tuple[str, dict[str, Any], RunManifest | None]:
    """Decide the task and run options: from flags (creating or private runs) or the run's manifest."""

    async def fetch() -> RunManifest | None:
        reader = NodeConfig(**(config.model_dump() | {"client_mode": True, "port": 0, "identity_path": None}))
        async with SwarmNode(reader) as node:
            if task is None and not create:
                return await wait_for_manifest(node, run_id, wait_seconds)
            return await read_manifest(node, run_id)

    manifest = run(fetch())
    if create:
        if task is None:
            raise ConfigError("--create needs the TASK to train")
        options = _merge(DEFAULT_RUN_OPTIONS, explicit)
        created = RunManifest.create(task, options, _fingerprint(task, explicit_data_dir(explicit)))
        if manifest is not None and manifest.digest != created.digest:
            raise StartupError(f"run {run_id!r} already exists with other settings (task {manifest.task!r}); "
                               "join it without --create, or pick another --run-id")
        return task, options, manifest or created
    if manifest is None:
        assert task is not None
        logger.warning("run %r has no manifest: training with this peer's flags (use --create to publish them)", run_id)
        return task, _merge(DEFAULT_RUN_OPTIONS, explicit), None
    options = manifest.options
    conflicts = [key for key, value in explicit.items() if key in options and options[key] != value]
    if conflicts:
        raise ConfigError(f"run {run_id!r} fixes {', '.join(sorted(conflicts))} in its manifest; drop those flags "
                          f"to join it (the run uses {json.dumps({k: options[k] for k in sorted(conflicts)})})")
    return task or manifest.task, options, manifest  # a different TASK is refused by check_compatible


def explicit_data_dir(explicit: dict[str, Any]) -> str | None:
    return explicit.get("_data_dir")


def load_task(name: str, data_dir: str | None) -> Task:
    """``--data-dir`` goes to the Fashion-MNIST tasks only; the others read no files."""
    return get_task(name, data_dir=data_dir) if name.startswith("fashion-mnist") else get_task(name)


def _fingerprint(task: str, data_dir: str | None) -> str | None:
    spec = load_task(task, data_dir)
    return spec.data_fingerprint() if spec.data_fingerprint else None


def _merge(defaults: dict[str, Any], explicit: dict[str, Any]) -> dict[str, Any]:
    merged = {key: (dict(value) if isinstance(value, dict) else value) for key, value in defaults.items()}
    for key, value in explicit.items():
        if key.startswith("_"):
            continue
        merged[key] = value
    return merged


def train(run_id: str, task_name: str, options: dict[str, Any], local: LocalOptions, network: NodeConfig,
          manifest: RunManifest | None, emit: Emit) -> dict[str, Any]:
    """Train until a stop condition or SIGTERM/SIGINT; returns the final summary (also emitted as ``done``)."""
    if local.threads:
        torch.set_num_threads(local.threads)
    task = load_task(task_name, local.data_dir)
    if manifest is not None:
        check_compatible(manifest, task_name, task.data_fingerprint() if task.data_fingerprint else None)
    hparams = {**task.default_hparams, **options.get("hparams", {})}
    batch_size = int(hparams.get("batch_size", 64))
    strategy = strategy_from_dict(options["strategy"])
    averaging = averaging_from_dict(options["averaging"])
    privacy = Privacy.parse(**options["privacy"]) if options.get("privacy") else None
    shard, num_shards = _shard(local, network)
    torch.manual_seed(int(options.get("seed", 0)))  # every peer starts from the same weights
    model = task.make_model()
    optimizer = make_optimizer(model.parameters(), hparams)
    dataset = task.train_data(shard, num_shards, int(options.get("seed", 0)))
    batches = endless_batches(dataset, batch_size, seed=shard)
    stop = _StopSignal()
    peer = Peer(model, optimizer, run_id=run_id, strategy=strategy, averaging=averaging,
                compression=options.get("compression", "none"), privacy=privacy, batch_size=batch_size,
                dataset_size=len(dataset), checkpoint_dir=local.checkpoint_dir, network=network,
                trusted_network=local.trusted_network, progress_refresh=local.progress_refresh, manifest=manifest)
    reason, final, started = "stopped", None, time.time()
    with stop, peer:
        if local.wait_peers > 1:
            peer.wait_for_peers(local.wait_peers, local.wait_seconds)
        emit({"event": "ready", "peer_id": peer.peer_id, "maddrs": peer.maddrs, "shard": shard,
              "num_shards": num_shards, "epoch": peer.epoch, "step": peer.status().step, "task": task_name,
              "options": options, "state_downloads": peer.status().state_downloads})
        # the first evaluation comes after the first step: a joiner's shows the state it downloaded
        last_progress, last_eval, eval_epoch = 0.0, -float("inf"), -1
        while True:
            if stop.received:
                reason = f"signal {stop.received}"
                break
            elapsed = time.time() - started
            if local.max_seconds is not None and elapsed >= local.max_seconds:
                reason = "max_seconds"
                break
            if local.max_steps is not None and peer.status().step >= local.max_steps:
                reason = "max_steps"
                break
            tick = time.monotonic()
            inputs, targets = next(batches)
            loss = task.loss_fn(model(inputs), targets)
            loss.backward()
            if local.slowdown > 1:  # forward and backward dominate a step: stretch them, not averaging
                time.sleep((local.slowdown - 1) * (time.monotonic() - tick))
            peer.step(batch_size=len(targets), loss=loss)
            now = time.monotonic()
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                emit(_progress_event(peer))
            if local.eval_every > 0 and now - last_eval >= local.eval_every and peer.epoch != eval_epoch:
                evaluated_at = time.time()  # the model's time: the event says when it had this accuracy
                # say so first: a long evaluation (seconds on a big model) is not a hung round
                emit({**_progress_event(peer), "evaluating": True})
                metrics = task.evaluate(model, max_batches=local.eval_batches)
                last_eval, eval_epoch = time.monotonic(), peer.epoch
                emit({"event": "eval", "t": evaluated_at, "peer_id": peer.peer_id, "step": peer.status().step,
                      "epoch": peer.epoch, **_finite_metrics(metrics)})
                if local.target_accuracy is not None and metrics["accuracy"] >= local.target_accuracy:
                    reason, final = "target_accuracy", metrics
                    break
        emit(_progress_event(peer))
        if final is None and local.final_eval:
            final = task.evaluate(model)
        status = peer.status()
    summary = {"event": "done", "peer_id": status.peer_id, "step": status.step, "epoch": status.epoch,
               "reason": reason, "final": None if final is None else _finite_metrics(final),
               "status": status.to_json(), "seconds": time.time() - started}
    emit(summary)
    return summary


def _finite_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    """Accuracy and loss for an event; a diverged model's NaN/Inf loss becomes None (JSON has no NaN,
    and the peer must still report its evaluation and leave cleanly)."""
    return {key: float(metrics[key]) if math.isfinite(metrics[key]) else None for key in ("accuracy", "loss")}


def _progress_event(peer: Peer) -> dict[str, Any]:
    status = peer.status().to_json()
    status.pop("last_report", None)
    return {"event": "progress", **status}


def _shard(local: LocalOptions, network: NodeConfig) -> tuple[int, int]:
    """An explicit shard, or one picked at random: volunteers of a public run spread over the data."""
    num_shards = local.num_shards or 1
    if local.shard is None:
        return secrets.randbelow(num_shards), num_shards
    if not 0 <= local.shard < num_shards:
        raise ConfigError(f"--shard must be within 0..{num_shards - 1} (--num-shards {num_shards}), got {local.shard}")
    return local.shard, num_shards


class _StopSignal:
    """SIGTERM/SIGINT end the training loop between steps, so the peer leaves and checkpoints cleanly."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name


def json_lines(event: dict[str, Any]) -> None:
    """Emit events as JSON lines on stdout (what ``swarmgrad demo`` and scripts read)."""
    sys.stdout.write(json.dumps({"t": time.time(), **event}, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()
