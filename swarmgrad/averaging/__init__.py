"""How tensors meet: wire frames, codecs, group all-reduce, moshpit rounds.

This layer knows nothing of models or optimizers: it averages named tensors.
"""

from swarmgrad.averaging.allreduce import AllReduceFailed, AllReduceReport, GroupAllReduce, GroupPlan
from swarmgrad.averaging.codecs import CODEC_NAMES, Codec, CodecError, ErrorFeedback, get_codec
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
    "GroupAllReduce",
    "GroupPlan",
    "get_codec",
]
