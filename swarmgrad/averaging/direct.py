"""The direct data plane: tensor traffic over plain TCP between peers, set up through libp2p.

libp2p stays the control plane. To open a channel to peer B, peer A sends B, over an ordinary
libp2p stream (authenticated to B's peer id and encrypted by libp2p), a fresh 256-bit session key
and a one-time connection token. B answers with its data addresses. A connects over TCP, presents
the token, and from then on every frame is AES-256-GCM sealed with that key (``secure.py``). A
connection with no valid token is closed before it can reach any handler; B learns A's identity
from the libp2p stream that registered the token, never from the TCP connection.

When B cannot be reached directly (nothing listening, a firewall, a NAT) A falls back to a libp2p
stream and remembers that choice for ``remember_seconds``. Plaintext frames happen only when both
sides opted in with ``trusted_network=True``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from swarmgrad.averaging.framestream import FastChannel
from swarmgrad.averaging.secure import KEY_BYTES, EncryptedChannel, FrameCipher
from swarmgrad.averaging.transport import Channel, ChannelHandler, Libp2pTransport, Transport
from swarmgrad.averaging.wire import FrameError, expect_kind, field
from swarmgrad.runtime import timeout

logger = logging.getLogger(__name__)

CONTROL_PROTOCOL = "swarmgrad/direct/1"
TOKEN_BYTES = 32
TOKEN_SECONDS = 10.0  # a token must be used this soon after it was issued
CONTROL_SECONDS = 5.0


@dataclass
class _PendingConnection:
    peer_id: str
    protocol: str
    key: bytes
    plain: bool
    expires: float


class DirectTransport(Transport):
    """Direct TCP channels where reachable, libp2p streams otherwise; same Channel interface."""

    def __init__(
        self,
        libp2p: Libp2pTransport,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_hosts: list[str] | None = None,
        trusted_network: bool = False,
        connect_timeout: float = 2.0,
        remember_seconds: float = 60.0,
    ):
        self.libp2p, self.host, self.port = libp2p, host, port
        self.advertise_hosts = advertise_hosts or [host]
        self.trusted_network, self.connect_timeout, self.remember_seconds = trusted_network, connect_timeout, remember_seconds
        self.name = "direct-plain" if trusted_network else "direct"
        self._handlers: dict[str, ChannelHandler] = {}
        self._pending: dict[bytes, _PendingConnection] = {}
        self._libp2p_only_until: dict[str, float] = {}  # peers we could not reach directly, remembered
        self._server: asyncio.Server | None = None
        self.addresses: list[tuple[str, int]] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.addresses = [(host, port) for host in self.advertise_hosts[:4]]
        await self.libp2p.serve(CONTROL_PROTOCOL, self._on_control)
        if self.trusted_network:
            logger.warning("direct data plane on %s:%d sends tensors UNENCRYPTED (trusted_network=True)", self.host, port)
        else:
            logger.info("direct data plane on %s:%d (AES-256-GCM)", self.host, port)

    async def stop(self) -> None:
        await self.libp2p.stop_serving(CONTROL_PROTOCOL)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def serve(self, protocol: str, handler: ChannelHandler) -> None:
        self._handlers[protocol] = handler
        await self.libp2p.serve(protocol, handler)  # the fallback path reaches the same handler

    async def stop_serving(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        await self.libp2p.stop_serving(protocol)

    # ---- opening side ---------------------------------------------------------------------------

    async def open(self, peer_id: str, protocol: str) -> Channel:
        if self._libp2p_only_until.get(peer_id, 0.0) > time.monotonic():
            return await self.libp2p.open(peer_id, protocol)
        try:
            return await self._open_direct(peer_id, protocol)
        except FrameError:
            raise  # the peer answered but broke the protocol: not a reachability problem
        except Exception as error:
            logger.info("no direct connection to %s (%s: %s); using libp2p", peer_id, type(error).__name__, error)
            self._libp2p_only_until[peer_id] = time.monotonic() + self.remember_seconds
            return await self.libp2p.open(peer_id, protocol)

    async def _open_direct(self, peer_id: str, protocol: str) -> Channel:
        key, token = secrets.token_bytes(KEY_BYTES), secrets.token_bytes(TOKEN_BYTES)
        control = await self.libp2p.open(peer_id, CONTROL_PROTOCOL)
        try:
            async with timeout(CONTROL_SECONDS):
                await control.send({"t": "direct", "protocol": protocol, "key": key, "token": token,
                                    "plain": self.trusted_network})
                reply = expect_kind(await control.recv(max_payload=0), "direct-ok")
        finally:
            await control.close()
        addresses = field(reply.header, "addresses", list)
        plain = self.trusted_network and field(reply.header, "plain", bool)
        for address in addresses[:4]:
            if not (isinstance(address, list) and len(address) == 2 and isinstance(address[0], str)
                    and isinstance(address[1], int) and 0 < address[1] < 65536):
                raise FrameError(f"bad data address {address!r:.80}")
        last_error: Exception = ConnectionError("the peer advertised no data address")
        for host, port in addresses[:4]:
            try:
                async with timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(host, port)
            except (OSError, asyncio.TimeoutError, TimeoutError) as error:
                last_error = error
                continue
            writer.write(token)
            name = "direct-plain" if plain else "direct"
            if plain:
                return FastChannel.take_over(peer_id, reader, writer, name)
            channel = EncryptedChannel.take_over(peer_id, reader, writer, name)
            channel.cipher = FrameCipher(key, sending=0)
            return channel
        raise last_error

    # ---- accepting side -------------------------------------------------------------------------

    async def _on_control(self, control: Channel) -> None:
        """A peer asks for a direct connection: remember its key and token, tell it where to connect."""
        async with timeout(CONTROL_SECONDS):
            request = expect_kind(await control.recv(max_payload=0), "direct")
        protocol = field(request.header, "protocol", str)
        key, token = field(request.header, "key", bytes), field(request.header, "token", bytes)
        plain = field(request.header, "plain", bool) and self.trusted_network  # both must opt in
        if len(key) != KEY_BYTES or len(token) != TOKEN_BYTES or protocol not in self._handlers or not self.addresses:
            await control.send_error("direct connection refused: bad key/token, unknown protocol or no listener")
            return
        now = time.monotonic()
        self._pending = {t: p for t, p in self._pending.items() if p.expires > now}  # drop stale tokens
        self._pending[token] = _PendingConnection(control.peer_id, protocol, key, plain, now + TOKEN_SECONDS)
        await control.send({"t": "direct-ok", "addresses": [list(a) for a in self.addresses], "plain": plain})

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with timeout(CONTROL_SECONDS):
                token = await reader.readexactly(TOKEN_BYTES)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError, OSError):
            writer.close()
            return
        pending = self._pending.pop(token, None)
        if pending is None or pending.expires < time.monotonic() or pending.protocol not in self._handlers:
            logger.info("closed a direct connection from %s: no valid token", writer.get_extra_info("peername"))
            writer.close()
            return
        name = "direct-plain" if pending.plain else "direct"
        if pending.plain:
            channel: Channel = FastChannel.take_over(pending.peer_id, reader, writer, name)
        else:
            channel = EncryptedChannel.take_over(pending.peer_id, reader, writer, name)
            channel.cipher = FrameCipher(pending.key, sending=1)
        try:
            await self._handlers[pending.protocol](channel)
        except FrameError as error:
            logger.info("bad frame from %s on %s: %s", pending.peer_id, pending.protocol, error)
            await channel.send_error(str(error))
        except Exception as error:  # one peer's connection must never take the node down
            logger.info("direct connection from %s failed: %s: %s", pending.peer_id, type(error).__name__, error)
        finally:
            await channel.close()
