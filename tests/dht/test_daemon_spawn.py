"""A node starts p2pd without forking its process (swarmgrad/dht/daemon.py): on uvloop hivemind's
start was a fork, and every page the training wrote afterwards faulted once (594 thousand faults in
the first step at 201M parameters). Real p2pd on loopback, on the peer's own loop (uvloop)."""

from __future__ import annotations

import os
import resource

import torch
from conftest import run_async

from swarmgrad.dht import NodeConfig, SwarmNode

PAGES = 16_384  # a 64 MiB buffer the training wrote before the daemon started


def thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_node_starts_and_stops_p2pd_without_forking_the_peer():
    weights = torch.ones(PAGES * 1024)
    weights.add_(1)  # every page written and resident
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))  # a fork runs these; a spawn does not

    async def scenario() -> tuple[int, int]:
        async with SwarmNode(NodeConfig(host="127.0.0.1")) as node:
            daemon = node.p2p._child
            before = thread_faults()
            weights.add_(1)  # what the next training step does
            written = thread_faults() - before
            assert daemon.returncode is None  # p2pd runs, its output read on the loop
            pid = daemon.pid
        return written, pid

    written, pid = run_async(scenario())
    assert not forks, "the node forked the process to start p2pd"
    # copy-on-write after a fork: one fault a page; written in place: none
    assert written < PAGES // 10, written
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
        "p2pd outlived its node"
