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

The Peer is a façade: ``PeerAssembly`` (assembly.py) builds and owns the parts (node, network
runtime, state server, policy, averaging backend, round driver, catch-up, checkpointer); the Peer
steps, pauses, reports and publishes evaluations through them. ``OpenRun`` (open_run.py) is the two-phase way in
for a caller that needs the run's settings before it can build its model (``swarmgrad peer``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import torch

from swarmgrad.dht.evaluations import Evaluation, evaluation
from swarmgrad.dht.membership import reachability
from swarmgrad.eventloop import BackgroundLoop
from swarmgrad.hostmemory import release_freed_memory, tune_allocator
from swarmgrad.peer.assembly import PeerAssembly, Training, check_privacy
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.keywords import peer_settings
from swarmgrad.peer.manifest import RunManifest
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.peer.status import PeerStatus
from swarmgrad.state.snapshot import StateTransferError

logger = logging.getLogger(__name__)


class Peer:
    """A training peer of a run.

    ``config``: the run settings (what every peer of a run shares, ``RunConfig``); its fields may also
    be given as keywords: ``strategy`` (DiLoCo (default), SyncSGD or GossipSGD), ``averaging``
    (Moshpit() for diloco and sync, Gossip() for gossip), ``compression`` (a codec name: averaging/codecs),
    ``aggregator`` (centered-clip (default), trimmed-mean, mean) and ``privacy`` (level="update"
    makes every released update private in the averaging layer; level="sample" runs per-sample DP-SGD
    in ``step`` and then needs ``batch_size`` and ``dataset_size``). When the run has a manifest, the
    settings not given come from it, and a given one that differs makes entering raise ``RunConfigMismatch``.

    ``peer``: this peer's own settings (``PeerConfig``: network, connection, checkpoints, bans, timing,
    ...); each of its options may also be given as a keyword by its flag name (``run_id``,
    ``initial_peers``, ``checkpoint_dir``, ``upload_limit_mbps``, ``ticket`` (a ticket file), ...),
    and each section by its name (``network=NodeConfig(...)``, ``timing=Timing(...)``,
    ``bans=Accountability(...)``). ``manifest``: a run manifest this peer publishes (and keeps
    published while it runs): it creates the run. ``grad_scaler``: fp16's ``torch.amp.GradScaler``,
    when the loss given to ``backward`` was scaled with it: ``step`` unscales the gradients and skips a
    step whose gradients overflowed (not stepped, not counted, never sent).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config: RunConfig | None = None,
                 peer: PeerConfig | None = None, batch_size: int | None = None, dataset_size: int | None = None,
                 manifest: RunManifest | None = None, grad_scaler: torch.amp.GradScaler | None = None, **options: Any):
        requested, local = peer_settings(config, peer, options)
        check_privacy(requested, batch_size, dataset_size)
        self._attach(PeerAssembly(requested, local, manifest), model, optimizer, batch_size, dataset_size, None)
        self.grad_scaler = grad_scaler

    @classmethod
    def _on(cls, assembly: PeerAssembly, background: BackgroundLoop, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, batch_size: int | None, dataset_size: int | None,
            grad_scaler: torch.amp.GradScaler | None = None) -> Peer:
        """A Peer on a run that ``OpenRun`` (open_run.py) opened: its node, its settled settings, its event loop."""
        peer = cls.__new__(cls)
        peer._attach(assembly, model, optimizer, batch_size, dataset_size, background)
        peer.grad_scaler = grad_scaler
        return peer

    def _attach(self, assembly: PeerAssembly, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batch_size: int | None, dataset_size: int | None, background: BackgroundLoop | None) -> None:
        self.assembly, self.model, self.optimizer = assembly, model, optimizer
        self.batch_size, self.dataset_size = batch_size, dataset_size
        tune_allocator()  # freed blocks reused while training, handed back after each round (hostmemory.py)
        self.run_id, self.timing = assembly.run_id, assembly.timing
        self.runtime, self.node, self.tracker = assembly.runtime, assembly.node, assembly.tracker
        self.counters, self.evaluations = assembly.counters, assembly.evaluations
        self.training: Training | None = None  # the parts phase two built, once entered
        self._background = background
        self._paused = False
        self._interrupted = False  # interrupt(): leaving, so no more swarm steps
        self._resynced = True  # False after a resume, until the first step checked the swarm's epoch
        self._round: asyncio.Task | None = None  # the swarm step in flight, which pause() cancels
        self._pause_changed: asyncio.Event | None = None  # set on each pause/resume (the loop's)

    @property
    def requested(self) -> RunConfig:
        """The run settings this peer chose."""
        return self.assembly.requested

    @property
    def config(self) -> RunConfig:
        """The run settings it trains with: the run's, once entered."""
        return self.assembly.config

    @property
    def manifest(self) -> RunManifest | None:
        return self.assembly.manifest

    # ---- public: sync -----------------------------------------------------------------------------

    def __enter__(self) -> Peer:
        if self._background is None:
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
            # the final checkpoint, then the averager and the runtime's parts, each within close_part
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
            self.training = await self.assembly.build(self.model, self.optimizer, batch_size=self.batch_size,
                                                      dataset_size=self.dataset_size)
            self.training.policy.grad_scaler = self.grad_scaler
        except BaseException:
            await self.assembly.close()
            raise
        _hand_back_freed_memory()  # what building the peer freed: its first round would otherwise stack on it
        return self

    async def __aexit__(self, *exc_info) -> None:
        training = self.training
        if training is not None:
            await training.driver.abandon()  # a round in flight is dropped before the last checkpoint
            if training.checkpointer is not None:
                try:
                    await training.checkpointer.save_last()
                except Exception as error:  # leaving must not fail because the disk is full
                    logger.error("final checkpoint failed: %s", error)
        await self.assembly.close()

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
            self._round.cancel()  # leave now: the group's deadline drops this peer 
            await asyncio.gather(self._round, return_exceptions=True)
        if self.training is not None:
            self.training.driver.cancel_flight()  # a round in flight too: withdrawn by the first step after resuming
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
        assert self.training is not None
        training, self._resynced = self.training, True
        if training.driver.flight is not None:
            await training.driver.land()  # the round cancelled by the pause: withdrawn, nothing applied
        await training.driver.settle_missed()  # the epoch is the state's again before it is compared
        await self.runtime.presence.read()
        epoch = self.tracker.local.epoch
        donors = self.tracker.ahead_of(epoch)
        if not donors:
            return False
        try:
            await training.catch_up(donors, epoch + 1 if training.policy.synchronous else 0)
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
        if self.training is None or self.training.policy.averages != "delta":
            return None
        latest = self.training.server.latest
        if latest is None or latest.version != self.epoch:
            return None
        return {name.removeprefix("model/"): tensor for name, tensor in latest.tensors().items()
                if name.startswith("model/")}

    def status(self) -> PeerStatus:
        local, counters, training = self.tracker.local, self.counters, self.training
        driver, catch_up = (training.driver, training.catch_up) if training is not None else (None, None)
        timer = training.round_timer if training is not None else None
        return PeerStatus(
            peer_id=self.node.peer_id, run_id=self.run_id, step=local.total_steps, epoch=local.epoch,
            samples=local.total_samples, samples_per_second=local.samples_per_second, loss=counters.loss,
            epsilon=self.epsilon, peers=len(self.tracker.swarm.peers), rounds_ok=counters.rounds_ok,
            rounds_failed=counters.rounds_failed, solo_steps=driver.solo_steps if driver else 0,
            samples_averaged=driver.samples_averaged if driver else 0,
            bytes_sent=counters.bytes_sent, bytes_received=counters.bytes_received,
            state_downloads=catch_up.downloads if catch_up else 0,
            rounds_replayed=catch_up.replayed if catch_up else 0, settings=self.tracker.settings,
            rounds_overlapped=driver.overlapped if driver else 0,
            warning=driver.warning if driver else None, paused=self._paused,
            epsilon_local=self.assembly.epsilon_local(),
            reachability=reachability(self.node.maddrs), rounds_unreachable=counters.rounds_unreachable,
            last_report=counters.last_report, refused_records=self.runtime.admission.refused_records,
            refused_streams=self.runtime.admission.refused_streams, banned=self.runtime.admission.misbehaviour.bans(),
            swarm_memory=self.swarm_memory(),
            kept_results_on_disk=training.server.results.bytes_on_disk() if training is not None else 0,
            round_deadline=timer.next_deadline if timer else None,
            round_rate_mbps=timer.assumed_rate * 8 / 1e6 if timer else None,
            longest_round=counters.longest_round, longest_allreduce=counters.longest_allreduce,
            entry_points=self.node.entry_points(), asyncio_tasks=self._asyncio_tasks(), **self._attendance(),
            device_bytes=training.policy.boundary.crossings.total() if training is not None else 0,
        )

    def _asyncio_tasks(self) -> int | None:
        loop = self._background.loop if self._background is not None else None
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return None
        return len(asyncio.all_tasks(loop))

    def _attendance(self) -> dict[str, Any]:
        matchmaker = getattr(self.training.averager, "matchmaker", None) if self.training is not None else None
        if matchmaker is None:
            return {}
        return {"no_shows": dict(matchmaker.attendance.no_shows), "absent": matchmaker.attendance.suspects()}

    def swarm_memory(self) -> dict[str, int]:
        """Host bytes held for the swarm beyond the model, its gradients and the optimizer, by holder."""
        training = self.training
        if training is None:
            return {}
        held = {**training.policy.held_bytes(), **training.server.held_bytes()}
        averager_bytes = getattr(training.averager, "held_bytes", None)
        if averager_bytes is not None:
            held.update(averager_bytes())
        return held

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
        """Privacy spent so far (None without privacy)."""
        return self.assembly.epsilon()

    # ---- training ---------------------------------------------------------------------------------

    def _local_step(self, batch_size: int, loss: float | torch.Tensor | None) -> bool:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if self.training is None:
            raise RuntimeError("use `with peer:` (or `async with` and astep) before stepping")
        if loss is not None:  # a tensor stays one: reading it would make the host wait for the device
            self.counters.note_loss(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        if self.training.per_sample is not None:
            self.training.per_sample.clip_and_noise_gradients()  # raises BudgetExhausted past max_epsilon
        return self.training.policy.after_backward(batch_size)

    def _swarm_step_due(self, epoch_due: bool) -> bool:
        """After a local step: a swarm step is due (``epoch_due``, the policy's say), or the round in
        flight is to be landed (overlap.py); while one travels, the policy's say waits for it."""
        assert self.training is not None
        driver = self.training.driver
        return driver.landing_due() if driver.flight is not None else epoch_due

    async def _swarm_step(self) -> None:
        """The due swarm step, or the landing of the round in flight."""
        assert self.training is not None
        if self._paused or self._interrupted:
            return
        training = self.training
        landing = training.driver.flight is not None
        # its own task, so that pause() can cancel the round without cancelling the caller's task
        self._round = asyncio.ensure_future(training.driver.land() if landing else training.driver.swarm_step())
        try:
            advanced = await self._round
        except asyncio.CancelledError:
            current = asyncio.current_task()
            cancelling = getattr(current, "cancelling", lambda: 0)()  # Python 3.11+: is the caller cancelled too?
            if not ((self._paused or self._interrupted) and self._round.cancelled()) or cancelling:
                raise
            return  # paused or interrupted mid-round: the epoch stays as it was, nothing was applied
        finally:
            self._round = None
        if advanced:  # the swarm's new start: the state joiners take
            training.publish_state()
            if training.checkpointer is not None and training.checkpointer.due():
                training.checkpointer.save()  # on a thread: the step goes on
            _hand_back_freed_memory()  # what the round freed


def _hand_back_freed_memory() -> None:
    """Free heap pages go back to the system on a worker thread (hostmemory.py): the step goes on."""
    asyncio.get_running_loop().run_in_executor(None, release_freed_memory)
