"""Unit tests of the peer layer without a network: strategy math, progress, run manifests and
averaging settings (snapshots, training state and checkpoints: test_peer_state.py).

Strategies are exercised without ``open()`` (which needs a node): the tests set the attributes
``open()`` would set and hand them a minimal fake context with an optimizer and a progress tracker.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pydantic
import pytest
import torch
from conftest import run_async
from peer_fakes import FakeAverager, FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.averaging.state_transfer import StateSnapshot
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer import Peer
from swarmgrad.peer.manifest import RunManifest, check_compatible, manifest_key, read_manifest
from swarmgrad.peer.progress import LocalProgress, PeerProgress, ProgressRecord, SwarmProgress
from swarmgrad.peer.settings import Gossip, Moshpit, averaging_from_dict
from swarmgrad.peer.state import StateMismatch, TrainingState
from swarmgrad.peer.strategies import DiLoCo, GossipSGD, SyncSGD, strategy_from_dict
from swarmgrad.version import __version__

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
        strategy.solo_step()
        for ref, p, start in zip(reference, strategy.params, strategy.start):
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
        for delta, value, ref in zip(strategy.delta, averaged, reference):
            delta.copy_(value)
            ref.grad = value.clone()
        strategy._outer_step()
        outer.step()
        for ref, p in zip(reference, strategy.params):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
    for momentum, ref in zip(strategy.momentum, reference):
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
    for i, m in enumerate(strategy.momentum):
        assert torch.equal(m, momentum[f"momentum/{i}"])
        assert torch.equal(strategy.start[i], strategy.params[i].detach())
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
    for total, a, b in zip(strategy.accumulated, g1, g2):
        torch.testing.assert_close(total, 3 * a + 5 * b)
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


def test_sync_swarm_step_averages_the_mean_gradient_and_steps_once():
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.averager = FakeAverager(strategy.accumulated, ok=False)
    outcome = run_async(strategy.swarm_step(epoch=0, attempt=0))
    assert not outcome.applied
    for p, b in zip(strategy.params, before):
        assert torch.equal(p.detach(), b)  # a failed round changes nothing
    strategy.averager.ok = True
    outcome = run_async(strategy.swarm_step(epoch=0, attempt=1))  # a retry must not divide again
    assert outcome.applied
    for call in strategy.averager.calls:
        assert call["weight"] == 8
        for seen, want in zip(call["values"], mean):
            torch.testing.assert_close(seen, want)
    for p, b, m in zip(strategy.params, before, mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
        assert p.grad is None
    assert all(not t.any() for t in strategy.accumulated)


def test_sync_solo_step_applies_the_mean_gradient():
    """Alone in the run (no swarm step attempted), the epoch ends on this peer's mean gradient."""
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.solo_step()
    for p, b, m in zip(strategy.params, before, mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
    assert all(not t.any() for t in strategy.accumulated)


def test_sync_keeps_no_state():
    model, optimizer = model_and_optimizer(0)
    strategy = attach(SyncSGD(), model, optimizer)
    accumulate(strategy, [2])
    assert strategy.state_tensors() == {} == strategy.expected_state()
    strategy.load_state_tensors({})
    assert all(not t.any() for t in strategy.accumulated)  # old gradients are dropped
    snapshot = StateSnapshot.capture(1, {**{f"model/{k}": v for k, v in model.state_dict().items()},
                                         "strategy/momentum/0": torch.zeros(1)})
    with pytest.raises(StateMismatch):
        TrainingState(model, optimizer, strategy).restore(snapshot)


# ---- strategy settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [SyncSGD(128), DiLoCo(10, 0.5, 0.8), GossipSGD(7), SyncSGD(), DiLoCo(),
                                      GossipSGD()])
def test_strategy_config_round_trip(strategy):
    config = json.loads(json.dumps(strategy.config()))  # as a manifest carries it
    again = strategy_from_dict(config)
    assert type(again) is type(strategy) and again.config() == strategy.config()


@pytest.mark.parametrize("data", [{"name": "adam"}, {}, {"name": "sync", "lr": 1.0}, {"name": "diloco", "steps": 3},
                                  {"name": "sync", "target_batch_size": 0}, {"name": "gossip", "every": 0}])
def test_strategy_from_dict_refuses_bad_settings(data):
    with pytest.raises(ConfigError):
        strategy_from_dict(data)


@pytest.mark.parametrize("make", [
    lambda: DiLoCo(inner_steps=0), lambda: DiLoCo(outer_lr=0), lambda: DiLoCo(outer_lr=11),
    lambda: DiLoCo(outer_momentum=1.0), lambda: DiLoCo(outer_momentum=-0.1), lambda: SyncSGD(0),
    lambda: SyncSGD(10**9 + 1), lambda: GossipSGD(0), lambda: GossipSGD(2_000_000),
])
def test_strategy_settings_are_validated(make):
    with pytest.raises(ConfigError):
        make()


def test_strategy_and_averaging_combinations():
    for strategy in (DiLoCo(), SyncSGD()):
        with pytest.raises(ConfigError, match="gossip"):
            strategy.check(Gossip())
        strategy.check(Moshpit())
    GossipSGD().check(Gossip())
    GossipSGD().check(Moshpit())
    model, optimizer = model_and_optimizer(0)
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=DiLoCo(), averaging=Gossip())
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=SyncSGD(), averaging=Gossip())


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


def progress_record(**changes):
    fields = dict(epoch=1, samples=10, steps=2, samples_per_second=3.0, steps_per_second=0.5, updated_at=time.time())
    return ProgressRecord(**{**fields, **changes})


@pytest.mark.parametrize("changes", [
    {"epoch": -1}, {"samples": -5}, {"steps": -1}, {"samples_per_second": math.nan}, {"steps_per_second": math.nan},
    {"samples_per_second": math.inf}, {"samples_per_second": -1.0}, {"samples_per_second": 2e9},
    {"updated_at": math.nan}, {"epoch": "1"},
])
def test_progress_record_rejects_bad_values(changes):
    with pytest.raises(pydantic.ValidationError):
        progress_record(**changes)


def test_progress_record_accepts_good_values():
    record = progress_record(averaging=True)
    assert record.epoch == 1 and record.averaging and not record.left


# ---- run manifests --------------------------------------------------------------------------------


def manifest(task="digits", settings=None, fingerprint="fp", created_at=100.0, version=__version__) -> RunManifest:
    return RunManifest(task=task, settings=json.dumps(settings or {"strategy": {"name": "diloco"}}, sort_keys=True),
                       version=version, data_fingerprint=fingerprint, created_at=created_at)


def test_manifest_create_options_and_digest():
    settings = {"strategy": DiLoCo(5).config(), "averaging": Moshpit(4).to_dict(), "lr": 0.1}
    created = RunManifest.create("digits", settings, "abc")
    assert created.version == __version__ and created.task == "digits" and created.data_fingerprint == "abc"
    assert created.options == settings
    assert abs(created.created_at - time.time()) < 60
    # the digest covers what is trained and how, not when
    later = RunManifest.create("digits", dict(reversed(list(settings.items()))), "abc")
    assert later.digest == created.digest
    assert RunManifest.create("charlm", settings, "abc").digest != created.digest
    assert RunManifest.create("digits", {**settings, "lr": 0.2}, "abc").digest != created.digest
    assert RunManifest.create("digits", settings, "other").digest != created.digest
    assert RunManifest.create("digits", settings, None).digest != created.digest


@pytest.mark.parametrize("settings", ["not json", "[1, 2]", "3"])
def test_manifest_options_must_be_a_json_object(settings):
    bad = RunManifest(task="t", settings=settings, version=__version__, created_at=1.0)
    with pytest.raises(ConfigError):
        bad.options


def test_check_compatible():
    major, minor, *_ = __version__.split(".")
    check_compatible(manifest(), "digits", "fp")
    check_compatible(manifest(), None, None)
    check_compatible(manifest(fingerprint=None), "digits", "anything")
    check_compatible(manifest(version=f"{major}.{minor}.99"), "digits", "fp")
    with pytest.raises(StartupError, match="swarmgrad"):
        check_compatible(manifest(version=f"{major}.{int(minor) + 1}.0"), "digits", "fp")
    with pytest.raises(StartupError):
        check_compatible(manifest(version=f"{int(major) + 1}.{minor}.0"), "digits", "fp")
    with pytest.raises(StartupError, match="charlm"):
        check_compatible(manifest(), "charlm", "fp")
    with pytest.raises(StartupError, match="data"):
        check_compatible(manifest(), "digits", "other-fp")


class FakeManifestNode:
    def __init__(self, bodies):
        self.bodies, self.keys = bodies, []

    async def get_records(self, key, body_type):
        self.keys.append((key, body_type))
        return {f"peer{i}": SimpleNamespace(body=body) for i, body in enumerate(self.bodies)}


def choose(bodies) -> RunManifest | None:
    node = FakeManifestNode(bodies)
    chosen = run_async(read_manifest(node, "my-run"))
    assert node.keys == [(manifest_key("my-run"), RunManifest)]
    return chosen


def test_read_manifest_takes_the_most_votes_then_the_earliest():
    assert choose([]) is None
    old_minority = manifest(task="old", created_at=1.0)
    majority = [manifest(created_at=50.0), manifest(created_at=20.0), manifest(created_at=30.0)]
    chosen = choose([old_minority, *majority])
    assert chosen.task == "digits" and chosen.created_at == 20.0
    tie = choose([manifest(task="b", created_at=9.0), manifest(task="a", created_at=5.0),
                  manifest(task="b", created_at=12.0), manifest(task="a", created_at=7.0)])
    assert tie.task == "a" and tie.created_at == 5.0


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


@pytest.mark.parametrize("settings", [Moshpit(), Moshpit(4, 3, 0.5, 30.0), Gossip(), Gossip(3, 5.0)])
def test_averaging_round_trip(settings):
    data = json.loads(json.dumps(settings.to_dict()))
    assert data["kind"] == settings.kind
    assert averaging_from_dict(data) == settings


@pytest.mark.parametrize("data", [{"kind": "allreduce"}, {}, {"kind": "gossip", "group_size": 4},
                                  {"kind": "moshpit", "group_size": 1}])
def test_averaging_from_dict_refuses_bad_settings(data):
    with pytest.raises(ConfigError):
        averaging_from_dict(data)


def test_a_diverged_models_evaluation_is_still_reported():
    """A NaN or Inf loss (a model that diverged) becomes None in eval/done events: JSON has no NaN,
    and the peer must report and leave rather than crash on its last line."""
    from swarmgrad.peer.runner import _finite_metrics, json_lines

    metrics = _finite_metrics({"accuracy": 0.1, "loss": float("nan")})
    assert metrics == {"accuracy": 0.1, "loss": None}
    assert _finite_metrics({"accuracy": 0.9, "loss": float("inf")})["loss"] is None
    assert _finite_metrics({"accuracy": 0.9, "loss": 0.25}) == {"accuracy": 0.9, "loss": 0.25}
    json_lines({"event": "done", "final": metrics})  # allow_nan=False: would raise on a raw NaN
