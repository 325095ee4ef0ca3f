"""Reachability, without a lab: who can be dialled, who leads and owns, how NATed peers are grouped,
the dial-back check's rules, and the relayed addresses handed to p2pd. The lab tests
(test_lab_nat*.py) run the same with real routers."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from swarmgrad.averaging.grid import grid_order, grid_sides, hub_groups, slices_reach_everyone
from swarmgrad.averaging.matchmaking import leader_of
from swarmgrad.console import members_table
from swarmgrad.dht.config import NodeConfig
from swarmgrad.dht.membership import Member, reachability
from swarmgrad.dht.node import _DaemonAddress
from swarmgrad.dht.reachability import DialBackServer

RELAY = "12D3KooWGpcnr2b2rHTCFiyaFepMS9dnSDYJG3ecGDooUBeXXU9w"
TARGET = "12D3KooWEgvzpzjMHiYPsqf2aPGoou5TFU1fnGqVaKVGrQhuAnSt"


def test_reachability_is_read_from_the_published_addresses():
    assert reachability([]) == "client"
    assert reachability([f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}"]) == "relayed"
    assert reachability(["/ip4/1.2.3.4/tcp/1", f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit"]) == "public"


def test_status_table_shows_how_each_member_is_reached():
    members = [Member(peer, maddrs, "peer", "0", 0, 0.0, time.time(), time.time() + 9, paused=paused)
               for peer, maddrs, paused in [("a" * 52, ["/ip4/1.2.3.4/tcp/1"], False),
                                            ("b" * 52, [f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit"], True),
                                            ("c" * 52, [], False)]]
    console = Console(width=200, record=True)
    console.print(members_table(members))
    text = console.export_text()
    assert "public" in text and "relayed (paused)" in text and "client" in text


def test_hub_groups_give_every_group_a_dialable_leader_and_change_every_round():
    peers = [f"p{i}" for i in range(8)]
    public = {"p1", "p6"}
    for salt in ("r1", "r2"):
        groups = hub_groups(grid_order(peers, salt), public, group_size=4)
        assert sorted(sum(groups, [])) == sorted(peers) and len(groups) == 2
        assert all(leader_of(group, frozenset(peers) - public) in public for group in groups)
        assert all(len(set(group) & public) == 1 for group in groups)  # one hub each
    first, second = (hub_groups(grid_order(peers, salt), public, 4) for salt in ("r1", "r2"))
    assert {frozenset(g) for g in first} != {frozenset(g) for g in second}  # the swarm still mixes
    # fewer dialable peers than groups: fewer, larger groups; none: no group at all
    assert [len(g) for g in hub_groups(peers, {"p3"}, 4)] == [8]
    assert hub_groups(peers, set(), 4) == []


def test_the_grid_is_kept_only_while_every_slice_has_a_dialable_member():
    peers = [f"p{i}" for i in range(4)]
    sides = grid_sides(4, 2)  # 2 x 2
    assert slices_reach_everyone(peers, set(peers), 0, sides)
    # a diagonal of public peers covers every slice in both dimensions; a row does not
    assert slices_reach_everyone(peers, {"p0", "p3"}, 0, sides) and slices_reach_everyone(peers, {"p0", "p3"}, 1, sides)
    assert not slices_reach_everyone(peers, {"p0", "p1"}, 0, sides)  # p2 and p3 share a slice along 0


def test_a_natted_member_leads_only_a_group_with_nobody_dialable():
    assert leader_of(["n1", "p1", "n2"], frozenset({"n1", "n2"})) == "p1"
    assert leader_of(["n1", "n2"], frozenset({"n1", "n2"})) == "n1"
    assert leader_of(["n1", "p1"], frozenset()) == "n1"  # none known behind a NAT: the hash order, as before


def test_relayed_addresses_reach_p2pd_with_bare_peer_ids():
    from hivemind.p2p import PeerID

    encoded = _DaemonAddress(f"/ip4/10.77.0.1/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}", TARGET).to_bytes()
    relay = PeerID.from_base58(RELAY).to_bytes()
    # ip4 10.77.0.1, tcp 31337, p2p <multihash, not a CID>, p2p-circuit; the target's own id left out
    assert encoded == bytes.fromhex("040a4d0001067a69") + b"\xa5\x03" + bytes([len(relay)]) + relay + b"\xa2\x02"
    with pytest.raises(ValueError, match="unsupported"):
        _DaemonAddress(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/ws", TARGET)


def test_hole_punching_is_off_on_loopback_and_on_elsewhere_unless_told():
    assert not NodeConfig().punches_holes
    assert NodeConfig(host="10.77.0.2").punches_holes
    assert not NodeConfig(host="10.77.0.2", hole_punching=False).punches_holes
    with pytest.raises(Exception, match="reachability"):
        NodeConfig(reachability="maybe")


def test_dial_back_dials_only_the_askers_address_and_at_most_once_per_interval():
    async def scenario() -> None:
        accepted = []
        server = await asyncio.start_server(lambda r, w: (accepted.append(1), w.close()), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        checker = DialBackServer(SimpleNamespace(), connect_timeout=1.0)
        ask = json.dumps({"port": port}).encode()
        assert await checker._check("a", f"/ip4/127.0.0.1/tcp/{port}", ask) == "reachable"
        assert await checker._check("a", f"/ip4/127.0.0.1/tcp/{port}", ask) == "busy"  # once per interval
        assert await checker._check("b", f"/ip4/127.0.0.1/tcp/{port + 1 if port < 65535 else 1}",
                                    json.dumps({"port": port + 1 if port < 65535 else 1}).encode()) == "unreachable"
        assert await checker._check("c", f"/p2p/{RELAY}/p2p-circuit", ask) == "unknown"  # relayed: nothing to dial
        assert await checker._check("d", "/ip4/127.0.0.1/tcp/1", b"{not json") == "bad-request"
        assert await checker._check("e", "/ip4/127.0.0.1/tcp/1", b'{"port": 70000}') == "unknown"
        assert len(accepted) == 1
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
