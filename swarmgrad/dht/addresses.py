"""Parsing and checking libp2p multiaddrs given by users (flags, config, records)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from swarmgrad.errors import ConfigError

if TYPE_CHECKING:
    from hivemind.utils.multiaddr import Multiaddr

EXAMPLE_PEER_ADDRESS = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
_TRANSPORTS = ("tcp", "udp")


def parse_multiaddr(text: str) -> Multiaddr:
    from hivemind.utils.multiaddr import Multiaddr  # hivemind loads in about a second: only when parsing

    try:
        return Multiaddr(text.strip())
    except Exception as error:
        raise ConfigError(f"malformed multiaddr {text!r} ({error}); expected e.g. {EXAMPLE_PEER_ADDRESS}") from None


def parse_peer_address(text: str) -> Multiaddr:
    """A multiaddr that names both where a peer listens and who it is (ends with /p2p/<peer id>)."""
    address = parse_multiaddr(text)
    protocols = {protocol.name for protocol in address.protocols()}
    if "p2p" not in protocols:
        raise ConfigError(f"multiaddr {text!r} has no /p2p/<peer id> part; expected e.g. {EXAMPLE_PEER_ADDRESS}")
    if not protocols & set(_TRANSPORTS) and "p2p-circuit" not in protocols:
        raise ConfigError(f"multiaddr {text!r} names no tcp or udp port; expected e.g. {EXAMPLE_PEER_ADDRESS}")
    return address


def parse_peer_addresses(texts: Iterable[str]) -> list[Multiaddr]:
    return [parse_peer_address(text) for text in texts]


def listen_address(host: str, port: int) -> Multiaddr:
    """The multiaddr to listen on for a host (IPv4/IPv6 literal) and TCP port (0 picks a free one)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is out of range 0..65535")
    family = "ip6" if ":" in host else "ip4"
    return parse_multiaddr(f"/{family}/{host}/tcp/{port}")
