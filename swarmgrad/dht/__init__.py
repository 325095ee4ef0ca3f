"""Who is out there: the libp2p node, the DHT, typed signed records, run presence and published evaluations.
Names load on first use."""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "NodeConfig": "swarmgrad.dht.config",
    "check_run_id": "swarmgrad.dht.config",
    "Evaluation": "swarmgrad.dht.evaluations",
    "EvaluationLog": "swarmgrad.dht.evaluations",
    "EvaluationRecord": "swarmgrad.dht.evaluations",
    "read_evaluations": "swarmgrad.dht.evaluations",
    "Identity": "swarmgrad.dht.identity",
    "Member": "swarmgrad.dht.membership",
    "MemberRecord": "swarmgrad.dht.membership",
    "Membership": "swarmgrad.dht.membership",
    "Progress": "swarmgrad.dht.membership",
    "TrainingStats": "swarmgrad.dht.membership",
    "list_members": "swarmgrad.dht.membership",
    "SwarmNode": "swarmgrad.dht.node",
    "RecordBody": "swarmgrad.dht.records",
    "RecordError": "swarmgrad.dht.records",
    "SignedRecord": "swarmgrad.dht.records",
    "record_kind": "swarmgrad.dht.records",
    "SyncNode": "swarmgrad.dht.sync",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
