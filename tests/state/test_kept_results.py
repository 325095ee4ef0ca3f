"""Round results a donor keeps for replays go to disk (state/kept.py): in memory only until a thread
has written them, in unlinked temporary files that leave nothing behind, read back a payload at a
time, and kept in memory (with one warning) where the disk refuses them."""

from __future__ import annotations

import asyncio
import logging
import os

import torch
from conftest import travelled_in

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.result_frames import FramedAverage
from swarmgrad.state import results as state_results
from swarmgrad.state.kept import KeptResults, ResultHolds
from swarmgrad.state.results import RESULT_DTYPE, result_digest


def frames_of(values: torch.Tensor, size: int) -> list[tuple[dict, bytes]]:
    """Stand-in frames: headers and payloads (what is kept is their bytes, not what they decode to)."""
    data = values.numpy().tobytes()
    return [({"t": "avg", "c": index}, data[start : start + size]) for index, start in enumerate(range(0, len(data), size))]


class Framed:
    """A result held as frames, as far as keeping it goes (``numel`` and its digest's pieces)."""

    def __init__(self, values: torch.Tensor, frames: list[tuple[dict, bytes]]):
        self.values, self.frames = values, frames

    def numel(self) -> int:
        return self.values.numel()

    def pieces(self):
        yield 0, self.values


async def written(results: KeptResults, epoch: int) -> None:
    for _ in range(500):
        if results[epoch].on_disk:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not written to disk in 5 s")


def test_a_kept_result_moves_to_an_unlinked_file_and_reads_back_to_the_byte(tmp_path):
    values = torch.randn(30_000, generator=torch.Generator().manual_seed(1))
    frames = frames_of(values, 7_000)

    async def scenario():
        results = KeptResults(ResultHolds(60.0), directory=str(tmp_path))
        results.add(4, Framed(values, frames), frames)
        in_memory = results.held_bytes_in_memory()
        await written(results, 4)
        kept = results[4]
        read = [bytes(await kept.read(index)) for index in range(kept.count)]
        return in_memory, results.held_bytes_in_memory(), results.bytes_on_disk(), kept, read, await kept.named()

    in_memory, after, on_disk, kept, read, digest = asyncio.run(scenario())
    nbytes = sum(len(payload) for _, payload in frames)
    assert in_memory == nbytes and after == 0 and on_disk == nbytes  # the memory went once it was written
    assert kept.framed and kept.headers == [header for header, _ in frames]
    assert read == [payload for _, payload in frames]
    assert digest == result_digest(values)
    assert os.listdir(tmp_path) == []  # unlinked at once: nothing is left behind if the process dies


def test_a_framed_results_digest_is_computed_once_when_a_peer_first_asks_for_it(tmp_path):
    """Decoding every frame for the digest is a tenth of a round's CPU at 201M, and most rounds no
    peer replays: it waits for the first asker; two at once share one computation; a failed one is
    computed again for the next asker."""
    values = torch.randn(20_000, generator=torch.Generator().manual_seed(5))
    frames = frames_of(values, 8_000)
    computed = []

    class Counted(Framed):
        def pieces(self):
            computed.append(len(computed))
            if len(computed) == 1:
                raise OSError("the first computation fails")
            yield from super().pieces()

    async def scenario():
        results = KeptResults(ResultHolds(60.0), directory=str(tmp_path))
        results.add(3, Counted(values, frames), frames)
        await written(results, 3)
        unasked = len(computed)
        try:
            await results[3].named()
        except OSError:
            pass
        names = await asyncio.gather(results[3].named(), results[3].named())
        return unasked, names, await results[3].named()

    unasked, names, again = asyncio.run(scenario())
    assert unasked == 0  # kept and written: no digest yet
    assert names == [result_digest(values)] * 2 and again == names[0]
    assert len(computed) == 2  # the failed one, then one for both askers and the third


def test_an_average_kept_as_its_frames_reads_them_from_the_file_once_written(tmp_path):
    """An average that outlives its round (an outer step a download reads past holds it) reads its
    frames where they are kept: once they are on disk it pins none of them in memory."""
    schema, decoded, frames = travelled_in(torch.randn(20_000, generator=torch.Generator().manual_seed(5)), "int8")
    average = FramedAverage(frames, schema, get_codec("int8"))

    async def scenario():
        results = KeptResults(ResultHolds(60.0), directory=str(tmp_path))
        results.add(3, average, frames)
        await written(results, 3)
        return results

    results = asyncio.run(scenario())
    assert results.held_bytes_in_memory() == 0 and average.nbytes() == results.bytes_on_disk()
    read = [average.frames[index] for index in range(len(frames))]
    assert [header for header, _ in read] == [header for header, _ in frames]
    assert [payload for _, payload in read] == [payload for _, payload in frames]
    assert all(payload is not kept for (_, payload), (_, kept) in zip(read, frames))  # read back, not pinned
    assert torch.equal(average.dense(), decoded) and torch.equal(average[5000:13000], decoded[5000:13000])


def test_a_float_result_is_kept_as_bfloat16_chunks_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(state_results, "RESULT_CHUNK_BYTES", 4096)
    values = torch.randn(5_000, generator=torch.Generator().manual_seed(2))

    async def scenario():
        results = KeptResults(ResultHolds(60.0), directory=str(tmp_path))
        results.add(7, values)
        await written(results, 7)
        kept = results[7]
        return kept, b"".join([bytes(await kept.read(index)) for index in range(kept.count)])

    kept, data = asyncio.run(scenario())
    assert not kept.framed and kept.count == 3  # 10,000 bytes in chunks of 4096
    assert data == values.to(RESULT_DTYPE).view(torch.uint8).numpy().tobytes()
    assert kept.digest == result_digest(values)


def test_a_result_dropped_while_a_sender_reads_it_stays_readable_until_it_is_done(tmp_path):
    values = torch.randn(8_000, generator=torch.Generator().manual_seed(3))

    async def scenario():
        results = KeptResults(ResultHolds(60.0), keep=1, directory=str(tmp_path))
        results.add(1, values)
        await written(results, 1)
        reading = results[1]  # a sender's reference, as StateServer._send_result holds it
        results.add(2, values * 2)  # keep=1: round 1 goes
        return 1 in results, bytes(await reading.read(0))

    still_kept, data = asyncio.run(scenario())
    assert not still_kept
    assert data == values.to(RESULT_DTYPE).view(torch.uint8).numpy().tobytes()


def test_where_the_disk_refuses_results_stay_in_memory_with_one_warning(tmp_path, caplog):
    values = torch.randn(2_000, generator=torch.Generator().manual_seed(4))
    missing = str(tmp_path / "not-there")

    async def scenario():
        results = KeptResults(ResultHolds(60.0), directory=missing)
        for epoch in range(3):
            results.add(epoch, values + epoch)
            await asyncio.sleep(0.2)  # the write was tried (and failed)
        return results, [bytes(await results[epoch].read(0)) for epoch in results.epochs()]

    with caplog.at_level(logging.WARNING, logger="swarmgrad.state.kept"):
        results, read = asyncio.run(scenario())
    assert results.epochs() == [1, 2] and results.bytes_on_disk() == 0
    assert results.held_bytes_in_memory() == 2 * values.numel() * 2
    assert read == [(values + epoch).to(RESULT_DTYPE).view(torch.uint8).numpy().tobytes() for epoch in (1, 2)]
    assert len([record for record in caplog.records if "could not write" in record.message]) == 1


def test_a_donor_that_keeps_no_results_writes_none(tmp_path):
    results = KeptResults(ResultHolds(60.0), keep=0, directory=str(tmp_path))
    results.add(1, torch.ones(100))
    assert results.epochs() == [] and results.nbytes() == 0
