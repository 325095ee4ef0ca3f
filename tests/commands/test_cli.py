"""The `swarmgrad` command as a user runs it: real processes, real daemons, loopback only."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]


def swarmgrad(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SWARMGRAD, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0]


class Bootstrap:
    """`swarmgrad bootstrap` in the background; its stdout gives its multiaddrs."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen([*SWARMGRAD, "bootstrap", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        first = self.process.stdout.readline().strip()
        if not first:
            raise RuntimeError(self.process.stderr.read())
        self.maddrs = [first]

    def stop(self, sig=signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        return self.process.wait(timeout=20)


@pytest.fixture
def bootstrap_node():
    nodes = []

    def start(*args):
        node = Bootstrap(*args)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        if node.process.poll() is None:
            node.process.kill()
            node.process.wait()


def test_keygen_then_bootstrap_keeps_peer_id_and_stops_on_signals(tmp_path, bootstrap_node):
    key = tmp_path / "boot.key"
    made = swarmgrad("keygen", str(key))
    assert made.returncode == 0, made.stderr
    peer_id = made.stdout.strip()
    assert peer_id.startswith("12D3KooW")
    assert_one_line_error(swarmgrad("keygen", str(key)), 2, "already exists")

    first = bootstrap_node("--identity", str(key))
    assert first.maddrs[0].startswith("/ip4/127.0.0.1/tcp/") and first.maddrs[0].endswith(f"/p2p/{peer_id}")
    assert first.stop(signal.SIGTERM) == 0
    second = bootstrap_node("--identity", str(key))
    assert second.maddrs[0].endswith(f"/p2p/{peer_id}")
    assert second.stop(signal.SIGINT) == 0


def test_status_lists_members_as_json_and_table(bootstrap_node):
    node = bootstrap_node("--run-id", "cli-run")
    result = swarmgrad("status", "--run-id", "cli-run", "--initial-peers", node.maddrs[0], "--json")
    assert result.returncode == 0, result.stderr
    members = json.loads(result.stdout)
    assert len(members) == 1
    member = members[0]
    assert {"peer_id", "maddrs", "role", "step", "samples_per_second", "last_seen"} <= set(member)
    assert member["role"] == "bootstrap" and node.maddrs[0] in member["maddrs"]
    assert abs(member["last_seen"] - time.time()) < 60

    table = swarmgrad("status", "--run-id", "cli-run", "--initial-peers", node.maddrs[0])
    assert table.returncode == 0 and "bootstrap" in table.stdout and "1 members" in table.stdout


def test_bad_input_gets_one_line_errors(tmp_path, bootstrap_node):
    assert_one_line_error(swarmgrad("status", "--run-id", "r", "--initial-peers", "/ip4/300.1.1.1/tcp/1"), 2,
                          "malformed multiaddr")
    assert_one_line_error(swarmgrad("status", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/5"), 2,
                          "no /p2p/<peer id>")
    assert_one_line_error(swarmgrad("status", "--run-id", "r"), 2, "--initial-peers")
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBrZfzJTLVMLC2mAwJPYFneSwyEVB9XZCPHPrnet727Ah"
    assert_one_line_error(swarmgrad("status", "--run-id", "r", "--initial-peers", unreachable, "--timeout", "2"), 1,
                          "could not reach any initial peer", unreachable)

    node = bootstrap_node()
    assert_one_line_error(swarmgrad("status", "--run-id", "bad run!", "--initial-peers", node.maddrs[0]), 2,
                          "run id")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(swarmgrad("bootstrap", "--port", str(port)), 2, f"port {port}", "in use")

    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"definitely not a key")
    assert_one_line_error(swarmgrad("bootstrap", "--identity", str(garbage)), 2, "not a swarmgrad/libp2p Ed25519 key")
    assert_one_line_error(swarmgrad("bootstrap", "--identity", str(tmp_path)), 2, "cannot read identity file")


def test_demo_trains_digits_with_two_peers_and_serves_its_dashboard(tmp_path):
    plot = tmp_path / "demo.png"
    demo = subprocess.Popen([*SWARMGRAD, "demo", "--peers", "2", "--task", "digits", "--inner-steps", "20",
                             "--target-accuracy", "0.93", "--max-seconds", "30", "--plot", str(plot), "--json",
                             "--dashboard", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.extend(demo.stderr), daemon=True)  # the pipe never fills
    drain.start()
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None and time.monotonic() < deadline and demo.poll() is None:
            time.sleep(0.2)  # the URL comes before the peers start
            url = next((line.split()[1] for line in list(errors) if line.startswith("dashboard: ")), None)
        assert url is not None and url.startswith("http://127.0.0.1:"), errors
        deadline, roles = time.monotonic() + 90, []
        while roles.count("peer") < 2 and time.monotonic() < deadline and demo.poll() is None:
            time.sleep(0.5)
            with urllib.request.urlopen(url + "api/run", timeout=5) as response:
                roles = [row["role"] for row in json.loads(response.read())["members"]]
        assert roles.count("peer") == 2 and "bootstrap" in roles and "monitor" in roles, roles
        stdout = demo.stdout.read()
        demo.wait(timeout=180)
    finally:
        demo.kill()
        drain.join(timeout=10)
    assert demo.returncode == 0, "".join(errors)
    summary = json.loads(stdout)
    assert summary["dashboard"] == url
    assert summary["num_peers"] == 2 and len(summary["peers"]) == 2
    assert summary["final_accuracy"] >= 0.93
    assert summary["seconds_to"]["0.85"] is not None and summary["seconds_to"]["0.85"] <= summary["total_seconds"]
    assert all(peer["rounds_ok"] >= 1 and peer["bytes_sent"] > 0 for peer in summary["peers"].values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -m extended: a wall-clock bar for an idle machine (the demo takes about a minute alone). Beside
# CI's other worker it took 151-237 s, and in one run the final evaluation fell back to 87.6% after 88%
# at 188 s. The demo's paths run in CI: test_demo_trains_digits_with_two_peers_and_serves_its_dashboard.
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)  # above the demo's own 240 s limit, so that one can fire and say why
def test_demo_defaults_reach_88_percent_on_fashion_mnist_within_three_minutes(tmp_path):
    """The README's main job, as shipped: 4 peers, DiLoCo + moshpit + int8, Fashion-MNIST."""
    started = time.monotonic()
    result = swarmgrad("demo", "--json", "--plot", str(tmp_path / "demo.png"), timeout=240)
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["final_accuracy"] >= 0.88, summary
    assert summary["time_to_85"] is not None and summary["time_to_88"] is not None
    assert wall < 180, f"demo took {wall:.0f} s"
