"""What a DiLoCo peer holds on the host for the swarm, beyond its model, gradients and optimizer
(``status().swarm_memory``, DESIGN's memory budget), measured on two real peers after real rounds:
the outer start and momentum, error feedback (bfloat16 for int8), and the last rounds' results
kept in one form each, on disk; no contribution or result buffer between rounds and no copy of the state
served to joiners."""

from __future__ import annotations

import asyncio

import torch
from conftest import run_async

import swarmgrad as sg

INNER = 4


def wide_classifier(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """8 inputs, 2 classes, 5634 parameters (enough that frames are bytes per element, not headers)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


async def train(peer: sg.Peer, model: torch.nn.Module, seed: int, steps: int) -> sg.PeerStatus:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs, targets = torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        await peer.astep(batch_size=16, loss=loss)
        await asyncio.sleep(0.01)
    return peer.status()


async def two_peers(steps: int) -> list[sg.PeerStatus]:
    models = [wide_classifier() for _ in range(2)]
    settings = {"strategy": sg.DiLoCo(inner_steps=INNER, overlap="off"), "compression": "int8",
                "timing": sg.Timing(presence_refresh=0.5)}
    async with sg.Peer(*models[0], run_id="swarm-memory", **settings) as first:
        async with sg.Peer(*models[1], run_id="swarm-memory", initial_peers=first.maddrs, **settings) as second:
            peers = [first, second]
            await asyncio.gather(*(peer.await_peers(2, 20) for peer in peers))
            return await asyncio.gather(*(train(peer, model, seed, steps)
                                          for seed, (peer, (model, _)) in enumerate(zip(peers, models))))


def test_between_rounds_a_diloco_peer_holds_its_outer_state_error_feedback_and_frames():
    params = sum(p.numel() for p in wide_classifier()[0].parameters())
    for status in run_async(two_peers(steps=6 * INNER)):
        held = status.swarm_memory
        assert status.rounds_ok >= 2, status
        assert held["outer_start"] == held["outer_momentum"] == 4 * params, held
        assert held["contribution"] == held["result"] == 0, held  # each round's buffers are freed once it is applied
        assert held["served_state_copies"] == 0, held  # joiners read the outer start and momentum themselves
        assert held["error_feedback"] == 2 * params, held  # the committed residual, bfloat16; nothing staged
        # the last two rounds' results, each as the int8 frames it travelled in (about a byte an
        # element) or, where it had none (a round it stepped alone, or replayed), as bfloat16 (2): never
        # both; on disk (state/kept.py), in memory only while the last one's write is under way
        kept = held["kept_results"] + status.kept_results_on_disk
        assert 0 < kept <= 2 * 2 * params and status.kept_results_on_disk > 0, (held, status.kept_results_on_disk)
        assert held["kept_results"] <= 2 * params, held
        # DESIGN's budget of about 12: 4 + 4 + 2, and a result being written (int8's frames: a byte an
        # element and a float32 scale per 1024)
        assert sum(held.values()) <= 12.05 * params, held
        # status says what crossed the device boundary (here a CPU "device": the same code): whole
        # parameter sets, 8 bytes per parameter per round
        assert status.device_bytes >= 8 * params * status.rounds_ok and status.device_bytes % (4 * params) == 0


def test_a_round_run_in_turn_reads_its_pseudo_gradient_where_it_lives(monkeypatch):
    """During a round run in turn no buffer holds the contribution or the result: the averager reads
    start - parameters a chunk at a time (the parameters do not move meanwhile) and hands the average
    over as the frames it travelled in (4 + 4 bytes per parameter less at the round's peak)."""
    from swarmgrad.averaging import moshpit

    seen = []
    allreduce = moshpit.Averager._allreduce

    async def watched(self, plan, weight, in_place, read=None):
        held = self._buffer.untyped_storage().nbytes()  # the contribution's storage, which it shares
        report, group = await allreduce(self, plan, weight, in_place, read)
        seen.append((read is not None, held, group.result is None))
        return report, group

    monkeypatch.setattr(moshpit.Averager, "_allreduce", watched)
    statuses = run_async(two_peers(steps=4 * INNER))
    assert all(status.rounds_ok >= 2 for status in statuses), statuses
    assert len(seen) >= 4 and set(seen) == {(True, 0, True)}, seen
