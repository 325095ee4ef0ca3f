"""swarmgrad: decentralized peer-to-peer training of PyTorch models."""

from swarmgrad.version import __version__

__all__ = ["__version__"]
