"""A round's deadline from its bytes between real peers (issue 35): two DiLoCo peers on loopback
with a 4 Mbit/s upload cap, whose 2 MB round (each way) needs about 4 s, succeed although the
first-round deadline they are given is 2 s. Under the old rule (a constant before any round
succeeded) every round failed at that constant, and the deadline never grew."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import run_async, train_steps

import swarmgrad as sg

UPLOAD_MBPS = 4.0  # 0.5 MB/s
WIDTH = 700  # 8 -> 700 -> 700 -> 2: 498k parameters, 2 MB of fp32


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # both peers start from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_round_longer_than_the_old_constant_deadline_succeeds():
    # a high assumed rate, so that the upload cap is what bounds the rate the first deadline assumes
    timing = sg.Timing(presence_refresh=0.5, first_round_deadline=2.0, assumed_rate_mbps=1000.0)
    settings = dict(run_id="deadline-bytes", strategy=sg.DiLoCo(inner_steps=4, overlap="off"), compression="none",
                    timing=timing, upload_limit_mbps=UPLOAD_MBPS)

    async def scenario() -> list[sg.PeerStatus]:
        models = [model_and_optimizer() for _ in range(2)]
        async with sg.Peer(*models[0], **settings) as first, \
                sg.Peer(*models[1], initial_peers=first.maddrs, **settings) as second:
            peers = [first, second]
            await asyncio.gather(*(peer.await_peers(2, 20) for peer in peers))
            return await asyncio.gather(*(
                train_steps(peer, model, seed, until=lambda peer=peer: peer.status().rounds_ok >= 1, seconds=40)
                for seed, (peer, (model, _)) in enumerate(zip(peers, models))))

    # each way, fp32: half its contribution out and its half's average back, the reverse in
    nbytes = 4 * sum(p.numel() for p in model_and_optimizer()[0].parameters())
    for status in run_async(scenario()):
        assert status.rounds_ok == 1, status
        report = status.last_report
        assert report is not None and report["allreduce_seconds"] > timing.first_round_deadline, report
        # the rate the round measured (at most the cap) sizes the next deadline: 4x the round's time
        rate_mbps = nbytes * 8 / 1e6 / report["allreduce_seconds"]
        assert status.round_rate_mbps == pytest.approx(rate_mbps) and rate_mbps <= 1.05 * UPLOAD_MBPS, status
        assert status.round_deadline == pytest.approx(4 * report["allreduce_seconds"]), status
