"""Real-size models through ``sg.Peer``: round time, wire time, host RAM per parameter, a joiner's
download and the training loop's stalls, for 20M to 200M parameters, on loopback and in the lab.

    .venv/bin/python benchmarks/big_model.py --networks loopback [--sizes 20M,60M] [--codecs int8,q2]
    sudo .venv/bin/python benchmarks/big_model.py [--networks lab,loopback] [--mbps 100] [--rtt-ms 40]
        [--rounds 8] [--join-after 3] [--json] [--out FILE.json] [--png FILE.png] [--quick]
    .venv/bin/python benchmarks/big_model.py --render FILE.json[,FILE.json] [--png FILE.png]  # saved reports again

For each network, codec and size P: a model of ``round(P / 4,196,352)`` ``torch.nn.Linear(2048, 2048)``
layers, each followed by a ``Tanh`` (fp32, each 4,196,352 parameters; the table says the exact count;
without the tanh the stack overflowed to Inf by the 32nd round at 201M), an Adam inner optimizer,
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
  ``catch_up_s`` in the JSON). ``averaging / all-reduce s``: of those calls, the median seconds of
  the averaging step (``status().last_report``'s ``seconds``: matchmaking and all-reduce) and of its
  all-reduce (``allreduce_seconds``); the rest of a call is the inner Adam step, the outer step and
  what the strategy does around the round. ``round cpu s``: the median CPU seconds the peer's process (all its
  threads; not its p2pd) spent over those calls: where three peers share a machine's cores, a
  round cannot take less than their sum over the cores, whatever the link.
* ``wire s``: per such round, this peer's bytes at its link rate, max(sent / up, received / down),
  from the ``bytes_sent`` / ``bytes_received`` deltas of ``status()`` over the call; the median over
  rounds. The two directions are separate links, so the larger one bounds the round; the sum over
  the rate is in the JSON too (``wire_sum_s``). ``link s``: the same for all the bytes the peer's
  link carried over the call (``/proc/self/net/dev`` of its namespace, every interface but loopback:
  link-layer bytes, the state it served and the replays included); ``quiet round s (n)``: the
  median of the n rounds whose link carried at most 1.15x their own bytes (no state served then) and
  during which no joiner fetched the state or a round's result (serving a replay's few bytes still
  costs a donor CPU beside its round: at 201M, int8, round CPU 12-17 s against 8.5 before the joiner).
  ``n/a`` on loopback.
* host RAM beyond model, gradients and optimizer, in bytes per parameter. Baseline: VmRSS of
  /proc/self/status after the model was built, one forward/backward pass left its gradients and one
  Adam step allocated both moments (16 bytes per parameter in all), after ``gc.collect()`` and before
  the ``Peer`` exists, with glibc's thresholds set first as the ``Peer`` sets them
  (``swarmgrad.hostmemory.tune_allocator``: what the allocator keeps of the training's own step is
  the training's, not the swarm's). ``steady``: VmRSS read right before each ``step()`` call that ran a swarm step
  (after ``backward()``: gradients present, as in the baseline), the median of those after the first
  round, minus the baseline. ``peak``: the largest VmRSS a thread sampling every 50 ms saw from the
  baseline on, minus the baseline (VmHWM minus the baseline is in the JSON too; ``peak_where``: each
  thread's innermost swarmgrad frames when the peak was seen; ``round_rise_bytes_per_param``: the median
  over swarm-step calls of how far RSS rose within the call above where it started, a round's own
  transient memory). ``BIG_MODEL_PROFILE_DIR=DIR`` makes each peer write a CPU-time profile of its
  event loop thread there (``loop-ROLEINDEX.prof``, pstats); ``BIG_MODEL_DEBUG=swarmgrad.averaging,...``
  makes each peer log those loggers at DEBUG (matchmaking says whom it waited for and why). The p2pd daemon a
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
  loop wait for, whatever the machine. Every such call is in the JSON (``step_log``: epoch, seconds,
  on a CPU, waiting for one), to find where in its epoch a stall came.

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
import json
import os
import queue
import signal
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its peer process and report modules

from _big_model_peer import PARAMS_PER_LAYER, PEERS, WorkerConfig, group_pids, log, proc_status  # noqa: E402
from _big_model_report import mark_joiner_fetches, output, rerender, summarize_case, summarize_peer  # noqa: E402

PEER_SCRIPT = Path(__file__).resolve().parent / "_big_model_peer.py"
MODEL_BYTES_PER_PARAM = 16  # fp32 weights, gradients, Adam's two moments
PROCESS_OVERHEAD = 0.4e9  # Python, torch and a p2pd per peer process, before any model
HEADROOM = 1 << 30  # kept free for the rest of the machine
GiB = 1 << 30
SIZES, CODECS, NETWORKS = "20M,60M,200M", "int8,q2", "lab,loopback"
QUICK = {"sizes": "5M", "codecs": "int8", "networks": "loopback", "rounds": 4, "join_after": 1}


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
        argv = [sys.executable, str(PEER_SCRIPT), json.dumps(asdict(cfg))]
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
    mark_joiner_fetches(results)
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
