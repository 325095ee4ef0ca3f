"""swarmgrad: decentralized peer-to-peer training of PyTorch models.

    import swarmgrad as sg
    peer = sg.Peer(model, optimizer, run_id="fmnist", initial_peers=[...],
                   strategy=sg.DiLoCo(inner_steps=50), averaging=sg.Moshpit(), compression="int8")

The public names load on first use, so ``swarmgrad --help`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from swarmgrad.version import __version__

_PUBLIC = {
    "Peer": "swarmgrad.peer.peer",
    "PeerStatus": "swarmgrad.peer.peer",
    "DiLoCo": "swarmgrad.peer.strategies",
    "SyncSGD": "swarmgrad.peer.strategies",
    "GossipSGD": "swarmgrad.peer.strategies",
    "Moshpit": "swarmgrad.peer.settings",
    "Gossip": "swarmgrad.peer.settings",
    "Privacy": "swarmgrad.averaging.privacy",
    "NodeConfig": "swarmgrad.dht.node",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'swarmgrad' has no attribute {name!r}")
