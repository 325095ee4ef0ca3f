"""A peer's own Prometheus metrics (``swarmgrad peer --metrics-port P``): read from ``peer.status()``
when scraped, so they cost the training loop nothing; round times observed as each round ends.

Served by prometheus_client's own small HTTP server on a thread, started before the peer joins so a
port in use is one error line before any training starts.
"""

from __future__ import annotations

import errno
import threading
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from swarmgrad.errors import ConfigError
from swarmgrad.version import __version__

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from swarmgrad.peer.backends import RoundOutcome
    from swarmgrad.peer.peer import Peer

# a gossip step takes milliseconds, a moshpit round seconds, a round on a slow uplink minutes
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class PeerMetrics:
    """``metrics = PeerMetrics(); url = metrics.serve(host, port); metrics.attach(peer)``; ``close()`` stops it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.round_seconds = Histogram("swarmgrad_peer_round_seconds", "Seconds per averaging round (or gossip step)",
                                       buckets=ROUND_BUCKETS, registry=self.registry)
        self.peer: Peer | None = None
        self.url: str | None = None  # once served
        self.registry.register(self)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def attach(self, peer: Peer) -> None:
        self.peer = peer
        peer.counters.observers.append(self.observe_round)

    def observe_round(self, outcome: RoundOutcome) -> None:
        seconds = getattr(outcome.report, "seconds", None)
        if isinstance(seconds, (int, float)) and seconds >= 0:
            self.round_seconds.observe(seconds)

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on host:port (0: any free port); returns its URL."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(f"metrics port {port} on {host} is in use; pick another with --metrics-port, "
                                  "or 0 for any free port") from None
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from None
        bound = self._server.server_address
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
        self.url = f"http://{shown}:{bound[1]}/metrics"
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- prometheus_client's collector protocol: called on every scrape ---------------------------

    def describe(self) -> list[Metric]:
        return []  # the names come with collect(); nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        peer = self.peer
        if peer is None:  # not joined yet: only the histogram (empty) is served
            return
        status = peer.status()
        info = InfoMetricFamily("swarmgrad_peer", "This peer", labels=["peer_id", "run_id", "version"])
        info.add_metric([status.peer_id, status.run_id, __version__], {})
        yield info
        yield CounterMetricFamily("swarmgrad_peer_steps", "Local optimizer (or accumulation) steps", value=status.step)
        yield CounterMetricFamily("swarmgrad_peer_samples", "Samples trained on", value=status.samples)
        yield GaugeMetricFamily("swarmgrad_peer_samples_per_second", "Current training rate",
                                value=status.samples_per_second)
        yield GaugeMetricFamily("swarmgrad_peer_epoch", "Swarm steps taken part in or caught up to", value=status.epoch)
        yield GaugeMetricFamily("swarmgrad_peer_peers", "Peers training with this peer's settings, itself included",
                                value=status.peers)
        rounds = CounterMetricFamily("swarmgrad_peer_rounds", "Averaging rounds, by outcome", labels=["outcome"])
        rounds.add_metric(["ok"], status.rounds_ok)
        rounds.add_metric(["failed"], status.rounds_failed)
        yield rounds
        yield CounterMetricFamily("swarmgrad_peer_solo_steps", "Epochs finished alone", value=status.solo_steps)
        yield CounterMetricFamily("swarmgrad_peer_bytes_sent", "Averaging bytes sent", value=status.bytes_sent)
        yield CounterMetricFamily("swarmgrad_peer_bytes_received", "Averaging bytes received",
                                  value=status.bytes_received)
        yield CounterMetricFamily("swarmgrad_peer_state_downloads", "Times this peer took the swarm's state",
                                  value=status.state_downloads)
        memory = GaugeMetricFamily("swarmgrad_peer_swarm_memory_bytes", "Host bytes held for the swarm beyond the "
                                   "model, its gradients and the optimizer, by holder", labels=["holder"])
        for holder, held in sorted(status.swarm_memory.items()):
            memory.add_metric([holder], held)
        yield memory
        yield GaugeMetricFamily("swarmgrad_peer_kept_results_on_disk_bytes", "Bytes of round results kept for "
                                "peers that replay them, in temporary files", value=status.kept_results_on_disk)
        if status.loss is not None:
            yield GaugeMetricFamily("swarmgrad_peer_loss", "Smoothed training loss", value=status.loss)
        if status.epsilon is not None:
            yield GaugeMetricFamily("swarmgrad_peer_epsilon", "Differential privacy spent so far", value=status.epsilon)
        latest = peer.evaluations.latest
        if latest is not None:
            yield GaugeMetricFamily("swarmgrad_peer_eval_accuracy", "Last held-out accuracy", value=latest.accuracy)
            if latest.loss is not None:
                yield GaugeMetricFamily("swarmgrad_peer_eval_loss", "Last held-out loss", value=latest.loss)
