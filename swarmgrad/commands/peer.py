"""``swarmgrad peer``: join (or create) a run and train a task until stopped."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from swarmgrad.commands.peer_view import peer_view
from swarmgrad.console import stderr
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.peer.runner import open_run, run_options, train

logger = logging.getLogger(__name__)


def run_peer(config: RunConfig, local: PeerConfig, *, json_output: bool) -> dict[str, Any]:
    run_id, monitoring = local.run_id, local.monitoring
    with contextlib.ExitStack() as stack:
        metrics = None
        if monitoring.metrics_port is not None:  # first: a port in use is an error before anything joins
            from swarmgrad.peer.metrics import PeerMetrics

            metrics = PeerMetrics()
            metrics.serve(monitoring.metrics_host, monitoring.metrics_port)
            stack.callback(metrics.close)
        run = stack.enter_context(open_run(config, local))  # the peer's own node settles the run's settings
        config = run.config
        if not json_output:
            settings = run_options(config)
            stderr.print(f"run {run_id}: task {config.task}, strategy {settings['strategy']}, averaging "
                         f"{settings['averaging']}, compression {config.compression}, privacy {settings['privacy']}",
                         markup=False)
        emit = stack.enter_context(peer_view(run_id, json_output=json_output))
        private = local.connection.ticket is not None
        return train(run, local, emit,
                     announce=(lambda maddrs: _print_join_hint(run_id, maddrs, private)) if local.create else None,
                     metrics=metrics)


def join_hint(run_id: str, maddrs: list[str], private: bool = False) -> str:
    """The command line others join this run with (no TASK: they take the run's manifest); a
    private run's joiners also need their own key and ticket."""
    hint = f"others join with: swarmgrad peer --run-id {run_id} --initial-peers {','.join(maddrs)}"
    return hint + " --identity KEY --ticket TICKET" if private else hint


def _print_join_hint(run_id: str, maddrs: list[str], private: bool = False) -> None:
    """The creator says on stderr how others join, as soon as it listens: before it waits for them."""
    if maddrs:  # a client-mode peer cannot be joined
        # plain stderr, not the rich console: a wrapped line would not paste back as one command
        print(join_hint(run_id, maddrs, private), file=sys.stderr, flush=True)
