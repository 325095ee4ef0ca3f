"""``swarmgrad peer``: join (or create) a run and train a task until stopped."""

from __future__ import annotations

import logging
import time
from typing import Any

from swarmgrad.console import stderr
from swarmgrad.dht.node import NodeConfig
from swarmgrad.peer.runner import LocalOptions, json_lines, resolve_run, train

logger = logging.getLogger(__name__)
LOG_EVERY = 5.0


def run_peer(config: NodeConfig, run_id: str, task: str | None, create: bool, explicit: dict[str, Any],
             local: LocalOptions, json_output: bool, wait_seconds: float) -> dict[str, Any]:
    task_name, options, manifest = resolve_run(config, run_id, task, create, explicit, wait_seconds)
    if not json_output:
        stderr.print(f"run {run_id}: task {task_name}, strategy {options['strategy']}, averaging "
                     f"{options['averaging']}, compression {options['compression']}, privacy {options['privacy']}")
    return train(run_id, task_name, options, local, config, manifest, json_lines if json_output else _HumanLog())


class _HumanLog:
    """One line on stderr every few seconds, plus evaluations and the end."""

    def __init__(self) -> None:
        self._last = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "ready":
            stderr.print(f"peer {event['peer_id']} training shard {event['shard']}/{event['num_shards']}; "
                         f"listening on {', '.join(event['maddrs']) or '(client mode)'}")
        elif kind == "progress" and time.monotonic() - self._last >= LOG_EVERY:
            self._last = time.monotonic()
            loss = "-" if event.get("loss") is None else f"{event['loss']:.4f}"
            epsilon = "" if event.get("epsilon") is None else f"  epsilon {event['epsilon']:.2f}"
            stderr.print(f"step {event['step']:>6}  epoch {event['epoch']:>4}  loss {loss}  "
                         f"{event['samples_per_second']:.0f} samples/s  peers {event['peers']}  rounds "
                         f"{event['rounds_ok']} ok/{event['rounds_failed']} failed  "
                         f"sent {event['bytes_sent'] / 1e6:.1f} MB{epsilon}")
        elif kind == "eval":
            stderr.print(f"held-out accuracy {event['accuracy']:.4f}  loss {event['loss']:.4f}  (epoch {event['epoch']})")
        elif kind == "done":
            final = event.get("final")
            result = "" if final is None else f"; final accuracy {final['accuracy']:.4f}"
            stderr.print(f"stopped ({event['reason']}) after {event['step']} steps, epoch {event['epoch']}{result}")
