"""Real-size models through ``sg.Peer``: round time, wire time, host RAM per parameter, a joiner's
download and the training loop's stalls, for 20M to 200M parameters, on loopback and in the lab.

    .venv/bin/python benchmarks/big_model.py --networks loopback [--sizes 20M,60M] [--codecs int8,q2]
    sudo .venv/bin/python benchmarks/big_model.py [--networks lab,loopback] [--mbps 100] [--rtt-ms 40]
        [--rounds 8] [--join-after 3] [--json] [--out FILE.json] [--png FILE.png] [--quick]
    .venv/bin/python benchmarks/big_model.py --render FILE.json[,FILE.json] [--png FILE.png]  # saved reports again

For each network, codec and size P: a model of ``round(P / 4,196,352)`` ``torch.nn.Linear(2048, 2048)``
layers (fp32, each 4,196,352 parameters; the table says the exact count), an Adam inner optimizer,
random 8 x 2048 batches from a seeded generator, loss = mean square of the output. Two peers start
the run (``sg.Peer(..., strategy=sg.DiLoCo(inner_steps=5, overlap="off"), averaging=sg.Moshpit(group_size=3),
compression=codec)``, one process each); once both finished ``--join-after`` rounds a third process
joins and downloads the swarm's state; then all three train until the joiner has averaged ``--rounds
- --join-after`` rounds, or the swarm went three times that many rounds past its arrival without it
(then it reads so in its ok column), and end together at the next epoch (at least ``--rounds``). The three processes start at once and build their models first (the joiner too, so
that it enters at once when told); the joiner then drops its Adam moments: a fresh joiner takes the
whole state.
On ``lab`` every peer has its own network namespace with ``--mbps`` up and down and a ``--rtt-ms``
round trip (swarmgrad/lab/network.py; needs root); on ``loopback`` links are unshaped. Rounds run in
turn (``--overlap off``), so one ``step()`` call holds one whole round; ``--overlap auto`` measures the
default instead (a round's launch and landing are then two calls; a call counts as a swarm step only
where the ``status()`` counters below moved).

What each peer process measures and reports to the parent (one JSON line):

* ``rounds ok / failed``: ``peer.status().rounds_ok`` / ``rounds_failed`` at the end (the joiner's
  include none of the starters').
* swarm-step calls: the ``step()`` calls after which ``status()``'s epoch, rounds_ok, rounds_failed,
  solo_steps, state_downloads or rounds_replayed moved. ``round s``: the median duration of those
  that attempted a round (rounds_ok or rounds_failed moved; the local Adam step of the call
  included); the others only caught up (a replay or a state download; ``catch_up_calls`` and
  ``catch_up_s`` in the JSON). ``round cpu s``: the median CPU seconds the peer's process (all its
  threads; not its p2pd) spent over those calls: where three peers share a machine's cores, a
  round cannot take less than their sum over the cores, whatever the link.
* ``wire s``: per such round, this peer's bytes at its link rate, max(sent / up, received / down),
  from the ``bytes_sent`` / ``bytes_received`` deltas of ``status()`` over the call; the median over
  rounds. The two directions are separate links, so the larger one bounds the round; the sum over
  the rate is in the JSON too (``wire_sum_s``). ``n/a`` on loopback.
* host RAM beyond model, gradients and optimizer, in bytes per parameter. Baseline: VmRSS of
  /proc/self/status after the model was built, one forward/backward pass left its gradients and one
  Adam step allocated both moments (16 bytes per parameter in all), after ``gc.collect()`` and before
  the ``Peer`` exists. ``steady``: VmRSS read right before each ``step()`` call that ran a swarm step
  (after ``backward()``: gradients present, as in the baseline), the median of those after the first
  round, minus the baseline. ``peak``: the largest VmRSS a thread sampling every 50 ms saw from the
  baseline on, minus the baseline (VmHWM minus the baseline is in the JSON too). The p2pd daemon a
  peer starts is another process: its median RSS is reported apart (``daemon MB``), not in these.
  ``swarm mem``: whatever ``status()`` reports under a key holding "memory", if it has one.
* the joiner's ``download s`` beside its state's bytes at the downlink rate: the time spent in
  ``swarmgrad.peer.catch_up.download_state`` (wrapped in the joiner's process) and the bytes of the
  snapshots it returned, summed over its downloads (``state MB ... in N`` where it took N); ``verify``: the share of that time spent in ``swarmgrad.state.transfer._verify``
  (the donors' second sketches and the local one, after the bytes are in). ``status()`` and the logs do
  not expose either: where these private functions are renamed the figures read n/a.
* ``stall``: the longest ``step()`` call that was no swarm-step call, beside the median of those calls,
  and their ratio (the training loop's worst pause outside rounds: e.g. serving the joiner's state).
  Each such call's wall time is split with the training thread's ``/proc/self/task/<tid>/schedstat``
  into seconds on a CPU, seconds runnable but waiting for a core (``runq``: the other peers' work on
  a shared machine) and the rest, ``blocked``: the thread waited on something (a lock, a future, I/O).
  ``blocked s`` is the longest such wait of any call outside rounds: what the peer made the training
  loop wait for, whatever the machine.

Before a size starts, the peers' memory is estimated as 3 x (16 + ``--swarm-bytes-per-param``) bytes
per parameter plus 0.4 GB per process; a size that would not fit in MemAvailable less 1 GiB is skipped
("skipped: needs ~X GiB"). While it runs, the parent sums the RSS of every process in the peers'
process groups every 0.5 s and kills them all past that cap. Every process and namespace started is
removed by its id, also on failure, SIGTERM or Ctrl-C.

``--quick`` (CI): one layer (4.2M parameters), loopback, int8, 4 rounds, the joiner after 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

WIDTH = 2048
PARAMS_PER_LAYER = WIDTH * WIDTH + WIDTH  # one Linear(2048, 2048): weight and bias
BATCH = 8
MODEL_BYTES_PER_PARAM = 16  # fp32 weights, gradients, Adam's two moments
PROCESS_OVERHEAD = 0.4e9  # Python, torch and a p2pd per peer process, before any model
HEADROOM = 1 << 30  # kept free for the rest of the machine
PEERS = 3  # two starters and a joiner
SAMPLE_S = 0.05
GiB = 1 << 30
MB = 1e6
SIZES, CODECS, NETWORKS = "20M,60M,200M", "int8,q2", "lab,loopback"
QUICK = {"sizes": "5M", "codecs": "int8", "networks": "loopback", "rounds": 4, "join_after": 1}
STATUS_FIELDS = ("epoch", "rounds_ok", "rounds_failed", "solo_steps", "state_downloads", "rounds_replayed")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- sizes and memory


def parse_size(text: str) -> int:
    """'20M' -> 20_000_000; 'k', 'M', 'G' suffixes, or a plain count."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def layers_for(params: int) -> int:
    return max(1, round(params / PARAMS_PER_LAYER))


def memory_needed(params: int, swarm_bytes_per_param: float) -> float:
    """Bytes the three peers are expected to hold at the peak."""
    return PEERS * ((MODEL_BYTES_PER_PARAM + swarm_bytes_per_param) * params + PROCESS_OVERHEAD)


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def proc_status(pid: int | str, key: str) -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM) in bytes, 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group ``pgid`` (a peer and the p2pd it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


# ---------------------------------------------------------------- the peer process


@dataclass
class WorkerConfig:
    role: str  # "starter" or "joiner"
    index: int
    layers: int
    codec: str
    run_id: str
    host: str
    inner_steps: int
    overlap: str
    deadline_s: float
    seed: int = 0
    joiner_moments: str = "download"  # DiLoCo's: "fresh" leaves the donors' Adam moments


class PeakSampler(threading.Thread):
    """The largest VmRSS of this process, read every ``SAMPLE_S`` seconds."""

    def __init__(self) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.peak = proc_status("self", "VmRSS")
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_S):
            self.peak = max(self.peak, proc_status("self", "VmRSS"))


class Commands(threading.Thread):
    """Lines from the parent on stdin: {"go": [initial peers]}, {"end_epoch": E}, {"stop": true} (end
    now, short of the end epoch) and {"leave": true}."""

    def __init__(self) -> None:
        super().__init__(name="parent-commands", daemon=True)
        self.initial_peers: list[str] = []
        self.end_epoch: int | None = None
        self.go, self.stop, self.leave = threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        for line in sys.stdin:
            message = json.loads(line)
            if "go" in message:
                self.initial_peers = list(message["go"])
                self.go.set()
            if "end_epoch" in message:
                self.end_epoch = int(message["end_epoch"])
            if message.get("stop"):
                self.stop.set()
            if message.get("leave"):
                self.leave.set()
        self.go.set()
        self.stop.set()
        self.leave.set()  # the parent is gone


def build_model(cfg: WorkerConfig) -> tuple[Any, Any, list[Any]]:
    """The model (same weights on every peer), its Adam, and this peer's batches."""
    import torch

    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(cfg.layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1000 + cfg.index)
    batches = [torch.randn(BATCH, WIDTH, generator=generator) for _ in range(4)]
    return model, optimizer, batches


def backward(model: Any, batch: Any) -> float:
    loss = model(batch).pow(2).mean()
    loss.backward()
    return float(loss.detach())


def allocate_training_state(model: Any, optimizer: Any, batch: Any) -> None:
    """One forward/backward and one Adam step: gradients kept, both moments allocated."""
    backward(model, batch)
    optimizer.step()


def instrument_download() -> dict[str, Any]:
    """Wrap the joiner's state download and its verification pass to time them (see the docstring)."""
    record: dict[str, Any] = {"download_s": None, "download_bytes": None, "verify_s": None}
    try:
        from swarmgrad.peer import catch_up
        from swarmgrad.state import transfer
    except ImportError:
        return record
    download, verify = getattr(catch_up, "download_state", None), getattr(transfer, "_verify", None)

    async def timed_download(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        snapshot = await download(*args, **kwargs)
        record["download_s"] = (record["download_s"] or 0.0) + time.perf_counter() - started
        record["download_bytes"] = (record["download_bytes"] or 0) + int(snapshot.nbytes)
        return snapshot

    async def timed_verify(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await verify(*args, **kwargs)
        finally:
            record["verify_s"] = (record["verify_s"] or 0.0) + time.perf_counter() - started

    if download is not None:
        catch_up.download_state = timed_download
    if verify is not None:
        transfer._verify = timed_verify
    return record


def status_counts(peer: Any) -> dict[str, int]:
    status = peer.status()
    counts = {name: int(getattr(status, name, 0)) for name in STATUS_FIELDS}
    counts["bytes_sent"], counts["bytes_received"] = status.bytes_sent, status.bytes_received
    return counts


def swarm_memory(peer: Any) -> dict[str, Any] | None:
    """What status() says about the swarm's memory, where it has such a field."""
    found = {key: value for key, value in peer.status().to_json().items() if "memory" in key}
    return found or None


def thread_schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable and waiting for one) of the calling thread so far (Linux);
    NaN where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
            on_cpu, waiting, _ = stats.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return float("nan"), float("nan")


def train(peer: Any, model: Any, batches: list[Any], commands: Commands, send: Any, deadline: float) -> dict:
    """Step until the parent's end epoch; every step() call timed, swarm steps told apart."""
    steps: list[float] = []
    step_epochs: list[int] = []  # the epoch each of those steps ran in
    step_cpu: list[float] = []  # of each of those steps: seconds on a CPU, and waiting for one
    step_runq: list[float] = []
    rounds: list[dict] = []
    steady: list[int] = []
    index = 0
    while not commands.stop.is_set() and (commands.end_epoch is None or peer.epoch < commands.end_epoch):
        if time.monotonic() > deadline:
            raise TimeoutError(f"reached epoch {peer.epoch} of {commands.end_epoch} before the deadline")
        loss = backward(model, batches[index % len(batches)])
        index += 1
        rss, before = proc_status("self", "VmRSS"), status_counts(peer)
        cpu_before, runq_before = thread_schedstat()
        process_before = time.process_time()
        started = time.perf_counter()
        peer.step(batch_size=BATCH, loss=loss)
        seconds = time.perf_counter() - started
        cpu_after, runq_after = thread_schedstat()
        process_cpu = time.process_time() - process_before
        after = status_counts(peer)
        if any(after[name] != before[name] for name in STATUS_FIELDS):
            rounds.append({"epoch": after["epoch"], "seconds": seconds, "rss_before": rss, "cpu_s": process_cpu,
                           "ok": after["rounds_ok"] - before["rounds_ok"],
                           "failed": after["rounds_failed"] - before["rounds_failed"],
                           "bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                           "bytes_received": after["bytes_received"] - before["bytes_received"]})
            steady.append(rss)
            send({"event": "epoch", "epoch": peer.epoch, "rounds_ok": after["rounds_ok"]})
        else:
            steps.append(seconds)
            step_epochs.append(after["epoch"])
            step_cpu.append(cpu_after - cpu_before)
            step_runq.append(runq_after - runq_before)
    return {"steps": steps, "step_epochs": step_epochs, "step_cpu": step_cpu, "step_runq": step_runq,
            "rounds": rounds}


def worker(cfg: WorkerConfig) -> None:
    """One peer process: model, baseline, Peer, training, one JSON result line to the parent."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print goes to the log; stdout belongs to the protocol

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        run_worker(cfg, send)
    except BaseException as error:
        import traceback

        log(traceback.format_exc())
        send({"event": "error", "error": f"{type(error).__name__}: {error}"[:2000]})


def run_worker(cfg: WorkerConfig, send: Any) -> None:
    import torch

    import swarmgrad as sg
    from swarmgrad.eventloop import configure_logging

    configure_logging(logging.INFO)
    torch.set_num_threads(1)
    deadline = time.monotonic() + cfg.deadline_s
    model, optimizer, batches = build_model(cfg)
    allocate_training_state(model, optimizer, batches[0])
    gc.collect()
    baseline = proc_status("self", "VmRSS")
    if cfg.role == "joiner":
        optimizer.state.clear()  # a fresh joiner: it downloads the whole state, Adam's moments included
        gc.collect()
    sampler, commands = PeakSampler(), Commands()
    sampler.start()
    commands.start()
    download = instrument_download() if cfg.role == "joiner" else None
    send({"event": "built"})
    if not commands.go.wait(max(1.0, deadline - time.monotonic())) or commands.leave.is_set():
        raise TimeoutError("the parent never said go")
    started = time.perf_counter()
    peer = sg.Peer(model, optimizer, run_id=cfg.run_id, initial_peers=commands.initial_peers,
                   strategy=sg.DiLoCo(inner_steps=cfg.inner_steps, overlap=cfg.overlap,
                                      joiner_moments=cfg.joiner_moments),
                   averaging=sg.Moshpit(group_size=PEERS), compression=cfg.codec, network=sg.NodeConfig(host=cfg.host))
    daemon_rss: list[int] = []
    with peer:
        enter_s = time.perf_counter() - started
        send({"event": "ready", "maddrs": peer.maddrs, "epoch": peer.epoch})
        if cfg.role == "starter":
            peer.wait_for_peers(2, 60)
        daemon = threading.Thread(target=_sample_daemons, args=(daemon_rss, commands.leave), daemon=True)
        daemon.start()
        record = train(peer, model, batches, commands, send, deadline)
        status, memory = peer.status(), swarm_memory(peer)
        result = {"role": cfg.role, "index": cfg.index, "params": sum(p.numel() for p in model.parameters()),
                  "baseline_rss": baseline, "peak_rss": sampler.peak, "hwm": proc_status("self", "VmHWM"),
                  "enter_s": enter_s, "rounds_ok": status.rounds_ok, "rounds_failed": status.rounds_failed,
                  "state_downloads": status.state_downloads, "epoch": status.epoch, "swarm_memory": memory,
                  "daemon_rss": statistics.median(daemon_rss) if daemon_rss else None,
                  "download": download, "stopped": commands.stop.is_set(), **record}
        send({"event": "result", **result})
        commands.leave.wait(max(1.0, deadline - time.monotonic()))  # groupmates may still finish a round with us
    sampler.stopped.set()


def _sample_daemons(samples: list[int], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        pids = [pid for pid in group_pids(os.getpgrp()) if pid != os.getpid()]
        samples.append(sum(proc_status(pid, "VmRSS") for pid in pids))


# ---------------------------------------------------------------- the parent: one group of peers


class Network:
    """Where the peers run: loopback processes, or one lab namespace each. Context manager."""

    def __init__(self, kind: str, mbps: float, rtt_ms: float):
        self.kind, self.mbps, self.rtt_ms = kind, mbps, rtt_ms
        self.net: Any = None

    def __enter__(self) -> Network:
        if self.kind == "lab":
            from swarmgrad.lab.network import EmulatedNetwork, LinkSpec

            # a packet a -> b spends delay_a + delay_b one way: the round trip is 4 x one link's delay
            link = LinkSpec(self.mbps, self.mbps, self.rtt_ms / 4, 0.0)
            self.net = EmulatedNetwork([link] * PEERS).__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.net is not None:
            self.net.__exit__(*exc_info)

    def host(self, index: int) -> str:
        return self.net.address(index) if self.net is not None else "127.0.0.1"

    def rate_bytes(self) -> float | None:
        return self.mbps * 1e6 / 8 if self.kind == "lab" else None

    def start(self, index: int, argv: list[str], log_file: TextIO) -> subprocess.Popen:
        options: dict[str, Any] = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        if self.net is not None:
            return self.net.popen(index, argv, **options)
        return subprocess.Popen(argv, start_new_session=True, **options)


class GroupFailed(RuntimeError):
    pass


@dataclass
class Group:
    """Three peer processes of one case: started, told when to end and leave, removed."""

    network: Network
    log_dir: Path
    cap_bytes: float
    deadline: float
    processes: list[subprocess.Popen] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)

    def start(self, cfg: WorkerConfig) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(cfg))]
        with open(self.log_dir / f"peer-{cfg.index}.log", "w") as log_file:
            process = self.network.start(cfg.index, argv, log_file)
        self.processes.append(process)
        threading.Thread(target=self._read, args=(cfg.index, process), daemon=True).start()

    def _read(self, index: int, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            try:
                self.events.put((index, json.loads(line)))
            except json.JSONDecodeError:
                continue
        self.events.put((index, {"event": "exit"}))

    def tell(self, message: dict, only: int | None = None) -> None:
        for index, process in enumerate(self.processes):
            if (only is None or only == index) and process.poll() is None and process.stdin is not None:
                try:
                    process.stdin.write(json.dumps(message) + "\n")
                    process.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass

    def next_event(self) -> tuple[int, dict] | None:
        """The next line from a peer, None after 0.5 s without one; GroupFailed on the deadline, the
        memory cap or a peer's error."""
        while True:
            if time.monotonic() > self.deadline:
                raise GroupFailed("the case ran past its deadline")
            rss = sum(proc_status(pid, "VmRSS") for p in self.processes for pid in group_pids(p.pid))
            if rss > self.cap_bytes:
                raise GroupFailed(f"killed: the peers held {rss / GiB:.1f} GiB, over the {self.cap_bytes / GiB:.1f} GiB cap")
            try:
                index, message = self.events.get(timeout=0.5)
            except queue.Empty:
                return None
            if message["event"] == "error":
                raise GroupFailed(f"peer {index}: {message['error']}")
            if message["event"] == "exit":
                raise GroupFailed(f"peer {index} exited (code {self.processes[index].poll()}) before reporting; "
                                  f"see {self.log_dir / f'peer-{index}.log'}")
            return index, message

    def close(self, grace_s: float) -> None:
        """Let the peers leave for ``grace_s``, then SIGTERM and SIGKILL their process groups."""
        self.tell({"leave": True})
        end = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [p for p in self.processes if p.poll() is None or group_pids(p.pid)]
            for process in left:
                try:
                    os.killpg(process.pid, sig)  # its own session: the peer and its p2pd
                except (ProcessLookupError, PermissionError):
                    pass
            for process in left:
                try:
                    process.wait(3)
                except subprocess.TimeoutExpired:
                    pass


@dataclass
class Case:
    network: str
    codec: str
    size: str
    params: int
    layers: int
    rounds: int
    join_after: int
    inner_steps: int
    overlap: str
    deadline_s: float
    joiner_moments: str = "download"


JOINER_PATIENCE = 3  # the swarm waits at most this many times the joiner's rounds for it to average them
STRAGGLER_S = 60.0  # a peer still short of the end epoch this long after the others reported is stopped


@dataclass
class Conductor:
    """The parent's side of one case: who enters the swarm when, and the epoch everyone ends at.

    The joiner enters once both starters did ``join_after`` rounds. The end: the epoch after the one
    at which the joiner averaged its ``rounds - join_after``-th round (at least ``rounds``), or, if it
    has not by then, once the swarm is ``JOINER_PATIENCE`` times that many rounds past its arrival
    (a joiner that never catches up shows as such instead of running the case into its deadline).
    A peer that has not reached the end epoch ``STRAGGLER_S`` after the others reported is told to
    stop where it is (a joiner that cannot take the state, e.g. when the donors disagree)."""

    case: Case
    group: Group
    built: set[int] = field(default_factory=set)
    went: set[int] = field(default_factory=set)  # told to enter the swarm
    epochs: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})
    maddrs: list[str] | None = None
    arrival: int | None = None  # the swarm's epoch when the joiner was in
    joiner_ok: int = 0
    end: int | None = None
    reported: dict[int, float] = field(default_factory=dict)  # peer -> when its result came
    stopped: set[int] = field(default_factory=set)

    def handle(self, index: int, message: dict) -> None:
        event = message["event"]
        if event == "built":
            self.built.add(index)
        elif event == "ready" and index == 0:
            self.maddrs = message["maddrs"]
        elif event == "ready" and index == 2:
            self.arrival = max(self.epochs.values())
            log(f"  the joiner is in at epoch {message['epoch']}, the swarm at {self.arrival}")
        elif event == "epoch":
            self.epochs[index] = message["epoch"]
            if index == 2:
                self.joiner_ok = message["rounds_ok"]
        elif event == "result":
            self.reported[index] = time.monotonic()
        self._admit()
        self._maybe_end()

    def tick(self, now: float) -> None:
        """Stop the peers still training ``STRAGGLER_S`` after all the others reported."""
        if len(self.reported) < PEERS - 1 or len(self.reported) == PEERS:
            return
        if now - max(self.reported.values()) > STRAGGLER_S:
            for index in set(range(PEERS)) - set(self.reported) - self.stopped:
                self.stopped.add(index)
                log(f"  peer {index} is stopped at epoch {self.epochs.get(index)}: short of {self.end} "
                    f"{STRAGGLER_S:.0f} s after the others")
                self.group.tell({"stop": True}, only=index)

    def _admit(self) -> None:
        ready = {0} if self.maddrs is None else {0, 1}
        if self.maddrs is not None and min(self.epochs[0], self.epochs[1]) >= self.case.join_after:
            ready.add(2)
        for index in sorted((self.built & ready) - self.went):
            self.went.add(index)
            if index == 2:
                log(f"  the joiner enters at epoch {max(self.epochs.values())}")
            self.group.tell({"go": self.maddrs or []}, only=index)

    def _maybe_end(self) -> None:
        if self.end is not None or self.arrival is None:
            return
        wanted = self.case.rounds - self.case.join_after
        swarm = max(self.epochs.values())
        if self.joiner_ok >= wanted or swarm >= self.arrival + JOINER_PATIENCE * wanted:
            self.end = max(self.case.rounds, swarm + 1)
            log(f"  the joiner averaged {self.joiner_ok} round(s); everyone ends at epoch {self.end}")
            self.group.tell({"end_epoch": self.end})


def run_case(case: Case, network: Network, log_dir: Path, cap_bytes: float) -> tuple[list[dict], dict]:
    """All three processes build their models at once; the two starters enter the swarm, then the
    joiner (``Conductor``); everyone trains to the end epoch. Results by peer, and the swarm's epochs
    at the joiner's arrival and at the end."""
    group = Group(network, log_dir, cap_bytes, time.monotonic() + case.deadline_s)
    run_id = f"bigmodel-{case.network}-{case.codec}-{case.size}-{os.getpid()}"
    for index, role in enumerate(("starter", "starter", "joiner")):
        group.start(WorkerConfig(role, index, case.layers, case.codec, run_id, network.host(index), case.inner_steps,
                                 case.overlap, case.deadline_s, joiner_moments=case.joiner_moments))
    conductor, results, finished = Conductor(case, group), {}, False
    try:
        while len(results) < PEERS:
            conductor.tick(time.monotonic())
            got = group.next_event()
            if got is None:
                continue
            index, message = got
            if message["event"] == "result":
                results[index] = message
            conductor.handle(index, message)
        finished = True
    finally:
        group.close(grace_s=30.0 if finished else 2.0)
    return [results[i] for i in range(PEERS)], {"joiner_arrival": conductor.arrival, "end_epoch": conductor.end}


# ---------------------------------------------------------------- summaries


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def per_param(value: float | None, params: int) -> float | None:
    return None if value is None else value / params


def round_figures(rounds: list[dict], rate: float | None) -> dict:
    """Round time and wire time over the calls that attempted a round (ok or failed); the calls that
    only caught up (a replay or a state download moved the epoch) are counted apart."""
    attempted = [r for r in rounds if r["ok"] + r["failed"] > 0]
    caught_up = [r for r in rounds if r["ok"] + r["failed"] == 0]
    return {
        "round_s": median([r["seconds"] for r in attempted]),
        # the process's CPU seconds over those calls, all its threads (the round's codec, rule and
        # transport work, and the call's Adam step); not the p2pd daemon's
        "round_cpu_s": median([r["cpu_s"] for r in attempted if "cpu_s" in r]),
        "wire_s": median([max(r["bytes_sent"], r["bytes_received"]) / rate for r in attempted]) if rate else None,
        "wire_sum_s": median([(r["bytes_sent"] + r["bytes_received"]) / rate for r in attempted]) if rate else None,
        "round_mb_sent": median([r["bytes_sent"] / MB for r in attempted]),
        "round_mb_received": median([r["bytes_received"] / MB for r in attempted]),
        "catch_up_calls": len(caught_up), "catch_up_s": sum(r["seconds"] for r in caught_up),
    }


def summarize_peer(result: dict, rate: float | None) -> dict:
    """The numbers of one peer's row (the docstring says what each is)."""
    params, baseline = result["params"], result["baseline_rss"]
    rounds = result["rounds"]
    after_first = [r["rss_before"] for r in rounds[1:]] or [r["rss_before"] for r in rounds]
    steady = median([float(v - baseline) for v in after_first])
    steps = result["steps"]
    stall, typical = (max(steps), statistics.median(steps)) if steps else (None, None)
    step_epochs = result.get("step_epochs") or []
    stall_epoch = step_epochs[steps.index(stall)] if stall is not None and len(step_epochs) == len(steps) else None
    cpu, runq = result.get("step_cpu") or [], result.get("step_runq") or []
    split = len(cpu) == len(runq) == len(steps) and steps
    blocked = [max(0.0, wall - on_cpu - waiting) for wall, on_cpu, waiting in zip(steps, cpu, runq)] if split else []
    at = steps.index(stall) if split else None
    download = result.get("download") or {}
    row = {
        "role": result["role"], "index": result["index"], "params": params, "epoch": result["epoch"],
        "stopped": result.get("stopped", False),
        "rounds_ok": result["rounds_ok"], "rounds_failed": result["rounds_failed"], **round_figures(rounds, rate),
        "steady_bytes_per_param": per_param(steady, params),
        "peak_bytes_per_param": per_param(result["peak_rss"] - baseline, params),
        "hwm_bytes_per_param": per_param(result["hwm"] - baseline, params),
        "baseline_rss": baseline, "daemon_rss": result["daemon_rss"], "swarm_memory": result["swarm_memory"],
        "stall_s": stall, "stall_epoch": stall_epoch, "median_step_s": typical,
        "stall_ratio": stall / typical if stall is not None and typical else None,
        "stall_cpu_s": cpu[at] if at is not None else None, "stall_runq_s": runq[at] if at is not None else None,
        "stall_blocked_s": blocked[at] if at is not None else None,
        "longest_blocked_s": max(blocked) if blocked else None,
        "median_blocked_s": statistics.median(blocked) if blocked else None,
        "median_step_cpu_s": statistics.median(cpu) if split else None,
        "state_downloads": result["state_downloads"], "enter_s": result["enter_s"],
        "download_s": download.get("download_s"), "download_bytes": download.get("download_bytes"),
        "verify_s": download.get("verify_s"),
        "rounds": rounds, "steps": len(steps),
    }
    nbytes = row["download_bytes"]
    row["download_wire_s"] = nbytes / rate if rate and nbytes else None
    verify, seconds = row["verify_s"], row["download_s"]
    row["verify_share"] = verify / seconds if verify is not None and seconds else None
    return row


def summarize_case(peers: list[dict]) -> dict:
    """The case's point in the PNG: the starters' median round and wire time, the peers' median steady
    and largest peak RAM per parameter."""
    starters = [p for p in peers if p["role"] == "starter"]
    return {"round_s": median([p["round_s"] for p in starters if p["round_s"] is not None]),
            "wire_s": median([p["wire_s"] for p in starters if p.get("wire_s") is not None]),
            "steady_bytes_per_param": median([p["steady_bytes_per_param"] for p in peers
                                              if p["steady_bytes_per_param"] is not None]),
            "peak_bytes_per_param": max((p["peak_bytes_per_param"] for p in peers), default=None)}


# ---------------------------------------------------------------- running every case


def case_deadline(params: int, rounds: int, args: argparse.Namespace) -> float:
    """Generous: startup, a state at 16 B/param over the link twice, and the rounds a joiner may take
    (``Conductor``) at ten times an int8 round's bytes."""
    if args.deadline_s:
        return args.deadline_s
    rate = args.mbps * 1e6 / 8
    return 120 + 3 * params / 1e6 + 32 * params / rate + rounds * JOINER_PATIENCE * (10 + 10 * params / rate)


def run_one(case: Case, args: argparse.Namespace, log_dir: Path) -> dict:
    record: dict[str, Any] = {**asdict(case), "status": "ok", "reason": None, "peers": [], "summary": None}
    need, available = memory_needed(case.params, args.swarm_bytes_per_param), mem_available()
    record.update(memory_needed=need, memory_available=available)
    if need > available - HEADROOM:
        record.update(status="skipped", reason=f"skipped: needs ~{need / GiB:.1f} GiB, "
                                               f"{(available - HEADROOM) / GiB:.1f} GiB free")
        log(f"{case.network}/{case.codec}/{case.size}: {record['reason']}")
        return record
    if case.network == "lab" and (missing := lab_unavailable()):
        record.update(status="skipped", reason=f"skipped: the lab cannot run here ({missing})")
        log(f"{case.network}/{case.codec}/{case.size}: {record['reason']}")
        return record
    log(f"{case.network}/{case.codec}/{case.size}: {case.layers} layers, {case.params:,} parameters, "
        f"~{need / GiB:.1f} GiB expected, deadline {case.deadline_s:.0f} s")
    started = time.monotonic()
    try:
        with Network(case.network, args.mbps, args.rtt_ms) as network:
            results, epochs = run_case(case, network, log_dir, available - HEADROOM)
            rate = network.rate_bytes()
    except (GroupFailed, OSError, RuntimeError) as error:
        record.update(status="failed", reason=str(error))
        log(f"{case.network}/{case.codec}/{case.size} failed: {error}")
        return record
    record.update(epochs)
    record["peers"] = [summarize_peer(result, rate) for result in results]
    record["summary"] = summarize_case(record["peers"])
    record["wall_s"] = time.monotonic() - started
    log(f"{case.network}/{case.codec}/{case.size}: done in {record['wall_s']:.0f} s")
    return record


def lab_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    from swarmgrad.errors import StartupError
    from swarmgrad.lab.network import check_requirements

    try:
        check_requirements()
    except StartupError as error:
        return str(error)
    return None


def cases(args: argparse.Namespace) -> list[Case]:
    found = []
    for network in args.networks:
        for codec in args.codecs:
            for size in args.sizes:
                layers = layers_for(parse_size(size))
                params = layers * PARAMS_PER_LAYER
                found.append(Case(network, codec, size, params, layers, args.rounds, args.join_after,
                                  args.inner_steps, args.overlap, case_deadline(params, args.rounds, args),
                                  args.joiner_moments))
    return found


# ---------------------------------------------------------------- output


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def memory_cell(value: dict | None) -> str:
    if not value:
        return "n/a"
    return ", ".join(f"{k}={v}" for k, v in value.items())[:40]


def state_cell(peer: dict) -> str:
    """The state's MB, and how many downloads they took where more than one."""
    if peer["download_bytes"] is None:
        return "n/a"
    count = peer["state_downloads"]
    return f"{peer['download_bytes'] / MB:.0f}" + (f" in {count}" if count > 1 else "")


COLUMNS = ("peer", "ok/failed", "round s", "round cpu s", "wire s", "steady B/param", "peak B/param", "daemon MB",
           "swarm mem", "download s", "state MB", "state wire s", "verify", "stall s", "median step s", "stall ratio",
           "stall cpu/runq/blocked s", "blocked s")


def table_rows(record: dict) -> list[tuple[str, ...]]:
    rows = []
    for peer in record["peers"]:
        joiner = peer["role"] == "joiner"
        rows.append((
            f"{peer['role']} {peer['index']}" + (f" (stopped at {peer['epoch']})" if peer.get("stopped") else ""),
            f"{peer['rounds_ok']}/{peer['rounds_failed']}", fmt(peer["round_s"]), fmt(peer.get("round_cpu_s")),
            fmt(peer["wire_s"]), fmt(peer["steady_bytes_per_param"], 1), fmt(peer["peak_bytes_per_param"], 1),
            fmt(None if peer["daemon_rss"] is None else peer["daemon_rss"] / MB, 0), memory_cell(peer["swarm_memory"]),
            fmt(peer["download_s"]) if joiner else "", state_cell(peer) if joiner else "",
            fmt(peer["download_wire_s"]) if joiner else "", fmt(peer["verify_share"]) if joiner else "",
            fmt(peer["stall_s"], 3) + (f" @{peer['stall_epoch']}" if peer.get("stall_epoch") is not None else ""), fmt(peer["median_step_s"], 3), fmt(peer["stall_ratio"], 1),
            "/".join(fmt(peer.get(key), 1) for key in ("stall_cpu_s", "stall_runq_s", "stall_blocked_s")),
            fmt(peer.get("longest_blocked_s"), 3),
        ))  # fmt: skip
    return rows


def render(record: dict, args: argparse.Namespace) -> Any:
    from rich.table import Table

    link = f"{args.mbps:g} Mbit/s up and down, {args.rtt_ms:g} ms RTT" if record["network"] == "lab" else "unshaped"
    title = (f"{record['network']} ({link}), {record['codec']}, {record['size']}: {record['layers']} x "
             f"Linear(2048, 2048) = {record['params']:,} parameters, DiLoCo H={record['inner_steps']}")
    if record.get("joiner_arrival") is not None:
        title += f"; the joiner came in at epoch {record['joiner_arrival']}, all ended at {record['end_epoch']}"
    if record["status"] != "ok":
        table = Table(title=title, title_justify="left", min_width=min(len(title), 160))
        table.add_column("status")
        table.add_row(record["reason"])
        return table
    table = Table(title=title, title_justify="left", caption=(
        "round s: median step() call that attempted a round; wire s: max(sent/up, received/down) of that "
        "round at the link rate. B/param: host RSS beyond model, gradients and Adam (steady: before each "
        "swarm step after the first, median; peak: 50 ms samples). daemon MB: the peer's p2pd. download "
        "s: the joiner's state downloads (all of them, as state MB), beside their bytes at the link rate; "
        "verify: share spent in the verification pass. stall: the longest step() outside rounds (@ the epoch it ran in), beside the median step; its "
        "seconds on a CPU, waiting for a core and blocked; blocked s: the longest wait of any step() outside rounds."))
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("peer", "swarm mem") else "right")
    for row in table_rows(record):
        table.add_row(*row)
    return table


def write_png(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rounds_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        if record["status"] == "ok":
            lines.setdefault((record["codec"], record["network"]), []).append(record)
    for (codec, network), points in sorted(lines.items()):
        points.sort(key=lambda r: r["params"])
        x = [r["params"] / 1e6 for r in points]
        label, summaries = f"{codec}, {network}", [r["summary"] for r in points]
        [line] = rounds_axis.plot(x, [s["round_s"] for s in summaries], marker="o", label=f"{label} round")
        color = line.get_color()
        if any(s.get("wire_s") is not None for s in summaries):
            rounds_axis.plot(x, [s.get("wire_s") for s in summaries], marker=".", linestyle=":", color=color,
                             label=f"{label} wire")
        memory_axis.plot(x, [s["steady_bytes_per_param"] for s in summaries], marker="o", color=color,
                         label=f"{label} steady")
        memory_axis.plot(x, [s["peak_bytes_per_param"] for s in summaries], marker="x", linestyle="--", color=color,
                         label=f"{label} peak")
    rounds_axis.set(xlabel="parameters (M)", ylabel="seconds", title="median round, and its bytes at the link rate")
    memory_axis.set(xlabel="parameters (M)", ylabel="host bytes per parameter beyond model + Adam",
                    title="swarm memory")
    for axis in (rounds_axis, memory_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=SIZES, help="parameter counts: 20M,60M,200M")
    parser.add_argument("--codecs", default=CODECS)
    parser.add_argument("--networks", default=NETWORKS, help="lab (needs root) and/or loopback")
    parser.add_argument("--rounds", type=int, default=8, help="rounds the swarm takes at least (the starters')")
    parser.add_argument("--join-after", type=int, default=3, help="the joiner starts once both starters did this many")
    parser.add_argument("--inner-steps", type=int, default=5, help="DiLoCo H")
    parser.add_argument("--overlap", default="off", choices=("off", "auto", "on"))
    parser.add_argument("--joiner-moments", default="download", choices=("download", "fresh"),
                        help="DiLoCo's joiner_moments: fresh, the joiner takes no Adam moments (half its download)")
    parser.add_argument("--mbps", type=float, default=100.0, help="lab: every link's rate, up and down")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="lab: round trip between any two peers")
    parser.add_argument("--swarm-bytes-per-param", type=float, default=100.0,
                        help="what a peer may hold beyond model and Adam, for the memory estimate")
    parser.add_argument("--deadline-s", type=float, default=None, help="per case (default: from size and rate)")
    parser.add_argument("--quick", action="store_true", help="CI: 5M, loopback, int8, 4 rounds, joiner after 1")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--png", default=None, help="write round seconds and bytes/param against P here")
    parser.add_argument("--render", default=None, help="print (and plot) saved --out reports (FILE,FILE...) instead of running")
    parser.add_argument("--logs", default=None, help="keep each peer's log in this directory")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.sizes = [s for s in str(args.sizes).split(",") if s]
    args.codecs = [c for c in str(args.codecs).split(",") if c]
    args.networks = [n for n in str(args.networks).split(",") if n]
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from swarmgrad.averaging.codecs import CODEC_NAMES

    if unknown := [n for n in args.networks if n not in ("lab", "loopback")]:
        parser.error(f"unknown network {unknown[0]!r}; choose lab or loopback")
    if unknown := [c for c in args.codecs if c.split(":")[0] not in CODEC_NAMES]:
        parser.error(f"unknown codec {unknown[0]!r}; choose from {', '.join(CODEC_NAMES)}")
    for size in args.sizes:
        try:
            if parse_size(size) <= 0:
                raise ValueError
        except ValueError:
            parser.error(f"--sizes: {size!r} is not a parameter count like 20M")
    if not (1 <= args.join_after < args.rounds) or args.inner_steps < 1:
        parser.error("need 1 <= --join-after < --rounds and --inner-steps >= 1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(WorkerConfig(**json.loads(args.worker)))
        return 0
    from swarmgrad.lab.signals import restore_handlers, terminate_on_signals

    if args.render:
        return output(args, rerender([Path(path) for path in args.render.split(",")], args))
    started, load = time.monotonic(), os.getloadavg()
    saved = terminate_on_signals()  # SIGTERM unwinds like Ctrl-C: every group and lab is removed
    records: list[dict] = []
    try:
        with _log_root(args.logs) as logs:
            for case in cases(args):
                log_dir = Path(logs) / f"{case.network}-{case.codec}-{case.size}"
                log_dir.mkdir()
                record = run_one(case, args, log_dir)
                if record["status"] == "failed":
                    record["log_tails"] = _tails(log_dir)
                records.append(record)
                if args.out:  # after each case: a long invocation cut short keeps what it measured
                    Path(args.out).write_text(json.dumps(make_report(args, records, load, started), indent=2))
    finally:
        restore_handlers(saved)
    return output(args, make_report(args, records, load, started))


def output(args: argparse.Namespace, report: dict) -> int:
    """The tables (or the JSON on stdout) and the PNG; exit status 1 if a case failed."""
    from rich.console import Console

    records = report["cases"]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.png:
        write_png(records, args.png)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console = Console(width=None if sys.stdout.isatty() else 220)
        for record in records:
            console.print(render(record, args))
    return 1 if any(record["status"] == "failed" for record in records) else 0


def rerender(paths: list[Path], args: argparse.Namespace) -> dict:
    """Saved reports as one (their cases in turn), round figures and summaries computed again by
    this version's rules."""
    reports = [json.loads(path.read_text()) for path in paths]
    report = {**reports[0], "cases": [record for each in reports for record in each["cases"]]}
    for key in ("mbps", "rtt_ms"):
        setattr(args, key, report["config"][key])
    for record in report["cases"]:
        rate = args.mbps * 1e6 / 8 if record["network"] == "lab" else None
        for peer in record["peers"]:
            peer.update(round_figures(peer["rounds"], rate))
        if record["status"] == "ok":
            record["summary"] = summarize_case(record["peers"])
    return report


def make_report(args: argparse.Namespace, records: list[dict], load: tuple[float, ...], started: float) -> dict:
    keys = ("sizes", "codecs", "networks", "rounds", "join_after", "inner_steps", "overlap", "joiner_moments", "mbps",
            "rtt_ms", "swarm_bytes_per_param")
    return {"config": {key: getattr(args, key) for key in keys},
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load, "loadavg_end": os.getloadavg(),
                        "mem_available_end": mem_available()},
            "cases": records, "wall_s": time.monotonic() - started}


@contextlib.contextmanager
def _log_root(path: str | None) -> Iterator[str]:
    """The peers' logs: under ``--logs`` (kept), else in a temporary directory removed at the end."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="big-model-") as logs:
        yield logs


def _tails(log_dir: Path, chars: int = 3000) -> dict[str, str]:
    return {path.name: path.read_text(errors="replace")[-chars:] for path in sorted(log_dir.glob("*.log"))}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as interrupted:
        sys.exit(getattr(interrupted, "exit_code", 130))
