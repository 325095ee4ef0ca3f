"""Micro-batches: a batch of the run's size computed in slices a device can hold, gradients
accumulated, so any GPU can join any run. The gradient equals the full batch's for a loss that is a
mean over samples (each slice's loss is weighted by its share of the batch)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from swarmgrad.device.placement import Precision

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accumulate_gradients(model: torch.nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                         micro_batch: int, precision: Precision,
                         scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Forward and backward over ``inputs`` in slices of ``micro_batch`` samples; the gradients
    accumulate in ``.grad``. Returns the batch's mean loss, detached and on the device (reading it
    would make the host wait for the GPU: the caller decides when)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    total = len(targets)
    mean_loss = torch.zeros((), device=targets.device)
    for start in range(0, total, micro_batch):
        x, y = inputs[start:start + micro_batch], targets[start:start + micro_batch]
        with precision.autocast():
            loss = loss_fn(model(x), y) * (len(y) / total)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        mean_loss += loss.detach().float()
    return mean_loss


def largest_micro_batch(batch_size: int, try_batch: Callable[[int], None], device: torch.device) -> int:
    """The largest micro-batch (``batch_size``, then halves) for which ``try_batch(n)`` (one forward
    and backward of n samples) runs out of no device memory (CUDA's out-of-memory error)."""
    size = batch_size
    while True:
        try:
            try_batch(size)
            return size
        except torch.cuda.OutOfMemoryError:
            if size == 1:
                raise
            logger.info("a micro-batch of %d does not fit on %s; trying %d", size, device, (size + 1) // 2)
            size = (size + 1) // 2
        finally:
            torch.cuda.empty_cache()
