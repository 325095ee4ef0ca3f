"""Checkpoints: a peer's last consistent state (and its privacy budget) in a directory, written atomically."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from swarmgrad.errors import ConfigError
from swarmgrad.state.snapshot import StateSnapshot, layout
from swarmgrad.version import __version__

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT = 1


def save_checkpoint(directory: Path, run_id: str, snapshot: StateSnapshot, extra: dict[str, Any]) -> Path:
    """Write ``snapshot`` plus ``extra`` (privacy accountant, counters) to ``directory/checkpoint.pt``.

    The file is written next to the old one and renamed over it, so a crash mid-write leaves the
    previous checkpoint intact.
    """
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "swarmgrad": __version__, "run_id": run_id, "version": snapshot.version,
        "specs": [list(spec) for spec in snapshot.specs], "meta": snapshot.meta, "data": snapshot.data,
        "extra": extra,
    }
    target = directory / CHECKPOINT_FILE
    handle, temporary = tempfile.mkstemp(prefix=".checkpoint-", dir=directory)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(directory: Path, run_id: str) -> tuple[StateSnapshot, dict[str, Any]] | None:
    """The checkpoint in ``directory``, or None when there is none; ConfigError when it cannot be used."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT:
            raise ValueError(f"format {payload.get('format')!r}, this version reads {FORMAT}")
        specs = tuple((str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in payload["specs"])
        snapshot = StateSnapshot(int(payload["version"]), specs, dict(payload["meta"]), payload["data"])
        snapshot.tensors()  # checks that the bytes fit the layout
    except Exception as error:
        raise ConfigError(f"checkpoint {path} cannot be read ({type(error).__name__}: {error}); "
                          "move it away to start fresh") from None
    if payload.get("run_id") != run_id:
        raise ConfigError(f"checkpoint {path} belongs to run {payload.get('run_id')!r}, not {run_id!r}; "
                          "use another --checkpoint-dir")
    if snapshot.nbytes != layout(snapshot.specs)[1]:
        raise ConfigError(f"checkpoint {path} is truncated; move it away to start fresh")
    return snapshot, dict(payload.get("extra") or {})


class Checkpointer:
    """Keeps a peer's latest published state (``latest()``, what joiners download) in ``directory``:
    after a swarm step once ``every`` seconds passed since the last save, and on leaving. ``extra()``
    is saved beside it (the privacy accountant, the step counters)."""

    def __init__(self, directory: Path, run_id: str, every: float, latest: Callable[[], StateSnapshot | None],
                 extra: Callable[[], dict[str, Any]]):
        self.directory, self.run_id, self.every, self.latest, self.extra = directory, run_id, every, latest, extra
        self._saved_at = time.monotonic()

    def load(self) -> tuple[StateSnapshot, dict[str, Any]] | None:
        return load_checkpoint(self.directory, self.run_id)

    def due(self) -> bool:
        return time.monotonic() - self._saved_at >= self.every

    async def save(self) -> None:
        snapshot = self.latest()
        if snapshot is None:
            return
        # off the loop: a large state takes seconds to write, and rounds go on meanwhile
        await asyncio.get_running_loop().run_in_executor(
            None, save_checkpoint, self.directory, self.run_id, snapshot, self.extra())
        self._saved_at = time.monotonic()
