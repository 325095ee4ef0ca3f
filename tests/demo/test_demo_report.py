"""The demo's reporting: parsing peer event lines, the live dashboard, the PNG plot and the JSON summary."""

from __future__ import annotations

import io
import json
import struct

import pytest
from rich.console import Console

from swarmgrad.demo.dashboard import render_dashboard
from swarmgrad.demo.events import RunLog, parse_event
from swarmgrad.demo.plot import plot_run, run_figure
from swarmgrad.demo.summary import summarize

T0 = 1_700_000_000.0
PEER_A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaa"
PEER_B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbbbb"
PEER_C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCcccccc"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def line(kind: str, seconds: float, peer_id: str, **fields) -> bytes:
    return json.dumps({"event": kind, "t": T0 + seconds, "peer_id": peer_id, **fields}).encode() + b"\n"


def progress(seconds: float, peer_id: str, step: int, epoch: int, loss: float, **fields) -> bytes:
    counters = {"samples_per_second": 250.0, "samples": step * 32, "rounds_ok": epoch, "rounds_failed": 0,
                "bytes_sent": epoch * 2_000_000, "bytes_received": epoch * 1_900_000, "epsilon": None}
    return line("progress", seconds, peer_id, step=step, epoch=epoch, loss=loss, **{**counters, **fields})


def run_stream() -> list[bytes]:
    """Two healthy peers (A evaluates), one that errors, plus junk a child process might print."""
    return [
        line("ready", 0.5, PEER_A, maddrs=["/ip4/127.0.0.1/tcp/1"]),
        line("ready", 0.6, PEER_B, maddrs=["/ip4/127.0.0.1/tcp/2"]),
        line("ready", 0.7, PEER_C, maddrs=[]),
        b"INFO some log line that is not JSON\n",
        b'{"event": "progress", "t": 1.0, "peer_id": "trunc',  # cut off when a child was killed
        b"\xff\xfe not utf-8\n",
        b"[1, 2, 3]\n",
        line("heartbeat", 1.0, PEER_A),  # unknown kind
        json.dumps({"event": "progress", "t": "soon", "peer_id": PEER_A}).encode(),  # t is not a number
        json.dumps({"event": "eval", "t": T0 + 1, "accuracy": 0.99}).encode(),  # no peer id
        progress(2.0, PEER_A, step=10, epoch=1, loss=1.2, future_key="ignored"),
        progress(2.1, PEER_B, step=12, epoch=1, loss=1.1, epsilon=0.5),
        progress(2.2, PEER_C, step=3, epoch=0, loss=2.3),
        line("error", 3.0, PEER_C, message="CUDA [out of memory] while averaging"),
        line("eval", 10.0, PEER_A, step=40, epoch=4, accuracy=0.80, loss=0.55),
        progress(11.0, PEER_A, step=50, epoch=5, loss=0.45),
        progress(11.2, PEER_B, step=55, epoch=5, loss=0.44, epsilon=1.25),
        # arrives before the earlier eval below: time to target must follow `t`, not arrival order
        line("eval", 30.0, PEER_A, step=120, epoch=12, accuracy=0.87, loss=0.36),
        line("eval", 20.0, PEER_A, step=80, epoch=8, accuracy=0.855, loss=0.40),
        progress(31.0, PEER_A, step=125, epoch=12, loss=0.30),
        progress(31.0, PEER_B, step=130, epoch=12, loss=0.31, epsilon=2.5),
        line("done", 40.0, PEER_B, step=140, epoch=13, reason="target reached", final=None),
        line("done", 41.0, PEER_A, step=150, epoch=13, reason="target reached", final={"accuracy": 0.86, "loss": 0.37}),
    ]


def make_log(lines: list[bytes]) -> RunLog:
    log = RunLog(started_at=T0)
    for raw in lines:
        log.add_line(raw)
    return log


def test_parse_event_keeps_known_events_and_drops_everything_else():
    assert parse_event(line("progress", 1.0, PEER_A, step=1, epoch=0, loss=2.0))["step"] == 1
    assert parse_event(line("ready", 1.0, PEER_A).decode())["peer_id"] == PEER_A
    for junk in [b"", b"\n", b"not json", b"\xff\xfe", b"null", b"[]", b'"text"', b'{"event": "eval"',
                 line("heartbeat", 1.0, PEER_A), json.dumps({"event": "done", "t": True, "peer_id": PEER_A}),
                 json.dumps({"event": "done", "peer_id": PEER_A}), json.dumps({"event": "ready", "t": 1.0})]:
        assert parse_event(junk) is None, junk


def test_run_log_tracks_peer_states_and_ignores_junk():
    log = make_log(run_stream())
    assert list(log.peers) == [PEER_A, PEER_B, PEER_C]
    assert [peer.state for peer in log.peers.values()] == ["done", "done", "error"]
    assert log.peers[PEER_C].error == "CUDA [out of memory] while averaging"
    assert log.peers[PEER_A].step == 150  # from `done`, newer than the last progress
    assert log.peers[PEER_A].maddrs == ["/ip4/127.0.0.1/tcp/1"]
    assert len(log.evals) == 3
    assert [loss for _, loss in log.peers[PEER_B].losses] == [1.1, 0.44, 0.31]
    # a progress line that arrives after `done` must not turn the peer back into "training"
    log.add_line(progress(42.0, PEER_B, step=141, epoch=13, loss=0.3))
    assert log.peers[PEER_B].state == "done"


def test_summary_numbers():
    summary = summarize(make_log(run_stream()))
    json.dumps(summary, allow_nan=False)  # must be strict JSON
    # 0.85 first reached by the eval at t=20 (it arrived after the one at t=30); 0.88 never reached
    assert summary["seconds_to"] == {"0.85": pytest.approx(20.0), "0.88": None}
    assert summary["final_accuracy"] == 0.86 and summary["final_loss"] == 0.37  # from done.final, not last eval
    assert summary["best_accuracy"] == 0.87
    assert [record["t"] for record in summary["evals"]] == [10.0, 20.0, 30.0]
    assert summary["evals"][1] == {"t": 20.0, "peer_id": PEER_A, "accuracy": 0.855, "loss": 0.40,
                                   "epoch": 8, "step": 80}
    peer_b = summary["peers"][PEER_B]
    assert (peer_b["steps"], peer_b["epochs"], peer_b["samples"]) == (140, 13, 130 * 32)
    assert (peer_b["rounds_ok"], peer_b["bytes_sent"], peer_b["epsilon"]) == (12, 24_000_000, 2.5)
    assert peer_b["reason"] == "target reached"
    assert summary["peers"][PEER_C]["reason"].startswith("error: CUDA")
    assert summary["peers"][PEER_A]["epsilon"] is None
    # A and B: 24 MB over 13 epochs each; C: 0 bytes over max(0, 1) epochs
    assert summary["bytes_sent_per_peer_per_epoch"] == pytest.approx((2 * 24e6 / 13) / 3, abs=1e-3)


def test_summary_without_evals_or_finals():
    summary = summarize(make_log([line("ready", 0.5, PEER_A), progress(2.0, PEER_A, step=5, epoch=0, loss=2.0),
                                  line("done", 3.0, PEER_A, step=6, epoch=0, reason="stopped")]),
                        targets=(0.5,))
    json.dumps(summary, allow_nan=False)
    assert summary["seconds_to"] == {"0.5": None}
    assert summary["final_accuracy"] is None and summary["final_loss"] is None and summary["best_accuracy"] is None
    assert summary["evals"] == []
    assert summary["bytes_sent_per_peer_per_epoch"] == 0.0
    assert summary["peers"][PEER_A]["reason"] == "stopped"


def test_summary_falls_back_to_latest_eval_and_ignores_nan():
    lines = [line("eval", 5.0, PEER_A, step=1, epoch=1, accuracy=0.9, loss=0.3),
             line("eval", 4.0, PEER_A, step=1, epoch=1, accuracy=0.7, loss=0.5),
             b'{"event": "eval", "t": 1700000006.0, "peer_id": "x", "accuracy": NaN, "loss": NaN}',
             b'{"event": "progress", "t": 1700000006.0, "peer_id": "x", "loss": Infinity, "bytes_sent": NaN}']
    summary = summarize(make_log(lines))
    json.dumps(summary, allow_nan=False)
    assert (summary["final_accuracy"], summary["final_loss"]) == (0.9, 0.3)  # latest by time, not arrival
    assert summary["seconds_to"] == {"0.85": 5.0, "0.88": 5.0}
    assert len(summary["evals"]) == 2


def render_text(log: RunLog, now: float) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(render_dashboard(log, now=now, title="test run"))
    return console.export_text()


def rows(text: str) -> dict[str, list[str]]:
    """Table rows by short peer id, split into cells (no cell in this table contains a space).

    The notes below the table also start with a peer id; the table comes first, so the first line wins.
    """
    table: dict[str, list[str]] = {}
    for cells in (line.split() for line in text.splitlines()):
        if cells and cells[0].startswith("12D3Ko"):
            table.setdefault(cells[0], cells)
    return table


def test_dashboard_shows_peers_numbers_and_accuracy():
    log = make_log(run_stream()[:-2])  # before the peers finish
    text = render_text(log, now=T0 + 35.0)
    assert "test run" in text
    table = rows(text)
    assert table["12D3Ko…aaaaaa"] == ["12D3Ko…aaaaaa", "training", "125", "12", "0.300", "250", "12/0", "24.0", "-"]
    assert table["12D3Ko…bbbbbb"] == ["12D3Ko…bbbbbb", "training", "130", "12", "0.310", "250", "12/0", "24.0", "2.50"]
    # a stopped peer shows no current speed
    assert table["12D3Ko…cccccc"] == ["12D3Ko…cccccc", "error", "3", "0", "2.300", "-", "0/0", "0.0", "-"]
    # brackets shown, not eaten as markup
    assert "12D3Ko…cccccc error: CUDA [out of memory] while averaging" in text
    assert "elapsed 35 s · 500 samples/s" in text  # only the two training peers count
    assert "held-out accuracy 87.00% (5 s ago) · best 87.00%" in text


def test_dashboard_shows_loss_and_bits_per_byte_for_a_language_task():
    lines = [*run_stream()[:-2], line("eval", 33.0, PEER_A, step=128, epoch=12, accuracy=0.41, loss=1.7329,
                                      bits_per_byte=2.5)]
    text = render_text(make_log(lines), now=T0 + 35.0)
    assert "held-out loss 1.733, 2.500 bits/byte (2 s ago)" in text and "best" not in text.split("elapsed")[1]


def test_dashboard_after_the_run_and_without_epsilon():
    text = render_text(make_log(run_stream()), now=T0 + 45.0)
    assert "12D3Ko…aaaaaa done: target reached" in text and "best 87.00%" in text
    lines = [progress(2.0, PEER_A, step=10, epoch=1, loss=1.2)]
    header = next(line for line in render_text(make_log(lines), now=T0 + 3.0).splitlines() if "peer" in line)
    assert "samples/s" in header and "ε" not in header  # the epsilon column only appears in private runs


def test_dashboard_flags_a_peer_that_went_quiet():
    log = make_log([progress(2.0, PEER_A, step=10, epoch=1, loss=1.2), progress(20.0, PEER_B, step=9, epoch=1, loss=1.3)])
    text = render_text(log, now=T0 + 21.0)
    assert "12D3Ko…aaaaaa training: no report for 19 s" in text
    assert "bbbbbb training: no report" not in text


def test_dashboard_before_any_event():
    text = render_text(RunLog(started_at=T0), now=T0 + 3.0)
    assert "waiting for peers" in text and "no held-out evaluation yet" in text and "elapsed 3 s" in text


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def test_plot_writes_png(tmp_path):
    path = plot_run(make_log(run_stream()), tmp_path / "out" / "run.png", title="demo")
    assert path == tmp_path / "out" / "run.png"
    assert png_size(path) == (900, 700)
    assert path.stat().st_size > 20_000  # two panels with curves, not a blank canvas


def test_plot_without_evals_or_events(tmp_path):
    with_progress = plot_run(make_log(run_stream()[:13]), tmp_path / "progress.png", title="no evals")
    empty = plot_run(RunLog(started_at=T0), tmp_path / "empty.png", title="nothing yet")
    assert png_size(with_progress) == png_size(empty) == (900, 700)
    assert with_progress.stat().st_size > 10_000 and empty.stat().st_size > 10_000
    assert with_progress.read_bytes() != empty.read_bytes()


def panel_texts(figure) -> list[list[str]]:
    return [[text.get_text() for text in axes.texts] for axes in figure.axes]


def test_plot_panels_say_what_is_missing():
    loss_texts, accuracy_texts = panel_texts(run_figure(make_log(run_stream()[:13]), "no evals"))
    assert "no held-out evaluation" in accuracy_texts and "no loss reported" not in loss_texts
    assert {"85%", "88%"} <= set(accuracy_texts)  # the target lines are labelled
    loss_texts, accuracy_texts = panel_texts(run_figure(RunLog(started_at=T0), "empty"))
    assert "no loss reported" in loss_texts and "no held-out evaluation" in accuracy_texts
    figure = run_figure(make_log(run_stream()), "full", targets=(0.9,))
    loss_axes, accuracy_axes = figure.axes
    assert len(loss_axes.lines) == 4  # three peers' training loss and the held-out loss
    assert list(accuracy_axes.lines[0].get_xdata()) == [10.0, 20.0, 30.0]  # sorted by time, since start
    assert panel_texts(figure)[1] == ["90%"]
