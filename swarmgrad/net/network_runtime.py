"""One network runtime per peer: the node, one transport, one presence record.

    async with NetworkRuntime("my-run", NodeConfig(initial_peers=[...])) as runtime:
        async with Averager(runtime, [tensor], name="delta") as averager:
            ...

Everything that talks to other peers shares what the runtime owns: averagers and gossip register
their protocols on its transport (direct TCP with the libp2p fallback), so any number of them can
run on one node (the state server too: state/server.py); and the peer's membership and training
progress travel in one presence record with one TTL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from swarmgrad.dht.membership import Member, Membership, Role, _read_listing, check_run_id
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.dht.tickets import Ticket
from swarmgrad.net.accountability import DEFAULT_ACCOUNTABILITY, Accountability
from swarmgrad.net.admission import DEFAULT_LOOKUP_INTERVAL, Admission
from swarmgrad.net.direct import default_transport
from swarmgrad.net.ratelimit import DEFAULT_LIMIT_MBPS, RateLimits
from swarmgrad.net.transport import Transport
from swarmgrad.timing import DEFAULT_TIMING, Timing

logger = logging.getLogger(__name__)


class NetworkRuntime:
    """Owns a peer's networking for the length of an ``async with`` block.

    ``node``: an already started SwarmNode to use (the caller keeps it); otherwise one is started
    from ``network``. ``direct=False`` keeps tensors on libp2p streams; ``trusted_network=True``
    sends them unencrypted on the direct plane (both ends must opt in). ``before_publish`` fills in
    what each presence heartbeat announces (the peer layer's progress). ``upload_limit_mbps`` /
    ``download_limit_mbps`` cap the data plane (every channel of this peer together; None: no cap).
    ``ticket``: this peer's membership ticket of a private run: the runtime then admits only peers
    with a ticket of the same run key (``admission``: their records, their streams) and announces its own.
    ``accountability``: when a misbehaving peer is banned here (its streams refused, its records ignored),
    in every run, public or private.
    """

    def __init__(self, run_id: str, network: NodeConfig | None = None, *, node: SwarmNode | None = None,
                 role: Role | None = None, direct: bool = True, trusted_network: bool = False,
                 timing: Timing = DEFAULT_TIMING, before_publish: Callable[[Membership], None] | None = None,
                 upload_limit_mbps: float | None = DEFAULT_LIMIT_MBPS, download_limit_mbps: float | None = DEFAULT_LIMIT_MBPS,
                 ticket: Ticket | None = None, accountability: Accountability = DEFAULT_ACCOUNTABILITY):
        self.run_id = check_run_id(run_id)
        self.ticket = ticket
        # one answer to "who may talk to me" for the presence listing and every served stream; in a
        # public run it refuses only banned peers (a dict lookup for everyone else)
        self.admission = Admission(self.run_id, ticket.run_key if ticket is not None else None,
                                   lookup_interval=min(timing.presence_refresh, DEFAULT_LOOKUP_INTERVAL),
                                   accountability=accountability)
        self.admission.lookup = self._look_up_members
        self.limits = RateLimits.from_mbps(upload_limit_mbps, download_limit_mbps)
        self.timing = timing
        self._owns_node = node is None
        self.node = node if node is not None else SwarmNode(network or NodeConfig())
        self.role: Role = role or ("client" if self.node.config.client_mode else "peer")
        self.direct, self.trusted_network = direct, trusted_network
        self.transport: Transport | None = None
        self.presence = Membership(self.node, self.run_id, role=self.role, ttl=timing.presence_ttl,
                                   refresh=timing.presence_refresh, watch=True,
                                   members_per_read=timing.members_per_read, before_publish=before_publish,
                                   admit=self.admission.admit_record,
                                   ticket=ticket.to_json() if ticket is not None else None)
        self._entered: list[tuple[str, Callable]] = []

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    def members(self) -> list[Member]:
        """The run's live members as of the last presence refresh (this peer included)."""
        return self.presence.members

    def can_reach(self, peer_id: str) -> bool:
        """Whether a connection with ``peer_id`` can be made for bulk data: one of the two must be
        dialable (a peer behind a NAT connects back to a dialable one, direct.py); between two
        NATed peers there is only a relay, which hivemind's p2pd caps at 128 KiB a connection."""
        if self.node.dialable:
            return True
        return any(m.peer_id == peer_id and m.reachability == "public" for m in self.presence.members)

    def reachable_first(self, peers: list[str]) -> list[str]:
        """``peers`` this peer can reach for bulk data, or all of them when it can reach none."""
        return [peer for peer in peers if self.can_reach(peer)] or list(peers)

    async def __aenter__(self) -> NetworkRuntime:
        try:
            if self._owns_node:
                await self.node.start()
                self._entered.append(("node", self.node.shutdown))
            elif self.node.p2p is None:
                raise RuntimeError("start the SwarmNode before the NetworkRuntime that uses it")
            if self.node.runtime is not None:
                # a second transport would take over the first's direct-connection protocol
                raise RuntimeError("this node already has a NetworkRuntime: share it (any number of "
                                   "averagers can use one runtime)")
            self.node.runtime = self
            self._entered.append(("node's runtime", self._release_node))
            if self.ticket is not None:  # before anything is served or announced
                self.ticket.check(self.ticket.run_key, self.run_id, self.peer_id)
            self.admission.admit_self(self.peer_id)
            self.transport = default_transport(self.node, self.direct, self.trusted_network, self.timing, self.limits,
                                               self.admission)
            await self.transport.start()
            self._entered.append(("transport", self.transport.stop))
            await self.presence.__aenter__()
            self._entered.append(("presence", lambda: self.presence.__aexit__(None, None, None)))
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _look_up_members(self) -> None:
        """Read the run's member records for the admission (a stream came from a peer not listed yet)."""
        await _read_listing(self.node, self.run_id, self.admission.admit_record)

    async def _release_node(self) -> None:
        self.node.runtime = None

    async def __aexit__(self, *exc_info) -> None:
        """Leave in reverse order; each part gets a deadline, so one that hangs (a groupmate that is
        leaving too, a daemon that died) cannot keep the peer from leaving."""
        while self._entered:
            name, close = self._entered.pop()
            try:
                await asyncio.wait_for(close(), self.timing.close_part)
            except asyncio.TimeoutError:
                logger.warning("while leaving: the %s did not close within %.0f s", name, self.timing.close_part)
            except Exception as error:  # keep closing the rest
                logger.debug("while leaving: the %s: %s: %s", name, type(error).__name__, error)
