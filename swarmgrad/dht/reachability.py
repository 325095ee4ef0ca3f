"""Can others dial this node? A dial-back check, asked of the peers a node starts with.

A node behind a NAT connects out fine, so nothing it sees tells it that nobody can connect in.
It asks a public node it is connected to (an initial peer) to dial it back: the asker names only its
listen *port*; the checker takes the *address* from the libp2p connection the request came over (the
asker's outside address, its NAT router's) and opens one plain TCP connection to that address and
port, then closes it. A connection that opens means the asker is dialable: ``public``. One that
times out or is refused means a router stands in the way.

Safety: a checker dials only the address the request came from (so it cannot be sent at a third
party), at most one check per asker per :data:`CHECK_EVERY` seconds and :data:`MAX_CONCURRENT`
at once; a request over a relayed connection (no address to dial) is answered ``unknown``.
hivemind's p2pd has AutoNAT, but its verdict is not readable over the daemon's API and it needs
several servers and a quarter of a minute; this check needs one peer and one round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from hivemind.p2p import P2P, PeerID

from swarmgrad.eventloop import timeout

logger = logging.getLogger(__name__)

PROTOCOL = "/swarmgrad/dialback/1"
CHECK_EVERY = 30.0  # seconds between two checks for the same asker
MAX_CONCURRENT = 8
MAX_REQUEST = 256  # bytes


class DialBackServer:
    """Answers dial-back requests on one node; registered by public nodes only."""

    def __init__(self, p2p: P2P, connect_timeout: float):
        self.p2p, self.connect_timeout = p2p, connect_timeout
        self._last: dict[str, float] = {}
        self._running = 0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._handle)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with timeout(2 * self.connect_timeout + 1.0):
                line = await reader.readline()
                answer = await self._check(str(info.peer_id), str(info.addr), line[:MAX_REQUEST])
                writer.write(json.dumps({"result": answer}).encode() + b"\n")
                await writer.drain()
        except (asyncio.TimeoutError, OSError, ConnectionError) as error:
            logger.debug("dial-back request from %s ended: %s", info.peer_id, error)
        finally:
            writer.close()

    async def _check(self, asker: str, address: str, request: bytes) -> str:
        try:
            port = json.loads(request)["port"]
        except (ValueError, KeyError, TypeError):
            return "bad-request"
        host = _ip_of(address)
        if not (isinstance(port, int) and 0 < port < 65536) or host is None:
            return "unknown"  # a bad port, or a relayed connection: no address to dial
        now = time.monotonic()
        self._last = {peer: t for peer, t in self._last.items() if now - t < CHECK_EVERY}
        if asker in self._last or self._running >= MAX_CONCURRENT:
            return "busy"
        self._last[asker] = now
        self._running += 1
        try:
            async with timeout(self.connect_timeout):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return "reachable"
        except (OSError, asyncio.TimeoutError):
            return "unreachable"
        finally:
            self._running -= 1


async def ask_dial_back(p2p: P2P, peers: list[str], port: int, deadline: float) -> bool | None:
    """True if a checker could dial us, False if one tried and could not; None if none answered.

    ``peers`` are peer ids to ask, in order; the first definite answer counts."""
    for peer in peers:
        try:
            async with timeout(deadline):
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL)
                try:
                    writer.write(json.dumps({"port": port}).encode() + b"\n")
                    await writer.drain()
                    answer = json.loads((await reader.readline())[:MAX_REQUEST] or b"{}").get("result")
                finally:
                    writer.close()
        except Exception as error:  # an old node, a relayed one, or gone: ask the next
            logger.debug("dial-back check by %s failed: %s: %s", peer, type(error).__name__, error)
            continue
        if answer in ("reachable", "unreachable"):
            logger.info("dial-back check by %s: %s", peer, answer)
            return answer == "reachable"
    return None


def _ip_of(maddr: str) -> str | None:
    parts = maddr.split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    return parts[2]


__all__ = ["PROTOCOL", "DialBackServer", "ask_dial_back"]
