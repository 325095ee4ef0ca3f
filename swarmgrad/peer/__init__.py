"""What a volunteer runs: Peer, training strategies, state sync, progress, checkpoints, run manifests."""

from swarmgrad.peer.peer import Peer, PeerStatus
from swarmgrad.peer.settings import Gossip, Moshpit
from swarmgrad.peer.strategies import DiLoCo, GossipSGD, Strategy, SyncSGD

__all__ = ["DiLoCo", "Gossip", "GossipSGD", "Moshpit", "Peer", "PeerStatus", "Strategy", "SyncSGD"]
