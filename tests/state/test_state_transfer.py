"""State transfer on real p2pd nodes: a joiner downloads a donor's state in parts spread over donors.

Three nodes on loopback (one joiner, two donors) live for the whole module on a background event
loop; each test serves its snapshots under its own protocol name.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from contextlib import AsyncExitStack, asynccontextmanager
from types import SimpleNamespace

import pytest
import torch
from conftest import joiner_and_donors, packed

from swarmgrad.peer.state import TrainingState
from swarmgrad.peer.strategies.diloco import DiLoCo, DiLoCoPolicy
from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state import transfer as state_transfer
from swarmgrad.state.served import ServedState
from swarmgrad.state.server import StateServer
from swarmgrad.state.snapshot import StateSnapshot, StateTransferError
from swarmgrad.state.transfer import download_state

_protocols = itertools.count()


@pytest.fixture(scope="module")
def swarm():
    with joiner_and_donors("state-transfer-test", 2) as started:
        yield started


def run(swarm, coroutine, seconds: float = 30.0):
    return swarm.loop.run(coroutine, timeout=seconds)


def new_protocol() -> str:
    return f"swarmgrad/test-state-{next(_protocols)}/state"


class CountingServer(StateServer):
    """A StateServer that records which parts it served."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served: list[int] = []
        self.described = 0

    async def _serve(self, channel) -> None:
        send = channel.send

        async def counting_send(header, payload=b""):
            await send(header, payload)
            if header.get("t") == "part":
                self.served.append(header["index"])
            elif header.get("t") == "state":
                self.described += 1

        channel.send = counting_send
        await super()._serve(channel)


class QuitAfterOnePart(CountingServer):
    """Serves one part, then drops the stream (the donor crashed or left mid-download), with the
    joiner's other requests on it unanswered."""

    async def _serve(self, channel) -> None:
        send = channel.send

        async def send_then_quit(header, payload=b""):
            await send(header, payload)
            if header.get("t") == "part":
                self.served.append(header["index"])  # counted here: CountingServer's count never sees it return
                raise ConnectionResetError("the donor left mid-download")  # the transport closes the stream

        channel.send = send_then_quit
        await super()._serve(channel)


class DelayedParts(CountingServer):
    """Sends each part ``delay`` seconds after it is asked for, once it served ``after`` parts: a
    donor on a slow link (0.4 s from the first part)."""

    delay, after = 0.4, 0

    async def _serve(self, channel) -> None:
        send = channel.send

        async def delayed_send(header, payload=b""):
            if header.get("t") == "part" and len(self.served) >= self.after:
                await asyncio.sleep(self.delay)
            await send(header, payload)

        channel.send = delayed_send
        await super()._serve(channel)


class StallAfterOnePart(DelayedParts):
    """Serves one part, then keeps the stream open and never answers a part request again (a hung
    donor); it still describes and sketches its state."""

    delay, after = 3600, 1


class LyingServer(CountingServer):
    """Describes its snapshot with a wrong byte count (``nbytes + lie``)."""

    lie = 8

    async def _serve(self, channel) -> None:
        send = channel.send

        async def lying_send(header, payload=b""):
            if header.get("t") == "state":
                header = {**header, "nbytes": header["nbytes"] + self.lie}
            await send(header, payload)

        channel.send = lying_send
        await super()._serve(channel)


class ShortPartServer(CountingServer):
    """Describes honestly but sends every part one byte short."""

    async def _serve(self, channel) -> None:
        send = channel.send

        async def short_send(header, payload=b""):
            if header.get("t") == "part":
                payload = payload[:-1]
            await send(header, payload)

        channel.send = short_send
        await super()._serve(channel)


class InFlight:
    """Watches the joiner's channels: per donor, the most part requests it had sent and not yet had
    answered at any moment."""

    def __init__(self, transport, monkeypatch):
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        opened = transport.open

        async def open_watched(peer_id, protocol):
            channel = await opened(peer_id, protocol)
            send, recv_header = channel.send, channel.recv_header

            async def counting_send(header, payload=b""):
                await send(header, payload)
                if header.get("t") == "part":
                    self.now[peer_id] += 1
                    self.most[peer_id] = max(self.most[peer_id], self.now[peer_id])

            async def counting_recv_header(*args, **kwargs):
                header, length = await recv_header(*args, **kwargs)
                if header.get("t") == "part":
                    self.now[peer_id] -= 1
                return header, length

            channel.send, channel.recv_header = counting_send, counting_recv_header
            return channel

        monkeypatch.setattr(transport, "open", open_watched)


@asynccontextmanager
async def serving(swarm, protocol: str, snapshots: list[StateSnapshot | None], kinds: list[type] | None = None):
    """Donor i serves snapshots[i] (None: nothing published) with a server of kinds[i]."""
    kinds = kinds or [CountingServer] * len(snapshots)
    async with AsyncExitStack() as stack:
        servers = []
        for transport, snapshot, kind in zip(swarm.transports[1:], snapshots, kinds):
            server = await stack.enter_async_context(kind(transport, protocol))
            if snapshot is not None:
                server.publish(snapshot)
            servers.append(server)
        yield servers


def big_state(version: int = 1, megabytes: float = 10.0, seed: int = 0) -> StateSnapshot:
    generator = torch.Generator().manual_seed(seed)
    floats = int(megabytes * 1024 * 1024 / 4)
    tensors = {
        "steps": torch.tensor([version, 2**40], dtype=torch.int64),
        "model/big": torch.randn(floats, generator=generator),
        "model/matrix": torch.randn(33, 17, generator=generator),
        "model/half": torch.randn(10, generator=generator).half(),
        "mask": torch.tensor([True, False, True]),
    }
    return StateSnapshot.capture(version, tensors, {"epoch": version, "strategy": {"name": "diloco"}})


def assert_same(got: ServedState, want: StateSnapshot | ServedState) -> None:
    assert got.version == want.version and got.specs == want.specs and got.meta == want.meta
    assert got.nbytes == want.nbytes and torch.equal(packed(got), packed(want))


def donor_ids(swarm) -> list[str]:
    return [node.peer_id for node in swarm.donors]


# ---- tests ----------------------------------------------------------------------------------------


def test_download_spreads_parts_over_both_donors(swarm):
    snapshot = big_state(version=4)
    parts = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)
    assert parts >= 3

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            return got, [sorted(server.served) for server in servers]

    got, served = run(swarm, scenario())
    assert_same(got, snapshot)
    assert all(served), f"every donor should serve a share, got {served}"
    assert sorted(served[0] + served[1]) == list(range(parts))  # each part fetched exactly once


def test_a_donor_has_several_part_requests_in_flight(swarm, monkeypatch):
    """One donor, many parts: the joiner keeps PIPELINE_PARTS requests in flight, so the donor sends
    on while they travel (one at a time, a donor served one part per round trip)."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 128 * 1024)
    snapshot = big_state(version=3, megabytes=4.0, seed=2)
    watched = InFlight(swarm.transports[0], monkeypatch)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot]) as (server,):
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)
            return got, server.served

    got, served = run(swarm, scenario())
    assert_same(got, snapshot)
    assert served == list(range(math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)))  # in order, each once
    assert state_transfer.PIPELINE_PARTS >= 4 and watched.most[donor_ids(swarm)[0]] == state_transfer.PIPELINE_PARTS


def test_download_of_some_tensors_fetches_only_their_parts(swarm):
    """``keep``: only the parts holding the kept tensors travel, and the snapshot holds just them."""
    generator = torch.Generator().manual_seed(3)
    tensors = {"model/w": torch.randn(1_500_000, generator=generator),  # 6 MB
               "optimizer/0/exp_avg": torch.randn(3_000_000, generator=generator),  # 12 MB
               "strategy/momentum/0": torch.randn(1_000_000, generator=generator)}  # 4 MB
    snapshot = StateSnapshot.capture(3, tensors, {"epoch": 3})
    keep = lambda name: not name.startswith("optimizer/")  # noqa: E731
    wanted = state_snapshot.parts_holding(snapshot.specs, keep)
    total = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)
    assert len(wanted) < total

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20, keep=keep)
            return got, sorted(itertools.chain.from_iterable(server.served for server in servers))

    got, served = run(swarm, scenario())
    assert served == wanted  # each wanted part once, no other part
    assert got.version == 3 and got.meta == {"epoch": 3}
    assert list(got.tensors()) == ["model/w", "strategy/momentum/0"]
    for name, tensor in got.tensors().items():
        assert torch.equal(tensor, tensors[name]), name


def test_a_download_lands_in_the_callers_tensors_and_checks_parts_shared_with_tensors_it_leaves(swarm):
    """``into``: parts land in the caller's own tensors (no buffer of the state beside them); a
    target of another shape is left alone. A part that also holds a tensor ``keep`` leaves out is
    kept whole, so the verification sketch of it matches the donors' (read as zeros, it would not)."""
    generator = torch.Generator().manual_seed(5)
    tensors = {"model/w": torch.randn(1_500_000, generator=generator),  # ends inside part 5
               "model/other": torch.randn(500_000, generator=generator),  # compared, left out, shares part 5
               "strategy/momentum/0": torch.randn(1_000_000, generator=generator),
               "model/b": torch.randn(7, generator=generator)}
    snapshot = StateSnapshot.capture(4, tensors, {"epoch": 4})
    keep = lambda name: name != "model/other"  # noqa: E731
    into = {"model/w": torch.zeros(1_500_000), "strategy/momentum/0": torch.zeros(1_000_000),
            "model/b": torch.zeros(8)}  # the wrong shape: a tensor of its own is made

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot]):
            return await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20, keep=keep,
                                        into=into)

    got = run(swarm, scenario())
    landed = got.tensors()
    assert list(landed) == ["model/w", "strategy/momentum/0", "model/b"]
    for name in ("model/w", "strategy/momentum/0"):
        assert landed[name].data_ptr() == into[name].data_ptr() and torch.equal(into[name], tensors[name]), name
    assert landed["model/b"].data_ptr() != into["model/b"].data_ptr() and torch.equal(landed["model/b"],
                                                                                    tensors["model/b"])
    assert not into["model/b"].any()


def test_many_small_parts_are_spread_and_complete(swarm, monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 64 * 1024)
    snapshot = big_state(version=2, megabytes=2.0, seed=1)
    parts = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            return got, [server.served for server in servers]

    got, served = run(swarm, scenario())
    assert_same(got, snapshot)
    assert all(served) and sorted(served[0] + served[1]) == list(range(parts))


def test_the_version_a_majority_reached_wins(swarm):
    """Of two donors, the lower version (both reached it): the one further on, still holding it, describes
    and serves it too; once both are further on, the newer one."""
    old, new = big_state(version=3, megabytes=2.5, seed=1), big_state(version=5, megabytes=2.5, seed=2)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [old, old]) as servers:
            servers[1].publish(new)
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            with pytest.raises(StateTransferError, match="version >= 4"):
                await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20, min_version=4)
            served = [list(server.served) for server in servers]
            servers[0].publish(new)
            assert_same(await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20), new)
            return got, served

    got, served = run(swarm, scenario())
    assert_same(got, old)
    assert all(served), served  # the donor further on served its share of the older version


def test_donor_keeps_the_previous_version_for_a_download_in_progress(swarm):
    first, second, third = (big_state(version=v, megabytes=0.1, seed=v) for v in (1, 2, 3))

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [first]) as (server,):
            server.publish(second)
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)
            server.publish(third)  # keeps 2 and 3, drops 1
            assert sorted(server._snapshots) == [2, 3]
            return got

    assert_same(run(swarm, scenario()), second)


class MovesOnMidDownload(CountingServer):
    """Publishes three newer versions right after serving its first part: on a slow link the swarm
    goes on for several epochs while one state travels."""

    newer: list[StateSnapshot] = []

    async def _serve(self, channel) -> None:
        send = channel.send

        async def send_then_move_on(header, payload=b""):
            await send(header, payload)
            if header.get("t") == "part" and self.newer:
                for snapshot in self.newer:
                    self.publish(snapshot)
                self.newer = []

        channel.send = send_then_move_on
        await super()._serve(channel)


def test_a_download_under_way_finishes_though_the_donor_moved_on_past_what_it_keeps(swarm, monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 64 * 1024)
    first = big_state(version=1, megabytes=0.5, seed=1)
    later = [big_state(version=v, megabytes=0.5, seed=v) for v in (2, 3, 4)]

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [first], [MovesOnMidDownload]) as (server,):
            server.newer = later
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)
            held_while_read = sorted(server._snapshots)
            await asyncio.sleep(0.5)  # the channel's end reaches the donor
            return got, held_while_read, sorted(server._snapshots), len(server.served)

    got, held_while_read, held_after, served = run(swarm, scenario())
    assert_same(got, first)  # every part of version 1, though the donor published 2, 3 and 4 meanwhile
    assert served == math.ceil(first.nbytes / state_snapshot.PART_BYTES)
    assert held_while_read in ([1, 3, 4], [3, 4])  # the joiner may have said "done" before we looked
    assert held_after == [3, 4]  # once nobody reads it, version 1 goes


def test_a_download_longer_than_its_budget_finishes_while_parts_keep_landing(swarm, monkeypatch):
    """``seconds`` bounds the time without a part landing, not the whole transfer: 8 parts at 0.4 s
    each take over 3 s against a budget of 2 s (a 40 MB state at 5 Mbit/s took 64 s against 60)."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 64 * 1024)
    snapshot = big_state(version=2, megabytes=0.5, seed=5)
    parts = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)
    assert parts * DelayedParts.delay > 1.5 * 2.0

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot], [DelayedParts]):
            started = asyncio.get_running_loop().time()
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=2.0)
            return got, asyncio.get_running_loop().time() - started

    got, took = run(swarm, scenario())
    assert_same(got, snapshot)
    assert took > 2.0


def test_a_donor_holds_at_most_a_bounded_number_of_versions_for_readers():
    server = StateServer(SimpleNamespace(), "unused")
    for version in range(1, 6):
        server.publish(big_state(version=version, megabytes=0.01, seed=version))
        server._reading(None, version)  # a channel starts reading each version as it comes
    server.publish(big_state(version=6, megabytes=0.01, seed=6))
    server.publish(big_state(version=7, megabytes=0.01, seed=7))
    # the latest two, and of the five read, the newest PINNED_SNAPSHOTS that are not among them
    assert sorted(server._snapshots) == [4, 5, 6, 7] and sorted(server._described) == [4, 5, 6, 7]
    server._reading(5, None)
    assert sorted(server._snapshots) == [4, 6, 7]
    for version in (1, 2, 3, 4):
        server._reading(version, None)
    assert sorted(server._snapshots) == [6, 7] and not server._readers


def download_beside_a_quitter(swarm, snapshot: StateSnapshot) -> tuple[StateSnapshot, list[int], list[int]]:
    """``snapshot`` downloaded from a donor that quits after one part and a healthy one; the parts each served."""

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot], [QuitAfterOnePart, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            return got, *[server.served for server in servers]

    return run(swarm, scenario())


def test_donor_that_quits_mid_download_is_replaced_by_the_other(swarm, monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 256 * 1024)
    snapshot = big_state(version=7, megabytes=4.0, seed=3)
    parts = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)

    got, quitter, healthy = download_beside_a_quitter(swarm, snapshot)
    assert_same(got, snapshot)
    assert len(quitter) == 1
    assert set(quitter) | set(healthy) == set(range(parts))
    assert len(healthy) in (parts - 1, parts)  # the quitter's one part may or may not have arrived


def test_donor_that_closes_after_its_last_part_still_vouches_on_a_new_stream(swarm, monkeypatch):
    """Two parts, one per donor: the quitter closes its stream after its part and is never asked
    for another, so the joiner learns it closed only when it asks for the verification sketch. It
    must ask again on a new stream; a strict majority of the two must vouch."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 256 * 1024)
    snapshot = big_state(version=7, megabytes=0.4, seed=5)
    assert math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES) == 2

    got, quitter, healthy = download_beside_a_quitter(swarm, snapshot)
    assert_same(got, snapshot)
    assert len(quitter) == 1 and len(healthy) == 1


def test_donor_that_hangs_mid_download_does_not_block_the_other(swarm, monkeypatch):
    """A donor that stops answering (stream still open) must not hold the download hostage: the parts
    asked of it and not delivered, several in flight, are fetched from the other."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 256 * 1024)
    snapshot = big_state(version=7, megabytes=4.0, seed=4)
    parts = math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)
    watched = InFlight(swarm.transports[0], monkeypatch)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot], [StallAfterOnePart, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=5)
            return got, [server.served for server in servers]

    got, (hung, healthy) = run(swarm, scenario())
    assert_same(got, snapshot)
    assert len(hung) == 1 and sorted(hung + healthy) == list(range(parts))
    assert watched.most[donor_ids(swarm)[0]] > 1  # it hung with several parts asked of it


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_state_with_nan_is_refused(swarm, bad):
    tensors = {"model/w": torch.randn(1000), "model/b": torch.randn(10)}
    tensors["model/w"][123] = bad
    poisoned = StateSnapshot.capture(9, tensors)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [poisoned]):
            with pytest.raises(StateTransferError, match="model/w"):
                await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)

    run(swarm, scenario())


@pytest.mark.parametrize("lie", [8, -4, 2**50])
def test_donor_lying_about_its_size_is_refused(swarm, lie):
    """A size that does not match the description is refused; one above this peer's limit too, as
    this peer's limit (a lone donor's state is simply too large for it)."""
    snapshot = big_state(version=5, megabytes=0.2)
    liar = type("Liar", (LyingServer,), {"lie": lie})

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot], [liar]) as (server,):
            with pytest.raises(StateTransferError, match="above this peer's limit" if lie == 2**50 else "none of 1"):
                await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)
            assert server.described == 1 and server.served == []
        # next to an honest donor, the liar is skipped and the honest one serves everything
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot], [liar, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            return got, [server.served for server in servers]

    got, (lied, honest) = run(swarm, scenario())
    assert_same(got, snapshot)
    assert lied == [] and honest


def test_donor_sending_short_parts_is_dropped(swarm, monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 128 * 1024)
    snapshot = big_state(version=5, megabytes=1.0, seed=5)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot], [ShortPartServer, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20)
            return got, [server.served for server in servers]

    got, (short, honest) = run(swarm, scenario())
    assert_same(got, snapshot)
    # its first part is refused and it gets no second chance (it may have answered the other
    # requests in flight before the joiner's close reached it: those are never read)
    assert 1 <= len(short) <= state_transfer.PIPELINE_PARTS
    assert len(honest) == math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)


def test_no_donors_or_no_state_is_an_error(swarm):
    async def scenario():
        with pytest.raises(StateTransferError, match="no peer"):
            await download_state(swarm.transports[0], new_protocol(), [], seconds=5)
        protocol = new_protocol()
        async with serving(swarm, protocol, [None, None]):  # serving, but nothing published yet
            with pytest.raises(StateTransferError, match="none of 2"):
                await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=5)
        with pytest.raises(StateTransferError):  # nobody serves this protocol at all
            await download_state(swarm.transports[0], new_protocol(), donor_ids(swarm), seconds=5)

    run(swarm, scenario())


def test_training_state_round_trip_through_a_download(swarm):
    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        strategy = DiLoCoPolicy(DiLoCo(inner_steps=5), model, optimizer, SimpleNamespace())  # no progress needed
        return model, optimizer, strategy, TrainingState(model, optimizer, strategy)

    def train(model, optimizer, steps: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    model, optimizer, strategy, state = build(0)
    train(model, optimizer, 3, seed=1)
    strategy.momentum.normal_()
    strategy.copy_params_into(strategy.start)  # snapshots are taken right after an outer step: start == params
    snapshot = state.capture(6, {"strategy": strategy.settings.model_dump()})

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [snapshot, snapshot]):
            return await download_state(swarm.transports[0], protocol, donor_ids(swarm), seconds=20, min_version=6)

    downloaded = run(swarm, scenario())
    assert_same(downloaded, snapshot)
    other_model, other_optimizer, other_strategy, other_state = build(1)
    other_state.restore(downloaded)

    for (name, a), b in zip(model.named_parameters(), other_model.parameters()):
        assert torch.equal(a, b), name
    mine, theirs = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert set(mine) == set(theirs) == set(range(4))
    for index in mine:
        assert set(mine[index]) == set(theirs[index]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine[index]:
            assert torch.equal(mine[index][key], theirs[index][key]), (index, key)
    assert torch.equal(strategy.momentum, other_strategy.momentum)
    assert torch.equal(strategy.start, other_strategy.start)  # the state's parameters are the new start
    # both continue identically
    train(model, optimizer, 2, seed=9)
    train(other_model, other_optimizer, 2, seed=9)
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)



class StepsOnMidDownload(CountingServer):
    """Serves a state read from live tensors and, right after its first part, takes an outer step:
    retires what it serves (going on with copies where a reader keeps it), changes its tensors in
    place and publishes the next version."""

    live: dict[str, torch.Tensor] = {}

    async def _serve(self, channel) -> None:
        send = channel.send

        async def send_then_step(header, payload=b""):
            await send(header, payload)
            if header.get("t") == "part" and self.latest.version == 1:
                if self.retire():
                    self.live = {name: tensor.clone() for name, tensor in self.live.items()}
                for tensor in self.live.values():
                    tensor.add_(1.0)
                self.publish(ServedState(2, self.live, {"epoch": 2}, live=frozenset(self.live)))

        channel.send = send_then_step
        await super()._serve(channel)


def test_a_download_of_a_live_state_finishes_with_its_values_though_the_donor_stepped_meanwhile(swarm, monkeypatch):
    """A donor serves its state from the tensors it trains with (no copy), and copies them only when
    a download under way still reads them as its next outer step comes: the joiner gets every byte of
    the version it described, and once nobody reads it the old tensors are gone."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 64 * 1024)
    generator = torch.Generator().manual_seed(3)
    live = {"model/w": torch.randn(100_000, generator=generator), "strategy/m": torch.randn(5_000, generator=generator)}
    expected = StateSnapshot.capture(1, live, {"epoch": 1})

    async def scenario():
        protocol = new_protocol()
        first = ServedState(1, live, {"epoch": 1}, live=frozenset(live))
        async with serving(swarm, protocol, [first], [StepsOnMidDownload]) as (server,):
            server.live = live
            assert server.held_bytes()["served_state_copies"] == 0
            got = await download_state(swarm.transports[0], protocol, donor_ids(swarm)[:1], seconds=20)
            copies_while_read = server.held_bytes()["served_state_copies"]
            stepped_on_copies = live["model/w"].data_ptr() != server.live["model/w"].data_ptr()
            await asyncio.sleep(0.5)  # the channel's end reaches the donor
            return (got, copies_while_read, stepped_on_copies, sorted(server._snapshots),
                    server.held_bytes()["served_state_copies"])

    got, copies_while_read, stepped_on_copies, held_after, copies_after = run(swarm, scenario())
    assert_same(got, expected)
    assert stepped_on_copies  # the joiner read the donor's own tensors while it stepped on copies
    assert copies_while_read in (0, expected.nbytes)  # the joiner may have said "done" before we looked
    assert held_after == [2] and copies_after == 0
