"""Held-out evaluation off the training thread (swarmgrad/peer/evaluator.py)."""

from __future__ import annotations

import dataclasses
import secrets
import threading

import pytest
import torch

from swarmgrad.peer import runner
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.evaluator import BackgroundEvaluator
from swarmgrad.peer.peer_config import Connection, Evaluation, PeerConfig, Stop
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.tasks import Task, TaskFactory, get_task


class GatedTask:
    """Scores a model by its first weight, once the test opens the gate (a slow evaluation)."""

    def __init__(self):
        self.gate, self.entered, self.threads = threading.Event(), threading.Event(), []

    def evaluate(self, model, max_batches=None):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10)
        return {"accuracy": float(model.weight.detach().flatten()[0]), "loss": 0.0}


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
    assert float(model.weight.detach().flatten()[0]) == 0.75  # the model itself is never touched


def test_an_evaluation_given_a_state_scores_that_state_and_leaves_the_model_alone():
    task, model = GatedTask(), torch.nn.Linear(2, 1)
    task.gate.set()
    with torch.no_grad():
        model.weight.fill_(0.75)
    swarm = {"weight": torch.full((1, 2), 0.5), "bias": torch.zeros(1)}
    with BackgroundEvaluator(task, model) as evaluator:
        for _ in range(2):  # the first evaluation makes the snapshot, the second reuses it
            assert evaluator.offer({"epoch": 3}, swarm)
            assert evaluator.wait(10)
            assert evaluator.poll() == ({"accuracy": 0.5, "loss": 0.0}, {"epoch": 3})
        assert evaluator.offer({"epoch": 4})  # no state: the model as it is
        assert evaluator.wait(10) and evaluator.poll()[0]["accuracy"] == 0.75
    assert float(model.weight.detach().flatten()[0]) == 0.75


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


def test_an_evaluation_offered_while_one_runs_is_skipped_not_queued():
    task, model = GatedTask(), torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(0.25)
    with BackgroundEvaluator(task, model) as evaluator:
        assert evaluator.offer({"epoch": 1})
        assert task.entered.wait(10)
        with torch.no_grad():
            model.weight.fill_(0.5)
        assert not evaluator.offer({"epoch": 2}) and not evaluator.offer({"epoch": 3})
        assert evaluator.skipped == 2
        task.gate.set()
        assert evaluator.wait(10)
        assert evaluator.poll() == ({"accuracy": 0.25, "loss": 0.0}, {"epoch": 1})  # the first snapshot's
        assert evaluator.wait(0) and evaluator.poll() is None  # nothing was kept for later
        assert evaluator.offer({"epoch": 4})  # the next offer evaluates the model as it is then
        assert evaluator.wait(10)
        assert evaluator.poll() == ({"accuracy": 0.5, "loss": 0.0}, {"epoch": 4})
    assert len(task.threads) == 2 and evaluator.skipped == 2


class GatedDigits(Task):
    """The digits task whose background evaluations wait at a gate; the final one (of the live
    model, all batches) does not."""

    def __init__(self):
        digits = get_task("digits")
        super().__init__(**{field.name: getattr(digits, field.name) for field in dataclasses.fields(digits)})
        self.gate, self.calls = threading.Event(), []

    def evaluate(self, model, max_batches=None, batch_size=None):
        self.calls.append((model, max_batches))
        if max_batches is not None:
            assert self.gate.wait(60)
        return super().evaluate(model, max_batches, batch_size)


GATED: GatedDigits | None = None


# the runner loads its task by name ("test_evaluator:GATED_DIGITS"), once the test has made GATED
GATED_DIGITS = TaskFactory("gated-digits", lambda options, data_dir: GATED)


def test_a_stopping_peer_reports_the_running_evaluation_then_evaluates_its_final_state(monkeypatch):
    """A real lone peer (p2pd, DHT) trains while its one evaluation is held: evaluation points pass
    skipped; at max_steps it waits for the held one, reports it with its snapshot's step and epoch,
    then evaluates the final state."""
    global GATED
    GATED = task = GatedDigits()
    stopping, original_wait = threading.Event(), BackgroundEvaluator.wait

    def wait(self, timeout=None):  # only to let the test see that training has stopped
        stopping.set()
        return original_wait(self, timeout)

    monkeypatch.setattr(BackgroundEvaluator, "wait", wait)
    config = RunConfig(task="test_evaluator:GATED_DIGITS", strategy=DiLoCo(inner_steps=5))
    local = PeerConfig(run_id=f"eval-{secrets.token_hex(4)}", connection=Connection(wait=10),
                       evaluation=Evaluation(every=0.01, batches=2), stop=Stop(max_steps=60))
    events: list[dict] = []

    def train_alone() -> None:
        with runner.open_run(config, local.model_copy(update={"create": True})) as run:
            runner.train(run, local, events.append)

    trainer = threading.Thread(target=train_alone)
    trainer.start()
    try:
        assert stopping.wait(120), events[-1:]
        assert not [event for event in events if event["event"] == "eval"]  # held at its gate all along
    finally:
        task.gate.set()
        trainer.join(60)
    assert not trainer.is_alive()
    kinds = [event["event"] for event in events]
    assert kinds.count("eval") == 1 and kinds[-1] == "done", kinds
    held, done = events[kinds.index("eval")], events[-1]
    assert (held["step"], held["epoch"]) == (1, 0), held  # the snapshot's, not the stopping model's
    assert done["reason"] == "max_steps" and done["step"] == 60 and done["epoch"] > 0, done
    assert done["evaluations_skipped"] >= 1, done
    assert done["final"] is not None and done["final"]["accuracy"] > 0, done
    (snapshot, batches), (final_model, final_batches) = task.calls
    assert batches == 2 and final_batches is None and snapshot is not final_model  # the final state itself
