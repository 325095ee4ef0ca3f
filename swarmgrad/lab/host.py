"""What the emulated network needs from this machine: root, the ``ip``/``tc``/``iptables`` tools and a tun device.

:func:`check_requirements` says what is missing and how to get it, before anything is built.
"""

from __future__ import annotations

import os
import shutil

from swarmgrad.errors import StartupError

_TOOLS = {
    "ip": "apt-get install -y iproute2",
    "tc": "apt-get install -y iproute2",
    "iptables": "apt-get install -y iptables",
    "iptables-restore": "apt-get install -y iptables",
}


def check_requirements() -> dict[str, str]:
    """Absolute paths of the tools the lab needs; StartupError saying what is missing and how to get it."""
    if os.geteuid() != 0:
        raise StartupError("the emulated network needs root (network namespaces, tun devices, tc, iptables); "
                           "run it with sudo or as root")
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    tools: dict[str, str] = {}
    missing = []
    for tool, install in _TOOLS.items():
        found = shutil.which(tool, path=search)
        if found:
            tools[tool] = found
        else:
            missing.append(f"{tool} ({install})")
    if missing:
        raise StartupError("the emulated network needs " + ", ".join(missing))
    if not os.path.exists("/dev/net/tun"):
        raise StartupError("the emulated network needs /dev/net/tun (the tun driver); "
                           "in a container, pass --device /dev/net/tun")
    return tools


__all__ = ["check_requirements"]
