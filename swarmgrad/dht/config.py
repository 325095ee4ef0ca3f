"""What a node is told: how it listens, whom it contacts first, who it is; and what a run id may be.

Kept apart from node.py so that reading settings (``swarmgrad --help``, config files) does not import
hivemind; the addresses are parsed, with hivemind's multiaddr, only when a NodeConfig is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

import pydantic
from pydantic import Field

from swarmgrad.dht.addresses import listen_address, parse_multiaddr, parse_peer_addresses
from swarmgrad.errors import ConfigError
from swarmgrad.settings import SettingsModel, flag

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

    host: str = Field("127.0.0.1", description="Listen address; 0.0.0.0 to accept peers from other machines.")
    port: int = Field(0, ge=0, le=65535, description="TCP port to listen on; 0 picks a free one.")
    announce_maddrs: list[str] = Field(
        [], description="Address to advertise instead of the listen address (port forwarding).",
        json_schema_extra=flag("announce") | {"metavar": "MADDR"})
    initial_peers: list[str] = Field(
        [], description="Multiaddr of a running node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; repeat the flag or "
        "separate with commas.", json_schema_extra=flag("initial-peers", "-p") | {"metavar": "MADDR"})
    identity_path: Optional[Path] = Field(
        None, description="Ed25519 key file (created if missing), so the node keeps its peer id across restarts.",
        json_schema_extra=flag("identity", "-i"))
    client_mode: bool = Field(False, description="Dial out only: no inbound connections (behind NAT, no port open; "
                              "edge and monitoring peers).")
    use_relay: bool = Field(True, description="Reach NATed peers through libp2p circuit relays.")
    use_auto_relay: bool = Field(False, description="Look for relays to become reachable from behind a NAT.")
    reachability: Literal["auto", "public", "private"] = Field(
        "auto", description="auto: ask an initial peer to dial this node back (not on loopback); private: behind a "
        "NAT, say so; public: skip the check.")
    hole_punching: Optional[bool] = Field(None, description="libp2p AutoNAT service and DCUtR hole punching "
                                          "(default: on unless on loopback).")
    relay_reservations: int = Field(64, ge=0, le=4096, description="NATed peers this node relays for.")
    relay_circuits: int = Field(16, ge=1, le=1024, description="Open relayed connections per peer.")
    relay_mbytes: float = Field(256.0, gt=0, description="MB per relayed connection and direction, then it is reset.")
    relay_seconds: float = Field(600.0, gt=0, description="Lifetime of one relayed connection at most, in seconds.")
    bootstrap_timeout: float = Field(20.0, gt=0, description="Seconds spent retrying the initial peers in all.")
    request_timeout: float = Field(5.0, gt=0, description="Seconds one DHT request (store or get) may take at most.")
    data_port: int = Field(0, ge=0, le=65535, description="TCP port for direct tensor traffic (0: any free one); "
                           "open it in firewalls.")

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


class BootstrapConfig(SettingsModel):
    """What ``swarmgrad bootstrap`` is told: its node, and the run it lists itself in."""

    run_id: Optional[str] = Field(None, description="Also list this node as a member of the run.",
                                  json_schema_extra=flag("run-id", "-r"))
    network: NodeConfig = NodeConfig()

    @pydantic.field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else check_run_id(value)
