"""Held-out evaluation off the training thread (swarmgrad/peer/evaluator.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from swarmgrad.peer.evaluator import BackgroundEvaluator
from swarmgrad.tasks import get_task


class GatedTask:
    """Scores a model by its first weight, once the test opens the gate (a slow evaluation)."""

    def __init__(self):
        self.gate, self.entered, self.threads = threading.Event(), threading.Event(), []

    def evaluate(self, model, max_batches=None):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10)
        return {"accuracy": float(model.weight.flatten()[0]), "loss": 0.0}


def test_an_evaluation_runs_beside_training_on_a_snapshot_of_the_model():
    task, model = GatedTask(), torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(0.25)
    with BackgroundEvaluator(task, model) as evaluator:
        evaluator.start({"step": 7})
        assert task.entered.wait(10) and evaluator.busy
        with torch.no_grad():  # training goes on while the evaluation waits at its gate
            model.weight.fill_(0.75)
        assert evaluator.poll() is None and not evaluator.wait(0.05)
        with pytest.raises(RuntimeError, match="already running"):
            evaluator.start()
        task.gate.set()
        assert evaluator.wait(10)
        done = evaluator.poll()
        assert done == ({"accuracy": 0.25, "loss": 0.0}, {"step": 7})  # the model as it was at start
        assert evaluator.poll() is None and not evaluator.busy  # each result comes back once
        evaluator.start({"step": 8})  # the snapshot is refreshed, not reused stale
        assert evaluator.wait(10)
        assert evaluator.poll()[0]["accuracy"] == 0.75
    assert task.threads == ["swarmgrad-eval_0"] * 2
    assert float(model.weight.flatten()[0]) == 0.75  # the model itself is never touched


def test_a_background_evaluation_scores_like_one_on_the_training_thread():
    task = get_task("digits")
    torch.manual_seed(0)
    model = task.make_model()
    expected = task.evaluate(model, max_batches=3)
    with BackgroundEvaluator(task, model, max_batches=3) as evaluator:
        evaluator.start()
        assert evaluator.wait(30)
        done = evaluator.poll()
    assert done[0] == expected


def test_an_evaluation_that_fails_raises_on_the_training_thread():
    class Broken:
        def evaluate(self, model, max_batches=None):
            raise ValueError("held-out set is gone")

    with BackgroundEvaluator(Broken(), torch.nn.Linear(2, 1)) as evaluator:
        evaluator.start()
        assert evaluator.wait(10)
        with pytest.raises(ValueError, match="held-out set is gone"):
            evaluator.poll()
