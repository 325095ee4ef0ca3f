"""scripts/install_torch.sh's choice of torch build, with nvidia-smi and the venv's python faked (a
real run downloads gigabytes; setup.sh's CPU path runs for real in CI)."""

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_torch.sh"
PINNED = re.search(r"^torch==(\S+)", (ROOT / "requirements-pins.txt").read_text(), re.M).group(1)


def run(tmp_path: Path, gpus: str | None, **env: str) -> list[str]:
    """The script's pip calls (the fake python's argument lists), one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncat > /dev/null\n')  # swallows the check's script
    python.chmod(0o755)
    if gpus is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}" if gpus is not None else _path_without_nvidia_smi(bin_dir)
    result = subprocess.run(["bash", str(SCRIPT), str(python)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": path, **env})
    assert result.returncode == 0, result.stderr
    return calls.read_text().splitlines() if calls.exists() else []


def _path_without_nvidia_smi(bin_dir: Path) -> str:
    kept = [d for d in os.environ["PATH"].split(":") if not (Path(d) / "nvidia-smi").exists()]
    return ":".join([str(bin_dir), *kept])


def test_without_a_gpu_nothing_is_installed_and_the_pins_decide(tmp_path):
    assert run(tmp_path, None) == []


def test_nvidia_smi_listing_no_gpu_is_no_gpu(tmp_path):
    assert run(tmp_path, "No devices found.\\n") == []


@pytest.mark.skipif(f"{platform.system()}-{platform.machine()}" != "Linux-x86_64", reason="PyPI's CUDA wheel is Linux x86_64's")
def test_a_listed_gpu_gets_pypis_plain_wheel_of_the_pinned_version_then_the_check(tmp_path):
    calls = run(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\n")
    # ===: the plain version only, so a local +cpu wheel on find-links cannot win
    assert calls[0].endswith(f"-m pip install --quiet --disable-pip-version-check torch==={PINNED}")
    assert calls[1] == "-"  # then torch.cuda.is_available() is checked
    assert len(calls) == 2


def test_an_index_given_is_used_for_the_pinned_version(tmp_path):
    url = "https://download.pytorch.org/whl/cu126"
    calls = run(tmp_path, "GPU 0: Tesla T4 (UUID: GPU-2)\\n", SWARMGRAD_TORCH_INDEX=url)
    assert calls[0].endswith(f"--index-url {url} torch=={PINNED}")
