"""`swarmgrad dashboard` on a real swarm: a bootstrap node, two `swarmgrad peer digits` processes (one
evaluates and serves --metrics-port), the dashboard as a user starts it, and headless Chromium
loading its page. Loopback only; one swarm shared by the module's tests (they run in file order,
the one that kills a peer last)."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from html.parser import HTMLParser

import pytest
from conftest import run_async
from peer_processes import SWARMGRAD, Process, Swarm
from prometheus_client.parser import text_string_to_metric_families

from swarmgrad.dht.config import NodeConfig
from swarmgrad.dht.evaluations import EvaluationRecord, evaluation, evaluations_key
from swarmgrad.dht.membership import MemberRecord, Progress, TrainingStats, members_key
from swarmgrad.dht.node import SwarmNode
from swarmgrad.version import __version__

PATIENT = ["--wait", "90"]  # a loaded 2-core machine can take half a minute to start the peers
CHROMIUM = shutil.which("chromium")


class Dashboard(Process):
    """`swarmgrad dashboard ... --port 0`; its first stdout line is the page's URL."""

    def __init__(self, run_id: str, maddr: str):
        super().__init__([*SWARMGRAD, "dashboard", "--run-id", run_id, "--initial-peers", maddr, "--port", "0"],
                         f"dashboard {run_id}")
        self.url = self.wait_until(lambda: self.lines[0] if self.lines else None, 60, "its URL")
        self.remember_daemons()

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            assert response.status == 200, path
            return response.read()

    def api(self, path: str = "run") -> dict:
        return json.loads(self.get(f"api/{path}"))

    def wait_for(self, condition, seconds: float, what: str):
        """Poll the API until ``condition(run)`` is true, and return that ``/api/run``; every call must be answered."""
        deadline = time.monotonic() + seconds
        while True:
            run = self.api()
            if condition(run):
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not seen within {seconds} s; last /api/run: {json.dumps(run)[:3000]}")
            time.sleep(0.5)


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/setup.sh installs Debian's `chromium` package when run "
                    "as root (apt-get install chromium)")
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=4000", *args], capture_output=True, text=True, timeout=timeout)


class PageParser(HTMLParser):
    """The rendered page's member rows, chart point counts and message, from Chromium's DOM dump."""

    def __init__(self) -> None:
        super().__init__()
        self.member_rows: dict[str, str] = {}  # peer id -> row class
        self.points: dict[str, int] = {}
        self.message_hidden = True
        self.message = ""
        self._in_message = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "tr" and "member" in classes:
            self.member_rows[attributes["data-peer-id"]] = " ".join(classes)
        if attributes.get("id", "").startswith("chart-"):
            self.points[attributes["id"]] = int(attributes.get("data-points", "0"))
        if attributes.get("id") == "message":
            self.message_hidden, self._in_message = "hidden" in attributes, True

    def handle_data(self, data: str) -> None:
        if self._in_message:
            self.message += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self._in_message = False


def rendered(url: str) -> PageParser:
    result = chromium("--dump-dom", url)
    assert result.returncode == 0 and "</html>" in result.stdout, result.stderr[-3000:]
    page = PageParser()
    page.feed(result.stdout)
    return page


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


class Run:
    def __init__(self) -> None:
        self.swarm = Swarm(f"dashboard-{secrets.token_hex(4)}")
        common = ["--inner-steps", "10", "--num-shards", "2", "--max-seconds", "240", "--wait-peers", "2", *PATIENT]
        self.evaluator = self.swarm.peer(*common, "--shard", "0", "--eval-every", "1", "--metrics-port", "0",
                                         "--no-final-eval",
                                         name="evaluator")
        self.other = self.swarm.peer(*common, "--shard", "1", "--eval-every", "0", "--no-final-eval", name="other")
        self.board = self.swarm._track(Dashboard(self.swarm.run_id, self.swarm.bootstrap.maddr))
        self.ids = {peer.ready(90)["peer_id"] for peer in (self.evaluator, self.other)}


@pytest.fixture(scope="module")
def run():
    started = Run()
    yield started
    started.swarm.close()


def live_ids(run_json: dict) -> set[str]:
    return {row["peer_id"] for row in run_json["members"] if row["status"] == "live"}


def test_the_page_shows_every_member_and_the_accuracy_curve(run, tmp_path):
    board = run.board
    run_json = board.wait_for(lambda r: run.ids <= live_ids(r) and len(r["members"]) >= 3, 60, "every member")
    monitor = next(row for row in run_json["members"] if row["role"] == "monitor")  # the dashboard itself
    assert monitor["reachability"] == "client"
    board.wait_for(lambda r: sum(len(e["results"]) for e in board.api("evaluations")["evaluators"]) >= 3, 60,
                   "three published evaluations")

    page = rendered(board.url)
    members = {row["peer_id"] for row in board.api()["members"]}
    assert run.ids | {monitor["peer_id"]} <= set(page.member_rows), (page.member_rows, members)
    assert all("live" in page.member_rows[peer_id] for peer_id in run.ids), page.member_rows
    assert page.points["chart-accuracy"] >= 3, page.points
    assert page.points["chart-speed"] >= 1 and page.points["chart-members"] >= 1, page.points
    assert page.message_hidden, page.message

    screenshot = tmp_path / "dashboard.png"
    result = chromium(f"--screenshot={screenshot}", "--window-size=1400,1500", board.url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000


def test_metrics_of_the_dashboard_and_of_a_peer_parse(run):
    evaluator_id = run.evaluator.last("ready")["peer_id"]
    run.board.wait_for(lambda r: r["summary"]["rounds_ok"] >= 1, 60, "an averaging round")
    # xdist may run this test first, on its own run: the evaluator's first evaluation may not be read yet
    run.board.wait_for(lambda r: any(e["peer_id"] == evaluator_id and e["results"][-1]["accuracy"] > 0.5
                                     for e in run.board.api("evaluations")["evaluators"]),
                       60, "the evaluator's published evaluation above 50%")
    board = metric_samples(run.board.get("metrics").decode())
    assert board[("swarmgrad_run_members", (("role", "peer"),))] == 2
    assert board[("swarmgrad_run_members", (("role", "monitor"),))] == 1
    assert board[("swarmgrad_run_training_peers", ())] == 2
    assert board[("swarmgrad_run_samples_per_second", ())] > 0
    assert board[("swarmgrad_run_rounds_total", (("outcome", "ok"),))] >= 1
    assert 0.5 < board[("swarmgrad_run_eval_accuracy", (("peer_id", evaluator_id),))] <= 1.0
    assert board[("swarmgrad_dashboard_dht_reads_total", (("record", "members"),))] >= 1

    url = run.evaluator.last("ready")["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

    def peer_metrics() -> dict:
        with urllib.request.urlopen(url, timeout=5) as response:
            return metric_samples(response.read().decode())

    deadline = time.monotonic() + 60
    while (peer := peer_metrics()).get(("swarmgrad_peer_rounds_total", (("outcome", "ok"),)), 0) < 1:
        assert time.monotonic() < deadline, peer
        time.sleep(0.5)
    assert peer[("swarmgrad_peer_info", (("peer_id", evaluator_id), ("run_id", run.swarm.run_id),
                                         ("version", __version__)))] == 1
    assert peer[("swarmgrad_peer_steps_total", ())] > 0
    assert peer[("swarmgrad_peer_samples_total", ())] >= peer[("swarmgrad_peer_steps_total", ())]
    assert peer[("swarmgrad_peer_samples_per_second", ())] > 0
    assert peer[("swarmgrad_peer_peers", ())] == 2
    assert peer[("swarmgrad_peer_round_seconds_count", ())] >= 1
    assert 0 < peer[("swarmgrad_peer_round_seconds_sum", ())] < 600
    assert peer[("swarmgrad_peer_bytes_sent_total", ())] > 0 and peer[("swarmgrad_peer_bytes_received_total", ())] > 0
    assert 0 < peer[("swarmgrad_peer_loss", ())] < 10
    assert 0.5 < peer[("swarmgrad_peer_eval_accuracy", ())] <= 1.0
    assert ("swarmgrad_peer_state_downloads_total", ()) in peer and ("swarmgrad_peer_epsilon", ()) not in peer
    held = {labels[0][1]: value for (name, labels), value in peer.items() if name == "swarmgrad_peer_swarm_memory_bytes"}
    assert held["outer_start"] == held["outer_momentum"] > 0 and "contribution" in held, held


def test_page_views_cost_the_swarm_no_dht_reads(run):
    board = run.board
    before, started = board.api()["dht"], time.monotonic()
    for _ in range(25):
        for path in ("", "api/run", "api/history", "api/evaluations", "metrics", "static/dashboard.js"):
            board.get(path)
    after, elapsed = board.api()["dht"], time.monotonic() - started
    made = sum(after["reads"].values()) - sum(before["reads"].values())
    scheduled = elapsed * after["scheduled_reads_per_second"]
    assert made <= scheduled + 2, (made, scheduled, elapsed)  # 150 requests, and only the schedule's reads
    assert after["scheduled_reads_per_second"] == pytest.approx(1 / 2 + 1 / 5)
    assert 0.3 < after["reads_per_second"] < 1.5, after  # the schedule, plus the first reads at start


def test_an_unknown_run_id_shows_an_empty_run_with_a_message(run):
    nobody = run.swarm._track(Dashboard(f"nobody-{secrets.token_hex(4)}", run.swarm.bootstrap.maddr))
    empty = nobody.wait_for(lambda r: r["members_read_at"] and r["members"], 30, "a first read")
    assert "No peers of run" in empty["message"], empty["message"]
    assert [row["role"] for row in empty["members"]] == ["monitor"]  # only the dashboard itself
    assert nobody.api("evaluations") == {"evaluators": []}
    page = rendered(nobody.url)
    assert not page.message_hidden and "No peers of run" in page.message, page.message
    assert page.points["chart-accuracy"] == 0
    nobody.close()


def test_a_lying_peer_neither_breaks_nor_dominates_the_dashboard(run):
    board, now = run.board, time.time()

    async def lie() -> str:
        async with SwarmNode(NodeConfig(initial_peers=[run.swarm.bootstrap.maddr])) as liar:
            claims = MemberRecord(maddrs=liar.maddrs, role="peer", version="<script>x</script>", step=10**15,
                                  samples_per_second=1e15, updated_at=time.time(),
                                  progress=Progress(epoch=10**9, samples=0, steps=0, steps_per_second=0.0),
                                  stats=TrainingStats(loss=-1e9, rounds_ok=0))
            assert await liar.store(members_key(run.swarm.run_id), claims, time.time() + 60)
            future = EvaluationRecord(task="digits", results=[
                evaluation(1.0, 0.0, epoch=10**9, step=1, evaluated_at=now + 7200)])
            assert await liar.store(evaluations_key(run.swarm.run_id), future, time.time() + 60)
            # and bytes that are no record at all: the DHT's validators refuse them
            await liar.dht.store(evaluations_key(run.swarm.run_id), b"\xc1garbage", time.time() + 60,
                                 subkey=liar.peer_id)
            await asyncio.to_thread(board.wait_for, lambda r: liar.peer_id in live_ids(r), 30, "the liar's row")
            await asyncio.sleep(6)  # past the next evaluations read
            return liar.peer_id

    liar_id = run_async(lie())
    run_json = board.api()
    row = next(row for row in run_json["members"] if row["peer_id"] == liar_id)
    assert row["version"] == "<script>x</script>" and row["samples_per_second"] == 1e15  # attributed, as claimed
    honest = [r["samples_per_second"] for r in run_json["members"] if r["peer_id"] in run.ids]
    assert run_json["summary"]["samples_per_second"] < 1e15 / 1e6, run_json["summary"]  # capped at 100 x median
    assert run_json["summary"]["epoch"] < 10**9  # the median of three claims
    assert liar_id not in {e["peer_id"] for e in board.api("evaluations")["evaluators"]}  # results from the future
    page = rendered(board.url)
    assert liar_id in page.member_rows and run.ids <= set(page.member_rows)  # the page still renders (no script ran)
    assert all(speed is not None for speed in honest)


def test_the_dashboard_keeps_serving_while_peers_die_and_join(run):
    board = run.board
    victim_id = run.other.last("ready")["peer_id"]
    run.other.signal(9)  # SIGKILL: no leave record, its presence record simply stops being refreshed
    board.wait_for(lambda r: {row["peer_id"]: row["status"] for row in r["members"]}.get(victim_id)
                   in ("quiet", "expired"), 30, "the killed peer greyed out")
    newcomer = run.swarm.peer("--inner-steps", "10", "--num-shards", "2", "--shard", "1", "--eval-every", "0",
                              "--no-final-eval", "--max-seconds", "120", *PATIENT, name="newcomer")
    newcomer_id = newcomer.ready(90)["peer_id"]
    board.wait_for(lambda r: newcomer_id in live_ids(r), 30, "the newcomer's row")
    statuses = {row["peer_id"]: row["status"] for row in board.api()["members"]}
    assert statuses.get(victim_id, "forgotten") in ("expired", "forgotten"), statuses
    assert board.process.poll() is None, board.describe()


def test_a_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBrZfzJTLVMLC2mAwJPYFneSwyEVB9XZCPHPrnet727Ah"
        board = subprocess.run([*SWARMGRAD, "dashboard", "--run-id", "r", "--initial-peers", unreachable,
                                "--port", str(port)], capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 20  # refused before any daemon or DHT bootstrap
        peer = subprocess.run([*SWARMGRAD, "peer", "digits", "--run-id", "r", "--create", "--max-steps", "1",
                               "--metrics-port", str(port)], capture_output=True, text=True, timeout=90)
    for result, fragment in ((board, f"port {port} on 127.0.0.1 is in use"),
                             (peer, f"metrics port {port} on 127.0.0.1 is in use")):
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in result.stderr, result.stderr
    assert '"event"' not in peer.stdout
