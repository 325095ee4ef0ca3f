"""The device and precision a peer trains with, resolved from what the user asked for.

``auto`` means: a CUDA GPU when torch can use one (then Apple's MPS), else the CPU; bf16 autocast
where the GPU supports it, fp16 with a loss scaler on older CUDA cards (bf16 broke pre-Ampere cards
in Psyche's runs), fp32 on the CPU. What was asked for and cannot be had is an error that says why,
never a silent fallback: a volunteer who asked for ``cuda`` and trains on the CPU would never know.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Literal

import torch

from swarmgrad.device import DEVICE_PATTERN, PrecisionName
from swarmgrad.errors import ConfigError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str = "auto") -> torch.device:
    """The device ``spec`` names (``auto|cpu|cuda|cuda:N|mps``), checked to be usable here."""
    if not re.fullmatch(DEVICE_PATTERN, spec):
        raise ConfigError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {spec!r}")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {spec}: this torch build ({torch.__version__}) cannot use a CUDA GPU here "
                              f"({_cuda_missing_reason()}); run `swarmgrad doctor`, or use --device cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", index)
    if device.type == "mps" and not _mps_available():
        raise ConfigError("--device mps: this torch build or machine has no MPS (Apple GPU) backend")
    return device


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _cuda_missing_reason() -> str:
    if torch.version.cuda is None:
        return "it is a CPU-only build"
    return f"built for CUDA {torch.version.cuda}, but no usable GPU or driver was found"


@dataclass(frozen=True)
class Precision:
    """How the forward and backward passes run: ``dtype`` under autocast (fp32: no autocast), and
    whether fp16's loss scaler is needed (its inf steps are skipped: ``Peer(grad_scaler=...)``)."""

    name: Literal["fp32", "bf16", "fp16"]
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass (and its loss) runs in."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A loss scaler for fp16 (None otherwise)."""
        return torch.amp.GradScaler(self.device_type) if self.needs_scaler else None


def resolve_precision(spec: PrecisionName, device: torch.device) -> Precision:
    """The precision ``spec`` names on ``device``; ``auto``: bf16 where supported, fp16 on older CUDA
    cards, fp32 on the CPU (autocast there is slower than fp32 on most CPUs)."""
    if spec not in ("auto", *_DTYPES):
        raise ConfigError(f"--precision must be auto, fp32, bf16 or fp16, got {spec!r}")
    if spec == "auto":
        if device.type == "cuda":
            return Precision("bf16" if torch.cuda.is_bf16_supported() else "fp16", "cuda")
        return Precision("fp32", device.type)
    if spec == "fp16" and device.type == "cpu":
        raise ConfigError("--precision fp16 needs a GPU (fp16 on the CPU is slow and unscaled); use bf16 or fp32")
    if spec == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--precision bf16: this GPU does not support bfloat16; use fp16 (with its loss scaler) "
                          "or auto")
    return Precision(spec, device.type)


def move_batch(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``: on CUDA through pinned memory with a non-blocking copy, so the copy
    overlaps the previous step's kernels (nanoGPT's way); as it is elsewhere."""
    if batch.device == device:
        return batch
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)
