"""Live terminal dashboard of a demo run: one row per peer, then elapsed time, held-out accuracy and peer notes."""

from __future__ import annotations

import time

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from swarmgrad.console import short_id
from swarmgrad.demo.events import PeerState, RunLog, number

STATE_STYLES = {"ready": "yellow", "training": "green", "done": "cyan", "error": "bold red"}
NOTE_WIDTH = 100
QUIET_SECONDS = 10.0  # peers report about once a second


def render_dashboard(log: RunLog, now: float | None = None, title: str = "swarmgrad demo") -> Group:
    """The peer table and, below it, a status line and one note per stopped or quiet peer.

    Called several times a second by rich.live.Live, so it only formats. The table fits 80 columns so a default
    terminal shows every number; free text such as error messages goes below it, where it may wrap.
    """
    now = time.time() if now is None else now
    return Group(peer_table(log, title), Text.from_markup(caption(log, now)))


def peer_table(log: RunLog, title: str) -> Table:
    peers = list(log.peers.values())
    with_epsilon = any(peer.stat("epsilon") is not None for peer in peers)  # only private runs have one
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    table.add_column("peer", no_wrap=True)
    table.add_column("state", no_wrap=True)
    numbers = ("step", "epoch", "loss", "samples/s", "rounds\nok/fail", "MB\nsent") + (("ε",) if with_epsilon else ())
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True)
    for peer in peers:
        table.add_row(*peer_row(peer, with_epsilon))
    if not peers:
        table.add_row("(waiting for peers)")
    return table


def peer_row(peer: PeerState, with_epsilon: bool) -> list[str]:
    loss, sent, epsilon = peer.stat("loss"), peer.stat("bytes_sent"), peer.stat("epsilon")
    # a stopped peer's last samples/s is history, not its current speed
    speed = peer.stat("samples_per_second") if peer.state == "training" else None
    rounds = f"{peer.stat('rounds_ok', 0):.0f}/{peer.stat('rounds_failed', 0):.0f}" if peer.progress else "-"
    row = [
        escape(short_id(peer.peer_id)),
        f"[{STATE_STYLES.get(peer.state, 'white')}]{peer.state}[/]",
        str(peer.step),
        str(peer.epoch),
        "-" if loss is None else f"{loss:.3f}",
        "-" if speed is None else f"{speed:.0f}",
        rounds,
        "-" if sent is None else f"{sent / 1e6:.1f}",
    ]
    if with_epsilon:
        row.append("-" if epsilon is None else f"{epsilon:.2f}")
    return row


def caption(log: RunLog, now: float) -> str:
    lines = [status_line(log, now)]
    for peer in log.peers.values():
        text = note(peer, now)
        if text:
            # escaped: error messages may contain [brackets] that rich would read as markup
            lines.append(f"{escape(short_id(peer.peer_id))} {peer.state}: {escape(text)}")
    return "\n".join(lines)


def note(peer: PeerState, now: float) -> str:
    """Why a peer stopped, or how long it has been quiet (a killed peer sends no `done`), in one line."""
    if peer.error is not None:
        text = peer.error
    elif peer.done is not None:
        text = str(peer.done.get("reason", ""))
    elif peer.state == "training" and now - float(peer.progress["t"]) > QUIET_SECONDS:
        text = f"no report for {now - float(peer.progress['t']):.0f} s"
    else:
        return ""
    text = " ".join(text.split())  # a multi-line traceback would push the table off the screen
    return text if len(text) <= NOTE_WIDTH else text[: NOTE_WIDTH - 1] + "…"


def status_line(log: RunLog, now: float) -> str:
    elapsed = max(0.0, now - log.started_at)
    speeds = [peer.stat("samples_per_second") for peer in log.peers.values() if peer.state == "training"]
    parts = [f"elapsed {elapsed:.0f} s", f"{sum(speed for speed in speeds if speed is not None):.0f} samples/s"]
    latest, best = log.latest_eval(), log.best_accuracy()
    if latest is None:
        parts.append("no held-out evaluation yet")
    else:
        accuracy, bits = number(latest.get("accuracy"), 0.0), number(latest.get("bits_per_byte"))
        seconds_ago = max(0.0, elapsed - log.seconds(float(latest["t"])))
        if bits is not None:  # a language task: its loss says more than next-byte accuracy
            parts.append(f"held-out loss {number(latest.get('loss'), 0.0):.3f}, {bits:.3f} bits/byte ({seconds_ago:.0f} s ago)")
            best = None
        else:
            parts.append(f"held-out accuracy {accuracy:.2%} ({seconds_ago:.0f} s ago)")
    if best is not None:
        parts.append(f"best {best:.2%}")
    return " · ".join(parts)
