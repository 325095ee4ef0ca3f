"""The numbers of benchmarks/big_model.py: a peer's JSON result summarized into its row (what each
figure means: big_model.py's docstring), the table, the PNG of cost against size, and saved reports
rendered again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

MB = 1e6


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def per_param(value: float | None, params: int) -> float | None:
    return None if value is None else value / params


def round_figures(rounds: list[dict], rate: float | None) -> dict:
    """Round time and wire time over the calls that attempted a round (ok or failed); the calls that
    only caught up (a replay or a state download moved the epoch) are counted apart."""
    attempted = [r for r in rounds if r["ok"] + r["failed"] > 0]
    caught_up = [r for r in rounds if r["ok"] + r["failed"] == 0]
    return {
        "round_s": median([r["seconds"] for r in attempted]),
        # the process's CPU seconds over those calls, all its threads (the round's codec, rule and
        # transport work, and the call's Adam step); not the p2pd daemon's
        "round_cpu_s": median([r["cpu_s"] for r in attempted if "cpu_s" in r]),
        # of those calls, the averaging step (matchmaking and all-reduce) and its all-reduce; the rest of
        # a call is the inner step, the outer step and whatever the strategy does around the round
        "averaging_s": median([r["averaging_s"] for r in attempted if r.get("averaging_s") is not None]),
        "allreduce_s": median([r["allreduce_s"] for r in attempted if r.get("allreduce_s") is not None]),
        "wire_s": median([max(r["bytes_sent"], r["bytes_received"]) / rate for r in attempted]) if rate else None,
        # everything the peer's link carried over those calls (the state it served, replays): the
        # round's bytes share it
        "link_s": median([max(r["link_sent"], r["link_received"]) / rate for r in attempted
                          if r.get("link_sent") is not None]) if rate else None,
        # the rounds whose link carried little beyond their own bytes (no state served, no replay):
        # what a round costs where the link is its own
        "quiet_round_s": median([r["seconds"] for r in attempted if _quiet(r)]),
        "quiet_rounds": sum(1 for r in attempted if _quiet(r)),
        "wire_sum_s": median([(r["bytes_sent"] + r["bytes_received"]) / rate for r in attempted]) if rate else None,
        "round_mb_sent": median([r["bytes_sent"] / MB for r in attempted]),
        "round_mb_received": median([r["bytes_received"] / MB for r in attempted]),
        "catch_up_calls": len(caught_up), "catch_up_s": sum(r["seconds"] for r in caught_up),
    }


QUIET_LINK = 1.15  # a quiet round's link bytes at most this many times its own (headers and acknowledgements)


def _quiet(round_: dict) -> bool:
    """Whether the link carried at most ``QUIET_LINK`` times the round's own bytes over the call, and
    no joiner fetched state or a result meanwhile (``beside_joiner``: a replay's bytes may be few, but
    serving them costs the donor CPU beside its round)."""
    if round_.get("link_sent") is None or round_.get("beside_joiner"):
        return False
    own, carried = round_["bytes_sent"] + round_["bytes_received"], round_["link_sent"] + round_["link_received"]
    return own > 0 and carried <= QUIET_LINK * own


def mark_joiner_fetches(results: list[dict]) -> None:
    """Mark every round (``beside_joiner``) whose call overlapped a span in which a joiner fetched the
    state or a round's result (its ``download["fetching"]``: wall-clock spans)."""
    spans = [span for result in results for span in (result.get("download") or {}).get("fetching", [])]
    for result in results:
        for round_ in result["rounds"]:
            if "began" in round_:
                ended = round_["began"] + round_["seconds"]
                round_["beside_joiner"] = any(began < ended and round_["began"] < end for began, end in spans)


def summarize_peer(result: dict, rate: float | None) -> dict:
    """The numbers of one peer's row (the docstring says what each is)."""
    params, baseline = result["params"], result["baseline_rss"]
    rounds = result["rounds"]
    after_first = [r["rss_before"] for r in rounds[1:]] or [r["rss_before"] for r in rounds]
    steady = median([float(v - baseline) for v in after_first])
    steps = result["steps"]
    stall, typical = (max(steps), statistics.median(steps)) if steps else (None, None)
    step_epochs = result.get("step_epochs") or []
    stall_epoch = step_epochs[steps.index(stall)] if stall is not None and len(step_epochs) == len(steps) else None
    cpu, runq = result.get("step_cpu") or [], result.get("step_runq") or []
    split = len(cpu) == len(runq) == len(steps) and steps
    blocked = [max(0.0, wall - on_cpu - waiting) for wall, on_cpu, waiting in zip(steps, cpu, runq)] if split else []
    at = steps.index(stall) if split else None
    download = result.get("download") or {}
    row = {
        "role": result["role"], "index": result["index"], "params": params, "epoch": result["epoch"],
        "stopped": result.get("stopped", False),
        "rounds_ok": result["rounds_ok"], "rounds_failed": result["rounds_failed"], **round_figures(rounds, rate),
        "steady_bytes_per_param": per_param(steady, params),
        "peak_bytes_per_param": per_param(result["peak_rss"] - baseline, params),
        "hwm_bytes_per_param": per_param(result["hwm"] - baseline, params), "peak_where": result.get("peak_where"),
        # how far RSS rose within each swarm-step call above where it started (the round's own
        # transient memory, apart from what the process held before it): the median over those calls
        "round_rise_bytes_per_param": per_param(median([r["rss_rise"] for r in rounds if "rss_rise" in r]), params),
        "baseline_rss": baseline, "daemon_rss": result["daemon_rss"], "swarm_memory": result["swarm_memory"],
        "stall_s": stall, "stall_epoch": stall_epoch, "median_step_s": typical,
        "stall_ratio": stall / typical if stall is not None and typical else None,
        "stall_cpu_s": cpu[at] if at is not None else None, "stall_runq_s": runq[at] if at is not None else None,
        "stall_blocked_s": blocked[at] if at is not None else None,
        "longest_blocked_s": max(blocked) if blocked else None,
        "median_blocked_s": statistics.median(blocked) if blocked else None,
        "median_step_cpu_s": statistics.median(cpu) if split else None,
        "state_downloads": result["state_downloads"], "enter_s": result["enter_s"],
        "download_s": download.get("download_s"), "download_bytes": download.get("download_bytes"),
        "verify_s": download.get("verify_s"),
        "rounds": rounds, "steps": len(steps),
        # every step() outside rounds in order, [epoch, seconds, on a CPU, waiting for one]: where a stall
        # came in its epoch (after a round? beside another peer's?) can be read back later
        "step_log": [[epoch, round(wall, 4), round(on_cpu, 4), round(waiting, 4)]
                     for epoch, wall, on_cpu, waiting in zip(step_epochs, steps, cpu, runq)] if split else [],
    }
    nbytes = row["download_bytes"]
    row["download_wire_s"] = nbytes / rate if rate and nbytes else None
    verify, seconds = row["verify_s"], row["download_s"]
    row["verify_share"] = verify / seconds if verify is not None and seconds else None
    return row


def summarize_case(peers: list[dict]) -> dict:
    """The case's point in the PNG: the starters' median round and wire time, the peers' median steady
    and largest peak RAM per parameter."""
    starters = [p for p in peers if p["role"] == "starter"]
    return {"round_s": median([p["round_s"] for p in starters if p["round_s"] is not None]),
            "wire_s": median([p["wire_s"] for p in starters if p.get("wire_s") is not None]),
            "steady_bytes_per_param": median([p["steady_bytes_per_param"] for p in peers
                                              if p["steady_bytes_per_param"] is not None]),
            "peak_bytes_per_param": max((p["peak_bytes_per_param"] for p in peers), default=None)}


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def memory_cell(value: dict | None) -> str:
    if not value:
        return "n/a"
    return ", ".join(f"{k}={v}" for k, v in value.items())[:40]


def state_cell(peer: dict) -> str:
    """The state's MB, and how many downloads they took where more than one."""
    if peer["download_bytes"] is None:
        return "n/a"
    count = peer["state_downloads"]
    return f"{peer['download_bytes'] / MB:.0f}" + (f" in {count}" if count > 1 else "")


COLUMNS = ("peer", "ok/failed", "round s", "quiet round s", "averaging / all-reduce s", "round cpu s", "wire s", "link s",
           "steady B/param", "peak B/param", "daemon MB",
           "swarm mem", "download s", "state MB", "state wire s", "verify", "stall s", "median step s", "stall ratio",
           "stall cpu/runq/blocked s", "blocked s")


def table_rows(record: dict) -> list[tuple[str, ...]]:
    rows = []
    for peer in record["peers"]:
        joiner = peer["role"] == "joiner"
        rows.append((
            f"{peer['role']} {peer['index']}" + (f" (stopped at {peer['epoch']})" if peer.get("stopped") else ""),
            f"{peer['rounds_ok']}/{peer['rounds_failed']}", fmt(peer["round_s"]),
            f"{fmt(peer.get('quiet_round_s'))} ({peer.get('quiet_rounds', 0)})",
            f"{fmt(peer.get('averaging_s'))} / {fmt(peer.get('allreduce_s'))}", fmt(peer.get("round_cpu_s")),
            fmt(peer["wire_s"]), fmt(peer.get("link_s")),
            fmt(peer["steady_bytes_per_param"], 1), fmt(peer["peak_bytes_per_param"], 1),
            fmt(None if peer["daemon_rss"] is None else peer["daemon_rss"] / MB, 0), memory_cell(peer["swarm_memory"]),
            fmt(peer["download_s"]) if joiner else "", state_cell(peer) if joiner else "",
            fmt(peer["download_wire_s"]) if joiner else "", fmt(peer["verify_share"]) if joiner else "",
            fmt(peer["stall_s"], 3) + (f" @{peer['stall_epoch']}" if peer.get("stall_epoch") is not None else ""), fmt(peer["median_step_s"], 3), fmt(peer["stall_ratio"], 1),
            "/".join(fmt(peer.get(key), 1) for key in ("stall_cpu_s", "stall_runq_s", "stall_blocked_s")),
            fmt(peer.get("longest_blocked_s"), 3),
        ))  # fmt: skip
    return rows


def render(record: dict, args: argparse.Namespace) -> Any:
    from rich.table import Table

    link = f"{args.mbps:g} Mbit/s up and down, {args.rtt_ms:g} ms RTT" if record["network"] == "lab" else "unshaped"
    title = (f"{record['network']} ({link}), {record['codec']}, {record['size']}: {record['layers']} x "
             f"(Linear(2048, 2048), Tanh) = {record['params']:,} parameters, DiLoCo H={record['inner_steps']}")
    if record.get("joiner_arrival") is not None:
        title += f"; the joiner came in at epoch {record['joiner_arrival']}, all ended at {record['end_epoch']}"
    if record["status"] != "ok":
        table = Table(title=title, title_justify="left", min_width=min(len(title), 160))
        table.add_column("status")
        table.add_row(record["reason"])
        return table
    table = Table(title=title, title_justify="left", caption=(
        "round s: median step() call that attempted a round; averaging / all-reduce s: of that call, the "
        "averaging step (matchmaking and all-reduce) and its all-reduce, medians; wire s: max(sent/up, received/down) of that "
        "round at the link rate; link s: all the bytes the peer's link carried over that call (state served, "
        "replays) at the link rate; quiet round s: the median of the (n) rounds whose link carried at most 1.15x "
        "their own bytes, no joiner fetching meanwhile. B/param: host RSS beyond model, gradients and Adam "
        "(steady: before each "
        "swarm step after the first, median; peak: 50 ms samples). daemon MB: the peer's p2pd. download "
        "s: the joiner's state downloads (all of them, as state MB), beside their bytes at the link rate; "
        "verify: share spent in the verification pass. stall: the longest step() outside rounds (@ the epoch it ran in), beside the median step; its "
        "seconds on a CPU, waiting for a core and blocked; blocked s: the longest wait of any step() outside rounds."))
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("peer", "swarm mem") else "right")
    for row in table_rows(record):
        table.add_row(*row)
    return table


def write_png(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rounds_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        if record["status"] == "ok":
            lines.setdefault((record["codec"], record["network"]), []).append(record)
    for (codec, network), points in sorted(lines.items()):
        points.sort(key=lambda r: r["params"])
        x = [r["params"] / 1e6 for r in points]
        label, summaries = f"{codec}, {network}", [r["summary"] for r in points]
        [line] = rounds_axis.plot(x, [s["round_s"] for s in summaries], marker="o", label=f"{label} round")
        color = line.get_color()
        if any(s.get("wire_s") is not None for s in summaries):
            rounds_axis.plot(x, [s.get("wire_s") for s in summaries], marker=".", linestyle=":", color=color,
                             label=f"{label} wire")
        memory_axis.plot(x, [s["steady_bytes_per_param"] for s in summaries], marker="o", color=color,
                         label=f"{label} steady")
        memory_axis.plot(x, [s["peak_bytes_per_param"] for s in summaries], marker="x", linestyle="--", color=color,
                         label=f"{label} peak")
    rounds_axis.set(xlabel="parameters (M)", ylabel="seconds", title="median round, and its bytes at the link rate")
    memory_axis.set(xlabel="parameters (M)", ylabel="host bytes per parameter beyond model + Adam",
                    title="swarm memory")
    for axis in (rounds_axis, memory_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def output(args: argparse.Namespace, report: dict) -> int:
    """The tables (or the JSON on stdout) and the PNG; exit status 1 if a case failed."""
    from rich.console import Console

    records = report["cases"]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.png:
        write_png(records, args.png)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console = Console(width=None if sys.stdout.isatty() else 220)
        for record in records:
            console.print(render(record, args))
    return 1 if any(record["status"] == "failed" for record in records) else 0


def rerender(paths: list[Path], args: argparse.Namespace) -> dict:
    """Saved reports as one (their cases in turn), round figures and summaries computed again by
    this version's rules."""
    reports = [json.loads(path.read_text()) for path in paths]
    report = {**reports[0], "cases": [record for each in reports for record in each["cases"]]}
    for key in ("mbps", "rtt_ms"):
        setattr(args, key, report["config"][key])
    for record in report["cases"]:
        rate = args.mbps * 1e6 / 8 if record["network"] == "lab" else None
        for peer in record["peers"]:
            peer.update(round_figures(peer["rounds"], rate))
        if record["status"] == "ok":
            record["summary"] = summarize_case(record["peers"])
    return report
