"""A swarmgrad task trained by hivemind's ``hivemind.Optimizer``: the baseline of the lab's time-to-accuracy benchmark.

    python benchmarks/hivemind_peer.py bootstrap --host ADDR --port PORT [--identity KEYFILE]
    python benchmarks/hivemind_peer.py peer TASK --run-id ID --host ADDR --initial-peers MADDR [MADDR ...]
        --identity KEYFILE [--shard I --num-shards N] [--slowdown S] [--max-seconds SEC] [--eval-every SEC]
        [--target-accuracy A] [--no-final-eval] [--wait-peers N --wait SEC] [--threads T]
        [--target-batch-size B] [--matchmaking-time SEC] [--averaging-timeout SEC] [--eval-batches K] [--seed 0]

``swarmgrad lab`` (``swarmgrad/lab/driver.py``) runs ``swarmgrad peer --json`` processes on an emulated internet
and measures how fast the swarm reaches a target accuracy. To compare with hivemind on the same links, this
runner trains the same task (model, data shard, loss, batch size, Adam and its learning rate from
``swarmgrad.tasks``) with ``hivemind.Optimizer`` and prints the same JSON events on stdout (``ready``,
``progress`` about every 2 s, ``eval``, ``done``; every ``peer_id`` is the one of ``--identity``), so the driver
can start it in place of ``swarmgrad peer``. ``bootstrap`` is a plain hivemind DHT node that prints its
multiaddrs, one per line, like ``swarmgrad bootstrap``. Logs, hivemind's included, go to stderr.

hivemind settings: those of its collaborative-training quickstart (``use_local_updates=True``: every peer
steps Adam on its own gradients and the peers average parameters once per epoch of ``--target-batch-size``
samples swarm-wide; ``matchmaking_time`` 3 s), ``averaging_timeout`` 60 s, and fp16 compression of what is
averaged (``grad_compression`` and ``state_averaging_compression``), the closest to swarmgrad's compressed rounds.
Only parameters are averaged (hivemind's default; Adam's statistics stay local). Like hivemind's own examples, a
peer that joins a running swarm (``--wait-peers 1`` while others are declared) downloads the swarm's state once
before training; afterwards hivemind downloads it by itself whenever the peer falls behind the swarm's epoch.

What the counters mean here: ``rounds_ok`` / ``rounds_failed`` count hivemind's parameter-averaging rounds as
it reports them itself (its "Averaged parameters with N peers" / "Averaging failed" status lines, which we
read off its logger); ``state_downloads`` counts downloads of a peer's state that returned one. Traffic is not
counted (``bytes_*`` are 0): the lab measures it on the network interfaces.

Stopping: SIGTERM/SIGINT, and ``--max-seconds`` (a SIGALRM), stop the loop between steps, and also abort a
step that waits for an averaging round (hivemind waits up to ``averaging_timeout`` when a groupmate left); then
come the last ``progress``, the final evaluation and ``done``, and the peer leaves within about 11 s.

Network hygiene: p2pd listens on ``--host`` only (port 0 for peers), with no IPFS bootstrap, no NAT port
mapping and no AutoNAT; hivemind's "is this identity taken" probe is off, as it would start a second daemon on
127.0.0.1 with those features on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hivemind import DHT, Optimizer
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

logger = logging.getLogger("hivemind_peer")

PROGRESS_EVERY = 2.0  # seconds between progress events
MIN_RATE_SECONDS = 0.5  # samples_per_second is measured over at least this long
LOSS_SMOOTHING = 0.05  # as swarmgrad's Peer
OPTIMIZER_SHUTDOWN_SECONDS = 8.0  # then the DHT's few seconds; the lab SIGKILLs a peer 15 s after its SIGTERM
POLL_SECONDS = 0.5


# ---------------------------------------------------------------- what hivemind does not count for us


class _DownloadCounter(DecentralizedAverager):
    """Sits between TrainingStateAverager and DecentralizedAverager in the MRO: sees what a state download returned
    (TrainingStateAverager.load_state_from_peers returns None either way)."""

    state_downloads = 0

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if wait and loaded is not None:
            self.state_downloads += 1
        return loaded


class _CountingStateAverager(TrainingStateAverager, _DownloadCounter):
    """hivemind's TrainingStateAverager, counting the state downloads that returned a state."""


class _CountingOptimizer(Optimizer):
    """hivemind.Optimizer with a :class:`_CountingStateAverager`; otherwise unchanged.

    The construction is hivemind 1.1.12's ``Optimizer._make_state_averager`` with the class swapped.
    """

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        return _CountingStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs,
        )  # fmt: skip

    @property
    def state_downloads(self) -> int:
        return self.state_averager.state_downloads


class _RoundCounter(logging.Filter):
    """Counts hivemind's parameter-averaging rounds from the status lines its state averager logs once per round.

    Those lines are DEBUG unless ``verbose``: the logger is opened to DEBUG for them, and this filter drops the
    DEBUG records again unless hivemind's own log level asks for them.
    """

    OK, FAILED = "Averaged parameters with", "Averaging failed with"
    LOGGER = "hivemind.optim.state_averager"

    def __init__(self) -> None:
        super().__init__()
        self.ok = self.failed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.OK):
            self.ok += 1
        elif message.startswith(self.FAILED):
            self.failed += 1
        return record.levelno >= logging.getLogger("hivemind").getEffectiveLevel()

    @classmethod
    def install(cls) -> _RoundCounter:
        counter = cls()
        averager_logger = logging.getLogger(cls.LOGGER)
        averager_logger.addFilter(counter)
        averager_logger.setLevel(logging.DEBUG)
        return counter


# ---------------------------------------------------------------- small helpers


class Interrupted(Exception):
    """A stop signal arrived while ``hivemind.Optimizer.step`` was running."""


class StopSignal:
    """SIGTERM/SIGINT, and SIGALRM at the ``--max-seconds`` deadline, end the training loop between steps (as
    swarmgrad's runner does) or abort a running ``opt.step()`` (see :meth:`interruptible`); ``reason`` says why.

    hivemind forks its DHT and averager processes after this is installed; in them the signals keep their
    default action, so that signalling the whole process group still ends them.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.pid = os.getpid()
        self._interruptible = False
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(sig, self._handle)

    def set_deadline(self, seconds: float) -> None:
        """Stop with reason "max_seconds" in ``seconds``, also within a step that waits for a round."""
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))

    def cancel_deadline(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A signal inside this block raises :class:`Interrupted`. For ``opt.step()``: it waits for the last
        averaging round, up to ``--averaging-timeout`` when a groupmate has left, and the lab SIGKILLs a peer
        15 s after its SIGTERM; the peer is leaving anyway, so its optimizer state no longer matters."""
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum: int, _frame: Any) -> None:
        if os.getpid() != self.pid:  # a forked hivemind process: die as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.reason is None:
            self.reason = "max_seconds" if signum == signal.SIGALRM else f"signal {signal.Signals(signum).name}"
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(self.reason)


def emit(event: dict[str, Any]) -> None:
    """One JSON event on stdout; NaN and infinities, also nested ones, are written as null."""
    sys.stdout.write(json.dumps({"t": time.time(), **_finite(event)}, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def network_options(host: str, port: int, identity: str | None) -> dict[str, Any]:
    """hivemind DHT/P2P options: listen on ``host`` only, nothing public, no second daemon for the identity check."""
    return {"host_maddrs": [f"/ip4/{host}/tcp/{port}"], "use_ipfs": False, "nat_port_map": False,
            "auto_nat": False, "identity_path": identity, "check_if_identity_free": False}


def declared_peers(dht: DHT, averager: DecentralizedAverager) -> set[str]:
    """Peers of the run whose state averager is up: those hivemind would download the state from."""
    found = dht.get(f"{averager.prefix}.all_averagers", latest=True)
    entries = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
    return {str(PeerID(key)) for key, info in entries.items()
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, (int, float))}


def shutdown(opt: Optimizer | None, dht: DHT) -> None:
    """Leave the run within a bounded time. The optimizer's goodbye waits for a round in flight (up to the
    averaging timeout); past :data:`OPTIMIZER_SHUTDOWN_SECONDS` we give up on it, still stop the DHT (which
    stops p2pd), terminate the averager processes and exit at once."""
    started = time.monotonic()
    hung = False
    if opt is not None:
        thread = threading.Thread(target=opt.shutdown, name="hivemind-shutdown", daemon=True)
        thread.start()
        thread.join(OPTIMIZER_SHUTDOWN_SECONDS)
        hung = thread.is_alive()
        if hung:
            logger.warning("hivemind.Optimizer did not shut down within %.0f s", OPTIMIZER_SHUTDOWN_SECONDS)
    dht.shutdown()  # bounded: hivemind terminates the DHT process after its shutdown_timeout
    logger.info("left the run in %.1f s", time.monotonic() - started)
    if hung:
        for child in multiprocessing.active_children():
            child.terminate()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ---------------------------------------------------------------- peer


@dataclass
class Progress:
    """What the training loop counts itself."""

    step: int = 0
    samples: int = 0
    loss: float | None = None  # exponential moving average; NaN once a loss was not finite, until the next one
    rate: float = 0.0  # samples per second between the last two progress events
    _last_samples: int = 0
    _last_t: float | None = None

    def add(self, batch_size: int, loss: float) -> None:
        self.step += 1
        self.samples += batch_size
        finite = self.loss is not None and math.isfinite(self.loss)
        self.loss = loss if not finite or not math.isfinite(loss) else self.loss + LOSS_SMOOTHING * (loss - self.loss)

    def measure_rate(self) -> None:
        now = time.monotonic()
        if self._last_t is not None and now - self._last_t < MIN_RATE_SECONDS:
            return  # the last report came just before (the loop's end): keep its rate
        if self._last_t is not None:
            self.rate = (self.samples - self._last_samples) / (now - self._last_t)
        self._last_samples, self._last_t = self.samples, now


class HivemindPeer:
    """One training peer: a DHT node, a hivemind.Optimizer around Adam, the task's model and data shard."""

    def __init__(self, args: argparse.Namespace) -> None:
        from swarmgrad.dht.identity import Identity
        from swarmgrad.tasks import endless_batches, get_task

        self.args = args
        self.task = get_task(args.task, dict(option.split("=", 1) for option in args.task_option))
        hparams = dict(self.task.default_hparams)
        self.batch_size = int(args.batch_size or hparams.get("batch_size", 64))
        self.lr = float(args.lr or hparams["lr"])
        torch.manual_seed(args.seed)  # every peer starts from the same weights
        self.model = self.task.make_model()
        dataset = self.task.train_data(args.shard, args.num_shards, args.seed)
        self.batches: Iterator = endless_batches(dataset, self.batch_size, seed=args.shard)
        self.rounds = _RoundCounter.install()
        self.dht = DHT(initial_peers=args.initial_peers, start=True,
                       **network_options(args.host, 0, args.identity))
        try:
            self.peer_id = str(self.dht.peer_id)
            expected = Identity.load(args.identity).peer_id
            assert self.peer_id == expected, f"hivemind's peer id {self.peer_id} is not the identity's {expected}"
            self.opt = _CountingOptimizer(
                dht=self.dht, run_id=args.run_id, batch_size_per_step=self.batch_size,
                target_batch_size=args.target_batch_size,
                optimizer=torch.optim.Adam(self.model.parameters(), lr=self.lr),
                use_local_updates=True, matchmaking_time=args.matchmaking_time,
                averaging_timeout=args.averaging_timeout, grad_compression=Float16Compression(),
                state_averaging_compression=Float16Compression(), verbose=False,
            )  # fmt: skip
        except BaseException:
            self.dht.shutdown()
            raise
        self.progress = Progress()

    # -- events

    def status(self) -> dict[str, Any]:
        opt = self.opt
        return {"peer_id": self.peer_id, "run_id": self.args.run_id, "step": self.progress.step,
                "epoch": opt.local_epoch, "samples": self.progress.samples,
                "samples_per_second": self.progress.rate, "loss": self.progress.loss, "epsilon": None,
                "peers": opt.tracker.global_progress.num_peers, "rounds_ok": self.rounds.ok,
                "rounds_failed": self.rounds.failed, "bytes_sent": 0, "bytes_received": 0,
                "state_downloads": opt.state_downloads}

    def emit_progress(self) -> None:
        self.progress.measure_rate()
        emit({"event": "progress", **self.status()})

    def evaluate(self, max_batches: int | None) -> dict[str, float]:
        metrics = self.task.evaluate(self.model, max_batches=max_batches)
        return {"accuracy": float(metrics["accuracy"]), "loss": float(metrics["loss"])}

    # -- phases

    def join(self, stop: StopSignal) -> None:
        """Wait for the initial peers (``--wait-peers``), or, as a late joiner, download the swarm's state."""
        opt, args = self.opt, self.args
        if args.wait_peers > 1:
            deadline = time.monotonic() + args.wait
            while not stop.reason and time.monotonic() < deadline:
                peers = declared_peers(self.dht, opt.state_averager) | {self.peer_id}
                if len(peers) >= args.wait_peers:
                    return
                time.sleep(POLL_SECONDS)
            if not stop.reason:
                logger.warning("fewer than %d peers after %.0f s: training anyway", args.wait_peers, args.wait)
        elif declared_peers(self.dht, opt.state_averager) - {self.peer_id}:
            logger.info("joining a running swarm: loading its state")
            opt.load_state_from_peers()

    def train_step(self, stop: StopSignal) -> None:
        opt = self.opt
        tick = time.monotonic()
        inputs, targets = next(self.batches)
        loss = self.task.loss_fn(self.model(inputs), targets)
        loss.backward()
        if self.args.slowdown > 1:  # forward and backward dominate a step: stretch them, not averaging
            time.sleep((self.args.slowdown - 1) * (time.monotonic() - tick))
        with stop.interruptible():
            opt.step(batch_size=len(targets))
        opt.zero_grad()
        self.progress.add(len(targets), float(loss.detach()))

    def run(self, stop: StopSignal) -> None:
        """Join, train until a stop condition, report the end (``ready`` ... ``done`` events)."""
        opt, args = self.opt, self.args
        started = time.time()
        if args.max_seconds is not None:
            stop.set_deadline(args.max_seconds)
        self.join(stop)
        emit({"event": "ready", "peer_id": self.peer_id, "maddrs": [str(m) for m in self.dht.get_visible_maddrs()],
              "shard": args.shard, "num_shards": args.num_shards, "epoch": opt.local_epoch, "step": 0,
              "task": args.task, "state_downloads": opt.state_downloads, "options": self.options()})
        reason, final = self.train(stop)
        stop.cancel_deadline()
        self.emit_progress()
        if final is None and args.final_eval:
            final = self.evaluate(None)
        emit({"event": "done", "peer_id": self.peer_id, "reason": reason, "step": self.progress.step,
              "epoch": opt.local_epoch, "final": final, "seconds": time.time() - started, "status": self.status()})

    def train(self, stop: StopSignal) -> tuple[str, dict[str, float] | None]:
        """The training loop: returns why it stopped, and the evaluation that reached the target accuracy."""
        opt, args = self.opt, self.args
        last_progress, last_eval, eval_epoch = time.monotonic(), -math.inf, -1
        self.progress.measure_rate()
        while not stop.reason:
            try:
                self.train_step(stop)
            except Interrupted:
                break
            now = time.monotonic()
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                self.emit_progress()
            # like swarmgrad's runner: at most every --eval-every seconds, and only once the swarm stepped
            if args.eval_every > 0 and now - last_eval >= args.eval_every and opt.local_epoch != eval_epoch:
                evaluated_at = time.time()  # the model's time, as swarmgrad's runner reports it
                emit({"event": "progress", **self.status(), "evaluating": True})  # as swarmgrad's runner does
                metrics = self.evaluate(args.eval_batches)
                last_eval, eval_epoch = time.monotonic(), opt.local_epoch
                emit({"event": "eval", "t": evaluated_at, "peer_id": self.peer_id, "step": self.progress.step,
                      "epoch": opt.local_epoch, **metrics})
                if args.target_accuracy is not None and metrics["accuracy"] >= args.target_accuracy:
                    return "target_accuracy", metrics
        return stop.reason or "stopped", None

    def options(self) -> dict[str, Any]:
        args = self.args
        return {"system": "hivemind", "optimizer": "adam", "lr": self.lr, "batch_size": self.batch_size,
                "target_batch_size": args.target_batch_size, "use_local_updates": True,
                "matchmaking_time": args.matchmaking_time, "averaging_timeout": args.averaging_timeout,
                "compression": "fp16", "seed": args.seed}


def run_peer(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = StopSignal()
    peer = HivemindPeer(args)
    try:
        peer.run(stop)
    finally:
        shutdown(peer.opt, peer.dht)
    return 0


# ---------------------------------------------------------------- bootstrap


def run_bootstrap(args: argparse.Namespace) -> int:
    stop = StopSignal()
    dht = DHT(start=True, **network_options(args.host, args.port, args.identity))
    try:
        for maddr in dht.get_visible_maddrs():
            print(maddr, flush=True)
        while not stop.reason:
            time.sleep(POLL_SECONDS)
        logger.info("bootstrap: %s, shutting down", stop.reason)
    finally:
        shutdown(None, dht)
    return 0


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    boot = commands.add_parser("bootstrap", help="a hivemind DHT node for peers to join; prints its multiaddrs")
    boot.add_argument("--host", default="127.0.0.1")
    boot.add_argument("--port", type=int, default=0)
    boot.add_argument("--identity", help="libp2p Ed25519 key file (as `swarmgrad keygen` writes)")

    peer = commands.add_parser("peer", help="train TASK with hivemind.Optimizer, JSON events on stdout")
    peer.add_argument("task", metavar="TASK")
    peer.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                      help="the task's options, as `swarmgrad peer --task-option`")
    peer.add_argument("--run-id", required=True)
    peer.add_argument("--host", default="127.0.0.1")
    peer.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    peer.add_argument("--identity", required=True, help="libp2p Ed25519 key file: its peer id names the events")
    peer.add_argument("--shard", type=int, default=0)
    peer.add_argument("--num-shards", type=int, default=1)
    peer.add_argument("--slowdown", type=float, default=1.0, help="each local step takes this many times longer")
    peer.add_argument("--max-seconds", type=float)
    peer.add_argument("--eval-every", type=float, default=10.0, help="seconds between evaluations; 0: none")
    peer.add_argument("--eval-batches", type=int, help="batches of the held-out set per periodic evaluation")
    peer.add_argument("--target-accuracy", type=float)
    peer.add_argument("--no-final-eval", dest="final_eval", action="store_false")
    peer.add_argument("--wait-peers", type=int, default=1, help="wait for this many peers (this one included)")
    peer.add_argument("--wait", type=float, default=60.0, help="seconds to wait for --wait-peers")
    peer.add_argument("--threads", type=int)
    peer.add_argument("--seed", type=int, default=0)
    peer.add_argument("--batch-size", type=int, help="default: the task's")
    peer.add_argument("--lr", type=float, help="Adam's learning rate; default: the task's")
    peer.add_argument("--target-batch-size", type=int, default=4096, help="samples per epoch, swarm-wide")
    peer.add_argument("--matchmaking-time", type=float, default=3.0)
    peer.add_argument("--averaging-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.command == "peer" and not 0 <= args.shard < args.num_shards:
        parser.error(f"--shard must be within 0..{args.num_shards - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    multiprocessing.set_start_method("fork", force=True)  # hivemind forks its DHT and averager processes
    return run_peer(args) if args.command == "peer" else run_bootstrap(args)


if __name__ == "__main__":
    sys.exit(main())
