"""One averaging round of a pseudo-gradient bigger than one message can be, and a replay of its result.

    python benchmarks/big_round.py [--elements 600e6] [--codecs q2,none] [--json] [--out FILE]

Two swarmgrad Averagers on loopback (real p2pd daemons and DHT, the direct encrypted data plane)
average one float32 tensor of --elements each (600 million: 2.4 GB, above AES-GCM's 2 GiB message
limit) under the mean rule, once per codec. Checked: the round succeeds, both members hold the same
result, and it is the mean of the two inputs (exactly up to float rounding without compression;
within the codec's error for q2, reported). Then peer 0 keeps the result as a donor does
(``StateServer.publish_result``: the frames it travelled in for q2, bfloat16 without compression)
and peer 1 downloads it as a peer that missed the round would (``download_result``: the frames,
decoded to exactly what peer 0 applied; or bfloat16 in chunks), checked bit for bit against what it
should be. Everything runs in one process on one event loop; the inputs are seeded.

The average lands in the input's own memory (``in_place``, as a DiLoCo round run in turn does), so
a q2 round holds 3 model-sized float32 buffers per peer at its peak (the input, error feedback's
residual and its staged successor), 1 without compression; the residuals are freed before the
replay. The inputs are drawn a piece at a time from seeds, so the check draws them again.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse
import asyncio
import gc
import json
import resource
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from swarmgrad.averaging import Aggregation, Averager, Moshpit
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.state.results import download_result
from swarmgrad.state.server import StateServer, state_protocol

RUN = "big-round"
PIECE = 1 << 24  # elements compared at a time: the check needs no model-sized temporary


@dataclass
class Row:
    codec: str
    elements: int
    ok: bool
    round_seconds: float
    bytes_sent: int
    same_on_both: bool
    relative_error: float  # |result - mean| / |mean| over the whole tensor
    replay_seconds: float
    replay_bytes_kept: int
    replay_exact: bool
    peak_rss_gb: float
    error: str | None = None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def piece(elements: int, seed: int, start: int) -> torch.Tensor:
    """Elements [start, start + PIECE) of input ``seed``: drawn a piece at a time, so any piece can be
    drawn again without the whole input (the round overwrites it with the average)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + start // PIECE)
    return torch.randn(min(PIECE, elements - start), generator=generator)


def seeded(elements: int, seed: int) -> torch.Tensor:
    return torch.cat([piece(elements, seed, start) for start in range(0, elements, PIECE)])


def relative_error(result: torch.Tensor, elements: int) -> float:
    """|result - mean| / |mean| of the two inputs, drawn again a piece at a time."""
    error = norm = 0.0
    for start in range(0, elements, PIECE):
        mean = (piece(elements, 0, start) + piece(elements, 1, start)) / 2
        error += float((result[start : start + PIECE] - mean).pow(2).sum())
        norm += float(mean.pow(2).sum())
    return (error / norm) ** 0.5


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


async def one_codec(codec: str, elements: int) -> Row:
    log(f"{codec}: two peers of {elements / 1e6:.0f}M elements ({elements * 4 / 1e9:.1f} GB fp32 each)")
    tensors = [seeded(elements, 0), seeded(elements, 1)]
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(SwarmNode(NodeConfig()))
        second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
        runtimes = [await stack.enter_async_context(NetworkRuntime(RUN, node=node)) for node in (first, second)]
        averagers = [await stack.enter_async_context(Averager(
            runtime, [tensor], settings=Moshpit(group_size=2, matchmaking_seconds=5.0), grid_dims=1,
            codec=codec, write_back=False, aggregation=Aggregation(rule="mean")))
            for runtime, tensor in zip(runtimes, tensors)]
        started = time.monotonic()
        # in place, as a DiLoCo round run in turn: the average lands in the input's own memory
        reports = await asyncio.gather(*(averager.step(weight=1.0, round_index=0, in_place=True)
                                         for averager in averagers))
        seconds = time.monotonic() - started
        if not all(report.ok for report in reports):
            error = "; ".join(str(report.error) for report in reports if not report.ok)
            return Row(codec, elements, False, seconds, 0, False, float("nan"), 0.0, 0, False, peak_rss_gb(), error)
        taken = [averager.take_average() for averager in averagers]
        results = [average for average, _ in taken]
        same = torch.equal(results[0], results[1])
        error = relative_error(results[0], elements)
        log(f"{codec}: round in {seconds:.1f} s, relative error {error:.2e}, same on both: {same}")
        for averager in averagers:  # what the replay does not need
            if averager.feedback is not None:
                averager.feedback.reset()
        gc.collect()
        # peer 0 keeps its result as a donor does; peer 1 replays it as a peer that missed the round
        server = await stack.enter_async_context(StateServer(runtimes[0].transport, state_protocol(RUN)))
        server.publish_result(0, results[0], taken[0][1])
        kept = server.results.nbytes()
        del taken
        started = time.monotonic()
        decoder = averagers[1].result_decoder if averagers[1].codec.lossy else None
        replayed = await download_result(runtimes[1].transport, state_protocol(RUN), [runtimes[0].peer_id], 0,
                                         elements, seconds=3600.0, decoder=decoder)
        replay_seconds = time.monotonic() - started
        want = results[1] if decoder is not None else results[1].to(torch.bfloat16).float()
        exact = torch.equal(replayed, want)
        log(f"{codec}: replay of {kept / 1e9:.2f} GB kept in {replay_seconds:.1f} s, exact: {exact}")
        return Row(codec, elements, True, seconds, reports[0].bytes_sent, same, error, replay_seconds, kept, exact,
                   peak_rss_gb())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=float, default=600e6, help="Elements of the averaged tensor.")
    parser.add_argument("--codecs", default="q2,none", help="Comma-separated codecs, one round each.")
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON instead of a table.")
    parser.add_argument("--out", help="Also write the JSON here.")
    args = parser.parse_args(argv)
    rows = []
    for codec in args.codecs.split(","):
        rows.append(asyncio.run(one_codec(codec, int(args.elements))))
        gc.collect()
    report = {"rows": [asdict(row) for row in rows]}
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=2)
    if args.json:
        print(json.dumps(report))
    else:
        table = Table(title=f"one round of {int(args.elements) / 1e6:.0f}M elements, two peers, loopback")
        for column in ("codec", "ok", "round s", "MB sent", "same on both", "rel. error vs mean", "replay s",
                       "kept MB", "replay exact", "peak RSS GB"):
            table.add_column(column)
        for row in rows:
            table.add_row(row.codec, str(row.ok), f"{row.round_seconds:.1f}", f"{row.bytes_sent / 1e6:.0f}",
                          str(row.same_on_both), f"{row.relative_error:.2e}", f"{row.replay_seconds:.1f}",
                          f"{row.replay_bytes_kept / 1e6:.0f}", str(row.replay_exact), f"{row.peak_rss_gb:.1f}")
        Console().print(table)
    return 0 if all(row.ok and row.same_on_both and row.replay_exact for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
