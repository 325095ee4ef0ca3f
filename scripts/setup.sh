#!/usr/bin/env bash
# Set up swarmgrad in ./.venv (idempotent): torch (its CUDA build when nvidia-smi lists a GPU,
# scripts/install_torch.sh; else the CPU build), hivemind with its p2pd, the package
# itself with its test tools, the offline datasets the demo and tests train on, and (as root) the
# tools some tests need: iptables for the swarm lab, chromium for the dashboard.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: swarmgrad needs Python >= 3.10; set PYTHON=/path/to/python3.11" >&2
    exit 2
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    "$PYTHON" -m venv .venv
fi

# A GPU's torch first (nothing without one); then the exact pins: an unpinned torch would pull a
# multi-GB CUDA build where no GPU can use it.
bash scripts/install_torch.sh .venv/bin/python
echo "setup: installing torch, hivemind and swarmgrad into .venv" >&2
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements-pins.txt
.venv/bin/pip install --quiet --disable-pip-version-check -c requirements-pins.txt -e ".[dev,frameworks]"

# Real Fashion-MNIST, offline, from Debian (the fashion-mnist task reads it from here).
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing Debian's dataset-fashion-mnist" >&2
        apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null; }
    else
        echo "setup: warning: Fashion-MNIST is missing; run 'sudo apt-get install dataset-fashion-mnist'" \
             "or pass --data-dir to the fashion-mnist task" >&2
    fi
fi
# The swarm lab (network namespaces with rate limits, delay and loss) needs iproute2 and iptables.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v iptables >/dev/null; then
    echo "setup: installing iptables (for the swarm lab)" >&2
    apt-get install -y -qq iptables iproute2 >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq iptables iproute2 >/dev/null; } \
        || echo "setup: warning: could not install iptables; 'swarmgrad lab' will say what is missing" >&2
fi
# The dashboard's test loads its page in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing chromium (the dashboard's test loads its page in it)" >&2
        apt-get install -y -qq chromium >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null; } \
            || echo "setup: warning: could not install chromium; tests/dashboard/test_dashboard.py will fail" >&2
    else
        echo "setup: warning: chromium is missing; run 'sudo apt-get install chromium' for the dashboard's test" >&2
    fi
fi
echo "setup: done ($(.venv/bin/swarmgrad --version))" >&2
