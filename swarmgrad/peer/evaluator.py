"""Held-out evaluation off the training thread: a snapshot of the model is scored on a thread of
its own while the peer keeps training.

An evaluation of 10k images on the training thread cost the evaluating peer of a demo five sixths
of its steps (172 against ~1,060 for the others). Here the training thread only copies the
parameters into a second model (one pass over them); torch releases the GIL inside its kernels, so
the scoring runs beside the training steps.

Evaluations never queue: a snapshot offered while one is scored is skipped (and counted), not
kept for later, so a finished evaluation is of a state at most one evaluation old; its result
carries the snapshot's meta (the runner's: time, step, epoch), so readers compare like with like.

    evaluator = BackgroundEvaluator(task, model, max_batches=20)
    evaluator.offer(meta={"epoch": 3})      # snapshot now and score it on the evaluator's thread,
                                            # unless one is still running (then False, skipped += 1)
    done = evaluator.poll()                 # None while it runs, then (metrics, meta) once
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
from typing import Any, Mapping

import torch

from swarmgrad.tasks import Task

logger = logging.getLogger(__name__)


class BackgroundEvaluator:
    """One evaluation at a time, on one thread, of a snapshot taken when it starts."""

    def __init__(self, task: Task, model: torch.nn.Module, max_batches: int | None = None):
        self.task, self.model, self.max_batches = task, model, max_batches
        self._snapshot: torch.nn.Module | None = None  # made on first use, reused: no allocation per evaluation
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmgrad-eval")
        self._running: concurrent.futures.Future[dict[str, float]] | None = None
        self._meta: dict[str, Any] = {}
        self.skipped = 0  # snapshots offered while an evaluation ran

    @property
    def busy(self) -> bool:
        return self._running is not None

    def offer(self, meta: dict[str, Any] | None = None, state: Mapping[str, torch.Tensor] | None = None) -> bool:
        """Start an evaluation of the model as it is now (or of ``state``, a ``state_dict`` for it),
        unless one is running: then skip this one (counted in ``skipped``) and return False."""
        if self._running is not None:
            self.skipped += 1
            logger.debug("evaluation %s skipped: the previous one still runs (%d skipped)", meta or {}, self.skipped)
            return False
        self.start(meta, state)
        return True

    @torch.no_grad()
    def start(self, meta: dict[str, Any] | None = None, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Snapshot the model (on the caller's thread, so the copy is of one consistent state), or
        load ``state`` into the snapshot instead, and score it in the background. ``meta`` comes
        back with the result."""
        if self._running is not None:
            raise RuntimeError("an evaluation is already running")
        if self._snapshot is None:
            self._snapshot = copy.deepcopy(self.model)
        elif state is None:
            self._snapshot.load_state_dict(self.model.state_dict())
        if state is not None:
            self._snapshot.load_state_dict(state)
        self._meta = dict(meta or {})
        self._running = self._pool.submit(self.task.evaluate, self._snapshot, self.max_batches)

    def poll(self) -> tuple[dict[str, float], dict[str, Any]] | None:
        """The finished evaluation's metrics and meta, once; None while none has finished. An
        evaluation that raised raises here, on the training thread."""
        if self._running is None or not self._running.done():
            return None
        running, self._running = self._running, None
        return running.result(), self._meta

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running evaluation (if any) has finished; False if it is still running."""
        if self._running is None:
            return True
        concurrent.futures.wait([self._running], timeout)
        return self._running.done()

    def close(self) -> None:
        """Wait for a running evaluation to end (its result is dropped) and stop the thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._running = None

    def __enter__(self) -> BackgroundEvaluator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
