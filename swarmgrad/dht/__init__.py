"""Who is out there: the libp2p node, the DHT, typed signed records and run membership."""

from swarmgrad.dht.identity import Identity
from swarmgrad.dht.membership import Member, MemberRecord, Membership, list_members
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.dht.records import RecordBody, RecordError, SignedRecord, record_kind
from swarmgrad.dht.sync import SyncNode

__all__ = [
    "Identity",
    "Member",
    "MemberRecord",
    "Membership",
    "NodeConfig",
    "RecordBody",
    "RecordError",
    "SignedRecord",
    "SwarmNode",
    "SyncNode",
    "list_members",
    "record_kind",
]
