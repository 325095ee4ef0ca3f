"""All-reduce time and bandwidth on loopback: hivemind's averager, swarmgrad's, and two raw references.

    python benchmarks/allreduce.py [--json] [--peers 4] [--size-mb 100] [--rounds 5]
                                   [--codecs none,fp16,int8] [--systems hivemind,raw-p2pd,raw-tcp,swarmgrad]
                                   [--aggregator RULE]

Every system runs in --peers fresh processes (one per peer, spawn), each holding one float32 tensor
of --size-mb. A round starts on a barrier; its time is the slowest peer's; we report the median of
--rounds rounds after one warm-up round. Tensors are reset to their initial values before every
round, so every round is a real average, checked against the mean of the initial tensors.

- hivemind: DecentralizedAverager per peer (own DHT; group of all peers), codecs map to
  NoCompression / Float16Compression / Uniform8BitQuantization.
- raw-p2pd / raw-tcp: no averaging, only traffic: every peer sends each other peer 2*size/N bytes
  at once (what a butterfly all-reduce sends: reduce-scatter + all-gather), over hivemind P2P binary
  streams through p2pd, or over plain asyncio TCP; the upper bounds for the two data planes.
- swarmgrad: swarmgrad.averaging.Averager on a NetworkRuntime (around a SwarmNode) per peer, one group of
  all peers; skipped if it cannot be imported. ``--aggregator`` (a rule of swarmgrad/averaging/rules/;
  default mean, hivemind's) picks how its owners combine contributions: a rule that needs all rows
  holds every member's chunk and aggregates it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # set before torch loads, inherited by every peer
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import argparse
import asyncio
import contextlib
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from _harness import (
    MB,
    GroupFailed,
    PeerContext,
    RoundStats,
    TrafficConfig,
    fmt,
    log,
    p2pd_peer,
    patch_hivemind_quantization,
    run_group,
    start_hivemind_dht,
    start_swarm_node,
    target_cell,
    tcp_aes_peer,
    tcp_peer,
    verdict,
)
from rich.console import Console
from rich.table import Table

CODEC_SYSTEMS = ("hivemind", "swarmgrad")  # systems that average, once per codec
RAW_SYSTEMS = ("raw-p2pd", "raw-tcp", "raw-tcp-aes")  # traffic only, codec-independent
TRANSPORTS = ("libp2p", "direct", "direct-plain")  # swarmgrad's data planes
# per swarmgrad transport: the raw reference it is compared with, and its targets (issues 3 and 4)
REFERENCE = {"libp2p": "raw-p2pd", "direct": "raw-tcp-aes", "direct-plain": "raw-tcp"}
TIME_RATIO_TARGETS = {"libp2p": 1.0, "direct": 2.0, "direct-plain": 3.5}  # hivemind s / swarmgrad s
BANDWIDTH_TARGETS = {"libp2p": 0.8, "direct": 0.6, "direct-plain": 0.6}  # fraction of the raw reference
CODEC_FACTOR = {"none": 1.0, "fp16": 0.5, "int8": 0.25}  # bytes on the wire per fp32 byte
# relative L2 error ||avg - mean|| / ||mean|| a correct round stays under, per codec
TOLERANCE = {"none": 1e-5, "fp16": 2e-3, "int8": 5e-2}


@dataclass
class BenchConfig:
    """What every peer of one run needs; picklable, sent to the spawned peers."""

    peers: int
    size_bytes: int
    rounds: int
    codec: str
    round_timeout: float
    chunk_bytes: int
    transport: str = "libp2p"  # swarmgrad only: libp2p | direct | direct-plain
    aggregator: str = "mean"  # swarmgrad only

    @property
    def numel(self) -> int:
        return self.size_bytes // 4

    @property
    def share_bytes(self) -> int:
        """fp32 bytes a peer sends each other peer in a butterfly all-reduce (reduce-scatter + all-gather)."""
        return 2 * self.size_bytes // self.peers


@dataclass
class Row:
    system: str
    codec: str
    transport: str = "-"  # swarmgrad rows: which data plane
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    rounds_s: list[float] = field(default_factory=list)
    mb_per_peer: float | None = None  # 2(N-1)/N * size after codec
    agg_mbps: float | None = None  # peers * mb_per_peer / median_s
    correct: bool | None = None
    rel_error: float | None = None
    time_ratio: float | None = None  # hivemind / swarmgrad median seconds (swarmgrad rows)
    effective_mbps: float | None = None  # peers * 2(N-1)/N * fp32 size / median_s: what averaging delivers
    bandwidth_fraction: float | None = None  # swarmgrad effective_mbps / raw p2pd agg_mbps (swarmgrad rows)
    transfer_s: float | None = None  # swarmgrad: median of the all-reduce phase alone (matchmaking excluded)
    transfer_fraction: float | None = None  # same fraction, timed on the all-reduce phase
    error: str | None = None
    note: str = ""


# ---------------------------------------------------------------- tensors and checks, in every peer


def peer_tensor(rank: int, numel: int) -> torch.Tensor:
    """The initial tensor of ``rank``; deterministic, so every peer can rebuild everyone's."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def expected_result(peers: int, numel: int, aggregator: str) -> torch.Tensor:
    """What a correct swarmgrad round holds: the mean, which centered-clip is on these honest tensors
    (none is farther than τ); the other rules work per coordinate, so the whole tensor's is each chunk's."""
    if aggregator in ("mean", "centered-clip"):
        return expected_mean(peers, numel)
    from swarmgrad.averaging.rules import get_rule

    stack = torch.stack([peer_tensor(rank, numel) for rank in range(peers)])
    return get_rule(aggregator).aggregate(stack, torch.ones(peers, dtype=torch.float64)).value


def expected_mean(peers: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel)
    for rank in range(peers):
        total += peer_tensor(rank, numel)
    return total / peers


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def round_result(seconds: list[float], oks: list[bool], errors: list[float], **extra: Any) -> dict:
    """What a peer sends back: times of the measured rounds (warm-up dropped) and correctness."""
    return {"seconds": seconds[1:], "ok": all(oks), "rel_error": max(errors), **extra}


# ---------------------------------------------------------------- hivemind baseline


def hivemind_peer(ctx: PeerContext, cfg: BenchConfig) -> dict:
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # hivemind forks its DHT and averager processes
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    codecs = {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}
    patch_hivemind_quantization()
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")  # hivemind's int8, once per round
    initial, expected = peer_tensor(ctx.rank, cfg.numel), expected_mean(cfg.peers, cfg.numel)
    dht = start_hivemind_dht(ctx)
    averager = None
    try:
        averager = DecentralizedAverager(
            [initial.clone()], dht, start=True, prefix="bench",
            target_group_size=cfg.peers, min_group_size=cfg.peers,
            # a full group starts at once, without waiting this out; hivemind warns unless request_timeout is smaller
            min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=cfg.round_timeout,
            compression=codecs[cfg.codec](),
        )  # fmt: skip
        ctx.sync()  # every averager is up before the first round
        seconds, oks, errors = [], [], []
        for index in range(cfg.rounds + 1):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(initial)
            ctx.sync()
            start = time.perf_counter()
            gathered = averager.step(timeout=cfg.round_timeout)
            seconds.append(time.perf_counter() - start)
            ctx.sync()  # check results only once every peer is done: checking costs CPU the others need
            with averager.get_tensors() as tensors:
                errors.append(rel_error(tensors[0], expected))
            oks.append(gathered is not None and len(gathered) == cfg.peers)
            _log_round(ctx, "hivemind", cfg.codec, index, seconds[-1], oks[-1])
        ctx.sync()  # nobody leaves while another may still be finishing the last round with it
        return round_result(seconds, oks, errors)
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def _log_round(ctx: PeerContext, system: str, codec: str, index: int, seconds: float, ok: bool) -> None:
    if ctx.rank == 0:
        label = "warm-up" if index == 0 else f"round {index}"
        log(f"{system}/{codec} {label}: {seconds:.2f} s (peer 0){'' if ok else ' FAILED'}")


# ---------------------------------------------------------------- swarmgrad


def swarmgrad_peer(ctx: PeerContext, cfg: BenchConfig) -> dict:
    from swarmgrad.eventloop import run

    return run(_swarmgrad_rounds(ctx, cfg))


async def _swarmgrad_rounds(ctx: PeerContext, cfg: BenchConfig) -> dict:
    from swarmgrad.averaging import Aggregation, Averager, Moshpit
    from swarmgrad.net.network_runtime import NetworkRuntime

    initial, expected = peer_tensor(ctx.rank, cfg.numel), expected_result(cfg.peers, cfg.numel, cfg.aggregator)
    tensor = initial.clone()
    async with contextlib.AsyncExitStack() as stack:
        node = await start_swarm_node(ctx, stack)
        runtime = await stack.enter_async_context(NetworkRuntime(
            "bench", node=node, direct=cfg.transport != "libp2p", trusted_network=cfg.transport == "direct-plain"))
        # one group of every peer: matchmaking ends as soon as all of them declared (the window, 1 s as
        # before the runtime refactor, is only waited out when some are missing)
        settings = Moshpit(group_size=cfg.peers, min_group_size=cfg.peers, matchmaking_seconds=1.0)
        averager = await stack.enter_async_context(
            Averager(runtime, [tensor], settings=settings, codec=cfg.codec, swap_storage=True,
                     aggregation=Aggregation(rule=cfg.aggregator))
        )  # fmt: skip  (swap_storage: the average becomes the tensor's storage, no 100 MB copy per round)
        deadline = time.monotonic() + 30  # groups are laid out from the membership: wait until it lists everyone
        while len(runtime.members()) < cfg.peers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await ctx.async_sync()
        seconds, oks, errors, sent, received, transports, transfer = [], [], [], [], [], set(), []
        for index in range(cfg.rounds + 1):
            tensor.copy_(initial)
            await ctx.async_sync()
            start = time.perf_counter()
            report = await asyncio.wait_for(averager.step(weight=1.0), cfg.round_timeout)
            seconds.append(time.perf_counter() - start)
            await ctx.async_sync()  # check results only once every peer is done (checking costs CPU)
            errors.append(rel_error(tensor, expected))
            oks.append(bool(report.ok) and _group_size(report) == cfg.peers)
            transfer.append(report.allreduce_seconds)
            sent.append(report.bytes_sent)
            received.append(report.bytes_received)
            transports.update(getattr(report, "transports", {}).values())  # e.g. libp2p or direct TCP, per peer
            _log_round(ctx, "swarmgrad", cfg.codec, index, seconds[-1], oks[-1])
        await ctx.async_sync()  # nobody leaves while another may still be finishing the last round with it
        return round_result(
            seconds, oks, errors, bytes_sent=max(sent), bytes_received=max(received), transports=sorted(transports),
            transfer_seconds=transfer[1:],
        )


def _group_size(report: Any) -> int:
    size = getattr(report, "group_size", None)  # the agreed contract; the first Averager lists the group instead
    return size if size is not None else len(report.group)


def swarmgrad_missing() -> str | None:
    """Why swarmgrad cannot be benchmarked here, or None if it can."""
    try:
        from swarmgrad.averaging import Averager  # noqa: F401
        from swarmgrad.dht import NodeConfig, SwarmNode  # noqa: F401
        from swarmgrad.net.network_runtime import NetworkRuntime  # noqa: F401
    except ImportError as error:
        return f"not available: {type(error).__name__}: {error}"
    return None


# ---------------------------------------------------------------- running systems, building rows

PEER_TARGETS = {
    "hivemind": hivemind_peer, "swarmgrad": swarmgrad_peer, "raw-p2pd": p2pd_peer, "raw-tcp": tcp_peer,
    "raw-tcp-aes": tcp_aes_peer,
}


def run_system(system: str, codec: str, cfg: BenchConfig) -> Row:
    """One system with one codec in fresh processes; failures end up in the row, never in an exception."""
    factor = CODEC_FACTOR.get(codec, 1.0)
    row = Row(system, codec, cfg.transport if system == "swarmgrad" else "-", mb_per_peer=2 * (cfg.peers - 1) / cfg.peers * cfg.size_bytes * factor / MB)
    if system == "swarmgrad" and (missing := swarmgrad_missing()):
        row.error = missing
        return row
    config: Any = cfg
    if system in RAW_SYSTEMS:
        config = TrafficConfig(cfg.peers, cfg.rounds, cfg.share_bytes, cfg.chunk_bytes, cfg.round_timeout)
    wait_s = cfg.round_timeout + 120  # a barrier also waits out others' start-up and correctness checks
    deadline_s = 180 + (cfg.rounds + 1) * (cfg.round_timeout + 30)
    label = f"{system}[{cfg.transport}]" if system == "swarmgrad" else system
    log(f"{label}/{codec}: {cfg.peers} peers x {cfg.size_bytes / MB:g} MB, {cfg.rounds} rounds + warm-up")
    started = time.monotonic()
    try:
        results = run_group(PEER_TARGETS[system], config, cfg.peers, deadline_s, wait_s)
    except GroupFailed as error:
        row.error = str(error)
        log(f"{system}/{codec} failed after {time.monotonic() - started:.0f} s: {error}")
        return row
    fill_row(row, results, cfg.peers)
    log(f"{system}/{codec}: median {row.median_s:.3f} s, {fmt(row.agg_mbps, 0)} MB/s aggregate, correct={row.correct}")
    return row


def fill_row(row: Row, results: list[dict], peers: int) -> None:
    stats = RoundStats.from_peers([result["seconds"] for result in results])
    row.rounds_s = [round(seconds, 4) for seconds in stats.rounds]
    row.median_s, row.min_s, row.max_s = stats.median, min(stats.rounds), max(stats.rounds)
    row.agg_mbps = peers * row.mb_per_peer / row.median_s
    row.effective_mbps = row.agg_mbps / CODEC_FACTOR.get(row.codec, 1.0)
    if "transfer_seconds" in results[0]:
        row.transfer_s = RoundStats.from_peers([result["transfer_seconds"] for result in results]).median
    errors = [result["rel_error"] for result in results if result["rel_error"] is not None]
    row.rel_error = max(errors) if errors else None
    within = row.rel_error is None or row.rel_error <= TOLERANCE[row.codec]
    row.correct = all(result["ok"] for result in results) and within
    if "bytes_sent" in results[0]:  # what swarmgrad says it sent, against the nominal butterfly volume
        row.note = f"sent {max(result['bytes_sent'] for result in results) / MB:.1f} MB/peer/round"
        transports = sorted({name for result in results for name in result.get("transports", [])})
        row.note += f" via {'+'.join(transports)}" if transports else ""


def add_ratios(rows: list[Row], codecs: list[str]) -> dict[str, dict]:
    """Fill the swarmgrad rows' comparison columns; return the same numbers keyed by transport and codec."""
    by_key = {(row.system, row.codec): row for row in rows if row.system != "swarmgrad"}
    ratios: dict[str, dict] = {}
    for ours in (row for row in rows if row.system == "swarmgrad" and row.median_s is not None):
        theirs = by_key.get(("hivemind", ours.codec))
        reference = by_key.get((REFERENCE[ours.transport], "-"))
        if theirs is not None and theirs.median_s is not None:
            ours.time_ratio = theirs.median_s / ours.median_s
        if reference is not None and reference.agg_mbps:
            ours.bandwidth_fraction = ours.effective_mbps / reference.agg_mbps
            if ours.transfer_s:
                ours.transfer_fraction = ours.bandwidth_fraction * ours.median_s / ours.transfer_s
        time_target, bandwidth_target = TIME_RATIO_TARGETS[ours.transport], BANDWIDTH_TARGETS[ours.transport]
        ratios.setdefault(ours.transport, {})[ours.codec] = {
            "reference": REFERENCE[ours.transport],
            "hivemind_over_swarmgrad": ours.time_ratio,
            "time_ratio_target": time_target,
            "time_ratio_pass": _passes(ours.time_ratio, time_target),
            "bandwidth_fraction_of_reference": ours.bandwidth_fraction,
            "bandwidth_target": bandwidth_target,
            "bandwidth_pass": _passes(ours.bandwidth_fraction, bandwidth_target),
            "transfer_phase_fraction_of_reference": ours.transfer_fraction,
            "transfer_phase_pass": _passes(ours.transfer_fraction, bandwidth_target),
        }
    return ratios


def _passes(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


# ---------------------------------------------------------------- output

CAPTION = (
    "seconds: one all-reduce round, slowest peer, median/min/max over the measured rounds after 1 warm-up. "
    "MB/peer = 2(N-1)/N x tensor size after codec (butterfly: reduce-scatter + all-gather), MB = 10^6 bytes. "
    "agg MB/s = peers x MB/peer / median seconds (bytes on the wire; raw rows: total bytes moved / time). "
    "Effective MB/s = the same with the fp32 size (what averaging delivers; equal to agg for codec none). "
    "bw / raw = effective MB/s / the aggregate of the matching raw reference (libp2p: raw-p2pd, direct: "
    "raw-tcp-aes, direct-plain: raw-tcp), timed on the whole round (matchmaking included) and on the all-reduce "
    "phase alone (swarmgrad's report.allreduce_seconds; the raw rows have no matchmaking). Targets, per transport "
    "(hivemind/swarmgrad time; bw / raw): " + "; ".join(
        f"{t}: >= {TIME_RATIO_TARGETS[t]}, >= {BANDWIDTH_TARGETS[t]}" for t in TRANSPORTS) + "."
)


def render(rows: list[Row], cfg: BenchConfig, wall_s: float) -> Table:
    table = Table(
        title=f"All-reduce on loopback: {cfg.peers} peers x {cfg.size_bytes / MB:g} MB fp32, {cfg.rounds} rounds, "
              f"swarmgrad aggregator {cfg.aggregator}",
        caption=f"{CAPTION} Wall time {wall_s:.0f} s.",
    )
    for header in ("system", "codec", "median s", "min s", "max s", "MB/peer", "agg MB/s", "effective MB/s", "correct"):
        table.add_column(header, justify="left" if header in ("system", "codec") else "right")
    table.add_column("hivemind/\nswarmgrad", justify="right")
    table.add_column("bw / raw\nwhole round", justify="right")
    table.add_column("bw / raw\nall-reduce\nphase", justify="right")
    table.add_column("note", overflow="fold", max_width=60)
    for row in rows:
        table.add_row(
            row.system if row.system != "swarmgrad" else f"swarmgrad {row.transport}", row.codec, fmt(row.median_s, 3), fmt(row.min_s, 3), fmt(row.max_s, 3),
            fmt(row.mb_per_peer, 1), fmt(row.agg_mbps, 0), fmt(row.effective_mbps, 0), verdict(row.correct, "yes", "NO"),
            target_cell(row.time_ratio, TIME_RATIO_TARGETS.get(row.transport, 1.0)),
            target_cell(row.bandwidth_fraction, BANDWIDTH_TARGETS.get(row.transport, 0.8)),
            target_cell(row.transfer_fraction, BANDWIDTH_TARGETS.get(row.transport, 0.8)),
            f"[red]{row.error}[/red]" if row.error else _error_note(row),
        )  # fmt: skip
    return table


def _error_note(row: Row) -> str:
    error = "" if row.rel_error is None else f"rel err {row.rel_error:.1e}"
    return ", ".join(part for part in (error, row.note) if part)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from swarmgrad.averaging.rules import RULE_NAMES  # the names only (no import of the rules)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=100.0, help="fp32 tensor per peer, MB = 10^6 bytes")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds, after one warm-up round")
    parser.add_argument("--codecs", default="none,fp16,int8")
    parser.add_argument("--systems", default="hivemind,raw-p2pd,raw-tcp,raw-tcp-aes,swarmgrad")
    parser.add_argument("--transport", default="libp2p,direct,direct-plain",
                        help="swarmgrad data planes to measure, comma-separated: " + ", ".join(TRANSPORTS))
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="write size of the raw references")
    parser.add_argument("--round-timeout", type=float, default=None, help="seconds; default 30 + 0.6 s per MB")
    parser.add_argument("--aggregator", default="mean", choices=RULE_NAMES,
                        help="how swarmgrad's owners combine contributions")
    args = parser.parse_args(argv)
    args.codecs = [codec for codec in args.codecs.split(",") if codec]
    args.systems = [system for system in args.systems.split(",") if system]
    args.transports = [transport for transport in args.transport.split(",") if transport]
    for transport in args.transports:
        if transport not in TRANSPORTS:
            parser.error(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
    for codec in args.codecs:
        if codec not in CODEC_FACTOR:
            parser.error(f"unknown codec {codec!r}; choose from {', '.join(CODEC_FACTOR)}")
    for system in args.systems:
        if system not in PEER_TARGETS:
            parser.error(f"unknown system {system!r}; choose from {', '.join(PEER_TARGETS)}")
    if args.peers < 2 or args.rounds < 1:
        parser.error("need --peers >= 2 and --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = BenchConfig(
        peers=args.peers, size_bytes=int(args.size_mb * MB) // 4 * 4, rounds=args.rounds, codec="-",
        round_timeout=args.round_timeout or 30 + 0.6 * args.size_mb, chunk_bytes=int(args.chunk_mib * 2**20),
        aggregator=args.aggregator,
    )  # fmt: skip
    started = time.monotonic()
    rows = []
    for system in args.systems:
        for transport in args.transports if system == "swarmgrad" else ["-"]:
            for codec in args.codecs if system in CODEC_SYSTEMS else ["-"]:
                config = BenchConfig(**{**asdict(base), "codec": codec, "transport": transport})
                rows.append(run_system(system, codec, config))
    ratios = add_ratios(rows, args.codecs)
    wall_s = time.monotonic() - started
    if args.json:
        config = {**asdict(base), "codecs": args.codecs, "systems": args.systems}
        config.pop("codec")
        report = {"config": config, "rows": [asdict(row) for row in rows], "ratios": ratios, "wall_s": wall_s}
        print(json.dumps(report, indent=2))
    else:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
            console = Console(width=180)
        console.print(render(rows, base, wall_s))
    # exit status: did every available system run and average correctly (targets are for the reader)
    broken = [row for row in rows if row.correct is False or (row.error and not row.error.startswith("not available"))]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
