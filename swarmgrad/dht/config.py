"""What a node is told: how it listens, whom it contacts first, who it is; and what a run id may be.

Kept apart from node.py so that reading settings (``swarmgrad --help``, config files) does not import
hivemind; the addresses are parsed, with hivemind's multiaddr, only when a NodeConfig is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

import pydantic

from swarmgrad.dht.addresses import listen_address, parse_multiaddr, parse_peer_addresses
from swarmgrad.errors import ConfigError

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run_id


class NodeConfig(pydantic.BaseModel):
    """How a node listens, whom it contacts first, and who it is."""

    model_config = pydantic.ConfigDict(extra="forbid")

    host: str = "127.0.0.1"  # listen here; 0.0.0.0 for a public node
    port: int = pydantic.Field(0, ge=0, le=65535)  # 0 picks a free port
    announce_maddrs: list[str] = []  # addresses to tell others, when behind port forwarding
    initial_peers: list[str] = []  # multiaddrs of any running nodes of the swarm
    identity_path: Optional[Path] = None  # Ed25519 key file; created on first use; same peer id across restarts
    client_mode: bool = False  # no inbound connections: for NATed, edge and monitoring peers
    use_relay: bool = True  # may reach NATed peers through libp2p circuit relays
    use_auto_relay: bool = False  # look for relays to become reachable from behind a NAT
    # "auto": ask an initial peer to dial us back (not on loopback); "private": behind a NAT, say so
    reachability: Literal["auto", "public", "private"] = "auto"
    hole_punching: Optional[bool] = None  # libp2p AutoNAT service + DCUtR; None: on unless on loopback
    relay_reservations: int = pydantic.Field(64, ge=0, le=4096)  # NATed peers this node relays for
    relay_circuits: int = pydantic.Field(16, ge=1, le=1024)  # open relayed connections per peer
    relay_mbytes: float = pydantic.Field(256.0, gt=0)  # per relayed connection and direction, then reset
    relay_seconds: float = pydantic.Field(600.0, gt=0)  # one relayed connection's lifetime at most
    bootstrap_timeout: float = pydantic.Field(20.0, gt=0)  # total seconds spent retrying initial peers
    request_timeout: float = pydantic.Field(5.0, gt=0)  # one DHT request (store or get) at most
    data_port: int = pydantic.Field(0, ge=0, le=65535)  # direct TCP for tensors; fixed for firewalls, 0 = any

    @property
    def on_loopback(self) -> bool:
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    @property
    def punches_holes(self) -> bool:
        """AutoNAT and hole punching: never on loopback (nothing to punch, and no stray dials)."""
        return (not self.on_loopback) if self.hole_punching is None else self.hole_punching

    @pydantic.model_validator(mode="after")
    def _check(self) -> NodeConfig:
        listen_address(self.host, self.port)
        parse_peer_addresses(self.initial_peers)
        for address in self.announce_maddrs:
            parse_multiaddr(address)
        return self
