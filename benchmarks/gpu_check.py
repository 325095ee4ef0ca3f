"""The prepared check for a machine with a CUDA GPU: is the device boundary the right placement, and
do two peers sharing the GPU in a swarm train as fast as the same two processes alone?

    python benchmarks/gpu_check.py [--json [FILE]] [--seconds 60] [--inner-steps 200] [--overlap on]

Runs on a GPU machine with torch (CUDA build) and no network, from a copy of this tree: nothing here
needs swarmgrad installed, and the parts that need its network stack (hivemind, p2pd, typer,
pydantic) are skipped, saying why, when those are missing. About 5 minutes; the parts together stay
under 8. Without a GPU it says so in one line and exits 0.

(a) **Placement**, on ~100M parameters of fp32 laid out as a GPT's (12 blocks of width 768): what
    one DiLoCo round's copies cost (bytes and seconds, median of a few) for
    - the device boundary (device/boundary.py): 4 B/param down and 4 up, in 32 MiB pieces through
      two pinned buffers on a side stream, consumed into a host flat buffer as the policy does;
    - naive per-parameter pageable ``.cpu()`` down and ``.copy_()`` up (the same 8 B/param), and the
      path as it was at 670d8d2 (16 B/param down: parameters twice and Adam's two moments; 4 up);
    - encoding int8 on the device before the copy (absmax per 1024-block, the int8 codec's format):
      1 B/param (+4 B per block) down, but the pseudo-gradient needs the outer start on the device:
      4 B/param up each round, or 4 B/param of GPU memory kept; the result goes up (4 B/param) either
      way. Beside it, the host's int8 encode that the boundary's path runs after its copy.
(b) **Compute utilisation**: 2 ``swarmgrad peer`` processes on this GPU (``--device cuda``, DiLoCo,
    ``--compression q2``, the ``lm`` task at size base (128M) if this tree has it, else ``charlm``
    at 12 x 768 (~85M)) train alone, each its own run, at the same time; then the same 2 in one
    swarm on loopback with a bootstrap node. Samples/s of each over the window all of them trained
    in; utilisation = swarm / alone (target >= 0.95).
(c) **Per round**, from the swarm peers' events: bytes that crossed the device boundary
    (``status.device_bytes``) beside the encoded bytes sent, round seconds, the precision and
    micro-batch ``auto`` picked (``ready``), peak GPU memory (``done``).

``--device cpu`` rehearses every part on the CPU (small sizes: ``--params``, ``--task digits``), so
the tests here run the same code the GPU machine will.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tree travels to the GPU machine: swarmgrad need not be installed
BLOCK = 1024  # the int8 codec's default block
TARGET_UTILISATION = 0.95
MB = 1e6


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- (a) placement

def gpt_shapes(width: int = 768, blocks: int = 12, vocab: int = 16384, context: int = 1024) -> list[tuple[int, ...]]:
    """A GPT's parameter shapes (embeddings, per block: norms, qkv, projection, MLP; final norm):
    about 98M parameters in 150 tensors at the defaults, so per-tensor costs count as they would."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(blocks):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


def shapes_for(params: int) -> list[tuple[int, ...]]:
    """GPT shapes scaled to about ``params`` parameters (the width shrinks, the layout stays)."""
    width = 768
    while width > 8 and sum(math.prod(s) for s in gpt_shapes(width)) > 1.05 * params:
        width -= 8
    return gpt_shapes(width)


def int8_encode(flat: Any) -> tuple[Any, Any]:
    """Absmax int8 per block of ``BLOCK`` on whatever device ``flat`` sits (the int8 codec's math:
    scale = max(absmax, 2^-100) / 127, q = round(x / scale)); returns (codes, scales)."""
    import torch

    numel = flat.numel()
    whole = numel - numel % BLOCK
    pieces = [flat[:whole].view(-1, BLOCK)] if whole else []
    if whole < numel:
        pieces.append(flat[whole:].view(1, -1))
    codes, scales = [], []
    for piece in pieces:
        largest = piece.abs().amax(dim=1).clamp_min_(2.0**-100)
        codes.append((piece * (127.0 / largest).unsqueeze(1)).round_().to(torch.int8).view(-1))
        scales.append(largest / 127.0)
    return torch.cat(codes), torch.cat(scales)


def _median_seconds(run: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    run()  # warm: pinned buffers, CUDA contexts and kernels are made on first use
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def placement(device_name: str, params: int, repeats: int = 3) -> dict[str, Any]:
    """Bytes and seconds of one round's copies, per placement (see the module docstring)."""
    import torch

    from swarmgrad.device.boundary import CHUNK_BYTES, DeviceBoundary

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # as the peer's parameters name it
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    shapes = shapes_for(params)
    generator = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(shape, generator=generator) * 0.02).to(device) for shape in shapes]
    moments = [[torch.zeros_like(t) for t in tensors] for _ in range(2)]  # Adam's, for the 670d8d2 path
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(numel)  # the host's flat buffer (the policy's layout), pageable as it is there
    start = torch.randn(numel, generator=generator) * 0.02  # the outer start, on the host
    start_pinned = start.pin_memory() if cuda else start
    boundary = DeviceBoundary(device)
    rows: list[dict[str, Any]] = []

    def row(name: str, down: float, up: float, seconds: float, note: str) -> None:
        rows.append({"placement": name, "down_bytes": int(down), "up_bytes": int(up), "seconds": seconds,
                     "bytes_per_param": (down + up) / numel, "note": note})

    def boundary_read() -> None:
        boundary.read(tensors, lambda offset, chunk: flat[offset:offset + len(chunk)].copy_(chunk))

    def boundary_write() -> None:
        boundary.write(tensors, lambda offset, count: flat[offset:offset + count])

    read_s = _median_seconds(boundary_read, sync, repeats)
    write_s = _median_seconds(boundary_write, sync, repeats)
    row("boundary (pinned, chunked, side stream)", 4 * numel, 4 * numel, read_s + write_s,
        f"read {read_s:.3f} s + write {write_s:.3f} s; no second model-sized buffer on the device")

    host = [t.detach().cpu() for t in tensors]

    def naive_read() -> None:
        for index, t in enumerate(tensors):
            host[index] = t.detach().cpu()

    def naive_write() -> None:
        for t, values in zip(tensors, host):
            t.copy_(values)

    naive_s = _median_seconds(naive_read, sync, repeats) + _median_seconds(naive_write, sync, repeats)
    row("naive per parameter (pageable .cpu()/.copy_())", 4 * numel, 4 * numel, naive_s,
        f"{len(tensors)} tensors, one synchronous copy each way")

    def old_read() -> None:  # parameters for the pseudo-gradient, then parameters and moments for the snapshot
        for group in (tensors, tensors, *moments):
            for t in group:
                t.detach().cpu()

    old_s = _median_seconds(old_read, sync, repeats) + _median_seconds(naive_write, sync, repeats)
    row("as at 670d8d2 (16 down, 4 up, per parameter)", 16 * numel, 4 * numel, old_s,
        "the pseudo-gradient's read and the per-round snapshot's (parameters and Adam's moments)")

    blocks = math.ceil(numel / BLOCK)
    chunk = max(BLOCK, (CHUNK_BYTES // 4) // BLOCK * BLOCK)  # whole blocks per piece: the frames match the codec's
    codes_host = torch.empty(numel, dtype=torch.int8, pin_memory=cuda)
    scales_host = torch.empty(blocks, dtype=torch.float32, pin_memory=cuda)
    device_flat = torch.cat([t.reshape(-1) for t in tensors])  # encode reads it in pieces (a GPT's own flat buffer)
    kept_start = start.to(device)

    def encode_on_device(send_start: bool) -> None:
        for offset in range(0, numel, chunk):
            count = min(chunk, numel - offset)
            if send_start:
                begin = start_pinned[offset:offset + count].to(device, non_blocking=True)
            else:
                begin = kept_start[offset:offset + count]
            codes, scales = int8_encode(begin - device_flat[offset:offset + count])
            codes_host[offset:offset + count].copy_(codes, non_blocking=True)
            scales_host[offset // BLOCK:offset // BLOCK + scales.numel()].copy_(scales, non_blocking=True)

    encoded_down = numel + 4 * blocks
    sent_s = _median_seconds(lambda: encode_on_device(True), sync, repeats)
    row("int8 on the device, start sent up", encoded_down, 8 * numel, sent_s + write_s,
        f"encode+copy {sent_s:.3f} s (start 4 B/param up each round) + the boundary's write")
    kept_s = _median_seconds(lambda: encode_on_device(False), sync, repeats)
    row("int8 on the device, start kept on it", encoded_down, 4 * numel, kept_s + write_s,
        f"encode+copy {kept_s:.3f} s + write; +4 B/param of GPU memory ({4 * numel / 2**30:.2f} GiB here)")

    host_encode_s, codec_used = _host_int8_seconds(flat, start, repeats)
    row("boundary read + int8 on the host (today's path)", 4 * numel, 4 * numel, read_s + host_encode_s + write_s,
        f"host encode {host_encode_s:.3f} s with {codec_used}, after the boundary's read")
    matches = _codes_agree(device_flat, start, codes_host, scales_host, numel)  # the last encode: start kept
    return {"params": numel, "tensors": len(tensors), "device": str(device), "rows": rows,
            "device_codes_equal_host_codec": matches}


def _host_int8_seconds(flat: Any, start: Any, repeats: int) -> tuple[float, str]:
    """Seconds the host takes to form and int8-encode the pseudo-gradient (the codec's own code where
    it imports, else the same math in torch)."""
    try:
        from swarmgrad.averaging.codecs import get_codec

        codec = get_codec("int8")
        return _median_seconds(lambda: codec.encode(start - flat), lambda: None, repeats), "the int8 codec"
    except ImportError:
        return _median_seconds(lambda: int8_encode(start - flat), lambda: None, repeats), "torch (codecs not importable)"


def _codes_agree(device_flat: Any, start: Any, codes_host: Any, scales_host: Any, numel: int) -> float | None:
    """Share of the device's int8 codes equal to the host codec's for the same values, its scales
    equal too (the codec's frames from the device's bytes); None where the codec does not import."""
    try:
        import numpy as np

        from swarmgrad.averaging.codecs import get_codec
    except ImportError:
        return None
    count = min(numel, 1 << 20)
    encoded = get_codec("int8").encode(start[:count] - device_flat[:count].cpu())
    blocks = math.ceil(count / BLOCK)
    if encoded.parts["scale"] != scales_host[:blocks].numpy().tobytes():
        return 0.0
    return float((np.frombuffer(encoded.parts["q"], dtype=np.int8) == codes_host[:count].numpy()).mean())


# ---------------------------------------------------------------- (b), (c) two peers on one GPU

class PeerRun:
    """One ``swarmgrad`` process: JSON events from stdout (read on a thread), stderr to a file, its own
    session so it and its p2pd are ended together."""

    def __init__(self, argv: list[str], name: str, folder: Path):
        self.name, self.err_path = name, folder / f"{name}.err"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.err_path, "w") as err:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                            text=True, env=env, start_new_session=True)
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    self.events.append(event)

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((event for event in self.events if event.get("event") == kind), None)

    def wait_line(self, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.lines and self.process.poll() is None:
            time.sleep(0.1)
        if not self.lines:
            raise RuntimeError(f"{self.name} printed nothing: {self.stderr_tail()}")
        return self.lines[0]

    def wait(self, seconds: float) -> None:
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            self.stop()
        self._reader.join(5)

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        with contextlib.suppress(ProcessLookupError):  # what it left in its session (p2pd)
            os.killpg(self.process.pid, signal.SIGKILL)

    def stderr_tail(self, lines: int = 8) -> str:
        return " | ".join(self.err_path.read_text(errors="replace").splitlines()[-lines:])


def swarm_ready(task: str) -> tuple[bool, str, dict[str, Any] | None]:
    """Whether ``swarmgrad peer`` can run here: ``swarmgrad doctor --json --task TASK`` answers (it
    imports what a peer needs but hivemind, and probes the task's micro-batch at its default size)
    and p2pd is found. Returns (ok, why not, doctor's report)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-m", "swarmgrad", "doctor", "--json", "--task", task], capture_output=True,
                              text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        return False, "swarmgrad doctor took over 90 s", None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"swarmgrad's dependencies are missing here ({last})", None
    report = json.loads(done.stdout)
    if not report["p2pd"]["found"]:
        return False, f"p2pd not found ({report['p2pd']['note']})", report
    try:
        import hivemind  # noqa: F401  (doctor finds p2pd without importing it)
    except ImportError as error:
        return False, f"hivemind does not import: {error}", report
    return True, "", report


def pick_task(requested: str | None) -> tuple[str, list[str]]:
    """The task and its options: ``lm`` at size base when this tree has it, else charlm at 12 x 768."""
    if requested:
        return requested, []
    from swarmgrad.tasks.registry import find_tasks

    if "lm" in find_tasks():
        return "lm", ["--task-option", "size=base"]
    return "charlm", ["--task-option", "dim=768", "--task-option", "layers=12", "--task-option", "heads=12",
                      "--task-option", "context=256"]


def peer_argv(args: argparse.Namespace, task: str, options: list[str], run_id: str, shard: int,
              join: list[str] | None) -> list[str]:
    argv = [sys.executable, "-m", "swarmgrad", "peer", task, *options, "--run-id", run_id, "--json",
            "--device", args.device, "--strategy", "diloco", "--compression", args.compression,
            "--inner-steps", str(args.inner_steps), "--overlap", args.overlap, "--max-seconds", str(args.seconds),
            "--eval-every", "0", "--no-final-eval", "--num-shards", "2", "--shard", str(shard), "--wait", "120"]
    if args.device == "cpu":
        argv += ["--threads", "1"]
    if join is None:
        return argv + ["--create"]  # a run of its own: it trains alone
    return argv + ["--initial-peers", *join, "--wait-peers", "2"]


def run_phase(args: argparse.Namespace, task: str, options: list[str], swarm: bool, folder: Path) -> list[PeerRun]:
    """Two peers, alone (each its own run) or in one swarm through a bootstrap node; all on loopback."""
    tag = "swarm" if swarm else "alone"
    started: list[PeerRun] = []
    try:
        join = None
        if swarm:
            bootstrap = PeerRun([sys.executable, "-m", "swarmgrad", "bootstrap", "--host", "127.0.0.1"],
                                "bootstrap", folder)
            started.append(bootstrap)
            join = [bootstrap.wait_line(60).strip()]
        run_id = f"gpu-check-{os.getpid()}"
        peers = [PeerRun(peer_argv(args, task, options, run_id if swarm else f"{run_id}-{tag}{shard}", shard, join),
                         f"{tag}{shard}", folder) for shard in range(2)]
        started += peers
        deadline = min(time.monotonic() + args.seconds + args.start_seconds, args.deadline)
        for peer in peers:
            peer.wait(max(1.0, deadline - time.monotonic()))
        for peer in peers:
            if peer.first("done") is None:
                raise RuntimeError(f"{peer.name} ended without a done event (exit {peer.process.returncode}): "
                                   f"{peer.stderr_tail()}")
        return peers
    finally:
        for process in reversed(started):
            process.stop()


def common_window(peers: list[PeerRun], skip: float) -> tuple[float, float]:
    """The wall-clock window every peer trained in: from the last ``ready`` (plus ``skip`` seconds of
    warm-up) to the first ``done``."""
    begin = max(peer.first("ready")["t"] for peer in peers) + skip
    end = min(peer.first("done")["t"] for peer in peers)
    return begin, end


def sample_series(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(wall time, samples trained so far) from a peer's events: 0 at ``ready``, each ``progress``
    (every second, while the training loop runs), and ``done``'s final count."""
    series = []
    for event in events:
        kind = event.get("event")
        if kind == "ready":
            series.append((event["t"], 0))
        elif kind == "progress" and "samples" in event:
            series.append((event["t"], event["samples"]))
        elif kind == "done":
            series.append((event["t"], event["status"]["samples"]))
    return sorted(series)


def samples_at(series: list[tuple[float, int]], t: float) -> float | None:
    """Samples at time ``t``, linear between the two points around it (a round may hold the loop, and
    its progress events, for seconds); None outside the series."""
    for (t0, s0), (t1, s1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return None


def rate_in_window(events: list[dict[str, Any]], begin: float, end: float) -> float | None:
    """Samples per second a peer trained between ``begin`` and ``end``."""
    series = sample_series(events)
    first, last = samples_at(series, begin), samples_at(series, end)
    if first is None or last is None or end <= begin:
        return None
    return (last - first) / (end - begin)


def summarise(peers: list[PeerRun], skip: float) -> dict[str, Any]:
    begin, end = common_window(peers, skip)
    rows = []
    for peer in peers:
        ready, done = peer.first("ready"), peer.first("done")
        status = done["status"]
        epochs = max(1, status["epoch"])
        report = status.get("last_report") or {}
        rows.append({
            "peer": peer.name, "samples_per_second": rate_in_window(peer.events, begin, end),
            "device": ready["device"], "precision": ready["precision"], "micro_batch": ready["micro_batch"],
            "steps": status["step"], "epochs": status["epoch"], "rounds_ok": status["rounds_ok"],
            "rounds_failed": status["rounds_failed"], "rounds_overlapped": status["rounds_overlapped"],
            "solo_steps": status["solo_steps"], "bytes_sent_per_round": status["bytes_sent"] / max(1, status["rounds_ok"]),
            "device_bytes_per_epoch": status.get("device_bytes", 0) / epochs,
            "round_seconds": report.get("seconds"), "allreduce_seconds": report.get("allreduce_seconds"),
            "peak_device_memory": done.get("peak_device_memory"),
        })
    rates = [row["samples_per_second"] for row in rows]
    return {"window_seconds": end - begin, "peers": rows,
            "samples_per_second": sum(rates) if all(rate is not None for rate in rates) else None}


def swarm_check(args: argparse.Namespace) -> dict[str, Any]:
    try:
        task, options = pick_task(args.task)
    except ImportError as error:
        why = f"swarmgrad's tasks do not import here ({error})"
        log(f"skipping the two-peer check: {why}")
        return {"skipped": why}
    ok, why, doctor = swarm_ready(task)
    if not ok:
        log(f"skipping the two-peer check: {why}")
        return {"skipped": why}
    log(f"two peers on {args.device}: task {' '.join([task, *options[1::2]])}, {args.seconds:g} s alone, then in a swarm")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as temp:
        folder = Path(temp)
        try:
            alone = summarise(run_phase(args, task, options, swarm=False, folder=folder), args.skip_seconds)
            log(f"alone: {alone['samples_per_second']} samples/s in all")
            if args.deadline - time.monotonic() < args.seconds + 60:
                raise RuntimeError(f"no time left for the swarm phase within --budget {args.budget:g} s")
            together = summarise(run_phase(args, task, options, swarm=True, folder=folder), args.skip_seconds)
            log(f"in a swarm: {together['samples_per_second']} samples/s in all")
        except RuntimeError as error:
            log(f"the two-peer check failed: {error}")
            return {"failed": str(error), "task": task, "options": options}
    utilisation = (together["samples_per_second"] / alone["samples_per_second"]
                   if together["samples_per_second"] and alone["samples_per_second"] else None)
    return {"task": task, "options": options, "compression": args.compression, "inner_steps": args.inner_steps,
            "overlap": args.overlap, "alone": alone, "swarm": together, "utilisation": utilisation,
            "target": TARGET_UTILISATION, "doctor": doctor}


# ---------------------------------------------------------------- report

def gpu_facts(device_name: str) -> dict[str, Any] | None:
    """The GPU and torch build, or None when there is no usable GPU."""
    import torch

    if device_name == "cpu":
        return {"name": "cpu (rehearsal)", "torch": torch.__version__}
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "capability": f"{major}.{minor}", "total_bytes": total,
            "free_bytes": free, "bf16": torch.cuda.is_bf16_supported(), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def table(report: dict[str, Any]) -> str:
    lines = [f"gpu_check on {report['gpu']['name']} (torch {report['gpu']['torch']})"]
    place = report.get("placement")
    if place:
        lines += ["", f"(a) one DiLoCo round's copies, {place['params'] / 1e6:.1f}M parameters in {place['tensors']} tensors",
                  f"{'placement':<50} {'down MB':>9} {'up MB':>8} {'B/param':>8} {'seconds':>8}  note"]
        for row in place["rows"]:
            lines.append(f"{row['placement']:<50} {row['down_bytes'] / MB:>9.1f} {row['up_bytes'] / MB:>8.1f} "
                         f"{row['bytes_per_param']:>8.2f} {row['seconds']:>8.3f}  {row['note']}")
        if place.get("device_codes_equal_host_codec") is not None:
            lines.append(f"device int8 codes equal to the host codec's: {place['device_codes_equal_host_codec']:.4%}")
    swarm = report.get("two_peers", {})
    if "skipped" in swarm or "failed" in swarm:
        lines += ["", f"(b, c) two peers: {'skipped' if 'skipped' in swarm else 'FAILED'}: "
                      f"{swarm.get('skipped') or swarm.get('failed')}"]
    elif swarm:
        lines += ["", f"(b) two peers on one device, task {' '.join([swarm['task'], *swarm['options'][1::2]])}, "
                      f"diloco, {swarm['compression']}, {swarm['inner_steps']} inner steps, overlap {swarm['overlap']}",
                  f"{'phase':<7} {'peer':<7} {'samples/s':>10} {'prec':>5} {'micro':>6} {'epochs':>7} {'rounds ok':>9} "
                  f"{'overlap':>7} {'sent MB/rnd':>11} {'device MB/ep':>12} {'round s':>8} {'peak GiB':>9}"]
        for phase in ("alone", "swarm"):
            for row in swarm[phase]["peers"]:
                peak = row["peak_device_memory"]
                lines.append(f"{phase:<7} {row['peer']:<7} {_num(row['samples_per_second'], 1):>10} "
                             f"{row['precision']:>5} {row['micro_batch']:>6} {row['epochs']:>7} {row['rounds_ok']:>9} "
                             f"{row['rounds_overlapped']:>7} {row['bytes_sent_per_round'] / MB:>11.2f} "
                             f"{row['device_bytes_per_epoch'] / MB:>12.1f} {_num(row['round_seconds'], 2):>8} "
                             f"{_num(None if peak is None else peak / 2**30, 2):>9}")
        utilisation = swarm["utilisation"]
        verdict = "n/a" if utilisation is None else ("meets" if utilisation >= swarm["target"] else "BELOW")
        lines.append(f"(c) compute utilisation (swarm / alone samples/s): {_num(utilisation, 3)} "
                     f"({verdict} the target {swarm['target']})")
    lines.append(f"took {report['seconds']:.0f} s")
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="write the report as JSON to FILE (bare --json: on stdout, the table on stderr)")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a rehearsal of every part)")
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the placement benchmark")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per placement (median)")
    parser.add_argument("--seconds", type=float, default=60.0, help="training seconds per phase and peer")
    parser.add_argument("--start-seconds", type=float, default=100.0, help="seconds a peer may take to start and leave")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds the whole check may take (peers past it are stopped)")
    parser.add_argument("--skip-seconds", type=float, default=5.0, help="warm-up seconds left out of the rates")
    parser.add_argument("--task", default=None, help="task of the two peers (default: lm size base, else charlm 12x768)")
    parser.add_argument("--inner-steps", type=int, default=200, help="DiLoCo inner steps per round")
    parser.add_argument("--overlap", default="on", choices=["auto", "on", "off"], help="DiLoCo's --overlap")
    parser.add_argument("--compression", default="q2", help="codec of what peers send")
    parser.add_argument("--skip-placement", action="store_true", help="only the two-peer check")
    parser.add_argument("--skip-peers", action="store_true", help="only the placement benchmark")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.deadline = started + args.budget
    try:
        import torch  # noqa: F401
    except ImportError:
        print("gpu_check: torch is not installed here: nothing to measure", flush=True)
        return 0
    gpu = gpu_facts(args.device)
    if gpu is None:
        import torch

        reason = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no usable GPU or driver"
        message = f"gpu_check: no CUDA GPU found (torch {torch.__version__}: {reason}); nothing measured"
        print(message, flush=True)
        if args.json and args.json != "-":
            Path(args.json).write_text(json.dumps({"gpu": None, "message": message}, indent=2) + "\n")
        return 0
    report: dict[str, Any] = {"gpu": gpu, "device": args.device}
    if not args.skip_placement:
        log(f"(a) placement on {args.device}, {args.params / 1e6:g}M parameters")
        report["placement"] = placement(args.device, int(args.params), args.repeats)
    if not args.skip_peers:
        report["two_peers"] = swarm_check(args)
    report["seconds"] = time.monotonic() - started
    text = table(report)
    if args.json == "-":
        print(text, file=sys.stderr, flush=True)
        print(json.dumps(report, indent=2, default=str), flush=True)
    else:
        print(text, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
