"""Shared plumbing for the multi-process benchmarks: spawn a group of peers, rendezvous, collect, clean up.

A benchmark "system" is a function ``target(ctx, config) -> dict`` run in ``peers`` fresh processes
(multiprocessing "spawn"). Peers meet through the parent: ``ctx.exchange(value)`` is an all-gather,
``ctx.sync()`` a barrier with a deadline. Every peer process leads its own process group, so the
parent can remove it together with everything it started (hivemind's forked DHT and averager
processes, p2pd daemons) when the system fails, hangs, or simply finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # network hygiene: every listener and every dial stays on this host
MB = 1e6  # all sizes and rates in the report use decimal megabytes

T = TypeVar("T")
PeerTarget = Callable[["PeerContext", Any], dict]


def log(message: str) -> None:
    """Progress goes to stderr, so ``--json`` keeps stdout clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class GroupFailed(RuntimeError):
    """A peer group raised, hung, or died; the message says which peer and why."""


@dataclass
class PeerContext:
    """What a peer process knows about its group; picklable, so it travels to the spawned process."""

    rank: int
    peers: int
    timeout: float  # seconds any single wait (barrier, exchange) may take
    barrier: Any  # multiprocessing Barrier
    outbox: Any  # peer -> parent: ("exchange" | "result" | "error", rank, payload)
    inbox: Any  # parent -> this peer: exchange answers

    def sync(self) -> None:
        """Barrier across all peers; raises BrokenBarrierError on timeout or when the parent aborts it."""
        self.barrier.wait(self.timeout)

    def exchange(self, value: Any) -> list[Any]:
        """All-gather through the parent: every peer's ``value``, indexed by rank."""
        self.outbox.put(("exchange", self.rank, value))
        return self.inbox.get(timeout=self.timeout)

    # Async twins: the blocking waits run in a thread, so the event loop keeps serving the network.
    async def async_sync(self) -> None:
        await asyncio.to_thread(self.sync)

    async def async_exchange(self, value: Any) -> list[Any]:
        return await asyncio.to_thread(self.exchange, value)


def _peer_main(target: PeerTarget, ctx: PeerContext, config: Any) -> None:
    """Entry point of a spawned peer process."""
    os.setpgid(0, 0)  # lead a process group: the parent can kill us with all our descendants
    os.dup2(2, 1)  # anything a library prints goes to stderr; stdout belongs to the parent's report
    try:
        import torch

        torch.set_num_threads(1)  # 2 cores shared by all peers
        result = target(ctx, config)
        ctx.outbox.put(("result", ctx.rank, result))
    except BaseException as error:  # report everything, including KeyboardInterrupt, then exit
        summary = f"{type(error).__name__}: {error}".strip()
        log(f"peer {ctx.rank} failed:\n{traceback.format_exc()}")
        ctx.outbox.put(("error", ctx.rank, summary))


def run_group(target: PeerTarget, config: Any, peers: int, deadline_s: float, wait_s: float) -> list[dict]:
    """Run ``target`` in ``peers`` processes; return their results by rank or raise GroupFailed.

    ``deadline_s`` bounds the whole group, ``wait_s`` each barrier/exchange inside it. Processes are
    always removed (with their process groups) before this returns.
    """
    context = mp.get_context("spawn")
    barrier = context.Barrier(peers)
    outbox = context.Queue()
    inboxes = [context.Queue() for _ in range(peers)]
    processes = []
    for rank in range(peers):
        ctx = PeerContext(rank, peers, wait_s, barrier, outbox, inboxes[rank])
        process = context.Process(target=_peer_main, args=(target, ctx, config), name=f"bench-peer-{rank}")
        process.start()
        processes.append(process)
    finished = False
    try:
        results = _collect(processes, barrier, outbox, inboxes, time.monotonic() + deadline_s)
        finished = True
        return results
    finally:
        _stop(processes, grace_s=20.0 if finished else 3.0)  # a clean shutdown may take a while; a hang won't end
        for q in [outbox, *inboxes]:
            q.close()
            q.cancel_join_thread()  # never block on a queue whose reader is gone


def _collect(processes: list, barrier: Any, outbox: Any, inboxes: list, deadline: float) -> list[dict]:
    """Serve exchanges and gather results until every peer answered, one failed, or time ran out."""
    peers = len(processes)
    results: dict[int, dict] = {}
    exchanges: dict[int, Any] = {}
    while len(results) < peers:
        if time.monotonic() > deadline:
            barrier.abort()
            raise GroupFailed(f"timed out; peers {sorted(set(range(peers)) - set(results))} did not finish")
        try:
            kind, rank, payload = outbox.get(timeout=0.5)
        except queue.Empty:
            _raise_if_died(processes, results)
            continue
        if kind == "error":
            barrier.abort()  # wake the others so they fail fast instead of waiting out their timeouts
            raise GroupFailed(f"peer {rank}: {payload}")
        if kind == "result":
            results[rank] = payload
        elif kind == "exchange":
            exchanges[rank] = payload
            if len(exchanges) == peers:
                answer = [exchanges[r] for r in range(peers)]
                for inbox in inboxes:
                    inbox.put(answer)
                exchanges.clear()
    return [results[r] for r in range(peers)]


def _raise_if_died(processes: list, results: dict[int, dict]) -> None:
    for rank, process in enumerate(processes):
        if rank not in results and process.exitcode is not None:
            raise GroupFailed(f"peer {rank} exited with code {process.exitcode} before reporting")


def _stop(processes: list, grace_s: float = 20.0) -> None:
    """Let peers shut down cleanly for a while, then SIGTERM and SIGKILL what is left of their groups."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # also after a clean exit: a p2pd or a forked hivemind process may outlive its peer
        left = [process for process in processes if process.is_alive() or _group_alive(process.pid)]
        if not left:
            break
        for process in left:
            _signal_group(process.pid, sig)
            if process.is_alive():  # died before setpgid, or the group is gone
                os.kill(process.pid, sig)
        for process in left:
            process.join(2.0)
        time.sleep(0.5)  # grandchildren are not ours to join; give them a moment to go


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)  # the group our peer created with setpgid(0, 0); its id is the peer's pid
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (everything exited) or was never created


@dataclass
class RoundStats:
    """Per-round group times (max over peers) after warm-up."""

    rounds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @classmethod
    def from_peers(cls, per_peer_seconds: list[list[float]]) -> RoundStats:
        """A round lasts until its slowest peer is done."""
        return cls([max(times) for times in zip(*per_peer_seconds)])


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(value: bool | None, yes: str, no: str) -> str:
    return "-" if value is None else (f"[green]{yes}[/green]" if value else f"[red]{no}[/red]")


def checks_table(title: str, checks: list[dict]) -> Any:
    """A benchmark's pass/fail checks (each {"check", "seen", "ok"}) as one rich table."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("check", "seen", "verdict"):
        table.add_column(column)
    for check in checks:
        table.add_row(check["check"], check["seen"], verdict(check["ok"], "pass", "FAIL"))
    return table


def target_cell(value: float | None, target: float) -> str:
    return "-" if value is None else f"{value:.2f} " + verdict(value >= target, "pass", "FAIL")


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ---------------------------------------------------------------- process accounting from /proc (no psutil here)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces): field 3 (state) comes first."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def child_pids(parent: int, name: str) -> list[int]:
    """Live children of ``parent`` whose command is ``name`` (e.g. the p2pd daemons a peer started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as comm:
                if comm.read().strip() != name:
                    continue
            if int(_stat_fields(int(entry))[1]) == parent:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):  # it exited while we looked
            continue
    return sorted(found)


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used so far, 0 if it is gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat(5)


# ---------------------------------------------------------------- starting peers of the systems compared


def start_hivemind_dht(ctx: PeerContext) -> Any:
    """Peer 0 starts first; the others bootstrap from its visible addresses. Loopback only."""
    from hivemind import DHT

    hygiene = dict(host_maddrs=[LOOPBACK], use_ipfs=False, nat_port_map=False, auto_nat=False)
    if ctx.rank == 0:
        dht = DHT(start=True, **hygiene)
        ctx.exchange([str(address) for address in dht.get_visible_maddrs()])
        return dht
    first_peer = ctx.exchange(None)[0]
    return DHT(initial_peers=first_peer, start=True, **hygiene)


def patch_hivemind_quantization() -> None:
    """hivemind 1.1.12's Quantization.extract calls int() on a 1-element array, which numpy 2.4 rejects.

    Unpatched, int8 rounds report success and leave wrong tensors. This is the same method with
    ``[0]`` added; it runs in this peer's processes only (the averager is forked from here).
    """
    import numpy as np
    import torch
    from hivemind.compression.quantization import Quantization

    def extract(self: Quantization, serialized: Any) -> torch.Tensor:
        codebook_size = int(np.frombuffer(serialized.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))
        return codebook[quantized].requires_grad_(serialized.requires_grad)

    Quantization.extract = extract


async def start_swarm_node(ctx: PeerContext, stack: contextlib.AsyncExitStack) -> Any:
    from swarmgrad.dht import NodeConfig, SwarmNode

    if ctx.rank == 0:
        node = await stack.enter_async_context(SwarmNode(NodeConfig()))
        await ctx.async_exchange(node.maddrs)
        return node
    first_peer = (await ctx.async_exchange(None))[0]
    return await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first_peer)))


# ---------------------------------------------------------------- raw all-to-all traffic (data-plane references)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop, uvloop where installed."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


@dataclass
class TrafficConfig:
    peers: int
    rounds: int  # measured rounds; one warm-up round comes first
    share_bytes: int  # sent to each other peer per round
    chunk_bytes: int  # bytes per write
    round_timeout: float


class Inflow:
    """What arrived in this round; done once every other peer's stream reached EOF."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.reset(0)

    def reset(self, streams: int) -> None:
        self.received = 0
        self.remaining = streams
        self.done = asyncio.Event()

    async def consume(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(self.chunk_bytes):
            self.received += len(data)
        writer.close()
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()


async def push(writer: asyncio.StreamWriter, payload: memoryview, chunk_bytes: int) -> None:
    for offset in range(0, len(payload), chunk_bytes):
        writer.write(payload[offset : offset + chunk_bytes])
        await writer.drain()
    writer.close()  # flushes what is buffered, then EOF for the receiver
    await writer.wait_closed()


OpenStream = Callable[[int], Awaitable[asyncio.StreamWriter]]


async def all_to_all_rounds(ctx: PeerContext, cfg: TrafficConfig, inflow: Inflow, open_stream: OpenStream) -> dict:
    """Every peer sends ``share_bytes`` to every other at once; a round ends when this peer sent and got all."""
    import numpy as np

    payload = memoryview(np.full(cfg.share_bytes, ctx.rank + 1, dtype=np.uint8))  # written: pages touched
    others = [rank for rank in range(ctx.peers) if rank != ctx.rank]

    async def send(rank: int) -> None:
        await push(await open_stream(rank), payload, cfg.chunk_bytes)

    seconds, complete = [], True
    for index in range(cfg.rounds + 1):
        inflow.reset(len(others))
        await ctx.async_sync()  # nobody sends before everyone has reset its counters
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*map(send, others), inflow.done.wait()), cfg.round_timeout)
        seconds.append(time.perf_counter() - start)
        complete &= inflow.received == cfg.share_bytes * len(others)
    await ctx.async_sync()  # drain() only means p2pd took the bytes: stay up until everyone has them
    return {"seconds": seconds[1:], "ok": complete, "rel_error": None}


def tcp_aes_peer(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    return run_async(_tcp_aes_rounds(ctx, cfg))


async def _tcp_aes_rounds(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    """asyncio TCP with every chunk sealed by AES-256-GCM (the cipher swarmgrad's direct plane uses)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(bytes(32))  # a fixed key: this measures the cipher's cost, not key exchange
    nonce = bytes(12)  # reusing a nonce is insecure, and irrelevant to the cost being measured

    class SealedInflow(Inflow):
        async def consume(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            plain = bytearray(self.chunk_bytes)
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(4), "big")
                    data = await reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    break
                aead.decrypt_into(nonce, data, None, memoryview(plain)[: size - 16])
                self.received += size - 16
            writer.close()
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()

    inflow = SealedInflow(cfg.chunk_bytes)
    server = await asyncio.start_server(inflow.consume, "127.0.0.1", 0)
    try:
        ports = await ctx.async_exchange(server.sockets[0].getsockname()[1])

        async def open_stream(rank: int) -> asyncio.StreamWriter:
            _reader, writer = await asyncio.open_connection("127.0.0.1", ports[rank])
            return _SealingWriter(writer, aead, nonce)  # type: ignore[return-value]

        return await all_to_all_rounds(ctx, cfg, inflow, open_stream)
    finally:
        server.close()
        await server.wait_closed()


class _SealingWriter:
    """Looks enough like a StreamWriter for ``push``: seals each chunk, length-prefixed."""

    def __init__(self, writer: asyncio.StreamWriter, aead, nonce: bytes):
        self.writer, self.aead, self.nonce = writer, aead, nonce

    def write(self, chunk) -> None:
        sealed = self.aead.encrypt(self.nonce, chunk, None)
        self.writer.writelines((len(sealed).to_bytes(4, "big"), sealed))

    async def drain(self) -> None:
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()

    async def wait_closed(self) -> None:
        await self.writer.wait_closed()


def p2pd_peer(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    return run_async(_p2pd_rounds(ctx, cfg))


async def _p2pd_rounds(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    """Binary streams through hivemind's p2pd, the transport swarmgrad's control plane uses."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    p2p = await P2P.create(host_maddrs=[LOOPBACK], use_ipfs=False, nat_port_map=False, auto_nat=False)
    try:
        inflow = Inflow(cfg.chunk_bytes)
        await p2p.add_binary_stream_handler("bench", lambda _info, reader, writer: inflow.consume(reader, writer))
        # the daemon's connect wants transport addresses, without the /p2p/<id> suffix
        addresses = [str(address).split("/p2p/")[0] for address in await p2p.get_visible_maddrs()]
        own = (p2p.peer_id.to_bytes(), addresses)
        everyone = [(PeerID(peer_id), addresses) for peer_id, addresses in await ctx.async_exchange(own)]
        for rank, (peer_id, addresses) in enumerate(everyone):
            if rank != ctx.rank:  # dial directly: no DHT lookup inside the measured rounds
                await p2p._client.connect(peer_id, [Multiaddr(address) for address in addresses])

        async def open_stream(rank: int) -> asyncio.StreamWriter:
            _info, _reader, writer = await p2p.call_binary_stream_handler(everyone[rank][0], "bench")
            return writer

        return await all_to_all_rounds(ctx, cfg, inflow, open_stream)
    finally:
        await p2p.shutdown()


def tcp_peer(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    return run_async(_tcp_rounds(ctx, cfg))


async def _tcp_rounds(ctx: PeerContext, cfg: TrafficConfig) -> dict:
    """Plain asyncio TCP on 127.0.0.1: what the loopback and the event loop allow."""
    inflow = Inflow(cfg.chunk_bytes)
    # default 64 KiB reader limit: a larger one measured slower here (big fresh buffers per read)
    server = await asyncio.start_server(inflow.consume, "127.0.0.1", 0)
    try:
        ports = await ctx.async_exchange(server.sockets[0].getsockname()[1])

        async def open_stream(rank: int) -> asyncio.StreamWriter:
            _reader, writer = await asyncio.open_connection("127.0.0.1", ports[rank])
            return writer

        return await all_to_all_rounds(ctx, cfg, inflow, open_stream)
    finally:
        server.close()
        await server.wait_closed()
