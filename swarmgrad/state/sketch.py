"""Comparing donors' states up to a tolerance, by sketches: a few random ±1 projections per part of
each tolerance class's values, drawn from a nonce the joiner picks, so a donor cannot shape what it
serves to what it will be checked with. Honest donors never hold identical bytes (each peer's
optimizer moments are its own, and moshpit groups leave parameters a little apart), so the
coordinate-wise median of the donors' sketches is the reference and a donor agrees when each of its
parts lies within its class's tolerance of it. The rules of a download: state/transfer.py.

A sketch reads a sample of the state, not all of it: at most ``SKETCH_PARTS`` of the parts holding
compared values, drawn from the nonce (``sample_parts``), so its cost (a donor's, per request, and
the joiner's own) does not grow with the state. A full pass cost 1.6-4 ms per MiB on an idle
machine (a state of 480M parameters missed the 15 s a sketch may take) and 16-70 ms per MiB on a
loaded 2-core one (200 MB: 13 s, 800 MB: 51 s; 64 parts: 4 s whatever the state). What a check with one sample proves:
every sampled part lies within tolerance of the median of the donors' sketches of it. What it does
not: a part outside the sample was not looked at. A donor that altered a fraction f of the compared
parts passes one check with probability at most (1 - f)^SKETCH_PARTS (sampling without
replacement is below that): f = 5% passes 3.7% of checks, f = 10% 0.1%, a single part of a large
state almost always. The joiner bounds the rest otherwise: a value that is NaN or Inf anywhere in
what it kept is refused (transfer.py ``_check_finite``, a full pass over its own copy); a donor
caught in any sample has every part it served fetched again from the others, not only the sampled
ones; and each verification pass draws a new sample once the bytes are in, so no donor knows which
parts will be read while it serves them. Parts that hold only never-compared values (optimizer
moments, integer counters) were never checked by any sketch.
"""

from __future__ import annotations

import hashlib
import random
import struct
from bisect import bisect_left, bisect_right
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.snapshot import DTYPES, element_size, layout

Specs = Sequence[tuple[str, str, tuple[int, ...]]]

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
# parts one sketch reads at most (64 MiB at 1 MiB parts: 0.1-0.26 s idle, 4 s on a loaded 2-core machine);
# a donor that altered 10% of the compared parts passes a check with probability 0.9^64 = 0.1%
SKETCH_PARTS = 64
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


def _segments(specs: Specs, parts: Sequence[int]) -> dict[int, list[list[tuple[int, int, str]]]]:
    """Of ``parts``, part -> per class, the (start, end, dtype) byte ranges within the part of the
    compared tensors' values in it: floating-point tensors only (integer and bool ones are counters
    and flags each peer keeps, such as BatchNorm's num_batches_tracked: rounds average only
    parameters). Offsets are multiples of 8 and so is a part's size: no value straddles two parts.
    The cost grows with the tensors and ``parts``, not with the bytes."""
    offsets, _ = layout(specs)
    size = state_snapshot.PART_BYTES
    wanted = sorted(set(parts))
    segments: dict[int, list[list[tuple[int, int, str]]]] = {}
    for (name, dtype, _), (start, length) in zip(specs, offsets):
        tolerance = tolerance_of(name)
        if tolerance is None or not length or not DTYPES[dtype].is_floating_point:
            continue
        end = start + length
        for part in wanted[bisect_left(wanted, start // size) : bisect_right(wanted, (end - 1) // size)]:
            base = part * size
            ranges = segments.setdefault(part, [[] for _ in CLASSES])[CLASSES.index(tolerance)]
            ranges.append((max(start, base) - base, min(end, base + size) - base, dtype))
    return segments


def compared_parts(specs: Specs, parts: Sequence[int]) -> list[int]:
    """Those of ``parts`` that hold compared values (the rest sketch to zeros whatever they hold)."""
    offsets, _ = layout(specs)
    size = state_snapshot.PART_BYTES
    held: set[int] = set()
    for (name, dtype, _), (start, length) in zip(specs, offsets):
        if length and tolerance_of(name) is not None and DTYPES[dtype].is_floating_point:
            held.update(range(start // size, (start + length - 1) // size + 1))
    return [part for part in parts if part in held]


def sample_parts(specs: Specs, parts: Sequence[int], seed: int) -> list[int]:
    """The parts a sketch for ``seed`` reads: of ``parts``, those holding compared values, or
    ``SKETCH_PARTS`` of them drawn from ``seed`` where there are more; ascending."""
    candidates = compared_parts(specs, parts)
    if len(candidates) <= SKETCH_PARTS:
        return candidates
    return sorted(random.Random(seed).sample(candidates, SKETCH_PARTS))


def compared_values(specs: Specs, parts: Sequence[int]) -> torch.Tensor:
    """How many compared values each of ``parts`` holds, per class: [len(parts), classes]."""
    segments = _segments(specs, parts)
    counts = torch.zeros(len(parts), len(CLASSES), dtype=torch.float64)
    for row, part in enumerate(parts):
        for column, ranges in enumerate(segments.get(part, ())):
            counts[row, column] = sum((end - start) // element_size(dtype) for start, end, dtype in ranges)
    return counts


def sketch(read_part: Callable[[int], torch.Tensor], specs: Specs, seed: int, parts: Sequence[int]) -> torch.Tensor:
    """float32 [len(parts), classes, SKETCH_PROJECTIONS]: for each of ``parts`` (``read_part(index)``:
    its bytes, of a state laid out by ``specs``) and each tolerance class, the projections of the
    class's values in it on ±1 vectors drawn from (seed, part, class). The signs come from SHAKE-256,
    so every machine and torch version draws the same; a class with no values in a part projects to
    zeros. Reads ``parts`` only, and only those holding compared values."""
    segments = _segments(specs, parts)
    result = torch.zeros(len(parts), len(CLASSES), SKETCH_PROJECTIONS, dtype=torch.float64)
    for row, part in enumerate(parts):
        if part not in segments:
            continue
        data = read_part(part)
        for column, ranges in enumerate(segments[part]):
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
