"""What ``swarmgrad peer`` shows a person: a live panel on a terminal, plain lines on a pipe.

Both take the runner's events (``ready``, ``progress``, ``eval``, ``done``) on stderr; ``--json``
prints the events themselves on stdout instead (commands/peer.py picks).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from swarmgrad.console import short_id, stderr

LOG_EVERY = 5.0  # plain lines: one progress line every few seconds
REFRESH_PER_SECOND = 2  # the panel: events come about once a second


class PlainLog:
    """One line on stderr every few seconds, plus evaluations and the end (for pipes and log files)."""

    def __init__(self) -> None:
        self._last = 0.0
        self._entry_points: list[str] = []

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "ready":
            stderr.print(f"peer {event['peer_id']} training shard {event['shard']}/{event['num_shards']}; "
                         f"listening on {', '.join(event['maddrs']) or '(client mode)'}", markup=False)
            if event.get("metrics_url"):
                stderr.print(f"metrics: {event['metrics_url']}", markup=False)
        elif kind == "progress" and time.monotonic() - self._last >= LOG_EVERY:
            self._last = time.monotonic()
            loss = "-" if event.get("loss") is None else f"{event['loss']:.4f}"
            epsilon = "" if event.get("epsilon") is None else f"  epsilon {event['epsilon']:.2f}"
            stderr.print(f"step {event['step']:>6}  epoch {event['epoch']:>4}  loss {loss}  "
                         f"{event['samples_per_second']:.0f} samples/s  peers {event['peers']}  rounds "
                         f"{event['rounds_ok']} ok/{event['rounds_failed']} failed  "
                         f"sent {event['bytes_sent'] / 1e6:.1f} MB{epsilon}", markup=False)
            entries = event.get("entry_points") or []
            if entries and set(entries) != set(self._entry_points):  # any public member lets others in
                self._entry_points = list(entries)
                stderr.print(f"others join through any of: --initial-peers {','.join(entries)}", markup=False)
        elif kind == "eval":
            stderr.print(f"held-out accuracy {_number(event.get('accuracy'), '.4f')}  loss "
                         f"{_number(event.get('loss'), '.4f')}  (epoch {event['epoch']})", markup=False)
        elif kind == "done":
            final = event.get("final")
            result = "" if final is None else f"; final accuracy {_number(final.get('accuracy'), '.4f')}"
            stderr.print(f"stopped ({event['reason']}) after {event['step']} steps, epoch {event['epoch']}{result}",
                         markup=False)


@dataclass
class PanelState:
    """What the panel shows: the latest event of each kind."""

    run_id: str
    started: float = field(default_factory=time.time)
    ready: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    evaluating: bool = False

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "ready":
            self.ready = event
        elif kind == "progress":
            self.progress, self.evaluating = event, bool(event.get("evaluating"))
        elif kind == "eval":
            self.evaluation, self.evaluating = event, False
        elif kind == "done":
            self.done = event


def render_panel(state: PanelState, now: float | None = None) -> Panel:
    """The panel for ``state``; only formats (rich calls it a few times a second)."""
    now = time.time() if now is None else now
    progress = state.progress or {}
    grid = Table.grid(padding=(0, 2))
    for _ in range(4):
        grid.add_column(justify="right", style="bold")
        grid.add_column(justify="left")
    rounds = f"{progress.get('rounds_ok', 0)} ok / {progress.get('rounds_failed', 0)} failed" if progress else "-"
    traffic = (f"{progress.get('bytes_sent', 0) / 1e6:.1f} sent / {progress.get('bytes_received', 0) / 1e6:.1f} recv"
               if progress else "-")
    epsilon = progress.get("epsilon")
    grid.add_row("step", str(progress.get("step", "-")), "epoch", str(progress.get("epoch", "-")),
                 "peers", str(progress.get("peers", "-")), "loss", _number(progress.get("loss"), ".4f"))
    grid.add_row("samples/s", _number(progress.get("samples_per_second"), ".0f"), "rounds", rounds,
                 "MB", traffic, "ε", "-" if epsilon is None else f"{epsilon:.2f}")
    lines: list[Any] = [grid, Text(_accuracy_line(state, now))]
    if progress.get("warning"):
        lines.append(Text(f"warning: {progress['warning']}", style="yellow"))
    if state.done is not None:
        lines.append(Text(f"stopped: {state.done.get('reason')}", style="cyan"))
    return Panel(Group(*lines), title=_title(state, now), title_align="left", box=box.ROUNDED,
                 subtitle=_subtitle(state), subtitle_align="left")


def _title(state: PanelState, now: float) -> str:
    ready = state.ready or {}
    who = f"peer {short_id(ready['peer_id'])}" if ready.get("peer_id") else "peer (joining)"
    task = f" · {ready['task']}" if ready.get("task") else ""
    doing = "stopped" if state.done else "evaluating" if state.evaluating else "training" if state.progress else \
        "joining"
    return f"swarmgrad · run {state.run_id}{task} · {who} · {doing} · {max(0.0, now - state.started):.0f} s"


def _subtitle(state: PanelState) -> str:
    ready = state.ready or {}
    parts = [f"shard {ready['shard']}/{ready['num_shards']}"] if "shard" in ready else []
    if ready.get("maddrs"):
        parts.append(ready["maddrs"][0])
    elif ready:
        parts.append("client mode")
    if ready.get("metrics_url"):
        parts.append(f"metrics {ready['metrics_url']}")
    return " · ".join(parts)


def _accuracy_line(state: PanelState, now: float) -> str:
    final = (state.done or {}).get("final")
    if isinstance(final, dict):
        return f"final held-out accuracy {_number(final.get('accuracy'), '.2%')}  loss {_number(final.get('loss'), '.4f')}"
    evaluation = state.evaluation
    if evaluation is None:
        return "held-out accuracy: no evaluation yet"
    ago = max(0.0, now - float(evaluation.get("t", now)))
    return (f"held-out accuracy {_number(evaluation.get('accuracy'), '.2%')}  loss "
            f"{_number(evaluation.get('loss'), '.4f')}  (epoch {evaluation.get('epoch')}, {ago:.0f} s ago)")


def _number(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else format(value, spec)


class LivePanel:
    """The panel, redrawn in place on stderr while the peer trains; log records print above it."""

    def __init__(self, run_id: str, console: Console = stderr):
        self.state = PanelState(run_id)
        self.console = console
        self._live: Live | None = None
        self._streams: list[tuple[logging.StreamHandler, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.state.add(event)
        if self._live is not None and event.get("event") != "progress":  # progress waits for the next redraw
            self._live.refresh()

    def __enter__(self) -> LivePanel:
        self._live = Live(render_panel(self.state), console=self.console, refresh_per_second=REFRESH_PER_SECOND,
                          get_renderable=lambda: render_panel(self.state), redirect_stderr=True)
        self._live.start()
        # logging's handlers hold the real stderr: point them at Live's proxy so records print above the panel
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, self.console.file):
                self._streams.append((handler, handler.setStream(sys.stderr)))
        return self

    def __exit__(self, *exc_info) -> None:
        for handler, stream in self._streams:
            handler.setStream(stream)
        self._streams.clear()
        if self._live is not None:
            self._live.stop()
            self._live = None


@contextlib.contextmanager
def peer_view(run_id: str, *, json_output: bool) -> Iterator[Any]:
    """The emitter for ``swarmgrad peer``'s events: JSON lines, the live panel (on a terminal) or plain lines."""
    if json_output:
        from swarmgrad.peer.runner import json_lines

        yield json_lines
    elif stderr.is_terminal:
        with LivePanel(run_id) as panel:
            yield panel
    else:
        yield PlainLog()
