"""Unit tests of the peer layer without a network: strategy (policy) math, run settings and progress
(manifests: test_manifest.py; snapshots and training state: test_peer_state.py; checkpoints:
test_checkpoint.py; the round driver: test_driver.py).

Policies are bound to a model, an optimizer and a fake progress tracker, with no node or averager.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from peer_fakes import FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.averaging.settings import Gossip, Moshpit
from swarmgrad.dht.membership import Progress
from swarmgrad.errors import ConfigError
from swarmgrad.peer import Peer
from swarmgrad.peer import progress as progress_module
from swarmgrad.peer.config import RunConfig, RunConfigMismatch, resolve_against_run, run_config
from swarmgrad.peer.progress import LocalProgress, PeerProgress, SwarmProgress
from swarmgrad.peer.state import StateMismatch, TrainingState
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.gossip import GossipSGD
from swarmgrad.peer.strategies.sync import SyncSGD
from swarmgrad.state.snapshot import StateSnapshot

# ---- DiLoCo ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("outer_lr, mu", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_diloco_outer_step_is_torch_nesterov_sgd_on_the_pseudo_gradient(outer_lr, mu):
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(inner_steps=3, outer_lr=outer_lr, outer_momentum=mu), model, optimizer)
    reference = [p.detach().clone().requires_grad_(True) for p in strategy.params]
    outer = torch.optim.SGD(reference, lr=outer_lr, momentum=mu, nesterov=mu > 0)
    generator = torch.Generator().manual_seed(7)
    for _ in range(4):
        with torch.no_grad():  # local training moves the parameters
            for p in strategy.params:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
        for ref, p in zip(reference, strategy.params):
            ref.grad = (ref.detach() - p.detach()).clone()  # start - now
        outer.step()
        strategy.solo()
        for ref, p, start in zip(reference, strategy.params, strategy.layout.views(strategy.start)):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
            assert torch.equal(start, p.detach())


def test_diloco_outer_step_uses_the_averaged_delta():
    """A swarm step replaces the local delta by the swarm's average before the outer step."""
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(outer_lr=0.7, outer_momentum=0.9), model, optimizer)
    reference = [p.detach().clone().requires_grad_(True) for p in strategy.params]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for round_index in range(3):
        averaged = [torch.randn(p.shape, generator=torch.Generator().manual_seed(round_index)) for p in strategy.params]
        for value, ref in zip(averaged, reference):
            ref.grad = value.clone()
        strategy.apply(torch.cat([value.reshape(-1) for value in averaged]))
        outer.step()
        for ref, p in zip(reference, strategy.params):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
    for momentum, ref in zip(strategy.layout.views(strategy.momentum), reference):
        torch.testing.assert_close(momentum, outer.state[ref]["momentum_buffer"], rtol=0, atol=1e-6)


def test_diloco_after_backward_steps_locally_and_counts():
    model, optimizer = model_and_optimizer(0, lr=0.5)
    tracker = FakeTracker()
    strategy = attach(DiLoCo(inner_steps=3), model, optimizer, tracker)
    due = []
    for step in range(3):
        before = [p.detach().clone() for p in strategy.params]
        grads = set_grads(strategy.params, step)
        due.append(strategy.after_backward(batch_size=8))
        for p, b, g in zip(strategy.params, before, grads):
            torch.testing.assert_close(p.detach(), b - 0.5 * g)
            assert p.grad is None
    assert due == [False, False, True]
    assert tracker.local.samples == 24 and tracker.local.steps == 3


def test_diloco_step_is_due_when_the_swarm_moves_on():
    model, optimizer = model_and_optimizer(0)
    ahead = PeerProgress("other", 1, 0.0, 0.0, 0.0, False)
    strategy = attach(DiLoCo(inner_steps=100), model, optimizer, FakeTracker((ahead,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(4)
    averaging = PeerProgress("other", 0, 0.0, 0.0, 0.0, True)
    strategy = attach(DiLoCo(inner_steps=100), model, optimizer, FakeTracker((averaging,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(4)


def test_diloco_state_tensors():
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(), model, optimizer)
    momentum = {f"momentum/{i}": torch.randn(p.shape) for i, p in enumerate(strategy.params)}
    with torch.no_grad():
        for p in strategy.params:
            p.add_(1.0)
    strategy.load_state_tensors(momentum)
    starts = strategy.layout.views(strategy.start)
    for i, m in enumerate(strategy.layout.views(strategy.momentum)):
        assert torch.equal(m, momentum[f"momentum/{i}"])
        assert torch.equal(starts[i], strategy.params[i].detach())
    assert set(strategy.state_tensors()) == set(strategy.expected_state()) == set(momentum)
    # a state that does not fit is refused by TrainingState.restore before anything is loaded
    state = TrainingState(model, optimizer, strategy)
    for wrong in ({}, {**momentum, "momentum/0": torch.zeros(1)}):
        snapshot = StateSnapshot.capture(1, {**{f"model/{k}": v for k, v in model.state_dict().items()},
                                             **{f"strategy/{k}": v for k, v in wrong.items()}})
        with pytest.raises(StateMismatch):
            state.restore(snapshot)


# ---- SyncSGD ---------------------------------------------------------------------------------------


def test_sync_accumulates_batch_weighted_gradients_without_stepping():
    model, optimizer = model_and_optimizer(0)
    tracker = FakeTracker()
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer, tracker)
    before = [p.detach().clone() for p in strategy.params]
    g1 = set_grads(strategy.params, 1)
    assert not strategy.after_backward(3)
    assert all(p.grad is None for p in strategy.params)
    g2 = set_grads(strategy.params, 2)
    assert strategy.after_backward(5)  # 8 samples reached
    assert not strategy.contribution.any()  # the sums stay where the gradients are until the round
    strategy.prepare()
    for mean, a, b in zip(strategy.layout.views(strategy.contribution), g1, g2):
        torch.testing.assert_close(mean, (3 * a + 5 * b) / 8)
    for p, b in zip(strategy.params, before):
        assert torch.equal(p.detach(), b)  # no optimizer step yet
    assert tracker.local.samples == 8


def test_sync_counts_the_swarms_samples():
    model, optimizer = model_and_optimizer(0)
    other = PeerProgress("other", 0, 100.0, 3.0, 10.0, False)
    strategy = attach(SyncSGD(target_batch_size=64), model, optimizer, FakeTracker((other,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(1)


def accumulate(strategy, batches: list[int]) -> list[torch.Tensor]:
    """Feed batches; returns the expected mean gradient."""
    total = [torch.zeros(p.shape) for p in strategy.params]
    for seed, size in enumerate(batches):
        for t, g in zip(total, set_grads(strategy.params, 10 + seed)):
            t.add_(g, alpha=size)
        strategy.after_backward(size)
    return [t / sum(batches) for t in total]


def test_sync_prepare_divides_once_and_apply_steps_on_the_average():
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.prepare()
    strategy.prepare()  # a retried round prepares again: it must not divide twice
    assert strategy.weight() == 8
    for seen, want in zip(strategy.layout.views(strategy.contribution), mean):
        torch.testing.assert_close(seen, want)
    for p, b in zip(strategy.params, before):
        assert torch.equal(p.detach(), b)  # preparing changes no parameter
    swarm_mean = [2 * m for m in mean]  # what the swarm averaged
    strategy.apply(torch.cat([m.reshape(-1) for m in swarm_mean]))
    for p, b, m in zip(strategy.params, before, swarm_mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
        assert p.grad is None
    assert not strategy.contribution.any()


def test_sync_solo_step_applies_the_mean_gradient():
    """Alone in the run (no swarm step attempted), the epoch ends on this peer's mean gradient."""
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.solo()
    for p, b, m in zip(strategy.params, before, mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
    assert not strategy.contribution.any()


def test_sync_keeps_no_state():
    model, optimizer = model_and_optimizer(0)
    strategy = attach(SyncSGD(), model, optimizer)
    accumulate(strategy, [2])
    assert strategy.state_tensors() == {} == strategy.expected_state()
    strategy.load_state_tensors({})
    strategy.prepare()
    assert not strategy.contribution.any()  # old gradients are dropped
    snapshot = StateSnapshot.capture(1, {**{f"model/{k}": v for k, v in model.state_dict().items()},
                                         "strategy/momentum/0": torch.zeros(1)})
    with pytest.raises(StateMismatch):
        TrainingState(model, optimizer, strategy).restore(snapshot)


# ---- run settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    RunConfig(), RunConfig(strategy=SyncSGD(target_batch_size=128)),
    RunConfig(strategy=DiLoCo(inner_steps=10, outer_lr=0.5, outer_momentum=0.8), compression="none"),
    RunConfig(strategy=GossipSGD(every=7)), RunConfig(strategy=GossipSGD(), averaging=Moshpit(group_size=4)),
    RunConfig(aggregator="trimmed-mean"), RunConfig(strategy=GossipSGD(), aggregator="mean"),
])
def test_run_config_round_trips_through_json(config):
    data = json.loads(config.settings_json())  # as a manifest carries it
    again = run_config(**data)
    assert again == config and again.digest == config.digest


@pytest.mark.parametrize("data", [{"strategy": {"name": "adam"}}, {"strategy": {"name": "sync", "lr": 1.0}},
                                  {"strategy": {"name": "diloco", "steps": 3}}, {"compression": "zip"},
                                  {"strategy": {"name": "sync", "target_batch_size": 0}}, {"colour": "red"},
                                  {"averaging": {"kind": "allreduce"}}, {"averaging": {"kind": "gossip", "group_size": 4}},
                                  {"aggregator": "krum"}, {"strategy": {"name": "gossip"}, "aggregator": "trimmed-mean"}])
def test_run_config_refuses_bad_settings(data):
    with pytest.raises(ConfigError):
        run_config(**data)


@pytest.mark.parametrize("make", [
    lambda: DiLoCo(inner_steps=0), lambda: DiLoCo(outer_lr=0), lambda: DiLoCo(outer_lr=11),
    lambda: DiLoCo(outer_momentum=1.0), lambda: DiLoCo(outer_momentum=-0.1), lambda: SyncSGD(target_batch_size=0),
    lambda: SyncSGD(target_batch_size=10**9 + 1), lambda: GossipSGD(every=0), lambda: GossipSGD(every=2_000_000),
])
def test_strategy_settings_are_validated(make):
    with pytest.raises(ConfigError):
        make()


def test_strategy_and_averaging_combinations():
    for strategy in (DiLoCo(), SyncSGD()):
        with pytest.raises(ConfigError, match="gossip"):
            RunConfig(strategy=strategy, averaging=Gossip())
        assert RunConfig(strategy=strategy).averaging == Moshpit()
    assert RunConfig(strategy=GossipSGD()).averaging == Gossip()
    assert RunConfig(strategy=GossipSGD(), averaging=Moshpit()).averaging == Moshpit()
    model, optimizer = model_and_optimizer(0)
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=DiLoCo(), averaging=Gossip())
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=SyncSGD(), averaging=Gossip())


def test_the_python_peers_defaults_are_the_run_configs():
    model, optimizer = model_and_optimizer(0)
    peer = Peer(model, optimizer, run_id="defaults")
    assert peer.requested == RunConfig() and peer.requested.explicit() == {}
    chosen = Peer(model, optimizer, run_id="defaults", strategy=DiLoCo(inner_steps=7), compression="none")
    assert chosen.requested.explicit() == {"strategy.name": "diloco", "strategy.inner_steps": 7, "compression": "none"}
    with pytest.raises(ConfigError, match="compression"):
        Peer(model, optimizer, run_id="defaults", config=RunConfig(compression="fp16"), compression="none")


def test_joining_takes_unset_settings_from_the_run_and_names_every_conflict():
    run = RunConfig(task="digits", strategy=DiLoCo(inner_steps=100), compression="int8")
    assert resolve_against_run("r", RunConfig(), run) is run
    assert resolve_against_run("r", RunConfig(strategy=DiLoCo(inner_steps=100)), run) is run
    assert resolve_against_run("r", RunConfig(compression="fp16"), None).compression == "fp16"
    with pytest.raises(RunConfigMismatch) as caught:
        resolve_against_run("r", RunConfig(strategy=DiLoCo(inner_steps=50, outer_lr=0.7), compression="none"), run)
    assert caught.value.conflicts == [("compression", "none", "int8"), ("strategy.inner_steps", 50, 100)]
    message = str(caught.value)
    assert "compression: 'none' here, 'int8' in the run" in message and "strategy.inner_steps: 50 here, 100" in message
    with pytest.raises(RunConfigMismatch, match="strategy.name: 'sync' here, 'diloco' in the run"):
        resolve_against_run("r", RunConfig(strategy=SyncSGD()), run)


def test_the_digest_covers_the_settings_not_the_task():
    assert RunConfig(task="digits").digest == RunConfig().digest
    assert RunConfig(compression="none").digest != RunConfig().digest
    assert RunConfig(strategy=DiLoCo(inner_steps=51)).digest != RunConfig().digest
    assert RunConfig(aggregator="mean").digest != RunConfig().digest  # peers that aggregate differently


def test_the_aggregator_defaults_to_centered_clip_and_is_a_peer_keyword():
    assert RunConfig().aggregator == "centered-clip"
    model, optimizer = model_and_optimizer(0)
    peer = Peer(model, optimizer, run_id="robust", aggregator="trimmed-mean")
    assert peer.requested.aggregator == "trimmed-mean" and peer.requested.explicit() == {"aggregator": "trimmed-mean"}
    with pytest.raises(ConfigError, match="it needs a group: gossip has none"):
        Peer(model, optimizer, run_id="robust", strategy=GossipSGD(), aggregator="trimmed-mean")


def test_the_weight_cap_is_four_epochs_of_samples_by_the_run_settings():
    model, optimizer = model_and_optimizer(0)
    assert attach(DiLoCo(inner_steps=10), model, optimizer).weight_cap(32) == 4 * 10 * 32
    assert attach(DiLoCo(inner_steps=10), model, optimizer).weight_cap(None) is None  # no batch size: no cap
    assert attach(SyncSGD(target_batch_size=512), model, optimizer).weight_cap(None) == 4 * 512
    assert attach(GossipSGD(every=3), model, optimizer, averaging=Moshpit()).weight_cap(16) == 4 * 3 * 16


# ---- progress -------------------------------------------------------------------------------------


def test_swarm_progress_aggregates():
    empty = SwarmProgress()
    assert empty.epoch == 0 and empty.mean_steps_in(0) == 0.0 and empty.samples_in(0) == 0
    assert not empty.averaging_in(0) and empty.samples_per_second == 0
    peers = (PeerProgress("a", 2, 10.0, 4.0, 5.0, False), PeerProgress("b", 2, 30.0, 8.0, 7.0, True),
             PeerProgress("c", 1, 99.0, 50.0, 1.0, False))
    swarm = SwarmProgress(peers)
    assert swarm.epoch == 2
    assert [p.peer_id for p in swarm.at(2)] == ["a", "b"] and swarm.at(3) == []
    assert swarm.samples_in(2) == 40.0 and swarm.samples_in(1) == 99.0
    assert swarm.mean_steps_in(2) == 6.0 and swarm.mean_steps_in(1) == 50.0
    assert swarm.averaging_in(2) and not swarm.averaging_in(1)
    assert swarm.samples_per_second == 13.0


def test_local_progress_counts_and_rates():
    local = LocalProgress()
    local.add(8)
    local.add(4)
    assert (local.samples, local.steps, local.total_samples, local.total_steps) == (12, 2, 12, 2)
    local.update_rates()  # less than 0.2 s since the mark: nothing to measure yet
    local._rate_mark = (time.monotonic() - 2.0, 0, 0)
    local.update_rates()
    assert local.samples_per_second == pytest.approx(6.0, rel=0.02)
    assert local.steps_per_second == pytest.approx(1.0, rel=0.02)
    local._rate_mark = (time.monotonic() - 1.0, local.total_samples, local.total_steps)
    for _ in range(4):
        local.add(4)
    local.update_rates()  # 16 samples/s now; smoothed toward it
    assert local.samples_per_second == pytest.approx(6.0 + 0.3 * (16.0 - 6.0), rel=0.02)
    assert local.steps_per_second == pytest.approx(1.0 + 0.3 * (4.0 - 1.0), rel=0.02)


def test_the_pace_a_peer_claims_leaves_out_its_catching_up(monkeypatch):
    """Minutes of taking the state or replaying rounds are not a slow pace: others decide by the step
    rate whether to wait for this peer (stragglers.py). Its samples/s still shows what it did."""
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])

    def train(seconds: int) -> None:
        for _ in range(seconds):  # a step of 4 samples a second, its rates measured every second
            now[0] += 1.0
            local.add(4)
            local.update_rates()

    def catch_up(seconds: int) -> None:
        for _ in range(seconds):  # no steps; the heartbeat measures every second
            now[0] += 1.0
            local.update_rates()

    local = LocalProgress()
    train(5)
    assert local.steps_per_second == pytest.approx(1.0)
    with local.pace_held():
        catch_up(120)
    assert local.steps_per_second == pytest.approx(1.0)  # held: the pace it trains at
    assert local.samples_per_second < 0.01  # shown as it is: nothing trained meanwhile
    train(2)
    assert local.steps_per_second == pytest.approx(1.0)
    catch_up(120)  # not held: the pace it claims decays, and climbs back a heartbeat at a time
    train(2)
    assert local.steps_per_second < 0.6


def progress(**changes):
    fields = dict(epoch=1, samples=10, steps=2, steps_per_second=0.5, settings="abc")
    return Progress(**{**fields, **changes})


@pytest.mark.parametrize("changes", [
    {"epoch": -1}, {"samples": -5}, {"steps": -1}, {"steps_per_second": math.nan}, {"steps_per_second": math.inf},
    {"steps_per_second": -1.0}, {"steps_per_second": 2e6}, {"epoch": "1"}, {"settings": "x" * 65}, {"averaging": "yes"},
])
def test_progress_rejects_bad_values(changes):
    with pytest.raises(ValueError):
        progress(**changes)


def test_progress_accepts_good_values():
    record = progress(averaging=True)
    assert record.epoch == 1 and record.averaging and record.settings == "abc"


# ---- averaging settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: Moshpit(min_group_size=1), lambda: Moshpit(group_size=3, min_group_size=4), lambda: Moshpit(group_size=1025),
    lambda: Moshpit(matchmaking_seconds=0.01), lambda: Moshpit(matchmaking_seconds=601),
    lambda: Moshpit(round_timeout=0.5), lambda: Moshpit(round_timeout=4000), lambda: Gossip(fanout=0),
    lambda: Gossip(fanout=17), lambda: Gossip(push_timeout=0.5), lambda: Gossip(push_timeout=601),
])
def test_averaging_settings_are_validated(make):
    with pytest.raises(ConfigError):
        make()


def test_a_diverged_models_evaluation_is_still_reported():
    """A NaN or Inf loss (a model that diverged) becomes None in eval/done events: JSON has no NaN,
    and the peer must report and leave rather than crash on its last line."""
    from swarmgrad.peer.runner import _finite_metrics, json_lines

    metrics = _finite_metrics({"accuracy": 0.1, "loss": float("nan")})
    assert metrics == {"accuracy": 0.1, "loss": None}
    assert _finite_metrics({"accuracy": 0.9, "loss": float("inf")})["loss"] is None
    assert _finite_metrics({"accuracy": 0.9, "loss": 0.25}) == {"accuracy": 0.9, "loss": 0.25}
    json_lines({"event": "done", "final": metrics})  # allow_nan=False: would raise on a raw NaN
