"""What ``swarmgrad peer`` runs: a built-in (or ``module:attribute``) task trained by a Peer, with
evaluations, stop conditions and progress events.

Run settings (a RunConfig: what every peer of a run must share) come from this peer's options
when the run is created and from the run's manifest when a volunteer joins; its own settings (a
PeerConfig: shard, threads, stop conditions, network) are each peer's own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import functools
import json
import logging
import math
import secrets
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from swarmgrad.device.microbatch import accumulate_gradients, largest_micro_batch
from swarmgrad.device.placement import Precision, move_batch, resolve_device, resolve_precision
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.evaluator import BackgroundEvaluator
from swarmgrad.peer.open_run import OpenRun
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.tasks import Task, get_task
from swarmgrad.tasks.base import dataset_size, endless_batches
from swarmgrad.tasks.train import clip_gradients, make_optimizer, make_schedule

if TYPE_CHECKING:
    from swarmgrad.peer.metrics import PeerMetrics
    from swarmgrad.peer.peer import Peer

logger = logging.getLogger(__name__)

PROGRESS_EVERY = 1.0
# A training loop that has not seen SIGTERM/SIGINT this long after it came prints every thread's stack
# on stderr (the peer's log), before a supervisor's grace ends (the demo's 10 s, the lab's 15 s)
STUCK_DUMP_SECONDS = 6.0

Emit = Callable[[dict[str, Any]], None]


def no_initial_peers(run_id: str) -> str:
    return (f"run {run_id!r}: nobody to join through; pass --initial-peers MADDR (the address of any peer "
            "of the run) to join it, or --create to start it as its first peer")


def open_run(config: RunConfig, local: PeerConfig) -> OpenRun:
    """The run, opened with this peer's own node (``with`` it, then ``train``): its settings settled
    once against the run's manifest (waiting for one when no TASK was given), this peer's data
    checked against the run's."""
    if local.create and config.task is None:
        raise ConfigError("--create needs the TASK to train")
    if not local.network.initial_peers and not local.create:
        raise ConfigError(no_initial_peers(local.run_id))
    joining_blind = config.task is None and not local.create
    return OpenRun(config=config, peer=local,
                   fingerprint=lambda task: _fingerprint(task, local.data.data_dir, config.task_options),
                   wait_for_manifest=local.connection.wait if joining_blind else None)


def load_task(name: str, data_dir: str | None, options: Mapping[str, Any]) -> Task:
    """The task ``name`` with the run's task options (``--task-option``); tasks that read no files
    ignore ``data_dir``. Settling the run reads its data fingerprint, and training the same task."""
    return _load_task(name, data_dir, tuple(sorted(options.items())))


@functools.cache
def _load_task(name: str, data_dir: str | None, options: tuple[tuple[str, Any], ...]) -> Task:
    return get_task(name, dict(options), data_dir)


def _fingerprint(task: str, data_dir: str | None, options: Mapping[str, Any]) -> str | None:
    spec = load_task(task, data_dir, options)
    return spec.data_fingerprint() if spec.data_fingerprint else None


def train(run: OpenRun, local: PeerConfig, emit: Emit, announce: Callable[[list[str]], None] | None = None,
          metrics: PeerMetrics | None = None) -> dict[str, Any]:
    """Train the task of the opened ``run`` (``open_run``) with its settings until a stop condition or
    SIGTERM/SIGINT; returns the final summary (also emitted as ``done``). SIGUSR1 pauses the peer,
    SIGUSR2 resumes it (events ``paused`` and ``resumed``); a paused peer computes no batches.
    ``announce(maddrs)`` is called once the peer listens, before it waits for ``--wait-peers``.
    ``metrics``: a served PeerMetrics, which then reports this peer. Every held-out evaluation is
    published as this peer's evaluation record of the run."""
    config = run.config
    if config.task is None:
        raise ConfigError("no task to train: give the TASK, or join a run that has a manifest")
    if local.compute.threads:
        torch.set_num_threads(local.compute.threads)
    task_name = config.task
    task = load_task(task_name, local.data.data_dir, config.task_options)
    hparams = {**task.default_hparams, **config.hparams}
    batch_size = int(hparams.get("batch_size", 64))
    shard, num_shards = _shard(local)
    device = resolve_device(local.compute.device)
    precision = resolve_precision(local.compute.precision, device)
    torch.manual_seed(config.seed)  # every peer starts from the same weights (made on the CPU: the same everywhere)
    model = task.make_model().to(device)
    optimizer = make_optimizer(model.parameters(), hparams)
    schedule = make_schedule(optimizer, hparams)
    dataset = task.train_data(shard, num_shards, config.seed)
    batches = endless_batches(dataset, batch_size, seed=shard)
    scaler = precision.make_scaler()
    micro_batch = _micro_batch(local, config, model, task, precision, batch_size, dataset, device)
    stop, pauses = _StopSignal(), _PauseSignal()
    connection = local.connection
    peer = run.peer(model, optimizer, batch_size=batch_size, dataset_size=dataset_size(dataset), grad_scaler=scaler)
    if metrics is not None:
        metrics.attach(peer)
    reason, final = "stopped", None
    with stop, pauses, peer, BackgroundEvaluator(task, model, local.evaluation.batches) as evaluator:
        pauses.attach(peer)
        stop.attach(peer)
        if announce is not None:
            announce(peer.maddrs)
        if connection.wait_peers > 1:
            peer.wait_for_peers(connection.wait_peers, connection.wait)
        emit({"event": "ready", "peer_id": peer.peer_id, "maddrs": peer.maddrs, "shard": shard,
              "num_shards": num_shards, "device": str(device), "precision": precision.name,
              "micro_batch": micro_batch, "epoch": peer.epoch, "step": peer.status().step, "task": task_name,
              "options": run_options(config), "state_downloads": peer.status().state_downloads,
              "metrics_url": metrics.url if metrics is not None else None})
        # the budget is training time: a slow start or a wait for others must not eat into it
        started = time.time()
        last_progress, last_eval, eval_epoch = 0.0, -float("inf"), -1
        if local.evaluation.every > 0 and peer.status().state_downloads and _offer_evaluation(peer, evaluator, emit):
            last_eval, eval_epoch = time.monotonic(), peer.epoch  # a joiner's first: the state it took, untrained
        while True:
            if stop.received:
                reason = f"signal {stop.received}"
                break
            elapsed = time.time() - started
            if local.stop.max_seconds is not None and elapsed >= local.stop.max_seconds:
                reason = "max_seconds"
                break
            if local.stop.max_steps is not None and peer.status().step >= local.stop.max_steps:
                reason = "max_steps"
                break
            for kind in pauses.changes():
                emit({**_progress_event(peer), "event": kind})
            if peer.paused:  # no batches: an edge device paused to save its battery or its link
                peer.wait_while_paused(PROGRESS_EVERY)
                if time.monotonic() - last_progress >= PROGRESS_EVERY:
                    last_progress = time.monotonic()
                    emit(_progress_event(peer))
                continue
            tick = time.monotonic()
            inputs, targets = next(batches)
            inputs, targets = move_batch(inputs, device), move_batch(targets, device)
            loss = accumulate_gradients(model, task.loss_fn, inputs, targets, micro_batch, precision, scaler)
            if scaler is not None and hparams.get("grad_clip"):
                scaler.unscale_(optimizer)  # clip the true gradients; the peer's step sees them unscaled
            clip_gradients(model.parameters(), hparams)
            if local.compute.slowdown > 1:  # forward and backward dominate a step: stretch them, not averaging
                time.sleep((local.compute.slowdown - 1) * (time.monotonic() - tick))
            peer.step(batch_size=len(targets), loss=loss)
            if schedule is not None:
                schedule.step()
            now = time.monotonic()
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                emit(_progress_event(peer))
            result = _report_evaluation(peer, evaluator.poll(), emit)
            target = local.stop.target_accuracy
            if result is not None and target is not None and result["accuracy"] >= target:
                reason, final = "target_accuracy", result
                break
            if local.evaluation.every > 0 and now - last_eval >= local.evaluation.every and peer.epoch != eval_epoch:
                last_eval = now  # the next point is --eval-every from this one, whether this one runs or not
                if _offer_evaluation(peer, evaluator, emit):
                    eval_epoch = peer.epoch
        faulthandler.cancel_dump_traceback_later()  # the loop saw the signal: no stack to show
        if final is None:  # the evaluation under way when training stopped is reported, then the final state's
            evaluator.wait()
            _report_evaluation(peer, evaluator.poll(), emit)
        emit(_progress_event(peer))
        if final is None and local.evaluation.final:
            evaluated_at = time.time()
            final = task.evaluate(model)
            # the peer leaves right after: wait (briefly) for the record, or it would be cut off
            with contextlib.suppress(Exception):  # a failure is logged by _publish
                _publish(peer, final, evaluated_at).result(timeout=2 * local.network.request_timeout + 1)
        status = peer.status()
    faulthandler.cancel_dump_traceback_later()  # a signal during the final evaluation or the leave: done now
    summary = {"event": "done", "peer_id": status.peer_id, "step": status.step, "epoch": status.epoch,
               "reason": reason, "final": None if final is None else _finite_metrics(final),
               "status": status.to_json(), "seconds": time.time() - started, "evaluations_skipped": evaluator.skipped,
               "peak_device_memory": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    emit(summary)
    return summary


def _micro_batch(local: PeerConfig, config: RunConfig, model: torch.nn.Module, task: Task, precision: Precision,
                 batch_size: int, dataset: Any, device: torch.device) -> int:
    """--micro-batch, or the largest that fits the device (probed on a batch of the training data)."""
    chosen = local.compute.micro_batch
    if chosen is None and device.type != "cuda":
        chosen = batch_size  # host memory is not probed: a peer that cannot hold a batch sets --micro-batch
    if chosen is None:
        sample = next(endless_batches(dataset, batch_size, seed=0))
        inputs, targets = move_batch(sample[0], device), move_batch(sample[1], device)

        def one_pass(size: int) -> None:
            accumulate_gradients(model, task.loss_fn, inputs[:size], targets[:size], size, precision)

        chosen = largest_micro_batch(batch_size, one_pass, device)
        model.zero_grad(set_to_none=True)
    chosen = min(chosen, batch_size)
    if chosen < batch_size and config.privacy is not None and config.privacy.level == "sample":
        raise ConfigError(f"--micro-batch {chosen} < the batch size {batch_size}: per-sample privacy clips each "
                          "sample of a whole batch at once; raise --micro-batch or lower the batch size")
    return chosen


def _offer_evaluation(peer: Peer, evaluator: BackgroundEvaluator, emit: Emit) -> bool:
    """Evaluate the swarm's model (``Peer.swarm_model``; else the model as it is now) in the
    background; False if the last one still runs."""
    # the snapshot's time, step and epoch: the event says when the model had this accuracy
    if not evaluator.offer({"t": time.time(), "step": peer.status().step, "epoch": peer.epoch}, peer.swarm_model()):
        return False
    emit({**_progress_event(peer), "evaluating": True})
    return True


def _report_evaluation(peer: Peer, finished: tuple[dict[str, float], dict[str, Any]] | None,
                       emit: Emit) -> dict[str, float] | None:
    """Publish and emit a finished background evaluation (``evaluator.poll()``); its metrics, or None."""
    if finished is None:
        return None
    result, snapshot = finished
    _publish(peer, result, snapshot["t"])  # for the run's dashboards; training goes on meanwhile
    # t, step and epoch are the snapshot's: readers compare evaluations of the same state
    emit({"event": "eval", **snapshot, "peer_id": peer.peer_id, **_finite_metrics(result)})
    return result


def _publish(peer: Peer, metrics: dict[str, float], evaluated_at: float) -> concurrent.futures.Future[bool]:
    """Publish an evaluation without waiting for the DHT; a failure is one warning (the next one may get through)."""
    samples = metrics.get("samples")
    future = peer.publish_evaluation(metrics["accuracy"], metrics.get("loss"), evaluated_at=evaluated_at,
                                     samples=int(samples) if samples is not None and samples >= 1 else None)
    future.add_done_callback(_log_unpublished)
    return future


def _log_unpublished(future: concurrent.futures.Future[bool]) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is not None or not future.result():
        logger.warning("could not publish the evaluation record%s", f": {error}" if error is not None else "")


def run_options(config: RunConfig) -> dict[str, Any]:
    """The run settings as the ``ready`` event reports them (the manifest's shape: all but the task)."""
    return json.loads(config.settings_json())


def _finite_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    """Accuracy and loss (and a language task's bits per byte) for an event; a diverged model's NaN/Inf
    loss becomes None (JSON has no NaN, and the peer must still report its evaluation and leave cleanly)."""
    return {key: float(metrics[key]) if math.isfinite(metrics[key]) else None
            for key in ("accuracy", "loss", "bits_per_byte") if key in metrics}


def _progress_event(peer: Peer) -> dict[str, Any]:
    status = peer.status().to_json()
    status.pop("last_report", None)
    return {"event": "progress", **status}


def _shard(local: PeerConfig) -> tuple[int, int]:
    """An explicit shard, or one picked at random: volunteers of a public run spread over the data."""
    data = local.data
    if data.shard is None:
        return secrets.randbelow(data.num_shards), data.num_shards
    return data.shard, data.num_shards  # within range: PeerConfig checks it


class _StopSignal:
    """SIGTERM/SIGINT end the training loop between steps, so the peer leaves and checkpoints cleanly.
    A swarm step under way is left at once (``Peer.interrupt``): its matchmaking may wait for a
    member that already left (up to a window), and the training loop would only see the signal
    after it, too late for a supervisor's grace period (the demo killed such a peer before it
    reported its last progress)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._peer: Peer | None = None

    def attach(self, peer: Peer) -> None:
        self._peer = peer
        if self.received is not None:
            peer.interrupt()

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._peer = None

    def _handle(self, signum: int, _frame: Any) -> None:
        first = self.received is None
        self.received = signal.Signals(signum).name
        if first:
            # if the loop never gets to see it, the log says where every thread waits (cancelled once it does)
            faulthandler.dump_traceback_later(STUCK_DUMP_SECONDS, exit=False)
            if self._peer is not None:
                self._peer.interrupt()  # returns at once; the round's task is cancelled on the peer's loop


class _PauseSignal:
    """SIGUSR1 pauses the peer and SIGUSR2 resumes it, at once (a round in flight is left even while
    the training thread waits on it); ``changes()`` gives the loop each change once it took effect.
    Installed before the peer starts, so an early signal is kept, not the default (which ends the
    process), and applied once the peer runs."""

    def __init__(self) -> None:
        self._peer: Peer | None = None
        self._wanted: bool | None = None  # paused or not, as last asked
        self._pending: list[tuple[str, concurrent.futures.Future[None]]] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _PauseSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR1, signal.SIGUSR2):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._peer = None

    def attach(self, peer: Peer) -> None:
        self._peer = peer
        if self._wanted:  # paused before it ran (a resume before that cancelled it out)
            self._apply(True)

    def changes(self) -> list[str]:
        """``paused`` / ``resumed`` for each change since the last call, after it took effect."""
        done, self._pending = self._pending, []
        for _, future in done:
            with contextlib.suppress(Exception):  # logged by the peer; the event still says what was asked
                future.result(timeout=30)
        return [kind for kind, _ in done]

    def _handle(self, signum: int, _frame: Any) -> None:
        wanted = signum == signal.SIGUSR1
        if wanted != bool(self._wanted):
            self._wanted = wanted
            if self._peer is not None:
                self._apply(wanted)

    def _apply(self, paused: bool) -> None:
        assert self._peer is not None
        future = self._peer.pause() if paused else self._peer.resume()
        self._pending.append(("paused" if paused else "resumed", future))


def json_lines(event: dict[str, Any]) -> None:
    """Emit events as JSON lines on stdout (what ``swarmgrad demo`` and scripts read)."""
    sys.stdout.write(json.dumps({"t": time.time(), **event}, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()
