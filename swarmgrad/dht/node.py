"""SwarmNode: one peer's libp2p daemon and DHT node, living in the caller's asyncio loop.

hivemind's ``DHT`` class forks a process per node; we hold ``hivemind.p2p.P2P`` and
``hivemind.dht.node.DHTNode`` directly so a peer has one event loop for everything it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import tempfile
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Iterator

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError

from swarmgrad.dht.addresses import listen_address
from swarmgrad.dht.config import NodeConfig
from swarmgrad.dht.daemon import daemon_class
from swarmgrad.dht.identity import Identity
from swarmgrad.dht.reachability import DialBackServer, ask_dial_back
from swarmgrad.dht.records import BodyT, RecordError, SignedRecord, SignedRecordValidator, open_envelope, seal
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.eventloop import timeout

logger = logging.getLogger(__name__)
DIAL_BACK_SECONDS = 5.0  # one dial-back check: a round trip and one TCP connect by the checker
SHUTDOWN_SECONDS = 10.0  # p2pd exits in well under a second; one that takes longer has hung or died
VERIFIED_RECORDS = 8192  # distinct record copies a node remembers as checked (digests: under 2 MB)
OPENED_RECORDS = 1024  # parsed records a node keeps for its reads (a kilobyte or two each)
# hivemind's caching is for reads that stop at the first copy found; every swarmgrad read is
# latest=True (a whole beam search, which ignores the local cache), so caching only adds work: a
# background re-read of a key after each of our stores under it and before its cached copy expires,
# a push of every fresh result to one more node, and more copies for each search to merge. Measured
# with 16 presence-only peers on 2 cores: 40 -> 28 DHT finds and 5.9% -> 3.7% of a core per peer.
# And its merging of concurrent reads of one key kept an entry for every key ever read; a round reads
# a new key, so each peer grew ~30 MB an hour (issue 38's soak). Our reads of a key are sequential.
DHT_OPTIONS = {"cache_locally": False, "cache_nearest": 0, "reuse_get_requests": False}
LATENCY_SAMPLES = 8  # DHT requests ``SwarmNode.dht_latency`` looks back over
# Addresses of peers this node saw publish them (presence), kept so that a node whose routing table
# emptied (its initial peers died, the others it knew left) can join again through any of them.
KNOWN_ADDRESSES = 64
REJOIN_PEERS = 8  # pinged at once by a re-bootstrap


class _RememberingValidator(RecordValidatorBase):
    """SignedRecordValidator that fully checks each distinct copy of a record once.

    A search hears the same record from every node of its beam that holds a copy (up to a bucket of
    20), so a presence read of N members checked up to 20 x N signatures at 0.15 ms each (Ed25519
    and a base58 peer id): with 16 presence-only peers on 2 cores, 413 checks per peer per second and
    58% of a peer process's CPU (15 checks remembering them); at 32 peers membership no longer
    converged. Identical bytes check identically, except for the time: a copy
    that passed before and still has DHT time left (its DHT expiry is at most its signed one) is
    valid again; any other goes through the full check, which decides as before.

    The records that check opens are kept too (``opened``), so a read hands them out without
    checking each signature a second time: that second check was half of a presence read's CPU.
    """

    def __init__(self, size: int = VERIFIED_RECORDS, opened: int = OPENED_RECORDS):
        self.validator, self.size, self.opened_size = SignedRecordValidator(), size, opened
        self._passed: OrderedDict[bytes, None] = OrderedDict()  # digests of copies that passed, oldest first
        self._opened: OrderedDict[bytes, SignedRecord] = OrderedDict()  # envelope digest -> its record, oldest first

    def opened(self, envelope: bytes) -> SignedRecord | None:
        """The record in ``envelope`` if a full check opened these very bytes and it has not expired
        since (the only part of that check that time changes); None otherwise."""
        record = self._opened.get(_digest(envelope))
        return record if record is not None and record.expires > time.time() else None

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.blake2b(digest_size=20)
        for part in (record.key, record.subkey, record.value, repr(record.expiration_time).encode()):
            digest.update(len(part).to_bytes(4, "big") + part)  # length-prefixed: no two splits hash alike
        seen = digest.digest()
        if seen in self._passed and record.expiration_time > time.time():
            self._passed.move_to_end(seen)
            return True
        checked = self.validator.open(record)
        if checked is None:
            return False
        self._passed[seen] = None
        if len(self._passed) > self.size:
            self._passed.popitem(last=False)
        envelope, opened = checked
        if opened.body is not None:  # a kind this process knows: parsed as a read would parse it
            digest = _digest(envelope)
            self._opened[digest] = opened
            self._opened.move_to_end(digest)
            if len(self._opened) > self.opened_size:
                self._opened.popitem(last=False)
        return True


def _digest(envelope: bytes) -> bytes:
    return hashlib.blake2b(envelope, digest_size=20).digest()


class SwarmNode:
    """A libp2p daemon plus a DHT node that accepts only signed swarmgrad records.

    Use as ``async with SwarmNode(config) as node:``; the daemon is gone when the block exits.
    """

    def __init__(self, config: NodeConfig | None = None, identity: Identity | None = None):
        self.config = config or NodeConfig()
        if identity is None and self.config.identity_path is not None:
            identity = Identity.load_or_create(self.config.identity_path)
        self.identity = identity or Identity.generate()
        self.runtime = None  # the NetworkRuntime that owns this node's transport, at most one
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        # False once a dial-back check (or the config) says nobody can dial us: the daemon then
        # reserves slots on relays, and the DHT runs as a client (others must not route through us)
        self.dialable = self.config.reachability != "private" and not self.config.client_mode
        self._relayed_addresses: dict[str, list[str]] = {}  # peers others reach only through relays
        self._introductions: set[asyncio.Task] = set()  # background connections to relayed peers
        # public for sure: said by the config, or by a dial-back check; a node off loopback with no
        # initial peers is a bootstrap node, public by its purpose
        self._known_public = self.config.reachability == "public" or (
            self.dialable and not self.config.initial_peers and not self.config.on_loopback)
        self._latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # seconds of recent DHT requests
        self._validator = _RememberingValidator()
        self._known: OrderedDict[str, list[str]] = OrderedDict()  # peer id -> addresses it published, newest last
        self.rebootstraps = 0  # times the routing table was empty and was filled again from known members

    @property
    def dht_latency(self) -> float:
        """Seconds the slowest of this node's recent DHT requests took (its bootstrap, stores and
        reads): what a loaded swarm's DHT answers in now; 0 before any."""
        return max(self._latencies, default=0.0)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def __aenter__(self) -> SwarmNode:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    async def start(self) -> None:
        if self.config.client_mode and not self.config.initial_peers:  # checked here: a Peer adds peers late
            raise ConfigError("a client-mode node accepts no connections, so it needs --initial-peers to join")
        self.p2p = await self._start_daemon()
        try:
            if self.dialable and self.config.reachability == "auto" and self._check_reachability():
                dialable = await ask_dial_back(self.p2p, self._initial_peer_ids(), self._listen_port(),
                                               deadline=DIAL_BACK_SECONDS)
                if dialable is False:
                    logger.info("nobody can dial this node (behind a NAT or firewall): restarting p2pd to "
                                "reserve relay slots; the DHT runs as a client")
                    self.dialable = False
                if dialable is not None and self.config.punches_holes:  # p2pd starts again knowing it
                    self._known_public = bool(dialable)
                    await self.p2p.shutdown()
                    self.p2p = await self._start_daemon()
            if self.dialable:
                await DialBackServer(self.p2p, DIAL_BACK_SECONDS / 2).start()
            started = time.monotonic()
            self.dht = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=self.config.initial_peers or None,
                client_mode=self.config.client_mode or not self.dialable,
                record_validator=self._validator,
                wait_timeout=self.config.request_timeout,
                ensure_bootstrap_success=bool(self.config.initial_peers),
                **DHT_OPTIONS,
            )
            self._latencies.append(time.monotonic() - started)
        except BaseException as error:
            await self.p2p.shutdown()
            self.p2p = None
            if isinstance(error, Exception):
                raise StartupError(f"DHT bootstrap through {self._tried()} failed: {error}") from None
            raise
        logger.info("node %s up, listening on %s", self.peer_id, " ".join(self.maddrs) or "nothing (client mode)")

    async def shutdown(self) -> None:
        """Stop the DHT and the daemon; bounded, so a daemon that died (or hangs) cannot hold a peer up."""
        for task in list(self._introductions):
            task.cancel()
        await asyncio.gather(*self._introductions, return_exceptions=True)
        if self.dht is not None:
            try:
                await asyncio.wait_for(self.dht.protocol.shutdown(), timeout=SHUTDOWN_SECONDS)
            except (asyncio.TimeoutError, OSError, ConnectionError) as error:
                logger.warning("DHT did not shut down cleanly (%s); stopping the daemon anyway", type(error).__name__)
            self.dht = None
        if self.p2p is not None:
            try:
                await asyncio.wait_for(self.p2p.shutdown(), timeout=SHUTDOWN_SECONDS)  # waits for p2pd to exit
            except (asyncio.TimeoutError, OSError, ConnectionError) as error:
                logger.warning("p2pd did not stop within %.0f s (%s)", SHUTDOWN_SECONDS, type(error).__name__)
            self.p2p = None

    @property
    def maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) others can dial; empty in client mode. Behind a NAT only
        the relayed ones (``/p2p-circuit``): its own addresses are no use to anyone else."""
        if self.p2p is None or not self.p2p._visible_maddrs:
            return []
        found = [str(address) for address in self.p2p._visible_maddrs]
        if not self.dialable:
            # p2pd's identify lists no relayed address even once it holds a reservation, so the
            # relays it was told to reserve on (its initial peers) are named here
            relays = [f"{relay}/p2p-circuit" for relay in self.config.initial_peers if self.config.use_relay]
            found = list(dict.fromkeys([address for address in found if "/p2p-circuit" in address] + relays))
        return [address if address.endswith(f"/p2p/{self.peer_id}") else f"{address}/p2p/{self.peer_id}"
                for address in found]

    def remember_addresses(self, peer_id: str, maddrs: list[str]) -> None:
        """What a peer published (its presence record): kept if it can be reached only through relays,
        because then p2pd cannot find it by itself; see :meth:`introduce`. Behind a NAT ourselves,
        we connect to such a peer at once, in the background: hole punching then has time to
        upgrade the relayed connection to a direct one before a round needs it (a stream opened on
        a relayed connection stays on it, and hivemind's p2pd resets those after 128 KiB)."""
        if maddrs and peer_id != self.peer_id:
            self._known[peer_id] = list(maddrs)[:8]
            self._known.move_to_end(peer_id)
            while len(self._known) > KNOWN_ADDRESSES:
                self._known.popitem(last=False)
        if maddrs and all("/p2p-circuit" in address for address in maddrs):
            known = peer_id in self._relayed_addresses
            self._relayed_addresses[peer_id] = list(maddrs)[:8]
            if not known and not self.dialable and self.config.punches_holes and peer_id != self.peer_id:
                task = asyncio.get_running_loop().create_task(self.introduce(peer_id))
                self._introductions.add(task)
                task.add_done_callback(self._introductions.discard)
        else:
            self._relayed_addresses.pop(peer_id, None)

    async def introduce(self, peer_id: str) -> None:
        """Before a stream to a relayed peer: connect to it through its relays (a no-op when connected).
        Failures are left to the stream that follows, which then says why."""
        await self._connect_to(peer_id, self._relayed_addresses.get(peer_id), "through its relays")

    async def reconnect(self, peer_id: str) -> bool:
        """After p2pd failed to open a stream to ``peer_id`` (its own DHT lookup can fail under load):
        connect to the addresses its presence record published. True when the connection was made."""
        addresses = self._known.get(peer_id) or self._relayed_addresses.get(peer_id)
        return await self._connect_to(peer_id, addresses, "at its published addresses")

    async def _connect_to(self, peer_id: str, addresses: list[str] | None, how: str) -> bool:
        """Have p2pd connect to ``peer_id`` at ``addresses``; False (logged) when it could not."""
        if not addresses or self.p2p is None or peer_id == self.peer_id:
            return False
        from hivemind.p2p import PeerID

        try:
            async with timeout(self.config.request_timeout):
                await self.p2p._client.connect(PeerID.from_base58(peer_id), [_DaemonAddress(a, peer_id) for a in addresses])
            return True
        except Exception as error:  # noqa: BLE001 - the stream's own error is the one to report
            logger.debug("could not connect to %s %s: %s", peer_id, how, error)
            return False

    @property
    def routing_peers(self) -> int:
        """Peers in this node's DHT routing table now (0: it can reach nobody through the DHT)."""
        return len(self.dht.protocol.routing_table.peer_id_to_uid) if self.dht is not None else 0

    def entry_points(self, count: int = 3) -> list[str]:
        """Up to ``count`` addresses a newcomer may join through: this node's own if others can dial
        it, then those of the members it saw most recently publish direct (not relayed) ones."""
        found = [self.maddrs[0]] if self.dialable and self.maddrs else []
        for addresses in reversed(self._known.values()):
            direct = [address for address in addresses if "/p2p-circuit" not in address]
            if direct and len(found) < count:
                found.append(direct[0])
        return found[:count]

    async def rebootstrap(self) -> int:
        """When the routing table is empty (every initial peer gone, and every peer learnt since),
        join the DHT again through the members this node saw publish addresses: connect to up to
        ``REJOIN_PEERS`` of the most recent and ping them into the table. Returns how many answered
        (0 also when the table was not empty)."""
        if self.dht is None or self.p2p is None or self.routing_peers > 0 or not self._known:
            return 0
        from hivemind.p2p import PeerID

        async def ping(peer_id: str, addresses: list[str]) -> bool:
            if not await self._connect_to(peer_id, addresses, "to re-bootstrap"):
                return False
            try:
                async with timeout(self.config.request_timeout):
                    return await self.dht.protocol.call_ping(PeerID.from_base58(peer_id)) is not None
            except Exception as error:  # noqa: BLE001 - gone too: the next one may answer
                logger.debug("re-bootstrap through %s failed: %s", peer_id, error)
                return False

        candidates = list(self._known.items())[-REJOIN_PEERS:]
        answered = sum(await asyncio.gather(*(ping(peer, addresses) for peer, addresses in candidates)))
        if answered:
            self.rebootstraps += 1
        logger.log(logging.INFO if answered else logging.DEBUG,
                   "the DHT routing table was empty: rejoined through %d of %d known member(s)", answered,
                   len(candidates))
        return answered

    async def refresh_maddrs(self) -> None:
        """Ask the daemon for its current addresses: a NATed node's relayed ones come and go."""
        if self.p2p is not None and not self.dialable and not self.config.client_mode:
            try:
                await asyncio.wait_for(self.p2p.get_visible_maddrs(latest=True), timeout=self.config.request_timeout)
            except (asyncio.TimeoutError, OSError, ConnectionError, P2PDaemonError, ValueError) as error:
                logger.debug("could not refresh this node's addresses: %s", error)

    def _check_reachability(self) -> bool:
        return bool(self.config.initial_peers) and not self.config.on_loopback

    def _initial_peer_ids(self) -> list[str]:
        return list(dict.fromkeys(address.rsplit("/p2p/", 1)[1] for address in self.config.initial_peers
                                  if "/p2p/" in address))

    def _listen_port(self) -> int:
        for address in self.p2p._visible_maddrs if self.p2p else []:
            parts = str(address).split("/")
            if "tcp" in parts:
                return int(parts[parts.index("tcp") + 1])
        return self.config.port

    async def store(self, key: str, body: BodyT, expires: float, *, all_replicas: bool = True,
                    beam_size: int | None = None) -> bool:
        """Sign ``body`` and store it in our own slot of ``key``; False if no DHT node took it in time.

        ``all_replicas=False`` returns once one replica has it (the rest finish in the background):
        for short-lived records that latency matters more for than durability. ``beam_size``: the
        nodes the search for the key's nearest keeps (hivemind's default: a bucket, 20).
        """
        envelope = seal(self.identity, key, body, expires)
        started = time.monotonic()
        beam = {} if beam_size is None else {"beam_size": beam_size}
        try:
            async with timeout(self.config.request_timeout * 2):
                return await self._live_dht().store(
                    key, envelope, expiration_time=expires, subkey=self.peer_id, await_all_replicas=all_replicas, **beam
                )
        except asyncio.TimeoutError:
            logger.warning("storing %s timed out", key)
            return False
        finally:
            self._latencies.append(time.monotonic() - started)

    async def get_records(self, key: str, body_type: type[BodyT], *,
                          beam_size: int | None = None) -> dict[str, SignedRecord[BodyT]]:
        """The latest valid record of each owner under ``key`` (empty if none or on timeout);
        ``beam_size`` as in :meth:`store`."""
        started = time.monotonic()
        beam = {} if beam_size is None else {"beam_size": beam_size}
        try:
            async with timeout(self.config.request_timeout * 2):
                found = await self._live_dht().get(key, latest=True, **beam)
        except asyncio.TimeoutError:
            logger.warning("reading %s timed out", key)
            return {}
        finally:
            self._latencies.append(time.monotonic() - started)
        if found is None or not isinstance(found.value, dict):
            return {}
        records: dict[str, SignedRecord[BodyT]] = {}
        for owner, entry in found.value.items():
            try:
                record = self._validator.opened(entry.value) or open_envelope(entry.value)
            except RecordError as error:  # the DHT validated it, but it may have expired since
                logger.debug("skipping record of %s under %s: %s", owner, key, error)
                continue
            if record.key == key and isinstance(record.body, body_type):
                records[record.owner] = record
        return records

    def _live_dht(self) -> DHTNode:
        if self.dht is None:
            raise RuntimeError("the node is not running; use `async with SwarmNode(...)`")
        return self.dht

    def _tried(self) -> str:
        return ", ".join(self.config.initial_peers)

    async def _start_daemon(self) -> P2P:
        """Start p2pd, retrying while the initial peers are unreachable, up to the bootstrap timeout."""
        config = self.config
        deadline = time.monotonic() + config.bootstrap_timeout
        delay = 0.25
        behind_nat = not self.dialable and not config.client_mode
        relays: dict = {}
        if behind_nat and config.use_relay and config.initial_peers:
            # reserve at once on the initial peers (public by definition: we reached them)
            relays = {"use_auto_relay": True, "trusted_relays": config.initial_peers, "force_reachability": "private"}
        elif self._known_public and config.punches_holes:
            # AutoNAT would find it out later, and go-libp2p then starts a relay service of its own
            # in place of the one holding reservations, which are lost: say so from the start
            relays = {"force_reachability": "public"}
        with _identity_file(self.identity) as identity_path:
            while True:
                try:
                    return await daemon_class(config, serve_relay=self.dialable, static_relays="trusted_relays" in relays).create(
                        initial_peers=config.initial_peers or None,
                        host_maddrs=[str(listen_address(config.host, config.port))],
                        announce_maddrs=config.announce_maddrs or None,
                        identity_path=str(identity_path),
                        no_listen=config.client_mode,
                        dht_mode="client" if config.client_mode or behind_nat else "server",
                        use_relay=config.use_relay,
                        nat_port_map=False,  # no UPnP traffic, ever: peers announce what they are told to
                        auto_nat=config.punches_holes,
                        use_ipfs=False,
                        **({"use_auto_relay": config.use_auto_relay} | relays),
                        check_if_identity_free=False,
                        startup_timeout=max(1.0, min(15.0, deadline - time.monotonic())),
                    )
                except P2PDaemonError as error:
                    message = str(error)
                    if "address already in use" in message:
                        raise ConfigError(
                            f"port {config.port} on {config.host} is in use; "
                            "pick another with --port, or 0 for any free port"
                        ) from None
                    if "failed to connect to bootstrap peers" not in message:
                        raise StartupError(f"the libp2p daemon failed to start: {message}") from None
                if time.monotonic() + delay >= deadline:
                    raise StartupError(
                        f"could not reach any initial peer within {config.bootstrap_timeout:.0f} s "
                        f"(tried {self._tried()}); check the addresses and that a node is running there"
                    )
                logger.info("no initial peer answered yet; retrying in %.1f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)


class _DaemonAddress:
    """A multiaddr in the binary form p2pd reads. hivemind's Multiaddr writes ``/p2p/<id>`` as a CID,
    which p2pd's parser rejects ("length greater than remaining number of bytes"): the peer ids go
    in as bare multihashes here, and the target's own trailing ``/p2p/<id>`` is left out."""

    P2P_CODE, CIRCUIT_CODE = 421, 290

    def __init__(self, text: str, target: str):
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        if text.endswith(f"/p2p/{target}"):
            text = text[: -len(f"/p2p/{target}")]
        head, *rest = text.split("/p2p/")
        encoded = Multiaddr(head).to_bytes()
        for part in rest:
            peer, _, tail = part.partition("/")
            digest = PeerID.from_base58(peer).to_bytes()
            encoded += _varint(self.P2P_CODE) + _varint(len(digest)) + digest
            if tail == "p2p-circuit":
                encoded += _varint(self.CIRCUIT_CODE)
            elif tail:
                raise ValueError(f"unsupported relayed address {text!r}")
        self._bytes = encoded

    def to_bytes(self) -> bytes:
        return self._bytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@contextlib.contextmanager
def _identity_file(identity: Identity) -> Iterator[Path]:
    """The identity as a key file for p2pd, in a private temporary folder removed after start-up."""
    with tempfile.TemporaryDirectory(prefix="swarmgrad-id-") as folder:
        path = Path(folder) / "identity.key"
        identity.save(path)
        yield path
