"""A state served from live tensors (state/served.py): the same bytes a copy would hold, no copy of
what the owner keeps put; kept by its readers when the owner moves on (the owner copies), else dropped."""

from __future__ import annotations

import torch

from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.served import ServedState
from swarmgrad.state.snapshot import StateSnapshot


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(300, 700, generator=generator),  # 840 kB: spans a part boundary
            "model/steps": torch.tensor([3], dtype=torch.int64),
            "strategy/momentum/0": torch.randn(513, generator=generator),
            "optimizer/0/exp_avg": torch.randn(300, 700, generator=generator)}


def all_bytes(state) -> torch.Tensor:
    return torch.cat([state.read_part(index) for index in range(state_snapshot.part_count(state.nbytes))])


def served(live_tensors: dict[str, torch.Tensor]) -> ServedState:
    live = frozenset(name for name in live_tensors if name != "model/steps")
    return ServedState(4, live_tensors, {"a": 1}, live=live, keep_live=lambda name: name.startswith("optimizer/"))


def test_parts_hold_the_bytes_a_copy_would_without_copying_the_live_tensors():
    live = tensors()
    state, copy = served(live), StateSnapshot.capture(4, live, {"a": 1})
    assert state.specs == copy.specs and state.nbytes == copy.nbytes and state.digest == copy.digest
    assert state.describe() == copy.describe()
    parts = state_snapshot.part_count(state.nbytes)
    assert parts >= 2
    for index in range(parts):
        assert bytes(state.read_part(index)) == bytes(copy.read_part(index))
    assert torch.equal(all_bytes(state), copy.data)
    assert torch.equal(state.read(1000, 5000), copy.data[1000:6000])
    assert state.held_bytes() == 8  # the int64 it does not read live
    assert state.tensors()["model/w"].data_ptr() == live["model/w"].data_ptr()


def test_a_state_being_read_keeps_its_tensors_and_the_owner_goes_on_with_copies():
    live = tensors()
    state = served(live)
    before = all_bytes(state).clone()
    assert state.retire(readers=1)  # the owner must now leave these tensors alone
    assert state.still_current() and state.frozen
    owner = {name: tensor.clone() for name, tensor in live.items()}  # what the owner steps on from here
    owner["model/w"].add_(1.0)
    owner["strategy/momentum/0"].mul_(2.0)
    assert torch.equal(all_bytes(state), before)
    assert state.tensors()["model/w"].data_ptr() == live["model/w"].data_ptr()  # kept, not copied
    # what it holds for its readers now counts as its own (the owner's copies are the owner's)
    assert state.held_bytes() == 8 + 300 * 700 * 4 + 513 * 4
    assert not state.retire(readers=1)  # nothing of the owner's is live here any more


def test_a_state_nobody_reads_goes_stale_instead_of_being_copied():
    state = served(tensors())
    assert not state.retire(readers=0)
    assert not state.still_current() and state.held_bytes() == 8
