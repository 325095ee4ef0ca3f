"""Resident memory of `swarmgrad peer` processes, their p2pd daemons included (issue 16, edge peers).

For each task, two real peers on loopback (one creates the run, one joins it) train until both
have averaged ``--rounds`` times; then the resident set size (RSS, and its peak) of each peer
process and of every process under it (p2pd) is read from /proc and summed.

    python scripts/peer_memory.py                      # digits and fashion-mnist, a table
    python scripts/peer_memory.py --tasks digits --json

Linux only (/proc). fashion-mnist reads its IDX files (``--data-dir``, default the task's).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]
PAGE_KIB = 1024  # /proc/PID/status reports kB


@dataclass
class Memory:
    task: str
    peer: str  # creator or joiner
    rounds_ok: int
    python_mib: float  # the peer process
    p2pd_mib: float  # every process under it (the libp2p daemon)
    total_mib: float
    peak_mib: float  # the sum of each process's high-water mark


class PeerProcess:
    """A `swarmgrad peer --json` child; a thread turns its stdout into events."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        bufsize=1, start_new_session=True)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.last: dict[str, dict[str, Any]] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.put(event)

    def wait_for(self, kind: str, seconds: float, condition=lambda event: True) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    raise RuntimeError(f"peer exited ({self.process.returncode}) before its {kind!r} event") from None
                continue
            self.last[event.get("event", "")] = event
            if event.get("event") == kind and condition(event):
                return event
        raise RuntimeError(f"no {kind!r} event within {seconds} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the peer and its p2pd: their own process group
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def _status_kib(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of ``pid`` in KiB (0, 0 if it is gone)."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def measure(pid: int) -> tuple[float, float, float]:
    """MiB: the process's RSS, its descendants' RSS, and the sum of all their peaks."""
    own, own_peak = _status_kib(pid)
    below = [_status_kib(child) for child in _descendants(pid)]
    return own / PAGE_KIB, sum(r for r, _ in below) / PAGE_KIB, (own_peak + sum(h for _, h in below)) / PAGE_KIB


def run_task(task: str, rounds: int, data_dir: str | None, seconds: float) -> list[Memory]:
    run_id = f"mem-{task}-{secrets.token_hex(3)}"
    common = ["--run-id", run_id, "--json", "--eval-every", "0", "--no-final-eval", "--max-seconds", str(seconds),
              "--wait", "60", "--num-shards", "2"]
    if data_dir:  # tasks that read no files ignore it
        common += ["--data-dir", data_dir]
    creator = PeerProcess([*SWARMGRAD, "peer", task, "--create", "--inner-steps", "10", "--shard", "0",
                           "--wait-peers", "2", *common])
    peers = {"creator": creator}
    try:
        ready = creator.wait_for("ready", 120)
        peers["joiner"] = PeerProcess([*SWARMGRAD, "peer", "--initial-peers", ready["maddrs"][0], "--shard", "1",
                                       *common])
        for peer in peers.values():
            peer.wait_for("progress", seconds, lambda event: event.get("rounds_ok", 0) >= rounds)
        results = []
        for name, peer in peers.items():
            python_mib, p2pd_mib, peak_mib = measure(peer.process.pid)
            results.append(Memory(task, name, peer.last["progress"]["rounds_ok"], round(python_mib, 1),
                                  round(p2pd_mib, 1), round(python_mib + p2pd_mib, 1), round(peak_mib, 1)))
        return results
    finally:
        for peer in peers.values():
            peer.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--rounds", type=int, default=3, help="averaging rounds each peer completes first")
    parser.add_argument("--data-dir", default=None, help="fashion-mnist: directory with the IDX files")
    parser.add_argument("--seconds", type=float, default=600.0, help="give up after this long per task")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON list")
    args = parser.parse_args(argv)
    results = [memory for task in args.tasks for memory in run_task(task, args.rounds, args.data_dir, args.seconds)]
    if args.json:
        print(json.dumps([asdict(memory) for memory in results]))
        return 0
    print(f"{'task':<15} {'peer':<8} {'rounds':>6} {'python MiB':>11} {'p2pd MiB':>9} {'total MiB':>10} {'peak MiB':>9}")
    for m in results:
        print(f"{m.task:<15} {m.peer:<8} {m.rounds_ok:>6} {m.python_mib:>11.1f} {m.p2pd_mib:>9.1f} "
              f"{m.total_mib:>10.1f} {m.peak_mib:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
