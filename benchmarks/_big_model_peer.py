"""The peer process of benchmarks/big_model.py: builds its model, enters the swarm when the parent says
so, trains to the parent's end epoch timing every ``step()`` call, and reports one JSON line (what
each figure means: big_model.py's docstring). The parent starts it as
``python benchmarks/_big_model_peer.py CONFIG_JSON``; stdin carries the parent's commands, stdout the
protocol, stderr the peer's log.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

WIDTH = 2048
PARAMS_PER_LAYER = WIDTH * WIDTH + WIDTH  # one Linear(2048, 2048): weight and bias
BATCH = 8
PEERS = 3  # two starters and a joiner
SAMPLE_S = 0.05
STATUS_FIELDS = ("epoch", "rounds_ok", "rounds_failed", "solo_steps", "state_downloads", "rounds_replayed")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
    """The largest VmRSS of this process, read every ``SAMPLE_S`` seconds, and where each thread was
    when it was seen (``where``: the innermost swarmgrad frames of each; what to chunk next)."""

    def __init__(self) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.peak = proc_status("self", "VmRSS")
        self.where: dict[str, list[str]] = {}
        self.recent = self.peak  # the largest since ``since``: one step() call's
        self.stopped = threading.Event()

    def since(self, rss: int) -> None:
        self.recent = rss

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_S):
            rss = proc_status("self", "VmRSS")
            self.recent = max(self.recent, rss)
            if rss > self.peak:
                self.peak, self.where = rss, _swarm_frames()


def _swarm_frames(depth: int = 4) -> dict[str, list[str]]:
    """Each thread's innermost ``depth`` frames in swarmgrad's code, as file:line function."""
    import traceback

    names = {thread.ident: thread.name for thread in threading.enumerate()}
    where = {}
    for ident, frame in sys._current_frames().items():
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)
                  if "/swarmgrad/" in f.filename]
        if frames:
            where[names.get(ident, str(ident))] = frames[-depth:]
    return where


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
    # a tanh after each layer: a stack of linear layers alone went to Inf by the 32nd round at 201M
    # (Adam moves every weight by about its learning rate however small its gradient, the outer
    # momentum adds those steps up, and their product over 48 layers overflowed float32)
    model = torch.nn.Sequential(*(module for _ in range(cfg.layers)
                                  for module in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())))
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
    record: dict[str, Any] = {"download_s": None, "download_bytes": None, "verify_s": None, "fetching": []}
    try:
        from swarmgrad.peer import catch_up
        from swarmgrad.state import transfer
    except ImportError:
        return record
    download, verify = getattr(catch_up, "download_state", None), getattr(transfer, "_verify", None)
    fetch = getattr(getattr(catch_up, "CatchUp", None), "fetch_missed", None)

    @contextmanager
    def fetching() -> Iterator[None]:
        """The wall-clock span of a fetch from donors (the state, a replayed or missed round's result), so
        the donors' rounds it overlapped are not counted quiet."""
        began = time.time()
        try:
            yield
        finally:
            record["fetching"].append((began, time.time()))

    async def timed_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        with fetching():
            return await fetch(self, *args, **kwargs)

    async def timed_download(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        with fetching():
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
    if fetch is not None:
        catch_up.CatchUp.fetch_missed = timed_fetch
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


def link_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this process's network namespace, every interface but loopback and
    the lab's ifb (which carries the incoming bytes a second time, to shape them) (/proc/self/net/dev:
    link-layer bytes, headers and acknowledgements included): in the lab, all that the peer's shaped
    link carried, state served and replays included."""
    from swarmgrad.lab.network import IFB_NAME

    received = sent = 0
    try:
        with open("/proc/self/net/dev") as dev:
            for line in dev.readlines()[2:]:
                name, counters = line.split(":", 1)
                if name.strip() not in ("lo", IFB_NAME):
                    fields = counters.split()
                    received, sent = received + int(fields[0]), sent + int(fields[8])
    except (OSError, ValueError, IndexError):
        pass
    return received, sent


def thread_schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable and waiting for one) of the calling thread so far (Linux);
    NaN where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
            on_cpu, waiting, _ = stats.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return float("nan"), float("nan")


def train(peer: Any, model: Any, batches: list[Any], commands: Commands, send: Any, deadline: float,
          sampler: PeakSampler) -> dict:
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
        rss, before, link_before = proc_status("self", "VmRSS"), status_counts(peer), link_bytes()
        cpu_before, runq_before = thread_schedstat()
        process_before = time.process_time()
        sampler.since(rss)
        started, began = time.perf_counter(), time.time()
        peer.step(batch_size=BATCH, loss=loss)
        seconds = time.perf_counter() - started
        cpu_after, runq_after = thread_schedstat()
        link_received, link_sent = (after - before for after, before in zip(link_bytes(), link_before))
        process_cpu = time.process_time() - process_before
        after = status_counts(peer)
        if any(after[name] != before[name] for name in STATUS_FIELDS):
            report = peer.status().last_report or {}  # the averaging step's own timing, where one ran
            rounds.append({"epoch": after["epoch"], "seconds": seconds, "began": began, "rss_before": rss,
                           "cpu_s": process_cpu,
                           "rss_rise": max(sampler.recent, proc_status("self", "VmRSS")) - rss,
                           "averaging_s": report.get("seconds"), "allreduce_s": report.get("allreduce_seconds"),
                           "ok": after["rounds_ok"] - before["rounds_ok"],
                           "failed": after["rounds_failed"] - before["rounds_failed"],
                           "bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                           "bytes_received": after["bytes_received"] - before["bytes_received"],
                           "link_sent": link_sent, "link_received": link_received})
            steady.append(rss)
            send({"event": "epoch", "epoch": peer.epoch, "rounds_ok": after["rounds_ok"]})
        else:
            steps.append(seconds)
            step_epochs.append(after["epoch"])
            step_cpu.append(cpu_after - cpu_before)
            step_runq.append(runq_after - runq_before)
    return {"steps": steps, "step_epochs": step_epochs, "step_cpu": step_cpu, "step_runq": step_runq,
            "rounds": rounds}


PROFILE_ENV = "BIG_MODEL_PROFILE_DIR"  # where each peer writes its event loop thread's CPU profile
DEBUG_ENV = "BIG_MODEL_DEBUG"  # comma-separated loggers (e.g. swarmgrad.averaging) each peer logs at DEBUG


def profile_event_loops(path: Path) -> None:
    """Diagnostics: the peer's event loop thread runs under cProfile timed by that thread's CPU time
    (not wall time: three peers on two cores wait for a core, which a sampling profiler counts as
    busy); the stats are written when the loop stops (``python -m pstats PATH``)."""
    import cProfile

    from swarmgrad import eventloop

    def profiled(run_forever: Any) -> Any:
        def run() -> None:
            profile = cProfile.Profile(time.thread_time)
            try:
                profile.runcall(run_forever)
            finally:
                profile.dump_stats(path)
        return run

    def init(self: Any, name: str = "swarmgrad-loop") -> None:  # BackgroundLoop's, its thread profiled
        self._loop = eventloop.new_event_loop()
        self._thread = threading.Thread(target=profiled(self._loop.run_forever), name=name, daemon=True)
        self._thread.start()

    eventloop.BackgroundLoop.__init__ = init


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
    from swarmgrad.hostmemory import tune_allocator

    configure_logging(logging.INFO)
    for name in filter(None, os.environ.get(DEBUG_ENV, "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)
    torch.set_num_threads(1)
    if os.environ.get(PROFILE_ENV):
        profile_event_loops(Path(os.environ[PROFILE_ENV]) / f"loop-{cfg.role}{cfg.index}.prof")
    tune_allocator()  # as sg.Peer will: what the allocator keeps of the training's own step is the baseline's
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
        record = train(peer, model, batches, commands, send, deadline, sampler)
        status, memory = peer.status(), swarm_memory(peer)
        result = {"role": cfg.role, "index": cfg.index, "params": sum(p.numel() for p in model.parameters()),
                  "baseline_rss": baseline, "peak_rss": sampler.peak, "peak_where": sampler.where,
                  "hwm": proc_status("self", "VmHWM"),
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


if __name__ == "__main__":
    worker(WorkerConfig(**json.loads(sys.argv[1])))
