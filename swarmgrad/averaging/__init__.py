"""How tensors meet: wire frames, codecs, group all-reduce, moshpit rounds, push-sum gossip.

This layer knows nothing of models or optimizers: it averages named tensors.
"""

from swarmgrad.averaging.allreduce import AllReduceFailed, AllReduceReport, GroupAllReduce, GroupPlan
from swarmgrad.averaging.codecs import CODEC_NAMES, Codec, CodecError, ErrorFeedback, get_codec
from swarmgrad.averaging.gossip import GossipAverager, GossipReport
from swarmgrad.averaging.moshpit import Averager, AveragingReport

__all__ = [
    "CODEC_NAMES",
    "AllReduceFailed",
    "AllReduceReport",
    "Averager",
    "AveragingReport",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "GossipAverager",
    "GossipReport",
    "GroupAllReduce",
    "GroupPlan",
    "get_codec",
]
