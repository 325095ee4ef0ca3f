"""Finding and removing what a lab left behind: its namespaces, stranded tun devices and processes.

Used by :class:`~swarmgrad.lab.network.EmulatedNetwork` on exit, and by ``swarmgrad lab clean``
after a lab was SIGKILLed. Everything is found by the lab's prefix, never by guesswork.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from swarmgrad.errors import ConfigError, StartupError

# Marks every process the lab starts (hub and peers), so cleanup finds them even after their
# namespace is gone; inherited by their children.
ENV_MARKER = "SWARMGRAD_LAB"
NETNS_DIR = Path("/run/netns")
PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,150}$")


def tun_temp_name(prefix: str, i: int) -> str:
    # A tun is created in the root namespace before it moves into its peer's namespace (where it
    # is renamed lab0), so its first name must be unique on the machine, at most 15 characters,
    # and derivable from the prefix so that cleanup can find one stranded by a crash.
    return f"sg{hashlib.sha1(prefix.encode()).hexdigest()[:6]}t{i}"


def tun_temp_stem(prefix: str) -> str:
    return tun_temp_name(prefix, 0)[:-1]


# -- leftovers ----------------------------------------------------------------------


def lab_namespaces(prefix: str) -> list[str]:
    """The namespaces named ``<prefix>-<i>`` (a peer's) or ``<prefix>-<i>-nat|cgn`` (its NAT routers) that exist now."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)(?:-nat|-cgn)?$")
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    found = [(match, name) for name in names if (match := pattern.match(name))]
    return [name for match, name in sorted(found, key=lambda item: (int(item[0].group(1)), item[1]))]


def root_links(prefix: str) -> list[str]:
    stem = tun_temp_stem(prefix)
    return [name for _index, name in socket.if_nameindex() if name.startswith(stem) and name[len(stem):].isdigit()]


def lab_processes(prefix: str) -> dict[int, str]:
    """Live (not zombie) processes in the lab's namespaces or carrying its marker: pid -> command."""
    ns_ids = set()
    for name in lab_namespaces(prefix):
        try:
            st = os.stat(NETNS_DIR / name)
            ns_ids.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    marker = f"{ENV_MARKER}={prefix}".encode()
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            if stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"Z":
                continue  # exited, waiting to be reaped: holds no namespace or device
            hit = False
            if ns_ids:
                st = os.stat(f"/proc/{pid}/ns/net")
                hit = (st.st_dev, st.st_ino) in ns_ids
            if not hit:
                hit = marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if hit:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[pid] = cmdline.strip()[:200]
        except (OSError, ValueError):
            continue  # gone meanwhile, or a kernel thread
    return found


def leftovers(prefix: str) -> list[str]:
    """Everything of lab ``prefix`` that still exists: namespaces, root-namespace links, processes."""
    items = [f"netns {name}" for name in lab_namespaces(prefix)]
    items += [f"link {name}" for name in root_links(prefix)]
    items += [f"process {pid} {cmd}" for pid, cmd in sorted(lab_processes(prefix).items())]
    return items


def cleanup(prefix: str) -> list[str]:
    """Remove what is left of lab ``prefix`` (e.g. after its process was SIGKILLed); returns what it found."""
    if not PREFIX_RE.match(prefix):
        raise ConfigError(f"not a lab prefix: {prefix!r}")
    found = leftovers(prefix)
    sweep(prefix, hub=None)
    return found


def stale_prefixes() -> list[str]:
    """Prefixes of default-named labs (``sglab-<pid>-<hex>``) whose owning process is gone."""
    pattern = re.compile(r"^(sglab-(\d+)-[0-9a-f]+)-\d+$")
    stale = set()
    for name in os.listdir(NETNS_DIR) if NETNS_DIR.exists() else []:
        match = pattern.match(name)
        if match and not Path(f"/proc/{match.group(2)}").exists():
            stale.add(match.group(1))
    return sorted(stale)


def sweep(prefix: str, hub: subprocess.Popen | None) -> None:
    """Kill the lab's processes, stop the hub, delete namespaces and stray links. Best effort, in order."""
    # Whatever still runs in the namespaces (started via exec_argv, or children that left their
    # process group) goes first, and hard: the tracked processes already had their grace period.
    kill_all(lambda: {pid for pid in lab_processes(prefix) if hub is None or pid != hub.pid})
    if hub is not None:
        if hub.stdin:
            close_quietly(hub.stdin)  # EOF on the control pipe: the hub exits and its tuns vanish
        try:
            hub.wait(timeout=3)  # it exits at once on EOF; one that does not is killed
        except subprocess.TimeoutExpired:
            hub.kill()
            hub.wait(timeout=5)  # SIGKILL: only the kernel's own cleanup remains
        if hub.stdout:
            close_quietly(hub.stdout)
    kill_all(lambda: set(lab_processes(prefix)))
    ip = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or "ip"
    names = lab_namespaces(prefix)
    if names:
        # Deleting the name frees the namespace once no process is left in it; with it go its ifb
        # device, qdiscs and iptables rules.
        run_tool([ip, "-force", "-batch", "-"], "".join(f"netns del {name}\n" for name in names), check=False)
    for link in root_links(prefix):
        run_tool([ip, "link", "del", link], check=False)


def kill_all(current: Any, timeout: float = 5.0) -> None:  # SIGKILLed processes vanish in milliseconds
    pids = current()
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)
        pids = current()


def run_tool(argv: list[str], stdin: str | None = None, check: bool = True) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()
        raise StartupError(f"building the emulated network failed: `{' '.join(argv)}` exited "
                           f"{result.returncode}: {detail[-600:]}")


def close_quietly(thing: Any) -> None:
    try:
        if isinstance(thing, int):
            os.close(thing)
        else:
            thing.close()
    except OSError:
        pass


def killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
