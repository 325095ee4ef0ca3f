"""One DiLoCo swarm round of the 5M-parameter model: wall time, passes over the pseudo-gradient, hivemind.

    python benchmarks/diloco_round.py [--json] [--out FILE] [--peers 4] [--rounds 5] [--inner-steps 5]
                                      [--codecs none,int8] [--systems swarmgrad,hivemind]

Every (system, codec) runs in --peers fresh processes on 127.0.0.1 (benchmarks/_harness.py).

- ``swarmgrad``: each peer builds ``fashion-mnist-large`` (5.05M params, 20.2 MB fp32) with torch seed
  0, an Adam optimizer and ``sg.Peer(..., strategy=sg.DiLoCo(inner_steps=H), averaging=
  sg.Moshpit(group_size=peers), compression=codec)``. No data: each local step sets ``p.grad`` to
  small random values (seeded per peer) and calls ``peer.step(batch_size=64)``. The ``step`` call
  that takes part in a swarm step (rounds_ok + rounds_failed or the epoch changed) is timed, its own
  local Adam step included. Epoch 0 is a warm-up, epochs 1..--rounds are measured, epoch --rounds+1
  is profiled on peer 0 (below). A round's time is its slowest peer's call (the first to start also
  waits for the others to notice); "last in" is the fastest peer's, about the averaging alone.
- ``copies``: peer 0's profiled swarm-step call under ``torch.profiler.profile(activities=[CPU],
  record_shapes=True)`` with ``profile_all_threads`` (a plain profile sees only the calling thread,
  and the peer averages on its background event-loop thread; checked with a two-thread test).
  Counted: aten ops in WRITE_OPS (data movement and elementwise arithmetic, which write a full
  result: copy_, cat, index_put, add/sub/mul/div and their in-place and out= forms, lerp, clamp,
  round, fill_/zero_, _foreach_* ...) with at least one float tensor argument (the destination
  included), on any thread, that write >= MIN_OP_BYTES and have no counted op below them in the
  call tree (so to/_to_copy/clone count once, as their copy_; a scalar wrapped by mul_ does not hide
  the mul_). Bytes written: in-place ops their first argument; out= ops their out argument; cat and
  stack the sum of their inputs; other ops their largest tensor argument. Ops under the inner
  optimizer's annotations (``Optimizer.step#InnerAdam.step`` / ``zero_grad``: local training, not the
  round) are left out; set_, views, allocations and reductions (aminmax, amax, norm: small outputs)
  are not copies. ``copies`` = bytes written / bytes of one fp32 copy of the model; ``ops`` = how
  many. Not visible to the profiler, so not counted: numpy work (the int8 decoder multiplies in
  numpy), ``.tobytes()``/``bytes()`` copies and socket I/O; for lossy codecs copies is a lower bound.
  The JSON's copies_detail has the split by op, the share written on the thread that called step(),
  outermost ops over >= 1% of the model that were not counted (reductions), and the round's attempts.
- ``hivemind``: the same parameter tensors (plus per-peer noise) averaged by
  ``hivemind.averaging.DecentralizedAverager`` in a group of all peers, rounds started on a barrier;
  the reference. hivemind/swarmgrad = hivemind median / swarmgrad median, per codec.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; inherited by every peer
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from _harness import MB, GroupFailed, PeerContext, fmt, log, patch_hivemind_quantization, run_group, start_hivemind_dht
from rich.console import Console
from rich.table import Table

TASK = "fashion-mnist-large"
GRAD_SETS = 3  # random gradients drawn once per peer and cycled: drawing 5M values per step costs more than Adam
MIN_OP_BYTES = 4096  # smaller writes: scalars, int8 block scales, the smallest biases (< 0.1% of the bytes)
ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "signed char": 1, "unsigned char": 1,
            "bool": 1, "short": 2, "int": 4, "long int": 8}
FLOATS = {"float", "double", "c10::Half", "c10::BFloat16", "TensorList"}  # TensorList: assumed float32
WRITE_OPS = {  # plus every _foreach_* op
    "copy_", "cat", "stack", "index_put_", "_index_put_impl_", "index_copy_", "masked_fill_", "masked_scatter_",
    "where", "fill_", "zero_", "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "neg_",
    "abs", "abs_", "sign", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "round",
    "round_", "floor", "floor_", "sqrt", "sqrt_", "reciprocal", "pow", "pow_", "lerp", "lerp_", "addcmul",
    "addcmul_", "addcdiv", "addcdiv_", "maximum", "minimum", "nan_to_num", "nan_to_num_"
}
NO_DATA = {  # views, metadata and no-op casts: they move no data
    "to", "as_strided", "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "narrow", "select", "detach",
    "alias", "resolve_conj", "resolve_neg", "expand", "squeeze", "unsqueeze", "t", "transpose", "permute", "flatten",
    "unflatten", "split", "split_with_sizes", "chunk", "unbind", "view_as", "set_", "lift_fresh"
}
SYSTEMS = ("swarmgrad", "hivemind")
CODECS_HIVEMIND = {"none": "NoCompression", "fp16": "Float16Compression", "int8": "Uniform8BitQuantization"}


class InnerAdam(torch.optim.Adam):
    """Adam under its own name: the profiler labels its step ``Optimizer.step#InnerAdam.step``."""


@dataclass
class Config:  # what every peer of one (system, codec) run needs; picklable
    peers: int
    rounds: int
    inner_steps: int
    codec: str
    round_timeout: float = 60.0


@dataclass
class Row:
    system: str
    codec: str
    round_s: float | None = None  # median over measured rounds of the slowest peer's swarm-step call
    last_in_s: float | None = None  # the same for the fastest peer
    rounds_s: list[float] = field(default_factory=list)
    rounds_ok: int = 0  # peer-rounds, over the measured rounds
    rounds_failed: int = 0
    mb_sent: float | None = None  # per peer per round (max over peers, median over rounds), MB = 10^6 bytes
    copies: float | None = None
    ops: int | None = None
    copies_detail: dict | None = None
    hivemind_over_swarmgrad: float | None = None
    swarmgrad_file: str | None = None  # where the peers imported swarmgrad from
    error: str | None = None


# ---------------------------------------------------------------- counting copies


def _profiler() -> Any:
    """A CPU profile of every thread of this process (torch >= 2.6; the peer averages on its own thread)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    threads = _ExperimentalConfig(profile_all_threads=True, capture_overload_names=True)
    return profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=threads)


def _tensor_args(event: Any) -> list[tuple[int, str]]:
    """(bytes, dtype) of each tensor argument; a TensorList is one entry with its tensors' total."""
    shapes = getattr(event, "structured_input_shapes", None) or event.input_shapes
    args = []
    for shape, dtype in zip(shapes, event.input_dtypes):
        if dtype == "TensorList":
            args.append((sum(math.prod(s) * 4 for s in shape if isinstance(s, list)), dtype))
        elif dtype in ITEMSIZE and all(isinstance(d, int) for d in shape):
            args.append((math.prod(shape) * ITEMSIZE[dtype], dtype))
    return args


def _written(event: Any) -> int:
    """Bytes the op writes, or 0 if it is not a counted kind (see the docstring)."""
    if not event.name.startswith("aten::"):
        return 0
    base = event.name[len("aten::"):]
    if base not in WRITE_OPS and not base.startswith("_foreach_"):
        return 0
    args = _tensor_args(event)
    if not args or not any(dtype in FLOATS for _, dtype in args):
        return 0
    if base.endswith("_"):
        return args[0][0]
    if "out" in (getattr(event, "overload_name", "") or ""):
        return args[-1][0]
    if base in ("cat", "stack"):
        return sum(size for size, _ in args)
    return max(size for size, _ in args)


def count_copies(prof: Any, model_bytes: int) -> dict:
    events = list(prof.events())
    skip = ("Optimizer.step#InnerAdam.", "Optimizer.zero_grad#InnerAdam.")

    def excluded(event: Any) -> bool:
        while event is not None:
            if event.name.startswith(skip):
                return True
            event = event.cpu_parent
        return False

    qualifying = {id(e): size for e in events if (size := _written(e)) >= MIN_OP_BYTES and not excluded(e)}

    def below(event: Any) -> bool:
        return any(id(c) in qualifying or below(c) for c in event.cpu_children)

    caller = next((e.thread for e in events if e.name.startswith(skip[0])), None)  # the thread calling step()
    by_op: dict[str, list[int]] = {}
    uncounted: dict[str, int] = {}
    total = ops = on_caller = 0
    for event in events:
        if id(event) in qualifying and not below(event):
            size = qualifying[id(event)]
            total, ops, on_caller = total + size, ops + 1, on_caller + size * (event.thread == caller)
            entry = by_op.setdefault(event.name, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + size
        elif (event.name.startswith("aten::") and event.name[6:] not in NO_DATA and id(event) not in qualifying
              and not (event.cpu_parent and event.cpu_parent.name.startswith("aten::")) and not below(event)
              and not excluded(event)
              and any(size >= model_bytes // 100 for size, dtype in _tensor_args(event) if dtype in FLOATS)):
            uncounted[event.name] = uncounted.get(event.name, 0) + 1  # outermost ops over the buffer: reductions
    return {"copies": total / model_bytes, "ops": ops, "bytes_written": total, "model_bytes": model_bytes,
            "share_on_calling_thread": on_caller / total if total and caller is not None else None,
            "by_op": {name: {"ops": n, "copies": size / model_bytes}
                      for name, (n, size) in sorted(by_op.items(), key=lambda kv: -kv[1][1])},
            "uncounted_large_ops": uncounted}


# ---------------------------------------------------------------- peers


def swarmgrad_peer(ctx: PeerContext, cfg: Config) -> dict:
    import swarmgrad as sg
    from swarmgrad.tasks import get_task

    if ctx.rank == 0:
        log(f"peer 0 imports swarmgrad from {sg.__file__}")
    torch.manual_seed(0)
    model = get_task(TASK).make_model()
    params = list(model.parameters())
    model_bytes = sum(p.numel() * 4 for p in params)
    optimizer = InnerAdam(params, lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + ctx.rank)
    grads = [[torch.randn(p.shape, generator=generator).mul_(1e-3) for p in params] for _ in range(GRAD_SETS)]
    initial = [] if ctx.rank == 0 else ctx.exchange(None)[0]
    peer = sg.Peer(model, optimizer, run_id=f"bench-diloco-{cfg.codec}", initial_peers=initial,
                   strategy=sg.DiLoCo(inner_steps=cfg.inner_steps), averaging=sg.Moshpit(group_size=cfg.peers),
                   compression=cfg.codec, network=sg.NodeConfig(host="127.0.0.1"))
    records: list[dict] = []
    copies: dict | None = None
    with peer:
        if ctx.rank == 0:
            ctx.exchange(peer.maddrs)
        present = peer.wait_for_peers(cfg.peers, 60)
        ctx.sync()
        deadline, step = time.monotonic() + cfg.round_timeout * (cfg.rounds + 2), 0
        while peer.epoch < cfg.rounds + 2:  # warm-up, measured rounds, the profiled round
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {ctx.rank} reached epoch {peer.epoch} of {cfg.rounds + 2} in time")
            profiling = ctx.rank == 0 and peer.epoch == cfg.rounds + 1
            for param, grad in zip(params, grads[step % GRAD_SETS]):
                param.grad = grad  # what backward() would leave: small random values, no compute
            step += 1
            before, epoch = peer.status(), peer.epoch
            with _profiler() if profiling else contextlib.nullcontext() as prof:
                started = time.perf_counter()
                peer.step(batch_size=64)
                seconds = time.perf_counter() - started
            after = peer.status()
            attempts = after.rounds_ok + after.rounds_failed - before.rounds_ok - before.rounds_failed
            if attempts or peer.epoch != epoch:  # this call took part in a swarm step (or caught up)
                records.append({"epoch": epoch, "seconds": seconds, "ok": after.rounds_ok - before.rounds_ok,
                                "attempts": attempts, "bytes_sent": after.bytes_sent - before.bytes_sent})
                if profiling:  # the attempts show whether the profile holds one round or retries too
                    copies = {**count_copies(prof, model_bytes), "attempts": attempts, "ok": records[-1]["ok"]}
        ctx.sync()  # nobody leaves while a groupmate may still be finishing the last round with it
    return {"rounds": records, "copies": copies, "present": present, "swarmgrad": sg.__file__}


def hivemind_peer(ctx: PeerContext, cfg: Config) -> dict:
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # hivemind forks its DHT and averager processes
    import hivemind.compression
    from hivemind.averaging import DecentralizedAverager

    from swarmgrad.tasks import get_task

    patch_hivemind_quantization()
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1000 + ctx.rank)
    tensors = [p.detach().clone().add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
               for p in get_task(TASK).make_model().parameters()]
    dht, averager = start_hivemind_dht(ctx), None
    try:
        averager = DecentralizedAverager(
            tensors, dht, start=True, prefix=f"bench-diloco-{cfg.codec}", target_group_size=cfg.peers,
            min_group_size=cfg.peers, min_matchmaking_time=2.0, request_timeout=1.0,
            allreduce_timeout=cfg.round_timeout,
            compression=getattr(hivemind.compression, CODECS_HIVEMIND[cfg.codec])(),
        )  # fmt: skip  (as benchmarks/allreduce.py: a full group starts at once)
        ctx.sync()
        seconds, oks = [], []
        for _ in range(cfg.rounds + 1):  # one warm-up round, then the measured ones
            ctx.sync()
            started = time.perf_counter()
            gathered = averager.step(timeout=cfg.round_timeout)
            seconds.append(time.perf_counter() - started)
            oks.append(gathered is not None and len(gathered) == cfg.peers)
        ctx.sync()
        return {"seconds": seconds[1:], "oks": oks[1:]}
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


# ---------------------------------------------------------------- running systems


def run_system(system: str, cfg: Config) -> Row:
    row = Row(system, cfg.codec)
    target = swarmgrad_peer if system == "swarmgrad" else hivemind_peer
    log(f"{system}/{cfg.codec}: {cfg.peers} peers, {cfg.rounds} rounds + warm-up")
    started = time.monotonic()
    try:
        results = run_group(target, cfg, cfg.peers, deadline_s=120 + (cfg.rounds + 2) * 30, wait_s=120)
    except GroupFailed as error:
        row.error = str(error)
        log(f"{system}/{cfg.codec} failed after {time.monotonic() - started:.0f} s: {error}")
        return row
    if system == "hivemind":
        per_round = list(zip(*(r["seconds"] for r in results)))
        row.rounds_s, row.last_in_s = [max(t) for t in per_round], statistics.median(min(t) for t in per_round)
        row.rounds_ok = sum(sum(r["oks"]) for r in results)
        row.rounds_failed = sum(len(r["oks"]) - sum(r["oks"]) for r in results)
    else:
        measured = range(1, cfg.rounds + 1)
        by_epoch = [{rec["epoch"]: rec for rec in r["rounds"]} for r in results]
        common = [e for e in measured if all(e in recs for recs in by_epoch)]
        if not common:
            row.error = "no measured round on every peer"
            return row
        row.rounds_s = [max(recs[e]["seconds"] for recs in by_epoch) for e in common]
        row.last_in_s = statistics.median(min(recs[e]["seconds"] for recs in by_epoch) for e in common)
        row.mb_sent = statistics.median(max(recs[e]["bytes_sent"] for recs in by_epoch) for e in common) / MB
        picked = [recs[e] for recs in by_epoch for e in measured if e in recs]
        row.rounds_ok = sum(rec["ok"] for rec in picked)
        row.rounds_failed = sum(rec["attempts"] - rec["ok"] for rec in picked)
        row.swarmgrad_file = results[0]["swarmgrad"]
        if (copies := results[0]["copies"]) is not None:
            row.copies, row.ops, row.copies_detail = copies["copies"], copies["ops"], copies
    row.rounds_s = [round(s, 4) for s in row.rounds_s]
    row.round_s = statistics.median(row.rounds_s)
    log(f"{system}/{cfg.codec}: median {row.round_s:.3f} s per round after {time.monotonic() - started:.0f} s")
    return row


def render(rows: list[Row], args: argparse.Namespace, wall_s: float) -> Table:
    table = Table(
        title=f"One DiLoCo round of {TASK}: {args.peers} peers, H={args.inner_steps}, {args.rounds} rounds",
        caption=("round s: the slowest peer's swarm-step call, median; last in: the fastest peer's. ok/failed: "
                 "peer-rounds. MB sent: per peer per round. copies: bytes written by data-movement ops in peer 0's "
                 f"swarm step / one fp32 model copy (see the docstring). Wall time {wall_s:.0f} s."),
    )  # fmt: skip
    headers = ("system", "codec", "round s", "last in s", "ok/failed", "MB sent", "copies", "ops", "hivemind/\nswarmgrad", "note")
    for header in headers:
        table.add_column(header, justify="left" if header in ("system", "codec", "note") else "right")
    for row in rows:
        table.add_row(row.system, row.codec, fmt(row.round_s, 3), fmt(row.last_in_s, 3),
                      f"{row.rounds_ok}/{row.rounds_failed}", fmt(row.mb_sent, 1), fmt(row.copies, 2),
                      "-" if row.ops is None else str(row.ops), fmt(row.hivemind_over_swarmgrad, 2),
                      f"[red]{row.error}[/red]" if row.error else "")  # fmt: skip
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds, after one warm-up round")
    parser.add_argument("--inner-steps", type=int, default=5, help="DiLoCo H: local steps between rounds")
    parser.add_argument("--codecs", default="none,int8")
    parser.add_argument("--systems", default="swarmgrad,hivemind")
    args = parser.parse_args(argv)
    args.codecs = [c for c in args.codecs.split(",") if c]
    args.systems = [s for s in args.systems.split(",") if s]
    for kind, names, known in (("codec", args.codecs, CODECS_HIVEMIND), ("system", args.systems, SYSTEMS)):
        if unknown := [name for name in names if name not in known]:
            parser.error(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    if args.peers < 2 or args.rounds < 1 or args.inner_steps < 1:
        parser.error("need --peers >= 2, --rounds >= 1 and --inner-steps >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, started_at, load = time.monotonic(), time.strftime("%Y-%m-%d %H:%M:%S %z"), os.getloadavg()
    rows = [run_system(system, Config(args.peers, args.rounds, args.inner_steps, codec))
            for system in args.systems for codec in args.codecs]
    medians = {(row.system, row.codec): row.round_s for row in rows}
    for row in rows:
        theirs = medians.get(("hivemind", row.codec))
        if row.system == "swarmgrad" and row.round_s and theirs:
            row.hivemind_over_swarmgrad = theirs / row.round_s
    ratios = {row.codec: row.hivemind_over_swarmgrad for row in rows if row.system == "swarmgrad"}
    wall_s = time.monotonic() - started
    config = {key: getattr(args, key) for key in ("peers", "rounds", "inner_steps", "codecs", "systems")}
    report = {"config": {**config, "task": TASK}, "started_at": started_at, "loadavg_start": load,
              "loadavg_end": os.getloadavg(), "rows": [asdict(row) for row in rows],
              "hivemind_over_swarmgrad": ratios, "wall_s": wall_s}  # fmt: skip
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
    else:  # piped or captured: do not squeeze the table into 80 columns
        Console(width=None if sys.stdout.isatty() else 160).print(render(rows, args, wall_s))
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
