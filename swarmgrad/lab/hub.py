"""The wire of the emulated internet: forwards IPv4 packets between the lab's tun devices, late.

The kernel here has no ``netem``, so one-way delay is added in userspace. :class:`EmulatedNetwork`
opens one tun device per peer namespace (in the root namespace, before moving it), then starts this
process with the open tun fds (``pass_fds``). Each packet read from peer ``s``'s tun is written into
the tun of the peer that owns its destination address, ``delay[s] + delay[d]`` seconds later: each
peer's ``delay_ms`` is the one-way latency of its access link, so a round trip between ``a`` and
``b`` takes ``2 * (delay[a] + delay[b])``.

Rate limits and loss are applied by the kernel in the namespaces (tbf, ifb, iptables), so this
process drops nothing, except packets for addresses outside the lab (which keeps traffic inside
the run's namespaces) and anything that is not IPv4.

Order: packets are released in (due time, arrival) order from one heap. The delay of a (source,
destination) pair is a constant, so packets of one flow leave in the order they came.

Lifetime: the hub exits when its stdin reaches EOF. The parent keeps the write end and closes it to
stop the hub; if the parent dies (even by SIGKILL) the kernel closes it, so a hub never outlives
its lab. Closing the tun fds (by exiting) deletes the tun devices, which are not persistent.

Standalone use (normally only :mod:`swarmgrad.lab.network` starts it)::

    python -m swarmgrad.lab.hub --prefix P --tun-fds 5,6 --delays-ms 10,30 < control-pipe

It prints ``ready`` on stdout once it polls the tuns.
"""

from __future__ import annotations

import argparse
import heapq
import os
import select
import signal
import sys
import time

# The lab's addresses: 11.77.<i // 250>.<i % 250 + 1> for peer i (see network.address).
SUBNET_OCTETS = (11, 77)
HOSTS_PER_OCTET = 250

# Reads per tun per wake-up: bounded so that one busy sender cannot starve the others or the timer.
READ_BURST = 64
# Larger than any MTU the lab configures (an IPv4 packet is at most 65535 bytes).
READ_SIZE = 65536


def peer_index(packet: bytes, n_peers: int) -> int:
    """The peer that owns the packet's IPv4 destination, or -1 (not IPv4, or outside the lab)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return -1
    if packet[16] != SUBNET_OCTETS[0] or packet[17] != SUBNET_OCTETS[1]:
        return -1
    host = packet[19]
    if not 1 <= host <= HOSTS_PER_OCTET:
        return -1
    index = packet[18] * HOSTS_PER_OCTET + host - 1
    return index if index < n_peers else -1


class Hub:
    """Delay line between tun fds. Single-threaded: one poll loop for reads and the release timer."""

    def __init__(self, tun_fds: list[int], delays_s: list[float], control_fd: int):
        if len(tun_fds) != len(delays_s):
            raise ValueError("one delay per tun fd")
        self.tun_fds = tun_fds
        self.delays_s = delays_s
        self.control_fd = control_fd
        # (due time, arrival sequence, destination index, packet); the sequence breaks ties in FIFO
        # order and keeps heapq from ever comparing packets.
        self.queue: list[tuple[float, int, int, bytes]] = []
        self.sequence = 0
        self.forwarded = 0
        self.dropped = 0
        for fd in tun_fds:
            os.set_blocking(fd, False)

    def run(self) -> None:
        poller = select.epoll()
        index_of_fd = {fd: i for i, fd in enumerate(self.tun_fds)}
        for fd in self.tun_fds:
            poller.register(fd, select.EPOLLIN)
        poller.register(self.control_fd, select.EPOLLIN | select.EPOLLHUP)
        print("ready", flush=True)
        while True:
            timeout = -1.0
            if self.queue:
                timeout = max(0.0, self.queue[0][0] - time.monotonic())
            for fd, _events in poller.poll(timeout):
                if fd == self.control_fd:
                    if not os.read(self.control_fd, 4096):
                        return  # EOF: the lab is closing, or its process died
                    continue
                self._read(index_of_fd[fd], fd)
            self._release(time.monotonic())

    def _read(self, source: int, fd: int) -> None:
        now = time.monotonic()
        for _ in range(READ_BURST):
            try:
                packet = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                return  # the device went away (lab teardown); the control pipe ends the loop
            destination = peer_index(packet, len(self.tun_fds))
            if destination < 0:
                self.dropped += 1
                continue
            due = now + self.delays_s[source] + self.delays_s[destination]
            self.sequence += 1
            heapq.heappush(self.queue, (due, self.sequence, destination, packet))

    def _release(self, now: float) -> None:
        queue = self.queue
        while queue and queue[0][0] <= now:
            _due, _seq, destination, packet = heapq.heappop(queue)
            try:
                os.write(self.tun_fds[destination], packet)
                self.forwarded += 1
            except OSError:
                # The receiving stack refused it (backlog full, device down): on a real link that
                # is a lost packet too, and TCP recovers.
                self.dropped += 1


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _raise_priority() -> None:
    """Run the wire ahead of the peers: on a busy machine a descheduled hub adds delay (and jitter)
    that no LinkSpec asked for. Real-time round-robin when allowed (the hub sleeps in epoll and uses
    a few percent of a core, and the kernel's RT throttling still reserves time for everything
    else), otherwise the best nice value we may take."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        return
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmgrad.lab.hub", description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", required=True, help="the lab's id (lets cleanup find this process)")
    parser.add_argument("--tun-fds", required=True, type=_ints, help="open tun fds, one per peer, in peer order")
    parser.add_argument("--delays-ms", required=True, type=_floats, help="one-way delay of each peer's link")
    args = parser.parse_args(argv)
    # Signals end the hub quietly; the lab that started it does the cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    _raise_priority()
    hub = Hub(args.tun_fds, [ms / 1000.0 for ms in args.delays_ms], control_fd=sys.stdin.fileno())
    hub.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
