"""swarmgrad: decentralized peer-to-peer training of PyTorch models.

    import swarmgrad as sg
    peer = sg.Peer(model, optimizer, run_id="fmnist", initial_peers=[...],
                   strategy=sg.DiLoCo(inner_steps=50), averaging=sg.Moshpit(), compression="int8")

The public names load on first use, so ``swarmgrad --help`` does not pay for importing torch.
"""

from __future__ import annotations

from swarmgrad.lazy import lazy_exports
from swarmgrad.version import __version__

_PUBLIC = {
    "Peer": "swarmgrad.peer.peer",
    "Optimizer": "swarmgrad.peer.optimizer",
    "PeerStatus": "swarmgrad.peer.status",
    "PeerConfig": "swarmgrad.peer.peer_config",
    "RunConfig": "swarmgrad.peer.config",
    "RunConfigMismatch": "swarmgrad.peer.config",
    "DiLoCo": "swarmgrad.peer.strategies.diloco",
    "SyncSGD": "swarmgrad.peer.strategies.sync",
    "GossipSGD": "swarmgrad.peer.strategies.gossip",
    "Moshpit": "swarmgrad.averaging.settings",
    "Gossip": "swarmgrad.averaging.settings",
    "Timing": "swarmgrad.timing",
    "Privacy": "swarmgrad.averaging.privacy",
    "BudgetExhausted": "swarmgrad.averaging.privacy",
    "NodeConfig": "swarmgrad.dht.config",
}

__all__ = ["__version__", *_PUBLIC]


__getattr__ = lazy_exports(__name__, _PUBLIC)
