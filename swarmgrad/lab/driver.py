"""``swarmgrad lab``: run a whole swarm of ``swarmgrad peer`` processes on an emulated internet.

One :class:`~swarmgrad.lab.network.EmulatedNetwork` namespace per peer (its link from the scenario)
plus one for a bootstrap node on an unshaped link. Every peer reports JSON events on stdout; a
thread per process feeds them to the main thread, which keeps the demo's :class:`RunLog` (so the
dashboard, plot and summary are the demo's), applies the churn schedule, watches for hung peers,
and stops the run once peer 0 is done (target accuracy or its time budget) or the lab's own
deadline passes. Leaving the ``with EmulatedNetwork`` block, also on Ctrl-C or SIGTERM, kills every
process and removes the namespaces.

Times in the summary (``seconds_to``, ``evals``, fault ``at``) count from the start of training:
the first ``ready`` event, i.e. once the initial peers found each other (``--wait-peers``).

What the summary adds to the demo's:

* ``faults``: each churn event with its outcome. A kill is fine ("others kept averaging") if a peer
  that was running at the time counted more successful rounds afterwards; a restart or join
  "caught up" if that start of the peer downloaded the swarm's state at least once or ended within
  one epoch of the others (epochs are given), and not if it then failed with an ``error:`` line.
* ``nan_seen``: a progress report without a finite loss (the runner reports NaN as None) after the
  same start of the peer had reported a finite one.
* ``hung_rounds``: how many times a running peer went silent for more than 3x its round deadline:
  the one its progress reports (``round_deadline``: its round's bytes at the rate it measured,
  timing.py RoundTimer), and at least 4x the round time seen from here (the gap between two progress
  reports across which the epoch advanced: the training loop waits for the round, matchmaking
  included) or, before one is seen, 60 s (180 s of silence). A peer whose last report says an
  evaluation follows (``"evaluating": true``) is not watched until it reports again.

The run directory (``logs`` in the summary) keeps each peer's stderr (``peer-I.log``, one section
per start), its key and checkpoints, and every event in ``events.jsonl``.

This module runs the lab: starting processes, the event loop, churn, the hang watch, stopping.
:mod:`swarmgrad.lab.peers` holds what it knows of each peer process; :mod:`swarmgrad.lab.report`
judges the faults and builds the summary, dashboard and printed report.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from swarmgrad.console import print_json, stderr
from swarmgrad.demo.events import RunLog, integer, number, parse_event
from swarmgrad.dht.config import NodeConfig
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.lab.network import EmulatedNetwork, LinkSpec, check_requirements
from swarmgrad.lab.peers import HANG_FACTOR, LabPeer, follow_lines, tail_log
from swarmgrad.lab.report import START_MARK, generation_error, judge_faults, lab_summary, print_report, render_lab
from swarmgrad.lab.scenario import ChurnEvent, Scenario
from swarmgrad.lab.sweep import killpg
from swarmgrad.peer.config_file import write_peer_config
from swarmgrad.peer.peer_config import Checkpoints, Compute, Connection, Data, Evaluation, PeerConfig, Stop

BOOTSTRAP_PORT = 31337
POLL_SECONDS = 0.25  # how often the driver looks at its peers: the live table's refresh
BOOTSTRAP_SECONDS = 90.0  # a loaded 2-core machine takes a while to start a node
FORMATION_SECONDS = 240.0  # until the first peer is ready: imports, two p2pd starts, --wait-peers
WAIT_SECONDS = 180  # `swarmgrad peer --wait` and --bootstrap-timeout: for the DHT and for the other peers
END_GRACE_SECONDS = 60.0  # past duration: peer 0's final evaluation, a round in flight
STOP_GRACE_SECONDS = 15.0  # SIGTERM -> done event; then SIGKILL
MIN_LATE_SECONDS = 5.0  # budget of a peer (re)started near the end


class Lab:
    """One lab run; :func:`run_lab` is the entry point."""

    def __init__(self, scenario: Scenario, run_dir: Path, *, json_output: bool, prefix: str | None = None):
        self.scenario = scenario
        self.run_dir = run_dir
        self.json_output = json_output
        self.prefix = prefix
        self.specs = scenario.expanded_peers()
        self.schedule = scenario.schedule()
        self.run_id = f"lab-{scenario.name}-{os.urandom(3).hex()}"
        self.created = time.time()
        self.log = RunLog(started_at=self.created)
        self.lines: queue.Queue[tuple[int, int, bytes | None]] = queue.Queue()
        self.peers: list[LabPeer] = []
        self.bootstrap_maddr: str | None = None
        self.t0: float | None = None  # start of training: the first `ready`
        self.done_index: int | None = None  # applied churn events: schedule[:done_index]
        self.faults: list[dict] = []
        self.nan_reports: list[dict] = []
        self.hangs: list[dict] = []
        self.ended_by = "running"
        self.ended_at: float | None = None
        self.net: EmulatedNetwork | None = None
        self.events_file: IO[str] | None = None
        run = scenario.run_config
        self.title = (f"swarmgrad lab {scenario.name}: {len(self.specs)} peers, {scenario.task}, "
                      f"{run.strategy.name}+{run.averaging.kind}, {run.compression}")

    # -- setup ----------------------------------------------------------------------------------

    def links(self) -> list[LinkSpec]:
        return [spec.link() for spec in self.specs] + [LinkSpec(math.inf, math.inf, 0.0, 0.0)]

    def prepare(self) -> None:
        from swarmgrad.dht.identity import Identity

        for index, spec in enumerate(self.specs):
            identity = Identity.generate()
            key = self.run_dir / f"peer-{index}.key"
            identity.save(key)
            checkpoints = self.run_dir / f"checkpoints-{index}"
            checkpoints.mkdir()
            log_path = self.run_dir / f"peer-{index}.log"
            self.peers.append(LabPeer(index, spec, identity.peer_id, key, checkpoints, log_path))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = "1"  # one core's worth per peer: the lab shares this machine's cores
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def bootstrap_command(self, address: str) -> list[str]:
        """A DHT node that prints its multiaddrs on stdout (``/ip4/...`` lines) and serves until SIGTERM."""
        return [sys.executable, "-m", "swarmgrad.cli", "bootstrap", "--host", address, "--port", str(BOOTSTRAP_PORT)]

    def start_bootstrap(self, net: EmulatedNetwork) -> None:
        index = len(self.specs)
        address = net.address(index)
        log_path = self.run_dir / "bootstrap.log"
        with open(log_path, "ab") as log:
            process = net.popen(index, self.bootstrap_command(address), stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, cwd=self.run_dir, env=self.env())
        assert process.stdout is not None
        deadline = time.monotonic() + BOOTSTRAP_SECONDS
        while time.monotonic() < deadline:
            net.check()
            ready, _, _ = select.select([process.stdout], [], [], 0.5)
            if ready:
                line = process.stdout.readline().decode(errors="replace").strip()
                if line.startswith("/ip4/"):
                    self.bootstrap_maddr = line
                    return
                if not line and process.poll() is not None:
                    break
        raise StartupError(f"the lab's bootstrap node did not start (exit code {process.poll()}); "
                           f"last lines of {log_path}: {tail_log(log_path)}")

    def peer_command(self, peer: LabPeer, *, max_seconds: float, wait_peers: int) -> list[str]:
        """``swarmgrad peer --json`` for ``peer``, its settings in a config file in the run's directory;
        a subclass may run other software that reports the same events."""
        path = write_peer_config(self.run_dir / f"peer-{peer.index}.toml", self.scenario.run_config,
                                 self.peer_config(peer, max_seconds=max_seconds, wait_peers=wait_peers))
        return [sys.executable, "-m", "swarmgrad.cli", "-v", "peer", "--config", str(path), "--json"]

    def peer_config(self, peer: LabPeer, *, max_seconds: float, wait_peers: int) -> PeerConfig:
        """The peer's own settings. Peer 0 is the one evaluator: after a swarm step every peer holds
        the same model."""
        assert self.net is not None and self.bootstrap_maddr is not None
        scenario = self.scenario
        if peer.index == 0:
            evaluation = Evaluation(every=scenario.eval_every, batches=scenario.eval_batches)
        else:
            evaluation = Evaluation(every=0, final=False)
        return PeerConfig(
            run_id=self.run_id,
            network=NodeConfig(host=self.net.address(peer.index), initial_peers=[self.bootstrap_maddr],
                               identity_path=peer.identity, bootstrap_timeout=WAIT_SECONDS),
            connection=Connection(wait=WAIT_SECONDS, wait_peers=wait_peers),
            data=Data(shard=peer.index, num_shards=len(self.specs)),
            compute=Compute(threads=1, slowdown=peer.spec.slowdown), evaluation=evaluation,
            stop=Stop(max_seconds=round(max_seconds, 1),
                      target_accuracy=scenario.target_accuracy if peer.index == 0 else None),
            checkpoints=Checkpoints(dir=peer.checkpoint_dir))

    def start_peer(self, peer: LabPeer, *, max_seconds: float, wait_peers: int) -> None:
        assert self.net is not None
        peer.generation += 1
        argv = self.peer_command(peer, max_seconds=max_seconds, wait_peers=wait_peers)
        with open(peer.log_path, "ab") as log:
            log.write(f"{START_MARK}{peer.generation} at {time.strftime('%H:%M:%S')}: {' '.join(argv)}\n".encode())
            log.flush()
            peer.process = self.net.popen(peer.index, argv, stdout=subprocess.PIPE, stderr=log,
                                          stdin=subprocess.DEVNULL, cwd=self.run_dir, env=self.env())
        peer.state, peer.started_at = "starting", time.time()
        peer.last_event_t = peer.last_progress_t = peer.last_progress_epoch = None
        peer.rounds_this_gen, peer.reported_loss, peer.hung = 0, False, False
        shown = self.log.peers.get(peer.peer_id)
        if shown is not None and shown.state not in ("ready", "training"):
            # a new start: its progress shows it training again; the last start's end is history
            shown.state, shown.done, shown.error = "ready", None, None
        threading.Thread(target=follow_lines, args=(peer.process.stdout, peer.index, peer.generation, self.lines),
                         name=f"lab-peer-{peer.index}", daemon=True).start()

    # -- events ---------------------------------------------------------------------------------

    def drain(self) -> None:
        while True:
            try:
                index, generation, line = self.lines.get_nowait()
            except queue.Empty:
                return
            peer = self.peers[index]
            if line is None or generation != peer.generation:
                continue  # EOF (the process state comes from poll) or a line from a killed generation
            event = parse_event(line)
            if event is None or event["peer_id"] != peer.peer_id:
                continue
            self.record_event(peer, event)
            self.on_event(peer, event)

    def record_event(self, peer: LabPeer, event: dict) -> None:
        """Every event, with the peer's lab index and start, in ``events.jsonl`` for a post-mortem."""
        if self.events_file is None:
            self.events_file = open(self.run_dir / "events.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.events_file.write(json.dumps({"lab_peer": peer.index, "lab_start": peer.generation, **event},
                                          default=str) + "\n")

    def on_event(self, peer: LabPeer, event: dict) -> None:
        kind, t = event["event"], float(event["t"])
        if kind == "ready" and self.t0 is None:
            self.t0 = t
            self.log.started_at = t
        self.log.add(event)
        peer.last_event_t = t
        if kind == "ready":
            peer.state = "running"
            peer.history.append({"generation": peer.generation, "t": t, "epoch": integer(event.get("epoch")),
                                 "state_downloads": integer(event.get("state_downloads")),
                                 "rounds_total": peer.rounds_total})
        elif kind == "progress":
            self.on_progress(peer, event, t)
        elif kind == "done":
            peer.state = "done"
            if peer.index == 0:
                self.ended_by = f"peer 0 done ({event.get('reason')})"

    def on_progress(self, peer: LabPeer, event: dict, t: float) -> None:
        epoch = integer(event.get("epoch"))
        previous_t, previous_epoch = peer.last_progress_t, peer.last_progress_epoch
        if previous_t is not None and previous_epoch is not None and epoch > previous_epoch:
            # a round ran between these reports (the training loop waits for it): learn its length
            peer.learn_round(t - previous_t)
        loss = number(event.get("loss"))
        if loss is None and peer.reported_loss:
            self.nan_reports.append({"peer": peer.index, "t": round(t - (self.t0 or t), 3),
                                     "step": integer(event.get("step"))})
        peer.reported_loss = peer.reported_loss or loss is not None
        rounds = integer(event.get("rounds_ok"))
        peer.rounds_total += max(0, rounds - peer.rounds_this_gen)
        peer.rounds_this_gen = max(rounds, peer.rounds_this_gen)
        peer.last_progress_t, peer.last_progress_epoch, peer.hung = t, epoch, False
        peer.reported_deadline = number(event.get("round_deadline"))
        peer.evaluating = bool(event.get("evaluating"))
        peer.history.append({"generation": peer.generation, "t": t, "epoch": epoch,
                             "state_downloads": integer(event.get("state_downloads")),
                             "rounds_total": peer.rounds_total})

    # -- the run --------------------------------------------------------------------------------

    def elapsed(self, now: float | None = None) -> float:
        return ((time.time() if now is None else now) - self.t0) if self.t0 is not None else 0.0

    def poll_processes(self) -> None:
        for peer in self.peers:
            if peer.process is not None and peer.state in ("starting", "running") and peer.process.poll() is not None:
                self.drain()  # its last lines (a done event) may still be queued
                if peer.state in ("starting", "running"):
                    peer.state = "exited"
                    peer.exited_at[peer.generation] = time.time()
                    if peer.peer_id in self.log.peers:
                        self.log.add({"event": "error", "t": time.time(), "peer_id": peer.peer_id,
                                      "message": f"exited with code {peer.process.returncode}: "
                                                 f"{tail_log(peer.log_path, 1)}"})

    def apply_churn(self) -> None:
        if self.t0 is None:
            return
        elapsed = self.elapsed()
        start = self.done_index or 0
        while start < len(self.schedule) and self.schedule[start].at <= elapsed:
            self.apply(self.schedule[start])
            start += 1
        self.done_index = start

    def apply(self, event: ChurnEvent) -> None:
        peer = self.peers[event.peer]
        record: dict[str, Any] = {"at": round(self.elapsed(), 1), "scheduled_at": round(event.at, 1),
                                  "action": event.action, "peer": event.peer, "peer_id": peer.peer_id,
                                  "generation": peer.generation, "outcome": None, "ok": None}
        if event.action == "kill":
            if peer.process is None or peer.process.poll() is not None:
                record.update(outcome=f"peer was not running ({peer.state})", ok=False)
            else:
                killpg(peer.process.pid, signal.SIGKILL)
                peer.process.wait()
                peer.state = "killed"
                if peer.peer_id in self.log.peers:  # the demo's dashboard and summary know no "killed" state
                    self.log.add({"event": "error", "t": time.time(), "peer_id": peer.peer_id,
                                  "message": f"killed by the lab's churn schedule at {self.elapsed():.0f} s"})
                record["survivors"] = {other.index: other.rounds_total for other in self.peers
                                       if other is not peer and other.state in ("starting", "running")}
                record["epoch"] = peer.last_progress_epoch
        else:
            remaining = self.scenario.duration - self.elapsed()
            self.start_peer(peer, max_seconds=max(MIN_LATE_SECONDS, remaining), wait_peers=1)
            record["generation"] = peer.generation
            record["swarm_epoch"] = self.swarm_epoch(exclude=peer)
        self.faults.append(record)

    def swarm_epoch(self, exclude: LabPeer | None = None) -> int | None:
        epochs = [p.last_progress_epoch for p in self.peers if p is not exclude and p.last_progress_epoch is not None
                  and p.state in ("running", "done")]
        return max(epochs, default=None)

    def watch_hangs(self) -> None:
        now = time.time()
        for peer in self.peers:
            if peer.state != "running" or peer.last_progress_t is None or peer.hung or peer.evaluating:
                continue  # an evaluation runs on the training thread: its silence is not a hung round
            deadline = peer.round_deadline()
            silent = now - peer.last_progress_t
            if silent > HANG_FACTOR * deadline:
                peer.hung = True
                self.hangs.append({"peer": peer.index, "at": round(self.elapsed(now), 1),
                                   "silent_seconds": round(silent, 1), "round_deadline": round(deadline, 1)})

    def should_stop(self) -> bool:
        first = self.peers[0]
        if first.state == "done":
            return True
        if first.state == "exited":
            self.ended_by = f"peer 0 exited with code {first.process.returncode if first.process else '?'}"
            return True
        if self.t0 is not None and self.elapsed() > self.scenario.duration + END_GRACE_SECONDS:
            self.ended_by = "time budget"
            return True
        return False

    def run(self, net: EmulatedNetwork) -> None:
        self.net = net
        self.start_bootstrap(net)
        initial = [peer for peer in self.peers if peer.spec.start]
        for peer in initial:
            self.start_peer(peer, max_seconds=self.scenario.duration, wait_peers=len(initial))
        live = None
        if not self.json_output:
            from rich.live import Live

            live = Live(self.render(), console=stderr, refresh_per_second=4)
            live.start()
        try:
            formed_by = time.time() + FORMATION_SECONDS
            while True:
                net.check()
                self.drain()
                self.poll_processes()
                if self.t0 is None:
                    if self.peers[0].state == "exited" or time.time() > formed_by:
                        raise StartupError(self.formation_failure())
                else:
                    self.apply_churn()
                    self.watch_hangs()
                    if self.should_stop():
                        break
                if live is not None:
                    live.update(self.render())
                time.sleep(POLL_SECONDS)
            self.ended_at = time.time()
            self.stop_all(live)
        finally:
            if live is not None:
                live.update(self.render())
                live.stop()

    def stop_all(self, live: Any) -> None:
        """SIGTERM every running peer (it leaves the run and reports `done`), SIGKILL what is left after a grace."""
        running = [p for p in self.peers if p.process is not None and p.process.poll() is None]
        for peer in running:
            if peer.state == "done":
                continue  # reported its end (peer 0): already on its way out
            try:
                peer.process.send_signal(signal.SIGTERM)  # the peer stops its own p2pd on the way out
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline and any(p.process.poll() is None for p in running):
            self.drain()
            if live is not None:
                live.update(self.render())
            time.sleep(POLL_SECONDS)
        for peer in running:
            if peer.process.poll() is None:
                killpg(peer.process.pid, signal.SIGKILL)
                peer.process.wait()
        time.sleep(0.2)  # the reader threads hand over the last lines
        self.drain()
        self.poll_processes()
        if self.events_file is not None:
            self.events_file.close()
            self.events_file = None

    def formation_failure(self) -> str:
        first = self.peers[0]
        if first.state == "exited":
            return (f"peer 0 exited with code {first.process.returncode if first.process else '?'} before the "
                    f"swarm formed; last lines of {first.log_path}: {tail_log(first.log_path)}")
        return (f"no peer was ready after {FORMATION_SECONDS:.0f} s (the machine may be too loaded for "
                f"{len(self.specs)} peers); last lines of {first.log_path}: {tail_log(first.log_path)}")

    # -- report ---------------------------------------------------------------------------------

    def render(self) -> Any:
        return render_lab(self)

    def judge_faults(self) -> None:
        """Fill in each applied churn event's outcome from what the peers reported afterwards."""
        judge_faults(self)

    def summary(self, plot_path: Path) -> dict:
        """The run's summary (see the module docstring); also draws the plot at ``plot_path``."""
        return lab_summary(self, plot_path)


def run_lab(scenario: Scenario, *, json_output: bool = False, plot_path: Path | str | None = None,
            duration_override: float | None = None, quick: bool = False, prefix: str | None = None,
            run_dir: Path | str | None = None) -> dict:
    """Run ``scenario`` on an emulated network and return the summary (the demo's, plus ``scenario``,
    ``faults``, ``nan_seen``, ``hung_rounds``...); prints it as JSON with ``json_output``, else shows a
    live dashboard on stderr and a faults table and result line on stdout.

    ``prefix`` names the lab's namespaces (default: ``sglab-<pid>-<random>``); ``run_dir`` is where
    keys, checkpoints and logs go (default: a new ``swarmgrad-lab-NAME-*`` temporary directory, kept).
    Needs root (StartupError otherwise). KeyboardInterrupt (Ctrl-C, or :class:`LabTerminated` for
    SIGTERM/SIGHUP) propagates after the lab is torn down.
    """
    check_requirements()
    if duration_override is not None or quick:
        scenario = scenario.adjusted(duration=duration_override, quick=quick)
    plot_path = Path(plot_path) if plot_path is not None else Path(f"swarmgrad-lab-{scenario.name}.png")
    plot_path = plot_path.resolve()  # the peers run elsewhere; the plot goes where the user meant
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix=f"swarmgrad-lab-{scenario.name}-"))
    else:
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        if any(run_dir.iterdir()):
            raise ConfigError(f"the lab's run directory {run_dir} is not empty")
    lab = Lab(scenario, run_dir, json_output=json_output, prefix=prefix)
    lab.prepare()
    with EmulatedNetwork(lab.links(), prefix=prefix, mtu=scenario.mtu) as net:
        lab.run(net)
    summary = lab.summary(plot_path)
    if json_output:
        print_json(summary)
    else:
        print_report(summary)
    return summary


__all__ = ["Lab", "LabPeer", "generation_error", "print_report", "run_lab"]
