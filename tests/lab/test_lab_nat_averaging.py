"""Averaging between peers behind NAT, in the lab: real routers (swarmgrad/lab/nat.py), real p2pd
relays and hole punching, real averaging rounds. Needs root; skipped otherwise.

Each test starts public bootstrap nodes (the first is also the relay: it is every peer's first
initial peer) and averaging peers, some behind NATs, which find out by a dial-back check that
nobody can dial them and reserve a slot on the relay. The first bootstrap's link counters show
what went through the relay. Hole punching needs a NATed peer to learn its outside address from
four public peers (go-libp2p's observed-address threshold), hence four bootstrap nodes there.
"""

from __future__ import annotations

import json
import math
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import lab_unavailable

from swarmgrad.lab.network import EmulatedNetwork, LinkSpec

_REASON = lab_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"emulated network unavailable: {_REASON}")
INF = math.inf
PEER = Path(__file__).parents[1] / "averaging_peer.py"
NUMEL = 1_000_000  # 4 MB: through a relay that is ~8 MB more on the relay's link, easy to tell apart


def _line(process: subprocess.Popen, seconds: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    assert ready, f"no output within {seconds} s"
    return process.stdout.readline()


def _bootstraps(net: EmulatedNetwork, count: int) -> list[str]:
    """``count`` bootstrap nodes in lab peers 0.. count-1, each joined to the first; their addresses."""
    found: list[str] = []
    for i in range(count):
        argv = [sys.executable, "-m", "swarmgrad.cli", "bootstrap", "--host", net.address(i), "--port", "31337"]
        process = net.popen(i, argv + (["--initial-peers", found[0]] if found else []), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
        maddr = ""
        while not maddr.startswith("/ip4/"):
            maddr = _line(process, 60).strip()
        found.append(maddr)
    return found


def _relay_bytes(net: EmulatedNetwork, bootstraps: int) -> int:
    """Bytes on the bootstrap nodes' links: every relay a NATed peer may use is one of them."""
    return sum(sum(net.traffic(i)) for i in range(bootstraps))


def _swarm(nats: list[str], group_size: int, numel: int = NUMEL, bootstraps: int = 1,
           wait_direct: float = 0.0) -> tuple[list[dict], int]:
    """Averaging peers behind ``nats`` (the k-th starts with the value k, from 1) average once
    through public bootstrap nodes: their reports, and the bytes that crossed the relays' links."""
    links = [LinkSpec(INF, INF, 5.0, 0.0)] * bootstraps + [LinkSpec(INF, INF, 5.0, 0.0, nat=kind) for kind in nats]
    with EmulatedNetwork(links) as net:
        initial = ",".join(_bootstraps(net, bootstraps))
        peers = [net.popen(i, [sys.executable, str(PEER), initial, "natrun", str(float(i - bootstraps + 1)), str(numel),
                               "--host", net.address(i), "--group-size", str(group_size), "--grid-dims", "0", "--window", "3",
                               "--timeout", "60", "--wait-direct", str(wait_direct)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(bootstraps, len(links))]
        for process in peers:
            assert "ready" in _line(process, 90)
        time.sleep(3)  # a few presence beats: everyone lists everyone, relay slots are reserved
        relay_before = _relay_bytes(net, bootstraps)
        for process in peers:
            process.stdin.write("go\n")
            process.stdin.flush()
        reports = [json.loads(_line(process, 120)) for process in peers]
        relayed = _relay_bytes(net, bootstraps) - relay_before
        for process in peers:
            process.stdin.write("done\n")
            process.stdin.flush()
    return reports, relayed


@pytest.mark.extended  # CI's quick NAT benchmark (test_lab_benchmarks) averages every NAT type in training
def test_every_nat_type_averages_with_a_public_peer_that_owns_the_parts():
    # group size 2 makes a 2 x 2 grid whose slices would pair NATed peers with each other; the
    # round falls back to one group led by the one public peer, which owns every part
    reports, relayed = _swarm(["none", "home", "symmetric", "cgnat"], group_size=2)
    assert [report["dialable"] for report in reports] == [True, False, False, False], reports
    for report in reports:
        assert report["ok"] and report["value"] == pytest.approx(2.5), report  # the mean of 1, 2, 3, 4
    for natted in reports[1:]:  # they dialled the public owner: its direct data plane, not a relay
        assert set(natted["transports"].values()) == {"direct"}, natted
    assert relayed < NUMEL, f"{relayed} bytes crossed the relay: the tensors went through it"


def test_two_peers_behind_home_nats_average_over_a_hole_punched_connection():
    # the round starts once hole punching connected the two (in the background, from the moment
    # presence listed each other: a round that raced it would go over the relay, and fail there)
    reports, relayed = _swarm(["home", "home"], group_size=2, bootstraps=4, wait_direct=20.0)
    for report in reports:
        assert report["dialable"] is False and all("/p2p-circuit" in m for m in report["maddrs"]), report
        assert report["ok"] and report["value"] == pytest.approx(1.5), report
        assert "direct" in sum(report["links"].values(), []), report  # the relayed connection was upgraded
    assert relayed < NUMEL, f"{relayed} bytes crossed the relay: the tensors went through it"


@pytest.mark.extended  # CI's quick NAT benchmark (test_lab_benchmarks) averages every NAT type in training
def test_a_symmetric_nat_and_a_cgnat_average_over_the_relay():
    """A symmetric NAT defeats hole punching; the relay carries the round. hivemind's p2pd resets a
    relayed connection after 128 KiB each way, so this round is small: 80 KB per peer."""
    numel = 20_000
    reports, relayed = _swarm(["symmetric", "cgnat"], group_size=2, numel=numel, bootstraps=4)
    for report in reports:
        assert report["dialable"] is False, report
        assert report["ok"] and report["value"] == pytest.approx(1.5), report
        assert sum(report["links"].values(), []) and "direct" not in sum(report["links"].values(), []), report
    assert relayed > 2 * 4 * numel, f"only {relayed} bytes crossed the relay"  # each peer's 80 KB, both ways


def test_a_public_peer_gets_a_natted_peers_data_over_a_connection_the_natted_peer_opened():
    """Reverse connection: the NATed peer is told over libp2p (through the relay) and connects back
    to the public peer's data plane; the blob takes that direct connection, not the relay."""
    blob = 2_000_000
    script = str(Path(__file__).parents[1] / "nat_transport_peer.py")
    links = [LinkSpec(INF, INF, 5.0, 0.0), LinkSpec(INF, INF, 5.0, 0.0, nat="home"), LinkSpec(INF, INF, 5.0, 0.0)]
    with EmulatedNetwork(links) as net:
        bootstrap = net.popen(0, [sys.executable, "-m", "swarmgrad.cli", "bootstrap", "--host", net.address(0),
                                  "--port", "31337"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        maddr = ""
        while not maddr.startswith("/ip4/"):
            maddr = _line(bootstrap, 60).strip()
        server = net.popen(1, [sys.executable, script, net.address(1), maddr, "serve", str(blob)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(_line(server, 90))
        assert ready["dialable"] is False
        relay_before = sum(net.traffic(0))
        fetcher = net.popen(2, [sys.executable, script, net.address(2), maddr, "fetch", ready["ready"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fetched = json.loads(_line(fetcher, 90))
        relayed = sum(net.traffic(0)) - relay_before
        server.stdin.write("done\n")
        server.stdin.flush()
        fetcher.wait(30)
        why = fetcher.stderr.read()  # the direct transport's log: why it fell back to libp2p, if it did
    assert fetched == {"transport": "direct", "bytes": blob, "dialable": True}, (fetched, why)
    assert relayed < blob / 4, f"{relayed} bytes crossed the relay"
