"""No single point of entry (issue 38, item 3), on real p2pd daemons and DHT nodes on loopback: a
run goes on when its bootstrap node dies, a newcomer joins through any member (``--initial-peers``
with several addresses, the dead bootstrap's among them), and a node whose routing table emptied
joins the DHT again through the members it saw."""

from contextlib import AsyncExitStack

from conftest import eventually, run_async
from hivemind.dht.routing import RoutingTable

from swarmgrad.commands.status import entry_points
from swarmgrad.dht import Membership, NodeConfig, SwarmNode, list_members

RUN = "entry-run"


async def member(stack: AsyncExitStack, initial_peers: list[str]) -> tuple[SwarmNode, Membership]:
    node = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=initial_peers)))
    presence = await stack.enter_async_context(Membership(node, RUN, ttl=6.0, refresh=0.5, watch=True))
    return node, presence


def listed(presence: Membership) -> set[str]:
    return {m.peer_id for m in presence.members}


def test_a_newcomer_joins_through_a_member_after_the_bootstrap_node_died():
    async def scenario():
        async with AsyncExitStack() as stack:
            bootstrap = SwarmNode()
            await bootstrap.start()
            try:
                first, first_presence = await member(stack, bootstrap.maddrs)
                second, second_presence = await member(stack, bootstrap.maddrs)

                async def both_listed() -> bool:
                    return all(listed(p) == {first.peer_id, second.peer_id} for p in (first_presence, second_presence))

                await eventually(both_listed, seconds=20)
            finally:
                dead = bootstrap.maddrs
                await bootstrap.shutdown()
            # each member names entry points: its own address first, then the other member's
            assert first.entry_points()[0] == first.maddrs[0] and second.maddrs[0] in first.entry_points()
            # several initial peers, the first of them dead: the newcomer joins through the member
            third, third_presence = await member(stack, [*dead, *first.entry_points()])
            everyone = {first.peer_id, second.peer_id, third.peer_id}

            async def all_listed() -> bool:
                return all(listed(p) == everyone for p in (first_presence, second_presence, third_presence))

            await eventually(all_listed, seconds=30)  # and the members that joined through the dead node see it
            members = await list_members(third, RUN)
            assert set(entry_points(members)) <= {first.maddrs[0], second.maddrs[0], third.maddrs[0]}
            assert len(entry_points(members)) == 3

    run_async(scenario())


def test_a_node_whose_routing_table_emptied_joins_again_through_members_it_knows():
    async def scenario():
        async with AsyncExitStack() as stack:
            bootstrap = SwarmNode()
            await bootstrap.start()
            try:
                lost, lost_presence = await member(stack, bootstrap.maddrs)
                other, other_presence = await member(stack, bootstrap.maddrs)

                async def both_listed() -> bool:
                    return all(listed(p) == {lost.peer_id, other.peer_id} for p in (lost_presence, other_presence))

                await eventually(both_listed, seconds=20)
            finally:
                await bootstrap.shutdown()
            # every peer it knew through the DHT is gone from its table (as when its initial peers died
            # and the rest it had learnt left; the other member's requests would soon add it back, so
            # the re-bootstrap runs at once here: the heartbeat calls it when the table is empty)
            table = lost.dht.protocol.routing_table
            lost.dht.protocol.routing_table = RoutingTable(table.node_id, table.bucket_size, table.depth_modulo)
            assert lost.routing_peers == 0
            assert await lost.rebootstrap() == 1 and lost.rebootstraps == 1 and lost.routing_peers > 0
            assert await lost.rebootstrap() == 0  # not empty: nothing to do
            newcomer, _ = await member(stack, other.maddrs)  # joins through the other member

            async def newcomer_seen() -> bool:
                return newcomer.peer_id in {m.peer_id for m in await list_members(lost, RUN)}

            await eventually(newcomer_seen, seconds=30)

    run_async(scenario())
