"""`swarmgrad demo`: a whole swarm training on this machine, on loopback only.

A bootstrap node runs in this process; N peers run as separate ``swarmgrad peer`` processes, each
on its own shard of the task's training set. Peer 0 evaluates on the held-out set after each
swarm step. The demo shows live progress, stops once the target accuracy is reached (or the time
budget is spent), and writes a loss/accuracy-vs-time plot and a summary.
"""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "DemoSettings": "swarmgrad.demo.settings",
    "peer_command": "swarmgrad.demo.settings",
    "run_demo": "swarmgrad.demo.run",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
