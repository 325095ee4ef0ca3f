"""What a training task is: a model factory, a loss, sharded training data and a held-out set
(``Task``), built by name from the options it declares (``TaskFactory``, ``TaskOptions``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pydantic
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from swarmgrad.errors import ConfigError
from swarmgrad.settings import SettingsModel

EVAL_BATCH_SIZE = 1000


@dataclass
class Task:
    """A built-in or user-supplied training problem; knows torch and data, nothing of networking.

    ``train_data(shard, num_shards, seed)`` returns this peer's disjoint part of the training set: a
    map-style dataset, or an ``IterableDataset`` of (input, target) samples, one pass per iteration,
    for data too large to index (``lm``); ``test_data()`` the held-out set that ``evaluate`` scores. ``make_model`` must be deterministic
    given ``torch.manual_seed`` so that peers can start from identical weights.
    """

    name: str
    make_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    train_data: Callable[[int, int, int], Dataset]
    test_data: Callable[[], Dataset]
    default_hparams: dict[str, Any] = field(default_factory=dict)
    # Identifies the data actually read (files, sizes, digests), so a public run can tell peers
    # that would train on different data apart. None when the task cannot tell.
    data_fingerprint: Callable[[], str] | None = None
    # A language task's bytes of text per target token: ``evaluate`` then also reports bits per byte
    bytes_per_token: float | None = None

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, max_batches: int | None = None,
                 batch_size: int | None = None) -> dict[str, float]:
        """Mean loss and accuracy (argmax over the last logit dimension) on the held-out set.

        Both are averaged over targets, so for a language model "accuracy" is next-token accuracy.
        The model's train/eval mode is restored afterwards.
        """
        batch_size = batch_size or int(self.default_hparams.get("eval_batch_size", EVAL_BATCH_SIZE))
        was_training = model.training
        model.eval()
        device = next(model.parameters(), torch.empty(0)).device
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for index, (inputs, targets) in enumerate(batches(self.test_data(), batch_size)):
                if max_batches is not None and index >= max_batches:
                    break
                inputs, targets = inputs.to(device), targets.to(device)
                logits = model(inputs)
                loss_sum += float(self.loss_fn(logits, targets)) * targets.numel()
                correct += int((logits.argmax(dim=-1) == targets).sum())
                count += targets.numel()
        finally:
            model.train(was_training)
        if count == 0:
            raise ConfigError(f"task {self.name!r} has an empty held-out set")
        result = {"loss": loss_sum / count, "accuracy": correct / count, "samples": float(count)}
        if self.bytes_per_token:
            result["bits_per_byte"] = result["loss"] / math.log(2) / self.bytes_per_token
        return result


class TaskOptions(pydantic.BaseModel):
    """A task's options (``RunConfig.task_options``, ``--task-option NAME=VALUE``): a subclass per
    task, each field with its default and a ``description`` (its help). Run-level, like the task:
    every peer of a run trains with the same. A task without options takes this model as it is.
    Strict as every settings model, but bad input stays a ValidationError: ``get_task`` words it."""

    model_config = SettingsModel.model_config


@dataclass(frozen=True)
class TaskFactory:
    """A task by name: ``build(options, data_dir)`` makes it from its validated ``options`` (an
    instance of ``options``). ``data_dir`` is this peer's directory for the task's files (None: the
    task's default place); a task that reads no files ignores it. A module of this package that
    holds one is found by the registry; ``module:attribute`` may name one outside it."""

    name: str
    build: Callable[[Any, Path | None], Task]
    options: type[TaskOptions] = TaskOptions


def shard_indices(size: int, shard: int, num_shards: int, seed: int) -> Tensor:
    """Indices of shard ``shard`` of ``num_shards``: a seeded permutation cut into near-equal parts.

    The parts are disjoint and together cover ``range(size)``; every peer computes the same cut.
    """
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ConfigError(f"shard must satisfy 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
    if num_shards > size:
        raise ConfigError(f"cannot split {size} training samples into {num_shards} non-empty shards")
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(size, generator=generator)
    return torch.tensor_split(permutation, num_shards)[shard]


def shard_dataset(dataset: Dataset, shard: int, num_shards: int, seed: int) -> Dataset:
    """A peer's shard of any map-style dataset; tensor datasets stay tensor datasets (fast slicing)."""
    indices = shard_indices(len(dataset), shard, num_shards, seed)  # type: ignore[arg-type]
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(tensor[indices] for tensor in dataset.tensors))
    return torch.utils.data.Subset(dataset, indices.tolist())


def batches(dataset: Dataset, batch_size: int, shuffle: bool = False,
            generator: torch.Generator | None = None, drop_last: bool = False) -> Iterator[tuple[Tensor, Tensor]]:
    """One pass over ``dataset`` in (inputs, targets) batches.

    A TensorDataset is sliced directly: a DataLoader would index and collate sample by sample,
    which costs more than a small model's forward pass on CPU.
    """
    if not isinstance(dataset, TensorDataset):
        yield from DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
                              drop_last=drop_last)
        return
    size = len(dataset)
    order = torch.randperm(size, generator=generator) if shuffle else None
    stop = size - size % batch_size if drop_last else size
    for start in range(0, stop, batch_size):
        if order is None:
            yield tuple(tensor[start:start + batch_size] for tensor in dataset.tensors)  # type: ignore[misc]
        else:
            index = order[start:start + batch_size]
            yield tuple(tensor[index] for tensor in dataset.tensors)  # type: ignore[misc]


def dataset_size(dataset: Dataset) -> int | None:
    """Samples in ``dataset`` (an IterableDataset's per pass, if it says), or None when it cannot tell."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def endless_batches(dataset: Dataset, batch_size: int, seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Shuffled batches forever, reshuffled every epoch, deterministic given ``seed``. An
    IterableDataset orders its samples itself: its passes are batched in turn."""
    if isinstance(dataset, IterableDataset):
        yield from _stream_batches(dataset, batch_size)
        return
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError("cannot draw batches from an empty dataset")
    generator = torch.Generator().manual_seed(seed)
    if len(dataset) < batch_size:  # type: ignore[arg-type]
        batch_size = len(dataset)  # type: ignore[arg-type]
    while True:
        yield from batches(dataset, batch_size, shuffle=True, generator=generator, drop_last=True)


def _stream_batches(dataset: IterableDataset, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of an IterableDataset's samples, pass after pass (a batch may span two passes)."""
    inputs: list[Tensor] = []
    targets: list[Tensor] = []
    while True:
        seen = 0
        for sample_input, sample_target in dataset:
            seen += 1
            inputs.append(sample_input)
            targets.append(sample_target)
            if len(inputs) == batch_size:
                yield torch.stack(inputs), torch.stack(targets)
                inputs, targets = [], []
        if seen == 0:
            raise ConfigError("cannot draw batches from an empty dataset")
