"""``sg.Optimizer``: two real peers (p2pd, DHT, loopback) stepped by plain loops on threads, each as
a torch optimizer: schedulers attach, clipping and GradScaler work, state_dict round-trips."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_batch, tiny_classifier

import swarmgrad as sg

INNER = 4


def train(opt: sg.Optimizer, model: torch.nn.Module, seed: int, steps: int, schedule=None) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs, targets = random_batch(generator)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()


@pytest.fixture
def two_optimizers():
    made: list[sg.Optimizer] = []

    def make(**kwargs) -> list[tuple[sg.Optimizer, torch.nn.Module]]:
        pairs = []
        for index in range(2):
            model, inner = tiny_classifier()
            peers = {} if index == 0 else {"initial_peers": made[0].peer.maddrs}
            made.append(sg.Optimizer(inner, model=model, batch_size=16, run_id=kwargs.get("run_id", "sg-opt"),
                                     strategy=sg.DiLoCo(inner_steps=INNER), timing=sg.Timing(presence_refresh=0.5),
                                     **peers))
            pairs.append((made[-1], model))
        for opt, _ in pairs:
            opt.peer.wait_for_peers(2, 30)
        return pairs

    yield make
    for opt in made:
        opt.close()


def test_two_optimizers_average_with_a_scheduler_and_round_trip_their_state(two_optimizers):
    (first, first_model), (second, second_model) = two_optimizers(run_id="sg-opt-rounds")
    assert isinstance(first, torch.optim.Optimizer) and first.param_groups is first.optimizer.param_groups
    schedule = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1 / (1 + step))
    assert first.optimizer.param_groups[0]["initial_lr"] == 0.05  # the scheduler reached the inner optimizer
    threads = [threading.Thread(target=train, args=(first, first_model, 0, 6 * INNER, schedule)),
               threading.Thread(target=train, args=(second, second_model, 1, 6 * INNER))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    statuses = [first.status(), second.status()]
    assert all(status.rounds_ok > 0 and status.step == 6 * INNER for status in statuses), statuses
    assert first.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / (1 + 6 * INNER))  # the inner step's rate

    saved = first.state_dict()
    assert saved["swarm"]["epoch"] == first.epoch > 0 and saved["swarm"]["total_steps"] == 6 * INNER
    assert set(saved) == {"state", "param_groups", "swarm"}
    weights = {key: value.clone() for key, value in first_model.state_dict().items()}
    momentum = {key: value.clone() for key, value in saved["swarm"]["strategy"].items()}
    train(first, first_model, 2, INNER - 1)  # alone, mid-epoch: counters and inner state move on
    assert first.status().step == 7 * INNER - 1
    first_model.load_state_dict(weights)
    first.load_state_dict(saved)
    assert first.status().step == 6 * INNER and first.epoch == saved["swarm"]["epoch"]
    again = first.state_dict()
    assert all(torch.equal(again["swarm"]["strategy"][key], value) for key, value in momentum.items())
    assert all(torch.equal(a, b) for a, b in zip(again["swarm"]["outer"], saved["swarm"]["outer"]))
    assert all(torch.equal(again["state"][index]["momentum_buffer"], saved["state"][index]["momentum_buffer"])
               for index in saved["state"] if saved["state"][index].get("momentum_buffer") is not None)

    broken = {**saved, "swarm": {**saved["swarm"], "strategy": {}}}
    with pytest.raises(ValueError, match="another strategy's state"):
        first.load_state_dict(broken)
    assert first.status().step == 6 * INNER


def test_a_step_the_grad_scaler_skips_is_neither_taken_nor_counted(two_optimizers):
    (first, model), _ = two_optimizers(run_id="sg-opt-scaler")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    inputs, targets = random_batch(torch.Generator().manual_seed(0))
    scaler.scale(torch.nn.functional.cross_entropy(model(inputs), targets)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(first)
    scaler.update()
    first.zero_grad()
    assert first.status().step == 0 and first.status().samples == 0
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert scaler.get_scale() == 2.0**3  # it saw the inf
    scaler.scale(torch.nn.functional.cross_entropy(model(inputs), targets)).backward()
    scaler.step(first)
    scaler.update()
    assert first.status().step == 1 and first.status().samples == 16
    assert not all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
