"""An emulated internet on one machine: one network namespace per peer, each with its own access link.

Every peer ``i`` lives in namespace ``<prefix>-<i>`` and has one interface, ``lab0`` (a tun device),
with address :func:`address` ``(i)`` in 11.77.0.0/16 (see ``SUBNET`` for why public-looking). Its :class:`LinkSpec` sets, for its access
link to the rest of the lab:

* ``up_mbit``: a tbf qdisc on ``lab0`` egress (what the peer sends);
* ``down_mbit``: ingress on ``lab0`` is redirected (u32 + mirred) to an ifb device ``labdown``
  whose tbf qdisc paces what the peer receives;
* ``delay_ms``: one-way latency, added by the hub process (:mod:`swarmgrad.lab.hub`) that forwards
  packets between the tun devices: a packet from ``a`` to ``b`` spends ``delay_a + delay_b`` on
  the wire, so the round trip is ``2 * (delay_a + delay_b)``;
* ``loss``: the chance that the link loses a packet that crosses it, in either direction. A packet
  from ``a`` to ``b`` crosses both links, so it arrives with probability
  ``(1 - loss_a) * (1 - loss_b)``. Both drops happen in ``b``'s INPUT chain (iptables statistic:
  a per-source rule for ``a``'s uplink loss, then one rule for ``b``'s downlink loss), because a
  drop on the sender's OUTPUT is not silent: ``sendto`` would fail with EPERM and TCP would retry
  at once instead of seeing a loss. Side effect: a packet lost on ``a``'s uplink has still used
  ``b``'s downlink.

Public peers' namespaces have no default route; a peer with ``nat`` set sits behind NAT routers
(:mod:`swarmgrad.lab.nat`) whose outermost holds its ``lab0``. The hub forwards only between lab
addresses, so peers reach each other and nothing else.

MTU: one MTU for the whole lab. ``mtu=None`` picks what takes about 4 ms to send at the slowest
finite link rate, within 1500..65000 bytes: large packets keep the Python hub at a few hundred
packets per second even at 100 Mbit/s, and the 4 ms cap keeps one packet from holding up the next
for long on slow links. Loss is per IP packet, so with large packets a given ``loss`` costs TCP
less than it would on a 1500-byte internet path; pass ``mtu=1500`` for internet-sized packets
(the hub then forwards ~8000 packets/s per 100 Mbit/s, about a tenth of a core).

The hub asks for real-time round-robin scheduling (it blocks in epoll and uses a few percent of a
core), so a busy machine delays the peers' processes, as it would on their own hardware, rather
than the wire between them. Where it may not, a descheduled hub leaves packets in the tuns' queues
(``TUN_QUEUE``: the kernel's 500 lost 72% of a UDP burst in a 0.15 s stall), so a stall only delays.

Lifetime: ``with EmulatedNetwork(links) as net:`` builds everything and tears it down on exit,
also on exceptions and KeyboardInterrupt. While the block runs, SIGTERM and SIGHUP raise
:class:`LabTerminated` (a KeyboardInterrupt; see :mod:`swarmgrad.lab.signals`) in the main thread,
so a CLI gets cleanup by catching KeyboardInterrupt outside the ``with`` and exiting with
``exc.exit_code`` (130 for Ctrl-C). If the lab's process is killed with SIGKILL, the hub exits by
itself (its control pipe closes) and :func:`cleanup` ``(prefix)`` removes the namespaces and the
peer processes left behind; :func:`stale_prefixes` lists labs whose owning process is gone.

This module builds, runs and tears down the network. :func:`check_requirements` (what the machine
must have) is in :mod:`swarmgrad.lab.host`, the signal handling in :mod:`swarmgrad.lab.signals`, the
leftover sweep in :mod:`swarmgrad.lab.sweep`; the names other code uses are re-exported here.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import math
import os
import secrets
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.lab import nat
from swarmgrad.lab.host import check_requirements
from swarmgrad.lab.nat import NAT_TYPES
from swarmgrad.lab.signals import DeferredSignals, LabTerminated, restore_handlers, terminate_on_signals
from swarmgrad.lab.sweep import (
    ENV_MARKER,
    PREFIX_RE,
    cleanup,
    close_quietly,
    killpg,
    lab_namespaces,
    leftovers,
    run_tool,
    stale_prefixes,
    sweep,
    tun_temp_name,
)

TUN_NAME = "lab0"
IFB_NAME = "labdown"
HOSTS_PER_OCTET = 250  # peer i -> 11.77.<i // 250>.<i % 250 + 1>; keep in sync with hub.py
MAX_PEERS = HOSTS_PER_OCTET * 256
# Globally routable-looking on purpose: libp2p treats RFC 1918 and RFC 2544 addresses as private
# and never starts hole punching towards them, so a lab in 10/8 (its old range) or 198.18/15 could
# not show it. Nothing leaves the lab: its namespaces have no default route and the hub forwards
# only between lab addresses, so these addresses are never routed to the internet.
SUBNET = "11.77.0.0/16"
PREFIX_LEN = 16
MIN_MTU, MAX_MTU = 1500, 65000
SERIALIZATION_S = 0.004  # auto MTU: about this long on the wire at the slowest link
QUEUE_S = 0.1  # tbf queue: this much data at the link rate (a modest home-router buffer)
TUN_QUEUE = 10_000  # packets a tun holds for the hub (the kernel's default 500: ~20 ms of a burst)

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


@dataclass(frozen=True)
class LinkSpec:
    """One peer's access link. Rates in Mbit/s (``math.inf``: unshaped), one-way delay in ms,
    loss as the probability that a packet crossing this link (either way) is lost."""

    up_mbit: float
    down_mbit: float
    delay_ms: float
    loss: float
    nat: str = "none"  # "home", "symmetric" or "cgnat": routers in front of the peer (lab/nat.py)

    def __post_init__(self) -> None:
        for name in ("up_mbit", "down_mbit"):
            value = _number(self, name)
            if not value > 0:
                raise ConfigError(f"LinkSpec.{name} must be a positive rate in Mbit/s "
                                  f"(math.inf for no limit), got {value!r}")
        delay = _number(self, "delay_ms")
        if not (math.isfinite(delay) and 0 <= delay <= 60_000):
            raise ConfigError(f"LinkSpec.delay_ms must be a one-way delay between 0 and 60000 ms, got {delay!r}")
        loss = _number(self, "loss")
        if not 0 <= loss < 1:
            raise ConfigError(f"LinkSpec.loss must be a probability in [0, 1), got {loss!r}")
        if self.nat not in NAT_TYPES:
            raise ConfigError(f"LinkSpec.nat must be one of {', '.join(NAT_TYPES)}, got {self.nat!r}")


def _number(spec: LinkSpec, name: str) -> float:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"LinkSpec.{name} must be a number, got {value!r}")
    return float(value)


def address(i: int) -> str:
    """Peer ``i``'s IPv4 address in the lab (the address its processes should bind to)."""
    if not 0 <= i < MAX_PEERS:
        raise ConfigError(f"peer index must be in [0, {MAX_PEERS}), got {i}")
    return f"11.77.{i // HOSTS_PER_OCTET}.{i % HOSTS_PER_OCTET + 1}"


def namespace(prefix: str, i: int) -> str:
    return f"{prefix}-{i}"


def default_prefix() -> str:
    """``sglab-<pid>-<random>``: unique per run, and tells :func:`stale_prefixes` whose lab it is."""
    return f"sglab-{os.getpid()}-{secrets.token_hex(3)}"


def auto_mtu(links: Sequence[LinkSpec]) -> int:
    rates = [r for link in links for r in (link.up_mbit, link.down_mbit) if math.isfinite(r)]
    if not rates:
        return MAX_MTU
    return int(min(MAX_MTU, max(MIN_MTU, min(rates) * 1e6 / 8 * SERIALIZATION_S)))


class EmulatedNetwork:
    """A lab of ``len(links)`` peers; see the module docstring. Sync context manager.

    ``popen(i, argv)`` runs a process in peer ``i``'s namespace (tracked: killed on exit, with its
    process group); ``exec_argv(i, argv)`` gives the command line for callers that start processes
    themselves (those are killed on exit too, as is anything else left in the namespaces).
    """

    def __init__(
        self,
        links: Sequence[LinkSpec],
        prefix: str | None = None,
        *,
        mtu: int | None = None,
        handle_signals: bool = True,
        grace_s: float = 1.0,
    ):
        links = list(links)
        if not links:
            raise ConfigError("an emulated network needs at least one LinkSpec")
        if len(links) > MAX_PEERS:
            raise ConfigError(f"an emulated network holds at most {MAX_PEERS} peers, got {len(links)}")
        for link in links:
            if not isinstance(link, LinkSpec):
                raise ConfigError(f"links must be LinkSpec values, got {link!r}")
        if prefix is not None and not PREFIX_RE.match(prefix):
            raise ConfigError(f"lab prefix must be letters, digits, '_', '.', '-' (at most 151), got {prefix!r}")
        if mtu is not None and not (isinstance(mtu, int) and MIN_MTU <= mtu <= MAX_MTU):
            raise ConfigError(f"mtu must be an integer in [{MIN_MTU}, {MAX_MTU}], got {mtu!r}")
        self.links = links
        self.prefix = prefix or default_prefix()
        self.mtu = mtu or auto_mtu(links)
        self.handle_signals = handle_signals
        self.grace_s = grace_s
        self.tools: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        self._hub: subprocess.Popen | None = None
        self._tun_fds: list[int] = []
        self._old_handlers: dict[int, Any] = {}
        self._started = False
        self._closed = False
        self._owns_prefix = False  # set once this object starts creating things under the prefix

    # -- public API -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.links)

    def __enter__(self) -> EmulatedNetwork:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def namespace(self, i: int) -> str:
        self._check_index(i)
        return namespace(self.prefix, i)

    def address(self, i: int) -> str:
        """Where peer ``i``'s processes bind: its lab address, or behind a NAT its LAN address."""
        self._check_index(i)
        return nat.peer_address(i, self.links[i].nat) or address(i)

    def public_address(self, i: int) -> str:
        """Peer ``i``'s address on the lab's wire: its own, or its outermost NAT router's."""
        self._check_index(i)
        return address(i)

    def _edge_namespace(self, i: int) -> str:
        """The namespace that holds peer ``i``'s ``lab0``: its own, or its outermost router's."""
        return ([namespace(self.prefix, i)] + nat.router_namespaces(self.prefix, i, self.links[i].nat))[-1]

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """Command line that runs ``argv`` inside peer ``i``'s namespace."""
        return [self.tools.get("ip", "ip"), "netns", "exec", self.namespace(i), *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in peer ``i``'s namespace, in a new session (its own process group), tracked.

        Keyword arguments go to ``subprocess.Popen``; ``env`` is extended with the lab's marker.
        """
        if not self._started or self._closed:
            raise StartupError("the emulated network is not running: use popen inside `with EmulatedNetwork(...)`")
        env = kwargs.pop("env", None)
        env = dict(os.environ if env is None else env)
        env[ENV_MARKER] = self.prefix
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.exec_argv(i, argv), env=env, **kwargs)
        self._procs.append(process)
        return process

    def traffic(self, i: int) -> tuple[int, int]:
        """Bytes peer ``i`` has sent and received on its link so far, IP headers and retransmissions
        included (the kernel's counters of ``lab0``): the same measure for any software in the lab.
        Received bytes count before the link's loss is applied."""
        self._check_index(i)
        result = subprocess.run([self.tools.get("ip", "ip"), "-n", self._edge_namespace(i), "-s", "-j", "link", "show",
                                 TUN_NAME], capture_output=True, text=True, check=False, timeout=10)  # a local netlink read
        if result.returncode != 0:
            raise StartupError(f"cannot read the traffic counters of peer {i}: {result.stderr.strip()[-300:]}")
        stats = json.loads(result.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    @property
    def hub_pid(self) -> int | None:
        return self._hub.pid if self._hub else None

    def check(self) -> None:
        """Raise StartupError if the hub (the wire between all peers) has died; a driver can call
        this while it waits on its peers, since without the hub they only see silence."""
        if self._hub is None or self._hub.poll() is not None:
            code = None if self._hub is None else self._hub.returncode
            raise StartupError(f"the lab's packet hub is not running (exit code {code}); the peers are cut off")

    def start(self) -> None:
        """Build the lab; on any failure (or interrupt) undo what was built and raise."""
        if self._started:
            raise StartupError("this EmulatedNetwork was already started; create a new one")
        self._started = True
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self.tools = check_requirements()
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the lab's processes, stop the hub, delete the namespaces. Idempotent."""
        if self._closed or not self._started:
            return
        self._closed = True
        # A second Ctrl-C or SIGTERM must not abandon a half-done teardown.
        deferred = DeferredSignals()
        try:
            self._kill_tracked()
            for fd in self._tun_fds:  # only set if start failed before the hub took them
                close_quietly(fd)
            self._tun_fds = []
            if self._owns_prefix:
                sweep(self.prefix, hub=self._hub)
            self._hub = None
        finally:
            deferred.restore()
            self._restore_signal_handlers()
            atexit.unregister(self.close)
            deferred.redeliver()

    # -- building -------------------------------------------------------------------------------

    def _check_index(self, i: int) -> None:
        if not (isinstance(i, int) and 0 <= i < len(self.links)):
            raise ConfigError(f"peer index must be in [0, {len(self.links)}), got {i!r}")

    def _build(self) -> None:
        n = len(self.links)
        ip = self.tools["ip"]
        existing = leftovers(self.prefix)
        if existing:
            # Not ours to touch: close() must not sweep it, so _owns_prefix stays False.
            raise StartupError(f"lab prefix {self.prefix!r} is in use ({existing[0]}); pick another, or run "
                               f"swarmgrad.lab.network.cleanup({self.prefix!r}) if that lab is dead")
        self._owns_prefix = True
        names = [namespace(self.prefix, i) for i in range(n)]
        routers = [name for i in range(n) for name in nat.router_namespaces(self.prefix, i, self.links[i].nat)]
        # Namespaces first, then the tuns (opened here, in the root namespace, so that this process
        # holds their fds for the hub), then move each tun into its namespace (a NAT router's for
        # a peer behind one).
        run_tool([ip, "-batch", "-"], "\n".join(f"netns add {name}" for name in names + routers) + "\n")
        for i in range(n):
            self._tun_fds.append(_open_tun(tun_temp_name(self.prefix, i)))
        run_tool([ip, "-batch", "-"], "".join(
            f"link set {tun_temp_name(self.prefix, i)} netns {self._edge_namespace(i)}\n" for i in range(n)))
        for i, link in enumerate(self.links):
            self._configure(i, link)
            if link.nat != "none":
                self._build_routers(i, link)
        self._start_hub()

    def _configure(self, i: int, link: LinkSpec) -> None:
        ns = self._edge_namespace(i)
        ip_lines = [
            "link set lo up",
            f"link set {tun_temp_name(self.prefix, i)} name {TUN_NAME}",
            # addrgenmode none: no IPv6 link-local address, so no router solicitations to forward.
            f"link set {TUN_NAME} mtu {self.mtu} txqueuelen {TUN_QUEUE} addrgenmode none",
            f"addr add {address(i)}/{PREFIX_LEN} dev {TUN_NAME}",  # also the only route: the lab
            f"link set {TUN_NAME} up",
        ]
        tc_lines = []
        if math.isfinite(link.up_mbit):
            tc_lines.append(f"qdisc add dev {TUN_NAME} root {self._tbf(link.up_mbit)}")
        if math.isfinite(link.down_mbit):
            ip_lines += [f"link add {IFB_NAME} type ifb", f"link set {IFB_NAME} addrgenmode none",
                         f"link set {IFB_NAME} up"]
            tc_lines += [
                f"qdisc add dev {TUN_NAME} handle ffff: ingress",
                # u32 matching everything: matchall is not built into every kernel.
                (f"filter add dev {TUN_NAME} parent ffff: protocol all u32 match u32 0 0 "
                 f"action mirred egress redirect dev {IFB_NAME}"),
                f"qdisc add dev {IFB_NAME} root {self._tbf(link.down_mbit)}",
            ]
        run_tool([self.tools["ip"], "-n", ns, "-batch", "-"], "\n".join(ip_lines) + "\n")
        if tc_lines:
            run_tool([self.tools["tc"], "-n", ns, "-batch", "-"], "\n".join(tc_lines) + "\n")
        rules = self._loss_rules(i, "INPUT")
        if rules and link.nat == "none":  # a NAT router applies them in its FORWARD chain
            script = "*filter\n" + "\n".join(rules) + "\nCOMMIT\n"
            run_tool([self.tools["ip"], "netns", "exec", ns, self.tools["iptables-restore"]], script)

    def _loss_rules(self, i: int, chain: str) -> list[str]:
        rules = []
        for j, other in enumerate(self.links):
            if j != i and other.loss > 0:  # the sender's uplink loss, applied where it is silent
                rules.append(f"-A {chain} -i {TUN_NAME} -s {address(j)}/32 {_random_drop(other.loss)}")
        if self.links[i].loss > 0:  # this peer's downlink loss
            rules.append(f"-A {chain} -i {TUN_NAME} {_random_drop(self.links[i].loss)}")
        return rules

    def _build_routers(self, i: int, link: LinkSpec) -> None:
        """Peer ``i``'s NAT routers (lab/nat.py): a veth from the peer to the first router, and
        from it to the next; each router forwards, masquerades and lets in only established flows."""
        ip = self.tools["ip"]
        routers = nat.routers(i, link.nat, TUN_NAME)
        inner = [namespace(self.prefix, i)] + nat.router_namespaces(self.prefix, i, link.nat)
        for k, router in enumerate(routers):
            here, inside = inner[k + 1], inner[k]
            inside_if = nat.LAN_IF if k == 0 else nat.WAN_IF  # the peer's interface, or the inner router's outside
            run_tool([ip, "-n", here, "link", "add", nat.LAN_IF, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                      inside_if, "mtu", str(self.mtu), "netns", inside])
            run_tool([ip, "-n", here, "link", "set", nat.LAN_IF, "addrgenmode", "none"])
            run_tool([ip, "-n", inside, "link", "set", inside_if, "addrgenmode", "none"])
        run_tool([ip, "-n", inner[0], "-batch", "-"], "\n".join(["link set lo up", *nat.peer_lines(i)]) + "\n")
        for k, router in enumerate(routers):
            here = inner[k + 1]
            run_tool([ip, "-n", here, "-batch", "-"], "\n".join(["link set lo up", *nat.router_lines(router)]) + "\n")
            run_tool([ip, "netns", "exec", here, *nat.enable_forwarding_argv()])
            loss = self._loss_rules(i, "FORWARD") if router.outside_if == TUN_NAME else []
            run_tool([ip, "netns", "exec", here, self.tools["iptables-restore"]], nat.router_rules(router, loss))

    def _tbf(self, mbit: float) -> str:
        rate_bytes = mbit * 1e6 / 8
        # The bucket must hold a whole packet (tbf drops bigger ones); two let TCP keep the link
        # busy. The queue holds QUEUE_S of data, and at least a few packets.
        burst = max(2 * self.mtu, int(rate_bytes * 0.002))
        limit = max(4 * self.mtu, int(rate_bytes * QUEUE_S))
        return f"tbf rate {int(mbit * 1e6)}bit burst {burst} limit {limit}"

    def _start_hub(self) -> None:
        env = dict(os.environ)
        env[ENV_MARKER] = self.prefix
        # The hub imports swarmgrad.lab.hub; make sure it resolves to this checkout.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        argv = [
            sys.executable, "-m", "swarmgrad.lab.hub", "--prefix", self.prefix,
            "--tun-fds", ",".join(map(str, self._tun_fds)),
            "--delays-ms", ",".join(repr(float(link.delay_ms)) for link in self.links),
        ]
        # stdin is the control pipe (EOF stops the hub); its own session keeps it out of the
        # terminal's Ctrl-C, since this process decides when the wire goes away.
        self._hub = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     pass_fds=self._tun_fds, start_new_session=True)
        line = _readline_with_timeout(self._hub.stdout, 60.0)  # generous: a loaded machine is slow
        if line.strip() != b"ready":
            code = self._hub.poll()
            raise StartupError(f"the lab's packet hub did not start (exit code {code}); see its stderr above")
        # The hub has its own copies now; ours would keep the tuns alive after the hub is gone.
        for fd in self._tun_fds:
            close_quietly(fd)
        self._tun_fds = []

    # -- teardown -------------------------------------------------------------------------------

    def _kill_tracked(self) -> None:
        # SIGTERM to each live process group, a grace period, then SIGKILL. Only groups whose leader
        # is not yet reaped: a reaped leader's pid may belong to someone else by now. Group members
        # that outlived their leader are still in the namespace (or carry the marker): _sweep.
        live = [p for p in self._procs if p.poll() is None]
        for process in live:
            killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in live:
            if process.poll() is None:
                killpg(process.pid, signal.SIGKILL)
        for process in live:
            try:
                process.wait(timeout=5)  # after SIGKILL
            except subprocess.TimeoutExpired:
                pass

    # -- signals --------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if self.handle_signals:
            self._old_handlers = terminate_on_signals()

    def _restore_signal_handlers(self) -> None:
        restore_handlers(self._old_handlers)
        self._old_handlers = {}


# -- small helpers ------------------------------------------------------------------------------


def _random_drop(probability: float) -> str:
    return f"-m statistic --mode random --probability {probability:.6f} -j DROP"


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as error:
        os.close(fd)
        raise StartupError(f"could not create tun device {name}: {error}") from error
    return fd


def _readline_with_timeout(stream: Any, timeout: float) -> bytes:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            return b""
    return stream.readline()


__all__ = [
    "EmulatedNetwork", "LabTerminated", "LinkSpec", "address", "auto_mtu", "check_requirements",
    "cleanup", "default_prefix", "lab_namespaces", "leftovers", "namespace", "stale_prefixes",
]
