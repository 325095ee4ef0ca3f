"""``swarmgrad lab``: run a swarm on one machine over an emulated internet.

:mod:`swarmgrad.lab.network` gives each peer its own network namespace and access link (rate,
one-way delay, loss); :mod:`swarmgrad.lab.hub` is the userspace wire that adds the delay;
:mod:`swarmgrad.lab.driver` runs a scenario's peers on it (:mod:`swarmgrad.lab.scenario`).
"""

from swarmgrad.lab.network import EmulatedNetwork, LabTerminated, LinkSpec, cleanup, leftovers

__all__ = ["EmulatedNetwork", "LabTerminated", "LinkSpec", "cleanup", "leftovers"]
