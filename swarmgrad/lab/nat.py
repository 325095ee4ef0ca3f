"""NAT routers in front of lab peers: the home router, the symmetric NAT and carrier-grade NAT.

A peer with ``nat != "none"`` runs in namespace ``<prefix>-<i>`` on a private LAN; between it and the
lab's wire stand one or two router namespaces, and the outermost one holds the peer's ``lab0`` tun
with its public lab address (so its access link, rates, delay and loss, is the router's uplink, as
at home):

* ``home``: ``<prefix>-<i>-nat`` masquerades the LAN (172.16.0.0/12, one /24 per peer) behind the
  public address. Linux keeps a flow's source port where it can, so one inside port maps to one
  outside port whatever the destination (endpoint-independent mapping): hole punching can work.
* ``symmetric``: the same router with ``MASQUERADE --random-fully``: a fresh random outside port for
  every new flow (endpoint-dependent mapping), so the port a peer observed is useless to anyone
  else: hole punching cannot work, relays can.
* ``cgnat``: two layers. The home router ``<prefix>-<i>-nat`` masquerades the LAN onto the
  carrier's network (100.64.0.0/10, RFC 6598), and the carrier's router ``<prefix>-<i>-cgn``
  masquerades that onto the public address; both map endpoint-independently, as RFC 6888 requires
  of a CGN.

Every router forwards what its inside sends, and lets in from outside only packets of flows the
inside opened (conntrack ESTABLISHED/RELATED): nothing inbound is ever forwarded on its own, and
nothing is port-forwarded. Every private LAN is distinct, so a peer's private address is an
address nobody else can reach, as on the internet (no other namespace has a route to it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal, get_args

NatType = Literal["none", "home", "symmetric", "cgnat"]
NAT_TYPES: tuple[str, ...] = get_args(NatType)
LAN_IF, WAN_IF = "lan0", "wan0"  # a router's inside and (for the inner router of two) outside veth
HOME_ROUTER, CARRIER_ROUTER = "nat", "cgn"


@dataclass(frozen=True)
class Router:
    """One NAT router: its namespace suffix, inside address (the LAN's gateway), outside interface."""

    suffix: str
    inside: str  # "a.b.c.1" on the LAN it serves (a /24)
    outside_if: str  # the tun (outermost) or the veth towards the next router
    outside_address: str | None  # its address on the next router's LAN (None: the tun's lab address)
    gateway: str | None  # the next router's inside address (None: the outermost, on the lab's wire)
    random_ports: bool


def lan_address(i: int, host: int) -> str:
    """Host ``host`` on peer ``i``'s home LAN: 172.(16 + i // 256).(i % 256).host."""
    return f"172.{16 + i // 256}.{i % 256}.{host}"


def carrier_address(i: int, host: int) -> str:
    """Host ``host`` on peer ``i``'s carrier network: 100.(64 + i // 256).(i % 256).host."""
    return f"100.{64 + i // 256}.{i % 256}.{host}"


def routers(i: int, nat: str, tun: str) -> list[Router]:
    """Peer ``i``'s routers, inside first; the last holds the tun. Empty for ``nat="none"``."""
    if nat == "none":
        return []
    if nat in ("home", "symmetric"):
        return [Router(HOME_ROUTER, lan_address(i, 1), tun, None, None, random_ports=nat == "symmetric")]
    if nat == "cgnat":
        return [Router(HOME_ROUTER, lan_address(i, 1), WAN_IF, carrier_address(i, 2), carrier_address(i, 1), False),
                Router(CARRIER_ROUTER, carrier_address(i, 1), tun, None, None, False)]
    raise ValueError(f"unknown NAT type {nat!r}; one of {', '.join(NAT_TYPES)}")


def peer_address(i: int, nat: str) -> str | None:
    """Where a NATed peer's processes bind (its LAN address); None without NAT (the lab address)."""
    return None if nat == "none" else lan_address(i, 2)


def router_namespaces(prefix: str, i: int, nat: str) -> list[str]:
    return [f"{prefix}-{i}-{router.suffix}" for router in routers(i, nat, "")]


def peer_lines(i: int) -> list[str]:
    """``ip -batch`` lines for the peer's own namespace: its LAN address and default route."""
    return [f"addr add {lan_address(i, 2)}/24 dev {LAN_IF}", f"link set {LAN_IF} up",
            f"route add default via {lan_address(i, 1)}"]


def router_lines(router: Router) -> list[str]:
    """``ip -batch`` lines for a router: its inside address, and its outside one unless that is the tun."""
    lines = [f"addr add {router.inside}/24 dev {LAN_IF}", f"link set {LAN_IF} up"]
    if router.outside_address is not None:
        lines += [f"addr add {router.outside_address}/24 dev {router.outside_if}", f"link set {router.outside_if} up",
                  f"route add default via {router.gateway}"]
    return lines


def router_rules(router: Router, loss_rules: list[str]) -> str:
    """The router's iptables-restore script: masquerade outward, let in only established flows.

    ``loss_rules`` (``-A FORWARD ...`` lines from the network) go before the accept, so the access
    link's loss applies to forwarded packets as it would to delivered ones."""
    out = router.outside_if
    masquerade = f"-A POSTROUTING -o {out} -j MASQUERADE" + (" --random-fully" if router.random_ports else "")
    filters = [
        *loss_rules,
        f"-A FORWARD -i {out} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A FORWARD -i {out} -j DROP",
        f"-A INPUT -i {out} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A INPUT -i {out} -j DROP",
    ]
    return "*nat\n" + masquerade + "\nCOMMIT\n*filter\n" + "\n".join(filters) + "\nCOMMIT\n"


def enable_forwarding_argv() -> list[str]:
    """Run inside a router's namespace: turn on IPv4 forwarding (``/proc/sys/net`` is per namespace;
    the interpreter is the one tool certain to be there)."""
    return [sys.executable, "-c", "open('/proc/sys/net/ipv4/ip_forward', 'w').write('1')"]


__all__ = ["NAT_TYPES", "NatType", "Router", "carrier_address", "lan_address", "peer_address", "router_namespaces", "routers"]
