"""Averaging between peers behind NAT, in the lab: real routers (swarmgrad/lab/nat.py), real p2pd
relays and hole punching, real averaging rounds. Needs root; skipped otherwise.

Each test starts a public bootstrap node (peer 0: also the relay) and two averaging peers behind
NATs, which find out by a dial-back check that nobody can dial them, reserve a slot on the
bootstrap, and then average with each other: over a hole-punched direct connection where both
NATs keep ports, over the relay where one NAT picks random ports (symmetric, with cgnat).
The bootstrap's link counters show what went through the relay.
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
PEER = Path(__file__).with_name("averaging_peer.py")
NUMEL = 1_000_000  # 4 MB: through a relay that is ~8 MB more on the relay's link, easy to tell apart


def _line(process: subprocess.Popen, seconds: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    assert ready, f"no output within {seconds} s"
    return process.stdout.readline()


def _swarm(nats: list[str], group_size: int, numel: int = NUMEL) -> tuple[list[dict], int]:
    """Averaging peers behind ``nats`` (peer i starts with the value i) average once through a
    public bootstrap: their reports, and the bytes that crossed the bootstrap's (the relay's) link."""
    links = [LinkSpec(INF, INF, 5.0, 0.0)] + [LinkSpec(INF, INF, 5.0, 0.0, nat=kind) for kind in nats]
    with EmulatedNetwork(links) as net:
        bootstrap = net.popen(0, [sys.executable, "-m", "swarmgrad.cli", "bootstrap", "--host", net.address(0),
                                  "--port", "31337"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        maddr = ""
        while not maddr.startswith("/ip4/"):
            maddr = _line(bootstrap, 60).strip()
        peers = [net.popen(i, [sys.executable, str(PEER), maddr, "natrun", str(float(i)), str(numel),
                               "--host", net.address(i), "--group-size", str(group_size), "--grid-dims", "0", "--window", "3",
                               "--timeout", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(1, len(links))]
        for process in peers:
            assert "ready" in _line(process, 90)
        time.sleep(3)  # a few presence beats: everyone lists everyone, relay slots are reserved
        relay_before = sum(net.traffic(0))
        for process in peers:
            process.stdin.write("go\n")
            process.stdin.flush()
        reports = [json.loads(_line(process, 120)) for process in peers]
        relayed = sum(net.traffic(0)) - relay_before
        for process in peers:
            process.stdin.write("done\n")
            process.stdin.flush()
    return reports, relayed


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


def test_peers_that_nobody_can_dial_form_no_group_and_say_why():
    reports, _ = _swarm(["home", "symmetric"], group_size=2)
    for report in reports:
        assert report["dialable"] is False and all("/p2p-circuit" in m for m in report["maddrs"]), report
        assert not report["ok"] and "can be dialled" in report["error"], report
        assert report["value"] in (1.0, 2.0)  # unchanged


def test_a_public_peer_gets_a_natted_peers_data_over_a_connection_the_natted_peer_opened():
    """Reverse connection: the NATed peer is told over libp2p (through the relay) and connects back
    to the public peer's data plane; the blob takes that direct connection, not the relay."""
    blob = 2_000_000
    script = str(Path(__file__).with_name("nat_transport_peer.py"))
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
                            stdout=subprocess.PIPE, text=True)
        fetched = json.loads(_line(fetcher, 90))
        relayed = sum(net.traffic(0)) - relay_before
        server.stdin.write("done\n")
        server.stdin.flush()
    assert fetched == {"transport": "direct", "bytes": blob, "dialable": True}, fetched
    assert relayed < blob / 4, f"{relayed} bytes crossed the relay"
