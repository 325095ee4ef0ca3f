"""Host memory a peer frees is reused while it trains and goes back to the system after each round.

glibc's malloc serves blocks under its mmap threshold from its heaps (one arena per busy thread) and
maps larger ones on their own. Two ways it can go wrong for a peer, both measured:
- Left as it is, the threshold grows to the largest block freed and heaps give back only what is
  free at their top, so a peer's resident memory kept its largest round's buffers, freed on worker
  threads into their arenas: 56-66 bytes per parameter beyond model and Adam in
  benchmarks/big_model.py --quick (4.2M parameters).
- With a small threshold (256 KiB, sessions 30-36) every block of a chunk or a layer's size was
  mapped and unmapped each time: 86-263 thousand page faults a second a peer, about half of each
  peer's CPU at 201M in the lab, a 100M-parameter Adam step 1.7 s instead of 0.9.
So the heaps keep freed blocks up to ``MMAP_THRESHOLD_BYTES`` (glibc's largest) for reuse, do not
shrink until ``TRIM_THRESHOLD_BYTES`` lie free at their top, and the peer hands what is free in
every arena back with ``malloc_trim`` once a swarm step is done (``release_freed_memory``): one
re-fault of the training's temporaries per round instead of one per block. Only where the C library
is glibc; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # blocks from here up are their own mappings (glibc allows no more)
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024  # a heap shrinks on its own only past this much free at its top


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    needed = ("mallopt", "malloc_trim", "gnu_get_libc_version")
    return libc if libc is not None and all(hasattr(libc, symbol) for symbol in needed) else None


@functools.cache
def tune_allocator() -> bool:
    """Set glibc's thresholds once per process (see the module docstring); True where that took."""
    libc = _glibc()
    if libc is None:  # not glibc: its allocator has its own rules
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    logger.debug("glibc thresholds %s: mmap %d, trim %d bytes", "set" if done else "not set",
                 MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    return done


def release_freed_memory() -> bool:
    """Give the system back the pages free in every heap (tens of milliseconds at 200M parameters:
    call it off the training loop); True where glibc released some."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
