"""State a joiner can trust (issue 15, item 4): the version a majority reached, donors compared by
sketches, parts only from those that agree, and what arrived verified with a second nonce.

Four real p2pd nodes on loopback (one joiner, three donors) live for the whole module on a
background event loop; each test serves its snapshots under its own protocol name. The joiner's
transport has an admission that records what it blames (the scores themselves are accountability's).
"""

from __future__ import annotations

import itertools
import math
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
from conftest import joiner_and_donors, packed

from swarmgrad.net.wire import FrameError, RemoteError
from swarmgrad.peer.state import OPTIMIZER_PREFIX
from swarmgrad.state import server as state_server
from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state import transfer as state_transfer
from swarmgrad.state.served import ServedState
from swarmgrad.state.server import StateServer, sketched_parts
from swarmgrad.state.sketch import (
    CLASSES,
    SKETCH_PARTS,
    SKETCH_PROJECTIONS,
    SKETCHES_PER_CHANNEL,
    agreeing,
    compared_parts,
    compared_values,
    majority_version,
    parts_within,
    reference_sketch,
    sample_parts,
    sketch,
    tolerance_of,
)
from swarmgrad.state.snapshot import StateSnapshot, StateTooLarge, StateTransferError
from swarmgrad.state.transfer import download_state

_protocols = itertools.count()


class Blames:
    """Stands in for the joiner's admission: what it was told, as (peer, kind)."""

    def __init__(self):
        self.told: list[tuple[str, str]] = []

    def blame(self, peer_id: str, kind: str, detail: str = "") -> None:
        self.told.append((peer_id, kind))


@pytest.fixture(scope="module")
def swarm():
    with joiner_and_donors("trusted-state-test", 3) as started:
        started.ids = [node.peer_id for node in started.donors]
        yield started


@pytest.fixture
def blames(swarm):
    recorder = Blames()
    swarm.transports[0].admission = recorder
    yield recorder
    swarm.transports[0].admission = None


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 128 * 1024)  # a state of ~2 MB in ~16 parts


def run(swarm, coroutine, seconds: float = 60.0):
    return swarm.loop.run(coroutine, timeout=seconds)


def new_protocol() -> str:
    return f"swarmgrad/test-trusted-{next(_protocols)}/state"


class CountingServer(StateServer):
    """A StateServer that records which parts it served."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served: list[int] = []

    async def _serve(self, channel) -> None:
        send = channel.send

        async def counting_send(header, payload=b""):
            await send(header, payload)
            if header.get("t") == "part":
                self.served.append(header["index"])

        channel.send = counting_send
        await super()._serve(channel)


class ServesPoison(CountingServer):
    """Describes and sketches its honest snapshot, but every part it serves comes from ``poison``."""

    poison: StateSnapshot

    async def _serve(self, channel) -> None:
        send = channel.send

        async def poisoned_send(header, payload=b""):
            if header.get("t") == "part":
                size = state_snapshot.PART_BYTES
                payload = memoryview(self.poison.data[header["index"] * size: (header["index"] + 1) * size].numpy())
            await send(header, payload)

        channel.send = poisoned_send
        await super()._serve(channel)


@asynccontextmanager
async def serving(swarm, protocol: str, snapshots: list[list[StateSnapshot]], kinds: list[type] | None = None):
    """Donor i publishes snapshots[i] (in order) with a server of kinds[i]."""
    kinds = kinds or [CountingServer] * len(snapshots)
    async with AsyncExitStack() as stack:
        servers = []
        for transport, published, kind in zip(swarm.transports[1:], snapshots, kinds):
            server = await stack.enter_async_context(kind(transport, protocol))
            for snapshot in published:
                server.publish(snapshot)
            servers.append(server)
        yield servers


def training_state(version: int = 7, optimizer_seed: int = 0, spread: float = 0.0, momentum_spread: float = 0.0,
                   spread_seed: int = 1) -> StateSnapshot:
    """A peer's state: the swarm's model and outer momentum (moved by ``spread`` and
    ``momentum_spread`` of their norms, as moshpit groups leave honest peers apart) and inner-optimizer
    moments of its own."""
    swarm_values = torch.Generator().manual_seed(0)
    model = torch.randn(300_000, generator=swarm_values)
    bias = torch.randn(100, generator=swarm_values)
    momentum = torch.randn(100_000, generator=swarm_values) * 0.01
    apart = torch.Generator().manual_seed(spread_seed)

    def moved(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
        noise = torch.randn(tensor.shape, generator=apart)
        return tensor + noise * (fraction * tensor.norm() / noise.norm())

    own = torch.Generator().manual_seed(1000 + optimizer_seed)
    tensors = {"model/w": moved(model, spread), "model/b": moved(bias, spread),
               "strategy/momentum/0": moved(momentum, momentum_spread),
               "optimizer/0/exp_avg": torch.randn(150_000, generator=own),
               "optimizer/0/exp_avg_sq": torch.rand(150_000, generator=own)}
    return StateSnapshot.capture(version, tensors, {"epoch": version})


def scaled(snapshot: StateSnapshot, factor: float) -> StateSnapshot:
    return StateSnapshot.capture(snapshot.version, {name: tensor * factor if tensor.is_floating_point() else tensor
                                                    for name, tensor in snapshot.tensors().items()}, snapshot.meta)


def noisy(snapshot: StateSnapshot, fraction: float, seed: int = 5) -> StateSnapshot:
    """``snapshot`` with noise of ``fraction`` of each compared tensor's norm added (optimizer moments,
    never compared, are left alone)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in snapshot.tensors().items():
        noise = torch.randn(tensor.shape, generator=generator)
        tensors[name] = tensor if tolerance_of(name) is None else tensor + noise * (fraction * tensor.norm() / noise.norm())
    return StateSnapshot.capture(snapshot.version, tensors, snapshot.meta)


def parts_of(snapshot: StateSnapshot) -> int:
    return math.ceil(snapshot.nbytes / state_snapshot.PART_BYTES)


def part(snapshot: StateSnapshot | ServedState, index: int) -> torch.Tensor:
    return snapshot.read_part(index)


def assert_same(got: ServedState, want: StateSnapshot) -> None:
    assert got.version == want.version and got.specs == want.specs and got.meta == want.meta
    assert torch.equal(packed(got), want.data)


# ---- the rules, as units ---------------------------------------------------------------------------


def test_the_version_is_the_highest_a_strict_majority_reached():
    assert majority_version([5]) == 5  # one donor: its own (a swarm of two stays joinable)
    assert majority_version([5, 3]) == 3  # of two, the lower: both reached it
    assert majority_version([10**6, 7, 7]) == 7  # one huge claim does not win
    assert majority_version([10**6, 10**6, 7]) == 10**6
    assert majority_version([9, 8, 7, 6]) == 7  # 3 of 4 reached 7, only 2 reached 8
    assert majority_version([4, 9, 1, 9, 9]) == 9
    with pytest.raises(ValueError):
        majority_version([])


def test_which_tensors_are_compared_and_how_closely():
    assert tolerance_of(OPTIMIZER_PREFIX + "0/exp_avg") is None  # each peer's own moments: never compared
    assert tolerance_of("strategy/momentum/3") == 3.0
    assert tolerance_of("model/layer.weight") == tolerance_of("steps") == 0.1
    assert CLASSES == (3.0, 0.1)


def test_a_sketch_depends_on_its_seed_and_keeps_distances():
    honest = training_state()
    parts = list(range(parts_of(honest)))
    first, again = sketch(honest.read_part, honest.specs, 1, parts), sketch(honest.read_part, honest.specs, 1, parts)
    assert first.shape == (len(parts), len(CLASSES), SKETCH_PROJECTIONS) and first.dtype == torch.float32
    assert torch.equal(first, again)
    assert not torch.equal(first, sketch(honest.read_part, honest.specs, 2, parts))
    # parts holding only optimizer moments sketch to zeros: two peers' moments never disagree
    own = training_state(optimizer_seed=1)
    optimizer_only = [index for index in parts if not compared_values(honest.specs, [index]).any()]
    assert optimizer_only and torch.equal(sketch(own.read_part, own.specs, 1, optimizer_only),
                                          torch.zeros(len(optimizer_only), len(CLASSES), 8))
    # integer tensors (counters each peer keeps, like BatchNorm's num_batches_tracked) are not compared
    counted = {"model/w": torch.ones(1000), "model/bn.num_batches_tracked": torch.tensor(5)}
    one = StateSnapshot.capture(1, counted)
    other = StateSnapshot.capture(1, {**counted, "model/bn.num_batches_tracked": torch.tensor(90_000)})
    assert torch.equal(sketch(one.read_part, one.specs, 1, [0]), sketch(other.read_part, other.specs, 1, [0]))
    assert compared_values(one.specs, [0]).tolist() == [[0.0, 1000.0]]
    # a state 5% apart sketches about 5% apart (8 projections: within 0.3..2x, seed by seed)
    apart = training_state(spread=0.05)
    ratios = []
    for seed in range(20):
        a, b = sketch(honest.read_part, honest.specs, seed, [0]), sketch(apart.read_part, apart.specs, seed, [0])
        ratios.append(float((a - b)[0, 1].norm() / a[0, 1].norm()) / 0.05)
    assert 0.3 < min(ratios) and max(ratios) < 2.0 and 0.7 < sum(ratios) / len(ratios) < 1.3, ratios


def test_the_median_of_sketches_ignores_a_minority_however_far():
    honest = torch.ones(3, 2, 8)
    liar = torch.full((3, 2, 8), -1000.0)
    assert torch.equal(reference_sketch(torch.stack([honest * 1.01, liar, honest])), honest)
    assert torch.equal(reference_sketch(torch.stack([honest, honest * 3])), honest * 2)  # even count: the middle two's mean


def test_a_part_agrees_within_its_class_tolerance():
    counts = torch.tensor([[10.0, 10.0]])
    reference = torch.zeros(1, 2, 8)
    reference[0, 0, 0] = reference[0, 1, 0] = 100.0  # norms 100 in both classes
    near = reference.clone()
    near[0, 1, 0] += 9.0  # model class: 9% < 10%
    near[0, 0, 0] += 250.0  # momentum class: 250% < 300%
    assert parts_within(near, reference, counts).tolist() == [True]
    far = reference.clone()
    far[0, 1, 0] += 11.0
    assert parts_within(far, reference, counts).tolist() == [False]
    far = reference.clone()
    far[0, 0, 0] += 310.0
    assert parts_within(far, reference, counts).tolist() == [False]
    nan = reference.clone()
    nan[0, 1, 3] = float("nan")
    assert parts_within(nan, reference, counts).tolist() == [False]
    # a part of zeros agrees with zeros, and with what lies under the floor (1e-6 per value)
    zeros = torch.zeros(1, 2, 8)
    assert parts_within(zeros, zeros, counts).tolist() == [True]
    assert parts_within(zeros + 1e-7, zeros, counts).tolist() == [True]
    assert parts_within(zeros + 1e-3, zeros, counts).tolist() == [False]


def test_agreeing_donors_are_those_near_the_median():
    honest = training_state()
    parts = list(range(parts_of(honest)))
    counts = compared_values(honest.specs, parts)
    states = {"a": honest, "b": training_state(optimizer_seed=1, spread=0.02, momentum_spread=0.7),
              "c": training_state(optimizer_seed=2, spread=0.02, momentum_spread=0.7, spread_seed=2),
              "liar": scaled(honest, -10.0), "noisy": noisy(honest, 0.5)}
    sketches = {name: sketch(state.read_part, state.specs, 3, parts) for name, state in states.items()}
    assert agreeing(sketches, counts) == ["a", "b", "c"]
    assert agreeing({"a": sketches["a"], "b": sketches["b"]}, counts) == ["a", "b"]
    assert agreeing({"a": sketches["a"], "liar": sketches["liar"]}, counts) == []
    assert agreeing({}, counts) == []


def test_a_sketch_request_names_at_most_sketch_parts_ascending_parts():
    assert sketched_parts({}, 3) == (0, 1, 2)  # an older joiner's request: every part
    assert sketched_parts({"parts": [0, 2]}, 3) == (0, 2) and sketched_parts({"parts": []}, 3) == ()
    for bad in ([2, 0], [1, 1], [100], [-1], [True], [0.0], list(range(SKETCH_PARTS + 1)), "0"):
        with pytest.raises(FrameError, match=f"at most {SKETCH_PARTS} ascending parts of 0..99"):
            sketched_parts({"parts": bad}, 100)


# ---- real donors ---------------------------------------------------------------------------------


def test_a_donor_serving_a_poisoned_state_is_outvoted_and_blamed(swarm, blames):
    honest = [training_state(optimizer_seed=seed) for seed in (0, 1)]
    poisoned = scaled(training_state(optimizer_seed=2), -10.0)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest[0]], [poisoned], [honest[1]]]) as servers:
            got = await download_state(swarm.transports[0], protocol, swarm.ids, seconds=20)
            return got, [server.served for server in servers]

    got, (first, liar, second) = run(swarm, scenario())
    assert liar == [] and first and second
    kept = got.tensors()
    for name, tensor in honest[0].tensors().items():
        if not name.startswith(OPTIMIZER_PREFIX):
            assert torch.equal(kept[name], tensor), name
    for index in range(parts_of(got)):  # each part (optimizer moments included) is one honest donor's
        assert any(torch.equal(part(got, index), part(state, index)) for state in honest), index
    assert blames.told == [(swarm.ids[1], "digest disagreement")]


def test_poisoned_parts_behind_honest_sketches_are_caught_and_fetched_again(swarm, blames):
    """The liar sketches an honest copy, so it agrees; the parts it serves are 10x their norm off. The check with
    a nonce drawn once the bytes are in catches them, and all it served comes again from the others."""
    honest = training_state()
    liar = type("Liar", (ServesPoison,), {"poison": noisy(honest, 10.0)})

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]] * 3, [CountingServer, liar, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, swarm.ids, seconds=20)
            return got, [server.served for server in servers]

    got, (first, poisoner, second) = run(swarm, scenario())
    assert_same(got, honest)
    # its parts holding compared values were poisoned (the first parts, taken by the donors in turn,
    # hold the model's) and caught; everything it served was fetched again from the others
    assert [index for index in poisoner if compared_values(honest.specs, [index]).any()], poisoner
    assert sorted(first + second) == list(range(parts_of(honest)))
    assert blames.told == [(swarm.ids[1], "bad state")]


def test_a_huge_version_claimed_by_one_donor_does_not_win(swarm, blames):
    honest = training_state(version=7)
    claim = scaled(training_state(version=10**6), 3.0)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest], [claim], [honest]]) as servers:
            got = await download_state(swarm.transports[0], protocol, swarm.ids, seconds=20, min_version=7)
            return got, [server.served for server in servers]

    got, (_, claimant, _) = run(swarm, scenario())
    assert_same(got, honest)
    assert claimant == [] and blames.told == []  # it does not hold version 7: it just drops out


def test_two_donors_a_little_apart_and_a_single_donor_hand_over_a_state(swarm, blames):
    one = training_state(optimizer_seed=0)
    other = training_state(optimizer_seed=1, spread=0.02, momentum_spread=0.7)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[one], [other]]) as servers:
            pair = await download_state(swarm.transports[0], protocol, swarm.ids[:2], seconds=20)
            alone = await download_state(swarm.transports[0], protocol, swarm.ids[1:2], seconds=20)
            return pair, alone, [server.served for server in servers]

    pair, alone, served = run(swarm, scenario())
    assert all(served), served
    for index in range(parts_of(pair)):
        assert any(torch.equal(part(pair, index), part(state, index)) for state in (one, other)), index
    assert_same(alone, other)
    assert blames.told == []


def test_two_donors_that_disagree_wildly_hand_over_nothing(swarm, blames):
    honest = training_state()

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest], [scaled(honest, -10.0)]]) as servers:
            with pytest.raises(StateTransferError, match="the donors disagree on the state at version 7: 0 of 2"):
                await download_state(swarm.transports[0], protocol, swarm.ids[:2], seconds=20)
            return [server.served for server in servers]

    assert run(swarm, scenario()) == [[], []]  # not a byte fetched
    assert blames.told == []  # no majority: nobody can tell which one lies


def test_a_donor_answers_a_few_sketches_per_channel_and_computes_each_once(swarm, monkeypatch):
    honest = training_state()
    everything = list(range(parts_of(honest)))
    computed = []
    real_sketch = state_server.sketch

    def counting_sketch(read_part, specs, seed, parts):
        computed.append(seed)
        return real_sketch(read_part, specs, seed, parts)

    monkeypatch.setattr(state_server, "sketch", counting_sketch)

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]]):
            channel = await swarm.transports[0].open(swarm.ids[0], protocol)
            try:
                answers = []
                for _ in range(SKETCHES_PER_CHANNEL):
                    answers.append(await state_transfer._ask_sketch(channel, 7, 42, honest.nbytes, everything))
                with pytest.raises(RemoteError, match="more than 4 sketch requests"):
                    await state_transfer._ask_sketch(channel, 7, 43, honest.nbytes, everything)
            finally:
                await channel.close()
            return answers

    answers = run(swarm, scenario())
    assert computed == [42]  # the same nonce again comes from the cache
    assert all(torch.equal(answer, answers[0]) for answer in answers)
    assert torch.equal(answers[0], real_sketch(honest.read_part, honest.specs, 42, everything))


def test_a_sketch_reads_a_bounded_sample_however_large_the_state(swarm, monkeypatch):
    """Parts of 8 KiB make the state ~200 compared parts: every sketch, the donors' and the joiner's
    own, reads at most SKETCH_PARTS of them, and the download still agrees and verifies."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 8 * 1024)
    honest = training_state()
    compared = compared_parts(honest.specs, range(parts_of(honest)))
    assert len(compared) > 3 * SKETCH_PARTS
    read: list[set[int]] = []

    def counting(real):
        def counted(read_part, specs, seed, parts):
            seen: set[int] = set()
            read.append(seen)
            return real(lambda index: seen.add(index) or read_part(index), specs, seed, parts)
        return counted

    monkeypatch.setattr(state_server, "sketch", counting(state_server.sketch))
    monkeypatch.setattr(state_transfer, "sketch", counting(state_transfer.sketch))

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]] * 3):
            return await download_state(swarm.transports[0], protocol, swarm.ids, seconds=20)

    assert_same(run(swarm, scenario()), honest)
    assert len(read) == 3 + 3 + 1  # each donor's comparison and verification sketches, the joiner's own
    assert all(len(seen) == SKETCH_PARTS and seen <= set(compared) for seen in read)
    # the sample is drawn from the nonce: another nonce reads other parts
    assert sample_parts(honest.specs, compared, 1) != sample_parts(honest.specs, compared, 2)


def test_a_poisoner_caught_in_a_sample_has_everything_it_served_fetched_again(swarm, blames, monkeypatch):
    """Sketches read a sample (8 KiB parts: ~200 compared, 64 read), so most poisoned parts are never
    read; the one caught in it is trusted with nothing it served, and the state comes out exact."""
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 8 * 1024)
    honest = training_state()
    assert len(compared_parts(honest.specs, range(parts_of(honest)))) > 3 * SKETCH_PARTS
    liar = type("Liar", (ServesPoison,), {"poison": noisy(honest, 10.0)})

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]] * 3, [CountingServer, liar, CountingServer]) as servers:
            got = await download_state(swarm.transports[0], protocol, swarm.ids, seconds=30)
            return got, [server.served for server in servers]

    got, (first, poisoner, second) = run(swarm, scenario())
    assert_same(got, honest)
    assert len(poisoner) > SKETCH_PARTS and sorted(first + second) == list(range(parts_of(honest)))
    assert blames.told == [(swarm.ids[1], "bad state")]


def test_a_state_above_this_peers_limit_is_refused_blaming_no_donor(swarm, blames):
    honest = training_state()

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]] * 3) as servers:
            with pytest.raises(StateTooLarge, match=f"the state is {honest.nbytes} bytes .* above this peer's "
                                                    f"limit of {honest.nbytes - 1} bytes .* raise download_state's "
                                                    f"max_bytes"):
                await download_state(swarm.transports[0], protocol, swarm.ids, seconds=20,
                                     max_bytes=honest.nbytes - 1)
            return [server.served for server in servers]

    assert run(swarm, scenario()) == [[], [], []]
    assert blames.told == []


class OlderDonor(CountingServer):
    """Reads sketch requests as a donor from before samples did: every part, whatever was asked."""

    async def _serve(self, channel) -> None:
        recv = channel.recv

        async def recv_without_parts(*args, **kwargs):
            request = await recv(*args, **kwargs)
            return type(request)({key: value for key, value in request.header.items() if key != "parts"},
                                 request.payload)

        channel.recv = recv_without_parts
        await super()._serve(channel)


def test_older_donors_that_sketch_every_part_still_hand_over_a_state(swarm, blames, monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 8 * 1024)
    honest = training_state()

    async def scenario():
        protocol = new_protocol()
        async with serving(swarm, protocol, [[honest]] * 3, [OlderDonor, CountingServer, OlderDonor]):
            return await download_state(swarm.transports[0], protocol, swarm.ids, seconds=30)

    assert_same(run(swarm, scenario()), honest)
    assert blames.told == []
