"""What a volunteer runs: Peer, run settings, training strategies, state sync, progress, checkpoints,
run manifests. Names load on first use."""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "Gossip": "swarmgrad.averaging.settings",
    "Moshpit": "swarmgrad.averaging.settings",
    "DiLoCo": "swarmgrad.peer.strategies.diloco",
    "GossipSGD": "swarmgrad.peer.strategies.gossip",
    "RunConfig": "swarmgrad.peer.config",
    "RunConfigMismatch": "swarmgrad.peer.config",
    "SyncSGD": "swarmgrad.peer.strategies.sync",
    "Peer": "swarmgrad.peer.peer",
    "PeerStatus": "swarmgrad.peer.status",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
