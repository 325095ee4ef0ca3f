"""The composition root: one peer's parts, built from the run's settings (``RunConfig``) and its own
(``PeerConfig``), in two phases on the peer's one event loop.

    assembly = PeerAssembly(requested, local)
    config = await assembly.open()                   # phase one: the node; the run's settings, settled
    model, optimizer = build(config)                 # `swarmgrad peer` needs the run's task and seed first
    training = await assembly.build(model, optimizer, batch_size=64)   # phase two
    ...
    await assembly.close()

Phase one starts only the node (p2pd, the DHT) and reads the run's manifest with it: nothing is
served or announced yet, so a peer still building its model is nobody's groupmate. Phase two, on
the same node: the network runtime (transport, presence), the state server, the policy, per-sample
privacy, the averager (moshpit) or gossip backend, catch-up, the round driver and the checkpointer;
then the peer joins (its checkpoint, else the swarm's state if the swarm is further along).
``close()`` leaves in reverse order, each part within ``timing.close_part``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch

from swarmgrad.averaging import Averager, GossipAverager
from swarmgrad.averaging.privacy import make_per_sample_private
from swarmgrad.averaging.privacy.budget import Accounted
from swarmgrad.averaging.privacy.per_sample import PerSamplePrivacy
from swarmgrad.averaging.settings import Aggregation
from swarmgrad.dht.evaluations import EvaluationLog
from swarmgrad.dht.membership import TrainingStats
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.tickets import Ticket
from swarmgrad.errors import ConfigError
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.peer.backends import AveragingBackend, GossipBackend, MoshpitBackend
from swarmgrad.peer.catch_up import CatchUp
from swarmgrad.peer.checkpoint import Checkpointer
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.counters import Counters
from swarmgrad.peer.driver import RoundDriver
from swarmgrad.peer.manifest import MANIFEST_TTL, RunManifest, publish_manifest, settle_from_dht
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.peer.progress import ProgressTracker
from swarmgrad.peer.state import TrainingState
from swarmgrad.peer.strategies.base import Policy
from swarmgrad.peer.strategies.registry import make_policy
from swarmgrad.state.server import StateServer, state_protocol
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.timing import RoundTimer

logger = logging.getLogger(__name__)

Fingerprint = Callable[[str], "str | None"]


@dataclass
class Training:
    """What phase two built, for the Peer to delegate to."""

    policy: Policy
    state: TrainingState
    averager: Averager | GossipAverager
    server: StateServer  # what joiners download from this peer, and the round results it keeps
    catch_up: CatchUp
    driver: RoundDriver
    checkpointer: Checkpointer | None
    per_sample: PerSamplePrivacy | None  # per-sample DP-SGD, applied in step()
    publish_state: Callable[[], None]  # the state joiners take: after every swarm step

    @property
    def accountant(self) -> Accounted | None:
        """Whichever spends the privacy budget: per-sample DP-SGD, or the averager's releases."""
        return self.per_sample if self.per_sample is not None else self.averager.releaser

    @property
    def round_timer(self) -> RoundTimer | None:
        """Where moshpit rounds' deadlines come from (gossip has no rounds to time)."""
        return self.averager.timer if isinstance(self.averager, Averager) else None


def check_privacy(config: RunConfig, batch_size: int | None, dataset_size: int | None) -> None:
    if config.privacy is not None and config.privacy.level == "sample" and (batch_size is None or dataset_size is None):
        raise ConfigError("privacy level='sample' (per-sample DP-SGD) needs batch_size and dataset_size")


class PeerAssembly:
    """Builds and owns one peer's parts. ``requested``: the run settings this peer chose (settled
    against the run's manifest in ``open``); ``manifest``: one this peer publishes (it creates the
    run). ``fingerprint(task)``: this peer's data fingerprint of a task, checked against a joined
    run's; ``wait_for_manifest``: seconds to wait for the run's manifest (None: read it once)."""

    def __init__(self, requested: RunConfig, local: PeerConfig, manifest: RunManifest | None = None, *,
                 fingerprint: Fingerprint = lambda task: None, wait_for_manifest: float | None = None):
        self.requested = self.config = requested
        self.local, self.manifest, self.run_id, self.timing = local, manifest, local.run_id, local.timing
        self._fingerprint, self._wait = fingerprint, wait_for_manifest
        connection = local.connection
        ticket = Ticket.load(connection.ticket) if connection.ticket is not None else None
        self.node = SwarmNode(local.network)
        self.runtime = NetworkRuntime(self.run_id, node=self.node, direct=connection.direct,
                                      trusted_network=connection.trusted_network, timing=self.timing,
                                      upload_limit_mbps=connection.upload_limit_mbps,
                                      download_limit_mbps=connection.download_limit_mbps, ticket=ticket,
                                      accountability=local.bans)
        self.counters = Counters(self.runtime.admission.misbehaviour)
        self.tracker = ProgressTracker(self.runtime.presence, epsilon=self.epsilon, stats=self.stats,
                                       blame=self.runtime.admission.blame)
        self.evaluations = EvaluationLog(self.node, self.run_id, task=requested.task or "")
        self.training: Training | None = None
        self._opened = False
        self._parts = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task] = []

    def epsilon(self) -> float | None:
        accountant = self.training.accountant if self.training is not None else None
        return accountant.epsilon if accountant is not None else None

    def epsilon_local(self) -> float | None:
        """What one release of this peer, seen alone, has spent (differs from epsilon with noise shares)."""
        accountant = self.training.accountant if self.training is not None else None
        return accountant.epsilon_local if accountant is not None else None

    # ---- phase one --------------------------------------------------------------------------------

    async def open(self) -> RunConfig:
        """Start this peer's node and settle the run's settings with it: the manifest handed over, else
        the run's (every check of it is ``settle_run``'s). Once; the settled settings after that."""
        if self._opened:
            return self.config
        self._opened = True
        await self.node.start()
        self._on_close("node", self.node.shutdown)
        self.config, self.manifest = await settle_from_dht(
            self.node, self.run_id, self.requested, self.manifest, create=self.local.create,
            fingerprint=self._fingerprint, ticket=self.runtime.ticket, wait=self._wait)
        self.evaluations.task = (self.config.task or "")[:64]
        if self.manifest is not None:
            logger.info("run %s: settings from its manifest (%s)", self.run_id, self.config.settings_json())
        return self.config

    # ---- phase two --------------------------------------------------------------------------------

    async def build(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, batch_size: int | None = None,
                    dataset_size: int | None = None) -> Training:
        """Assemble the training parts on the node ``open`` started, then join the run."""
        config, timing = await self.open(), self.timing
        check_privacy(config, batch_size, dataset_size)
        await self._parts.enter_async_context(self.runtime)
        server = StateServer(self.runtime.transport, state_protocol(self.run_id), idle_seconds=timing.join_timeout)
        await self._enter("state server", server)
        policy = make_policy(config, model, optimizer, self.tracker)
        policy.before_outer_step = server.retire  # states served from the policy's tensors freeze or go
        per_sample = None
        if config.privacy is not None and config.privacy.level == "sample":
            assert batch_size is not None and dataset_size is not None
            per_sample = make_per_sample_private(model, config.privacy, batch_size, dataset_size)
        state = TrainingState(model, optimizer, policy)
        averager, backend = self._averaging(policy, batch_size, private=per_sample is None)
        await self._enter("averager", averager)
        # peers whose settings or model differ never share a round key: the presence record says which we have
        self.tracker.settings = f"{config.digest}.{averager.schema.digest[:8]}"
        self.tracker.next_epoch(self.tracker.local.epoch)

        def publish_state() -> None:
            server.publish(state.capture(self.tracker.local.epoch, {"settings": config.settings_json()}))

        catch_up = CatchUp(self.runtime, server, policy, state, self.tracker, timing, publish_state,
                           decoder=averager.result_decoder if isinstance(averager, Averager) else None)
        self.counters.observers.insert(0, catch_up.observe)
        if isinstance(averager, Averager) and averager.matchmaker is not None:
            averager.matchmaker.available = lambda: not catch_up.running  # not waited for while taking the state
        driver = RoundDriver(policy, backend, self.tracker, timing, catch_up, self.counters.record, run_id=self.run_id,
                             keep_result=server.publish_result, overlap=getattr(config.strategy, "overlap", "off"),
                             replayer=catch_up)
        checkpoints = self.local.checkpoints
        checkpointer = None if checkpoints.dir is None else Checkpointer(
            checkpoints.dir, self.run_id, checkpoints.every, lambda: server.latest, self._checkpoint_extra,
            hold=server.hold)
        self.training = Training(policy, state, averager, server, catch_up, driver, checkpointer, per_sample,
                                 publish_state)
        await self._join(self.training)
        if self.manifest is not None:
            self._tasks.append(asyncio.create_task(self._keep_manifest_published(self.manifest), name="peer manifest"))
        return self.training

    def _averaging(self, policy: Policy, batch_size: int | None,
                   private: bool) -> tuple[Averager | GossipAverager, AveragingBackend]:
        """The run's averaging over the policy's contribution; update-level privacy unless per-sample runs."""
        config = self.config
        privacy = config.privacy if private else None
        if config.averaging.kind == "gossip":
            gossip = GossipAverager(self.runtime, [policy.contribution], name=policy.averages,
                                    settings=config.averaging, weight=1.0, codec=config.compression,
                                    privacy=privacy, aggregator=config.aggregator)
            return gossip, GossipBackend(gossip, policy.contribution)
        batch = config.hparams.get("batch_size", batch_size)  # the run's, else the one given here
        cap = policy.weight_cap(batch if type(batch) is int and batch > 0 else None)
        averager = Averager(self.runtime, policy.contribution_views(), name=policy.averages, settings=config.averaging,
                            codec=config.compression, privacy=privacy, write_back=False,
                            aggregation=Aggregation(rule=config.aggregator, weight_cap=cap))
        policy.read_contributions = averager.read_in_place(policy.contribution_reader)
        return averager, MoshpitBackend(averager, in_place=policy.average_in_place)

    async def _join(self, training: Training) -> None:
        """Resume from the checkpoint, then take the swarm's state if it is further along."""
        fresh = True
        loaded = training.checkpointer.load() if training.checkpointer is not None else None
        if loaded is not None:
            snapshot, extra = loaded
            training.state.restore(snapshot)
            self._restore_extra(training, extra)
            self.tracker.next_epoch(snapshot.version)
            fresh = False
            training.catch_up.in_step = True  # a state the swarm had: rounds missed since can be replayed
            logger.info("resumed from checkpoint %s at epoch %d", training.checkpointer.directory, snapshot.version)
        await self.runtime.presence.read()  # who is here now, with the settings just published
        epoch, synchronous = self.tracker.local.epoch, training.policy.synchronous
        donors = self.tracker.ahead_of(epoch)
        if not donors and fresh and not synchronous:
            donors = self.tracker.others_at(epoch)  # gossip: any peer's state beats a random start
        if donors:
            try:
                await training.catch_up(donors, epoch + 1 if synchronous else 0)
                return
            except StateTransferError as error:
                logger.warning("could not download the swarm's state (%s); starting from local values", error)
        training.publish_state()

    def _checkpoint_extra(self) -> dict[str, Any]:
        accountant = self.training.accountant if self.training is not None else None
        return {"privacy": accountant.state_dict() if accountant is not None else None,
                "counters": {"steps": self.tracker.local.total_steps, "samples": self.tracker.local.total_samples}}

    def _restore_extra(self, training: Training, extra: dict[str, Any]) -> None:
        privacy_state = extra.get("privacy")
        if training.accountant is not None and privacy_state is not None:
            training.accountant.load_state_dict(privacy_state)  # a restart must not reset the privacy budget
        counters = extra.get("counters", {})
        self.tracker.resume_counters(int(counters.get("steps", 0)), int(counters.get("samples", 0)))

    def stats(self) -> TrainingStats:
        """The totals this peer's presence record carries (for dashboards)."""
        counters = self.counters
        loss = counters.loss if counters.loss is not None and abs(counters.loss) <= 1e9 else None
        return TrainingStats(loss=loss, rounds_ok=counters.rounds_ok, rounds_failed=counters.rounds_failed,
                             bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
                             state_downloads=self.training.catch_up.downloads if self.training else 0,
                             bans=len(self.runtime.admission.misbehaviour.bans()))

    async def _keep_manifest_published(self, manifest: RunManifest) -> None:
        """Every peer that trains with the run's manifest keeps it in its own slot: the run outlives its creator."""
        while True:
            try:
                await publish_manifest(self.node, self.run_id, manifest)
            except Exception as error:  # retried on the next beat
                logger.warning("could not republish the run manifest: %s", error)
            await asyncio.sleep(MANIFEST_TTL / 3)

    # ---- leaving ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Leave in reverse order; each part gets a deadline, so one that hangs (a groupmate that is
        leaving too, a daemon that died) cannot keep the peer from leaving."""
        if self.training is not None:
            self.training.driver.cancel_flight()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._parts.aclose()

    async def _enter(self, name: str, part: Any) -> None:
        await part.__aenter__()
        self._on_close(name, lambda: part.__aexit__(None, None, None))

    def _on_close(self, name: str, close: Callable[[], Awaitable[None]]) -> None:
        async def bounded() -> None:
            try:
                await asyncio.wait_for(close(), self.timing.close_part)
            except Exception as error:  # keep leaving: the parts after it close all the same
                logger.warning("while leaving: the %s: %s: %s", name, type(error).__name__, error)

        self._parts.push_async_callback(bounded)
