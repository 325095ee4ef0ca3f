"""Host memory a peer frees goes back to the operating system (DESIGN's memory budget).

A round allocates and frees buffers of a chunk (1 MiB) to a model's size. glibc's malloc serves
blocks under its mmap threshold from its heaps, and that threshold grows (to 32 MiB) each time a
larger block is freed, so after the first round most of a round's buffers come from heaps that a
free does not shrink: a peer's resident memory then held its largest round's worth of freed memory.
Measured with benchmarks/big_model.py --quick (4.2M parameters): 56-66 bytes per parameter beyond
model and Adam with the default, 32 with a fixed threshold of 256 KiB. A fixed threshold also turns
the growth off. Only where the C library is glibc; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 * 1024  # blocks from here up are mapped on their own and unmapped when freed


@functools.cache
def return_freed_memory() -> bool:
    """Make blocks of ``MMAP_THRESHOLD_BYTES`` and more their own mappings, once per process; True
    where that took (glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        return False
    if mallopt is None or gnu is None:  # not glibc: its allocator has its own rules
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    logger.debug("glibc mmap threshold %s to %d bytes", "set" if done else "not set", MMAP_THRESHOLD_BYTES)
    return done
