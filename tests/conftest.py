"""Shared helpers: run async scenarios on uvloop, start child peer processes, wait for conditions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

import pytest
import torch

from swarmgrad.eventloop import configure_logging, run

# Under two xdist workers on two cores, each worker computes on one thread: torch's default (one per
# core) ran 2 OpenMP threads in each worker beside a lab's peer processes, each parallel region
# waiting for a descheduled thread, and a 25 s training test took 157 s. The peers the tests start
# keep their own settings (the lab's and the demo's run on one thread; a CLI peer's time-bounded
# accuracy checks were measured with torch's default).
TORCH_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
torch.set_num_threads(TORCH_THREADS)

configure_logging(20)

# CI runs the suite on two xdist workers (pyproject addopts): the suite keeps about one core busy on
# average (user + system time 1268 s over 1294 s of wall time), so two workers share the machine's
# two cores. These modules run whole swarms or labs; they all go to one worker, one at a time, so two
# of them never load the machine at once, and lab tests never see another lab's namespaces appear.
HEAVY_MODULES = {"test_attacks_benchmark", "test_bandwidth_sweep", "test_big_model_benchmark", "test_cli", "test_docs",
                 "test_scale_benchmark"}


def _heavy(item: pytest.Item) -> bool:
    module = item.module.__name__ if item.module is not None else ""
    return module.startswith("test_lab") or module in HEAVY_MODULES


# First: xdist's own hook reads the marks into each test's id ("...@heavy"), which is what its
# scheduler groups by; a conftest hook runs after a plugin's unless it asks to run first.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _heavy(item):
            item.add_marker(pytest.mark.xdist_group("heavy"))


def lab_unavailable() -> str | None:
    """Why the swarm lab's emulated network cannot run here (not root, tools or namespaces missing), or None."""
    from swarmgrad.errors import StartupError
    from swarmgrad.lab import network

    try:
        tools = network.check_requirements()
    except StartupError as error:
        return str(error)
    probe = f"sglab-probe-{os.getpid()}"
    made = subprocess.run([tools["ip"], "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run([tools["ip"], "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    return None


class FakeClock:
    """A clock tests move by hand: ``clock.now += seconds``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def packed(state) -> torch.Tensor:
    """A state's bytes (a StateSnapshot or a ServedState) as served, part after part."""
    from swarmgrad.state.snapshot import part_count

    return torch.cat([state.read_part(index) for index in range(part_count(state.nbytes))])


def travelled_in(values: torch.Tensor, codec_name: str):
    """A result as a lossy round hands it to every member: each chunk encoded by its owner, decoded.
    Returns (schema, the decoded values, the frames)."""
    from swarmgrad.averaging.codecs import get_codec
    from swarmgrad.averaging.frames import decode_chunk, encode_chunk
    from swarmgrad.averaging.layout import Schema

    schema, codec = Schema.of([("w", values)], chunk_elements=4096), get_codec(codec_name)
    frames, result = [], torch.empty_like(values)
    for chunk in schema.chunks:
        header, payload = encode_chunk(codec, values[chunk.start : chunk.start + chunk.length].view(chunk.view))
        frames.append(({"t": "avg", "c": chunk.index, **header}, bytes(payload)))
        result[chunk.start : chunk.start + chunk.length] = decode_chunk(codec, header, payload, chunk.view)
    return schema, result, frames


def run_async(coroutine):
    return run(coroutine)


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float, interval: float = 0.2) -> float:
    """Poll ``check`` until it is true; returns the seconds it took, fails the test after ``seconds``."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > seconds:
            pytest.fail(f"condition not met within {seconds} s")
        await asyncio.sleep(interval)
    return time.monotonic() - started


class MemberProcess:
    """A demo member (real p2pd, real DHT) in its own process, for kill/restart scenarios.

    Its methods never block the calling event loop, which may host the nodes the member talks to.
    """

    def __init__(self, run_id: str, initial_peers: list[str], *extra: str, ttl: float = 30.0):
        argv = [sys.executable, "-m", "swarmgrad.demo.member", "--run-id", run_id, "--ttl", str(ttl)]
        argv += ["--initial-peers", *initial_peers, *extra]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.peer_id = ""
        self.maddrs: list[str] = []

    async def ready(self) -> "MemberProcess":
        line = await asyncio.to_thread(self.process.stdout.readline)
        if not line:
            stderr = await asyncio.to_thread(self.process.stderr.read)
            raise RuntimeError(f"member process failed: {stderr[-2000:]}")
        ready = json.loads(line)
        self.peer_id, self.maddrs = ready["peer_id"], ready["maddrs"]
        return self

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    async def stop(self) -> int:
        """SIGTERM (a graceful leave); SIGKILL if it does not exit in time. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, 15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


@pytest.fixture
def member_processes():
    """``member = await member_processes(run_id, initial_peers)``; all are killed after the test."""
    started: list[MemberProcess] = []

    async def start(*args, **kwargs) -> MemberProcess:
        member = MemberProcess(*args, **kwargs)
        started.append(member)
        return await member.ready()

    yield start
    for member in started:
        if member.process.poll() is None:
            member.process.kill()
            member.process.wait()


def run_lab_benchmark(script: Path, *args: str, tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess,
                                                                                       list[str]]:
    """Run a lab benchmark (TMPDIR in ``tmp_path``); returns its result and the network namespaces it
    left: those named for its process (``sglab-<pid>-...``), whatever other labs run beside it."""
    from swarmgrad.lab.sweep import NETNS_DIR

    process = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    left = sorted(name for name in os.listdir(NETNS_DIR) if name.startswith(f"sglab-{process.pid}-")) \
        if NETNS_DIR.is_dir() else []
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), left


def p2pd_pids(parent: int | None = None) -> set[int]:
    """p2pd daemons that are children of ``parent`` (default: this test process, not other sessions')."""
    parent = os.getpid() if parent is None else parent
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        if name == "p2pd" and int(fields[1]) == parent:
            pids.add(int(entry))
    return pids


@contextlib.contextmanager
def joiner_and_donors(name: str, donors: int):
    """A background loop with a joiner node and ``donors`` nodes on loopback, and a Libp2pTransport
    per node (the joiner's first): what the state-transfer tests hand a module fixture."""
    from contextlib import AsyncExitStack
    from types import SimpleNamespace

    from swarmgrad.dht import NodeConfig, SwarmNode
    from swarmgrad.eventloop import BackgroundLoop
    from swarmgrad.net.transport import Libp2pTransport

    loop = BackgroundLoop(name)
    stack = AsyncExitStack()

    async def start():
        joiner = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1")))
        nodes = await asyncio.gather(*(
            stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=joiner.maddrs)))
            for _ in range(donors)))
        return joiner, nodes

    try:
        joiner, nodes = loop.run(start(), timeout=60)
        yield SimpleNamespace(loop=loop, joiner=joiner, donors=nodes,
                              transports=[Libp2pTransport(node.p2p) for node in (joiner, *nodes)])
    finally:
        loop.run(stack.aclose(), timeout=30)
        loop.close()


# -- a tiny model and a few training steps, shared by the tests of real peers ----------------------


def tiny_classifier(seed: int = 0, lr: float = 0.05) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """8 inputs, 2 classes, 178 parameters; the same weights for every peer built with one seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def random_batch(generator: torch.Generator, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 8, generator=generator), torch.randint(0, 2, (size,), generator=generator)


async def train_steps(peer, model: torch.nn.Module, seed: int, steps: int | None = None,
                      until: Callable[[], bool] | None = None, seconds: float = 90.0, pause: float = 0.01):
    """``peer.astep`` on random batches: ``steps`` of them, or until ``until()`` (at most ``seconds``);
    ``pause`` lets the other peers on this event loop run. Returns the peer's status."""
    generator = torch.Generator().manual_seed(seed)
    deadline, done = time.monotonic() + seconds, 0
    while (done < steps) if steps is not None else (not until() and time.monotonic() < deadline):
        inputs, targets = random_batch(generator)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        await peer.astep(batch_size=len(targets), loss=loss)
        await asyncio.sleep(pause)
        done += 1
    return peer.status()
