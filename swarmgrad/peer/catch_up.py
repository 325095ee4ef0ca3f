"""How a peer that fell behind the swarm gets back in step (architecture.md, invariant 'joining is cheap').

A peer behind (its round failed while the others' succeeded, it was paused for a moment, or its
state download ended with the swarm rounds further) replays the rounds it missed: it takes each
round's result from the peers that applied it (donors keep their last ``KEPT_RESULTS``,
``StateServer.publish_result``, and, for a joiner whose download of their state they served, every
round since its state's version, within a byte cap: ``ResultHolds``) and applies it to its own state,
as if it had averaged with them, keeping the local steps it made since its last round on top
(``Policy.apply_keeping_progress``, as overlap's land does): they, and their samples as weight, go
into its next round. One round behind, the round driver fetches the result while the peer trains on
into the next round, and applies it once that round's all-reduce is done (missed_round.py).
No donor alone decides what it applies (``CatchUp.agreed_result``): three are asked (those with the
lowest misbehaviour scores here, so that peers seen clipped or cut are not asked while others can
be) for the digest of the result they keep; the members of one group hold the very same one, so
where two name the same digest its bytes come once, from one of them, checked against it. Where no
two agree (groups of a larger swarm), each of the three hands over its result and their median is
applied. On a 10 Mbit/s link three results of the 5M-parameter model took 24 s where one takes 8.
That moves the frames the round travelled in (averaging/result_frames.py: q2's are 0.31 bytes an
element; where the donor has none, a bfloat16 copy), not the whole state (parameters, strategy state
and, for a fresh joiner, optimizer moments), so a peer on a slow link is back in time for the next round
instead of spiralling through downloads that each end with the swarm rounds further on (issue 35:
at 60M parameters over 100 Mbit/s a download took 75 s against rounds of 5-12 s, and a joiner that
could replay two rounds downloaded six times and never averaged). A replay takes at most as many
rounds as a download's bytes are worth (``replay_rounds``). Further behind, or when no donor kept a
round, the peer downloads the state and then replays whatever the swarm finished meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from typing import Any, Callable, Iterator, Protocol

import torch

from swarmgrad.eventloop import timeout
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.peer.backends import RoundOutcome
from swarmgrad.peer.state import TrainingState, not_optimizer
from swarmgrad.peer.strategies.base import Policy
from swarmgrad.state.kept import KEPT_RESULTS
from swarmgrad.state.results import (
    RESULT_DTYPE,
    ResultFrames,
    ResultPieces,
    digest_seconds,
    download_result,
    download_result_digest,
    download_result_in_parts,
)
from swarmgrad.state.server import StateServer
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.state.transfer import download_state
from swarmgrad.timing import Timing

logger = logging.getLogger(__name__)

REPLAY_DONORS = 3  # donors asked at once for a round's result: a median needs three
# how far apart (relative to the larger norm) two donors' results of one round may lie: moshpit
# groups average different members, so honest results differ, but by less than their norm
REPLAY_SPREAD = 1.0
RATE_WEIGHT = 0.5  # of the latest round in the smoothed receive rate a replay's deadline is sized by
COMBINE_ELEMENTS = 1 << 22  # donors' results are compared and combined this many elements at a time


class Progress(Protocol):
    local: Any

    def fresh(self) -> Any: ...

    def ahead_of(self, epoch: int) -> list[str]: ...

    def next_epoch(self, epoch: int, steps: int = 0, samples: int = 0) -> None: ...


def _spans(total: int) -> Iterator[slice]:
    for start in range(0, total, COMBINE_ELEMENTS):
        yield slice(start, min(total, start + COMBINE_ELEMENTS))


def median_of(results: list[torch.Tensor | ResultPieces]) -> tuple[torch.Tensor, list[float]]:
    """Donors' results' coordinate-wise median, and each one's distance from it, a span at a time: one
    float32 tensor of the result's size beside the frames, not a dense copy of each and their stack."""
    median = torch.empty(results[0].numel(), dtype=torch.float32)
    squares = [0.0] * len(results)
    for span in _spans(median.numel()):
        pieces = torch.stack([result[span] for result in results])
        middle = median[span] = pieces.median(dim=0).values
        for index, piece in enumerate(pieces):
            squares[index] += float((piece - middle).square().sum(dtype=torch.float64))
    return median, [math.sqrt(square) for square in squares]


def mean_of_two(first: torch.Tensor | ResultPieces, second: torch.Tensor | ResultPieces
                ) -> tuple[torch.Tensor, float, float]:
    """Two donors' results' mean, how far apart they lie, and the larger one's norm, a span at a time
    (at 201M parameters their dense copies, difference and mean held 28 bytes a parameter)."""
    mean = torch.empty(first.numel(), dtype=torch.float32)
    apart = norm_first = norm_second = 0.0
    for span in _spans(mean.numel()):
        one, other = first[span], second[span]
        apart += float((one - other).square().sum(dtype=torch.float64))
        norm_first += float(one.square().sum(dtype=torch.float64))
        norm_second += float(other.square().sum(dtype=torch.float64))
        torch.add(one, other, out=mean[span]).mul_(0.5)
    return mean, math.sqrt(apart), math.sqrt(max(norm_first, norm_second))


class CatchUp:
    """``await catch_up(donors, min_version)``: bring this peer to the swarm's epoch, by replaying
    the rounds it missed where donors kept them, else by downloading the state (then replaying).
    Raises StateTransferError (changing nothing) when neither works.

    Only a peer whose state came from the swarm (``in_step``: it averaged a round, took the state or
    resumed a checkpoint) replays: a result moves every peer's parameters by the same step, so one
    that started from other weights would stay apart from the swarm for good."""

    def __init__(self, runtime: NetworkRuntime, server: StateServer, policy: Policy, state: TrainingState,
                 tracker: Progress, timing: Timing, publish_state: Callable[[], None],
                 decoder: ResultFrames | None = None):
        self.runtime, self.server, self.policy, self.state, self.tracker = runtime, server, policy, state, tracker
        self.timing, self.publish_state = timing, publish_state
        self.decoder = decoder  # results then come in the frames their round travelled in, where kept
        self.downloads = 0  # whole states taken
        self.replayed = 0  # rounds replayed from their results
        self.in_step = False
        self.running = False  # taking the swarm's state now
        self.receive_rate: float | None = None  # bytes/s this peer's group rounds received at, smoothed

    def observe(self, outcome: RoundOutcome) -> None:
        """Each round's outcome (``Counters.observers``): a peer of a synchronous strategy that averaged
        holds the swarm's state (it may replay rounds it misses), and group rounds measure its downlink."""
        if not outcome.ok or outcome.report is None:
            return
        if self.policy.synchronous:
            self.in_step = True
        if outcome.report.kind == "moshpit":
            self.note_round(outcome.report.bytes_received, outcome.report.allreduce_seconds)

    def note_round(self, bytes_received: int, seconds: float) -> None:
        """A group round's all-reduce received ``bytes_received`` in ``seconds``: what this peer's
        downlink gives now (a slow member only makes it look slower: a longer deadline, still bounded)."""
        if bytes_received > 0 and seconds > 0:
            rate = bytes_received / seconds
            self.receive_rate = rate if self.receive_rate is None else \
                RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.receive_rate

    def replay_seconds(self, donors: int) -> float:
        """How long asking ``donors`` at once for a round's result may take: ``control_timeout``, plus
        their results' bytes (they share this peer's downlink) at the rate its rounds received, or
        before any at the assumed rate (``Timing.assumed_rate``); at most ``round_slack`` x those bytes
        at the assumed rate, as a first round gets. A fixed 5 s failed every replay at 5 Mbit/s: 10 MB
        of bfloat16 takes 16 s."""
        download = self.runtime.limits.download
        assumed = self.timing.assumed_rate(download.rate if download is not None else None)
        rate = max(self.receive_rate or assumed, assumed / self.timing.round_slack)
        nbytes = donors * self.policy.layout.total * torch.empty(0, dtype=RESULT_DTYPE).element_size()
        return self.timing.control_timeout + nbytes / rate

    @property
    def epoch(self) -> int:
        return self.tracker.local.epoch

    async def __call__(self, donors: list[str], min_version: int, rejoin: bool = False) -> None:
        """``rejoin``: this peer is ahead of the swarm on its own; it takes the donors' state as it is.
        ``running`` says so meanwhile (matchmaking then answers probes that this peer cannot come)."""
        self.running = True
        try:
            with self.tracker.local.pace_held():  # it is not training meanwhile: not a slow pace
                await self._catch_up(donors, min_version, rejoin)
        finally:
            self.running = False

    async def _catch_up(self, donors: list[str], min_version: int, rejoin: bool) -> None:
        if rejoin:
            await self.download(donors, min_version)
            return
        if await self.replay(donors) and not self.tracker.ahead_of(self.epoch):
            return
        await self.download(self.tracker.ahead_of(self.epoch) or donors, max(min_version, self.epoch + 1))
        await self.replay(self.tracker.ahead_of(self.epoch))  # the rounds the swarm finished meanwhile

    def result_bytes(self) -> int:
        """About what one round's result takes to replay: the frames it travelled in (where this peer
        decodes them), else bfloat16."""
        if self.decoder is not None and self.decoder.nbytes > 0:
            return self.decoder.nbytes
        return self.policy.layout.total * torch.empty(0, dtype=RESULT_DTYPE).element_size()

    def keeps_optimizer(self) -> bool:
        """Whether a download leaves this peer's inner optimizer state as it is (and so takes none):
        one that steps its own keeps what it has, and one without any starts its own where the
        strategy says so (DiLoCo's ``joiner_moments="fresh"``: Adam's moments are half a state)."""
        return self.policy.local_optimizer and (bool(self.state.optimizer.state)
                                                 or self.policy.fresh_optimizer_on_join)

    def state_bytes(self) -> int:
        """What a download of the state would take (``download``: without the optimizer's moments
        where this peer keeps its own)."""
        keep_optimizer = self.keeps_optimizer()
        return sum(tensor.numel() * tensor.element_size() for name, tensor in self.state.tensors().items()
                   if not keep_optimizer or not_optimizer(name))

    def replay_rounds(self) -> int:
        """The most rounds one replay takes: as many results as a download's bytes (past that, taking
        the state is cheaper, and a replay slower than the swarm's rounds would chase it for ever);
        never fewer than ``KEPT_RESULTS``. A ratio of bytes, so a bigger model does not outgrow it
        (DiLoCo with Adam: a 16-byte-per-parameter state against 1 for int8's frames, 0.31 for q2's)."""
        return max(KEPT_RESULTS, self.state_bytes() // max(1, self.result_bytes()))

    async def replay(self, donors: list[str]) -> int:
        """Apply, one by one, the results of the rounds from this peer's epoch up to the swarm's, as
        long as donors hand them over (they keep their last ``KEPT_RESULTS``, and more for a joiner
        whose download of their state they served: StateServer's holds), and at most
        ``replay_rounds``: further behind, the state is the way. Returns how many it applied."""
        assert self.runtime.transport is not None and self.server is not None
        behind = self.tracker.fresh().epoch - self.epoch
        most = self.replay_rounds()
        if not (self.policy.synchronous and self.in_step and donors and 0 < behind <= most):
            return 0
        applied = 0
        while donors and applied < most:
            epoch = self.epoch
            try:
                result = await self.fetch_missed(donors, epoch)
            except StateTransferError as error:
                logger.info("could not replay round %d: %s", epoch, error)
                break
            local = self.tracker.local
            carried = (local.steps, local.samples)  # the work since its last round, sent in its next one
            if not self.apply_missed(epoch, result):
                carried = (0, 0)
            self.tracker.next_epoch(epoch + 1, *carried)
            applied += 1
            donors = self.tracker.ahead_of(epoch + 1)
        if applied:
            self.publish_state()
            logger.info("replayed %d round(s) the swarm finished without this peer; now at epoch %d", applied,
                        self.epoch)
        return applied

    def replays_beside(self) -> bool:
        """Whether the result of the one round this peer missed may be fetched while it trains on into the
        next one, and applied once that one's all-reduce is done (``RoundDriver``): where it could replay."""
        return self.policy.synchronous and self.in_step and self.runtime.transport is not None \
            and self.server is not None

    async def fetch_missed(self, donors: list[str], epoch: int) -> torch.Tensor | ResultPieces:
        """The result of round ``epoch`` as donors (least suspect first) agree on it; StateTransferError
        when they do not hand it over."""
        asked = self.runtime.admission.misbehaviour.least_suspect_first(self.runtime.reachable_first(donors))
        return await self.agreed_result(asked, epoch)

    def apply_missed(self, epoch: int, result: torch.Tensor | ResultPieces) -> bool:
        """Apply the result of round ``epoch`` that this peer missed, its local progress kept on top (True
        where there was such progress), and keep it for a peer further behind (in the frames it came in,
        where it did). The caller moves the epoch on."""
        kept_progress = self.policy.apply_keeping_progress(result)
        self.server.publish_result(epoch, result, getattr(result, "frames", None))
        self.replayed += 1
        return kept_progress

    async def agreed_result(self, donors: list[str], epoch: int) -> torch.Tensor | ResultPieces:
        """The result of round ``epoch`` as ``REPLAY_DONORS`` of ``donors`` at once hand it over, so
        no single donor decides what this peer applies: of three or more, their coordinate-wise
        median; of two, their mean, only if they lie within ``REPLAY_SPREAD`` x the larger norm of
        each other (honest groups' averages do; a result negated or scaled 10x does not); of one
        (a swarm of two), its own. StateTransferError when none hands it over or two disagree (the
        state download, which a majority of donors must agree on, then decides)."""
        assert self.runtime.transport is not None
        asked = donors[:REPLAY_DONORS]
        if len(asked) >= 2:
            agreed = await self._result_by_digest(asked, epoch)
            if agreed is not None:
                return agreed
        seconds = self.replay_seconds(len(asked))
        outcomes = await asyncio.gather(*(download_result(
            self.runtime.transport, self.server.protocol, [donor], epoch, self.policy.layout.total,
            seconds=seconds, decoder=self.decoder) for donor in asked), return_exceptions=True)
        handed = [(donor, outcome) for donor, outcome in zip(asked, outcomes) if not isinstance(outcome, BaseException)]
        if len(handed) == 1:
            return handed[0][1]  # as it came (in its frames, where it did)
        results = [result for _, result in handed]
        if not results:
            failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
            raise StateTransferError(f"no donor handed over the result of round {epoch} ({failure})")
        # passes over the model's size: in a thread, not on the loop that serves this peer's streams
        if len(results) >= 3:
            median, distances = await asyncio.to_thread(median_of, results)
            spread = REPLAY_SPREAD * float(median.norm())
            for (donor, _), distance in zip(handed, distances):  # out-voted; blamed so that it is asked last next time
                if distance > spread:
                    self.runtime.admission.blame(donor, "digest disagreement", f"round {epoch}'s result")
            return median
        mean, apart, larger = await asyncio.to_thread(mean_of_two, *results)
        if apart > REPLAY_SPREAD * larger:
            raise StateTransferError(f"the two donors' results of round {epoch} disagree")
        return mean

    async def _result_by_digest(self, asked: list[str], epoch: int) -> torch.Tensor | ResultPieces | None:
        """The members of one group hold the very same result, so the donors are first asked only for
        its digest: where two or more name the same one, its bytes are taken once, a share of its frames
        from each of them at once (or, where that fails or it has no frames, whole from one of them), and
        checked against it. None where no two agree (groups of a larger swarm, a liar, donors
        gone): the caller then takes every donor's result and their median."""
        assert self.runtime.transport is not None
        try:
            async with timeout(self.timing.control_timeout + digest_seconds(self.policy.layout.total)):
                named = await asyncio.gather(*(download_result_digest(
                    self.runtime.transport, self.server.protocol, donor, epoch) for donor in asked),
                    return_exceptions=True)
        except asyncio.TimeoutError:
            return None
        counts = Counter(digest for digest in named if isinstance(digest, str))
        if not counts or counts.most_common(1)[0][1] < 2:
            return None
        digest = counts.most_common(1)[0][0]
        holders = [donor for donor, named_digest in zip(asked, named) if named_digest == digest]
        if self.decoder is not None:  # its frames, a share from each holder at once
            try:
                return await download_result_in_parts(
                    self.runtime.transport, self.server.protocol, holders, epoch, self.policy.layout.total,
                    seconds=self.replay_seconds(1), digest=digest, decoder=self.decoder)
            except StateTransferError as error:
                logger.info("round %d's result in parts from %d donors: %s; taking it from one", epoch,
                            len(holders), error)
        try:
            return await download_result(self.runtime.transport, self.server.protocol, holders, epoch,
                                         self.policy.layout.total, seconds=self.replay_seconds(1), digest=digest,
                                         decoder=self.decoder)
        except StateTransferError as error:
            logger.info("no donor handed over the result of round %d that %d of them named: %s", epoch,
                        len(holders), error)
            return None

    async def download(self, donors: list[str], min_version: int) -> None:
        """Take the swarm's state. A peer that steps its own optimizer and has its state keeps it,
        and so downloads about half the bytes (Adam: params + 2 moments); a fresh joiner takes the
        donors' whole state, or all but their optimizer state where its strategy starts its own
        (``keeps_optimizer``)."""
        assert self.runtime.transport is not None
        keep_optimizer = self.keeps_optimizer()
        donors = self.runtime.reachable_first(donors)  # behind a NAT: the donors it can connect to
        # the download writes the outer state in place (no buffer of the state's size beside it:
        # issue 35). A peer this far behind has little to lose in it: a failure resets it from the
        # parameters, and the peer no longer holds the swarm's state (it takes it again, never
        # replays onto a half-written one)
        into = self.state.download_targets()
        try:
            snapshot = await download_state(self.runtime.transport, self.server.protocol, donors,
                                            seconds=self.timing.join_timeout, min_version=min_version,
                                            keep=not_optimizer if keep_optimizer else None, into=into)
            self.state.restore(snapshot, keep_optimizer=keep_optimizer, adopt=True)
        except BaseException:
            if into:
                self.policy.reset_outer_state()
                self.in_step = False
            raise
        self.downloads += 1
        self.in_step = True
        self.tracker.next_epoch(snapshot.version)
        self.publish_state()
        logger.info("took the swarm's state at epoch %d (%d bytes from %d donor(s)%s)", snapshot.version,
                    snapshot.nbytes, len(donors), "; kept its own optimizer state" if keep_optimizer else "")

