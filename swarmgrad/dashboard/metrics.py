"""The dashboard's ``/metrics``: run-wide numbers for Prometheus, from the dashboard's cache (a
scrape reads no DHT), plus what the dashboard itself costs the swarm."""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from swarmgrad.dashboard.collector import Collector
from swarmgrad.dashboard.state import RunState


class RunMetrics:
    """A prometheus_client collector over a RunState; ``registry`` holds it and nothing else."""

    def __init__(self, state: RunState, collector: Collector | None = None):
        self.state, self.collector = state, collector
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state, now = self.state, time.time()
        summary = state.summary(now)
        info = InfoMetricFamily("swarmgrad_run", "The run this dashboard watches", labels=["run_id"])
        info.add_metric([state.run_id], {})
        yield info
        members = GaugeMetricFamily("swarmgrad_run_members", "Members present (live or quiet), by role",
                                    labels=["role"])
        by_role: dict[str, int] = {}
        for row in state.rows.values():
            if row.status(now) in ("live", "quiet"):
                by_role[row.body.role] = by_role.get(row.body.role, 0) + 1
        for role in ("peer", "client", "monitor", "bootstrap"):
            members.add_metric([role], by_role.get(role, 0))
        yield members
        yield GaugeMetricFamily("swarmgrad_run_training_peers", "Members that train", value=summary["training"])
        yield GaugeMetricFamily("swarmgrad_run_samples_per_second", "Swarm training rate (sum of claims, outliers "
                                "capped)", value=summary["samples_per_second"] or 0.0)
        if summary["loss"] is not None:
            yield GaugeMetricFamily("swarmgrad_run_loss", "Median smoothed training loss", value=summary["loss"])
        if summary["epoch"] is not None:
            yield GaugeMetricFamily("swarmgrad_run_epoch", "Median epoch of the training members",
                                    value=summary["epoch"])
        rounds = CounterMetricFamily("swarmgrad_run_rounds", "Averaging rounds the members report, summed over "
                                     "members, by outcome", labels=["outcome"])
        rounds.add_metric(["ok"], summary["rounds_ok"])
        rounds.add_metric(["failed"], summary["rounds_failed"])
        yield rounds
        traffic = CounterMetricFamily("swarmgrad_run_bytes", "Averaging bytes the members report, summed",
                                      labels=["direction"])
        traffic.add_metric(["sent"], summary["bytes_sent"])
        traffic.add_metric(["received"], summary["bytes_received"])
        yield traffic
        yield from self._evaluations()
        yield from self._costs(now)

    def _evaluations(self) -> Iterator[Metric]:
        accuracy = GaugeMetricFamily("swarmgrad_run_eval_accuracy", "Last held-out accuracy each evaluating peer "
                                     "published (its signed claim)", labels=["peer_id"])
        loss = GaugeMetricFamily("swarmgrad_run_eval_loss", "Last held-out loss each evaluating peer published",
                                 labels=["peer_id"])
        for evaluator in self.state.evaluators.values():
            if evaluator.results:
                result = evaluator.results[-1]
                accuracy.add_metric([evaluator.peer_id], result.accuracy)
                if result.loss is not None:
                    loss.add_metric([evaluator.peer_id], result.loss)
        yield accuracy
        yield loss

    def _costs(self, now: float) -> Iterator[Metric]:
        if self.collector is None:
            return
        reads = CounterMetricFamily("swarmgrad_dashboard_dht_reads", "DHT reads this dashboard made, by record kind "
                                    "(on a fixed schedule: pages and scrapes make none)", labels=["record"])
        for kind, count in self.collector.reads.items():
            reads.add_metric([kind], count)
        yield reads
        yield CounterMetricFamily("swarmgrad_dashboard_dht_failed_reads", "DHT reads that failed",
                                  value=self.collector.failed_reads)
        yield GaugeMetricFamily("swarmgrad_dashboard_dht_reads_per_second", "DHT reads per second since start",
                                value=self.collector.reads_per_second)
        staleness = GaugeMetricFamily("swarmgrad_dashboard_seconds_since_read", "Seconds since the last completed "
                                      "read, by record kind", labels=["record"])
        for kind, read_at in (("members", self.state.members_read_at),
                              ("evaluations", self.state.evaluations_read_at)):
            if read_at is not None:
                staleness.add_metric([kind], max(0.0, now - read_at))
        yield staleness
