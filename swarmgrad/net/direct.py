"""The direct data plane: tensor traffic over plain TCP between peers, set up through libp2p.

libp2p stays the control plane. To open a channel to peer B, peer A sends B, over an ordinary
libp2p stream (authenticated to B's peer id and encrypted by libp2p), a fresh 256-bit session key
and a one-time connection token. B answers with its data addresses. A connects over TCP, presents
the token, and from then on every frame is AES-256-GCM sealed with that key (``secure.py``). A
connection with no valid token is closed before it can reach any handler; B learns A's identity
from the libp2p stream that registered the token, never from the TCP connection.

When B knows nobody can dial it (behind a NAT: ``dialable=False``) and A offered its own data
addresses, B connects *back* to A instead and presents the token there: the connection a NATed
peer opened itself carries the tensors, and nothing bulk goes through a relay. When neither works
(nothing listening, a firewall, both behind NATs) A falls back to a libp2p stream and remembers
that choice for ``remember_seconds``. Plaintext frames happen only when both
sides opted in with ``trusted_network=True``.

One connection per peer pair is reused across rounds: each exchange on it starts with an ``open``
frame naming the protocol and ends with B's ``end`` frame; a connection that ended cleanly goes
back to A's pool, one that did not is closed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from swarmgrad.dht.node import SwarmNode
from swarmgrad.eventloop import timeout
from swarmgrad.net.admission import REFUSALS, Admission
from swarmgrad.net.channel import Channel, ChannelHandler
from swarmgrad.net.framestream import FastChannel
from swarmgrad.net.ratelimit import UNLIMITED, RateLimits
from swarmgrad.net.secure import KEY_BYTES, EncryptedChannel, FrameCipher
from swarmgrad.net.transport import Libp2pTransport, Transport
from swarmgrad.net.wire import FrameError, RemoteError, expect_kind, field
from swarmgrad.timing import DEFAULT_TIMING, Timing

logger = logging.getLogger(__name__)

CONTROL_PROTOCOL = "swarmgrad/direct/1"
TOKEN_BYTES = 32
POOL_IDLE_SECONDS = 60.0  # the opener reuses an idle connection this long...
SERVER_IDLE_SECONDS = 2 * POOL_IDLE_SECONDS  # ...and the other side keeps it open longer, so reuse never races a close
POOL_PER_PEER = 8
END_WAIT_SECONDS = 5.0  # the other side says ``end`` right after its handler returns: milliseconds


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
        connect_timeout: float = DEFAULT_TIMING.connect_timeout,
        control_timeout: float = DEFAULT_TIMING.control_timeout,
        remember_seconds: float = 60.0,  # an unreachable peer's NAT or firewall does not change by the second
        limits: RateLimits = UNLIMITED,
        dialable: bool = True,
    ):
        self.libp2p, self.host, self.port = libp2p, host, port
        # the setup of every direct connection is a libp2p stream, which libp2p's admission checks;
        # each exchange on a pooled connection asks again (a ticket expires, a ban comes later)
        self.admission = libp2p.admission
        self.dialable = dialable  # False: others cannot connect here, so this side connects back
        self.advertise_hosts = advertise_hosts or [host]
        self.trusted_network, self.connect_timeout, self.remember_seconds = trusted_network, connect_timeout, remember_seconds
        self.control_timeout = control_timeout
        self.limits = limits  # the peer's caps, shared with the libp2p fallback's channels
        # a token must be used this soon after it was issued: the answer to the setup, then up to
        # four addresses tried in turn (both ends use the same Timing)
        self.token_seconds = 2 * control_timeout + 4 * connect_timeout
        self.name = "direct-plain" if trusted_network else "direct"
        self._handlers: dict[str, ChannelHandler] = {}
        self._pending: dict[bytes, _PendingConnection] = {}
        self._awaiting_back: dict[bytes, asyncio.Future] = {}  # tokens of connections asked to come back
        self._tasks: set[asyncio.Task] = set()  # connections this side opened back, being served
        self._libp2p_only_until: dict[str, float] = {}  # peers we could not reach directly, remembered
        self._idle: dict[str, list[tuple[float, FastChannel]]] = {}  # per peer: (idle since, connection)
        self._connections: set[FastChannel] = set()
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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in list(self._connections):
            await channel.abort()
        self._idle.clear()
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
        while (channel := self._take_idle(peer_id)) is not None:
            try:
                return await self._lease(channel, protocol)
            except Exception:  # went stale while idle: try the next one, or a fresh connection
                await channel.abort()
        try:
            return await self._lease(await self._connect(peer_id, protocol), protocol)
        except FrameError:
            raise  # the peer answered but broke the protocol: not a reachability problem
        except RemoteError as error:
            if str(error).startswith(REFUSALS):
                raise  # reachable, but it does not admit us (yet, or bans us): libp2p would be refused the same
            logger.info("no direct connection to %s (%s); using libp2p", peer_id, error)
            self._libp2p_only_until[peer_id] = time.monotonic() + self.remember_seconds
            return await self.libp2p.open(peer_id, protocol)
        except Exception as error:
            logger.info("no direct connection to %s (%s: %s); using libp2p", peer_id, type(error).__name__, error)
            self._libp2p_only_until[peer_id] = time.monotonic() + self.remember_seconds
            return await self.libp2p.open(peer_id, protocol)

    def _take_idle(self, peer_id: str) -> FastChannel | None:
        pool = self._idle.get(peer_id, [])
        while pool:
            since, channel = pool.pop()
            if channel.idle and time.monotonic() - since < POOL_IDLE_SECONDS:
                return channel
            self._forget(channel)
        return None

    async def _lease(self, channel: FastChannel, protocol: str) -> FastChannel:
        channel.reset_counters()
        channel.on_close = self._return_to_pool
        await channel.send({"t": "open", "protocol": protocol})
        return channel

    async def _return_to_pool(self, channel: FastChannel) -> None:
        """A clean end: the other side says ``end`` once its handler finished; then keep the link."""
        try:
            if channel.idle:
                async with timeout(END_WAIT_SECONDS):
                    header, _ = await channel.recv_header(max_payload=0)
                pool = self._idle.setdefault(channel.peer_id, [])
                if header["t"] == "end" and channel.idle and len(pool) < POOL_PER_PEER:
                    pool.append((time.monotonic(), channel))
                    return
        except Exception:  # anything unexpected: this connection is not reused
            pass
        await channel.abort()
        self._forget(channel)

    def _forget(self, channel: FastChannel) -> None:
        self._connections.discard(channel)
        if not channel.aborted:
            channel.aborted = True
            channel._transport.close()

    async def _connect(self, peer_id: str, protocol: str) -> FastChannel:
        key, token = secrets.token_bytes(KEY_BYTES), secrets.token_bytes(TOKEN_BYTES)
        request = {"t": "direct", "protocol": protocol, "key": key, "token": token, "plain": self.trusted_network}
        back = None
        if self.dialable and self.addresses:  # a peer behind a NAT may connect back to us
            request["back"] = [list(address) for address in self.addresses]
            back = self._awaiting_back[token] = asyncio.get_running_loop().create_future()
        try:
            control = await self.libp2p.open(peer_id, CONTROL_PROTOCOL)
            try:
                async with timeout(self.control_timeout):
                    await control.send(request)
                    reply = await control.recv(max_payload=0)
            finally:
                await control.close()
            plain = self.trusted_network and field(reply.header, "plain", bool)
            if reply.kind == "direct-back" and back is not None:
                async with timeout(self.control_timeout + self.connect_timeout):
                    reader, writer = await back
                return self._channel(peer_id, reader, writer, key, plain, sending=0)
            reply = expect_kind(reply, "direct-ok")
        finally:
            self._awaiting_back.pop(token, None)
        addresses = _addresses(field(reply.header, "addresses", list))
        last_error: Exception = ConnectionError("the peer advertised no data address")
        for host, port in addresses:
            try:
                async with timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(host, port)
            except (OSError, asyncio.TimeoutError, TimeoutError) as error:
                last_error = error
                continue
            writer.write(token)
            return self._channel(peer_id, reader, writer, key, plain, sending=0)
        raise last_error

    def _channel(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                 plain: bool, sending: int) -> FastChannel:
        """A connection's channel: sealed with the session key (each side sends with its own nonces)."""
        name = "direct-plain" if plain else "direct"
        if plain:
            channel = FastChannel.take_over(peer_id, reader, writer, name)
        else:
            channel = EncryptedChannel.take_over(peer_id, reader, writer, name)
            channel.cipher = FrameCipher(key, sending=sending)
        channel.limit(self.limits)
        self._connections.add(channel)
        return channel

    def _background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_back(self, peer_id: str, back: list, token: bytes, key: bytes, plain: bool) -> None:
        """Behind a NAT: open the connection the asker offered, present its token, serve it from here."""
        for host, port in _addresses(back):
            try:
                async with timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(host, port)
            except (OSError, asyncio.TimeoutError, TimeoutError):
                continue
            writer.write(token)
            channel = self._channel(peer_id, reader, writer, key, plain, sending=1)
            try:
                await self._serve_connection(channel)
            finally:
                self._forget(channel)
            return
        logger.info("could not connect back to %s at any of its data addresses", peer_id)

    # ---- accepting side -------------------------------------------------------------------------

    async def _on_control(self, control: Channel) -> None:
        """A peer asks for a direct connection: remember its key and token, tell it where to connect."""
        async with timeout(self.control_timeout):
            request = expect_kind(await control.recv(max_payload=0), "direct")
        protocol = field(request.header, "protocol", str)
        key, token = field(request.header, "key", bytes), field(request.header, "token", bytes)
        plain = field(request.header, "plain", bool) and self.trusted_network  # both must opt in
        if len(key) != KEY_BYTES or len(token) != TOKEN_BYTES or protocol not in self._handlers or not self.addresses:
            await control.send_error("direct connection refused: bad key/token, unknown protocol or no listener")
            return
        back = request.header.get("back")
        if not self.dialable and isinstance(back, list) and _addresses(back):
            await control.send({"t": "direct-back", "plain": plain})
            self._background(self._connect_back(control.peer_id, back, token, key, plain))
            return
        now = time.monotonic()
        self._pending = {t: p for t, p in self._pending.items() if p.expires > now}  # drop stale tokens
        self._pending[token] = _PendingConnection(control.peer_id, protocol, key, plain, now + self.token_seconds)
        await control.send({"t": "direct-ok", "addresses": [list(a) for a in self.addresses], "plain": plain})

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with timeout(self.control_timeout):
                token = await reader.readexactly(TOKEN_BYTES)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError, OSError):
            writer.close()
            return
        back = self._awaiting_back.get(token)
        if back is not None and not back.done():  # a peer behind a NAT connecting back, as we asked
            back.set_result((reader, writer))
            return
        pending = self._pending.pop(token, None)
        if pending is None or pending.expires < time.monotonic() or pending.protocol not in self._handlers:
            logger.info("closed a direct connection from %s: no valid token", writer.get_extra_info("peername"))
            writer.close()
            return
        channel = self._channel(pending.peer_id, reader, writer, pending.key, pending.plain, sending=1)
        try:
            await self._serve_connection(channel)
        finally:
            self._forget(channel)

    async def _serve_connection(self, channel: FastChannel) -> None:
        """Serve exchanges on one authenticated connection until it idles out or misbehaves."""

        async def keep_open(_channel: FastChannel) -> None:
            """Handlers close channels when done; the connection outlives them."""

        channel.on_close = keep_open
        while True:
            try:
                async with timeout(SERVER_IDLE_SECONDS):
                    header, _ = await channel.recv_header(max_payload=0)
            except Exception:  # idle too long, closed by the peer, or garbage: done with this link
                return
            protocol = header.get("protocol")
            handler = self._handlers.get(protocol) if header["t"] == "open" and isinstance(protocol, str) else None
            if handler is None:
                await channel.send_error(f"expected an 'open' frame for a served protocol, got {header['t']!r}")
                return
            if self.admission is not None and not self.admission.admits(channel.peer_id):
                self.admission.refuse_stream(channel.peer_id)
                await channel.refuse(self.admission.refusal(channel.peer_id))
                return
            channel.reset_counters()
            try:
                await handler(channel)
            except FrameError as error:
                logger.info("bad frame from %s on %s: %s", channel.peer_id, protocol, error)
                if self.admission is not None:  # counts toward a ban (accountability.py)
                    self.admission.blame(channel.peer_id, "invalid frame", str(error))
                await channel.send_error(str(error))
                return
            except Exception as error:  # one peer's exchange must never take the node down
                logger.info("direct exchange with %s on %s failed: %s: %s", channel.peer_id, protocol,
                            type(error).__name__, error)
                return
            if not channel.idle:  # aborted, or stopped in the middle of a frame
                return
            await channel.send({"t": "end"})


def _addresses(value: list) -> list[tuple[str, int]]:
    """Up to four (host, port) pairs from a frame; FrameError for anything else."""
    found = []
    for address in value[:4]:
        if not (isinstance(address, list) and len(address) == 2 and isinstance(address[0], str)
                and isinstance(address[1], int) and 0 < address[1] < 65536):
            raise FrameError(f"bad data address {address!r:.80}")
        found.append((address[0], address[1]))
    return found


def default_transport(node: SwarmNode, direct: bool = True, trusted_network: bool = False,
                      timing: Timing = DEFAULT_TIMING, limits: RateLimits = UNLIMITED,
                      admission: Admission | None = None) -> Transport:
    """What a peer's runtime uses unless told otherwise: direct TCP where reachable, libp2p otherwise.
    ``limits``: the peer's upload and download caps, one bucket each for every channel of both.
    ``admission``: who may open streams here (None: anyone)."""
    libp2p = Libp2pTransport(node.p2p, limits, introduce=node.introduce, admission=admission, reconnect=node.reconnect)
    if not direct:
        return libp2p
    return DirectTransport(libp2p, host=node.config.host, port=node.config.data_port,
                           advertise_hosts=_data_hosts(node), trusted_network=trusted_network,
                           connect_timeout=timing.connect_timeout, control_timeout=timing.control_timeout,
                           limits=limits, dialable=node.dialable)


def _data_hosts(node: SwarmNode) -> list[str]:
    """Hosts to offer direct connections on: the node's own listen host, or, when it listens on
    every interface, the addresses it announces on libp2p (announced ones first)."""
    if node.config.host not in ("0.0.0.0", "::"):
        return [node.config.host]
    hosts: list[str] = []
    for address in [*node.config.announce_maddrs, *node.maddrs]:
        parts = address.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in hosts and parts[2] not in ("0.0.0.0", "::"):
            hosts.append(parts[2])
    return hosts or ["127.0.0.1"]
