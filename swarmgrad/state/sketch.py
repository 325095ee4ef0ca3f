"""Comparing donors' states up to a tolerance, by sketches: a few random ±1 projections per part of
each tolerance class's values, drawn from a nonce the joiner picks, so a donor cannot shape what it
serves to what it will be checked with. Honest donors never hold identical bytes (each peer's
optimizer moments are its own, and moshpit groups leave parameters a little apart), so the
coordinate-wise median of the donors' sketches is the reference and a donor agrees when each of its
parts lies within its class's tolerance of it. The rules of a download: state/transfer.py.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Mapping, Sequence

import numpy as np
import torch

from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.snapshot import DTYPES, element_size, layout

# How far a donor's tensors may lie from the donors' median and still agree, relative to the
# median's norm, per part; the first prefix a tensor's name starts with decides (peer/state.py names
# them). Measured (3 digits peers, DiLoCo, 42 epochs, group size 2, so one averaged alone each round):
# parameters 2.1% apart at most (0.08% between two that shared groups), outer momentum 76%; in the
# sketches, over 50 nonces, the loner lay at most 3.8% (parameters) and 2.48x (momentum) from the median.
TOLERANCES: tuple[tuple[str, float | None], ...] = (
    ("optimizer/", None),  # each peer's own inner-optimizer moments: never compared, taken from agreeing donors
    # outer momentum, each peer's sum of its own groups' averages: blocks one rescaled 4x or more (or
    # -10x); a momentum merely negated (2x its norm away) stays within
    ("strategy/", 3.0),
    ("", 0.1),  # the model and anything else: a donor can shift a joiner's parameters by 10% at most
)
# an absolute floor on the tolerance, per value (RMS): parts that are (nearly) zero, like a fresh momentum
SKETCH_FLOOR = 1e-6
# ±1 projections per part and class: with 8, a sketch's distance is 0.45..1.8x the true one at 99.9%
# (chi with 8 degrees of freedom), inside the margins between measured spreads and the tolerances
SKETCH_PROJECTIONS = 8
VERIFY_PASSES = 3  # nonce-2 checks of what arrived: the first, and two after refetching failed parts
SKETCHES_PER_CHANNEL = 1 + VERIFY_PASSES  # what a joiner asks of one donor: one to compare, one per pass
MAX_SEED = 2**63 - 1


def tolerance_of(name: str) -> float | None:
    """The tolerance ``TOLERANCES`` gives tensor ``name``: None when it is never compared."""
    for prefix, tolerance in TOLERANCES:
        if name.startswith(prefix):
            return tolerance
    return None


# the compared classes, in table order: a sketch holds one row of projections per part and class
CLASSES: tuple[float, ...] = tuple(tolerance for _, tolerance in TOLERANCES if tolerance is not None)


def _segments(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> dict[int, list[list[tuple[int, int, str]]]]:
    """Part -> per class, the (start, end, dtype) byte ranges of the compared tensors' values in it:
    floating-point tensors only (integer and bool ones are counters and flags each peer keeps, such
    as BatchNorm's num_batches_tracked: rounds average only parameters). Offsets are multiples of 8
    and so is a part's size: no value straddles two parts."""
    offsets, _ = layout(specs)
    segments: dict[int, list[list[tuple[int, int, str]]]] = {}
    for (name, dtype, _), (start, length) in zip(specs, offsets):
        tolerance = tolerance_of(name)
        if tolerance is None or not length or not DTYPES[dtype].is_floating_point:
            continue
        position, end = start, start + length
        while position < end:
            part = position // state_snapshot.PART_BYTES
            stop = min(end, (part + 1) * state_snapshot.PART_BYTES)
            segments.setdefault(part, [[] for _ in CLASSES])[CLASSES.index(tolerance)].append((position, stop, dtype))
            position = stop
    return segments


def compared_values(specs: Sequence[tuple[str, str, tuple[int, ...]]], parts: Sequence[int]) -> torch.Tensor:
    """How many compared values each of ``parts`` holds, per class: [len(parts), classes]."""
    segments = _segments(specs)
    counts = torch.zeros(len(parts), len(CLASSES), dtype=torch.float64)
    for row, part in enumerate(parts):
        for column, ranges in enumerate(segments.get(part, ())):
            counts[row, column] = sum((end - start) // element_size(dtype) for start, end, dtype in ranges)
    return counts


def sketch(data: torch.Tensor, specs: Sequence[tuple[str, str, tuple[int, ...]]], seed: int,
           parts: Sequence[int]) -> torch.Tensor:
    """float32 [len(parts), classes, SKETCH_PROJECTIONS]: for each part of ``data`` (a snapshot's
    bytes, laid out by ``specs``) and each tolerance class, the projections of the class's values in
    it on ±1 vectors drawn from (seed, part, class). The signs come from SHAKE-256, so every machine
    and torch version draws the same; a class with no values in a part projects to zeros."""
    segments = _segments(specs)
    result = torch.zeros(len(parts), len(CLASSES), SKETCH_PROJECTIONS, dtype=torch.float64)
    for row, part in enumerate(parts):
        for column, ranges in enumerate(segments.get(part, ())):
            if ranges:
                pieces = [data[start:end].view(DTYPES[dtype]).to(torch.float32) for start, end, dtype in ranges]
                values = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                result[row, column] = _project(values, seed, part, column)
    return result.to(torch.float32)


def _project(values: torch.Tensor, seed: int, part: int, column: int) -> torch.Tensor:
    width = -(-values.numel() // 8)  # bytes of signs per projection
    stream = hashlib.shake_256(b"swarmgrad/state-sketch" + struct.pack("<QQQ", seed, part, column))
    bits = np.unpackbits(np.frombuffer(stream.digest(SKETCH_PROJECTIONS * width), dtype=np.uint8))
    ones = torch.from_numpy(bits.reshape(SKETCH_PROJECTIONS, width * 8)[:, : values.numel()]).to(torch.float32)
    # a bit 1 is +1, a bit 0 is -1: the sum over the ones, twice, less the sum over all
    return 2 * (ones @ values).to(torch.float64) - values.sum(dtype=torch.float64)


def reference_sketch(sketches: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of donors' sketches ([donors, ...]; for an even count the mean of
    the middle two): a minority of donors, however far off, cannot move it past the majority's values."""
    ordered = sketches.sort(dim=0).values
    count = ordered.shape[0]
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def parts_within(candidate: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool [parts]: whether each part of sketch ``candidate`` lies within tolerance of ``reference``
    (both [parts, classes, k]; ``counts``: ``compared_values``). The rule, for every class c of the
    part: |candidate - reference| <= CLASSES[c] * |reference| + SKETCH_FLOOR * sqrt(k * values). A
    ±1 projection keeps a vector's norm in expectation, so this is about |x - x_ref| <= tolerance *
    |x_ref| on the values themselves. NaN or Inf is never within."""
    distance = (candidate.double() - reference.double()).norm(dim=-1)
    tolerance = torch.tensor(CLASSES, dtype=torch.float64) * reference.double().norm(dim=-1)
    allowed = tolerance + SKETCH_FLOOR * (SKETCH_PROJECTIONS * counts).sqrt()
    return (distance <= allowed).all(dim=-1)


def agreeing(sketches: Mapping[str, torch.Tensor], counts: torch.Tensor) -> list[str]:
    """The donors (of ``sketches``: donor -> [parts, classes, k]) whose every part lies within
    tolerance of the donors' median (``reference_sketch``, ``parts_within``)."""
    if not sketches:
        return []
    reference = reference_sketch(torch.stack(list(sketches.values())))
    return [donor for donor, drawn in sketches.items() if bool(parts_within(drawn, reference, counts).all())]


def majority_version(versions: Sequence[int]) -> int:
    """The highest version a strict majority of ``versions`` (one per donor that answered) reached:
    sorted from the highest, the one at index n // 2. One donor's claim wins only where it is the
    only donor, so that a swarm of two (one donor) stays joinable; of two, the lower (both reached it)."""
    if not versions:
        raise ValueError("no versions to choose from")
    return sorted(versions, reverse=True)[len(versions) // 2]
