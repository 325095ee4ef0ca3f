"""The Python API end to end: real peers (real p2pd daemons, a real DHT, loopback) embedded with
``async with sg.Peer(...)`` in one event loop, training a small model with real averaging rounds.
What joining a run from Python does with the run's settings, and what a peer says when it can
meet nobody. (Peers made by the CLI: test_peer_cli.py and test_config.py.)"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time

import pytest
import torch
from conftest import run_async, tiny_classifier, train_steps
from peer_processes import Swarm

import swarmgrad as sg
from swarmgrad.peer.manifest import RunManifest
from swarmgrad.tasks import get_task
from swarmgrad.tasks.base import endless_batches

STEPS = 40
INNER = 8


async def swarm(run_id: str, settings: list[dict], steps: int = STEPS) -> list[sg.PeerStatus]:
    """Peers with the given keyword settings join run ``run_id`` through the first, wait for each
    other, then train side by side; returns their statuses."""
    models = [tiny_classifier() for _ in settings]
    first = sg.Peer(*models[0], run_id=run_id, timing=sg.Timing(presence_refresh=0.5),
                    **settings[0])
    async with first:
        others = [sg.Peer(*pair, run_id=run_id, initial_peers=first.maddrs, timing=sg.Timing(presence_refresh=0.5),
                          **kwargs) for pair, kwargs in zip(models[1:], settings[1:])]
        for peer in others:
            await peer.__aenter__()
        try:
            peers = [first, *others]
            await asyncio.gather(*(peer.await_peers(len(peers), 20) for peer in peers))
            return await asyncio.gather(*(train_steps(peer, model, seed, steps) for seed, (peer, (model, _)) in
                                          enumerate(zip(peers, models))))
        finally:
            for peer in others:
                await peer.__aexit__(None, None, None)


def test_python_peers_with_default_settings_average_together():
    inner_steps = sg.DiLoCo().inner_steps
    statuses = run_async(swarm("py-defaults", [{}, {}], steps=3 * inner_steps))
    for status in statuses:
        assert status.rounds_ok > 0, status
        assert status.warning is None and status.settings == statuses[0].settings


def test_python_peers_whose_settings_differ_say_why_they_train_alone():
    """Without a manifest nothing stops two peers with other codecs from joining one run: they never
    share a round key, so each steps alone, and says so in its status."""
    statuses = run_async(swarm("py-mismatch", [{"compression": "none", "strategy": sg.DiLoCo(inner_steps=INNER)},
                                               {"strategy": sg.DiLoCo(inner_steps=INNER)}]))
    for status in statuses:
        assert status.rounds_ok == 0 and status.solo_steps > 0, status
        assert status.warning is not None and "1 peer(s) of run 'py-mismatch' train with other settings" in status.warning
    assert statuses[0].settings != statuses[1].settings


def test_a_python_peer_takes_the_runs_settings_from_its_manifest_and_refuses_conflicting_ones():
    run = sg.RunConfig(task="digits", strategy=sg.DiLoCo(inner_steps=INNER), compression="fp16")
    manifest = RunManifest.create(run, data_fingerprint=None)

    async def scenario() -> tuple[sg.RunConfig, str, list[sg.PeerStatus]]:
        model, optimizer = tiny_classifier()
        async with sg.Peer(model, optimizer, run_id="py-manifest", config=run, manifest=manifest) as first:
            conflicting = sg.Peer(*tiny_classifier(), run_id="py-manifest", initial_peers=first.maddrs,
                                  compression="int8", strategy=sg.DiLoCo(inner_steps=INNER + 1))
            with pytest.raises(sg.RunConfigMismatch) as refused:
                await conflicting.__aenter__()
            assert conflicting.training is None and conflicting.node.p2p is None  # nothing built, its node gone
            joiner = sg.Peer(*tiny_classifier(), run_id="py-manifest", initial_peers=first.maddrs)
            async with joiner:
                taken = joiner.config
        return taken, str(refused.value), []

    taken, message, _ = run_async(scenario())
    assert taken.compression == "fp16" and taken.strategy == sg.DiLoCo(inner_steps=INNER)
    assert "compression: 'int8' here, 'fp16' in the run" in message
    assert f"strategy.inner_steps: {INNER + 1} here, {INNER} in the run" in message


def test_a_python_peer_and_a_cli_peer_with_default_settings_average_together():
    """The first user report of issue 13: `swarmgrad peer digits --create` and a Python peer, both with
    their defaults, in one run. They must share a round key and average (before, they never met)."""
    run = Swarm(f"mix-{secrets.token_hex(4)}")
    try:
        cli = run.peer("--create", "--max-seconds", "120", "--eval-every", "0", "--no-final-eval",
                       "--num-shards", "2", "--shard", "0", "--wait-peers", "2", "--wait", "90", name="cli")
        task = get_task("digits")
        torch.manual_seed(sg.RunConfig().seed)  # the weights the CLI peers start from
        model = task.make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        batches = endless_batches(task.train_data(1, 2, 0), 64, seed=1)
        with sg.Peer(model, optimizer, run_id=run.run_id, initial_peers=[run.bootstrap.maddr]) as peer:
            assert peer.wait_for_peers(2, 90) == 2, run.describe()
            deadline = time.monotonic() + 90
            while peer.status().rounds_ok < 2 and time.monotonic() < deadline:
                inputs, targets = next(batches)
                loss = task.loss_fn(model(inputs), targets)
                loss.backward()
                peer.step(batch_size=len(targets), loss=loss)
            mine = peer.status()
        assert mine.rounds_ok >= 2 and mine.warning is None, mine
        cli.signal(signal.SIGTERM)
        done = cli.done(60)
        assert done["status"]["rounds_ok"] > 0, done["status"]
        assert done["status"]["settings"] == mine.settings
    finally:
        run.close()


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_python_peers_overlap_rounds_with_training_and_serve_the_swarms_model(compression):
    """With overlap on, each round travels while the next inner phase runs. Each peer's published
    state (what joiners download) holds the swarm's model, the start its outer steps reached, while
    its live parameters carry the local progress made since on top. With int8 the averager reads what
    a flight sent from its bfloat16 copy, a chunk at a time (no float32 contribution)."""
    holders: list[sg.Peer] = []
    flights: list[dict[str, int]] = []

    async def scenario() -> list[sg.PeerStatus]:
        models = [tiny_classifier() for _ in range(2)]
        strategy = sg.DiLoCo(inner_steps=INNER, overlap="on")
        timing = sg.Timing(presence_refresh=0.5)
        async with sg.Peer(*models[0], run_id=f"py-overlap-{compression}", strategy=strategy,
                           compression=compression, timing=timing) as first:
            async with sg.Peer(*models[1], run_id=f"py-overlap-{compression}", strategy=strategy,
                               compression=compression, timing=timing, initial_peers=first.maddrs) as second:
                holders.extend([first, second])
                for peer in holders:  # what each flight holds once launched
                    policy, launch = peer.training.policy, peer.training.policy.launch

                    def launched(*args, policy=policy, launch=launch, **kwargs):
                        sent = launch(*args, **kwargs)
                        flights.append(policy.held_bytes())
                        return sent

                    policy.launch = launched
                await asyncio.gather(first.await_peers(2, 20), second.await_peers(2, 20))
                statuses = await asyncio.gather(*(train_steps(peer, model, seed, 6 * INNER)
                                                  for seed, (peer, (model, _)) in enumerate(zip(holders, models))))
                for peer in holders:
                    await peer.training.driver.abandon()  # a round still in flight: withdrawn, start as last landed
                    snapshot = peer.training.server.latest
                    assert snapshot is not None and snapshot.version == peer.epoch
                    served = [snapshot.tensors()[f"model/{key}"] for key in peer.model.state_dict()]
                    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in served]), peer.training.policy.start)
                    live = torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()])
                    assert not torch.equal(live, peer.training.policy.start)  # the progress since the last landing
                    # what held-out evaluations score: the swarm's model, not the live parameters
                    swarm_model = peer.swarm_model()
                    assert list(swarm_model) == list(peer.model.state_dict())
                    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in swarm_model.values()]),
                                               peer.training.policy.start)
                    assert peer.training.catch_up.receive_rate > 0  # its rounds size a replay's deadline
                return statuses

    statuses = run_async(scenario())
    for status in statuses:
        assert status.rounds_overlapped >= 2 and status.rounds_ok >= 2, status
        assert status.epoch >= 3, status
    params = sum(p.numel() for p in tiny_classifier()[0].parameters())
    assert len(flights) >= 4, flights
    for held in flights:  # what a flight holds of what it sent, and in what
        assert (held["contribution"], held["flight"]) == ((0, 2 * params) if compression == "int8" else (4 * params, 0))
