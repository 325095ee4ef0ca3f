"""A round in flight where the averager reads contributions where they live (a lossy codec, no
privacy): what it sent is held as bfloat16, not as the float32 contribution (DESIGN's memory budget,
issue 35). The fakes are test_overlap.py's."""

from __future__ import annotations

import asyncio
import ctypes
import os

import torch
from peer_fakes import attach
from test_overlap import AVERAGE, GatedBackend, Harness, _settle

from swarmgrad.averaging.report import RoundReport
from swarmgrad.peer.backends import RoundOutcome
from swarmgrad.peer.strategies.diloco import DiLoCo


class ReadingBackend(GatedBackend):
    """As the averager does where it reads contributions where they live (a lossy codec, no privacy):
    through ``policy.contribution_reader()`` a chunk at a time, else from the contribution."""

    def __init__(self, policy, outcomes: list[bool]):
        super().__init__(policy.contribution, outcomes)
        self.policy = policy
        self.held: list[dict[str, int]] = []

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on=lambda: False) -> RoundOutcome:
        read = self.policy.contribution_reader()
        total = self.policy.layout.total
        self.calls.append(torch.cat([read(offset, min(7, total - offset)) for offset in range(0, total, 7)])
                          if read is not None else self.contribution.clone())
        self.held.append(self.policy.held_bytes())
        await self.release.wait()
        ok = self.outcomes.pop(0)
        return RoundOutcome(ok, torch.full((total,), AVERAGE) if ok else None, RoundReport("moshpit", attempt, ok=ok))


def test_a_flight_read_where_it_lives_holds_what_it_sent_as_bfloat16_and_resends_it_to_the_bit():
    """Where the averager reads contributions chunk by chunk, a flight holds no float32 contribution:
    what it sent is kept as bfloat16 (2 bytes a parameter for the flight, not 4), every attempt reads
    exactly that, and the provisional step, the landing and a withdrawal use the same values."""
    async def scenario(outcomes: list[bool], withdraw: bool):
        h = Harness(outcomes, outer_lr=0.7, outer_momentum=0.9)
        h.policy.read_contributions = True
        h.policy.prepare_round()  # as a round in turn does first: the contribution's buffer is given back
        h.backend = h.driver.backend = ReadingBackend(h.policy, outcomes)
        h.train(2)
        start, at_launch = h.policy.start.clone(), h.flat_params()
        await h.driver.swarm_step()
        await _settle()
        params = h.policy.layout.total
        sent = (start - at_launch).to(torch.bfloat16).float()
        provisional = start - 0.7 * (sent + 0.9 * sent)  # no momentum yet: start - lr (sent + mu (mu m + sent))
        torch.testing.assert_close(h.flat_params(), provisional)
        h.train(1, seed=10)
        meanwhile = h.flat_params() - provisional
        if withdraw:
            h.driver.cancel_flight()
        h.backend.release.set()
        advanced = await h.driver.land()
        return h, params, sent, start, at_launch, meanwhile, advanced

    h, params, sent, start, at_launch, meanwhile, advanced = asyncio.run(scenario([False, True], withdraw=False))
    assert advanced and len(h.backend.calls) == 2
    assert torch.equal(h.backend.calls[0], sent) and torch.equal(h.backend.calls[1], sent)  # resent to the bit
    assert all(held["contribution"] == 0 and held["flight"] == 2 * params for held in h.backend.held)
    assert h.policy.held_bytes()["flight"] == 0  # landed: what it sent is let go
    torch.testing.assert_close(h.policy.momentum, torch.full((params,), AVERAGE))
    new_start = start - 0.7 * (AVERAGE + 0.9 * AVERAGE)
    torch.testing.assert_close(h.policy.start, new_start)
    torch.testing.assert_close(h.flat_params(), new_start + meanwhile)

    h, params, sent, start, at_launch, meanwhile, advanced = asyncio.run(scenario([True], withdraw=True))
    assert not advanced and h.policy.held_bytes()["flight"] == 0
    torch.testing.assert_close(h.policy.start, start)
    torch.testing.assert_close(h.flat_params(), start - sent + meanwhile)  # where it was sent from, as sent


def test_a_round_that_becomes_a_flight_during_its_all_reduce_reads_on_what_it_was_sending():
    """The averager binds the reader when its all-reduce starts; where the driver launches that round
    as a flight meanwhile (its first attempt outlasted the matchmaking window), the parameters take
    the provisional step, and the chunks read after it are what was being sent, not start less the
    moved parameters."""
    h = Harness([], outer_lr=0.7, outer_momentum=0.9)
    h.policy.read_contributions = True
    h.policy.prepare_round()
    h.train(2)
    start, at_launch = h.policy.start.clone(), h.flat_params()
    read = h.policy.contribution_reader()
    assert read is not None
    total = h.policy.layout.total
    half = total // 2
    before = read(0, half)
    h.policy.launch(refill=False)
    assert not torch.equal(h.flat_params(), at_launch)  # the provisional step moved them
    after = read(half, total - half)
    pseudo_gradient = start - at_launch
    assert torch.equal(before, pseudo_gradient[:half])
    assert torch.equal(after, pseudo_gradient[half:].to(torch.bfloat16).float())  # as the flight holds it


def resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the whole pages inside ``tensor``'s storage (``mincore``: exactly its range)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.untyped_storage().data_ptr()
    first, last = -(-start // page) * page, (start + tensor.untyped_storage().nbytes()) // page * page
    pages = max(0, (last - first) // page)
    vector = (ctypes.c_ubyte * max(1, pages))()
    if pages and libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector[:pages]) * page


def test_a_diloco_peer_holds_no_contribution_memory_until_a_round_fills_it():
    """The contribution is made without touching its pages (``prepare`` writes all of it before it is
    read, a round in turn reads none of it): zeroed, they were resident from the start, 12 bytes a
    parameter with start and momentum before the first round, every big_model run's peak."""
    # 64 MiB of float32: past glibc's largest mmap threshold (32 MiB), so its own fresh mapping, never
    # a heap block this process freed before (smaller ones may be: resident already, and small)
    model = torch.nn.Linear(4096, 4096)
    policy = attach(DiLoCo(inner_steps=2), model, torch.optim.SGD(model.parameters(), lr=0.1))
    size = policy.contribution.untyped_storage().nbytes()
    assert size == 4 * policy.layout.total
    assert resident_bytes(policy.contribution) == 0
    whole_pages = size - 2 * os.sysconf("SC_PAGE_SIZE")  # its first and last pages may be shared
    assert resident_bytes(policy.start) >= whole_pages  # the start is written: the parameters' copy
    policy.prepare()  # a round that needs it whole (a lossless codec, privacy): written, then resident
    assert resident_bytes(policy.contribution) >= whole_pages
