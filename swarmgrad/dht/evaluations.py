"""Held-out evaluations as signed records of a run, so any dashboard of the run shows its accuracy.

An evaluating peer keeps one ``EvaluationRecord`` in its own slot of ``swarmgrad/R/evaluations``:
its last ``keep`` results, oldest first, rewritten with each new result and expiring ``ttl`` seconds
after the newest. A record is its signer's claim (any peer may lie), so readers show each result
attributed to the peer that signed it, and what one peer can put there is bounded: one slot, at
most ``MAX_RESULTS`` results of a strict schema, none dated in the future.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Annotated

import pydantic

from swarmgrad.dht.config import check_run_id
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import MAX_CLOCK_SKEW, RecordBody, record_kind

KEEP = 16  # results a peer republishes: a dashboard that starts late still draws a curve
MAX_RESULTS = 32  # what a reader accepts in one record (room for a later, larger KEEP)
TTL = 900.0  # a peer that stopped evaluating keeps its last results visible for a quarter of an hour


def evaluations_key(run_id: str) -> str:
    return f"swarmgrad/{check_run_id(run_id)}/evaluations"


MAX_LOSS = 1e9  # a record's loss bound: past it, the model diverged and the number means nothing


class Evaluation(pydantic.BaseModel):
    """One held-out result of the model a peer held at ``epoch``."""

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore", strict=True)

    evaluated_at: Annotated[float, pydantic.Field(gt=0, allow_inf_nan=False)]  # unix time of the model evaluated
    epoch: Annotated[int, pydantic.Field(ge=0, le=2**53)]
    step: Annotated[int, pydantic.Field(ge=0, le=2**53)]
    accuracy: Annotated[float, pydantic.Field(ge=0, le=1, allow_inf_nan=False)]
    loss: Annotated[float, pydantic.Field(ge=-MAX_LOSS, le=MAX_LOSS, allow_inf_nan=False)] | None = None
    samples: Annotated[int, pydantic.Field(ge=1, le=2**40)] | None = None  # held-out examples evaluated


@record_kind
class EvaluationRecord(RecordBody):
    kind = "evaluation"
    max_ttl = 3600.0

    task: Annotated[str, pydantic.Field(max_length=64)] = ""
    results: Annotated[list[Evaluation], pydantic.Field(min_length=1, max_length=MAX_RESULTS)]

    @pydantic.model_validator(mode="after")
    def _in_order(self) -> EvaluationRecord:
        times = [result.evaluated_at for result in self.results]
        if times != sorted(times):
            raise ValueError("results must be in the order they were evaluated")
        return self


def evaluation(accuracy: float, loss: float | None, *, epoch: int, step: int, evaluated_at: float | None = None,
               samples: int | None = None) -> Evaluation:
    """An Evaluation from a task's metrics; a diverged model's loss (NaN, infinite, or past
    ``MAX_LOSS``: an attacked swarm's reached 1e10) is left out, so the peer still reports it."""
    if loss is not None and not (math.isfinite(loss) and abs(loss) <= MAX_LOSS):
        loss = None
    return Evaluation(evaluated_at=time.time() if evaluated_at is None else float(evaluated_at), epoch=int(epoch),
                      step=int(step), accuracy=float(accuracy), loss=None if loss is None else float(loss),
                      samples=None if samples is None else int(samples))


class EvaluationLog:
    """This peer's last results, published as its record of the run: ``await log.add(result)``."""

    def __init__(self, node: SwarmNode, run_id: str, task: str = "", *, keep: int = KEEP, ttl: float = TTL):
        if not 1 <= keep <= MAX_RESULTS:
            raise ValueError(f"keep must be within 1..{MAX_RESULTS}, got {keep}")
        self.node, self.key, self.task = node, evaluations_key(run_id), task[:64]
        self.keep, self.ttl = keep, min(ttl, EvaluationRecord.max_ttl)
        self.results: list[Evaluation] = []
        self._lock = asyncio.Lock()  # two results published at once must not interleave their stores

    @property
    def latest(self) -> Evaluation | None:
        return self.results[-1] if self.results else None

    async def add(self, result: Evaluation) -> bool:
        """Keep ``result`` with the last ones and publish them; False if no DHT node took the record."""
        async with self._lock:
            self.results = sorted([*self.results, result], key=lambda kept: kept.evaluated_at)[-self.keep:]
            record = EvaluationRecord(task=self.task, results=list(self.results))
            return await self.node.store(self.key, record, time.time() + self.ttl)


async def read_evaluations(node: SwarmNode, run_id: str, *, now: float | None = None
                           ) -> dict[str, EvaluationRecord]:
    """Each evaluating peer's record (by peer id), results dated in the future (past clock skew) dropped."""
    records = await node.get_records(evaluations_key(run_id), EvaluationRecord)
    return {owner: kept for owner, record in records.items()
            if (kept := credible(record.body, now)) is not None}


def credible(record: EvaluationRecord, now: float | None = None) -> EvaluationRecord | None:
    """``record`` without results from the future (a lying or badly set clock); None if none is left."""
    latest = (time.time() if now is None else now) + MAX_CLOCK_SKEW
    results = [result for result in record.results if result.evaluated_at <= latest]
    if not results:
        return None
    return record if len(results) == len(record.results) else record.model_copy(update={"results": results})
