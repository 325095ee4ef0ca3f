"""NAT routers in the lab (swarmgrad/lab/nat.py): real namespaces, real conntrack, real sockets.

A peer behind any NAT reaches public peers; nobody reaches it unless it opened the flow; a home NAT
keeps a flow's source port (hole punching can work), a symmetric one picks a fresh port per flow,
carrier-grade NAT is two layers. Needs root; skipped otherwise.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import lab_unavailable

from swarmgrad.errors import ConfigError
from swarmgrad.lab import nat
from swarmgrad.lab.network import EmulatedNetwork, LinkSpec, leftovers

_REASON = lab_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"emulated network unavailable: {_REASON}")
INF = math.inf
PORT = 7100

# Accepts connections and answers each with the address:port it saw the connection come from.
OBSERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("ready", flush=True)
while True:
    c, peer = s.accept(); c.sendall(f"{peer[0]}:{peer[1]}".encode()); c.close()
"""

# Connects from a fixed local port to each target in turn; prints what each saw (or the error).
DIALER = """
import json, socket, sys
local_port, targets = int(sys.argv[1]), sys.argv[2:]
seen = []
for target in targets:
    host, port = target.rsplit(":", 1)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.settimeout(2)
    try:
        if local_port:
            s.bind(("0.0.0.0", local_port))
        s.connect((host, int(port))); seen.append(s.recv(100).decode())
    except OSError as error:
        seen.append(type(error).__name__)
    s.close()
print(json.dumps(seen))
"""


def _start(net: EmulatedNetwork, i: int, code: str, *args: object) -> subprocess.Popen:
    process = net.popen(i, [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def _dial(net: EmulatedNetwork, i: int, local_port: int, *targets: str) -> list[str]:
    result = subprocess.run(net.exec_argv(i, [sys.executable, "-c", DIALER, str(local_port), *targets]),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def lab():
    kinds = ["none", "none", "home", "symmetric", "cgnat"]
    with EmulatedNetwork([LinkSpec(INF, INF, 1.0, 0.0, nat=kind) for kind in kinds]) as net:
        observers = [_start(net, i, OBSERVER, net.address(i), PORT) for i in range(len(kinds))]
        yield net
        for process in observers:
            process.kill()


def test_natted_peers_bind_private_addresses_and_show_their_routers_address(lab):
    assert lab.address(0) == lab.public_address(0) == "11.77.0.1"
    assert lab.address(2) == nat.lan_address(2, 2) and lab.public_address(2) == "11.77.0.3"
    for i in (2, 3, 4):  # what a public peer sees of a NATed one: its outermost router's address
        seen = _dial(lab, i, 0, f"{lab.public_address(0)}:{PORT}")[0]
        assert seen.split(":")[0] == lab.public_address(i), (i, seen)


def test_nothing_reaches_a_natted_peer_unasked(lab):
    for target in (2, 3, 4):
        # its public address (the router: nothing is forwarded in) and its private one (no route)
        seen = _dial(lab, 0, 0, f"{lab.public_address(target)}:{PORT}", f"{lab.address(target)}:{PORT}")
        assert seen[0] in ("TimeoutError", "ConnectionRefusedError") and ":" not in seen[0], (target, seen)
        assert ":" not in seen[1], (target, seen)
    # and another NATed peer cannot reach it either
    assert ":" not in _dial(lab, 2, 0, f"{lab.public_address(3)}:{PORT}")[0]
    # while a public peer is reachable by all
    assert _dial(lab, 1, 0, f"{lab.public_address(0)}:{PORT}")[0].startswith(lab.public_address(1))


def test_home_nat_keeps_the_port_for_every_destination_and_symmetric_does_not(lab):
    targets = [f"{lab.public_address(0)}:{PORT}", f"{lab.public_address(1)}:{PORT}"]
    home = _dial(lab, 2, 7201, *targets)
    assert [seen.split(":")[1] for seen in home] == ["7201", "7201"], home  # endpoint-independent
    carrier = _dial(lab, 4, 7202, *targets)
    assert [seen.split(":")[1] for seen in carrier] == ["7202", "7202"], carrier  # two such layers
    symmetric = _dial(lab, 3, 7203, *targets)
    ports = {seen.split(":")[1] for seen in symmetric}
    assert "7203" not in ports and len(ports) == 2, symmetric  # a fresh random port per flow


def test_a_peer_reached_back_on_a_flow_it_opened():
    # established flows do come back in: UDP, the way QUIC and hole punching use it
    with EmulatedNetwork([LinkSpec(INF, INF, 1.0, 0.0), LinkSpec(INF, INF, 1.0, 0.0, nat="home")]) as net:
        echo = ("import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind((sys.argv[1],7300))\n"
                "print('ready',flush=True)\nd,a=s.recvfrom(100);s.sendto(d+b'!',a)")
        server = _start(net, 0, echo, net.address(0))
        client = ("import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(5)\n"
                  "s.sendto(b'hi',(sys.argv[1],7300));print(s.recv(100).decode())")
        result = subprocess.run(net.exec_argv(1, [sys.executable, "-c", client, net.public_address(0)]),
                                capture_output=True, text=True, timeout=30, check=False)
        assert result.stdout.strip() == "hi!", result.stderr
        server.kill()
        prefix = net.prefix
    assert leftovers(prefix) == []  # routers' namespaces are swept with the peers'


def test_unknown_nat_type_is_one_clear_error():
    with pytest.raises(ConfigError, match="LinkSpec.nat must be one of none, home, symmetric, cgnat"):
        LinkSpec(INF, INF, 0, 0, nat="full-cone")
