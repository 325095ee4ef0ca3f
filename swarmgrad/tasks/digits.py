"""scikit-learn's handwritten digits: 1797 8x8 images, offline, tiny; the quickest smoke-test task."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from swarmgrad.errors import ConfigError
from swarmgrad.tasks.base import Task, TaskFactory, TaskOptions, shard_dataset

SPLIT_SEED = 0  # fixed, so every peer holds out the same 20%
TEST_FRACTION = 0.2


@functools.lru_cache(maxsize=1)
def load_digits_split() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"train": (x, y), "test": (x, y)}; x is (N, 64) float in [0, 1], y int64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ConfigError("the digits task needs scikit-learn: pip install 'scikit-learn>=1.3'") from error
    bunch = load_digits()
    inputs = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    targets = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test_size = round(len(inputs) * TEST_FRACTION)
    test, train = order[:test_size], order[test_size:]
    return {"train": (inputs[train], targets[train]), "test": (inputs[test], targets[test])}


def make_digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def digits_task(options: TaskOptions, data_dir: Path | None = None) -> Task:
    """The ``digits`` task: no options; the data comes with scikit-learn, so ``data_dir`` is not used."""

    def train_data(shard: int, num_shards: int, seed: int) -> TensorDataset:
        return shard_dataset(TensorDataset(*load_digits_split()["train"]), shard, num_shards, seed)

    def test_data() -> TensorDataset:
        return TensorDataset(*load_digits_split()["test"])

    def fingerprint() -> str:
        import sklearn

        return f"digits:sklearn-{sklearn.__version__}:n={sum(len(x) for x, _ in load_digits_split().values())}"

    load_digits_split()  # fail now if scikit-learn is missing, not at the first training step
    return Task(
        name="digits",
        make_model=make_digits_mlp,
        loss_fn=F.cross_entropy,
        train_data=train_data,
        test_data=test_data,
        default_hparams={"batch_size": 32, "lr": 3e-3, "optimizer": "adam", "weight_decay": 0.0,
                         "eval_batch_size": 1000},
        data_fingerprint=fingerprint,
    )


DIGITS = TaskFactory("digits", digits_task)
