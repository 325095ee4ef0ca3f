"""Upload/download caps: the token bucket (fake clock), and paced channels over real loopback TCP."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarmgrad.errors import ConfigError
from swarmgrad.eventloop import run
from swarmgrad.net.framestream import FastChannel
from swarmgrad.net.ratelimit import (
    CHUNK_BYTES,
    MIN_BURST_BYTES,
    RateLimits,
    TokenBucket,
    check_limit_mbps,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def bucket(rate: float = 1000.0, burst: float | None = 500.0) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    return TokenBucket(rate, burst, clock=clock, sleep=clock.sleep), clock


# -- the bucket ----------------------------------------------------------------------------------


def test_full_bucket_passes_a_burst_then_charges_the_rest_at_the_rate():
    limiter, clock = bucket()
    assert limiter.charge(500) == 0.0  # starts full
    assert limiter.charge(250) == pytest.approx(0.25)  # 250 bytes of debt at 1000 B/s
    clock.now += 0.25
    assert limiter.tokens == pytest.approx(0.0)


def test_refill_never_exceeds_the_burst():
    limiter, clock = bucket()
    limiter.charge(500)
    clock.now += 60.0  # idle for a minute: still only one burst ahead
    assert limiter.tokens == pytest.approx(500.0)
    assert limiter.charge(600) == pytest.approx(0.1)


def test_take_sleeps_exactly_off_the_debt():
    limiter, clock = bucket()
    run(limiter.take(500))
    assert clock.slept == []
    run(limiter.take(2000))
    assert clock.slept == [pytest.approx(2.0)]
    assert limiter.total == 2500


def test_concurrent_takers_share_the_rate():
    """Callers arriving together queue behind each other's debt: the long-run rate is the cap."""
    clock = FakeClock()
    done: list[float] = []

    async def sleep(seconds: float) -> None:  # real concurrency, fake time: each wakes at its own deadline
        wake = clock.now + seconds
        clock.slept.append(seconds)
        await asyncio.sleep(seconds / 1000)
        done.append(wake)

    limiter = TokenBucket(1000.0, 100.0, clock=clock, sleep=sleep)

    async def main() -> None:
        await asyncio.gather(*(limiter.take(1000) for _ in range(5)))

    run(main())
    # 5000 bytes, 100 ahead: the last one may go at 4.9 s, and each waits 1 s longer than the one before
    assert sorted(clock.slept) == [pytest.approx(0.9 + i) for i in range(5)]
    assert max(done) == pytest.approx(100.0 + 4.9)


def test_default_burst_is_a_twentieth_of_a_second_but_at_least_64_kib():
    assert TokenBucket(1e6).burst == MIN_BURST_BYTES
    assert TokenBucket(1e8).burst == pytest.approx(5e6)
    assert TokenBucket.from_mbps(8).rate == pytest.approx(1e6)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "8", 2e6])
def test_bad_limits_are_one_clear_error(bad):
    with pytest.raises(ConfigError, match="upload_limit_mbps must be a positive number of Mbit/s"):
        RateLimits.from_mbps(upload_mbps=bad)
    with pytest.raises(ConfigError, match="download_limit_mbps"):
        check_limit_mbps(bad, "download_limit_mbps")


def test_no_limit_is_no_bucket():
    limits = RateLimits.from_mbps(None, 4)
    assert limits.upload is None and limits.download is not None and limits.any
    assert not RateLimits.from_mbps().any
    with pytest.raises(ValueError):
        TokenBucket(0)


# -- paced channels on loopback TCP --------------------------------------------------------------


async def channel_pair(sender_limits: RateLimits, receiver_limits: RateLimits) -> tuple[FastChannel, FastChannel, asyncio.Server]:
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(FastChannel.take_over("sender", reader, writer, "test").limit(receiver_limits))

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    sender = FastChannel.take_over("receiver", reader, writer, "test").limit(sender_limits)
    return sender, await accepted, server


async def transfer(sender_limits: RateLimits, receiver_limits: RateLimits, frames: int, frame_bytes: int) -> float:
    """Send ``frames`` frames of ``frame_bytes``; seconds until the receiver has them all."""
    sender, receiver, server = await channel_pair(sender_limits, receiver_limits)
    payload = bytes(frame_bytes)

    async def send_all() -> None:
        for index in range(frames):
            await sender.send({"t": "x", "i": index}, payload)

    async def receive_all() -> None:
        target = bytearray(frame_bytes)
        for index in range(frames):
            header, length = await receiver.recv_header()
            assert header["i"] == index and length == frame_bytes
            await receiver.recv_payload_into(memoryview(target))

    started = time.monotonic()
    await asyncio.gather(send_all(), receive_all())
    elapsed = time.monotonic() - started
    await sender.abort()
    await receiver.abort()
    server.close()
    return elapsed


MEGABYTES = 3
RATE_MBPS = 16  # 2 MB/s: 3 MB take 1.5 s


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_capped_channel_moves_bytes_at_the_cap(direction):
    limits = RateLimits.from_mbps(RATE_MBPS, None) if direction == "upload" else RateLimits.from_mbps(None, RATE_MBPS)
    sender, receiver = (limits, RateLimits()) if direction == "upload" else (RateLimits(), limits)
    elapsed = run(transfer(sender, receiver, frames=MEGABYTES, frame_bytes=1 << 20))
    bucket = limits.upload or limits.download
    expected = (MEGABYTES * (1 << 20) - bucket.burst) / bucket.rate
    assert bucket.total >= MEGABYTES * (1 << 20)
    # on loopback an uncapped channel moves 3 MB in milliseconds; the cap makes it take the budget's time
    assert expected * 0.95 <= elapsed <= expected * 1.25, (elapsed, expected)


def test_an_uncapped_channel_is_not_paced():
    assert run(transfer(RateLimits(), RateLimits(), frames=MEGABYTES, frame_bytes=1 << 20)) < 0.5


def test_a_paced_send_cut_off_mid_frame_leaves_the_channel_unusable():
    """A cancelled round (a peer pausing) must not hand a half-written stream to the next exchange."""

    async def main() -> tuple[bool, bool]:
        sender, receiver, server = await channel_pair(RateLimits.from_mbps(1, None), RateLimits())
        idle_before = sender.idle
        task = asyncio.create_task(sender.send({"t": "x"}, bytes(8 * CHUNK_BYTES)))  # 4 s at 1 Mbit/s
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        idle_after = sender.idle
        await sender.abort()
        await receiver.abort()
        server.close()
        return idle_before, idle_after

    assert run(main()) == (True, False)
