"""PNG of a demo run: training and held-out loss, and held-out accuracy against the targets, over time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from swarmgrad.console import short_id
from swarmgrad.demo.events import RunLog, number

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_LEGEND_PEERS = 12  # beyond this, per-peer legend entries hide the curves
SPARSE_POINTS = 20


def plot_run(log: RunLog, path: Path, title: str, targets: tuple[float, ...] = (0.85, 0.88)) -> Path:
    """Write the plot as a PNG to ``path`` (parents created) and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_figure(log, title, targets).savefig(path, dpi=100)
    return path


def run_figure(log: RunLog, title: str, targets: tuple[float, ...] = (0.85, 0.88)) -> Figure:
    # Figure + Agg canvas instead of pyplot: no global backend switch, no figure registry to leak into.
    # Imported here because matplotlib is slow to import and only needed once, at the end of a run.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, accuracy_axes = figure.subplots(2, 1, sharex=True)
    figure.suptitle(title)
    loss_panel(loss_axes, log)
    accuracy_panel(accuracy_axes, log, targets)
    accuracy_axes.set_xlabel("seconds since start")
    accuracy_axes.set_xlim(left=0)
    return figure


def loss_panel(axes: Axes, log: RunLog) -> None:
    for peer in log.peers.values():
        if peer.losses:
            seconds, losses = zip(*peer.losses)
            marker = "." if len(losses) < SPARSE_POINTS else None  # a lone point has no line to show it
            axes.plot(seconds, losses, marker=marker, linewidth=1, alpha=0.8, label=f"train {short_id(peer.peer_id)}")
    evals = log.sorted_evals()
    held_out = [(log.seconds(float(event["t"])), number(event.get("loss"))) for event in evals]
    held_out = [(seconds, loss) for seconds, loss in held_out if loss is not None]
    if held_out:
        axes.plot(*zip(*held_out), "o-", color="black", markersize=3, label="held-out loss")
    if 0 < len(axes.lines) <= MAX_LEGEND_PEERS:
        axes.legend(fontsize="small", ncol=2 if len(axes.lines) > 6 else 1)
    if not axes.lines:
        say(axes, "no loss reported")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)


def accuracy_panel(axes: Axes, log: RunLog, targets: tuple[float, ...]) -> None:
    evals = log.sorted_evals()
    accuracies = [number(event.get("accuracy"), 0.0) for event in evals]
    if evals:
        seconds = [log.seconds(float(event["t"])) for event in evals]
        axes.plot(seconds, accuracies, "o-", color="black", markersize=3, label="held-out accuracy")
    else:
        say(axes, "no held-out evaluation")
    for target in targets:
        axes.axhline(target, linestyle="--", linewidth=1, color="tab:red", alpha=0.7)
        axes.annotate(f"{target * 100:g}%", (1.0, target), xycoords=("axes fraction", "data"), fontsize="small",
                      ha="right", va="bottom", color="tab:red")
    # Keep the targets in view and zoom in on the region that matters (accuracy near the targets).
    axes.set_ylim(max(0.0, min([*accuracies, *targets]) - 0.05), 1.0)
    axes.set_ylabel("held-out accuracy")
    axes.grid(alpha=0.3)


def say(axes: Axes, text: str) -> None:
    """A note in the middle of an empty panel, so an empty plot reads as 'no data' rather than a bug."""
    axes.text(0.5, 0.5, text, transform=axes.transAxes, ha="center", va="center", color="gray")
