"""The device layer on the CPU: the boundary's pieces and byte counts (the same code a GPU runs, with
plain copies), what a swarm round moves across it per strategy, fp16's loss scaler skipping an
overflowed step, micro-batches giving the full batch's gradient, and device and precision choices."""

from __future__ import annotations

import pytest
import torch
from peer_fakes import FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.device.boundary import DeviceBoundary
from swarmgrad.device.microbatch import accumulate_gradients, largest_micro_batch
from swarmgrad.device.placement import Precision, resolve_device, resolve_precision
from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.gossip import GossipSGD
from swarmgrad.peer.strategies.sync import SyncSGD


def test_the_boundary_cuts_tensors_into_pieces_and_counts_each_byte():
    tensors = [torch.arange(10, dtype=torch.float32), torch.arange(7, dtype=torch.float32).reshape(7, 1) + 100]
    boundary = DeviceBoundary(torch.device("cpu"), chunk_bytes=4 * 4)  # 4 elements a piece
    seen: list[tuple[int, list[float]]] = []
    boundary.read(tensors, lambda offset, chunk: seen.append((offset, chunk.tolist())))
    assert [offset for offset, _ in seen] == [0, 4, 8, 10, 14]  # a piece never spans two tensors
    assert [value for _, chunk in seen for value in chunk] == list(range(10)) + [100 + i for i in range(7)]
    assert boundary.crossings.to_host_bytes == 4 * 17 and boundary.crossings.copies == 5

    flat = torch.arange(17, dtype=torch.float32) * -1
    boundary.write(tensors, lambda offset, numel: flat[offset:offset + numel])
    assert torch.equal(torch.cat([t.reshape(-1) for t in tensors]), flat)
    boundary.write(tensors, lambda offset, numel: torch.ones(numel), add=True)
    assert torch.equal(torch.cat([t.reshape(-1) for t in tensors]), flat + 1)
    assert boundary.crossings.to_device_bytes == 2 * 4 * 17 and boundary.crossings.copies == 15


def test_the_boundary_refuses_tensors_on_two_devices():
    with pytest.raises(ValueError, match="one device"):
        DeviceBoundary.of([torch.zeros(1), torch.zeros(1, device="meta")])


def _numel(policy) -> int:
    return sum(p.numel() for p in policy.params)


@pytest.mark.parametrize("strategy", [DiLoCo(inner_steps=2), GossipSGD(every=2), SyncSGD(target_batch_size=2)])
def test_a_round_moves_8_bytes_per_parameter_across_the_device_boundary(strategy):
    """Down once (the pseudo-gradient, parameters or gradient sums) and up once (the new parameters or
    the swarm's gradient); local steps cross nothing, and nothing else crosses per round."""
    model, optimizer = model_and_optimizer(0, kind="adam")
    policy = attach(strategy, model, optimizer, FakeTracker())
    policy.boundary.chunk_numel = 5  # several pieces per parameter: the chunking is what runs
    before = policy.boundary.crossings.total()
    for seed in range(2):
        set_grads(policy.params, seed)
        policy.after_backward(1)
    assert policy.boundary.crossings.total() == before  # local steps never cross
    policy.prepare()
    policy.apply(policy.contribution.clone())
    crossed = policy.boundary.crossings
    assert crossed.total() - before == 8 * _numel(policy)
    assert crossed.to_host_bytes >= 4 * _numel(policy) and crossed.to_device_bytes >= 4 * _numel(policy)


def test_an_overlapped_diloco_round_moves_12_bytes_per_parameter_and_never_reads_them_back():
    """Launch: the pseudo-gradient down, the provisional parameters up; land: the correction up only."""
    model, optimizer = model_and_optimizer(0)
    policy = attach(DiLoCo(inner_steps=2), model, optimizer, FakeTracker())
    set_grads(policy.params, 1)
    policy.after_backward(1)
    down, up = policy.boundary.crossings.to_host_bytes, policy.boundary.crossings.to_device_bytes
    sent = policy.launch().clone()
    set_grads(policy.params, 2)
    policy.after_backward(1)  # progress made while the round travels
    policy.land(sent)
    crossed = policy.boundary.crossings
    assert (crossed.to_host_bytes - down, crossed.to_device_bytes - up) == (4 * _numel(policy), 8 * _numel(policy))


def test_an_overflowed_fp16_step_is_skipped_not_counted_and_not_sent():
    model, optimizer = model_and_optimizer(0)
    policy = attach(DiLoCo(inner_steps=4), model, optimizer, FakeTracker())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    policy.grad_scaler = scaler
    inputs, targets = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 2)

    def backward() -> list[torch.Tensor]:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        unscaled = torch.autograd.grad(loss, policy.params, retain_graph=True)
        scaler.scale(loss).backward()
        return [g.clone() for g in unscaled]

    before = [p.detach().clone() for p in policy.params]
    backward()
    policy.params[0].grad[0, 0] = float("inf")  # an fp16 overflow
    assert not policy.after_backward(8)
    assert all(torch.equal(p.detach(), b) for p, b in zip(policy.params, before))  # not stepped
    assert policy.progress.local.samples == 0 and scaler.get_scale() == 512.0  # not counted; scale lowered
    policy.prepare()
    assert not policy.contribution.any()  # nothing of it is sent

    grads = backward()
    policy.after_backward(8)
    assert policy.progress.local.samples == 8
    for param, origin, grad in zip(policy.params, before, grads):  # SGD lr 0.1 on the unscaled gradient
        torch.testing.assert_close(param.detach(), origin - 0.1 * grad)

    grads = backward()
    scaler.unscale_(optimizer)  # a caller that clips unscales first: the step must not unscale twice
    torch.nn.utils.clip_grad_norm_(policy.params, 1e9)
    policy.after_backward(8)
    assert policy.progress.local.samples == 16

    policy.grad_scaler = None  # without the scaler, the overflow is stepped: the test sees the feature
    policy.params[0].grad = torch.full_like(policy.params[0], float("inf"))
    policy.after_backward(8)
    assert not torch.isfinite(policy.params[0]).all()


def test_micro_batches_give_the_full_batchs_gradient_and_mean_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    inputs, targets = torch.randn(32, 6), torch.randint(0, 3, (32,))
    fp32 = Precision("fp32", "cpu")
    whole = accumulate_gradients(model, torch.nn.functional.cross_entropy, inputs, targets, 32, fp32)
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sliced = accumulate_gradients(model, torch.nn.functional.cross_entropy, inputs, targets, 8, fp32)
    torch.testing.assert_close(sliced, whole)
    for param, want in zip(model.parameters(), full):
        torch.testing.assert_close(param.grad, want)
    model.zero_grad(set_to_none=True)
    uneven = accumulate_gradients(model, torch.nn.functional.cross_entropy, inputs, targets, 10, fp32)  # 10+10+10+2
    torch.testing.assert_close(uneven, whole)


def test_the_largest_micro_batch_that_fits_is_found_by_halving():
    tried: list[int] = []

    def fits_12(size: int) -> None:
        tried.append(size)
        if size > 12:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert largest_micro_batch(64, fits_12, torch.device("cpu")) == 8
    assert tried == [64, 32, 16, 8]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        largest_micro_batch(4, lambda size: fits_12(100), torch.device("cpu"))


def test_device_and_precision_choices_here():
    assert resolve_device("auto") == torch.device("cpu")  # no GPU on this machine
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cannot use a CUDA GPU"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="--device must be"):
        resolve_device("gpu")
    assert resolve_precision("auto", torch.device("cpu")).name == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        resolve_precision("fp16", torch.device("cpu"))
    assert Precision("fp16", "cuda").needs_scaler and not Precision("bf16", "cuda").needs_scaler


@pytest.mark.parametrize("strategy, copied", [(DiLoCo(inner_steps=2), "nothing"), (GossipSGD(every=2), "parameters"),
                                              (SyncSGD(target_batch_size=2), "parameters and moments")])
def test_the_state_published_after_a_round_copies_no_peers_own_optimizer_moments(strategy, copied):
    """After every round a peer publishes the state joiners take: DiLoCo's is read from its outer
    state, and a peer's own Adam moments are read where they are (on a GPU: when a joiner asks); only
    what has no other home is copied (gossip's parameters; sync's moments are the swarm's, kept whole)."""
    from swarmgrad.peer.state import TrainingState

    model, optimizer = model_and_optimizer(0, kind="adam")
    policy = attach(strategy, model, optimizer, FakeTracker())
    for seed in range(2):
        set_grads(policy.params, seed)
        policy.after_backward(1)
    if isinstance(strategy, SyncSGD):
        policy.prepare()
        policy.apply(policy.contribution.clone())  # sync's moments exist once it stepped
    served = TrainingState(model, optimizer, policy).capture(1, {})
    params, steps = 4 * _numel(policy), 4 * len(policy.params)  # Adam's step counters: a float32 each
    want = {"nothing": 0, "parameters": params, "parameters and moments": 3 * params + steps}[copied]
    assert served.held_bytes() == want


def test_a_replayed_diloco_round_keeps_the_local_progress_for_4_bytes_per_parameter():
    """A late peer replays the swarm's round: the new start plus its own steps since the last one,
    by adding the start's step to the parameters (never reading them back)."""
    model, optimizer = model_and_optimizer(0)
    policy = attach(DiLoCo(inner_steps=2, outer_lr=0.7, outer_momentum=0.9), model, optimizer, FakeTracker())
    set_grads(policy.params, 1)
    policy.after_backward(1)
    local_delta = [p.detach() - s for p, s in zip(policy.params, policy.layout.views(policy.start.clone()))]
    average = torch.randn(policy.layout.total, generator=torch.Generator().manual_seed(3)) * 0.01
    expected = policy.start - 0.7 * (average + 0.9 * average)  # momentum was zero: m = avg
    up = policy.boundary.crossings.to_device_bytes
    down = policy.boundary.crossings.to_host_bytes
    assert policy.apply_keeping_progress(average)
    torch.testing.assert_close(policy.start, expected)
    for param, start, delta in zip(policy.params, policy.layout.views(policy.start), local_delta):
        torch.testing.assert_close(param.detach(), start + delta)
    assert policy.boundary.crossings.to_device_bytes - up == 4 * _numel(policy)
    assert policy.boundary.crossings.to_host_bytes == down
