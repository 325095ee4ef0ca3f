"""A swarm that lives for an hour with churn: does anything grow, stall or stop? (issue 38, item 4)

    python benchmarks/soak.py --minutes 60 --plot soak.png [--json]     # the full run (about 65 min)
    python benchmarks/soak.py --minutes 3 --json                       # CI's variant
    python benchmarks/soak.py --minutes 10 --peers 7 --no-churn --logs DIR   # no kills; every log kept

Real processes on loopback: a ``swarmgrad bootstrap`` node and ``--peers`` (6) ``swarmgrad peer
digits`` peers (DiLoCo), each with a fixed identity. The schedule is written for an hour and
compressed by ``--minutes / 60``: one peer killed (SIGKILL, its p2pd too: a crash, its presence
record left behind) and restarted every 5 min, always the last one (the churner), so the others live
the whole run (their memory over an hour each); the bootstrap node killed at minute 20;
a new peer joining at minute 25 through a member's address (``status().entry_points``). Every 30 s
(scaled, at least 1 s) it samples each live process, Python and p2pd: resident memory, open file
descriptors, threads; and from each peer's last ``--json`` progress event: asyncio tasks, the bytes
of kept results and served state copies, rounds ok/failed, the longest round seen against its
deadline. The longest training-loop stall of each peer is the longest gap between progress events
in which its step did not move (events come every second: that is its resolution), with what moved
across it (rounds failed, downloads, replays); failed rounds are counted by kind from each peer's
log (``--logs DIR`` keeps the logs whole). A process that exits though the soak did not end it is
reported (``unexpected_exits``: when, its status, its last stderr lines): a peer must not exit
because another crashed.

Then: a table of slopes after the warm-up (10 min, scaled; a restarted process's from as long
after its own start: any process's allocator grows over its first minutes, and peers left alone
for 28 minutes grew 2.0-3.0%/h from minute 5 against 1.4-2.1%/h from minute 10), RSS as % per
hour of its mean, the others per hour; the share of rounds ok; whether the swarm went on after
the bootstrap died and when the late joiner first averaged; ``--plot`` draws every sampled series
against time (matplotlib). Issue 38's targets: RSS growth at most 5%/h per process, fds, threads
and tasks flat, >= 95% of rounds ok, no round over its deadline, no stall over one round's
deadline, the late joiner averaging within 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]
RUN = "soak"
HOUR = 3600.0
# the schedule of an hour-long soak, in seconds of that hour (scaled by --minutes / 60)
KILL_EVERY, BOOTSTRAP_DIES, LATE_JOIN, SAMPLE_EVERY, WARM_UP = 300.0, 1200.0, 1500.0, 30.0, 600.0
# a restarted peer takes 20-40 s here to import torch, start p2pd and take the swarm's state: kills
# closer together than this would only ever kill peers that have not started training again
MIN_KILL_EVERY = 45.0


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc (Linux; psutil is not among the project's dependencies)."""
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            found.setdefault(parent, []).append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def usage(pid: int) -> dict[str, int] | None:
    """Resident bytes, open fds and threads of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": int(fields["Threads"])}
    except (OSError, KeyError, ValueError):
        return None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# a peer's log line for a failed round (peer/counters.py), and what makes two errors the same kind
FAILED_ROUND = re.compile(r"round \d+: failed \((.*)\), \d+ peers")
ERROR_DETAILS = re.compile(r"12D3Koo\w+|\d+(\.\d+)?")


def error_kind(error: str) -> str:
    """A round error with its peer ids and numbers left out, so the same failure counts once."""
    return ERROR_DETAILS.sub("#", error)[:160]


class Proc:
    """A child process whose stdout lines (JSON events) and stderr tail are drained by threads; its
    failed rounds are counted by kind from its log, which ``logs`` (a directory) also keeps whole."""

    logs: Path | None = None

    def __init__(self, name: str, argv: list[str]):
        self.name, self.argv, self.started = name, argv, time.monotonic()
        self.round_errors: Counter[str] = Counter()
        # line-buffered: the log is readable while the soak runs
        self.log = open(self.logs / f"{name}.log", "w", buffering=1) if self.logs is not None else None
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self.events: list[tuple[float, dict]] = []  # (monotonic time, progress event)
        self.ready: dict | None = None
        self.daemons: set[int] = set()
        self.killed = False  # by the soak: any other exit is a crash the report names
        for pipe, sink in ((self.process.stdout, self._stdout), (self.process.stderr, self._stderr)):
            threading.Thread(target=self._drain, args=(pipe, sink), daemon=True).start()

    def _drain(self, pipe, sink) -> None:
        for line in pipe:
            sink(line.rstrip("\n"))

    def _stdout(self, line: str) -> None:
        self.lines.append(line)
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "progress":
                self.events.append((time.monotonic(), event))
                self.events = self.events[-4000:]  # bounded; stalls are tracked as events arrive
            elif event.get("event") == "ready":
                self.ready = event

    def _stderr(self, line: str) -> None:
        self.stderr = (self.stderr + [line])[-50:]
        failed = FAILED_ROUND.search(line)
        if failed:
            self.round_errors[error_kind(failed.group(1))] += 1
        if self.log is not None:
            self.log.write(line + "\n")

    def processes(self) -> list[int]:
        """This process's pid and its descendants' (p2pd among them), remembered for a kill."""
        if not self.alive():
            return []
        found = descendants(self.process.pid)
        self.daemons |= set(found)
        return [self.process.pid, *found]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self, grace: float = 0.0) -> None:
        """SIGKILL (after ``grace`` seconds, for a SIGTERM sent before), then the daemons under it."""
        self.processes()
        self.killed = True
        if grace <= 0 and self.alive():
            self.process.kill()
        try:
            self.process.wait(timeout=max(grace, 10))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        for pid in self.daemons:  # a crash leaves its p2pd behind: end it, by its id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class PeerSlot:
    """One peer's place in the swarm: its identity survives restarts, its processes do not."""

    name: str
    argv: list[str]
    incarnations: list[Proc] = field(default_factory=list)

    @property
    def current(self) -> Proc:
        return self.incarnations[-1]

    def start(self) -> Proc:
        self.incarnations.append(Proc(f"{self.name}#{len(self.incarnations)}", self.argv))
        return self.current


def peer_argv(directory: Path, index: int, initial: str, inner_steps: int, create: bool) -> list[str]:
    # -v: every round's outcome in the log (INFO), where failed rounds are counted by kind
    return [*SWARMGRAD, "-v", "peer", "digits", "--run-id", RUN, "--initial-peers", initial, "--threads", "1",
            "--identity", str(directory / f"peer{index}.key"), "--inner-steps", str(inner_steps), "--json",
            "--shard", str(index), "--num-shards", "8", *(["--create"] if create else [])]


def exited_by_itself(proc: Proc) -> bool:
    """A process that ended though the soak did not end it (a peer must not exit because another crashed)."""
    return not proc.killed and not proc.alive()


def exit_report(proc: Proc, at: float) -> dict:
    """When it ended, its exit status and its last stderr lines (read at the end: the pipe drains after the exit)."""
    return {"process": proc.name, "t": at, "returncode": proc.process.returncode, "stderr_tail": proc.stderr[-30:]}


def entry_points(slots: list[PeerSlot]) -> list[str]:
    """Addresses live members name to join through (``status().entry_points``), newest views first."""
    found: list[str] = []
    for slot in slots:
        if slot.current.alive() and slot.current.events:
            found += [a for a in slot.current.events[-1][1].get("entry_points") or [] if a not in found]
    return found


def wait_for(what: str, check, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"{what} not within {seconds:.0f} s")


def sample(now: float, procs: list[Proc]) -> list[dict]:
    """One row per live process (Python and each p2pd under it)."""
    rows = []
    for proc in procs:
        if not proc.alive():
            continue
        last = proc.events[-1][1] if proc.events else {}
        memory = last.get("swarm_memory") or {}
        for index, pid in enumerate(proc.processes()):
            measured = usage(pid)
            if measured is None:
                continue
            row = {"t": now, "process": proc.name if index == 0 else f"{proc.name}/p2pd", **measured}
            if index == 0 and last:
                row.update(tasks=last.get("asyncio_tasks"), kept_results=memory.get("kept_results", 0),
                           served_state_copies=memory.get("served_state_copies", 0),
                           rounds_ok=last.get("rounds_ok", 0), rounds_failed=last.get("rounds_failed", 0))
            rows.append(row)
    return rows


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    ts, vs = [t for t, _ in points], [v for _, v in points]
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(vs)
    var = sum((t - mean_t) ** 2 for t in ts)
    return 0.0 if var == 0 else sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, vs)) / var * HOUR


def slopes(rows: list[dict], starts: dict[str, float], warm_up: float) -> dict[str, dict]:
    """Per process: RSS %/h of its mean, fds/threads/tasks per hour, over its samples after the warm-up
    (and as long after its own start); processes with fewer than 4 such samples are left out."""
    table = {}
    for name in sorted({row["process"] for row in rows}):
        start = starts.get(name.split("/")[0], 0.0)
        kept = [row for row in rows if row["process"] == name and row["t"] >= max(warm_up, start + warm_up)]
        if len(kept) < 4:
            continue
        mean_rss = statistics.fmean(row["rss"] for row in kept)
        entry = {"samples": len(kept), "rss_mb": mean_rss / 1e6,
                 "rss_pct_per_hour": 100 * slope_per_hour([(r["t"], r["rss"]) for r in kept]) / mean_rss}
        for metric in ("fds", "threads", "tasks"):
            points = [(r["t"], r[metric]) for r in kept if r.get(metric) is not None]
            if len(points) >= 4:
                entry[f"{metric}_per_hour"] = slope_per_hour(points)
        table[name] = entry
    return table


# what a peer's status says about a stall: how these moved between the event before it and the one after
STALL_COUNTERS = ("epoch", "rounds_ok", "rounds_failed", "state_downloads", "solo_steps", "rounds_replayed",
                  "rounds_overlapped", "rounds_unreachable")


def stall_cause(before: dict, after: dict) -> dict[str, Any]:
    """What changed across a stall (rounds, downloads, epochs), and the round errors seen after it."""
    moved = {key: after.get(key, 0) - before.get(key, 0) for key in STALL_COUNTERS
             if isinstance(after.get(key), int) and after.get(key) != before.get(key)}
    return {"moved": moved, "warning": after.get("warning"), "absent": after.get("absent"),
            "longest_round": after.get("longest_round"), "round_deadline": after.get("round_deadline")}


def stalls_and_rounds(slots: list[PeerSlot], began: float, warm_up: float) -> dict[str, Any]:
    """Per incarnation: the longest gap in which its step did not move (after its first step), and the
    longest after the warm-up (``warm_up`` seconds into the soak and a fifth of it into the
    process's life, so a restarted peer's first swarm step, which takes the swarm's
    state, is not counted as a stall of a running loop), each with what moved across it; the
    longest round it reported against the deadline then, its rounds."""
    result = {}
    for slot in slots:
        for proc in slot.incarnations:
            longest_stall, longest_round, longest_allreduce, over, last_move, last_step = 0.0, 0.0, 0.0, 0, None, None
            moved_event, stall, steady, steady_stall = None, None, 0.0, None
            counted_from = max(began + warm_up, proc.started + warm_up / 5)
            for at, event in proc.events:
                step = event.get("step", 0)
                if last_step is None or step != last_step:
                    if last_move is not None and last_step:
                        gap = at - last_move
                        what = {"seconds": gap, "ended_after": at - proc.started, **stall_cause(moved_event, event)}
                        if gap > longest_stall:
                            longest_stall, stall = gap, what
                        if last_move >= counted_from and gap > steady:
                            steady, steady_stall = gap, what
                    last_move, last_step, moved_event = at, step, event
                longest_round = max(longest_round, event.get("longest_round") or 0.0)
                # the deadline bounds a round's all-reduce (matchmaking has its own window); the
                # longest all-reduce is checked against the deadline as it stood then
                deadline, allreduce = event.get("round_deadline"), event.get("longest_allreduce") or 0.0
                over += bool(deadline and allreduce > deadline and allreduce > longest_allreduce)
                longest_allreduce = max(longest_allreduce, allreduce)
            last = proc.events[-1][1] if proc.events else {}
            result[proc.name] = {"longest_stall": longest_stall, "stall": stall, "longest_stall_after_warm_up": steady,
                                 "stall_after_warm_up": steady_stall, "longest_round": longest_round,
                                 "longest_allreduce": longest_allreduce,
                                 "rounds_over_deadline": over, "rounds_ok": last.get("rounds_ok", 0),
                                 "round_errors": dict(proc.round_errors.most_common(5)),
                                 "rounds_failed": last.get("rounds_failed", 0),
                                 "deadline": last.get("round_deadline")}
    return result


def plot(rows: list[dict], path: Path, events: list[tuple[float, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("rss", "RSS (MB)", 1e6), ("fds", "open fds", 1), ("threads", "threads", 1),
               ("tasks", "asyncio tasks", 1), ("kept_results", "kept results (MB)", 1e6),
               ("served_state_copies", "served state copies (MB)", 1e6), ("rounds_ok", "rounds ok", 1),
               ("rounds_failed", "rounds failed", 1)]
    figure, axes = plt.subplots(len(metrics), 1, figsize=(10, 2.6 * len(metrics)), sharex=True)
    for axis, (metric, label, unit) in zip(axes, metrics):
        for name in sorted({row["process"] for row in rows}):
            points = [(row["t"] / 60, row[metric] / unit) for row in rows
                      if row["process"] == name and row.get(metric) is not None]
            if points:
                axis.plot(*zip(*points), label=name, linewidth=0.8)
        for at, what in events:
            axis.axvline(at / 60, color="grey", linestyle=":", linewidth=0.6)
        axis.set_ylabel(label)
    axes[-1].set_xlabel("minutes")
    axes[0].legend(fontsize=6, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def soak(minutes: float, peers: int, inner_steps: int, plot_path: Path | None, churn: bool = True) -> dict:
    """``churn=False``: no peer is killed (the bootstrap still dies and the late joiner still comes)."""
    scale = minutes * 60 / HOUR
    kill_every, bootstrap_dies, late_join = max(MIN_KILL_EVERY, KILL_EVERY * scale), BOOTSTRAP_DIES * scale, \
        LATE_JOIN * scale
    if not churn:
        kill_every = float("inf")
    sample_every, warm_up = max(1.0, SAMPLE_EVERY * scale), WARM_UP * scale
    rows: list[dict] = []
    timeline: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        directory = Path(tmp)
        bootstrap = Proc("bootstrap", [*SWARMGRAD, "bootstrap", "--identity", str(directory / "boot.key")])
        slots: list[PeerSlot] = []
        late: PeerSlot | None = None
        try:
            boot = wait_for("the bootstrap's address", lambda: bootstrap.lines[0] if bootstrap.lines else None, 60)
            for index in range(peers):
                slot = PeerSlot(f"peer{index}", peer_argv(directory, index, boot, inner_steps, create=index == 0))
                slot.start()
                if index == 0:  # the run's manifest first, then the others join it
                    wait_for("the first peer", lambda: slot.current.events, 120)
                    slot.argv = peer_argv(directory, 0, boot, inner_steps, create=False)  # restarts join
                slots.append(slot)
            wait_for("every peer training", lambda: all(s.current.events for s in slots), 180)
            began = time.monotonic()
            log(f"{peers} peers training; soaking for {minutes:g} min")
            next_sample, next_kill = 0.0, kill_every
            bootstrap_dead, late_started = False, None
            starts: dict[str, float] = {}
            exits: dict[str, tuple[Proc, float]] = {}
            while (now := time.monotonic() - began) < minutes * 60:
                current = [bootstrap, *(s.current for s in slots), *([late.current] if late else [])]
                for proc in current:
                    if proc.name not in exits and exited_by_itself(proc):
                        exits[proc.name] = (proc, now)
                        log(f"{proc.name} exited by itself, status {proc.process.returncode}")
                if now >= next_sample:
                    rows += sample(now, current)
                    next_sample += sample_every
                if now >= next_kill:
                    # always the last peer (the churner): the others live the whole run, so their memory is
                    # measured over an hour each. Round robin over peers 1-5 left peer3's first process 15
                    # minutes, 5 after the warm-up: a slope over 5 minutes is one allocator step (2 MB of
                    # 400 read +5.3%/h), not a growth rate; the churner's 5-minute lives are all warm-up
                    slot = slots[-1]
                    log(f"killing {slot.current.name} (SIGKILL) and restarting it")
                    slot.current.kill()
                    # it comes back through the bootstrap node and two live members: several initial
                    # peers, so the bootstrap's death does not keep it out
                    slot.argv = peer_argv(directory, slots.index(slot), ",".join([boot, *entry_points(slots)[:2]]),
                                          inner_steps, create=False)
                    starts[slot.start().name] = now
                    timeline.append((now, f"restart {slot.name}"))
                    next_kill += kill_every
                if not bootstrap_dead and now >= bootstrap_dies:
                    log("killing the bootstrap node")
                    bootstrap.kill()
                    bootstrap_dead = True
                    timeline.append((now, "bootstrap dies"))
                if late is None and now >= late_join:
                    through = entry_points(slots)[:2]
                    log(f"a new peer joins through {through}")
                    late = PeerSlot("late", peer_argv(directory, peers, ",".join(through), inner_steps, False))
                    starts[late.start().name] = now
                    late_started = now
                    timeline.append((now, "late joiner"))
                time.sleep(0.2)
            ended = time.monotonic() - began
            all_slots = slots + ([late] if late else [])
            per_incarnation = stalls_and_rounds(all_slots, began, warm_up)
        finally:
            everything = [bootstrap, *(p for s in slots for p in s.incarnations), *(late.incarnations if late else [])]
            for proc in everything:  # side by side: a peer's shutdown takes seconds
                proc.processes()
                if proc.alive():
                    proc.process.send_signal(signal.SIGTERM)
            for proc in everything:
                proc.kill(grace=15)
    ok = sum(entry["rounds_ok"] for entry in per_incarnation.values())
    failed = sum(entry["rounds_failed"] for entry in per_incarnation.values())
    after_boot = [row for row in rows if row["t"] >= bootstrap_dies and row.get("rounds_ok") is not None]
    rounds_at = {}  # process -> rounds ok at its first and last sample after the bootstrap died
    for row in after_boot:
        first, _ = rounds_at.get(row["process"], (row["rounds_ok"], 0))
        rounds_at[row["process"]] = (first, row["rounds_ok"])
    late_events = late.current.events if late else []
    late_averaged = next((at - began - late_started for at, event in late_events if event.get("rounds_ok", 0) > 0),
                         None) if late else None
    result = {
        "minutes": minutes, "peers": peers, "scale": scale, "seconds": ended,
        "schedule": {"kill_every": kill_every if churn else None, "bootstrap_dies": bootstrap_dies,
                     "late_join": late_join,
                     "sample_every": sample_every, "warm_up": warm_up},
        "rounds_ok": ok, "rounds_failed": failed, "rounds_ok_share": ok / max(1, ok + failed),
        "rounds_after_bootstrap_died": sum(last - first for first, last in rounds_at.values()),
        "late_joiner_averaged_after": late_averaged,
        "longest_stall": max((e["longest_stall"] for e in per_incarnation.values()), default=0.0),
        "longest_stall_after_warm_up": max((e["longest_stall_after_warm_up"] for e in per_incarnation.values()),
                                           default=0.0),
        "longest_round": max((e["longest_round"] for e in per_incarnation.values()), default=0.0),
        "rounds_over_deadline": sum(e["rounds_over_deadline"] for e in per_incarnation.values()),
        "round_errors": dict(sum((Counter(e["round_errors"]) for e in per_incarnation.values()), Counter())),
        "slopes": slopes(rows, starts, warm_up), "incarnations": per_incarnation, "samples": rows,
        "timeline": timeline, "unexpected_exits": [exit_report(proc, at) for proc, at in exits.values()],
    }
    if plot_path is not None:
        plot(rows, plot_path, timeline)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="length; the hour's schedule is scaled to it")
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=20, help="DiLoCo local steps per round")
    parser.add_argument("--plot", type=Path, help="draw every sampled series against time into this PNG")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (samples included)")
    parser.add_argument("--logs", type=Path, help="keep every process's log in this directory")
    parser.add_argument("--no-churn", action="store_true", help="kill no peer (the bootstrap still dies)")
    args = parser.parse_args()
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        Proc.logs = args.logs
    if not (0.5 <= args.minutes <= 24 * 60 and 2 <= args.peers <= 16):
        parser.error("--minutes must be within 0.5..1440 and --peers within 2..16")
    result = soak(args.minutes, args.peers, args.inner_steps, args.plot, churn=not args.no_churn)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'process':<16}{'samples':>8}{'RSS MB':>9}{'RSS %/h':>9}{'fds/h':>8}{'threads/h':>10}{'tasks/h':>9}")
    for name, entry in result["slopes"].items():
        print(f"{name:<16}{entry['samples']:>8}{entry['rss_mb']:>9.1f}{entry['rss_pct_per_hour']:>9.1f}"
              f"{entry.get('fds_per_hour', float('nan')):>8.1f}{entry.get('threads_per_hour', float('nan')):>10.1f}"
              f"{entry.get('tasks_per_hour', float('nan')):>9.1f}")
    print(f"rounds ok {result['rounds_ok']}, failed {result['rounds_failed']} "
          f"({100 * result['rounds_ok_share']:.1f}% ok); after the bootstrap died: "
          f"{result['rounds_after_bootstrap_died']} ok")
    print(f"late joiner first averaged after {result['late_joiner_averaged_after']} s; longest round "
          f"{result['longest_round']:.1f} s ({result['rounds_over_deadline']} over their deadline); longest "
          f"training-loop stall {result['longest_stall']:.1f} s ({result['longest_stall_after_warm_up']:.1f} s "
          "after the warm-up)")
    for ended in result["unexpected_exits"]:
        print(f"{ended['process']} exited by itself at {ended['t']:.0f} s, status {ended['returncode']}:")
        print("\n".join(f"    {line}" for line in ended["stderr_tail"]))
    for error, count in sorted(result["round_errors"].items(), key=lambda item: -item[1]):
        print(f"{count:>6} failed rounds: {error}")
    for name, entry in result["incarnations"].items():
        if entry["stall"]:
            print(f"{name}: longest stall {entry['longest_stall']:.1f} s ending {entry['stall']['ended_after']:.0f} s "
                  f"into its life; across it: {entry['stall']['moved']}")


if __name__ == "__main__":
    main()
