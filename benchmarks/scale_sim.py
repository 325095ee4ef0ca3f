"""Moshpit and gossip mixing simulated without a network, to 10,000 peers: rounds, bytes and seconds to consensus.

    python benchmarks/scale_sim.py [--json] [--out DIR] [--quick] [--peers 8,16,...] [--seeds 5]
                                   [--churn 0.1] [--group-failure 0.05] [--rerank] [--grid real|base]
                                   [--async-activity 0.7] [--moshpit-round-s 3.6] [--gossip-step-s 0.04]
                                   [--real FILE.json ...]

The simulation itself, and what it models (the mixing rules, churn, the metric, the bytes), is in
benchmarks/_mixing.py. This script runs it over N and seeds, prints the table (or one JSON object with
--json) and writes scale-sim.png to --out. Seconds = rounds x --moshpit-round-s, steps x
--gossip-step-s, constant in N.

--real FILE.json reads the JSON of benchmarks/scale.py or benchmarks/consensus.py (rows with peers
or N, and moshpit rounds or gossip steps to target), plots those points beside the simulated ones
(every N they hold is simulated too) and prints the gap per N.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _harness import MB, log
from _mixing import DIM, MAX_ROUNDS, NUMEL, TARGET, Run, grid_dims, sides_for, simulate_gossip, simulate_moshpit
from consensus import GROUP_SIZE
from rich.console import Console
from rich.table import Table

from swarmgrad.averaging.settings import Gossip

# N that fill their grid (8, 12, 16, 24, ...: exact after d rounds) and N that leave cells empty (10, 20, 50, 100, ...)
GRID = (8, 10, 12, 16, 20, 24, 32, 40, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024, 2000, 2048, 4096, 5000,
        8192, 10000)
QUICK_MAX_PEERS = 256
SEEDS = 5
CHURN = 0.1  # per round: a peer is absent (moshpit), a push is lost (gossip)
GROUP_FAILURE = 0.05  # per round and group
# measured here: moshpit 3.6 s a round at 16 peers, 1M floats (issue 14); gossip 0.77 s for 19.1 steps
# to 1e-3 at 8 peers (`python benchmarks/consensus.py --peers 8 --codecs none --no-privacy --json`)
MOSHPIT_ROUND_S = 3.6
GOSSIP_STEP_S = 0.040
# gossip on the peers' own clocks: each steps in a tick with this chance. Any value from 0.5 to 0.9 gives
# 18-23 steps at 8 peers; 0.7 matches the 8-peer runs (19.1 steps in consensus.py, 20.9 in scale.py --quick)
ASYNC_ACTIVITY = 0.7
PNG_NAME = "scale-sim.png"


# ---------------------------------------------------------------- the grid of runs


@dataclass(frozen=True)
class Variant:
    name: str  # its key in the JSON
    label: str
    method: str  # moshpit | gossip: which latency, which real points
    run: Callable[[int, int], Run]  # (peers, seed) -> Run


def variants(args: argparse.Namespace) -> list[Variant]:
    common = dict(dim=args.dim, numel=args.numel, target=args.target, max_rounds=args.max_rounds)
    moshpit = functools.partial(simulate_moshpit, side=args.group_size, grid=args.grid, **common)
    gossip = functools.partial(simulate_gossip, fanout=args.fanout, **common)
    churned = dict(churn=args.churn, failure=args.group_failure)
    found = [Variant("moshpit", "moshpit", "moshpit", moshpit),
             Variant("moshpit_churn", "moshpit +churn", "moshpit", functools.partial(moshpit, **churned))]
    if args.rerank:
        found.append(Variant("moshpit_rerank", "moshpit +churn reranked", "moshpit",
                             functools.partial(moshpit, rerank=True, **churned)))
    found += [Variant("gossip", "gossip", "gossip", gossip),
              Variant("gossip_churn", "gossip +lost", "gossip", functools.partial(gossip, drop=args.churn))]
    if args.async_activity < 1:
        found.append(Variant("gossip_async", "gossip, own clocks", "gossip",
                             functools.partial(gossip, activity=args.async_activity)))
    return found


@dataclass
class Summary:
    """One variant at one N over the seeds: median and range of the seeds that reached the target."""

    rounds: float | None
    low: float | None
    high: float | None
    reached: int
    seeds: int
    mb_per_peer: float | None  # median over the seeds that reached it
    seconds: float | None
    drift: float
    no_group: float


def summarise(runs: list[Run], seconds_per_round: float) -> Summary:
    done = [run for run in runs if run.rounds is not None]
    rounds = [run.rounds for run in done]
    median = statistics.median(rounds) if rounds else None
    return Summary(median, min(rounds, default=None), max(rounds, default=None), len(done), len(runs),
                   statistics.median(run.bytes_per_peer for run in done) / MB if done else None,
                   None if median is None else median * seconds_per_round,
                   statistics.median(run.drift for run in runs), statistics.median(run.no_group for run in runs))


def simulate_grid(args: argparse.Namespace, found: list[Variant]) -> list[dict]:
    latency = {"moshpit": args.moshpit_round_s, "gossip": args.gossip_step_s}
    rows = []
    for peers in args.peers:
        row: dict[str, Any] = {"peers": peers, "theory": grid_dims(peers, args.group_size),
                               "sides": sides_for(peers, args.group_size, args.grid)}
        for variant in found:
            runs = [variant.run(peers, seed) for seed in range(args.seeds)]
            row[variant.name] = asdict(summarise(runs, latency[variant.method]))
        rows.append(row)
        log(f"{peers} peers: " + ", ".join(f"{v.name} {fmt_rounds(row[v.name])}" for v in found))
    return rows


# ---------------------------------------------------------------- real measurements


@dataclass
class RealPoint:
    peers: int
    method: str  # moshpit | gossip
    rounds: float
    source: str  # file and key it came from


PEER_KEYS = ("peers", "N", "n", "num_peers")
NOT_A_COUNT = re.compile(r"bound|limit|cap|theory|ceil|second|_s$|ms|mb|byte|pass|verdict|ok|fail|trace", re.I)


def _flatten(row: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _rows(data: Any) -> list[dict]:
    """The row dicts of a benchmark's JSON: ``rows`` (consensus.py), a top-level list, or any list of dicts."""
    if isinstance(data, list):
        return [row for row in data if isinstance(row, dict)]
    if isinstance(data, dict):
        if isinstance(data.get("rows"), list):
            return _rows(data["rows"])
        return [row for value in data.values() if isinstance(value, list) for row in _rows(value)]
    return []


def _count(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def real_points(path: Path) -> list[RealPoint]:
    """Rounds/steps to target per N from scale.py's or consensus.py's JSON, read defensively: rows with
    peers (or N) and either a method with its steps, or keys naming moshpit rounds / gossip steps."""
    points = []
    for row in _rows(json.loads(path.read_text())):
        flat = _flatten(row)
        peers = next((int(flat[k]) for k in PEER_KEYS if _count(flat.get(k))), None)
        if peers is None or flat.get("error") or flat.get("converged") is False:
            continue
        method = flat.get("method")
        if method in ("moshpit", "gossip"):  # consensus.py: one method per row, steps = rounds for moshpit
            if flat.get("codec", "none") == "none" and (value := _count(flat.get("steps", flat.get("rounds")))):
                points.append(RealPoint(peers, method, value, f"{path.name}:steps"))
            continue
        for method, counter in (("moshpit", "round"), ("gossip", "step")):
            key = next((k for k in flat if method in k.lower() and counter in k.lower()
                        and not NOT_A_COUNT.search(re.sub(f"{method}|{counter}s?", "", k.lower()))
                        and _count(flat[k])), None)
            if key is not None:
                points.append(RealPoint(peers, method, float(flat[key]), f"{path.name}:{key}"))
    return points


COMPARED = {"moshpit": ("moshpit",), "gossip": ("gossip", "gossip_async")}  # the variants without churn


def gaps(rows: list[dict], points: list[RealPoint]) -> list[dict]:
    """Simulated (no churn) against real rounds at every N both have."""
    by_peers = {row["peers"]: row for row in rows}
    found = []
    for point in points:
        for variant in COMPARED[point.method]:
            simulated = by_peers.get(point.peers, {}).get(variant, {}).get("rounds")
            if simulated is not None:
                found.append({"peers": point.peers, "method": point.method, "variant": variant, "simulated": simulated,
                              "real": point.rounds, "gap": simulated - point.rounds, "ratio": simulated / point.rounds,
                              "source": point.source})
    return found


# ---------------------------------------------------------------- output


def fmt_rounds(summary: dict) -> str:
    if summary["rounds"] is None:
        return "never"
    cell = f"{summary['rounds']:.3g}"
    if summary["low"] != summary["high"]:
        cell += f" ({summary['low']:.3g}-{summary['high']:.3g})"
    if summary["reached"] < summary["seeds"]:
        cell += f" {summary['reached']}/{summary['seeds']}"
    return cell


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def caption(args: argparse.Namespace, found_gaps: list[dict], wall_s: float) -> str:
    text = (f"Simulated, no network: groups of {args.group_size}, gossip fanout {args.fanout}, {args.seeds} seed(s), "
            f"vectors of {args.dim}; rounds/steps to {args.target:g}: median (range), k/n when k of n seeds reached it. "
            f"churn: a peer is "
            f"absent {args.churn:g} of rounds and a group fails {args.group_failure:g} of rounds (moshpit), a push is "
            f"lost with p={args.churn:g} (gossip). Gossip steps are "
            + f"synchronous; 'own clocks': each peer steps in a tick with p={args.async_activity:g}"
            + f". MB sent/peer (10^6 B) for {args.numel:,} float32, codec none. s = rounds x {args.moshpit_round_s:g} s, "
            f"steps x {args.gossip_step_s:g} s. Wall time {wall_s:.0f} s.")
    for gap in found_gaps:
        text += (f"\nN={gap['peers']} {gap['variant']}: simulated {gap['simulated']:g}, real {gap['real']:g} "
                 f"(gap {gap['gap']:+.1f}, x{gap['ratio']:.2f}; {gap['source']})")
    return text


def render(rows: list[dict], found: list[Variant], args: argparse.Namespace, found_gaps: list[dict],
           wall_s: float) -> Table:
    table = Table(title=f"Rounds, MB and seconds to {args.target:g} consensus against N (simulated)",
                  caption=caption(args, found_gaps, wall_s), caption_justify="left", show_lines=True)
    table.add_column("N", justify="right")
    table.add_column("grid", justify="right")
    table.add_column("theory\nceil(log_%d N)" % args.group_size, justify="right", no_wrap=True)
    for variant in found:
        unit = "rounds" if variant.method == "moshpit" else "steps"
        table.add_column(f"{variant.label}\n{unit}; MB/peer, s", justify="right", no_wrap=True)
    for row in rows:
        cells = [str(row["peers"]), "x".join(map(str, row["sides"])), str(row["theory"])]
        for variant in found:
            cell = row[variant.name]
            cells.append(f"{fmt_rounds(cell)}\n{_num(cell['mb_per_peer'], 0)} MB, {_num(cell['seconds'], 1)} s")
        table.add_row(*cells)
    return table


def plot(rows: list[dict], found: list[Variant], points: list[RealPoint], args: argparse.Namespace,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    peers = np.array([row["peers"] for row in rows])
    highest = max([c["high"] for row in rows for c in (row[v.name] for v in found) if c["high"] is not None]
                  + [p.rounds for p in points] + [grid_dims(int(peers.max()), args.group_size)])
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 7))
    colors = {"moshpit": "tab:blue", "moshpit_churn": "tab:cyan", "moshpit_rerank": "tab:purple",
              "gossip": "tab:orange", "gossip_churn": "tab:red", "gossip_async": "tab:brown"}
    for variant in found:
        cells = [row[variant.name] for row in rows]
        median = np.array([np.nan if c["rounds"] is None else c["rounds"] for c in cells])
        low = np.array([np.nan if c["low"] is None else c["low"] for c in cells])
        high = np.array([np.nan if c["high"] is None else c["high"] for c in cells])
        color = colors.get(variant.name)
        # thin lines: N that fill their grid (or are powers of 2 for gossip) sit far below their neighbours
        left.plot(peers, median, "o-", ms=4, lw=0.7, color=color, label=f"{variant.label} (simulated)")
        left.fill_between(peers, low, high, color=color, alpha=0.2, linewidth=0)
        mb = np.array([np.nan if c["mb_per_peer"] is None else c["mb_per_peer"] for c in cells])
        right.plot(peers, mb, "o-", ms=4, lw=0.7, color=color, label=variant.label)
    dense = np.unique(np.geomspace(peers.min(), peers.max(), 600).round().astype(int))
    left.plot(dense, [grid_dims(n, args.group_size) for n in dense], "k--", lw=1,
              label=f"theory: ceil(log_{args.group_size} N)")
    for method, marker in (("moshpit", "D"), ("gossip", "s")):
        mine = [p for p in points if p.method == method]
        if mine:
            left.scatter([p.peers for p in mine], [p.rounds for p in mine], marker=marker, s=60, zorder=5,
                         facecolor="none", edgecolor=colors[method], linewidths=2, label=f"{method} (real peers)")
    for axis, ylabel in ((left, f"rounds (moshpit) / steps (gossip) to {args.target:g}"),
                         (right, f"MB sent per peer to {args.target:g} ({args.numel:,} float32)")):
        axis.set_xscale("log")
        axis.set_xlabel("peers N")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    left.set_yscale("log")
    left.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_yticks([t for t in (1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300, 500)
                     if t <= 1.5 * highest])
    fig.suptitle(f"Consensus against N, simulated: groups of {args.group_size}, fanout {args.fanout}, "
                 f"churn {args.churn:g}, {args.seeds} seed(s): median and range")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def _probability(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"need a probability in [0, 1), got {text}")
    return value


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"need a positive number, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _peer_list(text: str) -> list[int]:
    try:
        peers = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated peer counts, got {text!r}") from None
    if not peers or not all(2 <= p <= 100_000 for p in peers):
        raise argparse.ArgumentTypeError(f"need peer counts from 2 to 100000, got {text!r}")
    return peers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--out", type=Path, default=Path("."), help=f"folder for {PNG_NAME}")
    parser.add_argument("--quick", action="store_true", help=f"N up to {QUICK_MAX_PEERS}, 1 seed (for tests)")
    parser.add_argument("--peers", type=_peer_list, default=list(GRID), help="peer counts, comma-separated")
    parser.add_argument("--seeds", type=_positive(int), default=None, help=f"runs per N (default {SEEDS}, --quick 1)")
    parser.add_argument("--dim", type=_positive(int), default=DIM, help="simulated vector length")
    parser.add_argument("--numel", type=_positive(int), default=NUMEL, help="float32 elements the bytes are for")
    parser.add_argument("--target", type=_probability, default=TARGET, help="relative error every peer must reach")
    parser.add_argument("--group-size", type=_positive(int), default=GROUP_SIZE)
    parser.add_argument("--fanout", type=_positive(int), default=Gossip().fanout)
    parser.add_argument("--churn", type=_probability, default=CHURN,
                        help="moshpit: a peer is absent from a round; gossip: a push is lost")
    parser.add_argument("--group-failure", type=_probability, default=GROUP_FAILURE,
                        help="a moshpit group's all-reduce fails (with churn)")
    parser.add_argument("--grid", choices=("real", "base"), default="real",
                        help="moshpit grid: moshpit.py's (grid.py) or plain base-g digits of the sorted rank")
    parser.add_argument("--rerank", action="store_true", help="also: ranks recomputed among the present peers")
    parser.add_argument("--async-activity", type=_positive(float), default=ASYNC_ACTIVITY,
                        help="gossip on its own clocks: chance a peer steps in a tick (1: leave that variant out)")
    parser.add_argument("--moshpit-round-s", type=_positive(float), default=MOSHPIT_ROUND_S)
    parser.add_argument("--gossip-step-s", type=_positive(float), default=GOSSIP_STEP_S)
    parser.add_argument("--max-rounds", type=_positive(int), default=MAX_ROUNDS, help="cap on rounds/steps per run")
    parser.add_argument("--real", type=Path, action="append", default=[],
                        help="JSON of benchmarks/scale.py or consensus.py to plot beside (repeatable)")
    args = parser.parse_args(argv)
    if args.group_size < 2 or args.target <= 0 or args.async_activity > 1:
        parser.error("need --group-size >= 2, --target in (0, 1) and --async-activity in (0, 1]")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is not a folder")
    args.points = []
    for path in args.real:  # read before anything runs: a bad file fails at once
        try:
            args.points += real_points(path)
        except (OSError, ValueError) as error:
            parser.error(f"--real {path}: {error}")
    if args.quick:
        args.peers = [p for p in args.peers if p <= QUICK_MAX_PEERS] or [min(args.peers)]
    args.seeds = args.seeds or (1 if args.quick else SEEDS)
    # simulate every N a real file measured too, so each real point has a simulated one to compare with
    args.peers = sorted(set(args.peers) | {p.peers for p in args.points if p.peers <= max(args.peers)})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    found = variants(args)
    rows = simulate_grid(args, found)
    found_gaps = gaps(rows, args.points)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / PNG_NAME
    plot(rows, found, args.points, args, png)
    wall_s = time.monotonic() - started
    log(f"wrote {png}")
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                  if k not in ("json", "points", "real")}
        config["real"] = [str(p) for p in args.real]
        print(json.dumps({"config": config, "rows": rows, "real": [asdict(p) for p in args.points],
                          "gaps": found_gaps, "png": str(png), "wall_s": wall_s}, indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=240)
        console.print(render(rows, found, args, found_gaps, wall_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
