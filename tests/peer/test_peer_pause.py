"""Pause and resume with real peers (real p2pd daemons, a real DHT, loopback): a peer paused in the
middle of a round leaves it at once, the other keeps stepping without it, and on resume the paused
peer takes the swarm's state because the swarm moved on."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import run_async, tiny_classifier

import swarmgrad as sg
from swarmgrad.state.kept import KEPT_RESULTS

INNER = 4
TIMING = sg.Timing(presence_refresh=0.5)


class Trainer:
    """Steps a peer on random batches until stopped (the loop's other peers run meanwhile)."""

    def __init__(self, peer: sg.Peer, model: torch.nn.Module, seed: int):
        self.peer, self.model = peer, model
        self.generator = torch.Generator().manual_seed(seed)
        self.stopped = False
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self.stopped:
            x = torch.randn(16, 8, generator=self.generator)
            y = torch.randint(0, 2, (16,), generator=self.generator)
            torch.nn.functional.cross_entropy(self.model(x), y).backward()
            await self.peer.astep(batch_size=16)
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.stopped = True
        await self.task


async def until(check, seconds: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > seconds:
            pytest.fail(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_a_paused_peer_leaves_its_round_the_other_keeps_stepping_and_resume_catches_up():
    async def scenario() -> None:
        (model_a, opt_a), (model_b, opt_b) = tiny_classifier(), tiny_classifier()
        settings = {"strategy": sg.DiLoCo(inner_steps=INNER), "timing": TIMING}
        async with sg.Peer(model_a, opt_a, run_id="pause-run", **settings) as a:
            async with sg.Peer(model_b, opt_b, run_id="pause-run", initial_peers=a.maddrs, **settings) as b:
                await asyncio.gather(a.await_peers(2, 20), b.await_peers(2, 20))
                trainers = [Trainer(a, model_a, 0), Trainer(b, model_b, 1)]
                await until(lambda: a.status().rounds_ok >= 1 and b.status().rounds_ok >= 1, 60, "a first round")

                # a stops for a moment, so b's next round waits for it in matchmaking (seconds, and
                # retried): b pauses in the middle of it and must leave at once
                await trainers[0].stop()
                await until(lambda: b._round is not None, 60, "b in a round")
                await asyncio.sleep(0.3)
                assert b._round is not None
                started = time.monotonic()
                await b.apause()
                assert time.monotonic() - started < 1.0  # it left the round at once
                trainers[0] = Trainer(a, model_a, 3)
                assert b.paused and b.status().paused and b._round is None
                epoch_b, steps_b = b.epoch, b.status().step
                epoch_a = a.epoch

                # a keeps stepping: several epochs while b is paused; b trains nothing meanwhile
                seconds = await until(lambda: a.epoch >= epoch_a + 3, 90, "a stepping while b is paused")
                print(f"a took {seconds:.1f} s for 3 epochs while b was paused")
                # not waited for: ~8 s here; waiting out b in each matchmaking window took 30-43 s
                assert seconds < 25, f"a waited for the paused b: {seconds:.1f} s for 3 epochs"
                assert b.epoch == epoch_b and b.status().step == steps_b
                # further than a replay reaches: b's state then comes whole (a round in flight that a,
                # not training, had not landed can leave a an epoch behind b when b paused)
                beyond_replay = epoch_b + KEPT_RESULTS + 1
                await until(lambda: a.epoch >= beyond_replay, 60, "a beyond what b can replay")
                await until(lambda: any(m.peer_id == b.peer_id and m.paused for m in a.runtime.members()), 10,
                            "a sees b paused in its presence record")

                # resume: the swarm moved on, so b's first step takes its state (and drops that batch)
                await trainers[1].stop()
                downloads = b.status().state_downloads
                await b.aresume()
                assert not b.paused
                torch.nn.functional.cross_entropy(model_b(torch.randn(16, 8)), torch.randint(0, 2, (16,))).backward()
                await b.astep(batch_size=16)
                assert b.status().state_downloads == downloads + 1 and b.status().step == steps_b
                assert b.epoch >= beyond_replay
                trainers[1] = Trainer(b, model_b, 2)
                await until(lambda: b.status().step > steps_b, 30, "b training again")
                await until(lambda: not any(m.peer_id == b.peer_id and m.paused for m in a.runtime.members()), 10,
                            "a sees b resumed")
                for trainer in trainers:
                    await trainer.stop()

    run_async(scenario())


def test_a_paused_peer_drops_batches_and_pause_is_idempotent():
    async def scenario() -> None:
        model, optimizer = tiny_classifier()
        async with sg.Peer(model, optimizer, run_id="pause-alone", strategy=sg.DiLoCo(inner_steps=INNER),
                           timing=TIMING) as peer:
            before = [p.detach().clone() for p in model.parameters()]
            await peer.apause()
            await peer.apause()
            for _ in range(3):
                torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
                await peer.astep(batch_size=4)
            assert peer.status().step == 0 and peer.status().samples == 0
            assert all(p.grad is None for p in model.parameters())
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            with pytest.raises(ValueError, match="batch_size"):
                await peer.astep(batch_size=0)
            await peer.aresume()
            await peer.aresume()
            torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
            await peer.astep(batch_size=4)  # alone: nothing to catch up with, the batch trains
            assert peer.status().step == 1 and not peer.status().paused

    run_async(scenario())


def test_the_sync_api_pauses_from_another_thread_and_waits_while_paused():
    model, optimizer = tiny_classifier()
    with sg.Peer(model, optimizer, run_id="pause-sync", timing=TIMING) as peer:
        peer.pause().result(timeout=10)
        assert peer.paused and not peer.wait_while_paused(0.2)
        peer.resume().result(timeout=10)
        assert peer.wait_while_paused(0.2) and not peer.status().paused
