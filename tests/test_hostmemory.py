"""glibc's thresholds as a Peer sets them (swarmgrad/hostmemory.py): freed blocks are reused without
faulting their pages in again, stay with the process until a swarm step is done, and go back to the
system when ``release_freed_memory`` is called. Each case runs in a fresh interpreter: the thresholds
are process-wide and cannot be unset."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from swarmgrad.hostmemory import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the thresholds are glibc's")

BLOCK = 4 * 1024 * 1024  # a chunk's size: under the mmap threshold, far over the old 256 KiB
PAGE = 4096

PROGRAM = textwrap.dedent("""
    import json, resource, sys
    from swarmgrad import hostmemory

    def rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    mode, block = sys.argv[1], int(sys.argv[2])
    if mode == "tuned":
        assert hostmemory.tune_allocator()
    elif mode == "small-threshold":  # the setting of sessions 30-36: every block its own mapping
        hostmemory._glibc().mallopt(hostmemory.M_MMAP_THRESHOLD, 256 * 1024)
    before = faults()
    for _ in range(40):
        bytearray(block)  # allocated, zero-filled (every page touched) and freed
    reuse_faults = faults() - before

    start = rss()
    blocks = [bytearray(1024 * 1024) for _ in range(200)]  # a round's chunk buffers
    del blocks
    held = rss() - start
    hostmemory.release_freed_memory()
    print(json.dumps({"reuse_faults": reuse_faults, "held": held, "released": rss() - start}))
""")


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode, str(BLOCK)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_freed_blocks_are_reused_without_faulting_their_pages_again():
    tuned, small = run("tuned"), run("small-threshold")
    # 40 blocks of 1,024 pages: with each block its own mapping every page faults every time
    assert small["reuse_faults"] > 30 * BLOCK // PAGE, small
    assert tuned["reuse_faults"] < 3 * BLOCK // PAGE, tuned


def test_what_a_round_freed_stays_until_released_then_goes_back_to_the_system():
    tuned = run("tuned")
    untuned = run("default")  # glibc as it comes: a heap gives back what is free at its top at once
    assert untuned["held"] < 50 * 1024 * 1024, untuned
    tuned = run("tuned")
    assert tuned["held"] > 150 * 1024 * 1024, tuned  # 200 MiB freed: kept for reuse while training goes on
    assert tuned["released"] < 20 * 1024 * 1024, tuned  # malloc_trim handed it back
