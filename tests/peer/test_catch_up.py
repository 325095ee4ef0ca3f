"""Catching up with a swarm that moved on: a peer a round or two behind replays the rounds it missed
from a donor's kept results instead of downloading the whole state, and a download that ends with
the swarm a round further is followed by a replay, not another download (issue 17, item 4).

These drive ``CatchUp`` in-process with the transfers faked (what they check is the choice between
replay and download, and how donors' results are combined); test_catch_up_real.py runs real peers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import run_async
from peer_fakes import FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.net.accountability import Misbehaviour
from swarmgrad.net.ratelimit import UNLIMITED, RateLimits
from swarmgrad.peer import catch_up as catch_up_module
from swarmgrad.peer.catch_up import CatchUp
from swarmgrad.peer.progress import PeerProgress
from swarmgrad.peer.state import TrainingState
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.state.kept import KEPT_RESULTS
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.timing import Timing


class KeptResults:
    """What CatchUp uses of a StateServer: the results it keeps, and its protocol."""

    protocol = "state"

    def __init__(self) -> None:
        self.results: dict[int, torch.Tensor] = {}

    def publish_result(self, epoch: int, result: torch.Tensor, frames=None) -> None:
        self.results[epoch] = result.clone()


class Harness:
    """A DiLoCo peer at epoch 0 that took local steps; the swarm's other peer is at ``swarm_epoch``.
    Results of rounds are served from ``donor_results``; a state download hands over ``donor_state``."""

    def __init__(self, swarm_epoch: int, monkeypatch, in_step: bool = True):
        model, optimizer = model_and_optimizer(0)
        self.tracker = FakeTracker((PeerProgress("donor", swarm_epoch, 0.0, 0.0, 0.0, False),))
        self.policy = attach(DiLoCo(inner_steps=2, outer_lr=1.0, outer_momentum=0.0), model, optimizer, self.tracker)
        set_grads(self.policy.params, 1)
        self.policy.after_backward(batch_size=4)
        self.state = TrainingState(model, optimizer, self.policy)
        self.server = KeptResults()
        self.misbehaviour = Misbehaviour()
        runtime = SimpleNamespace(transport=object(), limits=UNLIMITED,
                                  reachable_first=lambda donors: list(donors),
                                  admission=SimpleNamespace(misbehaviour=self.misbehaviour,
                                                            blame=lambda peer, kind, detail: self.misbehaviour.note(
                                                                peer, kind, detail)))
        self.published: list[int] = []
        self.catch_up = CatchUp(runtime, self.server, self.policy, self.state, self.tracker, Timing(),
                                lambda: self.published.append(self.tracker.local.epoch))
        self.catch_up.in_step = in_step
        numel = self.policy.layout.total
        self.donor_results = {epoch: torch.full((numel,), 0.01 * (epoch + 1)) for epoch in range(swarm_epoch)}
        self.donor_state_version = swarm_epoch
        self.swarm_moves_during_download = 0
        self.asked_results: list[int] = []
        self.downloads = 0
        monkeypatch.setattr(catch_up_module, "download_result", self.download_result)
        monkeypatch.setattr(catch_up_module, "download_state", self.download_state)

    async def download_result(self, transport, protocol, donors, epoch, numel, seconds, decoder=None):
        self.asked_results.append(epoch)
        if epoch not in self.donor_results:
            raise StateTransferError(f"the result of round {epoch} is not kept here")
        assert donors == ["donor"] and numel == self.policy.layout.total
        return self.donor_results[epoch]

    async def download_state(self, transport, protocol, donors, seconds, min_version, keep, into):
        self.downloads += 1
        version = self.donor_state_version
        assert version >= min_version
        snapshot = self.state.capture(version, {})
        donor = self.tracker.others[0]  # the swarm finishes rounds while the bytes travel
        for epoch in range(donor.epoch, donor.epoch + self.swarm_moves_during_download):
            self.donor_results[epoch] = torch.full((self.policy.layout.total,), 0.01 * (epoch + 1))
        self.tracker.others = (PeerProgress("donor", donor.epoch + self.swarm_moves_during_download, 0.0, 0.0, 0.0,
                                            False),)
        return snapshot

    def start(self) -> torch.Tensor:
        return self.policy.start.clone()

    def run(self) -> None:
        run_async(self.catch_up(self.tracker.ahead_of(self.tracker.local.epoch), self.tracker.local.epoch + 1))


def test_a_peer_one_round_behind_replays_that_round_instead_of_downloading(monkeypatch):
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    start = h.start()
    local = [p.detach() - s for p, s in zip(h.policy.params, h.policy.layout.views(start))]  # its local step
    steps, samples = h.tracker.local.steps, h.tracker.local.samples
    assert any(bool(delta.abs().sum()) for delta in local)
    h.run()
    assert h.downloads == 0 and h.asked_results == [0]
    assert h.tracker.local.epoch == 1 and h.catch_up.replayed == 1
    # outer lr 1, no momentum: the new start is the old one minus the round's result, and the
    # parameters are the new start plus the local steps made since the old one (issue 38: a late
    # peer's work is kept, and its steps and samples count in the epoch it sends them in)
    assert torch.allclose(h.policy.start, start - h.donor_results[0])
    assert all(torch.allclose(p.detach(), s + delta, atol=1e-7)
               for p, s, delta in zip(h.policy.params, h.policy.layout.views(h.policy.start), local))
    assert (h.tracker.local.steps, h.tracker.local.samples) == (steps, samples) == (1, 4)
    assert torch.equal(h.server.results[0], h.donor_results[0])  # kept, for a peer behind this one
    assert h.published == [1]


def test_two_rounds_behind_replays_both_in_order(monkeypatch):
    h = Harness(swarm_epoch=2, monkeypatch=monkeypatch)
    start = h.start()
    h.run()
    assert h.downloads == 0 and h.asked_results == [0, 1] and h.tracker.local.epoch == 2
    assert torch.allclose(h.policy.start, start - h.donor_results[0] - h.donor_results[1])


def replay_reach(monkeypatch) -> int:
    """The most rounds the Harness peer replays at once (its state's bytes over a result's)."""
    return Harness(swarm_epoch=1, monkeypatch=monkeypatch).catch_up.replay_rounds()


def test_more_rounds_behind_than_donors_keep_for_everyone_replays_them_all_where_donors_hand_them_over(
        monkeypatch):
    """Donors keep more than KEPT_RESULTS for a joiner whose download they served (StateServer's
    holds): a peer that many rounds behind replays every one, not at most KEPT_RESULTS."""
    behind = KEPT_RESULTS + 2
    assert replay_reach(monkeypatch) >= behind
    h = Harness(swarm_epoch=behind, monkeypatch=monkeypatch)
    start = h.start()
    h.run()
    assert h.downloads == 0 and h.asked_results == list(range(behind)) and h.catch_up.replayed == behind
    assert torch.allclose(h.policy.start, start - sum(h.donor_results[epoch] for epoch in range(behind)))


def test_a_replay_is_bounded_by_the_bytes_of_a_download_not_by_a_count(monkeypatch):
    """The state is 4 results' bytes here (bfloat16 results, a DiLoCo state of model and momentum in
    float32, plain SGD): replaying more rounds than that moves more than the state, so the peer
    downloads; with results in frames of a quarter of the bytes it replays four times as many."""
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    numel = h.policy.layout.total
    assert h.catch_up.result_bytes() == 2 * numel
    assert h.catch_up.replay_rounds() == h.catch_up.state_bytes() // (2 * numel) == 4
    h.catch_up.decoder = SimpleNamespace(nbytes=numel // 2)
    assert h.catch_up.replay_rounds() == h.catch_up.state_bytes() // (numel // 2) >= 16


def test_further_behind_than_a_downloads_worth_of_results_downloads_the_state(monkeypatch):
    behind = replay_reach(monkeypatch) + 1
    h = Harness(swarm_epoch=behind, monkeypatch=monkeypatch)
    h.run()
    assert h.asked_results == [] and h.downloads == 1 and h.catch_up.replayed == 0
    assert h.tracker.local.epoch == behind


def test_a_download_that_ends_with_the_swarm_a_round_further_replays_that_round(monkeypatch):
    """The spiral this breaks: a slow link's download takes longer than a round, so every download
    ended one round behind and the next step downloaded again."""
    version = replay_reach(monkeypatch) + 1
    h = Harness(swarm_epoch=version, monkeypatch=monkeypatch)
    h.swarm_moves_during_download = 1
    h.run()
    assert h.downloads == 1 and h.asked_results == [version]
    assert h.tracker.local.epoch == version + 1 and h.catch_up.replayed == 1


def test_a_catch_up_holds_the_pace_the_peer_claims_while_it_downloads_and_replays(monkeypatch):
    """Others wait for this peer by its claimed step rate (stragglers.py): a download and the replay
    after it are not training, and leave that rate as it was."""
    version = replay_reach(monkeypatch) + 1
    h = Harness(swarm_epoch=version, monkeypatch=monkeypatch)
    h.swarm_moves_during_download = 1
    held: list[bool] = []
    download_result, download_state = h.download_result, h.download_state

    async def result_seen(*args, **kwargs):
        held.append(h.tracker.local._pace_held)
        return await download_result(*args, **kwargs)

    async def state_seen(*args, **kwargs):
        held.append(h.tracker.local._pace_held)
        return await download_state(*args, **kwargs)

    monkeypatch.setattr(catch_up_module, "download_result", result_seen)
    monkeypatch.setattr(catch_up_module, "download_state", state_seen)
    h.run()
    assert h.downloads == 1 and h.catch_up.replayed == 1
    assert held == [True, True] and not h.tracker.local._pace_held  # held in both, released after


def test_a_peer_whose_oldest_missed_round_no_donor_kept_downloads_the_state(monkeypatch):
    """Past a donor's byte cap the oldest rounds go first: a peer that needs one of them cannot
    replay from where it is, and takes the state instead (then replays what is left)."""
    behind = KEPT_RESULTS + 2
    h = Harness(swarm_epoch=behind, monkeypatch=monkeypatch)
    del h.donor_results[0]
    h.run()
    assert h.asked_results == [0] and h.downloads == 1 and h.catch_up.replayed == 0
    assert h.tracker.local.epoch == behind


def test_a_replay_no_donor_can_serve_falls_back_to_the_state(monkeypatch):
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    h.donor_results.clear()
    h.run()
    assert h.asked_results == [0] and h.downloads == 1 and h.tracker.local.epoch == 1 and h.catch_up.replayed == 0


def test_a_peer_whose_state_is_not_the_swarms_never_replays(monkeypatch):
    """A fresh joiner's weights are its own: a result moves everyone by the same step, so replaying it
    would keep the joiner apart from the swarm for good. It takes the state."""
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch, in_step=False)
    h.run()
    assert h.asked_results == [] and h.downloads == 1 and h.catch_up.in_step


@pytest.mark.parametrize("in_step", [False, True])
def test_a_download_lands_in_the_outer_state_and_a_failed_one_starts_it_afresh(monkeypatch, in_step):
    """A peer hands its outer start and momentum to the download to write in place (issue 35: no
    buffer of the state's size beside them); when the download fails half way they are reset from
    its parameters and the peer no longer counts as holding the swarm's state, so nothing half
    written is ever averaged or replayed onto."""
    h = Harness(swarm_epoch=3, monkeypatch=monkeypatch, in_step=in_step)
    h.donor_results.clear()  # nothing to replay: the state it is
    h.policy.momentum.fill_(0.5)
    handed: list[dict[str, torch.Tensor]] = []

    async def failing_download(transport, protocol, donors, seconds, min_version, keep, into):
        handed.append(into)
        for tensor in into.values():
            tensor.fill_(7.0)  # half a download landed
        raise StateTransferError("the donor left")

    monkeypatch.setattr(catch_up_module, "download_state", failing_download)
    with pytest.raises(StateTransferError):
        h.run()
    start_views = {view.data_ptr() for view in h.policy.outer_params()}
    assert {tensor.data_ptr() for name, tensor in handed[0].items() if name.startswith("model/")} == start_views
    assert handed[0]["strategy/momentum/0"].data_ptr() == h.policy.momentum.data_ptr()
    params = torch.cat([param.detach().reshape(-1) for param in h.policy.params])
    assert torch.equal(h.policy.start, params) and not h.policy.momentum.any()
    assert not h.catch_up.in_step


# ---- real peers -------------------------------------------------------------------------------------

def results_from(monkeypatch, served: dict[str, torch.Tensor | None]) -> list[list[str]]:
    """Round results served per donor (None: it kept none); returns the donor lists asked."""
    asked: list[list[str]] = []

    async def download_result(transport, protocol, donors, epoch, numel, seconds, decoder=None):
        asked.append(list(donors))
        result = served[donors[0]]
        if result is None:
            raise StateTransferError(f"the result of round {epoch} is not kept here")
        return result

    monkeypatch.setattr(catch_up_module, "download_result", download_result)
    return asked


def test_a_replayed_result_is_the_median_of_three_donors_so_a_poisoned_one_moves_nothing(monkeypatch):
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    honest = h.donor_results[0]
    asked = results_from(monkeypatch, {"a": honest, "b": honest * 1.1, "liar": -10 * honest, "d": honest})
    result = run_async(h.catch_up.agreed_result(["a", "liar", "b", "d"], 0))
    assert sorted(map(tuple, asked)) == [("a",), ("b",), ("liar",)]  # three at once, each alone
    torch.testing.assert_close(result, honest)  # per coordinate, the liar is an outlier
    assert h.misbehaviour.score("liar") > 0 and h.misbehaviour.score("a") == h.misbehaviour.score("b") == 0


def test_donors_seen_misbehaving_are_not_asked_for_a_result_while_three_others_can_be(monkeypatch):
    """Two liars among five donors could be two of the three asked, and so the median: peers this
    one scored are asked last (scaled x100 attack: one honest peer replayed such a round, 27%)."""
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    honest = h.donor_results[0]
    h.tracker.others = tuple(PeerProgress(name, 1, 0.0, 0.0, 0.0, False) for name in ("liar1", "a", "liar2", "b", "c"))
    asked = results_from(monkeypatch, {"liar1": 100 * honest, "liar2": 100 * honest, "a": honest, "b": honest,
                                       "c": honest})
    for liar in ("liar1", "liar2"):  # out-voted once before (what agreed_result blames)
        h.misbehaviour.note(liar, "digest disagreement")
    start = h.start()
    assert run_async(h.catch_up.replay(h.tracker.ahead_of(0))) == 1
    assert sorted(map(tuple, asked)) == [("a",), ("b",), ("c",)]
    torch.testing.assert_close(h.policy.start, start - honest)


def test_two_donors_whose_results_disagree_hand_over_nothing(monkeypatch):
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    honest = h.donor_results[0]
    results_from(monkeypatch, {"a": honest, "liar": -honest, "gone": None})
    with pytest.raises(StateTransferError, match="disagree"):
        run_async(h.catch_up.agreed_result(["a", "liar", "gone"], 0))
    results_from(monkeypatch, {"a": honest, "b": 1.2 * honest})
    torch.testing.assert_close(run_async(h.catch_up.agreed_result(["a", "b"], 0)), 1.1 * honest)


class SlicedResult:
    """A result held as frames would be: read a slice at a time; remembers the longest slice read."""

    def __init__(self, values: torch.Tensor):
        self.values, self.longest = values, 0

    def numel(self) -> int:
        return self.values.numel()

    def __getitem__(self, span: slice) -> torch.Tensor:
        piece = self.values[span].clone()
        self.longest = max(self.longest, piece.numel())
        return piece


def test_donors_results_are_combined_a_span_at_a_time(monkeypatch):
    """Where no two donors name the same digest, their results are compared and combined a span at a
    time: one float32 result beside their frames (at 201M parameters the dense copies of two donors'
    results, their difference and their mean held a joiner at 28 bytes a parameter)."""
    monkeypatch.setattr(catch_up_module, "COMBINE_ELEMENTS", 7)
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    generator = torch.Generator().manual_seed(0)
    honest = torch.randn(h.policy.layout.total, generator=generator)
    assert honest.numel() > 3 * 7  # several spans
    two = {"a": SlicedResult(honest), "b": SlicedResult(honest * 1.2)}
    results_from(monkeypatch, two)
    torch.testing.assert_close(run_async(h.catch_up.agreed_result(["a", "b"], 0)), 1.1 * honest)
    assert all(0 < result.longest <= 7 for result in two.values())

    nearby = honest + 0.01 * torch.randn(honest.shape, generator=generator)
    three = {"a": SlicedResult(honest), "b": SlicedResult(nearby), "liar": SlicedResult(-10 * honest)}
    results_from(monkeypatch, three)
    expected = torch.stack([result.values for result in three.values()]).median(dim=0).values
    torch.testing.assert_close(run_async(h.catch_up.agreed_result(["a", "b", "liar"], 0)), expected)
    assert all(0 < result.longest <= 7 for result in three.values())
    assert h.misbehaviour.score("liar") > 0 and h.misbehaviour.score("a") == h.misbehaviour.score("b") == 0


def test_a_replays_deadline_is_its_bytes_at_the_rate_the_peers_rounds_received(monkeypatch):
    """A replay gets control_timeout plus the results' bytes: before any round at the assumed rate
    (bounded by a download cap), after rounds at the rate they received (10 MB of bfloat16 at 5 Mbit/s
    is 16 s, against a fixed 5 s), and never more than round_slack x the bytes at the assumed rate (a
    member that barely moves a byte cannot make it wait for ever, nor can a bigger model outgrow it)."""
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    result_bytes = h.policy.layout.total * 2  # bfloat16
    timing = h.catch_up.timing = Timing(assumed_rate_mbps=result_bytes * 8 / 1e6)  # one result a second
    control, slack = timing.control_timeout, timing.round_slack
    deadlines: list[float] = []

    async def download_result(transport, protocol, donors, epoch, numel, seconds, decoder=None):
        deadlines.append(seconds)
        return h.donor_results[epoch]

    monkeypatch.setattr(catch_up_module, "download_result", download_result)
    run_async(h.catch_up.agreed_result(["donor"], 0))
    h.catch_up.note_round(bytes_received=result_bytes, seconds=0.5)  # two results a second
    run_async(h.catch_up.agreed_result(["donor"], 0))
    h.catch_up.note_round(bytes_received=result_bytes, seconds=1.5)  # slower now: smoothed to 4/3 a second
    run_async(h.catch_up.agreed_result(["a", "b", "c"], 0))  # three results share the link
    for _ in range(20):  # a link that (or a member who) barely moves a byte
        h.catch_up.note_round(bytes_received=1, seconds=1000.0)
    run_async(h.catch_up.agreed_result(["donor"], 0))
    h.catch_up.receive_rate = None
    h.catch_up.runtime.limits = RateLimits.from_mbps(None, timing.assumed_rate_mbps / 2)  # a download cap
    run_async(h.catch_up.agreed_result(["donor"], 0))
    assert deadlines[:2] == pytest.approx([control + 1.0, control + 0.5])
    assert deadlines[2:5] == pytest.approx([control + 3 * 0.75] * 3)
    assert deadlines[5] == pytest.approx(control + slack * 1.0)
    assert deadlines[6] == pytest.approx(control + 2.0)


def test_donors_that_name_the_same_result_hand_it_over_once_and_a_liar_among_them_is_skipped(monkeypatch):
    """Members of one group hold the same result: two of three donors naming its digest is agreement,
    and its bytes come from one of them alone (one result's bytes where the median took three). A
    donor that names the honest digest but serves other bytes is passed over for the next one."""
    h = Harness(swarm_epoch=1, monkeypatch=monkeypatch)
    honest = h.donor_results[0]
    served = {"liar": -10 * honest, "a": honest, "b": honest, "c": 3 * honest}
    named = {"liar": "honest", "a": "honest", "b": "honest", "c": "other"}
    fetched: list[str] = []

    async def download_result_digest(transport, protocol, donor, epoch):
        return named[donor]

    async def download_result(transport, protocol, donors, epoch, numel, seconds, digest=None, decoder=None):
        for donor in donors:
            fetched.append(donor)
            if digest is None or named[donor] == digest and served[donor] is honest:
                return served[donor]
        raise StateTransferError("no donor handed it over")

    monkeypatch.setattr(catch_up_module, "download_result_digest", download_result_digest)
    monkeypatch.setattr(catch_up_module, "download_result", download_result)
    assert run_async(h.catch_up.agreed_result(["liar", "a", "c"], 0)) is honest
    assert fetched == ["liar", "a"]  # one download at a time, from those naming the agreed digest
    fetched.clear()
    # no two donors name the same result: every donor's result, and their median
    named.update({"a": "a", "b": "b", "c": "c"})
    served.update({"liar": honest, "b": 1.1 * honest})
    torch.testing.assert_close(run_async(h.catch_up.agreed_result(["a", "b", "c"], 0)), 1.1 * honest)
    assert sorted(fetched) == ["a", "b", "c"]
