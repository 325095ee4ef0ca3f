"""The results of a peer's last rounds, kept for peers that missed a round to replay it (state/results.py,
peer/catch_up.py), on disk: a kept result costs host memory only until a thread has written it out.

Issue 35 measured at 201M parameters in the lab: a starter held 14.2 bytes per parameter between rounds
against DESIGN's 12, and 2 to 4 of them were results kept for replays (two rounds' int8 frames, and the
rounds held for a joiner). They are read only when a peer replays a round, and then once per peer: the
page cache serves them as well as memory would, and the kernel takes that back under pressure.

A result is kept as the frames it travelled in where it has them (averaging/result_frames.py), else as
bfloat16 in chunks of ``RESULT_CHUNK_BYTES``. Its bytes stay in memory until the write is done, in an
unlinked temporary file under the temporary directory (``TMPDIR``): nothing is left behind when the
process dies, and the file closes when the last reader lets go of it. Where the write fails (a full
disk), the result stays in memory, as before, and the log says so once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Callable, Sequence

import torch

from swarmgrad.state import results as state_results
from swarmgrad.state.results import RESULT_DTYPE, ResultPieces, result_digest

logger = logging.getLogger(__name__)

KEPT_RESULTS = 2  # rounds whose results a donor keeps: enough for a peer one or two rounds behind
# results a donor keeps beyond those, for the joiners its state downloads serve (``ResultHolds``):
# at most this many bytes per element of a result, oldest dropped first: int8's frames (about 1 byte
# an element a round) 12 rounds more than KEPT_RESULTS, q2's (0.31) 38, bfloat16 copies 6. On disk,
# so the bound is what a replay is worth: the state a joiner downloads is 12 to 16 bytes a parameter
# (DiLoCo's start and momentum, and SGD's or Adam's), and past that a download costs no more. At 4
# (when they were in memory) a 201M int8 joiner in the lab downloaded 3 times and never caught up: a
# download of its state took 7.5 of the swarm's rounds. A download that takes longer is followed by
# another one, as before.
HELD_RESULT_BYTES_PER_ELEMENT = 12.0
MAX_RESULT_HOLDERS = 64  # joiners a donor keeps results for at once (past it, the longest-idle goes)

Frame = tuple[dict, bytes]


@dataclass
class _Hold:
    floor: int  # the oldest round whose result the joiner still needs (its state's version, then its replay's)
    channels: int  # its downloads under way: held for as long as they read
    expires: float  # time.monotonic() past which, with no download under way, the hold ends


class ResultHolds:
    """Which round results joiners that downloaded this donor's state still need: a joiner that
    described version v replays the rounds from v on once its download is in, so results from v on
    are kept while it reads and ``idle_seconds`` after its last request (each result or digest it
    asks for moves its floor up and renews that). Keyed by the channel's authenticated peer id, at
    most ``MAX_RESULT_HOLDERS`` of them; the bytes they keep are capped by ``KeptResults``."""

    def __init__(self, idle_seconds: float):
        self.idle_seconds = idle_seconds
        self._holds: dict[str, _Hold] = {}

    def reading(self, peer: str, version: int, new_channel: bool = True) -> None:
        """``peer``'s download reads ``version`` (on one more channel, or on one that read another)."""
        hold = self._holds.get(peer)
        if hold is None:
            if len(self._holds) >= MAX_RESULT_HOLDERS:
                self._holds.pop(min(self._holds, key=lambda key: (self._holds[key].channels > 0,
                                                                  self._holds[key].expires)))
            hold = self._holds[peer] = _Hold(version, 0, 0.0)
        hold.floor = version
        hold.channels += 1 if new_channel or hold.channels == 0 else 0

    def read(self, peer: str) -> None:
        """One of ``peer``'s download channels ended: its replay comes next."""
        hold = self._holds.get(peer)
        if hold is not None:
            hold.channels = max(0, hold.channels - 1)
            hold.expires = time.monotonic() + self.idle_seconds

    def replaying(self, peer: str, epoch: int) -> None:
        """``peer`` asked for the result of round ``epoch``: it no longer needs the ones before."""
        hold = self._holds.get(peer)
        if hold is not None:
            hold.floor = max(hold.floor, epoch)
            hold.expires = time.monotonic() + self.idle_seconds

    def floor(self) -> int | None:
        """The oldest round a live hold needs (None: no joiner needs any); ends the expired ones."""
        now = time.monotonic()
        for peer in [peer for peer, hold in self._holds.items() if hold.channels <= 0 and hold.expires <= now]:
            del self._holds[peer]
        return min((hold.floor for hold in self._holds.values()), default=None)


class KeptResult:
    """One round's result as served: its frames (``headers`` and payloads) or bfloat16 chunks
    (``headers`` None), its sha256 (or how to compute it, in a thread when first asked), in memory or
    on disk."""

    def __init__(self, numel: int, headers: list[dict] | None, payloads: Sequence[bytes | memoryview],
                 digest: str | Callable[[], str]):
        self.numel, self.headers, self.digest = numel, headers, digest
        self.nbytes = sum(len(payload) for payload in payloads)
        self._payloads: list[bytes | memoryview] | None = list(payloads)
        self._file: IO[bytes] | None = None
        self._spans: list[tuple[int, int]] = []  # (offset, length) of each payload in the file
        self._naming: asyncio.Future[str] | None = None  # the digest being computed for the first asker

    @property
    def framed(self) -> bool:
        return self.headers is not None

    @property
    def on_disk(self) -> bool:
        return self._file is not None

    @property
    def count(self) -> int:
        return len(self._spans) if self._payloads is None else len(self._payloads)

    def write(self, directory: str | None) -> tuple[IO[bytes], list[tuple[int, int]]]:
        """Its bytes in a new unlinked file (in a thread: nothing here touches the event loop's state)."""
        payloads = self._payloads
        if payloads is None:
            raise RuntimeError("this result is on disk already")
        file = tempfile.TemporaryFile(dir=directory)
        try:
            spans, offset = [], 0
            for payload in payloads:
                file.write(payload)
                spans.append((offset, len(payload)))
                offset += len(payload)
            file.flush()
        except BaseException:
            file.close()
            raise
        return file, spans

    def written(self, file: IO[bytes], spans: list[tuple[int, int]]) -> None:
        """The write is done: the memory goes (on the event loop, between two reads of a sender)."""
        self._file, self._spans, self._payloads = file, spans, None

    def payload(self, index: int) -> bytes | memoryview:
        """Payload ``index``: from memory, or read from the file (blocking: in a thread, or a frame's worth)."""
        payloads = self._payloads  # once: the write may end meanwhile (on the event loop's thread)
        if payloads is not None:
            return payloads[index]
        offset, length = self._spans[index]
        assert self._file is not None
        data = os.pread(self._file.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"the kept result's file ended early ({len(data)} of {length} bytes at {offset})")
        return data

    async def read(self, index: int) -> bytes | memoryview:
        """Payload ``index``, off the event loop when it is on disk."""
        if self._payloads is not None:
            return self._payloads[index]
        return await asyncio.to_thread(self.payload, index)

    def frames(self) -> KeptFrames:
        return KeptFrames(self)

    async def named(self) -> str:
        """Its sha256; a framed result's is computed when first asked (``KeptResults.add``)."""
        digest = self.digest
        if isinstance(digest, str):
            return digest
        if self._naming is None:
            self._naming = asyncio.ensure_future(asyncio.to_thread(digest))
            self._naming.add_done_callback(self._named)
        return await asyncio.shield(self._naming)

    def _named(self, naming: asyncio.Future[str]) -> None:
        if naming.cancelled() or naming.exception() is not None:
            self._naming = None  # the next asker tries again
        else:
            self.digest = naming.result()


class KeptFrames(Sequence[Frame]):
    """A kept result's frames, read where they are (memory, then the file: a frame's pread), for an
    average that outlives its round (``FramedAverage.read_from``): an outer step a download reads
    past holds its average until the download ends, and it would otherwise keep a round's frames in
    memory for each step (at 201M in the lab, int8: 1 byte per parameter a round, 8 rounds deep)."""

    def __init__(self, kept: KeptResult):
        if not kept.framed:
            raise ValueError("a result kept as bfloat16 has no frames")
        self._kept = kept

    def __len__(self) -> int:
        return self._kept.count

    def __getitem__(self, index):  # type: ignore[override]  # one frame at a time, by its index
        if not isinstance(index, int):
            raise TypeError("kept frames are read one at a time")
        assert self._kept.headers is not None
        return self._kept.headers[index], self._kept.payload(index)


class KeptResults:
    """The results of this peer's last ``keep`` rounds, and older ones a joiner still needs (``holds``)
    within ``held_bytes`` per element; written to disk under ``directory`` (None: the temporary
    directory) as soon as they are kept."""

    def __init__(self, holds: ResultHolds, keep: int = KEPT_RESULTS,
                 held_bytes: float = HELD_RESULT_BYTES_PER_ELEMENT, directory: str | None = None):
        self.holds, self.keep, self.held_per_element, self.directory = holds, keep, held_bytes, directory
        self._results: dict[int, KeptResult] = {}
        self._warned = False

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._results

    def __getitem__(self, epoch: int) -> KeptResult:
        return self._results[epoch]

    def epochs(self) -> list[int]:
        return sorted(self._results)

    def add(self, epoch: int, result: torch.Tensor | ResultPieces, frames: Sequence[Frame] | None = None) -> None:
        """Keep what round ``epoch`` applied here (a flat float tensor: the swarm's average, or this
        peer's own values when it stepped alone): as the ``frames`` it travelled in where given
        (they decode to exactly it, in a fraction of its bytes), else as bfloat16. The digest is of
        its bfloat16 bytes either way."""
        if self.keep < 1:
            return
        for later in [later for later in self._results if later > epoch]:
            self._results.pop(later)  # rounds of a lead this peer gave up (it rejoined the swarm's epoch)
        if frames is None:
            if not isinstance(result, torch.Tensor):
                raise ValueError("a result held as frames is kept as its frames: pass them")
            copy = result.detach().reshape(-1).to("cpu").to(RESULT_DTYPE, copy=True)
            data, size = memoryview(copy.view(torch.uint8).numpy()), state_results.RESULT_CHUNK_BYTES
            kept = KeptResult(result.numel(), None, [data[start : start + size] for start in range(0, len(data), size)],
                              result_digest(copy))
        else:
            # its digest decodes every frame (at 201M: 0.6-0.75 CPU-seconds, a tenth of a round's CPU): a
            # peer that replays the round asks for it, most rounds nobody does
            kept = KeptResult(result.numel(), [header for header, _ in frames], [payload for _, payload in frames],
                              functools.partial(result_digest, result))
            read_from = getattr(result, "read_from", None)
            if read_from is not None:  # the average reads them where they are kept: it pins no copy
                read_from(kept.frames())
        self._results[epoch] = kept
        self._drop_old()
        self._write(kept)

    def _write(self, kept: KeptResult) -> None:
        """To disk: in a thread where an event loop runs, else now."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            try:
                kept.written(*kept.write(self.directory))
            except OSError as error:
                self._not_written(error)
            return
        writing = asyncio.ensure_future(asyncio.to_thread(kept.write, self.directory))

        def done(task: asyncio.Future) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                self._not_written(task.exception())
            else:
                kept.written(*task.result())

        writing.add_done_callback(done)

    def _not_written(self, error: BaseException | None) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("could not write a kept round result to disk (%s); keeping results in memory", error)

    def _drop_old(self) -> None:
        """Keep the last ``keep`` results, and the older ones a joiner still needs (``holds``) within
        ``held_bytes`` per element, dropping the oldest past that."""
        older = self.epochs()[: -self.keep]
        floor = self.holds.floor()
        held = [epoch for epoch in older if floor is not None and epoch >= floor]
        if held:
            cap = self.held_per_element * max(kept.numel for kept in self._results.values())
            while held and sum(self._results[epoch].nbytes for epoch in held) > cap:
                held.pop(0)
        for epoch in older:
            if epoch not in held:
                self._results.pop(epoch)  # a file a sender still reads closes when it is done

    def nbytes(self) -> int:
        """The bytes of the results kept, in memory or on disk."""
        return sum(kept.nbytes for kept in self._results.values())

    def held_bytes_in_memory(self) -> int:
        return sum(kept.nbytes for kept in self._results.values() if not kept.on_disk)

    def bytes_on_disk(self) -> int:
        return sum(kept.nbytes for kept in self._results.values() if kept.on_disk)
