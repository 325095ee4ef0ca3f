"""Fashion-MNIST: 28x28 grey clothing images in 10 classes, read from local IDX files."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from swarmgrad.errors import ConfigError
from swarmgrad.tasks.base import Task, TaskFactory, shard_dataset
from swarmgrad.tasks.idx import read_idx

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_PACKAGE = "dataset-fashion-mnist"
# Pixel statistics of the training set, so inputs are roughly zero-mean, unit-variance.
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class FashionCNN(nn.Module):
    """Two conv blocks and two linear layers (~206k parameters): fast on 2 CPU threads, ~90% accuracy."""

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 128, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.fc1 = nn.Linear(channels[1] * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def large_cnn() -> FashionCNN:
    """~5.05M parameters, almost all in the first linear layer (20 MB of fp32 to average): for
    benchmarks where communication must matter. A wide MLP of that size would be cheaper per step,
    but it plateaus near 88% test accuracy, so its time to 88% would be mostly noise."""
    return FashionCNN(channels=(32, 64), hidden=1600)


MODELS = {"cnn": FashionCNN, "large": large_cnn}


def find_file(data_dir: Path, stem: str) -> Path:
    """``stem.gz`` or raw ``stem``; a missing directory or file says how to get the data."""
    if not data_dir.is_dir():
        raise ConfigError(
            f"Fashion-MNIST directory {data_dir} does not exist: install Debian's {DEBIAN_PACKAGE} package "
            f"(apt-get install {DEBIAN_PACKAGE}) or pass --data-dir pointing at the IDX files"
        )
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"Fashion-MNIST file {stem}(.gz) not found in {data_dir}: install Debian's {DEBIAN_PACKAGE} package "
        f"or pass --data-dir pointing at a directory with the four IDX files"
    )


def load_split(data_dir: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float images (N, 1, 28, 28) and int64 labels (N,), cached per process."""
    images_path, labels_path = (find_file(Path(data_dir), stem) for stem in SPLITS[split])
    # The cache key includes size and mtime so a replaced file is read again.
    keys = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in (images_path, labels_path))
    return _load_split_cached(*keys)


@functools.lru_cache(maxsize=4)
def _load_split_cached(images_key: tuple, labels_key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = read_idx(images_key[0], expect_ndim=3), read_idx(labels_key[0], expect_ndim=1)
    if images.dtype != np.uint8 or images.shape[1:] != (28, 28):
        raise ConfigError(f"{images_key[0]} holds {images.dtype} images of shape {images.shape[1:]}, "
                          "expected uint8 28x28 (is it a Fashion-MNIST image file?)")
    if labels.dtype != np.uint8 or len(labels) != len(images):
        raise ConfigError(f"{labels_key[0]} holds {len(labels)} {labels.dtype} labels for {len(images)} images "
                          f"in {images_key[0]}; the files do not belong together")
    if labels.size and labels.max() >= len(CLASSES):
        raise ConfigError(f"{labels_key[0]} has label {labels.max()}, expected 0..{len(CLASSES) - 1}")
    # In-place torch ops on one fresh buffer: ~4x faster than numpy's temporaries for 47M pixels.
    pixels = torch.from_numpy(images.reshape(len(images), 1, 28, 28)).to(torch.float32)
    pixels.mul_(1 / (255 * PIXEL_STD)).sub_(PIXEL_MEAN / PIXEL_STD)
    return pixels, torch.from_numpy(labels.astype(np.int64))


def fingerprint(data_dir: Path) -> str:
    digest = hashlib.sha256()
    for stems in SPLITS.values():
        for stem in stems:
            digest.update(find_file(data_dir, stem).read_bytes())
    return "fashion-mnist:sha256:" + digest.hexdigest()[:16]


def fashion_mnist_task(data_dir: Path | None = None, model: str = "cnn") -> Task:
    """The ``fashion-mnist`` task (``model="large"``: ``fashion-mnist-large``); ``data_dir`` overrides
    Debian's install location."""
    directory = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    for stems in SPLITS.values():  # fail at configuration time, not when the first peer step runs
        for stem in stems:
            find_file(directory, stem)

    def train_data(shard: int, num_shards: int, seed: int) -> TensorDataset:
        return shard_dataset(TensorDataset(*load_split(directory, "train")), shard, num_shards, seed)

    def test_data() -> TensorDataset:
        return TensorDataset(*load_split(directory, "test"))

    return Task(
        name="fashion-mnist" if model == "cnn" else f"fashion-mnist-{model}",
        make_model=MODELS[model],
        loss_fn=F.cross_entropy,
        train_data=train_data,
        test_data=test_data,
        default_hparams={"batch_size": 64, "lr": 1e-3, "optimizer": "adam", "weight_decay": 0.0,
                         "eval_batch_size": 1000},
        data_fingerprint=lambda: fingerprint(directory),
    )


FASHION_MNIST = TaskFactory("fashion-mnist", lambda options, data_dir: fashion_mnist_task(data_dir))
# the same data with large_cnn, the lab benchmark's 5M-parameter model
FASHION_MNIST_LARGE = TaskFactory("fashion-mnist-large",
                                  lambda options, data_dir: fashion_mnist_task(data_dir, model="large"))
