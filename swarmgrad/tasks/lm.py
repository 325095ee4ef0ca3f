"""``lm``: a byte-level GPT (gpt.py) in named sizes, trained on text streamed from a corpus directory
(textstream.py), scored as held-out loss and bits per byte (its "accuracy" is next-byte top-1 accuracy).

The tokenizer is the identity on bytes: nothing to download, train or ship, and bits per byte is
the loss in bits. The default corpus is the running Python's standard library (as charlm's), so
peers on different Python versions read different text: the fingerprint tells them apart.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Literal

import pydantic

from swarmgrad.tasks.base import Task, TaskFactory, TaskOptions
from swarmgrad.tasks.charlm import SKIP_DIRS, sequence_cross_entropy
from swarmgrad.tasks.gpt import GPT, SIZES
from swarmgrad.tasks.textstream import Corpus, TextStream, heldout_windows, list_corpus

TOKENIZER = "bytes-v1"  # in the fingerprint: a peer that tokenized differently is told apart


class LMOptions(TaskOptions):
    size: Literal["tiny", "small", "medium", "base"] = pydantic.Field(
        "tiny", description="Model size: tiny (3.3M parameters), small (10.8M), medium (19.2M), base (128M).")
    context: int = pydantic.Field(256, ge=8, le=2**14, description="Bytes per training window: the model's context.")


# per size: learning rate and batch a CPU peer can afford; the rest is common (train.py reads them)
SIZE_HPARAMS = {"tiny": {"lr": 1e-3, "batch_size": 16}, "small": {"lr": 8e-4, "batch_size": 16},
                "medium": {"lr": 6e-4, "batch_size": 16}, "base": {"lr": 3e-4, "batch_size": 8}}
COMMON_HPARAMS = {"optimizer": "adamw", "weight_decay": 0.1, "decay_norms_and_biases": False,
                  "warmup_steps": 50, "decay_steps": 5000, "min_lr_ratio": 0.1, "grad_clip": 1.0,
                  "eval_batch_size": 32}


def lm_task(options: LMOptions, data_dir: Path | None = None) -> Task:
    """The ``lm`` task on ``data_dir``'s text files (default: the standard library's .py files)."""
    size, context = options.size, options.context
    root, skip = (Path(data_dir), ()) if data_dir is not None else (Path(sysconfig.get_paths()["stdlib"]), SKIP_DIRS)
    corpus = functools.cache(lambda: Corpus.split(list_corpus(root, skip)))

    def fingerprint() -> str:
        return f"lm:tokenizer={TOKENIZER}:context={context}:sha256:{corpus().fingerprint()[:16]}"

    return Task(
        name="lm",
        make_model=lambda: GPT(SIZES[size], context),
        loss_fn=sequence_cross_entropy,
        train_data=lambda shard, num_shards, seed: TextStream(corpus().train, shard, num_shards, seed, context),
        test_data=functools.cache(lambda: heldout_windows(corpus().heldout, context)),
        default_hparams={**COMMON_HPARAMS, **SIZE_HPARAMS[size], "context": context},
        data_fingerprint=functools.cache(fingerprint),
        bytes_per_token=1.0,
    )


LM = TaskFactory("lm", lm_task, LMOptions)

