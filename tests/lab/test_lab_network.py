"""The lab's emulated internet: real namespaces, real TCP/UDP between processes in them.

Needs root, iproute2 (ip, tc), iptables and /dev/net/tun; skipped otherwise.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import lab_unavailable

from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.lab import host, network
from swarmgrad.lab.network import EmulatedNetwork, LinkSpec, cleanup, leftovers

_REASON = lab_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"emulated network unavailable: {_REASON}")

INF = math.inf
REPO = Path(__file__).resolve().parents[2]

# -- tiny programs run inside the namespaces --------------------------------------------------------

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(4096):
    c.sendall(data)
"""

RTT_CLIENT = """
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    start = time.perf_counter(); s.sendall(b"x"); s.recv(1)
    rtts.append((time.perf_counter() - start) * 1000)
print(json.dumps(rtts))
"""

SINK = """
import json, socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("ready", flush=True)
c, _ = s.accept(); total = 0; first = None
while data := c.recv(1 << 20):
    first = first or time.perf_counter(); total += len(data)
print(json.dumps({"bytes": total, "seconds": time.perf_counter() - first}))
"""

SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
s.sendall(b"\\0" * int(sys.argv[3])); s.close()
"""

UDP_RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)  # SO_RCVBUFFORCE: never drop for lack of buffer
s.bind((sys.argv[1], int(sys.argv[2]))); s.settimeout(20)
print("ready", flush=True)
seen = set()
while (data := s.recv(2048)) != b"END":
    seen.add(data)
print(len(seen))
"""

UDP_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
target = (sys.argv[1], int(sys.argv[2]))
for i in range(int(sys.argv[3])):
    s.sendto(b"%08d" % i + b"." * 92, target)
    if i % 50 == 49:
        time.sleep(0.002)  # stay far below the tun queue, so only the emulated loss drops
for _ in range(40):
    s.sendto(b"END", target); time.sleep(0.002)
"""


def _server(net: EmulatedNetwork, i: int, code: str, *args: object) -> subprocess.Popen:
    process = net.popen(i, [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def _client(net: EmulatedNetwork, i: int, code: str, *args: object, timeout: float = 60) -> str:
    started = time.monotonic()
    try:
        result = subprocess.run(net.exec_argv(i, [sys.executable, "-c", code, *map(str, args)]),
                                capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"client in peer {i} still running after {timeout} s (load: {os.getloadavg()}); "
                    f"stderr: {error.stderr!r}")
    took = time.monotonic() - started
    assert result.returncode == 0, f"client in peer {i} failed after {took:.1f} s: {result.stderr}"
    return result.stdout


# -- delay, loss, isolation ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan():
    links = [
        LinkSpec(INF, INF, delay_ms=10, loss=0),   # 0
        LinkSpec(INF, INF, delay_ms=30, loss=0),   # 1
        LinkSpec(INF, INF, delay_ms=0, loss=0),    # 2
        LinkSpec(INF, INF, delay_ms=0, loss=0),    # 3
        LinkSpec(INF, INF, delay_ms=0, loss=0.2),  # 4
    ]
    with EmulatedNetwork(links) as net:
        yield net
    assert leftovers(net.prefix) == []


def _median_rtt_ms(net: EmulatedNetwork, a: int, b: int, port: int) -> float:
    server = _server(net, b, ECHO_SERVER, net.address(b), port)
    rtts = json.loads(_client(net, a, RTT_CLIENT, net.address(b), port, 9))
    server.wait(timeout=10)
    return statistics.median(rtts)


def test_round_trip_is_twice_the_sum_of_one_way_delays(wan):
    slow = _median_rtt_ms(wan, 0, 1, 7001)
    fast = _median_rtt_ms(wan, 2, 3, 7002)
    print(f"RTT 10ms<->30ms peers: {slow:.1f} ms; 0ms<->0ms peers: {fast:.2f} ms")
    assert 70 <= slow <= 140
    assert fast < 15


def _delivered(net: EmulatedNetwork, sender: int, receiver: int, port: int, count: int = 3000) -> float:
    server = _server(net, receiver, UDP_RECEIVER, net.address(receiver), port)
    _client(net, sender, UDP_SENDER, net.address(receiver), port, count)
    out, _ = server.communicate(timeout=60)
    return int(out) / count


def _tun_stats(net: EmulatedNetwork, i: int) -> dict:
    """Peer ``i``'s lab0 as ``ip -s -j link`` reports it: its queue length and packet counters."""
    shown = subprocess.run(net.exec_argv(i, ["ip", "-s", "-j", "link", "show", "lab0"]), capture_output=True,
                           text=True, check=True).stdout
    return json.loads(shown)[0]


def test_loss_applies_once_per_link_crossed(wan):
    up = _delivered(wan, 4, 2, 7101)      # through peer 4's lossy uplink
    down = _delivered(wan, 3, 4, 7102)    # through peer 4's lossy downlink
    clean = _delivered(wan, 3, 2, 7103)
    print(f"delivered with loss=0.2 on the sender: {up:.3f}, on the receiver: {down:.3f}, no loss: {clean:.3f}")
    senders = {i: _tun_stats(wan, i) for i in (3, 4)}
    # nothing but the links' loss drops: a hub slow to read (descheduled under load) leaves packets in a
    # queue long enough for every burst here (the kernel's 500 lost 13% beyond the 20% under CI's load)
    assert all(stats["txqlen"] == 10_000 and stats["stats64"]["tx"]["dropped"] == 0 for stats in senders.values()), \
        senders
    assert 0.7 <= up <= 0.9
    assert 0.7 <= down <= 0.9
    assert clean == 1.0


def test_traffic_stays_inside_the_lab(wan):
    probe = """
import errno, socket, sys
try:
    socket.create_connection(("192.0.2.1", 80), timeout=2)  # outside the lab: no route at all
except OSError as e:
    print(e.errno == errno.ENETUNREACH)
s = socket.socket(); s.settimeout(0.5)
try:
    s.connect((sys.argv[1], 80))  # inside the subnet but nobody's address: the hub drops it
except socket.timeout:
    print(True)
"""
    assert _client(wan, 0, probe, "11.77.0.200").split() == ["True", "True"]
    links = subprocess.run(wan.exec_argv(0, ["ip", "-o", "link"]), capture_output=True, text=True, check=False).stdout
    assert sorted(line.split(":")[1].strip() for line in links.splitlines()) == ["lab0", "lo"]
    routes = subprocess.run(wan.exec_argv(0, ["ip", "route"]), capture_output=True, text=True, check=False).stdout
    assert "default" not in routes and "11.77.0.0/16 dev lab0" in routes
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert " lab0:" not in host_links and " labdown:" not in host_links


# -- rates ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rated():
    links = [
        LinkSpec(up_mbit=20, down_mbit=INF, delay_ms=5, loss=0),   # 0: slow uplink
        LinkSpec(up_mbit=INF, down_mbit=100, delay_ms=5, loss=0),  # 1: fast downlink
        LinkSpec(up_mbit=INF, down_mbit=10, delay_ms=5, loss=0),   # 2: slow downlink
    ]
    with EmulatedNetwork(links) as net:
        yield net
    assert leftovers(net.prefix) == []


def _mbit(net: EmulatedNetwork, sender: int, receiver: int, port: int, size: int = 4_000_000) -> float:
    server = _server(net, receiver, SINK, net.address(receiver), port)
    _client(net, sender, SOURCE, net.address(receiver), port, size)
    out, _ = server.communicate(timeout=60)
    result = json.loads(out)
    assert result["bytes"] == size
    return size * 8 / result["seconds"] / 1e6


def test_uplink_and_downlink_rates(rated):
    up = _mbit(rated, 0, 1, 7201)
    down = _mbit(rated, 1, 2, 7202)
    print(f"4 MB over a 20 Mbit/s uplink: {up:.1f} Mbit/s; into a 10 Mbit/s downlink: {down:.1f} Mbit/s")
    assert 14 <= up <= 26
    assert 7 <= down <= 13


def test_traffic_counters_see_what_a_peer_sends(rated):
    sent_before, _ = rated.traffic(1)
    _, received_before = rated.traffic(0)
    _mbit(rated, 1, 0, 7203, size=2_000_000)
    sent, _ = rated.traffic(1)
    _, received = rated.traffic(0)
    # the payload plus TCP/IP headers and the handshake: a little more, never less
    assert 2_000_000 <= sent - sent_before <= 2_300_000
    assert 2_000_000 <= received - received_before <= 2_300_000
    with pytest.raises(ConfigError):
        rated.traffic(3)


# -- lifecycle ----------------------------------------------------------------------------------------

def count_sleeps(leftover: list[str]) -> int:
    return sum(re.fullmatch(r"process \d+ sleep 300", item) is not None for item in leftover)


def test_exit_removes_everything():
    with EmulatedNetwork([LinkSpec(10, 10, 5, 0.1), LinkSpec(INF, INF, 0, 0)]) as net:
        net.popen(0, ["sh", "-c", "sleep 300 & sleep 300"])
        untracked = subprocess.Popen(net.exec_argv(1, ["sleep", "300"]), start_new_session=True)
        present = leftovers(net.prefix)
        deadline = time.monotonic() + 10  # until all three sleeps run (sh forks its own)
        while count_sleeps(present) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
            present = leftovers(net.prefix)
        assert {f"netns {net.prefix}-0", f"netns {net.prefix}-1"} <= set(present)
        assert any("swarmgrad.lab.hub" in item for item in present)
        net.check()
        assert count_sleeps(present) == 3
    assert leftovers(net.prefix) == []
    assert untracked.wait(timeout=5) == -signal.SIGKILL


def test_keyboard_interrupt_inside_the_block_cleans_up():
    net = EmulatedNetwork([LinkSpec(INF, INF, 1, 0), LinkSpec(INF, INF, 1, 0)])
    with pytest.raises(KeyboardInterrupt), net:
        net.popen(1, ["sleep", "300"])
        raise KeyboardInterrupt
    assert leftovers(net.prefix) == []


def test_a_prefix_in_use_is_refused_and_left_alone():
    with EmulatedNetwork([LinkSpec(INF, INF, 0, 0)]) as net:
        with pytest.raises(StartupError, match="in use"):
            EmulatedNetwork([LinkSpec(INF, INF, 0, 0)], prefix=net.prefix).start()
        assert f"netns {net.prefix}-0" in leftovers(net.prefix)
        assert any("swarmgrad.lab.hub" in item for item in leftovers(net.prefix))
    assert leftovers(net.prefix) == []


# Python leaves SIGINT ignored in a child whose parent ignored it (pytest started in the background
# by a non-interactive shell): the driver takes Ctrl-C as a terminal's user would send it
DRIVER = """
import signal, sys, time
from swarmgrad.lab.network import EmulatedNetwork, LinkSpec
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    with EmulatedNetwork([LinkSpec(50, 50, 5, 0), LinkSpec(50, 50, 5, 0.05)]) as net:
        net.popen(0, ["sleep", "300"])
        net.popen(1, [sys.executable, "-c", "import time; time.sleep(300)"])
        print(net.prefix, flush=True)
        time.sleep(300)
except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP as LabTerminated: the CLI pattern
    sys.exit(getattr(exc, "exit_code", 130))
"""


def _driver() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    prefix = process.stdout.readline().strip()
    assert prefix.startswith("sglab-"), "driver did not start"
    return process, prefix


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signalled_lab_process_cleans_up(signum, code):
    process, prefix = _driver()
    assert leftovers(prefix)
    process.send_signal(signum)
    assert process.wait(timeout=20) == code
    assert leftovers(prefix) == []


def test_cleanup_after_sigkill():
    process, prefix = _driver()
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + 10  # the hub notices its control pipe closed and exits
    while any("swarmgrad.lab.hub" in item for item in leftovers(prefix)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = leftovers(prefix)
    assert not any("swarmgrad.lab.hub" in item for item in left)
    assert f"netns {prefix}-0" in left and any("sleep 300" in item for item in left)
    assert prefix in network.stale_prefixes()
    cleanup(prefix)
    assert leftovers(prefix) == []
    assert prefix not in network.stale_prefixes()


# -- configuration and requirements -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"up_mbit": 0, "down_mbit": 1, "delay_ms": 0, "loss": 0},
    {"up_mbit": 1, "down_mbit": -5, "delay_ms": 0, "loss": 0},
    {"up_mbit": 1, "down_mbit": 1, "delay_ms": -1, "loss": 0},
    {"up_mbit": 1, "down_mbit": 1, "delay_ms": math.nan, "loss": 0},
    {"up_mbit": 1, "down_mbit": 1, "delay_ms": 0, "loss": 1},
    {"up_mbit": 1, "down_mbit": 1, "delay_ms": 0, "loss": "0.1"},
])
def test_bad_link_specs_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match="LinkSpec"):
        LinkSpec(**kwargs)


def test_bad_network_arguments_are_config_errors():
    with pytest.raises(ConfigError):
        EmulatedNetwork([])
    with pytest.raises(ConfigError):
        EmulatedNetwork([LinkSpec(1, 1, 0, 0)], prefix="bad prefix/")
    assert network.address(0) == "11.77.0.1" and network.address(250) == "11.77.1.1"


def test_missing_root_or_tools_is_a_startup_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(StartupError, match="root"):
        EmulatedNetwork([LinkSpec(1, 1, 0, 0)]).start()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(host.shutil, "which", lambda tool, path=None: None if "iptables" in tool else "/x")
    with pytest.raises(StartupError, match="apt-get install -y iptables"):
        network.check_requirements()
