"""A round's deadline from its bytes and the rates measured (timing.py ``RoundTimer``, issue 35):
the rule itself, without peers. tests/peer/test_round_deadline.py runs it between real peers."""

from __future__ import annotations

import pytest

from swarmgrad.timing import MAX_STRETCH, Timing

MB = 1_000_000


def test_before_any_round_the_deadline_is_the_bytes_at_the_assumed_rate_or_the_first_rounds_least():
    timing = Timing(assumed_rate_mbps=2.0)  # 0.25 MB/s
    timer = timing.round_timer()
    assert timer.next_deadline is None  # no round asked about yet
    assert timer.deadline(21 * MB) == pytest.approx(4 * 84.0)  # 21 MB at 0.25 MB/s: 84 s, 4x slack
    assert timer.deadline(1000) == timing.first_round_deadline  # a small round still sets up its connections
    assert timer.assumed_rate == 0.25 * MB and timer.next_deadline == timing.first_round_deadline


def test_a_cap_on_this_peers_link_bounds_the_assumed_rate():
    timing = Timing(assumed_rate_mbps=100.0)
    assert timing.assumed_rate() == 12.5 * MB
    assert timing.assumed_rate(None, 2 * MB) == 2 * MB  # the slower cap where set
    assert timing.assumed_rate(1 * MB, None) == 1 * MB
    assert timing.round_timer(None, 1 * MB, None).deadline(20 * MB) == pytest.approx(4 * 20.0)


def test_a_successful_round_teaches_the_rate_and_later_deadlines_follow_it():
    timing = Timing(min_round_deadline=5.0)
    timer = timing.round_timer()
    timer.observe(10 * MB, 2.0)  # 5 MB/s
    assert timer.rate == 5 * MB
    assert timer.deadline(10 * MB) == pytest.approx(4 * 2.0)
    assert timer.deadline(1000) == 5.0  # after a success the shortest deadline is min_round_deadline
    timer.observe(10 * MB, 10.0)  # 1 MB/s, smoothed: 0.7 x 5 + 0.3 x 1
    assert timer.rate == pytest.approx(3.8 * MB)
    assert timer.deadline(38 * MB) == pytest.approx(4 * 10.0)


def test_a_round_that_timed_out_doubles_the_next_deadline_until_one_succeeds():
    timer = Timing(assumed_rate_mbps=2.0).round_timer()
    first = timer.deadline(21 * MB)
    why = timer.missed(21 * MB)
    assert why == "21.0 MB at an assumed 2.00 Mbit/s takes 84 s; next deadline 672 s"
    assert timer.deadline(21 * MB) == pytest.approx(2 * first) and timer.next_deadline == pytest.approx(2 * first)
    for _ in range(10):
        timer.missed(21 * MB)
    assert timer.deadline(21 * MB) == pytest.approx(MAX_STRETCH * first)  # a hung groupmate holds it only so long
    timer.observe(21 * MB, 400.0)  # it got through, slower than assumed: that rate now sizes deadlines
    assert timer.deadline(21 * MB) == pytest.approx(4 * 400.0)


def test_no_constant_caps_a_big_models_deadline():
    """A 1B-parameter model's 1 GB round at 100 Mbit/s takes 80 s; before any round at the assumed
    rate it gets hours (the old rule capped every deadline at 600 s), after one 4 x 80 s."""
    timer = Timing().round_timer()
    assert timer.deadline(1000 * MB) == pytest.approx(4 * 4000.0)
    timer.observe(1000 * MB, 80.0)
    assert timer.deadline(1000 * MB) == pytest.approx(320.0)
    assert timer.deadline(10_000 * MB) == pytest.approx(3200.0)


def test_round_timeout_fixes_every_deadline():
    timer = Timing().round_timer(30.0)
    assert timer.deadline(1000 * MB) == 30.0
    assert timer.missed(1000 * MB) == "1000.0 MB; Moshpit.round_timeout fixes the deadline"
    timer.observe(10 * MB, 1.0)
    assert timer.deadline(1000 * MB) == 30.0 and timer.deadline(1) == 30.0
