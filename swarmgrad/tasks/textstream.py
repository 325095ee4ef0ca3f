"""Text corpora streamed from disk: a directory's .txt/.md/.py/.jsonl files, split into a held-out
set fixed by file and training shards cut by byte offset, read piece by piece.

Nothing here holds an index of samples: a shard is one byte range of the files' concatenation, and
an epoch visits its pieces (``PIECE_BYTES`` each) in a seeded order, cutting each into windows as it
is read. Memory is the file table (one row per file) plus a few pieces, whatever the corpus' size.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, TensorDataset

from swarmgrad.errors import ConfigError

SUFFIXES = (".txt", ".md", ".py", ".jsonl")
PIECE_BYTES = 256 * 1024  # read at once; windows are shuffled within a group of pieces
GROUP_PIECES = 8  # pieces mixed together: ~2 MiB of text in memory at a time
HELDOUT_EVERY = 50  # every 50th file (sorted by path) is held out
MAX_TEST_BYTES = 64 * 1024  # the held-out set at most: 65k target bytes, a stable loss, a second of evaluation (tiny)
FINGERPRINT_EDGE = 1 << 20  # a file is hashed whole up to 2 MiB, else its first and last MiB (and its size)


@dataclass(frozen=True)
class TextFile:
    path: Path
    name: str  # relative to the corpus root, '/'-separated: what the order and the fingerprint use
    size: int


def list_corpus(root: Path, skip_dirs: Iterable[str] = (), suffixes: tuple[str, ...] = SUFFIXES) -> list[TextFile]:
    """The corpus' files with one of ``suffixes``, sorted by relative path (the same on every peer);
    empty files are left out."""
    if not root.is_dir():
        raise ConfigError(f"text corpus directory {root} does not exist (--data-dir)")
    skip = frozenset(skip_dirs)
    files: list[TextFile] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in skip]
        for name in names:
            path = Path(directory) / name
            if path.suffix in suffixes:
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if size > 0:
                    files.append(TextFile(path, path.relative_to(root).as_posix(), size))
    return sorted(files, key=lambda file: file.name)


@dataclass(frozen=True)
class Corpus:
    """A corpus split by file: ``train`` streamed in shards, ``heldout`` scored by evaluations."""

    train: list[TextFile]
    heldout: list[TextFile]

    @classmethod
    def split(cls, files: list[TextFile], every: int = HELDOUT_EVERY) -> Corpus:
        if len(files) < 2:
            raise ConfigError(f"a text corpus needs at least 2 files (one is held out), found {len(files)}")
        heldout = [i for i in range(len(files)) if i % every == every - 1] or [len(files) - 1]
        chosen = set(heldout)
        return cls([f for i, f in enumerate(files) if i not in chosen], [files[i] for i in heldout])

    def fingerprint(self) -> str:
        """Digest of every file's name, size and contents (whole up to 2 MiB, else both ends)."""
        digest = hashlib.sha256()
        for role, files in (("train", self.train), ("heldout", self.heldout)):
            for file in files:
                digest.update(f"{role}\0{file.name}\0{file.size}\0".encode())
                with open(file.path, "rb") as handle:
                    if file.size <= 2 * FINGERPRINT_EDGE:
                        digest.update(handle.read())
                    else:
                        digest.update(handle.read(FINGERPRINT_EDGE))
                        handle.seek(file.size - FINGERPRINT_EDGE)
                        digest.update(handle.read())
        return digest.hexdigest()


class ByteRange:
    """The concatenation of ``files`` as one byte range, read by global offset (files' own bytes; a
    .jsonl file contributes the "text" fields of the lines that start in the range read)."""

    def __init__(self, files: list[TextFile]):
        self.files = files
        self.starts = [0]
        for file in files:
            self.starts.append(self.starts[-1] + file.size)

    @property
    def size(self) -> int:
        return self.starts[-1]

    def read(self, start: int, stop: int) -> bytes:
        """Text of global bytes [start, stop)."""
        parts, index = [], bisect.bisect_right(self.starts, start) - 1
        while start < stop and index < len(self.files):
            file, offset = self.files[index], start - self.starts[index]
            length = min(stop, self.starts[index + 1]) - start
            parts.append(read_text(file, offset, length))
            start += length
            index += 1
        return b"".join(parts)


def read_text(file: TextFile, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of a text file; of a .jsonl file, the "text" fields (UTF-8,
    one per line, newline-separated) of the lines that start in that range."""
    with open(file.path, "rb") as handle:
        if file.path.suffix != ".jsonl":
            handle.seek(offset)
            return handle.read(length)
        handle.seek(max(0, offset - 1))
        if offset > 0 and handle.read(1) != b"\n":
            handle.readline()  # the line under way belongs to the range before
        texts = []
        while handle.tell() < offset + length:
            position, line = handle.tell(), handle.readline()
            if not line:
                break
            if line.strip():
                texts.append(_jsonl_text(line, file, position))
        return b"".join(text + b"\n" for text in texts)


def _jsonl_text(line: bytes, file: TextFile, position: int) -> bytes:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ConfigError(f"{file.path}: byte {position}: not a JSON line ({error})") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ConfigError(f"{file.path}: byte {position}: a .jsonl line needs a string field \"text\"")
    return text.encode("utf-8", "surrogatepass")


def windows(text: bytes, context: int) -> torch.Tensor:
    """Non-overlapping training windows of ``context + 1`` bytes (inputs and the next byte of each),
    as a (count, context + 1) uint8 tensor; the last input byte's target is the next window's first."""
    count = (len(text) - 1) // context
    if count <= 0:
        return torch.empty(0, context + 1, dtype=torch.uint8)
    data = torch.frombuffer(bytearray(text[: count * context + 1]), dtype=torch.uint8)
    return data.as_strided((count, context + 1), (context, 1)).clone()


class TextStream(IterableDataset):
    """Shard ``shard`` of ``num_shards`` of a corpus' training files: one pass over its byte range per
    iteration, as (inputs, targets) pairs of int64 byte ids, in an order drawn from (seed, shard, pass)."""

    def __init__(self, files: list[TextFile], shard: int, num_shards: int, seed: int, context: int):
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ConfigError(f"shard must satisfy 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
        self.source, self.context, self.seed, self.shard = ByteRange(files), context, seed, shard
        total = self.source.size
        self.start, self.stop = total * shard // num_shards, total * (shard + 1) // num_shards
        if (self.stop - self.start) // context < 1:
            raise ConfigError(f"shard {shard} of {num_shards} holds {self.stop - self.start} bytes of text, "
                              f"less than one window of {context}: use fewer shards or more text")
        self.passes = 0

    def __len__(self) -> int:
        """Windows per pass, from the byte count (.jsonl files give fewer: their text is shorter than their lines)."""
        return (self.stop - self.start) // self.context

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.shard) * 1_000_003 + self.passes) % 2**63)
        self.passes += 1
        pieces = -(-(self.stop - self.start) // PIECE_BYTES)
        order = torch.randperm(pieces, generator=generator)
        for group in order.split(GROUP_PIECES):
            chunks = [self._piece(int(index)) for index in group]
            group_windows = torch.cat(chunks)
            shuffled = group_windows[torch.randperm(len(group_windows), generator=generator)]
            for index in range(len(shuffled)):  # one view at a time: iterating a tensor makes a view of every row at once
                row = shuffled[index].long()
                yield row[:-1], row[1:]

    def _piece(self, index: int) -> torch.Tensor:
        start = self.start + index * PIECE_BYTES
        stop = min(start + PIECE_BYTES, self.stop)
        # one byte more: the last input's target (the first byte of the next piece, or of the next shard)
        return windows(self.source.read(start, min(stop + 1, self.source.size)), self.context)


def heldout_windows(files: list[TextFile], context: int, max_bytes: int = MAX_TEST_BYTES) -> TensorDataset:
    """The held-out set: windows from the start of each held-out file, ``max_bytes`` in all at most."""
    per_file = max(context + 1, max_bytes // max(1, len(files)))
    rows = [windows(read_text(file, 0, min(file.size, per_file)), context) for file in files]
    data = torch.cat(rows) if rows else torch.empty(0, context + 1, dtype=torch.uint8)
    if len(data) == 0:
        raise ConfigError(f"the held-out files hold less than one window of {context} bytes: use a shorter context")
    data = data.long()
    return TensorDataset(data[:, :-1], data[:, 1:])
