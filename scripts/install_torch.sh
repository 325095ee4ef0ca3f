#!/usr/bin/env bash
# Install a torch build that can use this machine's NVIDIA GPU, when it has one; setup.sh runs this
# before it installs requirements-pins.txt. Usage: install_torch.sh VENV_PYTHON
#
# Without a GPU (nvidia-smi missing or listing none) it does nothing: requirements-pins.txt's
# `torch==V` then installs whatever pip prefers for that pin (here the local +cpu wheel of pip's
# find-links; on a volunteer's machine without a GPU, PyPI's wheel, which runs on the CPU too).
#
# With a GPU, on Linux x86_64: PyPI's plain `torch-V-cpXY-cpXY-manylinux_2_28_x86_64.whl` IS the CUDA
# build (torch 2.13.0's: CUDA 13.0, its runtime, cuBLAS, cuDNN and NCCL in nvidia-* wheels; no system
# CUDA toolkit needed, only the driver). It is asked for as `torch===V` (PEP 440 arbitrary equality):
# `==V` also matches local builds such as `V+cpu`, which pip prefers when a find-links folder or a
# mirror offers one. requirements-pins.txt's `torch==V` is then already satisfied and left alone.
# SWARMGRAD_TORCH_INDEX=URL installs from that index instead (e.g. download.pytorch.org's cu126 index
# for a driver too old for CUDA 13), with `==V` since those builds carry a +cuXYZ label.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    exit 0  # no NVIDIA GPU: today's CPU path, untouched
fi
TORCH=$(sed -n 's/^torch==\([^[:space:]#]*\).*/\1/p' requirements-pins.txt)
if [ -z "$TORCH" ]; then
    echo "setup: error: requirements-pins.txt pins no torch version" >&2
    exit 2
fi
echo "setup: nvidia-smi lists a GPU: $(nvidia-smi -L | head -n 1)" >&2
if [ -n "${SWARMGRAD_TORCH_INDEX:-}" ]; then
    echo "setup: installing torch==$TORCH from $SWARMGRAD_TORCH_INDEX" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check --index-url "$SWARMGRAD_TORCH_INDEX" "torch==$TORCH"
elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    echo "setup: installing torch $TORCH with CUDA (PyPI's wheel, about 3 GB with its nvidia-* wheels)" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check "torch===$TORCH"
else
    echo "setup: warning: PyPI has no CUDA build of torch for $(uname -s) $(uname -m); set" \
         "SWARMGRAD_TORCH_INDEX to an index that has one (see pytorch.org), or the peer trains on the CPU" >&2
    exit 0
fi

# A CUDA build the driver is too old for imports fine and sees no GPU: say so, and what fixes it.
"$PY" - <<'EOF' >&2 || true
import torch

cuda = torch.version.cuda
if torch.cuda.is_available():
    print(f"setup: torch {torch.__version__} (CUDA {cuda}) uses {torch.cuda.get_device_name(0)}")
else:
    # the oldest Linux driver each CUDA major version runs on (NVIDIA's minor version compatibility)
    minimum = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}.get((cuda or "").split(".")[0], "?")
    print(f"setup: WARNING: torch {torch.__version__} (CUDA {cuda}) cannot use the GPU nvidia-smi lists. "
          f"CUDA {cuda} needs NVIDIA driver >= {minimum}: update the driver (`nvidia-smi` shows yours), or "
          "install a torch for an older CUDA: SWARMGRAD_TORCH_INDEX=https://download.pytorch.org/whl/cu126 "
          "bash scripts/setup.sh. Until then peers train on the CPU (--device cpu). `swarmgrad doctor` checks again.")
EOF
