"""``swarmgrad peer``: join (or create) a run and train a task until stopped."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from swarmgrad.console import stderr
from swarmgrad.dht.node import NodeConfig
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.runner import Emit, LocalOptions, json_lines, resolve_run, run_options, train

logger = logging.getLogger(__name__)
LOG_EVERY = 5.0


def run_peer(network: NodeConfig, run_id: str, config: RunConfig, *, create: bool, local: LocalOptions,
             json_output: bool) -> dict[str, Any]:
    config, manifest = resolve_run(network, run_id, config, create=create, wait_seconds=local.wait_seconds,
                                   data_dir=local.data_dir)
    if not json_output:
        settings = run_options(config)
        stderr.print(f"run {run_id}: task {config.task}, strategy {settings['strategy']}, averaging "
                     f"{settings['averaging']}, compression {config.compression}, privacy {settings['privacy']}",
                     markup=False)
    emit: Emit = json_lines if json_output else _HumanLog()
    return train(run_id, config, local, network, manifest, emit,
                 announce=(lambda maddrs: _print_join_hint(run_id, maddrs)) if create else None)


def join_hint(run_id: str, maddrs: list[str]) -> str:
    """The command line others join this run with (no TASK: they take the run's manifest)."""
    return f"others join with: swarmgrad peer --run-id {run_id} --initial-peers {','.join(maddrs)}"


def _print_join_hint(run_id: str, maddrs: list[str]) -> None:
    """The creator says on stderr how others join, as soon as it listens: before it waits for them."""
    if maddrs:  # a client-mode peer cannot be joined
        # plain stderr, not the rich console: a wrapped line would not paste back as one command
        print(join_hint(run_id, maddrs), file=sys.stderr, flush=True)


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
