"""What a node is told: how it listens, whom it contacts first, who it is; and what a run id may be.

Kept apart from node.py so that reading settings (``swarmgrad --help``, config files) does not import
hivemind; the addresses are parsed, with hivemind's multiaddr, only when a NodeConfig is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

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
    bootstrap_timeout: float = pydantic.Field(20.0, gt=0)  # total seconds spent retrying initial peers
    request_timeout: float = pydantic.Field(5.0, gt=0)  # one DHT request (store or get) at most
    data_port: int = pydantic.Field(0, ge=0, le=65535)  # direct TCP for tensors; fixed for firewalls, 0 = any

    @pydantic.model_validator(mode="after")
    def _check(self) -> NodeConfig:
        listen_address(self.host, self.port)
        parse_peer_addresses(self.initial_peers)
        for address in self.announce_maddrs:
            parse_multiaddr(address)
        return self
