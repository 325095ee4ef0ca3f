"""How tensors meet: wire frames, codecs, group all-reduce, moshpit rounds, push-sum gossip.

This layer knows nothing of models or optimizers: it averages named tensors. Names load on first use.
"""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "AllReduceFailed": "swarmgrad.averaging.allreduce",
    "AllReduceReport": "swarmgrad.averaging.allreduce",
    "GroupAllReduce": "swarmgrad.averaging.allreduce",
    "GroupPlan": "swarmgrad.averaging.group_plan",
    "CODEC_NAMES": "swarmgrad.averaging.codecs",
    "Codec": "swarmgrad.averaging.codecs",
    "CodecError": "swarmgrad.averaging.codecs",
    "ErrorFeedback": "swarmgrad.averaging.codecs",
    "get_codec": "swarmgrad.averaging.codecs",
    "GossipAverager": "swarmgrad.averaging.gossip",
    "Averager": "swarmgrad.averaging.moshpit",
    "Aggregation": "swarmgrad.averaging.settings",
    "RoundReport": "swarmgrad.averaging.report",
    "Gossip": "swarmgrad.averaging.settings",
    "Moshpit": "swarmgrad.averaging.settings",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
