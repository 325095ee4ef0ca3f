"""Upload and download caps: one token bucket per direction per peer, shared by all its channels.

A volunteer on a home uplink or a phone on a metered link says how much of it the swarm may use
(``upload_limit_mbps`` / ``download_limit_mbps``). Every data-plane channel of the peer (direct TCP,
encrypted or not, and the libp2p fallback streams) charges the bytes it writes to the peer's upload
bucket and the bytes it reads to its download bucket, so averaging, gossip and state transfer
together stay under the cap. The DHT's own traffic (small records, in p2pd) is not counted.

Sends wait for budget before they write (``await bucket.take(n)``). Receives charge what arrived
and stop reading the socket while the bucket is in debt (``charge(n)`` says for how long): the
kernel's receive window fills, and TCP slows the sender down.

Burst: a full bucket holds ``max(MIN_BURST_BYTES, BURST_SECONDS of the rate)``, enough that small
control frames pass at once and small enough that any stretch of a second or more stays within a
few percent of the cap. Channels write in pieces of at most ``CHUNK_BYTES``, so one large frame is
paced too rather than sent as one burst.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from swarmgrad.errors import ConfigError

DEFAULT_LIMIT_MBPS: float | None = None  # unlimited: the one default of both caps
BURST_SECONDS = 0.05
MIN_BURST_BYTES = 64 * 1024
CHUNK_BYTES = 64 * 1024  # a paced channel writes (and reads) at most this much per budget check
MAX_LIMIT_MBPS = 1e6  # 1 Tbit/s: anything above is a typo, not a cap


def check_limit_mbps(value: float | None, name: str) -> float | None:
    """``value`` if it is None or a positive, finite rate in Mbit/s; else one clear ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_LIMIT_MBPS:
        raise ConfigError(f"{name} must be a positive number of Mbit/s (at most {MAX_LIMIT_MBPS:g}) or None "
                         f"for no limit, got {value!r}")
    return float(value)


class TokenBucket:
    """``rate`` bytes per second, at most ``burst`` bytes ahead; starts full.

    The balance may go negative: a caller pays for its bytes at once and then waits until the
    debt is repaid, so callers that arrive together are served in turn and the long-run rate is
    exactly ``rate``. ``clock`` and ``sleep`` are swappable for tests.
    """

    def __init__(self, rate: float, burst: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"a token bucket needs a positive finite rate, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(MIN_BURST_BYTES, BURST_SECONDS * self.rate)
        if not self.burst > 0:
            raise ValueError(f"a token bucket needs a positive burst, got {burst!r}")
        self._clock, self._sleep = clock, sleep
        self._tokens = self.burst
        self._updated = clock()
        self.total = 0  # bytes charged so far

    @classmethod
    def from_mbps(cls, mbps: float, **kwargs) -> TokenBucket:
        return cls(mbps * 1e6 / 8, **kwargs)

    @property
    def tokens(self) -> float:
        """The balance now (negative: in debt)."""
        self._refill()
        return self._tokens

    def charge(self, n: int) -> float:
        """Pay for ``n`` bytes now; returns the seconds until the balance is back to zero (0: none owed)."""
        self._refill()
        self._tokens -= n
        self.total += n
        return max(0.0, -self._tokens / self.rate)

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes fit the budget (pay, then sleep off any debt)."""
        delay = self.charge(n)
        if delay > 0:
            await self._sleep(delay)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now


@dataclass(frozen=True)
class RateLimits:
    """A peer's two buckets (None: that direction is unlimited); what its transports hand to channels."""

    upload: TokenBucket | None = None
    download: TokenBucket | None = None

    @classmethod
    def from_mbps(cls, upload_mbps: float | None = DEFAULT_LIMIT_MBPS,
                  download_mbps: float | None = DEFAULT_LIMIT_MBPS) -> RateLimits:
        upload_mbps = check_limit_mbps(upload_mbps, "upload_limit_mbps")
        download_mbps = check_limit_mbps(download_mbps, "download_limit_mbps")
        return cls(TokenBucket.from_mbps(upload_mbps) if upload_mbps is not None else None,
                   TokenBucket.from_mbps(download_mbps) if download_mbps is not None else None)

    @property
    def any(self) -> bool:
        return self.upload is not None or self.download is not None


UNLIMITED = RateLimits()
