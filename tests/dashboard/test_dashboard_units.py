"""The dashboard's parts without a swarm: evaluation records, the run state (rows, curves, bounds,
lying peers), the web API over loopback HTTP, and the peer's terminal panel."""

from __future__ import annotations

import asyncio
import json
import math
import time

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import run_async
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from swarmgrad.commands.peer_view import PanelState, render_panel
from swarmgrad.dashboard.server import Dashboard
from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.dashboard.state import RunState, robust_sum
from swarmgrad.dht.config import NodeConfig
from swarmgrad.dht.evaluations import (
    KEEP,
    MAX_RESULTS,
    EvaluationLog,
    EvaluationRecord,
    credible,
    evaluation,
    evaluations_key,
)
from swarmgrad.dht.identity import Identity
from swarmgrad.dht.membership import MemberRecord, Progress, TrainingStats, members_key
from swarmgrad.dht.records import ENVELOPE_VERSION, RecordError, SignedRecord, _signed_part, open_envelope, seal

RUN = "units"
NOW = 1_800_000_000.0


def raw_envelope(identity: Identity, key: str, kind: str, body: dict, expires: float) -> bytes:
    """A correctly signed envelope around any body, valid or not: what a lying peer can send."""
    fields = {"v": ENVELOPE_VERSION, "kind": kind, "key": key, "subkey": identity.peer_id, "expires": float(expires),
              "body": msgpack.packb(body, use_bin_type=True), "pub": identity.public_key}
    fields["sig"] = identity.sign(_signed_part(fields))
    return msgpack.packb(fields, use_bin_type=True)


def result(t: float, accuracy: float = 0.5, **fields) -> dict:
    return {"evaluated_at": t, "epoch": 1, "step": 10, "accuracy": accuracy, "loss": 1.0, **fields}


# -- evaluation records --------------------------------------------------------------------------


def test_an_evaluation_record_round_trips_signed():
    identity = Identity.generate()
    record = EvaluationRecord(task="digits", results=[evaluation(0.9, 0.3, epoch=2, step=40, evaluated_at=NOW,
                                                                 samples=359)])
    opened = open_envelope(seal(identity, evaluations_key(RUN), record, time.time() + 60))
    assert opened.owner == identity.peer_id and opened.body == record
    assert evaluation(0.5, math.nan, epoch=0, step=0).loss is None  # a diverged loss is left out, not NaN
    assert evaluation(0.1, 3e10, epoch=0, step=0).loss is None  # finite but past the bound: a crash before


@pytest.mark.parametrize("body, why", [
    ({"task": "t", "results": [result(NOW, accuracy=1.5)]}, "accuracy above 1"),
    ({"task": "t", "results": [result(NOW, accuracy=math.nan)]}, "NaN accuracy"),
    ({"task": "t", "results": [result(NOW, loss=math.inf)]}, "infinite loss"),
    ({"task": "t", "results": [result(NOW, accuracy="0.9")]}, "a string for a number"),
    ({"task": "t", "results": [result(NOW, epoch=-1)]}, "negative epoch"),
    ({"task": "t", "results": [result(NOW + 1), result(NOW)]}, "out of order"),
    ({"task": "t", "results": []}, "no result"),
    ({"task": "t", "results": [result(NOW + i) for i in range(MAX_RESULTS + 1)]}, "too many results"),
    ({"task": "x" * 65, "results": [result(NOW)]}, "a task name too long"),
])
def test_a_malformed_evaluation_record_is_refused(body, why):
    envelope = raw_envelope(Identity.generate(), evaluations_key(RUN), "evaluation", body, time.time() + 60)
    with pytest.raises(RecordError):
        open_envelope(envelope)


def test_results_from_the_future_are_dropped():
    record = EvaluationRecord(results=[evaluation(0.5, 1.0, epoch=1, step=1, evaluated_at=NOW),
                                       evaluation(1.0, 0.0, epoch=9, step=9, evaluated_at=NOW + 3600)])
    kept = credible(record, now=NOW)
    assert kept is not None and [r.accuracy for r in kept.results] == [0.5]
    assert credible(EvaluationRecord(results=[record.results[1]]), now=NOW) is None


class StoringNode:
    """Records what an EvaluationLog stores (the DHT itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, EvaluationRecord, float]] = []

    async def store(self, key: str, body: EvaluationRecord, expires: float) -> bool:
        self.stored.append((key, body, expires))
        return True


def test_the_evaluation_log_republishes_its_last_results_in_order():
    node = StoringNode()
    log = EvaluationLog(node, RUN, task="digits")  # type: ignore[arg-type]

    async def scenario():
        for i in range(KEEP + 5):
            assert await log.add(evaluation(i / 100, 1.0, epoch=i, step=i, evaluated_at=NOW + i))

    run_async(scenario())
    key, record, expires = node.stored[-1]
    assert key == evaluations_key(RUN) and record.task == "digits"
    assert [r.epoch for r in record.results] == list(range(5, KEEP + 5))  # the last KEEP, oldest first
    assert expires > time.time() and log.latest == record.results[-1]
    assert len(node.stored) == KEEP + 5


# -- the run state -------------------------------------------------------------------------------


def member(owner: str, t: float, *, ttl: float = 6.0, state: str = "alive", role: str = "peer", step: int = 10,
           rate: float = 100.0, epoch: int = 3, loss: float | None = 0.5, rounds: int = 1,
           maddrs: list[str] | None = None) -> SignedRecord[MemberRecord]:
    body = MemberRecord(maddrs=maddrs if maddrs is not None else [f"/ip4/127.0.0.1/tcp/1/p2p/{owner}"], role=role,
                        version="0.1.0", step=step, samples_per_second=rate, updated_at=t, state=state,
                        progress=Progress(epoch=epoch, samples=0, steps=0, steps_per_second=1.0)
                        if role == "peer" else None,
                        stats=TrainingStats(loss=loss, rounds_ok=rounds, rounds_failed=0, bytes_sent=1000 * rounds)
                        if role == "peer" else None)
    return SignedRecord(key=members_key(RUN), owner=owner, expires=t + ttl, body=body)


def state(**settings) -> RunState:
    return RunState(RUN, DashboardSettings(**settings), started_at=NOW)


def statuses(run: RunState, now: float) -> dict[str, str]:
    return {row["peer_id"]: row["status"] for row in run.members_json(now)}


def test_rows_go_quiet_then_away_then_are_forgotten():
    run = state(forget_after=10.0)
    run.update_members({"a": member("a", NOW), "b": member("b", NOW), "c": member("c", NOW)}, NOW)
    assert statuses(run, NOW) == {"a": "live", "b": "live", "c": "live"}
    # a keeps beating; b leaves gracefully; c falls silent (killed)
    run.update_members({"a": member("a", NOW + 2), "b": member("b", NOW + 2, state="left")}, NOW + 2)
    assert statuses(run, NOW + 2) == {"a": "live", "b": "left", "c": "live"}
    run.update_members({"a": member("a", NOW + 4)}, NOW + 4)  # a read that misses b and c changes nothing by itself
    assert statuses(run, NOW + 4) == {"a": "live", "b": "left", "c": "quiet"}  # c missed half its lifetime
    run.update_members({"a": member("a", NOW + 7)}, NOW + 7)
    assert statuses(run, NOW + 7)["c"] == "expired"  # past its own signed expiry
    run.update_members({"a": member("a", NOW + 19)}, NOW + 19)
    assert statuses(run, NOW + 19) == {"a": "live"}  # both forgotten after forget_after
    # the totals keep what the forgotten peers reported
    assert run.summary(NOW + 19)["rounds_ok"] == 3


def test_a_member_that_left_before_the_dashboard_came_is_not_shown():
    run = state()
    run.update_members({"gone": member("gone", NOW - 1, state="left"), "a": member("a", NOW)}, NOW)
    assert statuses(run, NOW) == {"a": "live"}


def test_round_counters_add_up_across_updates_and_restarts():
    run = state()
    run.update_members({"a": member("a", NOW, rounds=3), "b": member("b", NOW, rounds=2)}, NOW)
    run.update_members({"a": member("a", NOW + 1, rounds=5), "b": member("b", NOW + 1, rounds=2)}, NOW + 1)
    assert run.summary(NOW + 1)["rounds_ok"] == 7
    run.update_members({"a": member("a", NOW + 2, rounds=1)}, NOW + 2)  # a restarted: its count began again
    assert run.summary(NOW + 2)["rounds_ok"] == 8
    assert list(run.history["rounds_ok"]) == [5, 7, 8]


def test_one_lying_peer_cannot_dominate_the_run_wide_numbers():
    run = state()
    honest = {name: member(name, NOW, rate=100.0 + i, epoch=4, loss=0.5) for i, name in enumerate("ab")}
    liar = member("liar", NOW, rate=1e15, epoch=10**9, loss=-1e9)
    run.update_members({**honest, "liar": liar}, NOW)
    summary = run.summary(NOW)
    assert summary["samples_per_second"] < 1e5  # capped at 100 x the median claim
    assert summary["epoch"] == 4 and summary["loss"] == 0.5  # medians
    assert robust_sum([]) == 0.0 and robust_sum([0.0, 5.0]) == 5.0
    liar_row = next(row for row in run.members_json(NOW) if row["peer_id"] == "liar")
    assert liar_row["samples_per_second"] == 1e15  # shown as claimed, attributed to the liar


def test_what_peers_can_make_the_dashboard_hold_is_bounded():
    run = state(max_members=5, max_evaluators=3, results_per_evaluator=4, history_points=10)
    for i in range(20):
        run.update_members({f"p{i}": member(f"p{i}", NOW + i)}, NOW + i)
    assert len(run.rows) == 5 and len(run.history["t"]) == 10
    for i in range(6):
        results = [evaluation(0.5, 1.0, epoch=j, step=j, evaluated_at=NOW + i * 100 + j) for j in range(8)]
        run.update_evaluations({f"e{i}": EvaluationRecord(results=results)}, NOW + 1000)
    assert sorted(run.evaluators) == ["e3", "e4", "e5"]  # the most recent evaluators
    assert all(len(kept.results) == 4 for kept in run.evaluators.values())


def test_evaluations_accumulate_without_duplicates():
    run = state()
    first = [evaluation(0.5 + i / 10, 1.0, epoch=i, step=i, evaluated_at=NOW + i) for i in range(3)]
    run.update_evaluations({"e": EvaluationRecord(task="digits", results=first)}, NOW + 3)
    run.update_evaluations({"e": EvaluationRecord(task="digits", results=first[1:] + [
        evaluation(0.95, 0.1, epoch=3, step=3, evaluated_at=NOW + 3)])}, NOW + 4)
    [evaluator] = run.evaluations_json()
    assert [r["epoch"] for r in evaluator["results"]] == [0, 1, 2, 3]
    assert run.summary(NOW + 4)["evaluation"]["accuracy"] == 0.95


def test_an_unknown_run_is_an_empty_run_with_a_message():
    run = state()
    assert "Joining" in run.message(NOW)
    monitor = member("me", NOW, role="monitor", maddrs=[])
    run.update_members({"me": monitor}, NOW)  # the dashboard's own presence record
    assert "No peers of run 'units' found" in run.message(NOW)
    assert run.members_json(NOW)[0]["reachability"] == "client"
    run.update_members({"me": monitor, "a": member("a", NOW)}, NOW)
    assert run.message(NOW) is None
    run.update_members({"a": member("a", NOW + 1, state="left")}, NOW + 1)
    assert "has left" in run.message(NOW + 1)


# -- the web API, over loopback HTTP, without a swarm ------------------------------------------


def test_the_api_page_and_metrics_are_served_from_the_cache():
    board = Dashboard(RUN, NodeConfig())  # the node is never started: requests never touch the DHT
    now = time.time()
    board.state.update_members({"a": member("a", now), "me": member("me", now, role="monitor", maddrs=[])}, now)
    board.state.members_read_at = now
    record = EvaluationRecord(task="digits", results=[evaluation(0.8 + i / 100, 0.5, epoch=i, step=i,
                                                                 evaluated_at=now - 10 + i) for i in range(3)])
    board.state.update_evaluations({"a": record}, now)
    board.state.rows["a"].body = board.state.rows["a"].body.model_copy(update={"epsilon": math.inf})

    async def scenario():
        async with TestClient(TestServer(board.app())) as client:
            page = await client.get("/")
            assert page.status == 200 and "default-src 'self'" in page.headers["Content-Security-Policy"]
            html = await page.text()
            for asset in ("static/vendor/uPlot.iife.min.js", "static/dashboard.js", "static/dashboard.css"):
                assert asset in html
                served = await client.get("/" + asset)
                assert served.status == 200 and len(await served.read()) > 500, asset
            assert (await client.get("/static/../server.py")).status in (403, 404)
            run = await (await client.get("/api/run")).json()
            assert run["run_id"] == RUN and run["message"] is None
            assert {row["peer_id"] for row in run["members"]} == {"a", "me"}
            assert next(row for row in run["members"] if row["peer_id"] == "a")["epsilon"] is None  # not Infinity
            assert run["summary"]["evaluation"]["accuracy"] == pytest.approx(0.82)
            history = await (await client.get("/api/history")).json()
            assert history["t"] and history["samples_per_second"] == [100.0]
            evaluations = await (await client.get("/api/evaluations")).json()
            assert len(evaluations["evaluators"][0]["results"]) == 3
            text = await (await client.get("/metrics")).text()
            return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                    for family in text_string_to_metric_families(text) for sample in family.samples}

    samples = asyncio.run(scenario())
    assert samples[("swarmgrad_run_members", (("role", "peer"),))] == 1
    assert samples[("swarmgrad_run_members", (("role", "monitor"),))] == 1
    assert samples[("swarmgrad_run_samples_per_second", ())] == 100.0
    assert samples[("swarmgrad_run_eval_accuracy", (("peer_id", "a"),))] == pytest.approx(0.82)
    assert samples[("swarmgrad_run_rounds_total", (("outcome", "ok"),))] == 1
    assert samples[("swarmgrad_dashboard_dht_reads_total", (("record", "members"),))] == 0


# -- the peer's terminal panel -------------------------------------------------------------------


def test_the_peer_panel_shows_what_a_volunteer_wants_to_know():
    panel = PanelState("my-run", started=NOW)
    panel.add({"event": "ready", "peer_id": "12D3KooWAbcdefghijklmnopqrstuv", "shard": 1, "num_shards": 4,
               "maddrs": ["/ip4/127.0.0.1/tcp/5/p2p/x"], "task": "digits", "metrics_url": "http://127.0.0.1:9/metrics"})
    panel.add({"event": "progress", "step": 1234, "epoch": 7, "peers": 3, "loss": 0.4321, "samples_per_second": 812.0,
               "rounds_ok": 6, "rounds_failed": 1, "bytes_sent": 12_500_000, "bytes_received": 11_000_000,
               "epsilon": 1.5, "warning": None})
    console = Console(record=True, width=140, color_system=None)
    console.print(render_panel(panel, now=NOW + 30))
    text = console.export_text()
    for shown in ("run my-run", "digits", "training", "1234", "epoch", "0.4321", "812", "6 ok / 1 failed",
                  "12.5 sent", "1.50", "no evaluation yet", "shard 1/4", "metrics http://127.0.0.1:9/metrics"):
        assert shown in text, (shown, text)
    panel.add({"event": "eval", "t": NOW + 25, "accuracy": 0.9123, "loss": 0.3, "epoch": 7})
    panel.add({"event": "done", "reason": "max_seconds", "final": {"accuracy": 0.95, "loss": 0.2}})
    console = Console(record=True, width=140, color_system=None)
    console.print(render_panel(panel, now=NOW + 30))
    text = console.export_text()
    assert "final held-out accuracy 95.00%" in text and "stopped: max_seconds" in text, text
    assert json.dumps(panel.ready)  # events stay plain data
