"""Differential privacy of releases: clipping bound, noise scale, Opacus-exact accounting, budget stop, settings."""

from __future__ import annotations

import logging

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier
from pydantic import ValidationError

from swarmgrad.averaging.privacy import (
    BudgetExhausted,
    Privacy,
    PrivacyError,
    PrivateReleaser,
    make_per_sample_private,
    total_norm,
)

# Opacus's per-sample hooks fire on outputs when inputs need no grad: expected, harmless
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

SHAPES = [(3, 4), (5,), (2, 3, 2), (1,)]


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def update_with_norm(norm: float, seed: int = 0) -> list[torch.Tensor]:
    generator = seeded(seed)
    tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
    scale = norm / total_norm(tensors)
    return [t * scale for t in tensors]


def opacus_rdp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return accountant.get_epsilon(delta=delta)


# --- clipping -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [0.3, 1.999, 2.0, 2.5, 40.0])
def test_released_update_is_clipped_to_clip_norm_before_noise(norm: float) -> None:
    update = update_with_norm(norm)
    expected = min(norm, 2.0)

    exact = PrivateReleaser(Privacy(clip_norm=2.0, noise_multiplier=0.0))
    released = exact.release(update)
    assert [t.shape for t in released] == [t.shape for t in update]
    assert total_norm(released) == pytest.approx(expected, rel=1e-5)
    assert total_norm(released) <= 2.0
    assert exact.last_clip_norm() == pytest.approx(expected, rel=1e-5)
    # clipping scales all tensors together: the direction of the whole update is kept
    direction = torch.cat([t.flatten() for t in released]) / expected
    original = torch.cat([t.flatten() for t in update]) / norm
    assert torch.allclose(direction, original, atol=1e-6)

    noisy = PrivateReleaser(Privacy(clip_norm=2.0, noise_multiplier=1.0), generator=seeded(1))
    noisy.release(update)
    assert noisy.last_clip_norm() <= 2.0
    assert noisy.last_clip_norm() == pytest.approx(expected, rel=1e-5)


def test_noise_std_and_mean_over_a_million_draws() -> None:
    releaser = PrivateReleaser(Privacy(clip_norm=2.0, noise_multiplier=0.7), generator=seeded(7))
    first, second = releaser.release([torch.zeros(500_000), torch.zeros(1000, 500)])
    noise = torch.cat([first, second.flatten()]).double()
    assert noise.numel() == 1_000_000
    assert noise.std().item() == pytest.approx(1.4, rel=0.03)
    assert abs(noise.mean().item()) < 0.01  # the mean's own std is 1.4e-3
    # independent per element: the two tensors do not share draws
    assert abs(torch.corrcoef(torch.stack([first.double(), second.flatten().double()]))[0, 1].item()) < 0.01


def test_default_generator_ignores_the_global_torch_seed() -> None:
    # a training script's torch.manual_seed must not make the noise predictable to others who know the seed
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0)).release([torch.zeros(64)])[0])
    assert not torch.equal(draws[0], draws[1])


# --- accounting -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("noise_multiplier", "sample_rate", "steps", "delta"),
                         [(1.1, 1.0, 10, 1e-5), (0.8, 0.05, 120, 1e-6), (2.0, 0.3, 37, 1e-5)])
def test_epsilon_equals_opacus_rdp_computation(noise_multiplier: float, sample_rate: float, steps: int,
                                               delta: float) -> None:
    privacy = Privacy(clip_norm=1.0, noise_multiplier=noise_multiplier, sample_rate=sample_rate, delta=delta)
    releaser = PrivateReleaser(privacy, generator=seeded())
    assert releaser.epsilon == 0.0
    for _ in range(steps):
        releaser.release([torch.ones(3)])
    assert releaser.releases == steps

    assert releaser.epsilon == pytest.approx(opacus_rdp_epsilon(noise_multiplier, sample_rate, steps, delta), rel=1e-9)
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=orders)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    assert releaser.epsilon == pytest.approx(float(epsilon), rel=1e-9)
    status = releaser.status()
    assert status == {"epsilon": releaser.epsilon, "delta": delta, "releases": steps,
                      "noise_multiplier": noise_multiplier, "clip_norm": 1.0, "exhausted": False,
                      "noise_shares": 1, "epsilon_local": releaser.epsilon}


def test_prv_accountant_by_name() -> None:
    releaser = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, accountant="prv"))
    expected = PRVAccountant()
    for _ in range(5):
        releaser.release([torch.ones(2)])
        expected.step(noise_multiplier=1.0, sample_rate=0.1)
    assert releaser.epsilon == pytest.approx(expected.get_epsilon(delta=1e-5), rel=1e-9)


def test_target_epsilon_derives_noise_that_spends_the_budget_over_expected_releases() -> None:
    privacy = Privacy(clip_norm=1.0, target_epsilon=2.0, expected_releases=40)
    noise_multiplier = privacy.resolved_noise_multiplier()
    assert noise_multiplier == get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=1.0, steps=40)
    releaser = PrivateReleaser(privacy, generator=seeded())
    for _ in range(40):
        releaser.release([torch.ones(4)])
    assert 2.0 - 0.011 <= releaser.epsilon <= 2.0  # Opacus's search stops within 0.01 of the target
    # max_epsilon defaults to target_epsilon: the budget covers expected_releases and no more
    assert releaser.exhausted
    with pytest.raises(BudgetExhausted):
        releaser.release([torch.ones(4)])
    assert releaser.releases == 40


def test_consistent_noise_and_target_are_accepted() -> None:
    derived = Privacy(clip_norm=1.0, target_epsilon=3.0, expected_releases=20).resolved_noise_multiplier()
    both = Privacy(clip_norm=1.0, noise_multiplier=derived * 1.005, target_epsilon=3.0, expected_releases=20)
    assert both.resolved_noise_multiplier() == derived * 1.005


def test_budget_stop_refuses_the_release_that_would_pass_max_epsilon(caplog: pytest.LogCaptureFixture) -> None:
    limit = 5.0
    allowed = next(t for t in range(1, 1000) if opacus_rdp_epsilon(1.0, 1.0, t + 1, 1e-5) > limit)
    releaser = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0, max_epsilon=limit), generator=seeded())
    update = [torch.ones(3), torch.ones(2, 2)]
    for _ in range(allowed - 1):
        releaser.release(update)
        assert not releaser.exhausted
    releaser.release(update)
    assert releaser.exhausted  # the next one would pass: known before anyone tries
    history = releaser.state_dict()["history"]
    epsilon = releaser.epsilon

    caplog.set_level(logging.WARNING, logger="swarmgrad.averaging.privacy")
    for _ in range(3):
        with pytest.raises(BudgetExhausted, match="max_epsilon"):
            releaser.release(update)
    assert releaser.releases == allowed
    assert releaser.state_dict()["history"] == history  # the refused releases left the accountant unchanged
    assert releaser.epsilon == epsilon <= limit
    assert releaser.status()["exhausted"] is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "privacy budget" in r.getMessage()]
    assert len(warnings) == 1


def test_zero_noise_spends_everything_at_once() -> None:
    releaser = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=0.0, max_epsilon=100.0))
    with pytest.raises(BudgetExhausted):
        releaser.release([torch.ones(2)])
    assert releaser.releases == 0 and releaser.epsilon == 0.0


def test_state_dict_carries_the_budget_across_a_restart() -> None:
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.2, sample_rate=0.2)
    first = PrivateReleaser(privacy, generator=seeded())
    for _ in range(6):
        first.release([torch.ones(2)])
    restarted = PrivateReleaser(privacy, generator=seeded())
    restarted.load_state_dict(first.state_dict())
    assert restarted.releases == 6
    assert restarted.epsilon == pytest.approx(first.epsilon, rel=1e-12)
    restarted.release([torch.ones(2)])
    assert restarted.epsilon == pytest.approx(opacus_rdp_epsilon(1.2, 0.2, 7, 1e-5), rel=1e-9)
    with pytest.raises(PrivacyError, match="accountant"):
        PrivateReleaser(privacy.model_copy(update={"accountant": "prv"})).load_state_dict(first.state_dict())


# --- inputs ---------------------------------------------------------------------------------------------------


def test_inputs_are_never_modified_and_outputs_are_new_float32_tensors() -> None:
    update = update_with_norm(10.0) + [torch.arange(6, dtype=torch.float64)]
    before = [t.clone() for t in update]
    released = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=0.5), generator=seeded()).release(update)
    assert all(torch.equal(a, b) for a, b in zip(update, before))
    assert all(t.dtype == torch.float32 for t in released)
    assert all(r.data_ptr() != u.data_ptr() for r, u in zip(released, update))

    within = [torch.full((4,), 0.1)]  # already within clip_norm and float32: still a copy, still noised elsewhere
    out = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=0.0)).release(within)[0]
    out.add_(1.0)
    assert torch.equal(within[0], torch.full((4,), 0.1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_rejected_without_counting(bad: float) -> None:
    releaser = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0))
    with pytest.raises(PrivacyError, match=r"update\[1\]"):
        releaser.release([torch.ones(3), torch.tensor([1.0, bad])])
    assert releaser.releases == 0 and releaser.epsilon == 0.0 and releaser.state_dict()["history"] == []
    with pytest.raises(PrivacyError, match="nothing to release"):
        releaser.release([])


# --- settings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "field"), [
    ({"clip_norm": 1.0, "noise_multiplier": -0.1}, "noise_multiplier"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, "delta"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 0.0}, "delta"),
    ({"clip_norm": 0.0, "noise_multiplier": 1.0}, "clip_norm"),
    ({"clip_norm": float("nan"), "noise_multiplier": 1.0}, "clip_norm"),
    ({"clip_norm": 1.0, "noise_multiplier": 0.1, "target_epsilon": 1.0, "expected_releases": 10}, "target_epsilon"),
    ({"clip_norm": 1.0, "target_epsilon": 1.0}, "expected_releases"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "level": "batch"}, "level"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "accountant": "moments"}, "accountant"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "max_epsilon": 0.0}, "max_epsilon"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.0}, "sample_rate"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "noise": 2.0}, "noise"),
    ({"clip_norm": 1.0}, "noise_multiplier"),
    ({"clip_norm": 1.0, "target_epsilon": 1e-6, "expected_releases": 10**6}, "target_epsilon"),
])
def test_invalid_settings_raise_privacy_error_naming_the_field(settings: dict, field: str) -> None:
    with pytest.raises(PrivacyError, match=field) as caught:
        Privacy.parse(**settings)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValidationError, match=field):  # plain construction: pydantic's error, same cause
        Privacy(**settings)


def test_settings_are_frozen_and_each_layer_refuses_the_other_level() -> None:
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValidationError):
        privacy.clip_norm = 5.0
    assert privacy.budget_limit() is None
    with pytest.raises(PrivacyError, match="level"):
        PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0, level="sample"))
    with pytest.raises(PrivacyError, match="level"):
        make_per_sample_private(torch.nn.Linear(2, 1), privacy, batch_size=4, dataset_size=40)


# --- per-sample DP-SGD ----------------------------------------------------------------------------------------


def per_sample_batch(model: torch.nn.Linear, scales: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = seeded(3)
    inputs = torch.randn(len(scales), model.in_features, generator=generator) * torch.tensor(scales)[:, None]
    return inputs, torch.randn(len(scales), model.out_features, generator=generator) * torch.tensor(scales)[:, None]


def hand_clipped_mean_gradient(model: torch.nn.Linear, inputs: torch.Tensor, targets: torch.Tensor,
                               clip_norm: float, batch_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reference DP-SGD without noise: one backward per sample, clip each, average (test-only loop)."""
    clipped, norms = [], []
    for x, y in zip(inputs, targets):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[None]), y[None]).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        norm = total_norm(grads)
        norms.append(norm)
        clipped.append([g * min(1.0, clip_norm / (norm + 1e-6)) for g in grads])
    mean = [torch.stack(parts).sum(0) / batch_size for parts in zip(*clipped)]
    return mean, torch.tensor(norms)


def test_per_sample_gradients_are_clipped_then_averaged() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    torch.nn.init.zeros_(model.bias)  # so a small input gives a small gradient
    # 7 samples of a batch configured as 10 (a short last batch): still divided by 10, as Opacus does
    inputs, targets = per_sample_batch(model, [0.01, 0.05, 0.2, 1.0, 3.0, 5.0, 10.0])
    expected, norms = hand_clipped_mean_gradient(model, inputs, targets, clip_norm=0.5, batch_size=10)
    assert (norms > 0.5).sum() >= 3 and (norms < 0.25).sum() >= 2  # clipped and untouched samples both present

    private = make_per_sample_private(model, Privacy(clip_norm=0.5, noise_multiplier=0.0, level="sample"),
                                      batch_size=10, dataset_size=100)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    private.clip_and_noise_gradients()
    grads = [p.grad for p in model.parameters()]
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    assert torch.allclose(private.last_sample_norms(), norms.float(), rtol=1e-4)
    assert total_norm(grads) <= 0.5
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())  # no pile-up across batches


def test_per_sample_noise_scale_and_accounting() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 50)
    inputs, targets = per_sample_batch(model, [1.0] * 16)
    clean, _ = hand_clipped_mean_gradient(model, inputs, targets, clip_norm=1.0, batch_size=16)
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.3, level="sample")
    private = make_per_sample_private(model, privacy, batch_size=16, dataset_size=1600, generator=seeded(5))

    epsilons = []
    for _ in range(3):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        private.clip_and_noise_gradients()
        epsilons.append(private.epsilon)
    noise = torch.cat([(p.grad - c).flatten() * 16 for p, c in zip(model.parameters(), clean)])
    assert noise.std().item() == pytest.approx(1.3, rel=0.05)  # nm * clip_norm, before dividing by the batch
    assert epsilons[0] < epsilons[1] < epsilons[2]
    assert private.steps == 3
    assert epsilons[2] == pytest.approx(opacus_rdp_epsilon(1.3, 0.01, 3, 1e-5), rel=1e-9)


def test_per_sample_target_and_budget_stop() -> None:
    model = torch.nn.Linear(3, 1)
    privacy = Privacy(clip_norm=1.0, target_epsilon=3.0, expected_releases=100, level="sample")
    private = make_per_sample_private(model, privacy, batch_size=10, dataset_size=1000)
    # the target is met at the real sample rate batch_size / dataset_size, not at the setting's default 1.0
    assert private.noise_multiplier == get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01,
                                                            steps=100)

    tight = make_per_sample_private(torch.nn.Linear(3, 1), Privacy(clip_norm=1.0, noise_multiplier=0.3,
                                    max_epsilon=1.0, level="sample"), batch_size=10, dataset_size=10)
    model = tight.module
    model.zero_grad()
    model(torch.randn(10, 3)).sum().backward()
    with pytest.raises(BudgetExhausted):
        tight.clip_and_noise_gradients()
    assert all(p.grad is None for p in model.parameters())  # raw gradients cannot reach an optimizer
    assert tight.steps == 0 and tight.exhausted


def test_a_restored_budget_reads_its_epsilon_afresh_and_forgets_a_refusal() -> None:
    from swarmgrad.averaging.privacy import BudgetExhausted, PrivacyBudget

    spent = PrivacyBudget(1.0, 1.0, 1e-5, None)
    spent.commit()
    one = spent.epsilon
    assert one > 0
    restored = PrivacyBudget(1.0, 1.0, 1e-5, None)
    restored.load_state_dict(spent.state_dict())
    assert restored.releases == 1 and restored.epsilon == one  # recomputed, not a stale 0
    fresh = PrivacyBudget(1.0, 1.0, 1e-5, None)
    fresh.load_state_dict(PrivacyBudget(1.0, 1.0, 1e-5, None).state_dict())
    assert fresh.releases == 0 and fresh.epsilon == 0.0
    tight = PrivacyBudget(1.0, 1.0, 1e-5, one / 2)
    with pytest.raises(BudgetExhausted):
        tight.check()
    assert tight.exhausted
    looser = PrivacyBudget(1.0, 1.0, 1e-5, one * 10)
    looser._refused = True
    looser.load_state_dict(tight.state_dict())  # a restart with a larger limit may release again
    assert not looser.exhausted
    looser.check()


def test_a_checkpoint_of_another_accountant_or_malformed_is_refused_by_name() -> None:
    from swarmgrad.averaging.privacy import PrivacyBudget

    budget = PrivacyBudget(1.0, 0.5, 1e-5, None)
    with pytest.raises(PrivacyError, match="^accountant: checkpoint was kept with 'prv', this peer uses 'rdp'$"):
        budget.load_state_dict({"mechanism": "prv", "history": [], "releases": 0})
    with pytest.raises(PrivacyError, match=r"^accountant: malformed privacy state in checkpoint \(KeyError\('releases'\)\)$"):
        budget.load_state_dict({"mechanism": "rdp", "history": []})
    with pytest.raises(PrivacyError, match="^accountant: malformed privacy state in checkpoint"):
        budget.load_state_dict({"mechanism": "rdp", "history": [(1.0, "x", 1)], "releases": 1})
    assert budget.releases == 0 and budget.state_dict()["history"] == []  # nothing changed


def test_the_refusal_says_which_release_and_what_epsilon_and_the_limit_is_inclusive(caplog) -> None:
    from swarmgrad.averaging.privacy import BudgetExhausted, PrivacyBudget

    probe = PrivacyBudget(1.0, 1.0, 1e-5, None)
    probe.commit()
    first = probe.epsilon
    probe.commit()
    second = probe.epsilon
    exact = PrivacyBudget(1.0, 1.0, 1e-5, second)  # a limit exactly at two releases' epsilon
    exact.check()
    exact.commit()
    exact.check()
    exact.commit()
    with pytest.raises(BudgetExhausted) as refused:
        exact.check()
    assert str(refused.value).startswith(f"privacy budget spent: update 3 would raise epsilon from {second:.4g} to ")
    assert str(refused.value).endswith(f"past max_epsilon={second:g} (delta=1e-05); this peer stops releasing")
    steps = PrivacyBudget(1.0, 1.0, 1e-5, first / 2, what="step")
    with pytest.raises(BudgetExhausted, match="^privacy budget spent: step 1 would raise epsilon from 0 to "):
        steps.check()


def test_epsilon_is_right_however_check_and_commit_interleave() -> None:
    """check() computes the next epsilon ahead; commit() reuses it only for the release it was for."""
    from swarmgrad.averaging.privacy import PrivacyBudget

    reference = PrivacyBudget(1.0, 0.5, 1e-5, None)
    epsilons = []
    for _ in range(3):
        reference.commit()
        epsilons.append(reference.epsilon)
    budget = PrivacyBudget(1.0, 0.5, 1e-5, 1e9)
    budget.check()
    budget.commit()
    budget.commit()  # no check() for this one: the cached value is for release 1 only
    assert budget.epsilon == epsilons[1]
    budget.check()
    budget.commit()
    assert budget.epsilon == epsilons[2]


def test_a_prv_budget_restored_from_no_releases_reads_zero() -> None:
    """PRV's epsilon cannot be computed on an empty history: a restored empty budget must not ask."""
    from swarmgrad.averaging.privacy import PrivacyBudget

    budget = PrivacyBudget(1.0, 0.5, 1e-5, None, mechanism="prv")
    budget.load_state_dict(PrivacyBudget(1.0, 0.5, 1e-5, None, mechanism="prv").state_dict())
    assert budget.epsilon == 0.0 and budget.releases == 0


def test_noise_shares_split_the_noise_and_account_both_sides() -> None:
    """Distributed DP: each of 4 releases carries half the noise std, so their sum carries sigma * C; epsilon
    is the average's guarantee (sigma), epsilon_local one release's seen alone (sigma / 2)."""
    shared = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0, noise_shares=4), generator=seeded(3))
    released = shared.release([torch.zeros(1_000_000)])[0]
    assert released.std().item() == pytest.approx(0.5, rel=0.01)
    for _ in range(9):
        shared.release([torch.zeros(10)])
    assert shared.epsilon == pytest.approx(opacus_rdp_epsilon(1.0, 1.0, 10, 1e-5), rel=1e-9)
    assert shared.epsilon_local == pytest.approx(opacus_rdp_epsilon(0.5, 1.0, 10, 1e-5), rel=1e-9)
    assert shared.epsilon_local > 2 * shared.epsilon
    status = shared.status()
    assert (status["noise_shares"], status["epsilon_local"]) == (4, shared.epsilon_local)
    restored = PrivateReleaser(Privacy(clip_norm=1.0, noise_multiplier=1.0, noise_shares=4))
    restored.load_state_dict(shared.state_dict())
    assert restored.epsilon_local == pytest.approx(shared.epsilon_local, rel=1e-9)  # from the history alone


def test_noise_shares_are_for_the_update_level_and_groups_that_hold_them() -> None:
    from swarmgrad.errors import ConfigError
    from swarmgrad.peer.config import RunConfig

    with pytest.raises(PrivacyError, match="noise_shares"):
        Privacy.parse(clip_norm=1.0, noise_multiplier=1.0, noise_shares=0)
    with pytest.raises(PrivacyError, match="level='sample'"):
        Privacy.parse(clip_norm=1.0, noise_multiplier=1.0, noise_shares=4, level="sample")
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.0, noise_shares=4)
    with pytest.raises(ConfigError, match="min_group_size >= 4"):
        RunConfig(privacy=privacy)  # moshpit's default min_group_size is 2
    with pytest.raises(ConfigError, match="gossip"):
        RunConfig(privacy=privacy, strategy={"name": "gossip"})
    assert RunConfig(privacy=privacy, averaging={"kind": "moshpit", "min_group_size": 4}).privacy.noise_shares == 4
