"""Scale on loopback: N real peers (node, presence, averager, small tensors), several per process.

    python benchmarks/scale.py [--json] [--peers 8,16,32,64] [--per-process 8] [--rounds 12] [--quick]

Every peer is a SwarmNode (its own p2pd) with a NetworkRuntime on one run; the peers of a process
share its one asyncio loop (``--per-process`` K of them, so N peers take ceil(N / K) processes).
Start-up: three seeds (the first rank of each of the first three processes, where there are three)
start one after another, each bootstrapping from the seeds before it; then all other peers start at
once (START_CONCURRENCY at a time per process), each bootstrapping from all three seeds, so no single
node (nor one process's event loop) carries the bootstrap. Then, for each N:
- membership: seconds from the last peer's node start until every peer's ``runtime.members()``
  lists all N (each process polls its peers every 0.1 s; the latest process decides);
- DHT: all peers at once, each stores 5 signed records (3 with --quick; ``node.store``, all
  replicas) under keys of its own and reads each back (``node.get_records``): median and p95;
- moshpit: Averager(group_size 4, min_group_size 2, a WINDOW s matchmaking window), 4096 float32
  per peer (randn seeded by rank), codec none, weight 1.0, lockstep rounds (each process all-gathers
  its peers' errors after their rounds) until the max relative error ||x_i - mean|| / ||mean|| is
  at most 1e-3, or --rounds rounds. Matchmaking = report.seconds - report.allreduce_seconds; a
  peer-round without a group is one whose report is not ok;
- gossip: GossipAverager (fanout 1, weight 1.0, codec none) steps on every peer until every peer is
  within 1e-3 of the mean: the first moment all peers' latest errors (noted after every step) were;
- both average plainly (aggregator "mean"): robust aggregation is not what this measures;
- memory: VmRSS of the benchmark processes plus their p2pd daemons, per peer, at the end; daemon
  CPU: utime + stime of the p2pd daemons from the last start to the end, per peer, in % of a core.
Exit status 1 if a configuration failed to run; a missed bound is a finding, shown in the table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; inherited by every peer process
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from _harness import (
    MB,
    GroupFailed,
    PeerContext,
    child_pids,
    cpu_seconds,
    fmt,
    log,
    quantile,
    rss_bytes,
    run_group,
    verdict,
)
from consensus import peer_tensor, rel_error
from rich.console import Console
from rich.table import Table

GROUP_SIZE, MIN_GROUP_SIZE = 4, 2
# matchmaking seconds: only a cap, as a peer stops waiting once its whole slice of the grid has declared;
# at 32 peers on 2 cores a declaration took 0.7-1.3 s to read back, so the default 2 s cut groups short
WINDOW = 5.0
# plain means: robust aggregation (centered-clip) moves honest peers too, and mixing is what this measures
AGGREGATOR = "mean"
SEEDS = 3  # the first peers started; every later peer bootstraps from all of them
START_CONCURRENCY = 2  # peers of one process starting at a time: 64 p2pd at once starve 2 cores
TARGET = 1e-3  # relative error
MEMBERSHIP_TARGET_S = 10.0  # issue 14: membership converges within 10 s of the last start
NO_GROUP_TARGET = 0.01  # issue 14: fewer than 1% of peer-rounds find no group
POLL_S, TICK_S = 0.1, 0.2  # membership poll; gossip progress all-gather
DHT_RECORD_TTL_S = 120.0
MEMBERSHIP_TIMEOUT_S, STEP_TIMEOUT_S = 120.0, 60.0  # a peer that takes longer has hung: the configuration fails
DEFAULTS = {"rounds": 12, "dht_ops": 5, "gossip_limit_s": 60.0}
QUICK = {"rounds": 6, "dht_ops": 3, "gossip_limit_s": 30.0}


@dataclass
class ScaleConfig:
    """What every process of one configuration needs; picklable."""

    peers: int
    per_process: int
    numel: int
    rounds: int
    dht_ops: int
    gossip_limit_s: float

    @property
    def processes(self) -> int:
        return math.ceil(self.peers / self.per_process)

    @property
    def run_id(self) -> str:
        return f"scale-{self.peers}"

    def ranks(self, process: int) -> range:
        return range(process * self.per_process, min(self.peers, (process + 1) * self.per_process))

    @property
    def seeds(self) -> list[int]:
        """The seeds' ranks: each in another process while there are processes enough (one event
        loop behind all three answered every newcomer's bootstrap pings late, and bootstraps failed)."""
        return sorted(range(self.peers), key=lambda rank: (rank % self.per_process, rank))[:SEEDS]


def round_bound(peers: int) -> int:
    """ceil(log_4 N) + 1, in integers (float logs put log_4 64 a hair above 3)."""
    dims = 0
    while GROUP_SIZE**dims < peers:
        dims += 1
    return dims + 1


@dataclass
class Row:
    peers: int
    processes: int
    start_s: float | None = None  # first seed's start until the last peer's node is up
    membership_s: float | None = None
    store_ms: tuple[float | None, float | None] = (None, None)  # p50, p95
    get_ms: tuple[float | None, float | None] = (None, None)
    dht_failures: int = 0  # stores that no replica took, or reads that missed the record
    matchmaking_ms: tuple[float | None, float | None] = (None, None)
    peer_rounds: int = 0
    no_group: int = 0
    no_group_share: float | None = None
    round_errors: dict[str, int] = field(default_factory=dict)  # why peer-rounds were not ok
    moshpit_rounds: int | None = None  # first round after which every peer was within TARGET
    round_bound: int = 0
    moshpit_trace: list[float] = field(default_factory=list)  # max error over peers after each round
    no_group_per_round: list[int] = field(default_factory=list)
    gossip_steps: float | None = None  # mean step() calls per peer until all were within TARGET
    gossip_s: float | None = None
    gossip_max_error: float | None = None
    gossip_pushes: dict[str, int] = field(default_factory=dict)  # accepted / failed (refused or lost), whole phase
    mb_rss_per_peer: float | None = None  # processes + daemons
    mb_daemon_rss_per_peer: float | None = None
    daemon_cpu_pct_per_peer: float | None = None
    python_cpu_pct_per_peer: float | None = None
    phase_s: dict[str, float] = field(default_factory=dict)  # wall seconds of each phase (process 0)
    max_fds: int = 0  # open file descriptors of the busiest benchmark process, at the end
    load_average: float | None = None  # 1-minute load average at the end (2 cores here)
    membership_ok: bool | None = None
    moshpit_ok: bool | None = None
    no_group_ok: bool | None = None
    error: str | None = None


# ---------------------------------------------------------------- in every process


@dataclass
class Peer:
    rank: int
    node: Any  # SwarmNode
    runtime: Any  # NetworkRuntime
    stack: contextlib.AsyncExitStack
    started_at: float  # time.monotonic() when its node was up (one clock for all processes of this host)


def scale_process(ctx: PeerContext, cfg: ScaleConfig) -> dict:
    from swarmgrad.eventloop import run

    return run(_process_main(ctx, cfg))


async def _process_main(ctx: PeerContext, cfg: ScaleConfig) -> dict:
    say = log if ctx.rank == 0 else (lambda _message: None)  # one process narrates
    mean = sum(peer_tensor(rank, cfg.numel) for rank in range(cfg.peers)) / cfg.peers
    first_start = time.monotonic()
    peers = await start_peers(ctx, cfg)
    try:
        daemons = child_pids(os.getpid(), "p2pd")
        cpu_before = {pid: cpu_seconds(pid) for pid in [os.getpid(), *daemons]}
        measured_from = time.monotonic()
        converged_at = await members_converged(peers, cfg.peers)
        starts = await ctx.async_exchange((first_start, max(p.started_at for p in peers), converged_at))
        result: dict = {"start_s": max(s[1] for s in starts) - min(s[0] for s in starts),
                        "membership_s": max(s[2] for s in starts) - max(s[1] for s in starts)}
        say(f"{cfg.peers} peers up in {result['start_s']:.1f} s; membership converged "
            f"{result['membership_s']:.1f} s after the last start")
        phases = {"start": max(s[1] for s in starts) - first_start, "membership": time.monotonic() - measured_from}
        mark = time.monotonic()
        result |= await dht_phase(cfg, peers)
        await ctx.async_sync()
        phases["dht"], mark = time.monotonic() - mark, time.monotonic()
        say(f"{cfg.peers} peers: DHT store/get done; moshpit")
        result |= await moshpit_phase(ctx, cfg, peers, mean, say)
        phases["moshpit"], mark = time.monotonic() - mark, time.monotonic()
        say(f"{cfg.peers} peers: gossip")
        result |= await gossip_phase(ctx, cfg, peers, mean)
        phases["gossip"] = time.monotonic() - mark
        wall = time.monotonic() - measured_from
        result |= {
            "peers": len(peers), "daemons": len(daemons), "measured_s": wall, "phase_s": phases,
            "fds": len(os.listdir("/proc/self/fd")), "load_average": os.getloadavg()[0],
            "rss_bytes": rss_bytes(os.getpid()) + sum(rss_bytes(pid) for pid in daemons),
            "daemon_rss_bytes": sum(rss_bytes(pid) for pid in daemons),
            "daemon_cpu_s": sum(cpu_seconds(pid) - cpu_before[pid] for pid in daemons),
            "python_cpu_s": cpu_seconds(os.getpid()) - cpu_before[os.getpid()],
        }
        await ctx.async_sync()  # nobody leaves while another still measures
        return result
    finally:
        await asyncio.gather(*(peer.stack.aclose() for peer in peers), return_exceptions=True)


async def start_peer(cfg: ScaleConfig, rank: int, initial_peers: list[str]) -> Peer:
    from swarmgrad.dht import NodeConfig, SwarmNode
    from swarmgrad.net.network_runtime import NetworkRuntime

    stack = contextlib.AsyncExitStack()
    try:
        node = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=initial_peers)))
        started_at = time.monotonic()
        runtime = await stack.enter_async_context(NetworkRuntime(cfg.run_id, node=node))
    except BaseException:
        await stack.aclose()
        raise
    return Peer(rank, node, runtime, stack, started_at)


async def start_peers(ctx: PeerContext, cfg: ScaleConfig) -> list[Peer]:
    """The seeds one after another (all processes take part in each step), then everyone else at once."""
    local, peers, seeds = list(cfg.ranks(ctx.rank)), {}, cfg.seeds
    try:
        addresses: list[str] = []
        for seed in seeds:
            mine = None
            if seed in local:
                peers[seed] = await start_peer(cfg, seed, list(addresses))
                mine = peers[seed].node.maddrs
            addresses += next(found for found in await ctx.async_exchange(mine) if found is not None)
        gate = asyncio.Semaphore(START_CONCURRENCY)

        async def start(rank: int) -> Peer:
            async with gate:
                return await start_peer(cfg, rank, addresses)

        rest = [rank for rank in local if rank not in seeds]
        outcomes = await asyncio.gather(*map(start, rest), return_exceptions=True)
        peers |= {rank: outcome for rank, outcome in zip(rest, outcomes) if isinstance(outcome, Peer)}
        failed = [outcome for outcome in outcomes if not isinstance(outcome, Peer)]
        if failed:
            raise failed[0]
    except BaseException:
        await asyncio.gather(*(peer.stack.aclose() for peer in peers.values()), return_exceptions=True)
        raise
    return [peers[rank] for rank in local]


async def members_converged(peers: list[Peer], count: int) -> float:
    """When every local peer's presence first listed all ``count`` members (time.monotonic())."""
    deadline = time.monotonic() + MEMBERSHIP_TIMEOUT_S
    while not all(len(peer.runtime.members()) >= count for peer in peers):
        if time.monotonic() > deadline:
            seen = sorted(len(peer.runtime.members()) for peer in peers)
            raise TimeoutError(f"after {MEMBERSHIP_TIMEOUT_S:.0f} s these peers list {seen} of {count} members")
        await asyncio.sleep(POLL_S)
    return time.monotonic()


async def dht_phase(cfg: ScaleConfig, peers: list[Peer]) -> dict:
    from swarmgrad.averaging.matchmaking import MatchRecord

    async def one_peer(peer: Peer) -> tuple[list[float], list[float], int]:
        stores, gets, failures = [], [], 0
        for index in range(cfg.dht_ops):
            key = f"swarmgrad/{cfg.run_id}/bench/{peer.rank}/{index}"
            body = MatchRecord(ready_at=time.time(), share=1.0, schema_digest="scale", codec="none")
            started = time.perf_counter()
            stored = await peer.node.store(key, body, time.time() + DHT_RECORD_TTL_S)
            stores.append(1000 * (time.perf_counter() - started))
            started = time.perf_counter()
            found = await peer.node.get_records(key, MatchRecord)
            gets.append(1000 * (time.perf_counter() - started))
            failures += not stored or peer.node.peer_id not in found
        return stores, gets, failures

    outcomes = await asyncio.gather(*map(one_peer, peers))
    return {"store_ms": [ms for stores, _, _ in outcomes for ms in stores],
            "get_ms": [ms for _, gets, _ in outcomes for ms in gets],
            "dht_failures": sum(failures for _, _, failures in outcomes)}


async def moshpit_phase(ctx: PeerContext, cfg: ScaleConfig, peers: list[Peer], mean: Any, say: Any) -> dict:
    from swarmgrad.averaging import Aggregation, Averager, Moshpit

    settings = Moshpit(group_size=GROUP_SIZE, min_group_size=MIN_GROUP_SIZE, matchmaking_seconds=WINDOW)
    tensors = [peer_tensor(peer.rank, cfg.numel) for peer in peers]
    matchmaking_ms, errors, trace, failed_per_round, reached = [], Counter(), [], [], None
    sizes_per_round: list[dict[int, int]] = []  # group size -> peer-rounds: a full grid meets in 4s only
    async with contextlib.AsyncExitStack() as stack:
        averagers = [await stack.enter_async_context(Averager(peer.runtime, [tensor], settings=settings, codec="none",
                                                              aggregation=Aggregation(rule=AGGREGATOR)))
                     for peer, tensor in zip(peers, tensors)]
        await ctx.async_sync()  # every averager serves before anyone's first round
        for round_index in range(cfg.rounds):
            reports = await asyncio.gather(*(asyncio.wait_for(averager.step(weight=1.0, round_index=round_index),
                                                              STEP_TIMEOUT_S) for averager in averagers))
            matchmaking_ms += [1000 * (report.seconds - report.allreduce_seconds) for report in reports]
            errors.update((report.error or "")[:80] for report in reports if not report.ok)
            worst = max(rel_error(tensor, mean) for tensor in tensors)
            sizes = Counter(len(report.group) for report in reports if report.ok)
            everyone = await ctx.async_exchange((worst, sum(not report.ok for report in reports), dict(sizes)))
            trace.append(max(error for error, _, _ in everyone))
            failed_per_round.append(sum(failed for _, failed, _ in everyone))
            sizes_per_round.append(dict(sum((Counter(counts) for _, _, counts in everyone), Counter())))
            say(f"{cfg.peers} peers: moshpit round {round_index + 1}: max error {trace[-1]:.2e}, "
                f"{failed_per_round[-1]} peer-rounds without a group, group sizes {sorted(sizes_per_round[-1].items())}")
            if trace[-1] <= TARGET:
                reached = round_index + 1
                break
        await ctx.async_sync()  # keep serving until every group is done
    return {"matchmaking_ms": matchmaking_ms, "peer_rounds": len(trace) * len(peers), "no_group": sum(errors.values()),
            "round_errors": dict(errors), "moshpit_trace": trace, "moshpit_rounds": reached,
            "no_group_per_round": failed_per_round, "group_sizes_per_round": sizes_per_round}


async def gossip_phase(ctx: PeerContext, cfg: ScaleConfig, peers: list[Peer], mean: Any) -> dict:
    """Every peer steps as fast as it can and notes its error after each step; every TICK_S the
    processes all-gather their worst error to decide when to stop; the histories then say when
    every peer was first within target at once, and after how many steps."""
    from swarmgrad.averaging import GossipAverager

    tensors = [peer_tensor(peer.rank, cfg.numel) for peer in peers]
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        gossips = [await stack.enter_async_context(GossipAverager(peer.runtime, [tensor], weight=1.0, codec="none",
                                                                          aggregator=AGGREGATOR))
                   for peer, tensor in zip(peers, tensors)]
        await ctx.async_sync()
        started = time.monotonic()
        histories = [[(started, rel_error(tensor, mean))] for tensor in tensors]  # (time, error) after each step

        pushes = Counter()

        async def keep_stepping(index: int) -> None:
            while not stop.is_set():
                report = await asyncio.wait_for(gossips[index].step(), STEP_TIMEOUT_S)
                histories[index].append((time.monotonic(), rel_error(tensors[index], mean)))
                pushes.update(accepted=len(report.pushed_to), failed=len(report.failed))

        loops = [asyncio.create_task(keep_stepping(index)) for index in range(len(gossips))]
        try:
            while True:
                await asyncio.sleep(TICK_S)  # a sampling period, not a wait for something
                for loop in loops:
                    if loop.done():
                        loop.result()  # a failed step fails the configuration
                worst = max(history[-1][1] for history in histories)
                everyone = await ctx.async_exchange((worst, time.monotonic() - started))
                if max(e for e, _ in everyone) <= TARGET or everyone[0][1] > cfg.gossip_limit_s:  # rank 0's clock
                    break
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
        everyone = [h for histories_of in await ctx.async_exchange(histories) for h in histories_of]
        await ctx.async_sync()  # keep serving pushes until every peer has stopped pushing
    return gossip_convergence(everyone, started) | {"gossip_pushes": dict(pushes)}


def gossip_convergence(histories: list[list[tuple[float, float]]], started: float) -> dict:
    """The first moment every peer's latest error was within TARGET, and each peer's steps by then."""
    latest = [history[0][1] for history in histories]
    events = sorted((at, peer, step, error) for peer, history in enumerate(histories)
                    for step, (at, error) in enumerate(history) if step > 0)
    steps = [0] * len(histories)
    for at, peer, step, error in events:
        latest[peer], steps[peer] = error, step
        if max(latest) <= TARGET:
            return {"gossip_steps": sum(steps) / len(steps), "gossip_s": at - started, "gossip_max_error": max(latest)}
    return {"gossip_steps": None, "gossip_s": None, "gossip_max_error": max(latest)}


# ---------------------------------------------------------------- in this process


def run_configuration(peers: int, args: argparse.Namespace) -> Row:
    cfg = ScaleConfig(peers, args.per_process, args.numel, args.rounds, args.dht_ops, args.gossip_limit_s)
    row = Row(peers, cfg.processes, round_bound=round_bound(peers))
    log(f"{peers} peers in {cfg.processes} processes of up to {cfg.per_process}")
    try:
        results = run_group(scale_process, cfg, cfg.processes, deadline_s=900.0, wait_s=300.0)
    except GroupFailed as error:
        row.error = str(error)
        log(f"{peers} peers failed: {error}")
        return row
    first, count = results[0], sum(r["peers"] for r in results)
    pooled = {name: [value for r in results for value in r[name]] for name in ("store_ms", "get_ms", "matchmaking_ms")}
    row.start_s, row.membership_s = first["start_s"], first["membership_s"]
    row.store_ms, row.get_ms, row.matchmaking_ms = (
        (quantile(pooled[name], 0.5), quantile(pooled[name], 0.95)) for name in ("store_ms", "get_ms", "matchmaking_ms"))
    row.dht_failures = sum(r["dht_failures"] for r in results)
    row.peer_rounds, row.no_group = sum(r["peer_rounds"] for r in results), sum(r["no_group"] for r in results)
    row.no_group_share = row.no_group / row.peer_rounds if row.peer_rounds else None
    row.round_errors = dict(sum((Counter(r["round_errors"]) for r in results), Counter()))
    row.moshpit_rounds, row.moshpit_trace = first["moshpit_rounds"], first["moshpit_trace"]
    row.no_group_per_round, row.phase_s, row.load_average = first["no_group_per_round"], first["phase_s"], first["load_average"]
    row.max_fds = max(r["fds"] for r in results)
    row.gossip_pushes = {kind: sum(r["gossip_pushes"].get(kind, 0) for r in results) for kind in ("accepted", "failed")}
    row.gossip_steps, row.gossip_s, row.gossip_max_error = first["gossip_steps"], first["gossip_s"], first["gossip_max_error"]
    row.mb_rss_per_peer = sum(r["rss_bytes"] for r in results) / count / MB
    row.mb_daemon_rss_per_peer = sum(r["daemon_rss_bytes"] for r in results) / count / MB
    peer_seconds = sum(r["measured_s"] * r["peers"] for r in results)
    row.daemon_cpu_pct_per_peer = 100 * sum(r["daemon_cpu_s"] for r in results) / peer_seconds
    row.python_cpu_pct_per_peer = 100 * sum(r["python_cpu_s"] for r in results) / peer_seconds
    row.membership_ok = row.membership_s <= MEMBERSHIP_TARGET_S
    row.moshpit_ok = row.moshpit_rounds is not None and row.moshpit_rounds <= row.round_bound
    row.no_group_ok = row.no_group_share is not None and row.no_group_share < NO_GROUP_TARGET
    if sum(r["daemons"] for r in results) != count:
        row.error = f"found {sum(r['daemons'] for r in results)} p2pd daemons for {count} peers"
    log(f"{peers} peers: {summary(row)}")
    return row


def summary(row: Row) -> str:
    return (f"membership {fmt(row.membership_s, 1)} s, moshpit {row.moshpit_rounds} rounds (bound {row.round_bound}), "
            f"{row.no_group} of {row.peer_rounds} peer-rounds without a group, gossip {fmt(row.gossip_steps, 1)} "
            f"steps / {fmt(row.gossip_s, 1)} s, {fmt(row.mb_rss_per_peer, 0)} MB/peer")


CAPTION = (
    "members s: from the last peer's node start until every peer lists all N (10 s target). DHT: every peer at "
    "once stores signed records under keys of its own (all replicas) and reads each back. match ms: "
    "report.seconds - report.allreduce_seconds over all peer-rounds. no group: peer-rounds whose report is not ok "
    "(< 1% target). moshpit: group_size 4, min 2, {window:g} s window, weight 1.0, lockstep rounds until every "
    "peer is within 1e-3 of the mean, bound ceil(log_4 N) + 1. gossip: fanout 1, steps = mean step() calls per "
    "peer. MB/peer: VmRSS of the benchmark processes and their p2pd daemons (MB = 10^6 bytes). p2pd CPU: "
    "utime + stime of the daemons from the last start to the end, per peer, in % of one core."
)


def pair(values: tuple[float | None, float | None]) -> str:
    return f"{fmt(values[0], 0)} / {fmt(values[1], 0)}"


def render(rows: list[Row], args: argparse.Namespace, wall_s: float) -> Table:
    title = f"Scale on loopback: {args.numel:,} float32 per peer, up to {args.per_process} peers per process"
    table = Table(title=title, caption=CAPTION.format(window=WINDOW) + f" Wall time {wall_s:.0f} s.")
    headers = ("N", "procs", "start s", "members s", "store ms p50/p95", "get ms p50/p95", "match ms p50/p95",
               "no group", "moshpit rounds", "gossip steps", "gossip s", "MB RSS/peer", "p2pd CPU %/peer")
    for header in headers:
        table.add_column(header, justify="right", overflow="fold")
    for row in rows:
        if row.error and row.membership_s is None:
            table.add_row(str(row.peers), str(row.processes), f"[red]{row.error}[/red]", *[""] * (len(headers) - 3))
            continue
        rounds = f"{row.moshpit_rounds}" if row.moshpit_rounds is not None else f">{len(row.moshpit_trace)}"
        table.add_row(
            str(row.peers), str(row.processes), fmt(row.start_s, 1),
            f"{fmt(row.membership_s, 1)} " + verdict(row.membership_ok, "pass", "FAIL"),
            pair(row.store_ms) + (f" [red]{row.dht_failures} failed[/red]" if row.dht_failures else ""),
            pair(row.get_ms), pair(row.matchmaking_ms),
            f"{100 * (row.no_group_share or 0):.1f}% " + verdict(row.no_group_ok, "pass", "FAIL"),
            f"{rounds} (<= {row.round_bound}) " + verdict(row.moshpit_ok, "pass", "FAIL"),
            fmt(row.gossip_steps, 1), fmt(row.gossip_s, 1) if row.gossip_s is not None else "[red]not reached[/red]",
            fmt(row.mb_rss_per_peer, 0), fmt(row.daemon_cpu_pct_per_peer, 1))
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--peers", default=None, help="peer counts, comma-separated (default 8,16,32,64)")
    parser.add_argument("--per-process", type=int, default=8, help="peers sharing one process and its event loop")
    parser.add_argument("--numel", type=int, default=4096, help="float32 elements per peer")
    parser.add_argument("--rounds", type=int, default=None, help=f"moshpit rounds at most (default {DEFAULTS['rounds']})")
    parser.add_argument("--quick", action="store_true", help="8 peers, fewer rounds and DHT operations (CI)")
    args = parser.parse_args(argv)
    if args.quick and args.peers is not None:
        parser.error("--quick runs 8 peers; leave out --peers")
    try:
        args.peers = [int(p) for p in (args.peers or ("8" if args.quick else "8,16,32,64")).split(",") if p]
    except ValueError:
        parser.error(f"--peers takes comma-separated integers, got {args.peers!r}")
    if not args.peers or min(args.peers) < MIN_GROUP_SIZE:
        parser.error(f"need every --peers >= {MIN_GROUP_SIZE}")
    if args.per_process < 1 or args.numel < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--per-process, --numel and --rounds must be positive")
    preset = QUICK if args.quick else DEFAULTS
    args.rounds = args.rounds or preset["rounds"]
    args.dht_ops, args.gossip_limit_s = preset["dht_ops"], preset["gossip_limit_s"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind: run_group removes the peers
    started = time.monotonic()
    rows = [run_configuration(peers, args) for peers in args.peers]
    wall_s = time.monotonic() - started
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"} | {"window_s": WINDOW, "group_size": GROUP_SIZE,
                                                                         "target": TARGET, "aggregator": AGGREGATOR}
        print(json.dumps({"config": config, "rows": [asdict(r) for r in rows], "wall_s": wall_s}, indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=220)
        console.print(render(rows, args, wall_s))
    return 1 if any(row.error for row in rows) else 0  # not meeting a bound is a finding, shown in the table


if __name__ == "__main__":
    sys.exit(main())
