"""``swarmgrad doctor``: what a volunteer needs to know before joining a run.

The torch build and whether it can use this machine's GPU, what ``--device auto`` and
``--precision auto`` resolve to, the micro-batch a peer would pick for a task, whether the libp2p
daemon (p2pd, shipped inside hivemind) is there, and, with ``--reachability``, whether a node
starts. Each answer is measured here, with the same functions the peer uses (device/placement.py,
device/microbatch.py), so doctor and peer cannot disagree.

Registered on the app by :func:`register`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import typer

from swarmgrad.commands.exits import call_reporting_errors

GiB = 2**30
# the oldest Linux driver each CUDA major version runs on (NVIDIA's minor version compatibility)
MIN_DRIVER = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}
REACHABILITY_LATER = ("checked once the peer runs: an initial peer dials it back (dht/reachability.py); "
                      "`swarmgrad status` lists it as public, relayed or client")


def register(app: typer.Typer) -> None:
    """Add ``doctor`` to ``app``."""
    app.command()(doctor)


def doctor(
    task: str = typer.Option("digits", "--task", help="Task whose micro-batch to probe (the largest that fits the "
                             "GPU's free memory, as `swarmgrad peer --micro-batch` auto picks it)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Directory the task reads its data from."),
    reachability: bool = typer.Option(False, "--reachability", help="Also start a libp2p node briefly on loopback "
                                      "(p2pd and the DHT) and say what it can tell about reachability.",
                                      show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of lines.",
                                     show_default=False),
) -> None:
    """Check this machine for training: torch build, GPU, memory, precision, micro-batch, p2pd."""
    report = call_reporting_errors(lambda: diagnose(task, data_dir, reachability))
    typer.echo(json.dumps(report, indent=2) if json_output else render(report))


def diagnose(task: str = "digits", data_dir: str | None = None, reachability: bool = False) -> dict[str, Any]:
    """Everything doctor reports, as a JSON-ready dict."""
    import torch

    from swarmgrad.device.placement import resolve_device, resolve_precision
    from swarmgrad.version import __version__

    device = resolve_device("auto")
    precision = resolve_precision("auto", device)
    report: dict[str, Any] = {
        "swarmgrad": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "build": torch_build(),
        "nvidia_smi": nvidia_smi_gpus(),
        "device": str(device),
        "gpus": gpus(),
        "precision": precision.name,
        "micro_batch": micro_batch(task, data_dir, device, precision),
        "p2pd": find_p2pd(),
        "reachability": start_node() if reachability else {"checked": False, "note": REACHABILITY_LATER},
    }
    report["warnings"] = warnings(report)
    return report


def torch_build() -> str:
    """``cpu-only``, ``cuda X.Y`` or ``rocm X.Y``: what this torch was compiled for."""
    import torch

    if getattr(torch.version, "hip", None):
        return f"rocm {torch.version.hip}"
    if torch.version.cuda:
        return f"cuda {torch.version.cuda}"
    return "cpu-only"


def nvidia_smi_gpus() -> list[str] | None:
    """The GPUs NVIDIA's driver lists (``nvidia-smi -L``), or None without the driver's tool: a GPU
    listed here that torch cannot use means a CPU torch build or a driver too old for its CUDA."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        # a local query, no bytes to move: 15 s only bounds a hung driver, which doctor then reports
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.startswith("GPU ")]


def gpus() -> list[dict[str, Any]]:
    """Each CUDA (or ROCm) device torch can use: name, memory, compute capability, bf16."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        major, minor = torch.cuda.get_device_capability(index)
        with torch.cuda.device(index):
            bf16 = bool(torch.cuda.is_bf16_supported())
        found.append({"index": index, "name": torch.cuda.get_device_name(index), "total_bytes": int(total),
                      "free_bytes": int(free), "capability": f"{major}.{minor}", "bf16": bf16})
    return found


def micro_batch(task_name: str, data_dir: str | None, device: Any, precision: Any) -> dict[str, Any]:
    """The micro-batch ``--micro-batch`` auto picks for ``task_name``: probed on a GPU (the runner's
    way: the largest of the batch, then halves, whose forward and backward fit), the whole batch on
    the CPU (host memory is not probed)."""
    import torch

    from swarmgrad.tasks.registry import get_task

    task = get_task(task_name, None, data_dir)
    batch_size = int(task.default_hparams.get("batch_size", 64))
    answer: dict[str, Any] = {"task": task_name, "batch_size": batch_size}
    if device.type != "cuda":
        return answer | {"size": batch_size, "probed": False, "note": "whole batch (the CPU is not probed)"}
    probed = _probe(task, batch_size, device, precision)
    torch.cuda.empty_cache()  # the probe's model and batch are gone with its frame
    size = probed["size"]
    return answer | probed | {"probed": True,
                              "note": "whole batch" if size == batch_size else f"{batch_size} in slices of {size}"}


def _probe(task: Any, batch_size: int, device: Any, precision: Any) -> dict[str, Any]:
    import torch

    from swarmgrad.device.microbatch import accumulate_gradients, largest_micro_batch
    from swarmgrad.tasks.base import endless_batches

    model = task.make_model().to(device)
    inputs, targets = next(endless_batches(task.train_data(0, 1, 0), batch_size, seed=0))
    inputs, targets = inputs.to(device), targets.to(device)
    torch.cuda.reset_peak_memory_stats(device)

    def one_pass(size: int) -> None:
        accumulate_gradients(model, task.loss_fn, inputs[:size], targets[:size], size, precision)
        model.zero_grad(set_to_none=True)

    size = largest_micro_batch(batch_size, one_pass, device)
    return {"size": size, "parameters": sum(p.numel() for p in model.parameters()),
            "peak_bytes": int(torch.cuda.max_memory_allocated(device))}


def find_p2pd() -> dict[str, Any]:
    """hivemind's p2pd binary, where hivemind's P2P starts it from (hivemind/hivemind_cli/p2pd),
    found without importing hivemind (its import takes seconds)."""
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return {"found": False, "path": None, "note": "hivemind is not installed: run scripts/setup.sh"}
    path = Path(list(spec.submodule_search_locations)[0]) / "hivemind_cli" / "p2pd"
    found = path.is_file() and os.access(path, os.X_OK)
    return {"found": found, "path": str(path),
            "note": "" if found else "hivemind is installed without its p2pd: reinstall hivemind (pip install "
                                     "--force-reinstall hivemind) on a platform it ships p2pd for"}


def start_node() -> dict[str, Any]:
    """Start a node on loopback (no UPnP, no AutoNAT, no IPFS bootstrap: NodeConfig's loopback
    defaults) and stop it: p2pd and the DHT work here. Reachability needs a peer elsewhere to dial
    this machine back, so it is checked when the peer joins a run, not here."""
    from swarmgrad.dht.config import NodeConfig
    from swarmgrad.dht.node import SwarmNode
    from swarmgrad.eventloop import run

    async def up() -> list[str]:
        async with SwarmNode(NodeConfig(host="127.0.0.1", port=0)) as node:
            return node.maddrs

    try:
        maddrs = run(up())
    except Exception as error:  # noqa: BLE001 - what failed is the answer
        return {"checked": True, "node_started": False, "error": f"{type(error).__name__}: {error}",
                "note": REACHABILITY_LATER}
    return {"checked": True, "node_started": True, "maddrs": maddrs, "note": REACHABILITY_LATER}


def warnings(report: dict[str, Any]) -> list[str]:
    """What stands between this machine and training on its GPU, with the fix."""
    found: list[str] = []
    listed = report["nvidia_smi"]
    if listed and not report["gpus"]:
        if report["build"] == "cpu-only":
            found.append(f"nvidia-smi lists {len(listed)} GPU(s) but torch {report['torch']} is a CPU-only build: "
                         "run scripts/setup.sh again (it installs the CUDA build when nvidia-smi lists a GPU)")
        else:
            major = report["build"].split()[-1].split(".")[0]
            found.append(f"nvidia-smi lists {len(listed)} GPU(s) but torch ({report['build']}) cannot use them: the "
                         f"driver is probably older than it needs (>= {MIN_DRIVER.get(major, '?')}; `nvidia-smi` "
                         "shows yours), or CUDA_VISIBLE_DEVICES hides them; see scripts/install_torch.sh")
    if not report["p2pd"]["found"]:
        found.append(f"p2pd not found: {report['p2pd']['note']}")
    node = report["reachability"]
    if node.get("checked") and not node.get("node_started"):
        found.append(f"a libp2p node did not start here: {node.get('error')}")
    return found


def render(report: dict[str, Any]) -> str:
    """The report as aligned lines for a terminal."""
    rows = [("swarmgrad", f"{report['swarmgrad']} (python {report['python']})"),
            ("torch", f"{report['torch']} ({report['build']} build)")]
    if report["nvidia_smi"] is not None:
        rows.append(("nvidia-smi", "; ".join(report["nvidia_smi"]) or "lists no GPU"))
    rows.append(("device auto", report["device"]))
    for gpu in report["gpus"]:
        rows.append((f"GPU {gpu['index']}", f"{gpu['name']}: {gpu['total_bytes'] / GiB:.1f} GiB, "
                     f"{gpu['free_bytes'] / GiB:.1f} GiB free, compute {gpu['capability']}, "
                     f"bf16 {'yes' if gpu['bf16'] else 'no'}"))
    if not report["gpus"]:
        rows.append(("GPUs", "none torch can use"))
    rows.append(("precision auto", report["precision"] + (" (with a loss scaler)" if report["precision"] == "fp16"
                                                          else "")))
    batch = report["micro_batch"]
    rows.append(("micro-batch auto", f"{batch['size']} of {batch['task']}'s batch {batch['batch_size']}: {batch['note']}"))
    p2pd = report["p2pd"]
    rows.append(("p2pd", f"found: {p2pd['path']}" if p2pd["found"] else f"MISSING: {p2pd['note']}"))
    node = report["reachability"]
    if not node.get("checked"):
        rows.append(("reachability", f"{node['note']} (--reachability starts a node here)"))
    elif node.get("node_started"):
        rows.append(("node", f"started on loopback: {' '.join(node['maddrs'])}"))
        rows.append(("reachability", node["note"]))
    else:
        rows.append(("node", f"FAILED: {node['error']}"))
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines += [f"warning: {warning}" for warning in report["warnings"]]
    return "\n".join(lines)
