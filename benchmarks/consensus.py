"""Consensus on loopback: seconds and bytes per peer until every peer is within --target of the mean.

    python benchmarks/consensus.py [--json] [--peers 8,16] [--numel 1000000] [--codecs none,int8]
                                   [--target 1e-3] [--time-limit 120] [--methods gossip,moshpit] [--no-privacy]

Every peer (a spawned process) holds one float32 tensor, torch.randn seeded by its rank, and the
weight rank + 1; its error is ||x_i - mean|| / ||mean||, computed in every peer after every step.
- gossip: GossipAverager (push-sum), target the weighted mean. Peers step on their own clocks and
  report through a queue; a coordinator thread here stops them (an Event) once all are within target.
- moshpit: Averager, groups of 4 (at least 2, a 1 s matchmaking window), lockstep rounds (the
  all-gather of errors after each round is the barrier before the next); weight=1.0 everywhere, so
  the target is the unweighted mean.
Each configuration is its own run: a NetworkRuntime per peer around the peer's one SwarmNode.
One process group per peer count runs every configuration in turn (starting 16 peers with a p2pd
each takes tens of seconds on 2 cores); a failed configuration gets an error row and the ones after
it a fresh group. The first group also measures the cost of privacy on a 4-peer moshpit step.
Exit status 1 if a configuration failed to run (not converging is a finding, shown in the table).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; inherited by every peer
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import queue
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from _harness import MB, GroupFailed, PeerContext, fmt, log, run_group, start_swarm_node, verdict
from rich.console import Console
from rich.table import Table

GROUP_SIZE = 4
WINDOW = 1.0  # moshpit matchmaking seconds (the Averager's default before the runtime refactor; now 2 s)
PRIVACY_PEERS, PRIVACY_ROUNDS = 4, 6  # one warm-up round, then the median of the rest
STALL_ROUNDS, STALL_SECONDS = 10, 15.0  # no 10% progress for this long: stop, report "stalled"
PROGRESS_FIELDS = ("steps", "error", "seconds", "bytes")  # a gossip peer's report after each step
# consensus of fixed values is what this measures: plain means (a robust aggregator bounds outliers,
# and members that meet again with one value make centered-clip return that value, robust.py)
AGGREGATOR = "mean"


@dataclass
class Job:
    method: str  # gossip | moshpit | privacy
    codec: str


@dataclass
class GroupConfig:
    """What every peer of one group needs; picklable (queue and events travel as Process arguments)."""

    peers: int
    numel: int
    target: float
    time_limit: float
    jobs: list[Job]
    progress: Any  # peer -> coordinator: ("progress" | "done", job, rank, payload)
    stops: list[Any]  # one Event per job: the coordinator tells gossip peers to stop


@dataclass
class Row:
    method: str
    codec: str
    peers: int
    seconds: float | None = None  # until every peer was within target
    steps: float | None = None  # gossip: mean steps per peer; moshpit: rounds
    mb_per_peer: float | None = None  # bytes sent until convergence (or until stopped), mean over peers
    max_error: float | None = None  # final, over peers
    converged: bool | None = None
    note: str = ""
    error: str | None = None
    trace: list[float] = field(default_factory=list)  # moshpit: max error over peers after each round


# ---------------------------------------------------------------- in every peer


def peer_tensor(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def means(peers: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean with weights rank + 1, unweighted mean) of the initial tensors."""
    weighted, plain = torch.zeros(numel), torch.zeros(numel)
    for rank in range(peers):
        tensor = peer_tensor(rank, numel)
        weighted.add_(tensor, alpha=rank + 1)
        plain.add_(tensor)
    return weighted / (peers * (peers + 1) / 2), plain / peers


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


async def wait_for_members(runtime: Any, count: int, timeout_s: float) -> None:
    """The clock starts only once this peer's presence lists the whole run (gossip picks neighbours
    from it; moshpit sizes its grid from it)."""
    deadline = time.monotonic() + timeout_s
    while len(runtime.members()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"saw fewer than {count} members of {runtime.run_id} after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def consensus_peer(ctx: PeerContext, cfg: GroupConfig) -> dict:
    from swarmgrad.eventloop import run

    return run(_run_jobs(ctx, cfg))


async def _run_jobs(ctx: PeerContext, cfg: GroupConfig) -> dict:
    weighted, plain = means(cfg.peers, cfg.numel)
    async with contextlib.AsyncExitStack() as stack:
        node = await start_swarm_node(ctx, stack)
        for index, job in enumerate(cfg.jobs):
            if job.method == "privacy":
                result = await privacy_job(ctx, cfg, node, index)
            else:
                run_job = gossip_job if job.method == "gossip" else moshpit_job
                result = await run_job(ctx, cfg, node, index, job, weighted if job.method == "gossip" else plain)
            cfg.progress.put(("done", index, ctx.rank, result))
            await ctx.async_sync()  # nobody starts the next job while another still serves this one
    return {}


async def gossip_job(ctx: PeerContext, cfg: GroupConfig, node: Any, index: int, job: Job, mean: torch.Tensor) -> dict:
    from swarmgrad.averaging import GossipAverager
    from swarmgrad.net.network_runtime import NetworkRuntime

    run_id, tensor, stop = f"consensus-{index}-gossip-{job.codec.replace(':', '_')}", peer_tensor(ctx.rank, cfg.numel), cfg.stops[index]
    async with NetworkRuntime(run_id, node=node) as runtime, \
            GossipAverager(runtime, [tensor], weight=ctx.rank + 1.0, codec=job.codec, aggregator=AGGREGATOR) as gossip:
        await wait_for_members(runtime, cfg.peers, 60.0)
        await ctx.async_sync()
        start, steps, sent = time.monotonic(), 0, 0
        error = rel_error(tensor, mean)
        while not stop.is_set() and time.monotonic() - start < cfg.time_limit:
            report = await asyncio.wait_for(gossip.step(), cfg.time_limit)  # only a hung step is an error
            steps, sent = steps + 1, sent + report.bytes_sent
            error = rel_error(tensor, mean)
            cfg.progress.put(("progress", index, ctx.rank, (steps, error, time.monotonic() - start, sent)))
        elapsed = time.monotonic() - start
        await ctx.async_sync()  # keep serving pushes until every peer has stopped pushing
        return {"steps": steps, "bytes": sent, "error": error, "seconds": elapsed, "total_s": elapsed}


async def moshpit_job(ctx: PeerContext, cfg: GroupConfig, node: Any, index: int, job: Job, mean: torch.Tensor) -> dict:
    from swarmgrad.averaging import Aggregation, Averager, Moshpit
    from swarmgrad.net.network_runtime import NetworkRuntime

    run_id, tensor = f"consensus-{index}-moshpit-{job.codec.replace(':', '_')}", peer_tensor(ctx.rank, cfg.numel)
    settings = Moshpit(group_size=GROUP_SIZE, min_group_size=2, matchmaking_seconds=WINDOW)
    async with NetworkRuntime(run_id, node=node) as runtime, \
            Averager(runtime, [tensor], settings=settings, codec=job.codec,
                     aggregation=Aggregation(rule=AGGREGATOR)) as averager:
        await wait_for_members(runtime, cfg.peers, 60.0)  # the grid's dimensions come from the member count
        await ctx.async_sync()
        start, sent, failed, history = time.monotonic(), 0, 0, []
        result: dict = {}
        for round_index in range(10_000):
            report = await asyncio.wait_for(averager.step(weight=1.0, round_index=round_index), cfg.time_limit)
            sent, failed = sent + report.bytes_sent, failed + (not report.ok)
            done_at, error = time.monotonic() - start, rel_error(tensor, mean)
            everyone = await ctx.async_exchange((error, done_at, sent))  # every peer decides alike
            history.append(max(e for e, _, _ in everyone))
            converged = history[-1] <= cfg.target
            result.update(steps=round_index + 1, bytes=sent, error=error, failed=failed, trace=history,
                          seconds=max(t for _, t, _ in everyone), total_s=done_at, converged=converged,
                          stalled=not converged and _stalled(history))
            if converged or result["stalled"] or everyone[0][1] > cfg.time_limit:  # rank 0's clock decides
                break
        await ctx.async_sync()
        return result


def _stalled(history: list[float]) -> bool:
    """The max error has not improved by 10% over the last STALL_ROUNDS rounds (a codec's noise floor)."""
    return len(history) > STALL_ROUNDS and min(history[-STALL_ROUNDS:]) > 0.9 * min(history[:-STALL_ROUNDS])


async def privacy_job(ctx: PeerContext, cfg: GroupConfig, node: Any, index: int) -> dict:
    """Rank 0's step time in a 4-peer moshpit group, without and with privacy (ranks >= 4 only keep step)."""
    from swarmgrad.averaging.privacy import Privacy

    tensor = peer_tensor(ctx.rank, cfg.numel)
    plain = await _timed_moshpit(ctx, cfg, node, f"consensus-{index}-plain", tensor, None)
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.0)
    private = await _timed_moshpit(ctx, cfg, node, f"consensus-{index}-private", tensor, privacy)
    return {"plain": plain[1:], "private": private[1:], "kind": "moshpit step with / without privacy (4 peers, rank 0)"}


async def _timed_moshpit(ctx: PeerContext, cfg: GroupConfig, node: Any, run_id: str, tensor: torch.Tensor,
                         privacy: Any) -> list[float]:
    """PRIVACY_ROUNDS steps of one 4-peer group; rank 0's seconds. Every rank syncs alike."""
    from swarmgrad.averaging import Aggregation, Averager, Moshpit
    from swarmgrad.net.network_runtime import NetworkRuntime

    active = ctx.rank < PRIVACY_PEERS
    seconds: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        if active:
            runtime = await stack.enter_async_context(NetworkRuntime(run_id, node=node))
            settings = Moshpit(group_size=PRIVACY_PEERS, min_group_size=PRIVACY_PEERS, matchmaking_seconds=WINDOW)
            averager = await stack.enter_async_context(
                Averager(runtime, [tensor], settings=settings, codec="none", privacy=privacy,
                         aggregation=Aggregation(rule=AGGREGATOR)))
            await wait_for_members(runtime, PRIVACY_PEERS, 60.0)
        for round_index in range(PRIVACY_ROUNDS):
            await ctx.async_sync()
            if active:
                started = time.perf_counter()
                report = await asyncio.wait_for(averager.step(weight=1.0, round_index=round_index), cfg.time_limit)
                seconds.append(time.perf_counter() - started)
                if not report.ok:
                    raise RuntimeError(f"privacy-cost round {round_index} failed: {report.error}")
        await ctx.async_sync()
    return seconds


# ---------------------------------------------------------------- in this process


class Coordinator(threading.Thread):
    """Reads every peer's progress; stops a gossip job once all peers are within target, or stalled."""

    def __init__(self, progress: Any, stops: list[Any], peers: int, target: float):
        super().__init__(daemon=True, name="consensus-coordinator")
        self.progress, self.stops, self.peers, self.target = progress, stops, peers, target
        self.latest: dict[int, dict[int, tuple]] = {}  # job -> rank -> PROGRESS_FIELDS
        self.converged: dict[int, dict[int, tuple]] = {}  # job -> the latest reports when all were within target
        self.best: dict[int, tuple[float, float]] = {}  # job -> (best max error, when)
        self.stalled: set[int] = set()
        self.done: dict[int, dict[int, dict]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                kind, job, rank, payload = self.progress.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "done":
                self.done.setdefault(job, {})[rank] = payload
            else:
                self._progress(job, rank, payload)

    def _progress(self, job: int, rank: int, report: tuple) -> None:
        latest = self.latest.setdefault(job, {})
        latest[rank] = report
        if len(latest) < self.peers or job in self.converged or self.stops[job].is_set():
            return
        worst = max(error for _, error, _, _ in latest.values())
        if worst <= self.target:
            self.converged[job] = dict(latest)
            self.stops[job].set()
            return
        best, since = self.best.get(job, (float("inf"), time.monotonic()))
        if worst < 0.9 * best:
            self.best[job] = (worst, time.monotonic())
        elif time.monotonic() - since > STALL_SECONDS:
            self.stalled.add(job)
            self.stops[job].set()

    def finish(self) -> None:
        time.sleep(1.0)  # the last "done" messages may still be in the peers' queue feeders
        self.halt.set()
        self.join(5.0)


def run_peer_count(peers: int, jobs: list[Job], args: argparse.Namespace) -> list[tuple[Job, Any]]:
    """Every job with (coordinator, job index) or an error string; a failed job's successors get a new group."""
    outcomes: list[tuple[Job, Any]] = []
    pending = list(jobs)
    while pending:
        spawn = mp.get_context("spawn")  # the context run_group uses: its queue and events travel to the peers
        progress, stops = spawn.Queue(), [spawn.Event() for _ in pending]
        coordinator = Coordinator(progress, stops, peers, args.target)
        coordinator.start()
        cfg = GroupConfig(peers, args.numel, args.target, args.time_limit, pending, progress, stops)
        failure = None
        try:
            run_group(consensus_peer, cfg, peers, deadline_s=180 + len(pending) * (args.time_limit + 60),
                      wait_s=args.time_limit + 90)
        except GroupFailed as error:
            failure = str(error)
        finally:
            coordinator.finish()
            progress.close()
            progress.cancel_join_thread()
        complete = [i for i in range(len(pending)) if len(coordinator.done.get(i, {})) == peers]
        failed_at = next((i for i in range(len(pending)) if i not in complete), len(pending))
        outcomes += [(pending[i], (coordinator, i)) for i in range(failed_at)]
        if failed_at < len(pending):
            outcomes.append((pending[failed_at], failure or "no result from some peers"))
            log(f"{peers} peers, {pending[failed_at].method}/{pending[failed_at].codec} failed: {failure}")
        pending = pending[failed_at + 1 :]
    return outcomes


def make_row(job: Job, peers: int, outcome: Any) -> Row:
    """Gossip: counts at the coordinator's convergence snapshot; moshpit: at the converging round."""
    row = Row(job.method, job.codec, peers)
    if isinstance(outcome, str):
        row.error = outcome
        return row
    coordinator, index = outcome
    done = [coordinator.done[index][rank] for rank in range(peers)]
    if job.method == "gossip":
        snapshot = coordinator.converged.get(index)
        at = [dict(zip(PROGRESS_FIELDS, report)) for report in snapshot.values()] if snapshot else done
        row.converged, stalled = snapshot is not None, index in coordinator.stalled
    else:
        at, row.converged, stalled, row.trace = done, done[0]["converged"], done[0]["stalled"], done[0]["trace"]
    row.seconds = max(d["seconds"] for d in at) if row.converged else None
    row.steps = statistics.mean(d["steps"] for d in at)
    row.mb_per_peer = statistics.mean(d["bytes"] for d in at) / MB
    row.max_error = max(d["error"] for d in done)
    step_ms = 1000 * statistics.mean(d["total_s"] / max(1, d["steps"]) for d in done)
    row.note = ("" if row.converged else "stalled, " if stalled else "time limit, ") + f"{step_ms:.0f} ms/step"
    if job.method == "moshpit":
        row.note += f"; {sum(d['failed'] for d in done)} of {row.steps * peers} peer-rounds not averaged (no group)"
    return row


def privacy_summary(outcome: Any) -> dict:
    if isinstance(outcome, str):
        return {"error": outcome}
    coordinator, index = outcome
    first = coordinator.done[index][0]
    plain, private = statistics.median(first["plain"]), statistics.median(first["private"])
    return {"kind": first["kind"], "plain_s": plain, "private_s": private, "ratio": private / plain}


# ---------------------------------------------------------------- output and main

CAPTION = (
    "s to target: from when all peers see the whole run until every peer is within target (gossip: peers' clocks "
    "at their latest reports; moshpit: end of the converging round, slowest peer), error checks included. steps: "
    "gossip = mean step() calls per peer; moshpit = lockstep rounds. MB sent/peer: sum of report.bytes_sent until "
    "then, mean over peers (MB = 10^6 bytes). Target: gossip, the weighted mean (weights rank+1); moshpit, the "
    "UNWEIGHTED mean (every peer passes weight=1.0: moshpit does not carry weights across rounds)."
)


def render(rows: list[Row], privacy: dict | None, args: argparse.Namespace, wall_s: float) -> Table:
    title = f"Consensus to {args.target:g} relative error: {args.numel:,} float32 per peer, loopback"
    table = Table(title=title, caption=f"{CAPTION} Wall time {wall_s:.0f} s.")
    for header in ("method", "codec", "peers", "s to target", "steps/rounds", "MB sent/peer", "final max err",
                   "converged", "note"):
        table.add_column(header, justify="left" if header in ("method", "codec", "note") else "right",
                         overflow="fold", max_width=60 if header == "note" else None)
    for row in rows:
        table.add_row(row.method, row.codec, str(row.peers), fmt(row.seconds, 1), fmt(row.steps, 1),
                      fmt(row.mb_per_peer, 1), "-" if row.max_error is None else f"{row.max_error:.2e}",
                      verdict(row.converged, "yes", "NO"), f"[red]{row.error}[/red]" if row.error else row.note)
    if privacy:
        table.caption += " " + privacy_line(privacy)
    return table


def privacy_line(privacy: dict) -> str:
    if "error" in privacy:
        return f"Cost of privacy: failed ({privacy['error']})."
    return (f"Cost of privacy (clip 1.0, noise 1.0): {privacy['kind']}: {privacy['private_s'] * 1000:.0f} ms / "
            f"{privacy['plain_s'] * 1000:.0f} ms = {privacy['ratio']:.2f}x.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--peers", default="8,16", help="peer counts, comma-separated")
    parser.add_argument("--numel", type=int, default=1_000_000, help="float32 elements per peer")
    parser.add_argument("--codecs", default="none,int8")
    parser.add_argument("--methods", default="gossip,moshpit")
    parser.add_argument("--target", type=float, default=1e-3, help="relative error every peer must reach")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per configuration")
    parser.add_argument("--no-privacy", action="store_true", help="skip the cost-of-privacy measurement")
    args = parser.parse_args(argv)
    args.peers = [int(p) for p in args.peers.split(",") if p]
    args.codecs = [c for c in args.codecs.split(",") if c]
    args.methods = [m for m in args.methods.split(",") if m]
    if any(p < PRIVACY_PEERS for p in args.peers) or not set(args.methods) <= {"gossip", "moshpit"}:
        parser.error(f"need every --peers >= {PRIVACY_PEERS} and --methods among gossip, moshpit")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    rows: list[Row] = []
    privacy = None
    for position, peers in enumerate(args.peers):
        jobs = [Job(method, codec) for method in args.methods for codec in args.codecs]
        if position == 0 and not args.no_privacy:
            jobs.append(Job("privacy", "none"))  # once, in the first group: its peers are already up
        log(f"{peers} peers: {', '.join(f'{j.method}/{j.codec}' for j in jobs)}")
        for job, outcome in run_peer_count(peers, jobs, args):
            if job.method == "privacy":
                privacy = privacy_summary(outcome)
                log(privacy_line(privacy))
                continue
            rows.append(row := make_row(job, peers, outcome))
            log(f"{peers} peers {job.method}/{job.codec}: {fmt(row.seconds, 1)} s, {fmt(row.steps, 1)} steps, "
                f"{fmt(row.mb_per_peer, 1)} MB/peer, converged={row.converged} {row.error or row.note}")
    wall_s = time.monotonic() - started
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        print(json.dumps({"config": config, "rows": [asdict(r) for r in rows], "privacy": privacy, "wall_s": wall_s},
                         indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=200)
        console.print(render(rows, privacy, args, wall_s))
    # exit status: did every configuration run (not converging is a finding, shown in the table)
    return 1 if any(row.error for row in rows) or (privacy or {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
