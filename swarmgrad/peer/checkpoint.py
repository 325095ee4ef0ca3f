"""Checkpoints: a peer's last consistent state (and its privacy budget) in a directory, written on a
thread while training goes on, and switched to atomically.

    latest                                the name of the current checkpoint (replaced atomically)
    checkpoint-<version>-<token>/         one save:
        state-00001-of-00002.safetensors  the state's tensors by their snapshot names (model/<key>,
        state-00002-of-00002.safetensors  strategy/<key>, optimizer/<i>/<key>), SHARD_BYTES at most
        checkpoint.json                   format, versions, run id, specs, meta and extra
    .checkpoint-*                         a save under way, or one a kill cut short

A save fills a fresh ``.checkpoint-*`` directory, fsyncs its files and itself, renames it, then
replaces ``latest``: killed at any moment, it leaves the previous checkpoint whole, and ``latest``
names that one until the new one is complete. The next save removes what a killed one left; each
save removes the checkpoints before it. ``safetensors.torch.load_file`` reads a shard without
swarmgrad. ``checkpoint.pt`` (format 1, one ``torch.save`` of the snapshot) is still read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swarmgrad.errors import ConfigError
from swarmgrad.state.served import ServedState
from swarmgrad.state.snapshot import StateSnapshot, layout
from swarmgrad.version import __version__

logger = logging.getLogger(__name__)

# what a reader's load_file holds at once (and an older safetensors copies to write it): bounded, as
# Hugging Face's shards are (5 GB there)
SHARD_BYTES = 1024**3
FORMAT = 2
LATEST_FILE = "latest"
DESCRIPTION_FILE = "checkpoint.json"
PARTIAL_PREFIX = ".checkpoint-"  # the old format's temporary files began so too
SAVED = re.compile(r"checkpoint-\d+-\w+")
SHARD = re.compile(r"state-\d{5}-of-\d{5}\.safetensors")
LEGACY_FILE = "checkpoint.pt"
LEGACY_FORMAT = 1


def save_checkpoint(directory: Path, run_id: str, snapshot: StateSnapshot | ServedState,
                    extra: dict[str, Any]) -> Path | None:
    """Write ``snapshot`` plus ``extra`` (privacy accountant, counters: JSON) as ``directory``'s checkpoint.

    Returns the new checkpoint's folder, or None when the snapshot no longer held the state it was
    taken of once written (its ``still_current()``, where it has one, said so): the previous
    checkpoint stays. Tensors are written shard by shard from the snapshot's own memory (a served
    state's: the outer start and momentum, held for the save, and the optimizer's moments, which move
    at every inner step: each as it was when its shard was written).
    """
    directory.mkdir(parents=True, exist_ok=True)
    _remove(directory.glob(PARTIAL_PREFIX + "*"))  # what a killed save left
    tensors = snapshot.tensors()
    shards = _shards(tensors)
    files = [f"state-{index:05d}-of-{len(shards):05d}.safetensors" for index in range(1, len(shards) + 1)]
    # before the shards: an ``extra`` that is not JSON fails the save at once
    description = json.dumps({
        "format": FORMAT, "swarmgrad": __version__, "run_id": run_id, "version": snapshot.version,
        "specs": [[name, dtype, list(shape)] for name, dtype, shape in snapshot.specs], "meta": snapshot.meta,
        "extra": extra, "shards": files,
    })
    temporary = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=directory))
    try:
        for file, names in zip(files, shards):
            save_file({name: tensors[name] for name in names}, temporary / file, metadata={"format": "pt"})
            _fsync(temporary / file)
        still_current = getattr(snapshot, "still_current", None)
        if still_current is not None and not still_current():
            logger.debug("checkpoint of version %d dropped: the state changed while it was written", snapshot.version)
            shutil.rmtree(temporary)
            return None
        (temporary / DESCRIPTION_FILE).write_text(description)
        _fsync(temporary / DESCRIPTION_FILE)
        _fsync(temporary)
        target = directory / f"checkpoint-{snapshot.version}-{temporary.name.removeprefix(PARTIAL_PREFIX)}"
        temporary.rename(target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync(directory)
    _point_to(directory, target.name)
    _remove(path for path in directory.iterdir()
            if (SAVED.fullmatch(path.name) and path != target) or path.name == LEGACY_FILE)
    return target


def load_checkpoint(directory: Path, run_id: str) -> tuple[StateSnapshot, dict[str, Any]] | None:
    """The checkpoint in ``directory``, or None when there is none; ConfigError when it cannot be used."""
    if (directory / LATEST_FILE).exists():
        snapshot, found_run, extra = _read(directory)
        where = directory
    elif (directory / LEGACY_FILE).exists():
        where = directory / LEGACY_FILE
        snapshot, found_run, extra = _read_legacy(where)
    else:
        return None
    if found_run != run_id:
        raise ConfigError(f"checkpoint {where} belongs to run {found_run!r}, not {run_id!r}; "
                          "use another --checkpoint-dir")
    return snapshot, extra


def _read(directory: Path) -> tuple[StateSnapshot, Any, dict[str, Any]]:
    """The checkpoint ``latest`` names, copied tensor by tensor into one snapshot buffer."""
    reading = directory / LATEST_FILE
    try:
        name = reading.read_text().strip()
        if not SAVED.fullmatch(name):
            raise ValueError(f"it names {name[:80]!r}, not a checkpoint")
        folder = directory / name
        reading = folder / DESCRIPTION_FILE
        description = json.loads(reading.read_text())
        if description.get("format") != FORMAT:
            raise ValueError(f"format {description.get('format')!r}, this version reads {FORMAT}")
        specs = tuple((str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in description["specs"])
        snapshot = StateSnapshot(int(description["version"]), specs, dict(description["meta"]),
                                 torch.zeros(layout(specs)[1], dtype=torch.uint8))
        views, found = snapshot.tensors(), set()
        for file in description["shards"]:
            if not SHARD.fullmatch(file):
                raise ValueError(f"it lists {file[:80]!r}, not a shard")
            reading = folder / file
            with safe_open(reading, framework="pt") as shard:
                for key in shard.keys():
                    tensor, view = shard.get_tensor(key), views.get(key)
                    if view is None or key in found or tensor.dtype != view.dtype or tensor.shape != view.shape:
                        raise ValueError(f"{key!r} ({tensor.dtype}{tuple(tensor.shape)}) is not in the specs, "
                                         "or is there twice or in another shape")
                    view.copy_(tensor)
                    found.add(key)
        if found != set(views):
            raise ValueError(f"no shard holds {sorted(set(views) - found)[:3]}")
        extra = dict(description.get("extra") or {})
    except Exception as error:
        raise ConfigError(f"checkpoint {reading} cannot be read ({type(error).__name__}: {error}); "
                          f"move {directory} away to start fresh") from None
    return snapshot, description.get("run_id"), extra


def _read_legacy(path: Path) -> tuple[StateSnapshot, Any, dict[str, Any]]:
    """Format 1: ``checkpoint.pt``, the whole snapshot in one ``torch.save``."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != LEGACY_FORMAT:
            raise ValueError(f"format {payload.get('format')!r}, this version reads {LEGACY_FORMAT} here")
        specs = tuple((str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in payload["specs"])
        snapshot = StateSnapshot(int(payload["version"]), specs, dict(payload["meta"]), payload["data"])
        snapshot.tensors()  # checks that the bytes fit the layout
    except Exception as error:
        raise ConfigError(f"checkpoint {path} cannot be read ({type(error).__name__}: {error}); "
                          "move it away to start fresh") from None
    if snapshot.nbytes != layout(snapshot.specs)[1]:
        raise ConfigError(f"checkpoint {path} is truncated; move it away to start fresh")
    return snapshot, payload.get("run_id"), dict(payload.get("extra") or {})


def _shards(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """The tensors' names in order, cut into shards of SHARD_BYTES at most (or one larger tensor)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _point_to(directory: Path, name: str) -> None:
    """Replace ``latest`` with one naming ``name``, atomically and durably."""
    handle, temporary = tempfile.mkstemp(prefix=PARTIAL_PREFIX, dir=directory)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(name + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, directory / LATEST_FILE)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync(directory)


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a rename is durable once its directory is)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _remove(paths: Iterable[Path]) -> None:
    for path in list(paths):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class Checkpointer:
    """Keeps a peer's latest published state (``latest()``, what joiners download) in ``directory``:
    after a swarm step once ``every`` seconds passed since the last save began, and on leaving.
    ``extra()`` is saved beside it (the privacy accountant, the step counters). A save runs on a
    thread: the swarm step that started it goes on; one comes due only when none is under way.
    ``hold(version)`` keeps the state a save reads as it is until the returned call (the state server's:
    a state served from live tensors is left to the save, and the owner steps on copies)."""

    def __init__(self, directory: Path, run_id: str, every: float,
                 latest: Callable[[], StateSnapshot | ServedState | None],
                 extra: Callable[[], dict[str, Any]],
                 hold: Callable[[int], Callable[[], None]] = lambda version: lambda: None):
        self.directory, self.run_id, self.every, self.latest, self.extra = directory, run_id, every, latest, extra
        self.hold = hold
        self._saved_at = time.monotonic()
        self._writing: asyncio.Task[None] | None = None

    def load(self) -> tuple[StateSnapshot, dict[str, Any]] | None:
        return load_checkpoint(self.directory, self.run_id)

    @property
    def writing(self) -> bool:
        return self._writing is not None and not self._writing.done()

    def due(self) -> bool:
        return not self.writing and time.monotonic() - self._saved_at >= self.every

    def save(self) -> None:
        """Start saving the latest state and return at once; nothing while a save is under way (the
        next swarm step after it saves a fresher state)."""
        snapshot = self.latest()
        if snapshot is None or self.writing:
            return
        self._saved_at = time.monotonic()
        self._writing = asyncio.ensure_future(self._write(snapshot, self.extra(), self.hold(snapshot.version)))

    async def save_last(self) -> None:
        """On leaving: let the save under way finish, then save the latest state and wait for it;
        raises what that save raised."""
        if self._writing is not None:
            await self._writing
        snapshot = self.latest()
        if snapshot is not None:
            release = self.hold(snapshot.version)
            try:
                await asyncio.to_thread(save_checkpoint, self.directory, self.run_id, snapshot, self.extra())
            finally:
                release()

    async def _write(self, snapshot: StateSnapshot | ServedState, extra: dict[str, Any], release: Callable[[], None]) -> None:
        try:
            await asyncio.to_thread(save_checkpoint, self.directory, self.run_id, snapshot, extra)
        except Exception as error:  # training goes on; the next due save tries again
            logger.error("checkpoint to %s failed: %s: %s", self.directory, type(error).__name__, error)
        finally:
            release()
