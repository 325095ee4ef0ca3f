"""Real `swarmgrad bootstrap` / `swarmgrad peer --json` processes for end-to-end tests (not a test module).

Every process gets a reader thread per pipe, so its pipes never fill; stdout lines are parsed as JSON
events. ``Swarm`` tracks what it started and ``Swarm.close()`` ends all of it (p2pd daemons included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from conftest import p2pd_pids

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]

Event = dict[str, Any]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Process:
    """A child process whose stdout and stderr are drained by threads."""

    def __init__(self, argv: list[str], name: str):
        self.name, self.argv = name, argv
        self.started = time.time()
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        bufsize=1)
        self.lines: list[str] = []  # stdout
        self.stderr_lines: list[str] = []
        self.p2pd: set[int] = set()  # daemons seen under this process, ended at close
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=self._drain, args=(self.process.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._drain, args=(self.process.stderr, self.stderr_lines),
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def _drain(self, pipe, into: list[str]) -> None:
        for line in pipe:
            with self._changed:
                into.append(line.rstrip("\n"))
                self._parsed(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _parsed(self, line: str) -> None:
        pass

    def wait_until(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Wait (at most ``timeout`` s) until ``condition()`` is truthy; returns it, or raises with the logs."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = condition()
                if value:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{self.name}: {what} not seen within {timeout} s\n{self.describe()}")
                if self.process.poll() is not None and not any(thread.is_alive() for thread in self._threads):
                    value = condition()
                    if value:
                        return value
                    raise AssertionError(f"{self.name} exited ({self.process.returncode}) before {what}\n"
                                         f"{self.describe()}")
                self._changed.wait(min(remaining, 0.2))

    def remember_daemons(self) -> None:
        if self.process.poll() is None:
            self.p2pd |= p2pd_pids(self.process.pid)

    def wait_exit(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s\n{self.describe()}") from None
        for thread in self._threads:
            thread.join(timeout=5)
        return code

    def signal(self, sig: int) -> None:
        self.remember_daemons()
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM, without waiting: ``close()`` then waits for the exit."""
        self.remember_daemons()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; then end any p2pd left behind."""
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for pid in self.p2pd:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)

    def describe(self) -> str:
        stderr = "\n".join(self.stderr_lines[-40:])
        stdout = "\n".join(line[:300] for line in self.lines[-8:])
        return f"--- {self.name}: {' '.join(self.argv[2:])}\n--- stdout (tail):\n{stdout}\n--- stderr (tail):\n{stderr}"


class Bootstrap(Process):
    def __init__(self, *args: str):
        super().__init__([*SWARMGRAD, "bootstrap", *args], "bootstrap")
        self.maddr = self.wait_until(lambda: self.lines[0] if self.lines else None, 60, "its multiaddr")
        self.remember_daemons()


class PeerProcess(Process):
    """`swarmgrad peer ... --json`: ``events`` holds the parsed JSON lines as they arrive."""

    def __init__(self, args: list[str], name: str, verbose: int = 0):
        self.events: list[Event] = []
        self.bad_lines: list[str] = []
        super().__init__([*SWARMGRAD, *(["-" + "v" * verbose] if verbose else []), "peer", *args], name)

    def _parsed(self, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            self.events.append(json.loads(line))
        except json.JSONDecodeError:
            self.bad_lines.append(line)

    def of(self, kind: str) -> list[Event]:
        with self._changed:
            return [event for event in self.events if event.get("event") == kind]

    def last(self, kind: str) -> Event | None:
        found = self.of(kind)
        return found[-1] if found else None

    def wait_event(self, kind: str, timeout: float, where: Callable[[Event], bool] = lambda event: True) -> Event:
        def find():
            for event in self.events:
                if event.get("event") == kind and where(event):
                    return event
            return None

        return self.wait_until(find, timeout, f"a {kind!r} event")

    def ready(self, timeout: float = 60) -> Event:
        event = self.wait_event("ready", timeout)
        self.remember_daemons()
        return event

    def done(self, timeout: float) -> Event:
        return self.wait_event("done", timeout)

    def progress_value(self, key: str) -> Any:
        """``key`` of the latest progress (or done status) event."""
        done = self.last("done")
        if done is not None:
            return done["status"][key]
        progress = self.last("progress")
        return None if progress is None else progress[key]


class Swarm:
    """One bootstrap node plus peers; ``close()`` ends everything it started."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.processes: list[Process] = []
        self.bootstrap = self._track(Bootstrap())

    def _track(self, process):
        self.processes.append(process)
        return process

    def peer(self, *args: str, name: str | None = None, task: str | None = "digits", json_output: bool = True,
             initial_peers: bool = True, verbose: int = 0) -> PeerProcess:
        argv = [*([task] if task else []), "--run-id", self.run_id, "--threads", "1"]
        if initial_peers:
            argv += ["--initial-peers", self.bootstrap.maddr]
        argv += [*args, *(["--json"] if json_output else [])]
        return self._track(PeerProcess(argv, name or f"peer{len(self.processes)}", verbose))

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A short-lived `swarmgrad ...` command, to completion."""
        return subprocess.run([*SWARMGRAD, *args], capture_output=True, text=True, timeout=timeout)

    def describe(self) -> str:
        return "\n".join(process.describe() for process in self.processes)

    def close(self) -> None:
        errors = []
        peers = [process for process in self.processes if process is not self.bootstrap]
        for process in peers:  # they shut down side by side: a peer's final steps take seconds
            process.terminate()
        for process in reversed(self.processes):  # peers first, the bootstrap node last
            try:
                process.close()
            except Exception as error:  # keep closing the rest
                errors.append(error)
        if errors:
            raise errors[0]
