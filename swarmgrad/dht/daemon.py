"""The p2pd daemon class a node starts, and how it is started: without forking the peer.

hivemind's ``P2P.create`` starts p2pd with ``asyncio.create_subprocess_exec``. On uvloop
(eventloop.py) that is libuv's ``uv_spawn``, a ``fork()`` of the whole peer: the kernel copies its
page tables on the loop thread, and every page the training writes afterwards faults once to break
the copy-on-write. Measured at 201M parameters (model, gradients and Adam: 3.2 GB written every
step): 594 thousand faults and 1.45 s in the first step against 0.95 after, the longest stall of the
training loop outside rounds in the lab (2.1x the median step); a fork of a process that large can
also fail outright where the kernel does not overcommit memory. ``subprocess.Popen`` starts a program
with ``vfork`` / ``posix_spawn``, which copy nothing, so p2pd is started that way and its output read
on the running loop.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
from types import SimpleNamespace
from typing import Any

from hivemind.p2p import P2P, p2p_daemon

from swarmgrad.dht.config import NodeConfig

EXIT_POLL_S = 0.05  # how often wait() looks whether p2pd has exited (it exits within ms of SIGTERM)


class SpawnedProcess:
    """The part of asyncio's ``Process`` hivemind's P2P uses (``stdout``, ``returncode``,
    ``terminate``, ``wait``), over a ``Popen``."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader | None):
        self._popen, self.stdout = popen, stdout

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        # polled, not waited on a thread: a daemon that never exits then holds no thread of the executor
        while (code := self._popen.poll()) is None:
            await asyncio.sleep(EXIT_POLL_S)
        return code


async def spawn(program: str, *args: str, stdout: Any = None, stderr: Any = None, env: Any = None,
                limit: int = 2**16) -> SpawnedProcess:
    """``asyncio.create_subprocess_exec`` for the arguments hivemind passes, without a fork."""
    popen = subprocess.Popen([program, *args], stdout=stdout, stderr=stderr, env=env)
    reader = None
    if popen.stdout is not None:
        reader = asyncio.StreamReader(limit=limit)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                           popen.stdout)
    return SpawnedProcess(popen, reader)


@functools.cache
def start_daemons_without_fork() -> None:
    """hivemind's p2p_daemon module sees asyncio with ``spawn`` as its ``create_subprocess_exec``;
    nothing else in the process changes."""
    subprocess_module = SimpleNamespace(**{**vars(asyncio.subprocess), "create_subprocess_exec": spawn})
    p2p_daemon.asyncio = SimpleNamespace(**{**vars(asyncio), "subprocess": subprocess_module})


def daemon_class(config: NodeConfig, *, serve_relay: bool, static_relays: bool) -> type[P2P]:
    """hivemind's P2P, with the relay service's bounds on its p2pd command line (P2P.create has no
    parameters for them); a node nobody can dial relays for nobody. With ``static_relays`` it
    reserves on the trusted relays at once (p2pd's relay discovery waits for 4 candidates or 3
    minutes before it reserves anywhere)."""
    start_daemons_without_fork()
    if not config.use_relay:
        return P2P
    flags = [f"-relayService={int(serve_relay)}"] + (["-relayDiscovery=0"] if static_relays else [])
    if serve_relay:
        flags += [f"-relayMaxReservations={config.relay_reservations}", f"-relayMaxCircuits={config.relay_circuits}",
                  f"-relayDataLimit={int(config.relay_mbytes * 2**20)}", f"-relayTimeLimit={config.relay_seconds:g}s"]

    class BoundedRelayP2P(P2P):
        def _make_process_args(self, *args, **kwargs) -> list[str]:  # hivemind calls it on the instance
            return P2P._make_process_args(*args, **kwargs) + flags

    return BoundedRelayP2P
