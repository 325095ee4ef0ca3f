"""Run membership on a real swarm: real p2pd daemons and DHT nodes on loopback."""

import asyncio
import time
from contextlib import AsyncExitStack
from types import SimpleNamespace

import msgpack
import pytest
from conftest import eventually, p2pd_pids, run_async
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID

from swarmgrad.dht import Identity, Membership, NodeConfig, SwarmNode, SyncNode, list_members
from swarmgrad.dht.membership import FIRST_FAST_READS, PRESENCE_BEAM, MemberRecord, Progress, members_key
from swarmgrad.dht.records import seal
from swarmgrad.errors import ConfigError
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.timing import Timing

RUN = "test-run"


async def member_ids(node: SwarmNode, run_id: str = RUN) -> set[str]:
    return {member.peer_id for member in await list_members(node, run_id)}


def test_six_nodes_see_all_members_within_ten_seconds():
    async def scenario():
        started = time.monotonic()
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            others = await asyncio.gather(
                *(stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs))) for _ in range(5))
            )
            nodes = [first, *others]
            for node in nodes:
                await stack.enter_async_context(Membership(node, RUN, ttl=10))
            everyone = {node.peer_id for node in nodes}

            async def all_see_everyone() -> bool:
                views = await asyncio.gather(*(member_ids(node) for node in nodes))
                return all(view == everyone for view in views)

            await eventually(all_see_everyone, seconds=10 - (time.monotonic() - started))
            members = await list_members(nodes[3], RUN)
            assert {member.maddrs[0] for member in members} == {node.maddrs[0] for node in nodes}
            assert all(member.role == "peer" and member.version for member in members)

    run_async(scenario())


def test_graceful_leave_is_immediate_and_sigkill_expires_within_ttl(member_processes):
    ttl = 4.0

    async def scenario():
        async with SwarmNode() as observer, Membership(observer, RUN, ttl=ttl):
            leaver, victim = await asyncio.gather(
                member_processes(RUN, observer.maddrs, ttl=ttl), member_processes(RUN, observer.maddrs, ttl=ttl)
            )

            async def both_listed():
                return {leaver.peer_id, victim.peer_id} <= await member_ids(observer)

            await eventually(both_listed, seconds=10)

            assert await leaver.stop() == 0  # SIGTERM: graceful leave
            assert leaver.peer_id not in await member_ids(observer)

            victim.kill()
            killed_at = time.monotonic()

            async def victim_gone():
                return victim.peer_id not in await member_ids(observer)

            await eventually(victim_gone, seconds=ttl + 3)
            assert time.monotonic() - killed_at <= ttl + 3
            assert observer.peer_id in await member_ids(observer)

    run_async(scenario())


def test_presence_carries_progress_and_watchers_reread_it_on_their_beat():
    """One record per peer with membership and progress: a watching member rereads everyone's on
    its refresh, ``publish_soon`` announces at once, and a leave drops out of the next listing."""
    with pytest.raises(ConfigError, match="refresh"):
        Membership(SwarmNode(), RUN, ttl=6, refresh=6)
    refresh = 0.5

    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            epoch = 0

            def fill(membership: Membership) -> None:  # what the peer layer does before each heartbeat
                membership.update(progress=Progress(epoch=epoch, samples=10 * epoch, steps=epoch, steps_per_second=2.0))

            publisher = await stack.enter_async_context(
                Membership(first, RUN, ttl=6, refresh=refresh, watch=True, before_publish=fill))
            watcher = await stack.enter_async_context(Membership(second, RUN, ttl=6, refresh=refresh, watch=True))

            async def progress_seen(want: int) -> bool:
                listed = {member.peer_id: member for member in watcher.members}
                return first.peer_id in listed and listed[first.peer_id].progress is not None \
                    and listed[first.peer_id].progress.epoch == want

            async def both_see_both() -> bool:
                return all({m.peer_id for m in ms.members} == {first.peer_id, second.peer_id}
                           for ms in (publisher, watcher))

            await eventually(both_see_both, seconds=5)  # no list_members call: the beat reread it
            await eventually(lambda: progress_seen(0), seconds=5)
            epoch = 3
            publisher.publish_soon()  # announced now, read by the watcher on its next beat
            took = await eventually(lambda: progress_seen(3), seconds=5, interval=0.05)
            assert took < 3 * refresh + 1.0, took
            [listed] = [m for m in watcher.members if m.peer_id == first.peer_id]
            assert listed.to_json()["progress"] == {"epoch": 3, "samples": 30, "steps": 3, "steps_per_second": 2.0,
                                                    "averaging": False, "settings": ""}
            assert [m.progress for m in publisher.members if m.peer_id == second.peer_id] == [None]
            await publisher.__aexit__(None, None, None)  # a graceful leave

            async def gone() -> bool:
                return [m.peer_id for m in watcher.members] == [second.peer_id]

            await eventually(gone, seconds=3 * refresh + 1.0)

    run_async(scenario())


def test_runtime_presence_is_one_record_per_peer_and_lists_the_run():
    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            client = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs,
                                                                          client_mode=True)))
            timing = Timing(presence_refresh=0.5)
            runtimes = [await stack.enter_async_context(NetworkRuntime(RUN, node=node, timing=timing))
                        for node in (first, second, client)]
            assert runtimes[0].presence.ttl == timing.presence_ttl == 6.0 and runtimes[2].role == "client"

            async def everyone_listed() -> bool:
                return all(len(runtime.members()) == 3 for runtime in runtimes)

            await eventually(everyone_listed, seconds=5)
            roles = {member.peer_id: member.role for member in runtimes[0].members()}
            assert roles == {first.peer_id: "peer", second.peer_id: "peer", client.peer_id: "client"}
            assert {m.peer_id for m in await list_members(first, RUN)} == set(roles)  # one record each in the DHT
            assert 0 < second.dht_latency < 5  # its bootstrap, stores and reads were timed

    run_async(scenario())


def test_forged_malformed_and_oversized_records_are_rejected_and_node_keeps_serving():
    async def scenario():
        async with SwarmNode() as victim, Membership(victim, RUN, ttl=30):
            # the attacker is a raw hivemind DHT node without our validator, talking straight to the victim
            attacker_p2p = await P2P.create(initial_peers=victim.maddrs, nat_port_map=False, auto_nat=False)
            attacker = await DHTNode.create(p2p=attacker_p2p, initial_peers=victim.maddrs)
            try:
                key = members_key(RUN)
                key_id = DHTID.generate(source=key)
                expires = time.time() + 30
                victim_id = PeerID.from_base58(victim.peer_id)
                body = MemberRecord(maddrs=[], role="peer", version="evil", step=0, samples_per_second=0.0,
                                    updated_at=time.time())
                forger = Identity.generate()
                forged = seal(forger, key, body, expires)  # valid signature, but filed in the victim's slot
                fields = msgpack.unpackb(seal(victim.identity, key, body, expires))
                fields["body"] = msgpack.packb(body.model_copy(update={"step": 7}).model_dump())
                tampered = msgpack.packb(fields)  # victim's signature over a different body
                attempts = {
                    "forged": (forged, victim.peer_id),
                    "tampered": (tampered, victim.peer_id),
                    "malformed": (b"\x93\x01\xff garbage", forger.peer_id),
                    "oversized": (b"\x00" * 1_000_000, forger.peer_id),
                }
                for name, (value, subkey) in attempts.items():
                    ok = await attacker.protocol.call_store(
                        victim_id, [key_id], [attacker.protocol.serializer.dumps(value)], [expires], subkeys=[subkey]
                    )
                    assert ok == [False], f"{name} record was accepted: {ok}"

                members = await list_members(victim, RUN)
                assert [member.peer_id for member in members] == [victim.peer_id]
                assert members[0].step == 0 and members[0].version != "evil"
                # still serving: a legitimate newcomer joins and is listed
                async with SwarmNode(NodeConfig(initial_peers=victim.maddrs)) as newcomer, Membership(newcomer, RUN):
                    assert await member_ids(victim) == {victim.peer_id, newcomer.peer_id}
            finally:
                await attacker.shutdown()
                await attacker_p2p.shutdown()

    run_async(scenario())


def test_identity_file_gives_same_peer_id_across_restarts(tmp_path):
    async def start_and_report() -> tuple[str, str]:
        async with SwarmNode(NodeConfig(identity_path=tmp_path / "id.key")) as node:
            return node.peer_id, node.p2p.peer_id.to_base58()

    first = run_async(start_and_report())
    second = run_async(start_and_report())
    assert first[0] == first[1]  # p2pd runs under the identity we sign records with
    assert first == second


def test_client_mode_reads_membership_but_accepts_no_connections():
    async def scenario():
        async with SwarmNode() as server, Membership(server, RUN):
            client_config = NodeConfig(initial_peers=server.maddrs, client_mode=True)
            async with SwarmNode(client_config) as client, Membership(client, RUN, role="client"):
                assert client.maddrs == []
                listed = {member.peer_id: member for member in await list_members(client, RUN)}
                assert set(listed) == {server.peer_id, client.peer_id}
                assert listed[client.peer_id].maddrs == [] and listed[client.peer_id].role == "client"
                # a stranger that learns the client's peer id still cannot open a connection to it
                async with SwarmNode(NodeConfig(initial_peers=server.maddrs)) as stranger:
                    try:
                        await asyncio.wait_for(stranger.p2p._client.connect(PeerID.from_base58(client.peer_id), []), 10)
                        connected = True
                    except Exception:
                        connected = False
                    assert not connected

    run_async(scenario())


def test_sync_facade_and_clean_shutdown():
    before = p2pd_pids()
    with SyncNode(run_id=RUN, ttl=10) as first:
        with SyncNode(NodeConfig(initial_peers=first.maddrs), run_id=RUN, ttl=10) as second:
            assert {m.peer_id for m in second.members()} == {first.peer_id, second.peer_id}
            second.update(step=5, samples_per_second=2.0)
        assert [m.peer_id for m in first.members()] == [first.peer_id]
    assert p2pd_pids() == before  # no daemon left behind


def test_a_large_run_beats_less_often_so_presence_costs_the_swarm_linear_time():
    """A listing costs O(members) and a beat is a store: past ``members_per_read`` members the beat
    interval grows with the run (64 members, 16 per read: every 4 refreshes), and so does the life
    of each record; not for a joiner's first rereads, so it lists the swarm at once."""
    timing = Timing(presence_refresh=0.5)
    assert [timing.beat_interval(n) for n in (1, 16, 32, 64)] == [0.5, 0.5, 1.0, 2.0]
    assert timing.ahead_wait(8) == 1.5 and timing.ahead_wait(64) == 3.0
    listings = [{f"p{i}": fake_member_record() for i in range(60 + i)} for i in range(4)]

    async def get_records(key, body_type, **_options):
        return listings.pop(0)

    presence = Membership(SimpleNamespace(get_records=get_records, remember_addresses=lambda *_: None), "big-run", ttl=6.0, refresh=0.5, watch=True,
                          members_per_read=16)
    for _ in range(FIRST_FAST_READS - 1):  # a joiner's first rereads: every refresh, to list the swarm at once
        run_async(presence.read())
        assert presence.beat_interval == 0.5
    run_async(presence.read())
    assert len(presence.members) == 62 and presence.stretch == 62 / 16  # then by the run's size
    assert Membership(SimpleNamespace(), "big-run", ttl=6.0, refresh=0.5, watch=True).beat_interval == 0.5


def fake_member_record(state: str = "alive", expires_in: float = 30.0) -> SimpleNamespace:
    """What ``Membership.read`` uses of a verified member record."""
    body = SimpleNamespace(state=state, maddrs=[], role="peer", version="0", step=0, samples_per_second=0.0,
                           updated_at=time.time(), epsilon=None, progress=None, stats=None, paused=False)
    return SimpleNamespace(body=body, expires=time.time() + expires_in)


def test_a_member_one_read_misses_stays_listed_until_its_record_expires_or_it_leaves():
    """On a loaded swarm a read can miss a record holder; the listing keeps that member (the
    moshpit grid is laid out from it) until its last record expires or it says it left."""
    record = fake_member_record
    reads: list[dict] = []

    async def get_records(key, body_type, **_options):
        return reads.pop(0)

    presence = Membership(SimpleNamespace(get_records=get_records, remember_addresses=lambda *_: None), "flaky-run", ttl=6.0, watch=True)

    def listed(*records: dict) -> list[str]:
        reads.append(dict(*records))
        return [member.peer_id for member in run_async(presence.read())]

    assert listed({"a": record(), "b": record(), "c": record(expires_in=0.2)}) == ["a", "b", "c"]
    assert listed({"a": record()}) == ["a", "b", "c"]  # b and c missed by this read: kept
    time.sleep(0.25)
    assert listed({}) == ["a", "b"]  # a failed read changes nothing; c's last record has expired
    assert listed({"b": record("left")}) == ["a"]  # b said it left: gone at once


def test_a_record_outlives_beats_as_long_as_its_store_and_reread_really_take():
    """Under load a store and a reread take seconds (64 peers starting on 2 cores: 8-10 s a beat);
    records that lived ``ttl`` expired before the next beat renewed them and membership never
    converged. A record lives ttl / refresh beats of the measured length (before any beat, the
    node's DHT latency stands in); presence stores and reads search a narrow beam."""
    lifetimes: list[float] = []
    beams: list[int | None] = []

    async def store(key, body, expires, *, all_replicas=True, beam_size=None):
        beams.append(beam_size)
        lifetimes.append(expires - time.time())
        await asyncio.sleep(0.3)  # a loaded DHT
        return True

    async def get_records(key, body_type, *, beam_size=None):
        beams.append(beam_size)
        await asyncio.sleep(0.3)
        return {}

    async def refresh_maddrs():
        pass

    def node(latency: float) -> SimpleNamespace:
        return SimpleNamespace(store=store, get_records=get_records, refresh_maddrs=refresh_maddrs, maddrs=[],
                               dht_latency=latency, remember_addresses=lambda *_: None, dht=None,
                               routing_peers=1)

    async def scenario(latency: float) -> None:
        async with Membership(node(latency), "slow-run", ttl=1.0, refresh=0.2, watch=True):
            await asyncio.sleep(1.0)  # a beat after the first: 0.2 s between beats, 0.6 s of work in each

    run_async(scenario(0.0))
    assert lifetimes[0] == pytest.approx(1.0, abs=0.05)  # nothing measured yet: ttl x stretch
    assert len(lifetimes) >= 2 and min(lifetimes[1:]) >= 5 * (0.2 + 0.6) - 0.05  # 5 beats of 0.8 s, not 1 s
    assert set(beams) == {PRESENCE_BEAM}
    lifetimes.clear()
    run_async(scenario(0.5))
    assert lifetimes[0] == pytest.approx(5 * (0.2 + 2 * 0.5), abs=0.05)  # a store and a read at the node's latency


def test_a_heartbeat_with_an_empty_routing_table_rejoins_through_known_members_first():
    """Issue 38: every initial peer gone and nobody left in the routing table: the heartbeat asks the
    node to re-bootstrap from the members it saw (SwarmNode.rebootstrap, on real daemons in
    test_entry_points.py) before it announces."""
    calls: list[str] = []

    async def store(*args, **kwargs):
        calls.append("store")
        return True

    async def rebootstrap():
        calls.append("rebootstrap")
        node.routing_peers = 1
        return 1

    async def refresh_maddrs():
        pass

    node = SimpleNamespace(store=store, refresh_maddrs=refresh_maddrs, maddrs=[], dht_latency=0.0, dht=None,
                           routing_peers=0, rebootstrap=rebootstrap)

    async def scenario():
        async with Membership(node, "empty-run", ttl=2.0, refresh=0.1):
            await asyncio.sleep(0.35)

    run_async(scenario())
    assert calls[:3] == ["store", "rebootstrap", "store"] and calls.count("rebootstrap") == 1

