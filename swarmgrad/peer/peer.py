"""``swarmgrad.Peer``: wraps a model and optimizer so an ordinary training loop trains with a swarm.

    with Peer(model, optimizer, run_id="fmnist", initial_peers=[...], strategy=DiLoCo(inner_steps=50)) as peer:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            peer.step(batch_size=len(x))

``async with`` / ``await peer.astep(...)`` do the same inside an asyncio app. All networking runs on
one event loop (the app's, or a background thread's for the sync API); the training thread only
does local work, except while a swarm step (averaging) is due, when it waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from swarmgrad.averaging.privacy import Privacy, PrivateReleaser, make_per_sample_private
from swarmgrad.averaging.state_transfer import StateServer, StateTransferError, download_state
from swarmgrad.averaging.transport import Libp2pTransport
from swarmgrad.dht.membership import Membership, check_run_id
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.errors import ConfigError
from swarmgrad.peer.checkpoint import load_checkpoint, save_checkpoint
from swarmgrad.peer.manifest import MANIFEST_TTL, RunManifest, publish_manifest
from swarmgrad.peer.progress import ProgressTracker
from swarmgrad.peer.settings import Averaging, Gossip, Moshpit
from swarmgrad.peer.state import TrainingState, not_optimizer
from swarmgrad.peer.strategies import DiLoCo, GossipSGD, Strategy, StrategyContext
from swarmgrad.runtime import BackgroundLoop

logger = logging.getLogger(__name__)
CLOSE_PART_SECONDS = 10.0  # strategy, progress, membership, state server: each; then the node (<= 10 s)

MAX_ROUND_ATTEMPTS = 3
CATCH_UP_RETRY_SECONDS = 5.0
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
    peers: int  # peers seen in the run's progress (this one included)
    rounds_ok: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    state_downloads: int = 0
    last_report: dict[str, Any] | None = None

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
    bytes_sent: int = 0
    bytes_received: int = 0
    state_downloads: int = 0
    loss: float | None = None
    last_report: dict[str, Any] | None = field(default=None)


class Peer:
    """A training peer of run ``run_id``.

    ``strategy``: DiLoCo (default), SyncSGD or GossipSGD. ``averaging``: Moshpit() (default for
    diloco and sync) or Gossip() (default for gossip). ``compression``: a codec spec (none, fp16,
    bf16, int8, topk:0.01, powersgd:4). ``privacy``: level="update" makes every released update
    private in the averaging layer; level="sample" runs per-sample DP-SGD in ``step`` and then
    needs ``batch_size`` and ``dataset_size``. ``checkpoint_dir``: resume from and save to it.
    ``network``: a NodeConfig for host, port, identity, client mode, relays. ``manifest``: a run
    manifest this peer keeps published while it runs (public runs, see manifest.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        initial_peers: Sequence[str] = (),
        strategy: Strategy | None = None,
        averaging: Averaging | None = None,
        compression: str = "none",
        privacy: Privacy | None = None,
        batch_size: int | None = None,
        dataset_size: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: float = 60.0,
        network: NodeConfig | None = None,
        direct: bool = True,
        trusted_network: bool = False,
        progress_refresh: float = 1.0,
        join_timeout: float = 60.0,
        manifest: RunManifest | None = None,
    ):
        self.run_id = check_run_id(run_id)
        self.model, self.optimizer = model, optimizer
        self.strategy = strategy if strategy is not None else DiLoCo()
        self.averaging = averaging if averaging is not None else (
            Gossip() if isinstance(self.strategy, GossipSGD) else Moshpit())
        self.strategy.check(self.averaging)
        self.compression, self.privacy = compression, privacy
        self.per_sample = None
        if privacy is not None and privacy.level == "sample":
            if batch_size is None or dataset_size is None:
                raise ConfigError("privacy level='sample' (per-sample DP-SGD) needs batch_size and dataset_size")
            self.per_sample = make_per_sample_private(model, privacy, batch_size, dataset_size)
        if not 0.1 <= progress_refresh <= 60:
            raise ConfigError(f"progress_refresh must be within 0.1..60 s, got {progress_refresh}")
        config = network if network is not None else NodeConfig()
        if initial_peers:
            config = config.model_copy(update={"initial_peers": [*config.initial_peers, *initial_peers]})
        self.node = SwarmNode(config)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.join_timeout = checkpoint_every, join_timeout
        self.direct, self.trusted_network, self.progress_refresh = direct, trusted_network, progress_refresh
        self.state = TrainingState(model, optimizer, self.strategy)
        self.tracker = ProgressTracker(self.node, self.run_id, refresh=progress_refresh)
        self.membership = Membership(self.node, self.run_id, role="client" if config.client_mode else "peer",
                                     ttl=max(6.0, 6 * progress_refresh))
        self._protocol = f"swarmgrad/{self.run_id}/state"
        self._server: StateServer | None = None
        self._transport: Libp2pTransport | None = None
        self._counters = _Counters()
        self._background: BackgroundLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_checkpoint = time.monotonic()
        self._opened = False
        self._catch_up_retry_at = 0.0
        self.manifest = manifest

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
            self._background.run(self.__aexit__(*exc_info), timeout=60)
        finally:
            self._background.close()
            self._background = None

    def step(self, batch_size: int, loss: float | torch.Tensor | None = None) -> None:
        """Call after ``loss.backward()`` on a batch of ``batch_size`` samples; the peer steps the optimizer."""
        if self._local_step(batch_size, loss):
            if self._background is None:
                raise RuntimeError("use `with peer:` (or `async with` and astep) before stepping")
            self._background.run(self._swarm_step())

    # ---- public: async ----------------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        await self.node.start()
        try:
            self._transport = Libp2pTransport(self.node.p2p)
            self._server = StateServer(self._transport, self._protocol)
            await self._server.__aenter__()
            await self.membership.__aenter__()
            await self.tracker.__aenter__()
            await self.strategy.open(StrategyContext(
                self.model, self.optimizer, self.node, self.run_id, self.tracker, self.averaging, self.compression,
                self.privacy if self.per_sample is None else None, self.direct, self.trusted_network))
            await self._join()
        except BaseException:
            await self._shutdown()
            raise
        self._opened = True
        self._tasks.append(asyncio.create_task(self._announce_forever(), name="peer announce"))
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._opened and self.checkpoint_dir is not None:
            try:
                await self._save_checkpoint()
            except Exception as error:  # leaving must not fail because the disk is full
                logger.error("final checkpoint failed: %s", error)
        await self._shutdown()

    async def astep(self, batch_size: int, loss: float | torch.Tensor | None = None) -> None:
        """The asyncio twin of ``step``."""
        if self._local_step(batch_size, loss):
            await self._swarm_step()

    def wait_for_peers(self, count: int, seconds: float = 60.0) -> int:
        """Block until ``count`` peers (this one included) train in the run, or ``seconds`` pass;
        returns how many there are. Useful to start a swarm together."""
        if self._background is None:
            raise RuntimeError("use `with peer:` first (or `await peer.await_peers(...)` inside `async with`)")
        return self._background.run(self.await_peers(count, seconds))

    async def await_peers(self, count: int, seconds: float = 60.0) -> int:
        """The asyncio twin of ``wait_for_peers``."""
        deadline = time.monotonic() + seconds
        while len(self.tracker.fresh().peers) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
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

    def status(self) -> PeerStatus:
        local, counters = self.tracker.local, self._counters
        return PeerStatus(
            peer_id=self.node.peer_id, run_id=self.run_id, step=local.total_steps, epoch=local.epoch,
            samples=local.total_samples, samples_per_second=local.samples_per_second, loss=counters.loss,
            epsilon=self.epsilon, peers=len(self.tracker.swarm.peers), rounds_ok=counters.rounds_ok,
            rounds_failed=counters.rounds_failed, bytes_sent=counters.bytes_sent,
            bytes_received=counters.bytes_received, state_downloads=counters.state_downloads,
            last_report=counters.last_report,
        )

    @property
    def epsilon(self) -> float | None:
        if self.per_sample is not None:
            return self.per_sample.epsilon
        releaser = self._releaser()
        return releaser.epsilon if releaser is not None else None

    # ---- internals --------------------------------------------------------------------------------

    def _local_step(self, batch_size: int, loss: float | torch.Tensor | None) -> bool:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            if math.isfinite(value):
                previous = self._counters.loss
                self._counters.loss = value if previous is None else previous + LOSS_SMOOTHING * (value - previous)
        if self.per_sample is not None:
            self.per_sample.clip_and_noise_gradients()  # raises BudgetExhausted past max_epsilon
        return self.strategy.after_backward(batch_size)

    async def _swarm_step(self) -> None:
        epoch = self.tracker.local.epoch
        if time.monotonic() < self._catch_up_retry_at:
            return  # the last download failed: train on locally for a moment before trying again
        if self.strategy.synchronous:
            ahead = self.tracker.ahead_of(epoch)
            if ahead:  # the swarm moved on without us: take its state instead of averaging stale values
                await self._try_catch_up(ahead, epoch + 1)
                return
        applied, attempts = False, MAX_ROUND_ATTEMPTS
        if self.strategy.synchronous and not self.tracker.others_at(epoch) and not self.tracker.others_at(epoch - 1):
            attempts = 0  # alone in the run: no one to average with
        else:
            self.tracker.set_averaging(True)
        for attempt in range(attempts):
            outcome = await self.strategy.swarm_step(epoch, attempt)
            self._record(outcome.report, outcome.applied)
            applied = outcome.applied
            if applied or not self.strategy.synchronous:
                break
            ahead = await self._wait_for_ahead(epoch)
            if ahead:
                await self._try_catch_up(ahead, epoch + 1)
                return
            if not self.tracker.others_at(epoch):
                break  # nobody else is training: finish the epoch alone
        if self.strategy.synchronous and not applied:
            logger.info("epoch %d: no group after %d attempt(s); stepping on local values", epoch, attempts)
            self.strategy.solo_step()
        self.tracker.next_epoch(epoch + 1)
        self._publish_state()
        if self.checkpoint_dir is not None and time.monotonic() - self._last_checkpoint >= self.checkpoint_every:
            await self._save_checkpoint()

    async def _wait_for_ahead(self, epoch: int) -> list[str]:
        """Peers that finished ``epoch`` (a round we missed), waiting long enough for them to say so."""
        deadline = time.monotonic() + 2 * self.progress_refresh + 0.5
        while True:
            ahead = self.tracker.ahead_of(epoch)
            if ahead or time.monotonic() > deadline:
                return ahead
            await asyncio.sleep(0.1)

    async def _join(self) -> None:
        """Resume from the checkpoint, then take the swarm's state if it is further along (invariant 8)."""
        fresh = True
        if self.checkpoint_dir is not None:
            loaded = load_checkpoint(self.checkpoint_dir, self.run_id)
            if loaded is not None:
                snapshot, extra = loaded
                self.state.restore(snapshot)
                self._restore_extra(extra)
                self.tracker.next_epoch(snapshot.version)
                fresh = False
                logger.info("resumed from checkpoint %s at epoch %d", self.checkpoint_dir, snapshot.version)
        epoch = self.tracker.local.epoch
        donors = self.tracker.ahead_of(epoch)
        if not donors and fresh and not self.strategy.synchronous:
            donors = self.tracker.others_at(epoch)  # gossip: any peer's state beats a random start
        if donors:
            try:
                await self._catch_up(donors, epoch + 1 if self.strategy.synchronous else 0)
                return
            except StateTransferError as error:
                logger.warning("could not download the swarm's state (%s); starting from local values", error)
        self._publish_state()

    async def _try_catch_up(self, donors: list[str], min_version: int) -> None:
        """Take the swarm's state; if no donor can hand it over, keep training locally and retry later
        (a donor that just left, or a slow link, must not end this peer)."""
        try:
            await self._catch_up(donors, min_version)
        except StateTransferError as error:
            self._catch_up_retry_at = time.monotonic() + CATCH_UP_RETRY_SECONDS
            logger.warning("could not take the swarm's state (%s); training on, retrying in %.0f s",
                           error, CATCH_UP_RETRY_SECONDS)

    async def _catch_up(self, donors: list[str], min_version: int) -> None:
        # a peer that steps its own optimizer and has its state keeps it, and so downloads about
        # half the bytes (Adam: params + 2 moments): a peer on a slow link that fell behind gets
        # back in step before the swarm moves on again. A fresh joiner takes the donors' state.
        keep_optimizer = self.strategy.local_optimizer and bool(self.optimizer.state)
        snapshot = await download_state(self._transport, self._protocol, donors, seconds=self.join_timeout,
                                        min_version=min_version, keep=not_optimizer if keep_optimizer else None)
        self.state.restore(snapshot, keep_optimizer=keep_optimizer)
        self._counters.state_downloads += 1
        self.tracker.next_epoch(snapshot.version)
        self._publish_state()
        logger.info("took the swarm's state at epoch %d (%d bytes from %d donor(s)%s)", snapshot.version,
                    snapshot.nbytes, len(donors), "; kept its own optimizer state" if keep_optimizer else "")

    def _publish_state(self) -> None:
        assert self._server is not None
        epoch = self.tracker.local.epoch
        self._server.publish(self.state.capture(epoch, {"strategy": self.strategy.config()}))

    def _record(self, report: Any, applied: bool) -> None:
        counters = self._counters
        if report is None:
            return
        counters.rounds_ok += int(applied)
        counters.rounds_failed += int(not applied)
        counters.bytes_sent += getattr(report, "bytes_sent", 0)
        counters.bytes_received += getattr(report, "bytes_received", 0)
        counters.last_report = {key: value for key, value in asdict(report).items()
                                if key not in ("group", "contributors", "transports", "pushed_to", "failed")}
        counters.last_report["peers"] = len(getattr(report, "group", getattr(report, "pushed_to", [])))

    def _releaser(self) -> PrivateReleaser | None:
        """The accountant of update-level privacy (None without it, or with per-sample privacy)."""
        return next((a.releaser for a in self.strategy.averagers() if a.releaser is not None), None)

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
        assert self.checkpoint_dir is not None and self._server is not None
        snapshot = self._server.latest
        if snapshot is None:
            return
        extra = {"privacy": self._privacy_state(),
                 "counters": {"steps": self.tracker.local.total_steps, "samples": self.tracker.local.total_samples}}
        await asyncio.get_running_loop().run_in_executor(
            None, save_checkpoint, self.checkpoint_dir, self.run_id, snapshot, extra)
        self._last_checkpoint = time.monotonic()

    async def _announce_forever(self) -> None:
        published = -math.inf
        while True:
            if self.manifest is not None and time.monotonic() - published > MANIFEST_TTL / 3:
                try:
                    await publish_manifest(self.node, self.run_id, self.manifest)
                    published = time.monotonic()
                except Exception as error:  # retried on the next beat
                    logger.warning("could not republish the run manifest: %s", error)
            local = self.tracker.local
            epsilon = self.epsilon
            self.membership.update(step=local.total_steps, samples_per_second=local.samples_per_second,
                                   epsilon=epsilon if epsilon is None or math.isfinite(epsilon) else None)
            await asyncio.sleep(self.progress_refresh)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        parts = [("strategy", self.strategy.close()), ("progress", self.tracker.__aexit__(None, None, None)),
                 ("membership", self.membership.__aexit__(None, None, None))]
        if self._server is not None:
            parts.append(("state server", self._server.__aexit__(None, None, None)))
        for name, closing in parts:
            try:
                # each part gets a deadline: the peer leaves in bounded time even if a part hangs
                # (e.g. on a groupmate that is leaving too), and `with peer` never outlives its 60 s
                await asyncio.wait_for(closing, CLOSE_PART_SECONDS)
            except asyncio.TimeoutError:
                logger.warning("while closing the peer: its %s did not finish within %.0f s", name, CLOSE_PART_SECONDS)
            except Exception as error:  # keep closing the rest
                logger.debug("while closing the peer's %s: %s: %s", name, type(error).__name__, error)
        await self.node.shutdown()
        self._opened = False
