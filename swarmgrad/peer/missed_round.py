"""A round this peer missed by one, fetched while it trains on into the next and takes part in it.

A peer that finds the swarm one round ahead (its round failed while the others' succeeded, or it came
out of a download or a replay just after the swarm's next round formed) used to replay that round
first, in turn: the training loop waited for the result's bytes, and the peer then reached the next
round after its group had formed. Where a result's bytes take about as long as the swarm's inner
phase, that repeats every round: at 201M parameters in the lab (int8, 100 Mbit/s, H=5) a replay took
25 s against a 13.6 s inner phase, and the joiner never averaged (0 of 27 rounds).

Here the result is fetched in the background (``Replayer.fetch_missed``) while the peer trains on at
the next epoch, so it reaches that round with the others and sends its progress in it (a DiLoCo
pseudo-gradient is the progress since the last outer step, whichever step that was). The fetched
result is applied only once that round's all-reduce is done with the contribution, and before its
average, so every outer step lands in the swarm's order and the peer ends where the others do
(``RoundDriver``). Where the fetch fails the peer is back at the missed epoch, its progress kept, and
catches up the usual way.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)


class Replayer(Protocol):
    """What the driver uses of the peer's catch-up (catch_up.py ``CatchUp``)."""

    publish_state: Callable[[], None]

    def replays_beside(self) -> bool: ...

    async def fetch_missed(self, donors: list[str], epoch: int) -> Any: ...

    def apply_missed(self, epoch: int, result: Any) -> bool: ...


class Progress(Protocol):
    local: Any

    def fresh(self) -> Any: ...

    def next_epoch(self, epoch: int, steps: int = 0, samples: int = 0) -> None: ...


@dataclass
class MissedRound:
    """The result of round ``epoch``, which this peer missed, on its way."""

    epoch: int
    fetch: asyncio.Future

    @classmethod
    def start(cls, replayer: Replayer | None, tracker: Progress, donors: list[str], epoch: int) -> MissedRound | None:
        """Fetch round ``epoch``'s result from ``donors`` and move this peer on to the next epoch, where the
        swarm is (None where the swarm is further ahead, or this peer cannot replay). Its samples stay
        counted toward the next round; its steps count anew, so that it comes to that round with the
        others (policies' ``epoch_due``), not at once."""
        if replayer is None or tracker.fresh().epoch != epoch + 1 or not replayer.replays_beside():
            return None
        fetch = asyncio.ensure_future(replayer.fetch_missed(donors, epoch))
        tracker.next_epoch(epoch + 1, samples=tracker.local.samples)
        logger.info("epoch %d: the swarm finished it without this peer; fetching its result while training on "
                    "into epoch %d's round", epoch, epoch + 1)
        return cls(epoch, fetch)

    async def settle(self, replayer: Replayer, tracker: Progress) -> bool:
        """Apply the fetched result (True), or, where the fetch failed, put this peer back at the missed
        epoch, its progress kept (False). Only once nothing reads the contribution (no round runs)."""
        try:
            result = await self.fetch
        except asyncio.CancelledError:
            raise
        except Exception as error:  # donors gone or disagreeing: the usual catch-up then
            logger.info("could not fetch the result of round %d (%s); back at that epoch", self.epoch, error)
            local = tracker.local
            tracker.next_epoch(self.epoch, steps=local.steps, samples=local.samples)
            return False
        replayer.apply_missed(self.epoch, result)
        replayer.publish_state()
        logger.info("applied round %d's result, fetched while training on", self.epoch)
        return True

    async def drop(self) -> None:
        """Leaving: the fetch stops; nothing of it is applied."""
        self.fetch.cancel()
        await asyncio.wait([self.fetch])
        if not self.fetch.cancelled():
            self.fetch.exception()  # retrieved: no "never retrieved" warning at exit
