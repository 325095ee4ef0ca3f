"""Accountability without a network: the score, its decay, the threshold, a ban's end (fake clock),
the admission refusing a banned peer in a public run, a round's suspicions reaching the score, and
whom a leader leaves out of its group when members refuse one another."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import FakeClock, run_async
from rich.console import Console

import swarmgrad as sg
from swarmgrad.averaging.invitations import left_out, peer_ids
from swarmgrad.averaging.report import RoundReport
from swarmgrad.commands.status import _view
from swarmgrad.dht.membership import Member, TrainingStats
from swarmgrad.errors import ConfigError
from swarmgrad.net.accountability import WEIGHTS, Accountability, Misbehaviour
from swarmgrad.net.admission import BANNED, NOT_ADMITTED, Admission
from swarmgrad.net.wire import FrameError
from swarmgrad.peer.backends import RoundOutcome
from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.landing import StateLanding
from swarmgrad.state.snapshot import StateSnapshot, StateTransferError
from swarmgrad.state.transfer import _check_finite

RULE = Accountability(ban_threshold=5, ban_seconds=30, half_life=10, far_rows=0.5)


def test_scores_add_the_kinds_weights_and_halve_every_half_life():
    clock = FakeClock(1000.0)
    scores = Misbehaviour(RULE, clock=clock)
    scores.note("p", "clipped")
    scores.note("p", "weight cut")
    assert scores.score("p") == pytest.approx(RULE.far_rows + WEIGHTS["weight cut"])
    clock.now += 10  # one half-life
    assert scores.score("p") == pytest.approx(1.25)
    clock.now += 20
    assert scores.score("p") == pytest.approx(0.3125)
    assert scores.score("someone else") == 0.0 and not scores.banned("p")


def test_an_honest_peer_clipped_now_and_then_is_never_banned():
    clock = FakeClock(1000.0)
    scores = Misbehaviour(RULE, clock=clock)
    for _ in range(200):  # every 10 s (one half-life): its score settles at 2, below 5
        assert not scores.note("honest", "clipped")
        clock.now += 10
    assert scores.score("honest") < 2.0 and scores.bans() == {}


def test_past_the_threshold_a_peer_is_banned_once_logged_and_the_ban_ends(caplog):
    clock = FakeClock(1000.0)
    scores = Misbehaviour(RULE, clock=clock)
    with caplog.at_level(logging.WARNING, logger="swarmgrad.net.accountability"):
        assert [scores.note("liar", "invalid frame") for _ in range(5)] == [False] * 4 + [True]
    assert scores.banned("liar") and scores.bans() == {"liar": pytest.approx(30)}
    (line,) = [record.getMessage() for record in caplog.records]
    assert "banned liar for 30 s, until" in line and "score 5.0 >= 5" in line and "invalid frame x5" in line
    assert not scores.note("liar", "bad state")  # while banned nothing more counts
    clock.now += 29.9
    assert scores.banned("liar") and scores.bans()["liar"] == pytest.approx(0.1)
    clock.now += 0.2
    assert not scores.banned("liar") and scores.bans() == {}
    assert scores.score("liar") == 0.0 and scores.bans_total == 1  # it starts over


def test_a_burst_bans_at_once_and_the_peer_itself_is_never_scored():
    scores = Misbehaviour(RULE, clock=FakeClock(1000.0))
    scores.ignore.add("me")
    scores.note_round({"me": ["weight cut"] * 5, "a": ["weight cut", "bad state"], "b": ["clipped"]})
    assert set(scores.bans()) == {"a"} and scores.score("me") == 0.0 and scores.score("b") == 0.5


def test_by_default_clipped_and_rejected_rows_never_ban_however_often():
    """Honest rows late in training are rejected round after round (accountability.py (*))."""
    scores = Misbehaviour(clock=FakeClock(1000.0))
    for _ in range(1000):
        scores.note_round({"far": ["rejected", "clipped"]}, ["far"])
    assert scores.score("far") == 0.0 and scores.bans() == {}
    scores.note_round({"far": ["weight cut"]}, ["far"])  # what no honest peer does still counts
    assert scores.score("far") == WEIGHTS["weight cut"]


def test_clean_rounds_forgive_so_only_round_after_round_of_clipping_bans():
    scores = Misbehaviour(Accountability(far_rows=0.5), clock=FakeClock(1000.0))  # threshold 10
    group = ["liar", "honest", "other"]
    for round_index in range(1000):  # the honest peer is clipped in every other round, the liar in every one
        suspicions = {"liar": ["clipped"]} if round_index < 19 else {}
        if round_index % 2:
            suspicions["honest"] = ["clipped"]
        scores.note_round(suspicions, group)
        if round_index == 18:
            assert not scores.banned("liar") and scores.score("liar") == pytest.approx(9.5)
        if round_index == 19:  # one clean round halves its score
            assert scores.score("liar") == pytest.approx(4.75)
    assert scores.score("honest") <= 1.0 and scores.bans() == {}
    for _ in range(20):
        scores.note_round({"liar": ["clipped"]}, group)
    assert set(scores.bans()) == {"liar"}


@pytest.mark.parametrize("field, value", [("ban_threshold", 0), ("ban_seconds", -1), ("half_life", float("nan"))])
def test_bad_settings_are_one_line_errors(field, value):
    with pytest.raises(ConfigError, match=f"Accountability: {field}"):
        Accountability(**{field: value})


def test_a_public_runs_admission_refuses_a_banned_peer_and_its_records_until_the_ban_ends():
    clock = FakeClock(1000.0)
    admission = Admission("public-run", None, accountability=RULE)
    admission.misbehaviour.clock = clock
    admission.admit_self("me")
    assert admission.admits("other") and admission.admit_record("other", None)  # public: everyone
    assert run_async(admission.admit("other"))
    for _ in range(5):
        admission.blame("other", "invalid frame", "garbage")
        admission.blame("me", "invalid frame")  # never bans itself
    assert not admission.admits("other") and admission.admits("me")
    assert not admission.admit_record("other", None) and not run_async(admission.admit("other"))
    assert admission.refusal("other") == BANNED and admission.refusal("x") == NOT_ADMITTED
    assert admission.refused_records == 1 and admission.refused_streams == 1
    clock.now += RULE.ban_seconds
    assert admission.admits("other") and admission.admit_record("other", None)


def test_a_rounds_suspicions_count_toward_a_ban_and_show_in_the_status():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    peer = sg.Peer(model, torch.optim.SGD(model.parameters(), lr=0.1), run_id="score-rounds",
                   bans=Accountability(ban_threshold=4))
    report = RoundReport("moshpit", 0, ok=True, group=["liar"], contributors=["liar"],
                         suspicions={"liar": ["weight cut", "clipped"]})
    peer.counters.record(RoundOutcome(ok=True, report=report))
    assert peer.runtime.admission.misbehaviour.score("liar") == pytest.approx(2.0, rel=1e-3)  # clipped: 0
    peer.counters.record(RoundOutcome(ok=False, report=report))
    assert set(peer.status().banned) == {"liar"} and peer.assembly.stats().bans == 1


def test_a_donor_whose_parts_hold_nan_is_blamed_for_bad_state():
    good = torch.zeros(300_000)  # 1.2 MB: parts 0 and 1
    bad = torch.tensor([1.0, float("nan")])
    snapshot = StateSnapshot.capture(3, {"good": good, "bad": bad}, {})

    def landed(keep=None) -> StateLanding:
        landing = StateLanding(snapshot.specs, keep)
        for index in state_snapshot.parts_holding(snapshot.specs, keep):
            landing.write(index, snapshot.read_part(index).clone())
        return landing

    blamed = []
    with pytest.raises(StateTransferError, match="NaN or Inf in 'bad'"):
        _check_finite(landed(), {0: "honest", 1: "poisoner"}, lambda *args: blamed.append(args))
    assert blamed == [("poisoner", "bad state", "NaN or Inf in 'bad'")]
    _check_finite(landed(lambda name: name == "good"), {0: "honest", 1: "poisoner"},
                  lambda *args: blamed.append(args))
    assert len(blamed) == 1  # a tensor it does not keep was never fetched


def test_swarmgrad_status_says_which_members_ban_others():
    def member(name: str, bans: int) -> Member:
        return Member(peer_id=f"12D3KooW{name * 20}", maddrs=[], role="peer", version="0", step=0,
                      samples_per_second=0.0, last_seen=0.0, expires=0.0, stats=TrainingStats(bans=bans))

    console = Console(width=200, record=True)
    console.print(_view([member("A", 2), member("B", 0)], "r"))
    text = console.export_text()
    assert "bans: 12D3Ko" in text and "bans 2" in text and text.count(" bans ") == 1
    console.print(_view([member("B", 0)], "r"))
    assert "bans:" not in console.export_text()


def test_a_leader_leaves_out_whom_a_majority_refuses_else_the_members_that_refuse():
    assert left_out("L", {"a": set(), "b": set(), "x": set()}) == set()
    # one honest member banned the liar x: x stays (a majority admits it), the banner sits this round out
    assert left_out("L", {"a": {"x"}, "b": set(), "c": set(), "x": set()}) == {"a"}
    # most members banned it: x is left out, nobody else
    assert left_out("L", {"a": {"x"}, "b": {"x"}, "c": {"x"}, "x": {"a", "b"}}) == {"x"}
    # two of the four others is no majority: x and the two that refuse it sit out (x refuses them too)
    assert left_out("L", {"a": {"x"}, "b": {"x"}, "c": set(), "x": {"a", "b"}}) == {"a", "b", "x"}
    # a liar that refuses honest members loses its own seat only, however many it names
    assert left_out("L", {"a": set(), "b": set(), "x": {"a", "b", "L"}}) == {"x"}
    # half is no majority: of L, a, x, only a refuses x (L counts as admitting it)
    assert left_out("L", {"a": {"x"}, "x": set()}) == {"a"}
    assert left_out("L", {"a": {"x"}, "b": {"x"}, "x": set()}) == {"x"}  # 2 of the 3 others
    assert left_out("L", {}) == set()


def test_an_invitations_peer_lists_are_checked():
    assert peer_ids({}, "group", 4) == set()  # an older leader's invitation names no group
    assert peer_ids({"group": ["a", "b", "a"]}, "group", 4) == {"a", "b"}
    for bad in ("a", [1], ["a"] * 5, [""], ["x" * 129], None):
        with pytest.raises(FrameError, match="'group'"):
            peer_ids({"group": bad}, "group", 4)
