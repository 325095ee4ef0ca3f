"""Attack benchmark: honest peers' accuracy with Byzantine peers in the swarm, without and with the defences.

    .venv/bin/python benchmarks/attacks.py [--attacks scaled,weight,...] [--aggregators mean,defaults,median,...]
        [--peers 8] [--attackers 2] [--seconds S] [--task digits] [--target A] [--repeats N] [--privacy FLAGS]
        [--quick] [--json]

Every row is one fresh run on loopback: a bootstrap node and ``--peers`` real ``swarmgrad peer``
processes (DiLoCo, moshpit, int8), ``--attackers`` of them the real peer with one behaviour changed
(benchmarks/_attacker.py, which lists the attacks). Each attack runs once per ``--aggregators``
entry, next to a clean run of each: by default with ``--aggregator mean`` (what the attack does) and
with the run's defaults (centered-clip, weight caps, bans: what the defences do); any aggregation
rule (swarmgrad/averaging/rules/) can be named instead, and its rows run with ``--aggregator NAME``.
The poisoned-state rows add a joiner: one of the honest peers starts a quarter of the training time
late, takes the swarm's state (attackers serve it too) and trains at least that long (the row runs
longer if it must); its final accuracy is reported apart.

Reported per row: the honest peers' held-out accuracy when the row stops them (median and min;
their final evaluations after leaving are in the JSON too), seconds to
``--target`` (the median honest peer's first evaluation at or above it, counted from when every
starting peer was ready), rounds ok / failed (median honest peer), bans (how many honest peers
banned an attacker, how many attackers were banned by any honest peer, and any honest peer banned
by another), honest peers that crashed (exited without their final report: a diverged model can
do that), how often honest peers logged an attacker's contribution clipped or its weight cut,
and the round time (the mean over each honest peer's rounds, from its /metrics round-time
histogram, median over peers). Then, from the two clean rows, the
defaults' overhead: their time to target over mean's and their round time over mean's, and
issue 15's bars judged on those numbers (each attack under the defaults within 2 points of the
clean run; the defaults' time to target within 10% of mean's); they do not set the exit status.
A clean run's time to target varies by a second or more from run to run (rows take ~4 s to
reach it), so ``--repeats N`` runs the clean rows N times, the aggregators taking turns, and
judges on their medians (``--attacks clean --repeats 5``: the overhead bar alone).

``--privacy FLAGS`` gives every peer of every row those privacy flags: the attacks under DP against a
clean DP run. At the update level an attacker then changes what its releaser released (noise and
all, past its own clip), since a liar need not clip; the honest rows' noise sets centered-clip's
radius, so honest noisy rows are not clipped (``honest_clipped``).

``--quick`` (for CI): 4 peers, 1 attacker, 10 s rows side by side: clean and the scaled attack,
under the defaults (``--aggregators mean``: the scaled attack without them).
Progress goes to stderr, the table too when ``--json`` prints the report on stdout. Everything a
row starts (peers, their p2pd daemons, the bootstrap node) is ended when the row ends, also on
Ctrl-C or failure: each process leads its own process group. Exit status 0 when every row ran,
1 when one could not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _attacker import ATTACKS  # a script: its directory is on sys.path
from _harness import checks_table, fmt, log
from rich.console import Console
from rich.table import Table

from swarmgrad.averaging.rules import RULE_NAMES

BENCHMARKS = Path(__file__).resolve().parent
SWARMGRAD = [sys.executable, "-m", "swarmgrad"]
ATTACKER = [sys.executable, str(BENCHMARKS / "_attacker.py")]
DEFAULTS = "defaults"  # the aggregator column of rows that leave the run's defaults alone
AGGREGATORS = ("mean", DEFAULTS)  # the rows per attack unless --aggregators names others
JOINER_ATTACKS = {"poisoned-state"}  # rows that need a late honest peer to show anything
# honest peers' log lines (-v) that name a peer whose contribution their aggregation bounded
CLIPPED = re.compile(r"round \S+: (\S+)'s contribution was ")
WEIGHT_CUT = re.compile(r"round \S+: (\S+) claimed weight \S+; cut to ")
EXCEPTION = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line: its exception
GRACE_S = 20.0  # a peer's final evaluation and leaving, after SIGTERM
SAFETY_S = 180.0  # a peer's own --max-seconds: the row's training time plus this
ACCURACY_POINTS = 2.0  # issue 15's bar: an attack under the defaults ends this close to the clean run
TIME_SLACK = 0.10  # and without attackers the defaults reach the target within this of mean's time


@dataclass(frozen=True)
class Layout:
    """What every row of one invocation shares."""

    task: str
    peers: int
    attackers: int
    seconds: float  # training time of a row, from when every starting peer is ready
    inner_steps: int
    eval_every: float
    target: float
    join_after: float  # a joiner starts this long after every starting peer was ready, and trains at least as long
    privacy: tuple[str, ...] = ()  # flags every peer of every row gets (--privacy): attacks under DP


@dataclass(frozen=True)
class Row:
    attack: str | None  # None: the clean run
    aggregator: str  # a rule's name (--aggregator NAME), or DEFAULTS

    @property
    def label(self) -> str:
        return f"{self.attack or 'clean'}/{self.aggregator}"

    @property
    def joiner(self) -> bool:
        return self.attack in JOINER_ATTACKS


class Child:
    """A child process in its own process group; threads drain its pipes (stdout lines parsed as JSON events)."""

    def __init__(self, argv: list[str], name: str, log_path: Path | None = None):
        self.name, self.argv = name, argv
        self.launched = time.time()
        self.exited: float | None = None
        self.round_seconds: float | None = None  # mean over its rounds, read before it is stopped
        self.events: list[dict[str, Any]] = []
        self.received: list[float] = []  # wall time each event arrived
        self.stderr_tail: list[str] = []
        # peer id -> rounds this peer logged its contribution clipped (or trimmed) / its weight claim cut
        self.clipped: dict[str, int] = {}
        self.cut: dict[str, int] = {}
        self.first_line = threading.Event()
        self.lines: list[str] = []
        self.log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 (closed by the reader)
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                        start_new_session=True)  # its own group: p2pd goes with it
        self._threads = [threading.Thread(target=self._stdout, daemon=True),
                         threading.Thread(target=self._stderr, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self.first_line.set()
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                    self.received.append(time.time())
                except json.JSONDecodeError:
                    pass
        self.first_line.set()
        self.process.wait()
        self.exited = time.time()

    def _stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            for pattern, counts in ((CLIPPED, self.clipped), (WEIGHT_CUT, self.cut)):
                found = pattern.search(line)
                if found:
                    counts[found.group(1)] = counts.get(found.group(1), 0) + 1
            self.stderr_tail = [*self.stderr_tail[-30:], line.rstrip("\n")]
            if self.log is not None:
                self.log.write(line)
        if self.log is not None:
            self.log.close()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in list(self.events) if event.get("event") == kind]

    def drained(self) -> None:
        """Wait (briefly) until the pipes of an exited process are read to the end."""
        for thread in self._threads:
            thread.join(timeout=5)

    def crash(self) -> str | None:
        """Why it exited without a ``done`` event: the last line of its traceback, or its exit code."""
        if self.of("done") or self.process.poll() is None:
            return None
        errors = [line for line in self.stderr_tail if EXCEPTION.match(line)]
        return errors[-1][:200] if errors else f"exit code {self.process.returncode}"

    def arrived(self, kind: str) -> float | None:
        """When the first ``kind`` event arrived here (wall time)."""
        for event, at in zip(list(self.events), list(self.received)):
            if event.get("event") == kind:
                return at
        return None

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, grace_s: float) -> None:
        """SIGTERM (a peer leaves the run cleanly) and ``grace_s`` to exit, then SIGKILL to whatever is
        left of its process group (a p2pd daemon whose peer died)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is empty: everything exited
        self.process.wait()
        for thread in self._threads:
            thread.join(timeout=5)

    def describe(self) -> str:
        return f"--- {self.name}: exit {self.process.poll()}\n" + "\n".join(self.stderr_tail[-15:])


class RowFailed(RuntimeError):
    pass


def peer_argv(layout: Layout, row: Row, run_id: str, bootstrap: str, shard: int, wait_peers: int,
              attack: str | None) -> list[str]:
    argv = [layout.task, "--run-id", run_id, "--initial-peers", bootstrap, "--threads", "1",
            "--inner-steps", str(layout.inner_steps), "--num-shards", str(layout.peers), "--shard", str(shard),
            # the benchmark stops the peers; this only bounds a peer the benchmark could not stop
            "--max-seconds", f"{layout.seconds + SAFETY_S:.0f}", "--eval-every", f"{layout.eval_every:g}",
            "--wait-peers", str(wait_peers), "--wait", "90", "--json", *layout.privacy]
    if attack is None:
        argv += ["--metrics-port", "0"]  # its round-time histogram, read before the row stops it
    if row.aggregator != DEFAULTS:
        argv += ["--aggregator", row.aggregator]
    if attack is not None:
        return [*ATTACKER, "--attack", attack, *argv]
    return [*SWARMGRAD, "-v", "peer", *argv]  # -v: the honest peers log what their aggregation bounded


def run_row(layout: Layout, row: Row, bootstrap: str, stop: threading.Event, logs: Path | None = None) -> dict[str, Any]:
    """One fresh run through the ``bootstrap`` node: peers (attackers among them), an optional joiner;
    its measurements. Every peer is stopped at once ``layout.seconds`` after all were ready: one that
    left alone would hold the others' last round up to its deadline. ``logs``: a directory for each
    process's stderr (a folder per row)."""
    run_id = f"attacks-{secrets.token_hex(4)}"
    folder = None
    if logs is not None:
        folder = logs / row.label.replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []

    def start(argv: list[str], name: str) -> Child:
        child = Child(argv, name, folder / f"{name}.log" if folder is not None else None)
        children.append(child)
        return child

    try:
        attackers = layout.attackers if row.attack is not None else 0
        starters = layout.peers - int(row.joiner)
        peers: list[tuple[Child, bool]] = []  # (process, honest)
        for shard in range(starters):
            attack = row.attack if shard >= starters - attackers else None
            argv = peer_argv(layout, row, run_id, bootstrap, shard, starters, attack)
            peers.append((start(argv, f"attacker{shard}" if attack else f"honest{shard}"), attack is None))
        started = _wait_all(peers, "ready", 120, stop)
        joiner: Child | None = None
        if row.joiner:
            if stop.wait(layout.join_after):
                raise KeyboardInterrupt
            joiner = start(peer_argv(layout, row, run_id, bootstrap, starters, 1, None), "joiner")
            peers.append((joiner, True))
        ends = started + layout.seconds
        if joiner is not None:  # it trains a while after taking the state, however long it took to start
            ends = max(ends, _wait_all([(joiner, True)], "ready", 120, stop) + layout.join_after)
        if stop.wait(max(0.0, ends - time.time())):
            raise KeyboardInterrupt
        for child, honest in peers:
            if honest:
                child.round_seconds = _mean_round_seconds(child)
        stopped = time.time()
        for child in children:
            child.signal(signal.SIGTERM)  # each ends its step (or round), evaluates, and leaves
        _wait_all(peers, "done", 60 + GRACE_S, stop, exits_count=True)  # a peer may have crashed: that is data
        result = summarize(layout, row, [(child, honest) for child, honest in peers if child is not joiner], joiner,
                           started, stopped)
        result["ready_after"] = started - peers[0][0].launched  # start-up, on this machine now
        result["train_seconds"] = ends - started
        return result
    finally:
        stopping = [threading.Thread(target=child.stop, args=(GRACE_S,)) for child in children]
        for thread in stopping:  # side by side: each takes seconds to leave
            thread.start()
        for thread in stopping:
            thread.join()


def _mean_round_seconds(child: Child) -> float | None:
    """The mean of every round's time so far, from the peer's /metrics round-time histogram."""
    ready = child.of("ready")
    url = ready[0].get("metrics_url") if ready else None
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
    except OSError as error:
        log(f"{child.name}: no metrics from {url}: {error}")
        return None
    found = dict(re.findall(r"^swarmgrad_peer_round_seconds_(sum|count) (\S+)$", text, re.M))
    count = float(found.get("count", 0))
    return float(found["sum"]) / count if count else None


def _wait_all(peers: list[tuple[Child, bool]], kind: str, timeout: float, stop: threading.Event,
              exits_count: bool = False) -> float:
    """Wait until every peer emitted ``kind`` (``exits_count``: or exited); when the last one did (wall time)."""
    deadline = time.monotonic() + timeout
    while True:
        if stop.is_set():
            raise KeyboardInterrupt
        missing = [child for child, _ in peers if not child.of(kind)]
        if not missing:
            return max(child.arrived(kind) or 0.0 for child, _ in peers)
        dead = [child for child in missing if child.process.poll() is not None]
        if dead:
            for child in dead:
                child.drained()  # its last lines may still be in the pipe
            if exits_count and all(child.process.poll() is not None for child in missing):
                return time.time()
            if not exits_count and not dead[0].of(kind):
                raise RowFailed(f"{dead[0].name} exited before its {kind!r} event\n{dead[0].describe()}")
        if time.monotonic() > deadline:
            raise RowFailed(f"{missing[0].name}: no {kind!r} event within {timeout:.0f} s\n{missing[0].describe()}")
        time.sleep(0.2)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def latest_status(child: Child) -> dict[str, Any]:
    """Its final status, or for a peer that crashed its last progress event (the status less the last round's report)."""
    done = child.of("done")
    return done[0]["status"] if done else (child.of("progress") or [{}])[-1]


def last_accuracy(child: Child, before: float) -> float | None:
    """The peer's last held-out accuracy of a state from before ``before`` (wall time)."""
    found = [event["accuracy"] for event in child.of("eval") if event["t"] <= before and event.get("accuracy") is not None]
    return found[-1] if found else None


def summarize(layout: Layout, row: Row, peers: list[tuple[Child, bool]], joiner: Child | None,
              started: float, stopped: float) -> dict[str, Any]:
    """The row's numbers. Accuracy is each honest peer's last evaluation before the row stopped the
    peers: while they leave, the last rounds have fewer members (two cannot out-vote a liar), so the
    final evaluations after that (``left_accuracies``) also measure how the swarm came apart."""
    honest = [child for child, is_honest in peers if is_honest]
    attackers = [child for child, is_honest in peers if not is_honest]
    everyone = [*honest, *([joiner] if joiner else [])]
    ids = {child.of("ready")[0]["peer_id"]: child for child, _ in peers}
    if joiner is not None:
        ids[joiner.of("ready")[0]["peer_id"]] = joiner
    attacker_ids = {pid for pid, child in ids.items() if child in attackers}
    honest_ids = set(ids) - attacker_ids
    done = {child: child.of("done")[0] for child in everyone if child.of("done")}
    crashed = {child.name: child.crash() for child in everyone if child not in done}
    status_of = {child: latest_status(child) for child in everyone}
    accuracies = [value for child in honest if (value := last_accuracy(child, stopped)) is not None]
    left = [done[child]["final"]["accuracy"] for child in honest if child in done and done[child].get("final")]
    reached = []
    for child in honest:
        times = [max(0.0, event["t"] - started) for event in child.of("eval")  # a state it took may be there already
                 if (event.get("accuracy") or 0) >= layout.target]
        reached.append(min(times) if times else math.inf)
    time_to_target = statistics.median(reached) if reached else math.inf
    bans = {child: set(status_of[child].get("banned") or {}) for child in everyone}

    def counted(kind: str, whose: set[str]) -> int:
        return sum(count for child in everyone for pid, count in getattr(child, kind).items() if pid in whose)

    round_seconds = [child.round_seconds for child in honest if child.round_seconds is not None]
    status = [status_of[child] for child in honest if status_of[child]]
    result: dict[str, Any] = {
        "attack": row.attack or "clean",
        "aggregator": row.aggregator,
        "honest_peers": len(honest),  # the starters; a joiner is reported apart
        "observers": len(everyone),  # honest peers whose bans count (a joiner's too)
        "attackers": len(attackers),
        # rounds the attackers averaged in (with honest peers: nobody else is there), so their attack was delivered
        "attacker_rounds_ok": sum((latest_status(child).get("rounds_ok") or 0) for child in attackers),
        "accuracy_median": _median(accuracies),
        "accuracy_min": min(accuracies) if accuracies else None,
        "accuracies": accuracies,
        "left_accuracies": [value for value in left if value is not None],  # final evaluations, after leaving
        "time_to_target": None if math.isinf(time_to_target) else time_to_target,
        "reached_target": sum(not math.isinf(value) for value in reached),
        "crashed": crashed,  # honest peers that exited without their final report, and why
        "epoch_median": _median([s["epoch"] for s in status]),
        "rounds_ok": _median([s["rounds_ok"] for s in status]),
        "rounds_failed": _median([s["rounds_failed"] for s in status]),
        "round_seconds": _median(round_seconds),
        "bans_of_attackers": sum(bool(bans[child] & attacker_ids) for child in everyone),
        "attackers_banned": len(set().union(*bans.values()) & attacker_ids),
        "honest_banned": len(set().union(*bans.values()) & honest_ids),
        # (honest observer, round) pairs that logged an attacker's / an honest peer's contribution bounded
        "attacker_clipped": counted("clipped", attacker_ids),
        "attacker_weight_cut": counted("cut", attacker_ids),
        "honest_clipped": counted("clipped", honest_ids),
        "honest_weight_cut": counted("cut", honest_ids),
        "joiner": None,
    }
    if joiner is not None:
        final = (done[joiner].get("final") or {}) if joiner in done else {}
        evals = joiner.of("eval")
        result["joiner"] = {"accuracy": last_accuracy(joiner, stopped), "left_accuracy": final.get("accuracy"),
                            "first_accuracy": evals[0]["accuracy"] if evals else None,  # of the state it took
                            "state_downloads": status_of[joiner].get("state_downloads")}
    return result


def clean_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per aggregator, the clean rows' medians (one row, or ``--repeats`` of them) of what the bars
    judge on: accuracy, time to target (rows that never reached it left out) and round time."""
    found: dict[str, dict[str, Any]] = {}
    for aggregator in dict.fromkeys(row["aggregator"] for row in rows):
        clean = [row for row in rows if row["attack"] == "clean" and row["aggregator"] == aggregator
                 and "error" not in row]
        if clean:
            found[aggregator] = {key: _median([row[key] for row in clean if row[key] is not None])
                                 for key in ("accuracy_median", "time_to_target", "round_seconds")}
            found[aggregator]["runs"] = len(clean)
    return found


def overhead(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The defaults against mean without attackers (medians over the clean rows): time to target and
    round time, as ratios."""
    clean = clean_medians(rows)
    if not set(AGGREGATORS) <= set(clean):
        return None
    mean, defaults = clean["mean"], clean[DEFAULTS]

    def ratio(key: str) -> float | None:
        a, b = defaults.get(key), mean.get(key)
        return a / b if a is not None and b else None

    return {"time_to_target_mean": mean["time_to_target"], "time_to_target_defaults": defaults["time_to_target"],
            "time_ratio": ratio("time_to_target"), "round_seconds_mean": mean["round_seconds"],
            "round_seconds_defaults": defaults["round_seconds"], "round_ratio": ratio("round_seconds"),
            "clean_runs": mean["runs"]}


def checks(rows: list[dict[str, Any]], over: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Issue 15's bars, judged on what the rows measured: each attack under the defaults within
    ``ACCURACY_POINTS`` of the clean run's median, and the defaults' time to target within
    ``TIME_SLACK`` of mean's without attackers."""
    reference = clean_medians(rows).get(DEFAULTS, {}).get("accuracy_median")
    found = []
    for row in rows:
        if row["attack"] == "clean" or row["aggregator"] != DEFAULTS:
            continue
        value = row.get("accuracy_median")
        ok = None if reference is None or value is None else \
            value >= reference - ACCURACY_POINTS / 100 and not row["crashed"]
        found.append({"check": f"{row['attack']} under the defaults: within {ACCURACY_POINTS:g} points of clean",
                      "seen": row["error"][:60] if "error" in row else
                      f"{_pct(value)} vs {_pct(reference)}" + (f", {len(row['crashed'])} crashed" if row["crashed"] else ""),
                      "ok": ok})
    if over is not None:
        ratio = over["time_ratio"]
        found.append({"check": f"no attackers: the defaults reach the target within {TIME_SLACK:.0%} of mean's time",
                      "seen": f"{fmt(over['time_to_target_defaults'], 1)} s vs {fmt(over['time_to_target_mean'], 1)} s",
                      "ok": None if ratio is None else ratio <= 1 + TIME_SLACK})
    return found


def table(rows: list[dict[str, Any]], layout: Layout) -> Table:
    clean = {aggregator: medians["accuracy_median"] for aggregator, medians in clean_medians(rows).items()}
    title = (f"attacks: {layout.peers} peers ({layout.attackers} attackers), {layout.task}, {layout.seconds:g} s per "
             f"peer, target {layout.target:.0%}")
    out = Table(title=title, title_justify="left")
    # bans h->a: honest peers that banned an attacker / honest peers; clip/cut: (observer, round) pairs
    for column in ("attack", "aggregator", "acc median", "acc min", "vs clean", "to target s", "epochs",
                   "rounds ok/fail", "round s", "crashed", "bans h->a", "atk banned", "hon banned", "atk clip/cut",
                   "joiner acc"):
        out.add_column(column, justify="left" if column in ("attack", "aggregator") else "right", no_wrap=True)
    for row in rows:
        if "error" in row:
            out.add_row(row["attack"], row["aggregator"], f"[red]{row['error'][:60]}[/red]", *[""] * 12)
            continue
        reference = clean.get(row["aggregator"], clean.get(DEFAULTS))  # --quick has the defaults' clean row only
        gap = None if reference is None or row["accuracy_median"] is None else row["accuracy_median"] - reference
        joiner = row["joiner"]
        out.add_row(row["attack"], row["aggregator"], _pct(row["accuracy_median"]), _pct(row["accuracy_min"]),
                    "-" if gap is None else f"{gap * 100:+.1f}", fmt(row["time_to_target"], 1),
                    fmt(row["epoch_median"], 0), f"{fmt(row['rounds_ok'], 0)}/{fmt(row['rounds_failed'], 0)}",
                    fmt(row["round_seconds"], 3), str(len(row["crashed"])), f"{row['bans_of_attackers']}/{row['observers']}",
                    f"{row['attackers_banned']}/{row['attackers']}", str(row["honest_banned"]),
                    f"{row['attacker_clipped']}/{row['attacker_weight_cut']}", "-" if joiner is None else _pct(joiner["accuracy"]))
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def parse_attacks(text: str) -> list[str | None]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name != "clean" and name not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attack(s) {', '.join(unknown)}; choose from clean, {', '.join(ATTACKS)}")
    return [None if name == "clean" else name for name in names]


def parse_aggregators(text: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name != DEFAULTS and name not in RULE_NAMES]
    if not names or unknown:
        raise ValueError(f"--aggregators must name {DEFAULTS} and/or rules from {', '.join(RULE_NAMES)}, got {text!r}")
    return names


def plan(attacks: list[str | None], aggregators: list[str], clean: list[str], repeats: int = 1) -> list[Row]:
    """The clean rows (one per aggregator in ``clean``, ``repeats`` rounds of them) first, then each
    attack with each aggregator."""
    rows = [Row(None, aggregator) for _ in range(repeats) for aggregator in clean]
    rows += [Row(attack, aggregator) for attack in attacks if attack is not None for aggregator in aggregators]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=None,
                        help=f"comma-separated, from {', '.join(ATTACKS)} (default: all; --quick: scaled)")
    parser.add_argument("--aggregators", default=None,
                        help=f"rows per attack, comma-separated: {DEFAULTS} (the run's defaults) and/or aggregation "
                             f"rules by name, from {', '.join(RULE_NAMES)} (default mean,{DEFAULTS}; "
                             f"--quick: {DEFAULTS})")
    parser.add_argument("--no-clean", action="store_true", help="leave out the clean rows")
    parser.add_argument("--peers", type=int, default=None, help="peers per row, attackers included (default 8; --quick 4)")
    parser.add_argument("--attackers", type=int, default=None, help="attackers per attack row (default 2; --quick 1)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="training seconds per row, from when every peer is ready (default 40; --quick 8)")
    parser.add_argument("--task", default="digits", help="digits (default) or fashion-mnist")
    parser.add_argument("--target", type=float, default=None, help="accuracy timed (default 0.93)")
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="DiLoCo local steps per round (default 20; --quick 10)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the clean rows this many times and judge on their medians (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="CI: 4 peers, 1 attacker, clean and scaled under the defaults, short rows side by side")
    parser.add_argument("--privacy", default="",
                        help="privacy flags for every peer of every row, e.g. \"--privacy-clip 1 --privacy-noise 0.02 "
                             "--privacy-noise-shares 4 --averaging moshpit --min-group-size 4\": attacks under DP, "
                             "against a clean DP run (an attacker then changes what its releaser released)")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout (the table to stderr)")
    parser.add_argument("--logs", default=None, help="keep every process's stderr in this directory")
    args = parser.parse_args(argv)
    quick = args.quick
    try:
        attacks = parse_attacks(args.attacks or ("scaled" if quick else ",".join(ATTACKS)))
        text = args.aggregators or (DEFAULTS if quick else ",".join(AGGREGATORS))
        aggregators = parse_aggregators(text)
        peers = args.peers or (4 if quick else 8)
        attackers = args.attackers if args.attackers is not None else (1 if quick else 2)
        if not 0 < attackers < peers - 1:
            raise ValueError(f"--attackers must be within 1..{peers - 2} for {peers} peers, got {attackers}")
        seconds = args.seconds or (10.0 if quick else 40.0)
        inner_steps = args.inner_steps or (10 if quick else 20)
        if not 1 <= inner_steps <= 10_000:
            raise ValueError(f"--inner-steps must be within 1..10000, got {inner_steps}")
        if not 1 <= seconds <= 3600:
            raise ValueError(f"--seconds must be within 1..3600, got {seconds:g}")
        target = args.target if args.target is not None else 0.93
        if not 1 <= args.repeats <= 20:
            raise ValueError(f"--repeats must be within 1..20, got {args.repeats}")
        if not 0 < target < 1:
            raise ValueError(f"--target must be within (0, 1), got {target:g}")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    layout = Layout(task=args.task, peers=peers, attackers=attackers, seconds=seconds, inner_steps=inner_steps,
                    eval_every=0.5, target=target, join_after=seconds / 4, privacy=tuple(args.privacy.split()))
    # --quick: the attack rows are compared with the clean run under the defaults (--aggregators mean
    # then shows the same attack without the defences)
    clean = [] if args.no_clean else [DEFAULTS] if quick else aggregators
    rows = plan(attacks, aggregators, clean, args.repeats)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logs = Path(args.logs) if args.logs else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    bootstrap = Child([*SWARMGRAD, "bootstrap"], "bootstrap", logs / "bootstrap.log" if logs else None)
    try:
        if not bootstrap.first_line.wait(60) or not bootstrap.lines:
            print(f"error: the bootstrap node gave no address\n{bootstrap.describe()}", file=sys.stderr)
            return 1
        results = _run_rows(layout, rows, bootstrap.lines[0], stop, side_by_side=quick, logs=logs)
    except KeyboardInterrupt:
        stop.set()
        log("interrupted: the rows' processes are stopped")
        return 130
    finally:
        bootstrap.stop(5.0)
    report = {"layout": layout.__dict__, "rows": results, "overhead": overhead(results)}
    report["checks"] = checks(results, report["overhead"])
    console = Console(stderr=args.json, width=220)
    console.print(table(results, layout))
    if report["overhead"] is not None:
        o = report["overhead"]
        runs = f" (medians of {o['clean_runs']} runs each)" if o["clean_runs"] > 1 else ""
        console.print(f"defaults vs mean, no attackers{runs}: time to {target:.0%} {fmt(o['time_to_target_defaults'], 1)} s "
                      f"vs {fmt(o['time_to_target_mean'], 1)} s (ratio {fmt(o['time_ratio'])}); round "
                      f"{fmt(o['round_seconds_defaults'], 3)} s vs {fmt(o['round_seconds_mean'], 3)} s "
                      f"(ratio {fmt(o['round_ratio'])})")
    if report["checks"]:
        console.print(checks_table("issue 15's bars (measured, not gating the exit status)", report["checks"]))
    if args.json:
        print(json.dumps(report))
    return 0 if all("error" not in row for row in results) else 1


def _run_rows(layout: Layout, rows: list[Row], bootstrap: str, stop: threading.Event, side_by_side: bool,
              logs: Path | None) -> list[dict[str, Any]]:
    """Every row, one after the other (``side_by_side``: all at once), through one bootstrap node."""
    def one(row: Row) -> dict[str, Any]:
        log(f"{row.label}: starting")
        begun = time.monotonic()
        try:
            result = run_row(layout, row, bootstrap, stop, logs)
        except Exception as error:  # one row's failure (or a bug reading it) must not lose the others
            if not isinstance(error, RowFailed):
                log(traceback.format_exc())
            log(f"{row.label}: FAILED: {error}")
            return {"attack": row.attack or "clean", "aggregator": row.aggregator,
                    "error": (str(error).splitlines() or [type(error).__name__])[0]}
        log(f"{row.label}: honest accuracy median {_pct(result['accuracy_median'])}, min "
            f"{_pct(result['accuracy_min'])}, {time.monotonic() - begun:.0f} s")
        return result

    if not side_by_side:
        return [one(row) for row in rows]
    with concurrent.futures.ThreadPoolExecutor(len(rows)) as pool:
        futures = [pool.submit(one, row) for row in rows]
        try:
            return [future.result() for future in futures]
        except KeyboardInterrupt:
            stop.set()  # the rows' threads stop their processes
            raise


if __name__ == "__main__":
    sys.exit(main())
