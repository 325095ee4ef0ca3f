"""A tiny character-level transformer trained on the Python standard library's own source.

The corpus is on every machine that runs Python, needs no download, and the vocabulary is simply
the 256 byte values, so there is no tokenizer state to ship. Peers on different Python versions
read different text: ``data_fingerprint`` tells them apart.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from pathlib import Path

import pydantic
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from swarmgrad.errors import ConfigError
from swarmgrad.tasks.base import Task, TaskFactory, TaskOptions, shard_dataset

VOCAB = 256
DEFAULT_MAX_BYTES = 4 * 2**20
# Test suites hold odd encodings and huge fixtures; codec tables and pydoc topics are generated,
# not code; site-packages differs per install. None of them makes a better corpus.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                       "pydoc_data", "__pycache__"})
MAX_TEST_WINDOWS = 1024  # keeps a full evaluation to a few seconds on a CPU


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The stdlib's .py files in a deterministic order (sorted relative paths)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in SKIP_DIRS]
        files += [Path(directory) / name for name in names if name.endswith(".py")]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


@functools.lru_cache(maxsize=2)
def read_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The first ``max_bytes`` of the concatenated sources as an int64 tensor of byte values."""
    chunks, total = [], 0
    for path in stdlib_sources():
        try:
            data = path.read_bytes() + b"\n"
        except OSError:
            continue  # an unreadable file changes the fingerprint, not the outcome
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 2 * 1024:
        raise ConfigError(f"found only {total} bytes of Python source under {sysconfig.get_paths()['stdlib']}; "
                          "the charlm task needs the standard library's .py files installed")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def split_windows(text: torch.Tensor, context: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows: inputs text[i:i+context], targets the same shifted by one byte.

    Held-out windows are spread evenly over the whole corpus (every k-th), not its tail, which
    would be a few modules the model never saw the style of.
    """
    count = (len(text) - 1) // context
    starts = torch.arange(count) * context
    offsets = torch.arange(context)
    inputs, targets = text[starts[:, None] + offsets], text[starts[:, None] + offsets + 1]
    every = max(10, math.ceil(count / MAX_TEST_WINDOWS))
    is_test = torch.arange(count) % every == every - 1
    return {"train": (inputs[~is_test], targets[~is_test]), "test": (inputs[is_test], targets[is_test])}


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Byte-level GPT: (batch, length) byte ids -> (batch, length, 256) next-byte logits."""

    def __init__(self, context: int = 64, dim: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.context:
            raise ValueError(f"sequence of {tokens.shape[-1]} bytes exceeds the model's context of {self.context}")
        x = self.embed(tokens) + self.position[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # tied output layer: fewer parameters, trains faster


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def unigram_entropy(targets: torch.Tensor) -> float:
    """Cross-entropy (nats) of predicting every byte from byte frequencies alone: the bar to beat."""
    probabilities = torch.bincount(targets.reshape(-1), minlength=VOCAB).double()
    probabilities = probabilities[probabilities > 0] / probabilities.sum()
    return float(-(probabilities * probabilities.log()).sum())


class CharLMOptions(TaskOptions):
    context: int = pydantic.Field(64, ge=2, le=2**16, description="Bytes per training window: the model's context.")
    max_bytes: int = pydantic.Field(DEFAULT_MAX_BYTES, ge=128, le=2**34,
                                    description="Bytes of standard-library source to read at most.")
    dim: int = pydantic.Field(128, ge=1, le=2**14, description="Width of the transformer.")
    layers: int = pydantic.Field(2, ge=1, le=256, description="Transformer blocks.")
    heads: int = pydantic.Field(4, ge=1, le=256, description="Attention heads per block (they divide dim).")

    @pydantic.model_validator(mode="after")
    def _check(self) -> CharLMOptions:
        if self.max_bytes < 64 * self.context or self.dim % self.heads:
            raise ConfigError(f"charlm needs max_bytes >= 64 * context and dim divisible by heads; got "
                              f"context={self.context}, max_bytes={self.max_bytes}, dim={self.dim}, heads={self.heads}")
        return self


def charlm_task(options: CharLMOptions, data_dir: Path | None = None) -> Task:
    """The ``charlm`` task; it reads the running Python's own sources, so ``data_dir`` is not used."""
    context, max_bytes, dim, layers, heads = (options.context, options.max_bytes, options.dim, options.layers,
                                              options.heads)

    def windows() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return _windows(context, max_bytes)

    def fingerprint() -> str:
        digest = hashlib.sha256(read_corpus(max_bytes).to(torch.uint8).numpy().tobytes()).hexdigest()
        return f"charlm:context={context}:sha256:{digest[:16]}"

    return Task(
        name="charlm",
        make_model=lambda: CharTransformer(context, dim, heads, layers),
        loss_fn=sequence_cross_entropy,
        train_data=lambda shard, num_shards, seed: shard_dataset(TensorDataset(*windows()["train"]), shard,
                                                                 num_shards, seed),
        test_data=lambda: TensorDataset(*windows()["test"]),
        default_hparams={"batch_size": 32, "lr": 2e-3, "optimizer": "adamw", "weight_decay": 0.01,
                         "eval_batch_size": 128, "context": context},
        data_fingerprint=fingerprint,
    )


CHARLM = TaskFactory("charlm", charlm_task, CharLMOptions)


@functools.lru_cache(maxsize=2)
def _windows(context: int, max_bytes: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return split_windows(read_corpus(max_bytes), context)
