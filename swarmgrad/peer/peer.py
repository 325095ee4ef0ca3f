"""``swarmgrad.Peer``: wraps a model and optimizer so an ordinary training loop trains with a swarm.

    with Peer(model, optimizer, run_id="fmnist", initial_peers=[...], strategy=DiLoCo(inner_steps=50)) as peer:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            peer.step(batch_size=len(x))

``async with`` / ``await peer.astep(...)`` do the same inside an asyncio app. All networking runs on
one event loop (the app's, or a background thread's for the sync API); the training thread only
does local work, except while a swarm step (averaging) is due, when it waits for it.

Pausing (``peer.pause()`` / ``peer.resume()``, the CLI's SIGUSR1 / SIGUSR2): a paused peer leaves
the round in flight at once (its groupmates' deadline drops it), starts no new one, and stays a
member of the run, marked paused in its presence record. ``step()`` while paused trains nothing and
sends nothing: it drops the batch's gradients and returns. The first ``step()`` after ``resume()``
takes the swarm's state if the swarm moved on meanwhile (and drops that batch, computed from the
stale model); otherwise training goes on from where it paused.

The pieces: a ``NetworkRuntime`` (node, transport, state server, presence), a ``ProgressTracker``
(this peer's progress in its presence record, and everyone else's), a policy (the strategy: what it
contributes, how it applies the average), an averaging backend, and the ``RoundDriver`` that runs
the rounds. The Peer itself settles the run's settings, joins, keeps the state joiners download,
checkpoints and reports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from swarmgrad.averaging import Averager, GossipAverager
from swarmgrad.averaging.moshpit import UNREACHABLE_GROUP
from swarmgrad.averaging.privacy import Privacy, PrivateReleaser, make_per_sample_private
from swarmgrad.averaging.settings import Aggregation, Averaging
from swarmgrad.dht.evaluations import Evaluation, EvaluationLog, evaluation
from swarmgrad.dht.membership import TrainingStats, check_run_id, reachability
from swarmgrad.dht.node import NodeConfig
from swarmgrad.dht.tickets import Ticket
from swarmgrad.errors import ConfigError
from swarmgrad.eventloop import BackgroundLoop
from swarmgrad.net.accountability import DEFAULT_ACCOUNTABILITY, Accountability
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.ratelimit import DEFAULT_LIMIT_MBPS
from swarmgrad.peer.catch_up import CatchUp
from swarmgrad.peer.checkpoint import load_checkpoint, save_checkpoint
from swarmgrad.peer.config import RunConfig, resolve_against_run
from swarmgrad.peer.driver import AveragingBackend, GossipBackend, MoshpitBackend, RoundDriver, RoundOutcome
from swarmgrad.peer.manifest import MANIFEST_TTL, RunManifest, check_admission, publish_manifest, read_manifest
from swarmgrad.peer.progress import ProgressTracker
from swarmgrad.peer.state import TrainingState
from swarmgrad.peer.strategies.base import Policy
from swarmgrad.peer.strategies.registry import Strategy, make_policy
from swarmgrad.state.server import StateServer, state_protocol
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.timing import DEFAULT_TIMING, Timing

logger = logging.getLogger(__name__)

LOSS_SMOOTHING = 0.05


@dataclass
class PeerStatus:
    """What ``peer.status()`` returns; ``to_json()`` for scripts and event streams."""

    peer_id: str
    run_id: str
    step: int  # local optimizer steps (or accumulation steps) so far
    epoch: int  # swarm steps taken part in (or caught up to)
    samples: int  # samples trained on by this peer
    samples_per_second: float
    loss: float | None  # smoothed training loss, when step() was given one
    epsilon: float | None  # privacy spent so far, when privacy is on
    peers: int  # peers seen in the run's progress with this peer's settings (this one included)
    rounds_ok: int = 0
    rounds_failed: int = 0
    solo_steps: int = 0  # epochs finished alone (nobody to average with)
    bytes_sent: int = 0
    bytes_received: int = 0
    state_downloads: int = 0
    rounds_replayed: int = 0  # rounds it missed and applied afterwards, from a peer that kept their result
    rounds_overlapped: int = 0  # rounds that travelled while the next inner phase ran (overlap.py)
    settings: str = ""  # digest of the run settings this peer trains with
    warning: str | None = None  # why this peer trains alone, when it can tell
    paused: bool = False  # peer.pause() (SIGUSR1): no rounds, no training, until resume()
    reachability: str = "public"  # how others reach it: public, relayed (behind a NAT) or client
    rounds_unreachable: int = 0  # rounds sat out: nobody in its group publishes an address to reach it by
    last_report: dict[str, Any] | None = None
    refused_records: int = 0  # private run: member records of peers without a valid ticket, ignored
    refused_streams: int = 0  # private run: their streams, refused
    banned: dict[str, float] = field(default_factory=dict)  # peers banned here for misbehaviour -> seconds left

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("loss", "epsilon"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = None
        return data


@dataclass
class _Counters:
    rounds_ok: int = 0
    rounds_failed: int = 0
    rounds_unreachable: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    loss: float | None = None
    last_report: dict[str, Any] | None = field(default=None)


class Peer:
    """A training peer of run ``run_id``.

    Run settings (what every peer of a run shares): ``config=RunConfig(...)``, or any of its fields
    as keywords: ``strategy`` (DiLoCo (default), SyncSGD or GossipSGD), ``averaging`` (Moshpit() for
    diloco and sync, Gossip() for gossip), ``compression`` (none, fp16, bf16, int8 (default),
    topk:0.01, powersgd:4), ``aggregator`` (centered-clip (default), trimmed-mean, mean) and
    ``privacy`` (level="update" makes every released update private in the averaging layer;
    level="sample" runs per-sample DP-SGD in ``step`` and then needs ``batch_size`` and
    ``dataset_size``). When the run has a manifest, the settings not given come
    from it, and a given one that differs makes ``__enter__`` raise ``RunConfigMismatch``.

    Local settings: ``checkpoint_dir`` (resume from and save to it), ``network`` (a NodeConfig for
    host, port, identity, client mode, relays), ``timing`` (presence refresh, deadlines),
    ``manifest`` (a run manifest this peer keeps published while it runs), ``upload_limit_mbps`` /
    ``download_limit_mbps`` (caps in Mbit/s on everything this peer's averaging, gossip and state
    transfer send / receive, together; None: no cap), ``accountability`` (when a misbehaving peer
    is banned here: averaging/accountability.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        initial_peers: Sequence[str] = (),
        config: RunConfig | None = None,
        strategy: Strategy | None = None,
        averaging: Averaging | None = None,
        compression: str | None = None,
        aggregator: str | None = None,
        privacy: Privacy | None = None,
        batch_size: int | None = None,
        dataset_size: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: float = 60.0,
        network: NodeConfig | None = None,
        direct: bool = True,
        trusted_network: bool = False,
        timing: Timing | None = None,
        manifest: RunManifest | None = None,
        upload_limit_mbps: float | None = DEFAULT_LIMIT_MBPS,
        download_limit_mbps: float | None = DEFAULT_LIMIT_MBPS,
        ticket: Ticket | None = None,
        accountability: Accountability = DEFAULT_ACCOUNTABILITY,
    ):
        self.run_id = check_run_id(run_id)
        self.model, self.optimizer = model, optimizer
        self.requested = _requested_config(config, strategy=strategy, averaging=averaging, compression=compression,
                                           aggregator=aggregator, privacy=privacy)
        self.config = self.requested  # settled against the run's manifest on entering
        self.batch_size, self.dataset_size = batch_size, dataset_size
        self._check_local_privacy(self.requested)
        node_config = network if network is not None else NodeConfig()
        if initial_peers:
            node_config = node_config.model_copy(update={"initial_peers": [*node_config.initial_peers, *initial_peers]})
        self.timing = timing = timing or DEFAULT_TIMING
        self.runtime = NetworkRuntime(self.run_id, node_config, direct=direct, trusted_network=trusted_network,
                                      timing=timing, upload_limit_mbps=upload_limit_mbps,
                                      download_limit_mbps=download_limit_mbps, ticket=ticket,
                                      accountability=accountability)
        self.node = self.runtime.node
        self.state_server: StateServer | None = None  # what joiners download from this peer, once it runs
        self.tracker = ProgressTracker(self.runtime.presence, epsilon=lambda: self.epsilon, stats=self._stats,
                                       blame=self.runtime.admission.blame)
        self.evaluations = EvaluationLog(self.node, self.run_id, task=self.requested.task or "")
        # called on the peer's loop with each round's outcome (the metrics' round-time histogram)
        self.round_listeners: list[Callable[[RoundOutcome], None]] = []
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.manifest = manifest
        self.policy: Policy | None = None
        self.per_sample = None
        self.driver: RoundDriver | None = None
        self.catch_up: CatchUp | None = None
        self._averager: Averager | GossipAverager | None = None
        self._counters = _Counters()
        self._background: BackgroundLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_checkpoint = time.monotonic()
        self._opened = False
        self._paused = False
        self._interrupted = False  # interrupt(): leaving, so no more swarm steps
        self._resynced = True  # False after a resume, until the first step checked the swarm's epoch
        self._round: asyncio.Task | None = None  # the swarm step in flight, which pause() cancels
        self._pause_changed: asyncio.Event | None = None  # set on each pause/resume (the loop's)

    # ---- public: sync -----------------------------------------------------------------------------

    def __enter__(self) -> Peer:
        self._background = BackgroundLoop(name=f"swarmgrad-peer-{self.run_id}")
        try:
            self._background.run(self.__aenter__())
        except BaseException:
            self._background.close()
            self._background = None
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._background is None:
            return
        try:
            # the final checkpoint, then the averager and the runtime's four parts, each within close_part
            self._background.run(self.__aexit__(*exc_info), timeout=6 * self.timing.close_part)
        finally:
            self._background.close()
            self._background = None

    def step(self, batch_size: int, loss: float | torch.Tensor | None = None) -> None:
        """Call after ``loss.backward()`` on a batch of ``batch_size`` samples; the peer steps the optimizer.
        While paused it drops the batch and returns at once."""
        if self._paused or (not self._resynced and self._loop_run(self._resync())):
            self._drop_batch(batch_size)
            return
        due = self._local_step(batch_size, loss)
        if self._swarm_step_due(due):
            self._loop_run(self._swarm_step())

    def pause(self) -> concurrent.futures.Future[None]:
        """Leave the round in flight and take part in none until ``resume()``. Returns at once (safe
        from another thread or a signal handler); the future is done once the peer has paused."""
        return self._loop_submit(self.apause(), "pause")

    def resume(self) -> concurrent.futures.Future[None]:
        """Take part in rounds again; the next ``step()`` takes the swarm's state if it moved on."""
        return self._loop_submit(self.aresume(), "resume")

    def interrupt(self) -> concurrent.futures.Future[None]:
        """Leave the swarm step under way at once and start no new one: the peer is about to leave
        (``swarmgrad peer`` on SIGTERM). A round's matchmaking may otherwise wait a whole window for a
        member that already left. Returns at once (safe from a signal handler); ``step()`` then only
        trains locally."""
        return self._loop_submit(self.ainterrupt(), "interrupt")

    @property
    def paused(self) -> bool:
        return self._paused

    def wait_while_paused(self, seconds: float | None = None) -> bool:
        """Block while the peer is paused, at most ``seconds``; True when it is not paused (any more).
        For training loops that should not even compute batches while paused."""
        if self._background is None:
            raise RuntimeError("use `with peer:` first")
        if not self._paused:
            return True
        return self._background.run(self._await_resumed(seconds))

    def _loop_run(self, coroutine: Any) -> Any:
        if self._background is None:
            coroutine.close()
            raise RuntimeError("use `with peer:` (or `async with` and astep) before stepping")
        return self._background.run(coroutine)

    def _loop_submit(self, coroutine: Any, what: str) -> concurrent.futures.Future[None]:
        if self._background is None:
            coroutine.close()
            raise RuntimeError(f"use `with peer:` first (or `await peer.a{what}()` inside `async with`)")
        return self._background.submit(coroutine)

    # ---- public: async ----------------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        try:
            await self.runtime.__aenter__()
            await self._serve_state()
            await self._settle_config()
            await self._open_training()
            await self._join()
        except BaseException:
            await self._shutdown()
            raise
        self._opened = True
        if self.manifest is not None:
            self._tasks.append(asyncio.create_task(self._keep_manifest_published(), name="peer manifest"))
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self.driver is not None:
            await self.driver.abandon()  # a round in flight is dropped before the last checkpoint
        if self._opened and self.checkpoint_dir is not None:
            try:
                await self._save_checkpoint()
            except Exception as error:  # leaving must not fail because the disk is full
                logger.error("final checkpoint failed: %s", error)
        await self._shutdown()

    async def astep(self, batch_size: int, loss: float | torch.Tensor | None = None) -> None:
        """The asyncio twin of ``step``."""
        if self._paused or (not self._resynced and await self._resync()):
            self._drop_batch(batch_size)
            return
        due = self._local_step(batch_size, loss)
        if self._swarm_step_due(due):
            await self._swarm_step()

    async def apause(self) -> None:
        """The asyncio twin of ``pause``."""
        if self._paused:
            return
        self._paused = True
        if self._round is not None:
            # leave now: the group's deadline drops this peer (architecture.md, invariant 'stragglers are dropped')
            self._round.cancel()
            await asyncio.gather(self._round, return_exceptions=True)
        if self.driver is not None:
            self.driver.cancel_flight()  # a round in flight too: withdrawn by the first step after resuming
        self.tracker.set_averaging(False)
        self._announce_pause()
        logger.info("paused at epoch %d: in no round until resumed", self.epoch)

    async def ainterrupt(self) -> None:
        """The asyncio twin of ``interrupt``."""
        self._interrupted = True
        if self._round is not None:
            self._round.cancel()  # the group's deadline drops this peer, as for a pause
            await asyncio.gather(self._round, return_exceptions=True)

    async def aresume(self) -> None:
        """The asyncio twin of ``resume``."""
        if not self._paused:
            return
        self._paused, self._resynced = False, False
        self._announce_pause()
        logger.info("resumed at epoch %d", self.epoch)

    async def _await_resumed(self, seconds: float | None) -> bool:
        deadline = None if seconds is None else time.monotonic() + seconds
        while self._paused:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            event = self._pause_event()
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return True

    def _pause_event(self) -> asyncio.Event:
        if self._pause_changed is None:
            self._pause_changed = asyncio.Event()
        return self._pause_changed

    def _announce_pause(self) -> None:
        self.runtime.presence.paused = self._paused
        self.runtime.presence.publish_soon()
        self._pause_event().set()

    def _drop_batch(self, batch_size: int) -> None:
        """A paused peer trains nothing: the batch's gradients go, nothing is counted."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.model.zero_grad(set_to_none=True)

    async def _resync(self) -> bool:
        """The first step after a resume: take the swarm's state if it moved on while this peer was
        paused. True when it did (the batch at hand came from the old model)."""
        assert self.policy is not None and self.driver is not None
        self._resynced = True
        if self.driver.flight is not None:
            await self.driver.land()  # the round cancelled by the pause: withdrawn, nothing applied
        await self.runtime.presence.read()
        epoch = self.tracker.local.epoch
        donors = self.tracker.ahead_of(epoch)
        if not donors:
            return False
        try:
            await self.catch_up(donors, epoch + 1 if self.policy.synchronous else 0)
        except StateTransferError as error:
            logger.warning("after resuming: could not take the swarm's state (%s); training on", error)
            return False
        return True

    def wait_for_peers(self, count: int, seconds: float = 60.0) -> int:  # a user's choice: others start within a minute
        """Block until ``count`` peers (this one included) train in the run, or ``seconds`` pass;
        returns how many there are. Useful to start a swarm together."""
        if self._background is None:
            raise RuntimeError("use `with peer:` first (or `await peer.await_peers(...)` inside `async with`)")
        return self._background.run(self.await_peers(count, seconds))

    async def await_peers(self, count: int, seconds: float = 60.0) -> int:
        """The asyncio twin of ``wait_for_peers``."""
        deadline = time.monotonic() + seconds
        while len(self.tracker.fresh().peers) < count and time.monotonic() < deadline:
            await asyncio.sleep(self.timing.presence_refresh / 4)  # the presence refresh brings newcomers
        return len(self.tracker.swarm.peers)

    # ---- public: status ---------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def maddrs(self) -> list[str]:
        return self.node.maddrs

    @property
    def epoch(self) -> int:
        return self.tracker.local.epoch

    def swarm_model(self) -> dict[str, torch.Tensor] | None:
        """DiLoCo: the model's ``state_dict`` as of this peer's latest outer step, the swarm's model
        (what joiners download and checkpoints keep), without the local progress made since. With
        overlap a round lands in the middle of the next inner phase, and the live model then carries
        that phase's steps on one shard: held-out evaluations score this instead, as they score the
        fresh outer step where rounds run in turn. None for the other strategies, and until this
        epoch's state is published."""
        if self.policy is None or self.policy.averages != "delta" or self.state_server is None:
            return None
        latest = self.state_server.latest
        if latest is None or latest.version != self.epoch:
            return None
        return {name.removeprefix("model/"): tensor for name, tensor in latest.tensors().items()
                if name.startswith("model/")}

    def status(self) -> PeerStatus:
        local, counters = self.tracker.local, self._counters
        return PeerStatus(
            peer_id=self.node.peer_id, run_id=self.run_id, step=local.total_steps, epoch=local.epoch,
            samples=local.total_samples, samples_per_second=local.samples_per_second, loss=counters.loss,
            epsilon=self.epsilon, peers=len(self.tracker.swarm.peers), rounds_ok=counters.rounds_ok,
            rounds_failed=counters.rounds_failed, solo_steps=self.driver.solo_steps if self.driver else 0,
            bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
            state_downloads=self.catch_up.downloads if self.catch_up else 0,
            rounds_replayed=self.catch_up.replayed if self.catch_up else 0, settings=self.tracker.settings,
            rounds_overlapped=self.driver.overlapped if self.driver else 0,
            warning=self.driver.warning if self.driver else None, paused=self._paused,
            reachability=reachability(self.node.maddrs), rounds_unreachable=counters.rounds_unreachable,
            last_report=counters.last_report, refused_records=self.runtime.admission.refused_records,
            refused_streams=self.runtime.admission.refused_streams, banned=self.runtime.admission.misbehaviour.bans(),
        )

    def publish_evaluation(self, accuracy: float, loss: float | None = None, *, samples: int | None = None,
                           evaluated_at: float | None = None) -> concurrent.futures.Future[bool]:
        """Publish a held-out result of the current model as this peer's signed record of the run, so
        any dashboard of the run shows it. Returns at once; the future says whether it was stored."""
        if self._background is None:
            raise RuntimeError("use `with peer:` first (or `await peer.apublish_evaluation(...)` inside `async with`)")
        result = self._evaluation(accuracy, loss, samples, evaluated_at)
        return self._background.submit(self.evaluations.add(result))

    async def apublish_evaluation(self, accuracy: float, loss: float | None = None, *, samples: int | None = None,
                                  evaluated_at: float | None = None) -> bool:
        """The asyncio twin of ``publish_evaluation``: True once the record is stored."""
        return await self.evaluations.add(self._evaluation(accuracy, loss, samples, evaluated_at))

    def _evaluation(self, accuracy: float, loss: float | None, samples: int | None,
                    evaluated_at: float | None) -> Evaluation:
        return evaluation(accuracy, loss, epoch=self.epoch, step=self.tracker.local.total_steps,
                          evaluated_at=evaluated_at, samples=samples)

    @property
    def epsilon(self) -> float | None:
        if self.per_sample is not None:
            return self.per_sample.epsilon
        releaser = self._releaser()
        return releaser.epsilon if releaser is not None else None

    # ---- opening ----------------------------------------------------------------------------------

    async def _serve_state(self) -> None:
        server = StateServer(self.runtime.transport, state_protocol(self.run_id), idle_seconds=self.timing.join_timeout)
        await server.__aenter__()
        self.state_server = server

    async def _settle_config(self) -> None:
        """Take the run's settings from its manifest; refuse settings given here that differ (issue:
        two peers whose settings differ never share a round key, and would train alone silently)."""
        found = self.manifest  # a caller that settled the run already (`swarmgrad peer`) hands it over
        if found is None and self.node.config.initial_peers:
            found = await read_manifest(self.node, self.run_id, self.runtime.admission.run_key)
        check_admission(self.run_id, found, self.runtime.ticket)  # a private run's, or a ticket for none
        self.config = resolve_against_run(self.run_id, self.requested, found.run_config() if found else None)
        self._check_local_privacy(self.config)
        self.evaluations.task = (self.config.task or "")[:64]
        self.manifest = found  # train with the run's settings, and keep them published with the others
        if found is not None:
            logger.info("run %s: settings from its manifest (%s)", self.run_id, self.config.settings_json())

    def _check_local_privacy(self, config: RunConfig) -> None:
        if config.privacy is not None and config.privacy.level == "sample" and \
                (self.batch_size is None or self.dataset_size is None):
            raise ConfigError("privacy level='sample' (per-sample DP-SGD) needs batch_size and dataset_size")

    async def _open_training(self) -> None:
        config = self.config
        self.policy = make_policy(config, self.model, self.optimizer, self.tracker)
        if config.privacy is not None and config.privacy.level == "sample":
            self.per_sample = make_per_sample_private(self.model, config.privacy, self.batch_size, self.dataset_size)
        update_privacy = config.privacy if self.per_sample is None else None
        self.state = TrainingState(self.model, self.optimizer, self.policy)
        backend: AveragingBackend
        if config.averaging.kind == "gossip":
            gossip = GossipAverager(self.runtime, [self.policy.contribution], name=self.policy.averages,
                                    settings=config.averaging, weight=1.0, codec=config.compression,
                                    privacy=update_privacy, aggregator=config.aggregator)
            self._averager, backend = gossip, GossipBackend(gossip, self.policy.contribution)
        else:
            batch = config.hparams.get("batch_size", self.batch_size)  # the run's, else the one given here
            averager = Averager(self.runtime, self.policy.contribution_views(), name=self.policy.averages,
                                settings=config.averaging, codec=config.compression, privacy=update_privacy,
                                write_back=False, aggregation=Aggregation(
                                    rule=config.aggregator,
                                    weight_cap=self.policy.weight_cap(batch if type(batch) is int and batch > 0 else None)))
            self._averager, backend = averager, MoshpitBackend(averager)
        await self._averager.__aenter__()
        # peers whose settings or model differ never share a round key: the presence record says which we have
        schema = getattr(self._averager, "schema", None)
        self.tracker.settings = f"{config.digest}.{schema.digest[:8]}" if schema is not None else config.digest
        self.tracker.next_epoch(self.tracker.local.epoch)
        assert self.state_server is not None
        self.catch_up = CatchUp(self.runtime, self.state_server, self.policy, self.state, self.tracker, self.timing,
                                self._publish_state, decoder=getattr(self._averager, "result_decoder", None))
        self.driver = RoundDriver(self.policy, backend, self.tracker, self.timing, self.catch_up, self._record,
                                  run_id=self.run_id, keep_result=self.state_server.publish_result,
                                  overlap=getattr(self.config.strategy, "overlap", "off"))

    async def _join(self) -> None:
        """Resume from the checkpoint, then take the swarm's state if it is further along (architecture.md, invariant
        'joining is cheap')."""
        assert self.policy is not None
        fresh = True
        if self.checkpoint_dir is not None:
            loaded = load_checkpoint(self.checkpoint_dir, self.run_id)
            if loaded is not None:
                snapshot, extra = loaded
                self.state.restore(snapshot)
                self._restore_extra(extra)
                self.tracker.next_epoch(snapshot.version)
                fresh = False
                assert self.catch_up is not None
                self.catch_up.in_step = True  # a state the swarm had: rounds missed since can be replayed
                logger.info("resumed from checkpoint %s at epoch %d", self.checkpoint_dir, snapshot.version)
        await self.runtime.presence.read()  # who is here now, with the settings just published
        epoch = self.tracker.local.epoch
        donors = self.tracker.ahead_of(epoch)
        if not donors and fresh and not self.policy.synchronous:
            donors = self.tracker.others_at(epoch)  # gossip: any peer's state beats a random start
        if donors:
            try:
                await self.catch_up(donors, epoch + 1 if self.policy.synchronous else 0)
                return
            except StateTransferError as error:
                logger.warning("could not download the swarm's state (%s); starting from local values", error)
        self._publish_state()

    # ---- training ---------------------------------------------------------------------------------

    def _local_step(self, batch_size: int, loss: float | torch.Tensor | None) -> bool:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if self.policy is None:
            raise RuntimeError("use `with peer:` (or `async with` and astep) before stepping")
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            if math.isfinite(value):
                previous = self._counters.loss
                self._counters.loss = value if previous is None else previous + LOSS_SMOOTHING * (value - previous)
        if self.per_sample is not None:
            self.per_sample.clip_and_noise_gradients()  # raises BudgetExhausted past max_epsilon
        return self.policy.after_backward(batch_size)

    def _swarm_step_due(self, epoch_due: bool) -> bool:
        """After a local step: a swarm step is due (``epoch_due``, the policy's say), or the round in
        flight is to be landed (overlap.py); while one travels, the policy's say waits for it."""
        assert self.driver is not None
        return self.driver.landing_due() if self.driver.flight is not None else epoch_due

    async def _swarm_step(self) -> None:
        """The due swarm step, or the landing of the round in flight."""
        assert self.driver is not None
        if self._paused or self._interrupted:
            return
        landing = self.driver.flight is not None
        # its own task, so that pause() can cancel the round without cancelling the caller's task
        self._round = asyncio.ensure_future(self.driver.land() if landing else self._advance())
        try:
            advanced, keep_local_progress = await self._round
        except asyncio.CancelledError:
            current = asyncio.current_task()
            cancelling = getattr(current, "cancelling", lambda: 0)()  # Python 3.11+: is the caller cancelled too?
            if not ((self._paused or self._interrupted) and self._round.cancelled()) or cancelling:
                raise
            # paused or interrupted mid-round: the epoch stays as it was, nothing was applied
            # (architecture.md, invariant 'a failed round changes nothing')
            return
        finally:
            self._round = None
        if advanced:  # the parameters are the swarm's now (the new start): the state joiners take
            self._publish_state()
            if self.checkpoint_dir is not None and time.monotonic() - self._last_checkpoint >= self.checkpoint_every:
                await self._save_checkpoint()
        if keep_local_progress is not None:
            keep_local_progress()

    async def _advance(self) -> tuple[bool, None]:
        assert self.driver is not None
        return await self.driver.swarm_step(), None

    def _publish_state(self) -> None:
        assert self.state_server is not None
        epoch = self.tracker.local.epoch
        self.state_server.publish(self.state.capture(epoch, {"settings": self.config.settings_json()}))

    def _stats(self) -> TrainingStats:
        """The totals this peer's presence record carries (for dashboards)."""
        counters = self._counters
        loss = counters.loss if counters.loss is not None and abs(counters.loss) <= 1e9 else None
        return TrainingStats(loss=loss, rounds_ok=counters.rounds_ok, rounds_failed=counters.rounds_failed,
                             bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
                             state_downloads=self.catch_up.downloads if self.catch_up else 0,
                             bans=len(self.runtime.admission.misbehaviour.bans()))

    def _record(self, outcome: RoundOutcome) -> None:
        counters, report = self._counters, outcome.report
        if report is None:
            return
        for listener in self.round_listeners:
            try:
                listener(outcome)
            except Exception as error:  # an observer must not break the round's bookkeeping
                logger.warning("round listener failed: %s: %s", type(error).__name__, error)
        # bans (accountability.py): what the round caught, and a clean round for the others it saw contribute
        self.runtime.admission.misbehaviour.note_round(getattr(report, "suspicions", {}), getattr(report, "observed", []))
        counters.rounds_ok += int(outcome.ok)
        if outcome.ok and self.catch_up is not None and self.policy is not None and self.policy.synchronous:
            self.catch_up.in_step = True  # its state is the swarm's now: it may replay rounds it misses
        counters.rounds_failed += int(not outcome.ok)
        counters.rounds_unreachable += int(getattr(report, "error", None) == UNREACHABLE_GROUP)
        counters.bytes_sent += getattr(report, "bytes_sent", 0)
        counters.bytes_received += getattr(report, "bytes_received", 0)
        counters.last_report = {key: value for key, value in asdict(report).items()
                                if key not in ("group", "contributors", "transports", "pushed_to", "failed", "observed")}
        counters.last_report["peers"] = len(getattr(report, "group", getattr(report, "pushed_to", [])))
        if hasattr(report, "allreduce_seconds"):  # a group round (a gossip push is too frequent to log)
            if outcome.ok and self.catch_up is not None:
                self.catch_up.note_round(report.bytes_received, report.allreduce_seconds)
            logger.info("round %d: %s, %d peers, %.1f s (all-reduce %.1f s), %.2f MB sent", report.round_index,
                        "ok" if outcome.ok else f"failed ({report.error})", counters.last_report["peers"],
                        report.seconds, report.allreduce_seconds, report.bytes_sent / 1e6)

    # ---- privacy and checkpoints ------------------------------------------------------------------

    def _releaser(self) -> PrivateReleaser | None:
        """The accountant of update-level privacy (None without it, or with per-sample privacy)."""
        return getattr(self._averager, "releaser", None)

    def _privacy_state(self) -> dict[str, Any] | None:
        holder = self.per_sample if self.per_sample is not None else self._releaser()
        return holder.state_dict() if holder is not None else None

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        privacy_state = extra.get("privacy")
        holder = self.per_sample if self.per_sample is not None else self._releaser()
        if holder is not None and privacy_state is not None:
            holder.load_state_dict(privacy_state)  # a restart must not reset the privacy budget
        counters = extra.get("counters", {})
        self.tracker.resume_counters(int(counters.get("steps", 0)), int(counters.get("samples", 0)))

    async def _save_checkpoint(self) -> None:
        assert self.checkpoint_dir is not None
        snapshot = self.state_server.latest if self.state_server is not None else None
        if snapshot is None:
            return
        extra = {"privacy": self._privacy_state(),
                 "counters": {"steps": self.tracker.local.total_steps, "samples": self.tracker.local.total_samples}}
        await asyncio.get_running_loop().run_in_executor(
            None, save_checkpoint, self.checkpoint_dir, self.run_id, snapshot, extra)
        self._last_checkpoint = time.monotonic()

    # ---- background and leaving -------------------------------------------------------------------

    async def _keep_manifest_published(self) -> None:
        """Every peer that trains with the run's manifest keeps it in its own slot: the run outlives its creator."""
        assert self.manifest is not None
        while True:
            try:
                await publish_manifest(self.node, self.run_id, self.manifest)
            except Exception as error:  # retried on the next beat
                logger.warning("could not republish the run manifest: %s", error)
            await asyncio.sleep(MANIFEST_TTL / 3)

    async def _shutdown(self) -> None:
        if self.driver is not None:
            self.driver.cancel_flight()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._averager is not None:
            try:
                await asyncio.wait_for(self._averager.__aexit__(None, None, None), self.timing.close_part)
            except Exception as error:  # keep leaving: the runtime closes the rest
                logger.warning("while closing the peer's averager: %s: %s", type(error).__name__, error)
        if self.state_server is not None:
            try:
                await asyncio.wait_for(self.state_server.__aexit__(None, None, None), self.timing.close_part)
            except Exception as error:  # keep leaving
                logger.warning("while closing the state server: %s: %s", type(error).__name__, error)
            self.state_server = None
        await self.runtime.__aexit__(None, None, None)
        self._opened = False


def _requested_config(config: RunConfig | None, **fields: Any) -> RunConfig:
    """The settings the caller chose: ``config`` and/or keywords (not both for one field)."""
    given = {name: value for name, value in fields.items() if value is not None}
    if config is None:
        return RunConfig(**given)
    both = sorted(set(given) & config.model_fields_set)
    if both:
        raise ConfigError(f"{', '.join(both)} given both in config= and as keyword(s): pass each once")
    if not given:
        return config
    return RunConfig(**{name: getattr(config, name) for name in config.model_fields_set}, **given)
