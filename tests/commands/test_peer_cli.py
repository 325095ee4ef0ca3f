"""`swarmgrad peer` end to end: real peer processes, real p2pd daemons, loopback only, the digits task.

Each test starts a bootstrap node and a few `swarmgrad peer ... --json` processes, reads their event
lines (ready, progress, eval, done) and checks what the swarm did. Every peer uses --threads 1.
"""

from __future__ import annotations

import json
import math
import os
import pty
import re
import secrets
import select
import signal
import subprocess
import time

import pytest
import torch
from peer_processes import SWARMGRAD, PeerProcess, Swarm


@pytest.fixture
def swarm():
    """``swarm(prefix)`` starts a bootstrap node for a fresh run id; every process it starts is ended after the test."""
    started: list[Swarm] = []

    def start(prefix: str = "peer-cli") -> Swarm:
        run = Swarm(f"{prefix}-{secrets.token_hex(4)}")
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


def finished(peer: PeerProcess, timeout: float) -> dict:
    """The peer's `done` event, after it exited with code 0."""
    done = peer.done(timeout)
    code = peer.wait_exit(20)
    assert code == 0, peer.describe()
    assert not peer.bad_lines, peer.bad_lines
    return done


def check_event_lines(peer: PeerProcess) -> None:
    """Every stdout line is a JSON event with a time stamp."""
    assert peer.events and len(peer.events) == len(peer.lines), peer.describe()
    assert all(isinstance(event.get("t"), float) and abs(event["t"] - time.time()) < 600 for event in peer.events)
    kinds = [event["event"] for event in peer.events]
    assert kinds[0] == "ready" and kinds[-1] == "done" and kinds.count("done") == 1, kinds


# a loaded 2-core machine can take half a minute to start three peers: wait for each other that long
PATIENT = ["--wait", "90"]

STRATEGIES = {
    "diloco": ["--strategy", "diloco", "--inner-steps", "20"],
    "sync": ["--strategy", "sync", "--target-batch-size", "512"],
    "gossip": ["--strategy", "gossip", "--gossip-every", "4", "--averaging", "gossip"],
}


# sync runs with `-m extended` (CI's 25 minutes): its policy is unit-tested (test_peer_units) and the
# round driver it shares with diloco and gossip runs with real peers in the other two
@pytest.mark.parametrize("strategy", [pytest.param(name, marks=pytest.mark.extended) if name == "sync" else name
                                      for name in STRATEGIES])
def test_three_peers_train_digits_together(swarm, strategy):
    run = swarm(f"strategy-{strategy}")
    peers = [run.peer(*STRATEGIES[strategy], "--shard", str(shard), "--num-shards", "3", "--max-seconds", "10",
                      "--eval-every", "0", "--wait-peers", "3", *PATIENT, name=f"{strategy}{shard}")
             for shard in range(3)]
    readies = [peer.ready(90) for peer in peers]
    assert sorted(ready["shard"] for ready in readies) == [0, 1, 2]
    assert all(ready["num_shards"] == 3 and ready["task"] == "digits" for ready in readies)
    assert all(ready["options"]["strategy"]["name"] == strategy for ready in readies)
    assert len({ready["peer_id"] for ready in readies}) == 3

    # a peer stops between steps; its last step may wait out one gossip push timeout (30 s) to a
    # groupmate that is leaving at the same moment, then it leaves itself (bounded to ~10 s)
    dones = [finished(peer, 10 + 30 + 30) for peer in peers]
    for peer, done in zip(peers, dones):
        check_event_lines(peer)
        status = done["status"]
        assert done["reason"] == "max_seconds", done
        assert done["final"] is not None and done["final"]["accuracy"] >= 0.80, (peer.name, done)
        assert status["rounds_ok"] >= 1 and status["bytes_sent"] > 0, (peer.name, status)
        assert status["bytes_received"] > 0, (peer.name, status)
        assert status["step"] > 0 and status["samples"] > 0
        assert max(event["peers"] for event in peer.of("progress")) == 3, peer.describe()  # it saw the others


def test_private_peers_report_growing_epsilon(swarm):
    run = swarm("privacy")
    # per-sample DP-SGD, chosen explicitly (the run default level is "update"). The peers train long
    # enough for `status` to find them: at 12 s, on a loaded CI host, they had left before the status
    # checks below began, and every listing was empty (2 CI runs)
    # the creator runs the documented command (examples/join_public_run.md); the other joins by the
    # run's manifest alone, so its sample rate (batch/shard) is its own, never the manifest's
    local = ["--num-shards", "2", "--max-seconds", "30", "--eval-every", "0", "--wait-peers", "2", *PATIENT]
    creator = run.peer("--create", "--strategy", "diloco", "--inner-steps", "20", "--privacy-level", "sample",
                       "--privacy-clip", "1.0", "--privacy-noise", "1.0", "--shard", "0", *local, name="private0")
    joiner = run.peer("--shard", "1", *local, task=None, name="private1")
    peers = [creator, joiner]
    for peer in peers:
        ready = peer.ready(90)
        assert ready["options"]["privacy"]["noise_multiplier"] == 1.0
        assert ready["options"]["privacy"]["level"] == "sample"

    # while they train, `swarmgrad status` lists both with the privacy they spent
    for peer in peers:
        peer.wait_event("progress", 30, lambda event: event["epsilon"] is not None and event["epsilon"] > 0)
    ids = {peer.last("ready")["peer_id"] for peer in peers}
    deadline, members = time.monotonic() + 20, []
    while time.monotonic() < deadline:
        result = run.run("status", "--run-id", run.run_id, "--initial-peers", run.bootstrap.maddr, "--json")
        assert result.returncode == 0, result.stderr
        members = {member["peer_id"]: member for member in json.loads(result.stdout)}
        if ids <= set(members) and all(isinstance(members[i].get("epsilon"), float) for i in ids):
            break
        time.sleep(0.5)
    assert ids <= set(members), members
    for peer_id in ids:
        assert members[peer_id]["role"] == "peer"
        assert isinstance(members[peer_id]["epsilon"], float) and members[peer_id]["epsilon"] > 0, members[peer_id]

    for peer in peers:
        done = finished(peer, 90)
        assert done["final"]["accuracy"] >= 0.70, (peer.name, done)
        assert done["status"]["rounds_ok"] >= 1, done["status"]
        epsilons = [event["epsilon"] for event in peer.of("progress")]
        assert all(isinstance(e, float) and math.isfinite(e) and e > 0 for e in epsilons), epsilons
        assert all(later >= earlier for earlier, later in zip(epsilons, epsilons[1:])), epsilons
        assert epsilons[-1] > epsilons[0], epsilons
        assert done["status"]["epsilon"] == pytest.approx(epsilons[-1])


def test_mid_run_joiner_downloads_the_swarms_state(swarm):
    run = swarm("joiner")
    common = ["--strategy", "diloco", "--inner-steps", "20", "--num-shards", "3", "--eval-every", "1"]
    # the originals evaluate (a cheap digits evaluation) as often as they can: an epoch takes ~0.1 s,
    # and the joiner's evaluation is compared with theirs of a nearby epoch
    # the originals train until the test stops them (the cap is a backstop): a joiner that took long to
    # start on a loaded machine found a fixed 22 s run over, nobody left to download from
    originals = [run.peer(*common, "--eval-every", "0.1", "--shard", str(shard), "--max-seconds", "150",
                          "--wait-peers", "2", *PATIENT, name=f"original{shard}") for shard in range(2)]
    for peer in originals:
        peer.ready(90)
    for peer in originals:  # the swarm is under way: each original has averaged at least once
        peer.wait_until(lambda peer=peer: (peer.progress_value("rounds_ok") or 0) >= 1, 30, "a first round")
        assert peer.process.poll() is None, peer.describe()

    joiner = run.peer(*common, "--shard", "2", "--max-seconds", "5", *PATIENT, name="joiner")
    ready = joiner.ready(90)
    assert ready["state_downloads"] >= 1, ready
    assert ready["epoch"] > 0, ready
    first = joiner.wait_event("eval", 30)
    # of the state it took, before its first step: its accuracy is the download's, not its training's
    assert first["epoch"] == ready["epoch"] and first["step"] == ready["step"] == 0, (ready, first)
    # the swarm's accuracy at the same state: the originals' evaluations of snapshots within 2 epochs
    # of the joiner's (an eval event's epoch is its snapshot's; evaluations run in the background and
    # report in snapshot order, so those before it are all in once it has reported one at or after it)
    for peer in originals:
        peer.wait_event("eval", 30, lambda event: event["epoch"] >= first["epoch"])
    nearby = [event for peer in originals for event in peer.of("eval") if abs(event["epoch"] - first["epoch"]) <= 2]
    assert nearby, (first, [[event["epoch"] for event in peer.of("eval")] for peer in originals])
    gaps = [abs(first["accuracy"] - event["accuracy"]) for event in nearby]
    assert min(gaps) <= 0.02, (first, nearby)
    assert first["accuracy"] >= 0.5, first  # a fresh model would be near chance (0.1)

    finished(joiner, 30)
    for peer in originals:
        peer.signal(signal.SIGTERM)
    for peer in originals:
        assert finished(peer, 40)["reason"] == "signal SIGTERM"


@pytest.mark.extended  # CI's quick churn lab run (test_lab_driver) SIGKILLs a peer of three and checks the others go on
def test_swarm_survives_a_sigkilled_peer(swarm):
    run = swarm("sigkill")
    peers = [run.peer("--strategy", "diloco", "--inner-steps", "20", "--shard", str(shard), "--num-shards", "3",
                      "--max-seconds", "18", "--eval-every", "0", "--wait-peers", "3", *PATIENT, name=f"peer{shard}")
             for shard in range(3)]
    for peer in peers:
        peer.ready(90)
    victim, survivors = peers[0], peers[1:]
    for peer in peers:
        peer.wait_event("progress", 30, lambda event: event["rounds_ok"] >= 2)
    victim.signal(signal.SIGKILL)
    assert victim.wait_exit(10) == -signal.SIGKILL
    killed_at = {peer.name: peer.progress_value("rounds_ok") for peer in survivors}

    for peer in survivors:
        peer.wait_event("progress", 40, lambda event, base=killed_at[peer.name]: event["rounds_ok"] >= base + 2)
    for peer in survivors:
        done = finished(peer, 40)
        assert done["reason"] == "max_seconds"
        assert done["status"]["rounds_ok"] >= killed_at[peer.name] + 2, (killed_at, done["status"])
        assert done["final"]["accuracy"] >= 0.80, done
    assert "done" not in {event["event"] for event in victim.events}


def test_restart_resumes_from_checkpoint_with_privacy_budget(swarm, tmp_path):
    run = swarm("restart")
    checkpoints = tmp_path / "ckpt"
    # per-sample DP-SGD in a created run: a lone peer releases no update, but every one of its steps spends budget
    flags = ["--create", "--checkpoint-dir", str(checkpoints), "--privacy-clip", "1.0", "--privacy-noise", "1.0",
             "--privacy-level", "sample", "--inner-steps", "20", "--eval-every", "0"]
    first = run.peer(*flags, "--max-steps", "300", name="first")
    ready = first.ready(90)
    assert ready["epoch"] == 0 and ready["step"] == 0
    done = finished(first, 120)  # upper bounds: 300 per-sample DP steps took 60+ s on a slow CI host
    assert done["reason"] == "max_steps" and done["step"] == 300, done
    first_epsilon = done["status"]["epsilon"]
    assert isinstance(first_epsilon, float) and first_epsilon > 0, done
    assert (checkpoints / "latest").is_file()

    second = run.peer(*flags, "--max-steps", "600", name="second")
    resumed = second.ready(90)
    assert resumed["epoch"] > 0 and resumed["step"] >= 300, resumed
    assert resumed["epoch"] >= done["epoch"] - 1, (resumed, done)
    again = finished(second, 120)
    assert again["reason"] == "max_steps" and again["step"] == 600, again
    assert again["status"]["epsilon"] > first_epsilon, (first_epsilon, again["status"])
    progress = [event["epsilon"] for event in second.of("progress")]
    assert progress and progress[0] >= first_epsilon, (first_epsilon, progress)  # the budget was not reset
    assert again["final"]["accuracy"] >= 0.5, again


def test_public_run_manifest_gives_joiners_the_settings(swarm):
    run = swarm("public")
    # the test stops the creator itself: its own clock must not end it first (on a slow host the two
    # one-shot runs below took so long that it stopped at max_seconds, and the SIGTERM came after)
    creator = run.peer("--create", "--strategy", "diloco", "--inner-steps", "20", "--max-seconds", "600",
                       "--eval-every", "0", "--wait-peers", "2", *PATIENT, name="creator")
    volunteer = run.peer("--max-seconds", "10", "--wait-peers", "2", *PATIENT, task=None, name="volunteer")
    made = creator.ready(90)
    joined = volunteer.ready(90)
    assert made["task"] == "digits" and made["options"]["strategy"]["inner_steps"] == 20
    assert joined["task"] == "digits", joined
    assert joined["options"]["strategy"]["inner_steps"] == 20, joined["options"]
    assert joined["options"] == made["options"]
    done = finished(volunteer, 40)
    assert done["status"]["rounds_ok"] >= 1, done["status"]

    # while the creator still trains (and keeps its manifest published)
    assert creator.process.poll() is None, creator.describe()
    conflict = run.run("peer", "digits", "--run-id", run.run_id, "--initial-peers", run.bootstrap.maddr,
                       "--strategy", "sync", "--threads", "1", "--max-seconds", "2", "--json")
    wrong_task = run.run("peer", "charlm", "--run-id", run.run_id, "--initial-peers", run.bootstrap.maddr,
                         "--threads", "1", "--max-seconds", "2", "--json")

    creator.signal(signal.SIGTERM)
    stopped = finished(creator, 30)
    assert stopped["reason"] == "signal SIGTERM", stopped
    assert stopped["status"]["rounds_ok"] >= 1

    assert_one_line_error(conflict, "strategy")
    assert conflict.returncode == 2
    # a TASK that differs from the manifest's must be refused, not silently replaced by the run's task
    # (fails while swarmgrad/peer/manifest.py settle_run returns manifest.task and drops the given TASK)
    assert_one_line_error(wrong_task, "charlm", "digits")


def test_first_peer_of_a_run_needs_no_initial_peers(swarm):
    """`--create` without `--initial-peers`: the run's first peer listens, says how others join, trains."""
    run = swarm("first")
    first = run.peer("--create", "--inner-steps", "20", "--max-steps", "30", "--eval-every", "0",
                     initial_peers=False, name="first")
    ready = first.ready(90)
    assert ready["maddrs"] and all(maddr.startswith("/ip4/127.0.0.1/tcp/") for maddr in ready["maddrs"]), ready
    assert ready["options"]["strategy"]["inner_steps"] == 20
    done = finished(first, 60)
    assert done["reason"] == "max_steps" and done["step"] == 30, done
    hints = [line for line in first.stderr_lines if line.startswith("others join with: ")]
    assert hints == [f"others join with: swarmgrad peer --run-id {run.run_id} --initial-peers "
                     f"{','.join(ready['maddrs'])}"], first.describe()


# -m extended (CI's 25 minutes): the manifest's settings reaching a joiner are checked by
# test_public_run_manifest_gives_joiners_the_settings, the first peer's listening and join hint by
# test_first_peer_of_a_run_needs_no_initial_peers; this one joins through that hint alone
@pytest.mark.extended
def test_second_peer_joins_the_first_through_its_manifest(swarm):
    """The joiner gives only the run id and the first peer's address; the manifest gives the rest."""
    run = swarm("join-first")
    # it waits for the joiner, so it must say how to join before its `ready`
    first = run.peer("--create", "--inner-steps", "20", "--max-seconds", "60", "--eval-every", "0",
                     "--num-shards", "2", "--shard", "0", "--wait-peers", "2", *PATIENT, initial_peers=False,
                     name="first")
    hint = first.wait_until(lambda: next((line for line in first.stderr_lines
                                          if line.startswith("others join with: ")), None), 90, "the join hint")
    assert not first.of("ready"), first.describe()
    address = hint.split("--initial-peers ")[1].split(",")[0]
    joiner = run.peer("--initial-peers", address, "--num-shards", "2", "--shard", "1", "--max-seconds",
                      "10", "--wait-peers", "2", *PATIENT, task=None, initial_peers=False, name="joiner")
    made, joined = first.ready(90), joiner.ready(90)
    assert joined["task"] == "digits" and joined["options"] == made["options"], (joined, made)
    done = finished(joiner, 40)
    assert done["status"]["rounds_ok"] >= 1, done["status"]
    assert first.process.poll() is None, first.describe()
    first.signal(signal.SIGTERM)
    assert finished(first, 30)["reason"] == "signal SIGTERM"


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode != 0, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert not any('"event": "ready"' in line for line in result.stdout.splitlines()), result.stdout[-2000:]


def run_on_a_terminal(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` with its stderr on a pseudo-terminal (what a volunteer's shell gives it); returns
    the exit code and everything it drew there."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="120", LINES="40", TERM="xterm-256color")
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    drawn, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other end closed: the process exited
                break
            if not chunk:
                break
            drawn += chunk
        elif process.poll() is not None:
            break
    os.close(master)
    try:
        code = process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"still running after {timeout} s:\n{drawn.decode(errors='replace')[-3000:]}") from None
    return code, drawn.decode(errors="replace")


def test_a_lone_volunteer_sees_a_live_panel_on_a_terminal_and_plain_lines_on_a_pipe():
    def argv(run_id: str) -> list[str]:
        return [*SWARMGRAD, "peer", "digits", "--run-id", run_id, "--create", "--max-seconds", "6",
                "--eval-every", "1", "--threads", "1"]

    on_a_pipe = subprocess.Popen(argv(f"pipe-{secrets.token_hex(4)}"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    code, drawn = run_on_a_terminal(argv(f"tty-{secrets.token_hex(4)}"), timeout=90)
    stdout, lines = on_a_pipe.communicate(timeout=90)
    assert code == 0, drawn[-3000:]
    assert "╭─ swarmgrad · run tty-" in drawn and "samples/s" in drawn and "rounds" in drawn, drawn[-3000:]
    assert "held-out accuracy" in drawn and "final held-out accuracy" in drawn, drawn[-3000:]
    assert "\x1b[1A" in drawn  # redrawn in place, not scrolled
    assert not re.search(r"^step +\d+ +epoch", drawn, re.M), drawn[-3000:]

    assert on_a_pipe.returncode == 0 and stdout == "", lines
    assert re.search(r"^step +\d+ +epoch +\d+ +loss", lines, re.M), lines
    assert re.search(r"^held-out accuracy 0\.\d+", lines, re.M), lines
    assert "stopped (max_seconds)" in lines and "╭" not in lines and "\x1b[" not in lines, lines


def test_a_micro_batching_peer_trains_and_averages_with_a_whole_batch_one(swarm):
    """--micro-batch 8 in a run of batch 32: the gradient is accumulated over 4 slices, so the peer trains
    the run's batch size and averages with a peer computing whole batches; --device picks where."""
    run = swarm("micro")
    common = ["--inner-steps", "10", "--batch-size", "32", "--max-seconds", "10", "--eval-every", "0",
              "--num-shards", "2", "--wait-peers", "2", *PATIENT]
    sliced = run.peer(*common, "--shard", "0", "--device", "cpu", "--micro-batch", "8", name="sliced")
    whole = run.peer(*common, "--shard", "1", "--device", "auto", name="whole")
    ready = sliced.ready(90)
    assert (ready["device"], ready["precision"], ready["micro_batch"]) == ("cpu", "fp32", 8), ready
    expected_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert whole.ready(90)["device"] == expected_device and whole.ready(90)["micro_batch"] == 32
    for peer in (sliced, whole):
        done = finished(peer, 10 + 30 + 30)
        assert done["status"]["rounds_ok"] >= 1, (peer.name, done["status"])
        assert done["final"]["accuracy"] >= 0.8, (peer.name, done)
