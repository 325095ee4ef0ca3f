"""Checkpoints: the safetensors format, its atomic switch (a real SIGKILL mid-write), the old format,
and the Checkpointer that saves on a thread while the swarm step goes on."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarmgrad.errors import ConfigError
from swarmgrad.peer import checkpoint
from swarmgrad.peer.checkpoint import (
    DESCRIPTION_FILE,
    LATEST_FILE,
    LEGACY_FILE,
    Checkpointer,
    load_checkpoint,
    save_checkpoint,
)
from swarmgrad.state.snapshot import StateSnapshot

ROOT = Path(__file__).resolve().parent.parent.parent


def sample_snapshot(version: int = 3) -> StateSnapshot:
    torch.manual_seed(version)
    return StateSnapshot.capture(version, {
        "model/w": torch.randn(4, 3), "model/half": torch.randn(5).half(), "model/bf": torch.randn(2, 2).bfloat16(),
        "model/count": torch.tensor(7), "model/mask": torch.tensor([True, False, True]), "model/empty": torch.zeros(0, 3),
        "strategy/momentum": torch.randn(4, 3, dtype=torch.float64), "optimizer/0/exp_avg": torch.randn(4, 3),
    }, {"settings": "{}", "optimizer_scalars": {"0": {"step": 4}}})


def assert_same(loaded: StateSnapshot, snapshot: StateSnapshot) -> None:
    assert (loaded.version, loaded.specs, loaded.meta) == (snapshot.version, snapshot.specs, snapshot.meta)
    assert torch.equal(loaded.data, snapshot.data)  # bitwise, padding included


def saved(directory: Path) -> Path:
    return directory / (directory / LATEST_FILE).read_text().strip()


# ---- the format --------------------------------------------------------------------------------------------


def test_round_trip_in_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 64)  # several shards; the 96-byte tensors get one each
    assert load_checkpoint(tmp_path / "deep" / "dir", "run") is None
    snapshot = sample_snapshot()
    folder = save_checkpoint(tmp_path / "deep" / "dir", "run", snapshot, {"privacy": {"history": [[1.0, 0.5, 3]]}})
    assert folder == saved(tmp_path / "deep" / "dir") and folder.name.startswith("checkpoint-3-")
    shards = sorted(path.name for path in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"state-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(folder)) == sorted([*shards, DESCRIPTION_FILE])
    loaded, extra = load_checkpoint(tmp_path / "deep" / "dir", "run")
    assert_same(loaded, snapshot)
    assert extra == {"privacy": {"history": [[1.0, 0.5, 3]]}}
    assert sorted(os.listdir(tmp_path / "deep" / "dir")) == sorted([LATEST_FILE, folder.name])  # nothing else left


def test_a_user_loads_the_tensors_with_safetensors_alone(tmp_path):
    snapshot = sample_snapshot()
    save_checkpoint(tmp_path, "run", snapshot, {})
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(saved(tmp_path).glob("*.safetensors")):
        state.update(load_file(shard))
    expected = snapshot.tensors()
    assert state.keys() == expected.keys()
    assert all(state[name].dtype == tensor.dtype and torch.equal(state[name], tensor) for name, tensor in expected.items())
    description = json.loads((saved(tmp_path) / DESCRIPTION_FILE).read_text())
    assert (description["format"], description["run_id"], description["version"]) == (2, "run", 3)


def test_each_save_replaces_the_last_one_of_the_same_version_too(tmp_path):
    first = save_checkpoint(tmp_path, "run", sample_snapshot(3), {"steps": 1})
    second = save_checkpoint(tmp_path, "run", sample_snapshot(3), {"steps": 2})  # leaving: same epoch, new counters
    assert first != second and not first.exists()
    assert load_checkpoint(tmp_path, "run")[1] == {"steps": 2}
    assert sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, second.name])


def test_checkpoint_of_another_run_is_refused(tmp_path):
    save_checkpoint(tmp_path, "run-a", sample_snapshot(), {})
    with pytest.raises(ConfigError, match="belongs to run 'run-a', not 'run-b'"):
        load_checkpoint(tmp_path, "run-b")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


DAMAGES = {
    "truncated shard": lambda folder: truncate(folder / "state-00001-of-00001.safetensors"),
    "garbage shard": lambda folder: (folder / "state-00001-of-00001.safetensors").write_bytes(b"not safetensors" * 9),
    "missing shard": lambda folder: (folder / "state-00001-of-00001.safetensors").unlink(),
    "truncated description": lambda folder: truncate(folder / DESCRIPTION_FILE),
    "missing description": lambda folder: (folder / DESCRIPTION_FILE).unlink(),
    "missing folder": shutil.rmtree,
    "pointer to nowhere": lambda folder: (folder.parent / LATEST_FILE).write_text("../../etc\n"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_a_config_error_naming_the_file(tmp_path, damage):
    folder = save_checkpoint(tmp_path, "run", sample_snapshot(), {})
    DAMAGES[damage](folder)
    with pytest.raises(ConfigError, match=rf"^checkpoint {tmp_path}/\S+ cannot be read \(.+\); "
                                          rf"move {tmp_path} away to start fresh$"):
        load_checkpoint(tmp_path, "run")


def test_a_shard_that_does_not_fit_the_specs_is_refused(tmp_path):
    folder = save_checkpoint(tmp_path, "run", sample_snapshot(), {})
    description = json.loads((folder / DESCRIPTION_FILE).read_text())
    description["specs"][0][2] = [3, 4]
    (folder / DESCRIPTION_FILE).write_text(json.dumps(description))
    with pytest.raises(ConfigError, match="'model/w' .* is not in the specs, or is there twice or in another shape"):
        load_checkpoint(tmp_path, "run")


# ---- the old format: checkpoint.pt ---------------------------------------------------------------------------


def save_legacy(directory: Path, run_id: str, snapshot: StateSnapshot, extra: dict) -> Path:
    """What swarmgrad wrote before format 2."""
    payload = {"format": 1, "swarmgrad": "0", "run_id": run_id, "version": snapshot.version,
               "specs": [list(spec) for spec in snapshot.specs], "meta": snapshot.meta, "data": snapshot.data,
               "extra": extra}
    torch.save(payload, directory / LEGACY_FILE)
    return directory / LEGACY_FILE


def test_the_old_format_is_still_read_and_the_first_new_save_replaces_it(tmp_path):
    snapshot = sample_snapshot(5)
    save_legacy(tmp_path, "run", snapshot, {"counters": {"steps": 9}})
    loaded, extra = load_checkpoint(tmp_path, "run")
    assert_same(loaded, snapshot)
    assert extra == {"counters": {"steps": 9}}
    with pytest.raises(ConfigError, match="belongs to run 'run'"):
        load_checkpoint(tmp_path, "other")
    folder = save_checkpoint(tmp_path, "run", sample_snapshot(6), {})
    assert sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, folder.name])
    assert load_checkpoint(tmp_path, "run")[0].version == 6


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_damaged_old_checkpoint_is_a_config_error(tmp_path, damage):
    path = save_legacy(tmp_path, "run", sample_snapshot(), {})
    content = path.read_bytes()
    path.write_bytes({"garbage": b"not a checkpoint" * 10, "truncated": content[: len(content) // 2],
                      "empty": b""}[damage])
    with pytest.raises(ConfigError, match="cannot be read"):
        load_checkpoint(tmp_path, "run")


@pytest.mark.parametrize("cut", [4, 3])
def test_old_checkpoint_whose_bytes_do_not_fit_the_layout_is_refused(tmp_path, cut):
    snapshot = sample_snapshot()
    short = StateSnapshot(snapshot.version, snapshot.specs, snapshot.meta, snapshot.data[:-cut].clone())
    save_legacy(tmp_path, "run", short, {})
    with pytest.raises(ConfigError):
        load_checkpoint(tmp_path, "run")
    long = StateSnapshot(snapshot.version, snapshot.specs, snapshot.meta,
                         torch.cat([snapshot.data, torch.zeros(cut, dtype=torch.uint8)]))
    save_legacy(tmp_path, "run", long, {})
    with pytest.raises(ConfigError, match="truncated"):
        load_checkpoint(tmp_path, "run")


# ---- atomicity -------------------------------------------------------------------------------------------


def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    first = save_checkpoint(tmp_path, "run", sample_snapshot(1), {"n": 1})

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, "run", sample_snapshot(2), {"n": 2})
    loaded, extra = load_checkpoint(tmp_path, "run")
    assert loaded.version == 1 and extra == {"n": 1}
    assert sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, first.name])


def test_killed_between_rename_and_pointer_the_previous_one_is_loaded_and_the_orphan_removed(tmp_path, monkeypatch):
    first = save_checkpoint(tmp_path, "run", sample_snapshot(1), {})

    def killed(directory, name):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "_point_to", killed)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path, "run", sample_snapshot(2), {})
    assert len(os.listdir(tmp_path)) == 3  # latest, the first and the orphan
    assert_same(load_checkpoint(tmp_path, "run")[0], sample_snapshot(1))
    third = save_checkpoint(tmp_path, "run", sample_snapshot(3), {})
    assert not first.exists() and sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, third.name])


KILLED_WRITER = """
import sys, time
from pathlib import Path

import safetensors.torch
import torch

from swarmgrad.peer import checkpoint
from swarmgrad.state.snapshot import StateSnapshot


def state(version):
    generator = torch.Generator().manual_seed(version)
    return StateSnapshot.capture(version, {f"model/w{i}": torch.randn(1024, 1024, generator=generator)
                                           for i in range(8)}, {"v": version})  # 32 MB


def slow_save_file(tensors, path, metadata=None):  # a disk at about 30 MB/s
    data = safetensors.torch.save(tensors, metadata)
    with open(path, "wb") as file:
        for start in range(0, len(data), 1 << 16):
            file.write(data[start : start + (1 << 16)])
            file.flush()
            time.sleep(0.002)


directory = Path(sys.argv[1])
checkpoint.save_checkpoint(directory, "run", state(1), {"n": 1})
checkpoint.save_file, checkpoint.SHARD_BYTES = slow_save_file, 8 << 20
checkpoint.save_checkpoint(directory, "run", state(2), {"n": 2})
"""


def test_sigkill_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the second save has one whole shard and part of the next
            partial = [path for path in tmp_path.glob(".checkpoint-*") if path.is_dir()]
            shards = sorted(partial[0].glob("*.safetensors")) if partial else []
            if len(shards) >= 2 and 0 < shards[-1].stat().st_size < 8 << 20:
                break
            assert writer.poll() is None, f"the writer ended first:\n{writer.stderr.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "the second save never got under way"
            time.sleep(0.005)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    loaded, extra = load_checkpoint(tmp_path, "run")
    generator = torch.Generator().manual_seed(1)
    expected = {f"model/w{i}": torch.randn(1024, 1024, generator=generator) for i in range(8)}
    assert loaded.version == 1 and extra == {"n": 1} and loaded.meta == {"v": 1}
    assert all(torch.equal(loaded.tensors()[name], tensor) for name, tensor in expected.items())
    assert partial[0].exists()  # what the kill left: ignored by the load, removed by the next save
    save_checkpoint(tmp_path, "run", sample_snapshot(3), {})
    assert not any(path.name.startswith(".checkpoint-") for path in tmp_path.iterdir())


class LiveSnapshot:
    """A snapshot whose tensors are views of live ones: ``still_current()`` says whether they moved on."""

    def __init__(self, snapshot: StateSnapshot, current: bool):
        self.version, self.specs, self.meta = snapshot.version, snapshot.specs, snapshot.meta
        self._snapshot, self.current = snapshot, current

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._snapshot.tensors()

    def still_current(self) -> bool:
        return self.current


def test_a_snapshot_that_changed_while_written_is_dropped(tmp_path, caplog):
    first = save_checkpoint(tmp_path, "run", sample_snapshot(1), {})
    with caplog.at_level(logging.DEBUG, logger="swarmgrad.peer.checkpoint"):
        assert save_checkpoint(tmp_path, "run", LiveSnapshot(sample_snapshot(2), current=False), {}) is None
    assert "checkpoint of version 2 dropped: the state changed while it was written" in caplog.text
    assert sorted(os.listdir(tmp_path)) == sorted([LATEST_FILE, first.name])
    assert load_checkpoint(tmp_path, "run")[0].version == 1
    assert save_checkpoint(tmp_path, "run", LiveSnapshot(sample_snapshot(2), current=True), {}) is not None
    assert_same(load_checkpoint(tmp_path, "run")[0], sample_snapshot(2))


# ---- the Checkpointer: off the swarm step ------------------------------------------------------------------


def test_save_returns_at_once_one_write_at_a_time_and_the_last_save_waits(tmp_path, monkeypatch):
    release, started, written = threading.Event(), threading.Event(), []

    def held(directory, run_id, snapshot, extra):
        started.set()
        assert release.wait(10)
        written.append((snapshot.version, extra["n"]))

    monkeypatch.setattr(checkpoint, "save_checkpoint", held)
    state, count = {"snapshot": sample_snapshot(1)}, iter(range(1, 10))
    checkpointer = Checkpointer(tmp_path, "run", 0.0, lambda: state["snapshot"], lambda: {"n": next(count)})

    async def main() -> None:
        assert checkpointer.due()
        checkpointer.save()  # returns while the write is held
        assert await asyncio.to_thread(started.wait, 10)
        assert checkpointer.writing and not checkpointer.due()
        state["snapshot"] = sample_snapshot(2)
        checkpointer.save()  # skipped: one write at a time
        last = asyncio.ensure_future(checkpointer.save_last())
        await asyncio.sleep(0.05)
        assert written == [] and not last.done()
        release.set()
        await last
        assert checkpointer.due()

    asyncio.run(main())
    assert written == [(1, 1), (2, 2)]


def test_a_failed_background_save_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    def full(directory, run_id, snapshot, extra):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_checkpoint", full)
    checkpointer = Checkpointer(tmp_path, "run", 0.0, sample_snapshot, dict)

    async def main() -> None:
        checkpointer.save()
        await asyncio.sleep(0.2)
        assert not checkpointer.writing
        with pytest.raises(OSError, match="disk full"):  # leaving: the peer logs it as the final checkpoint
            await checkpointer.save_last()

    asyncio.run(main())
    assert "OSError: disk full" in caplog.text


# ---- a DiLoCo peer's live state ------------------------------------------------------------------------------


@pytest.mark.parametrize("held", [True, False])
def test_an_outer_step_during_a_save_leaves_the_save_its_tensors_or_drops_it(tmp_path, monkeypatch, held):
    """A DiLoCo peer's state is served from its outer start and momentum, not a copy. A save holds
    the version it writes (the state server's ``hold``): an outer step meanwhile goes on with copies,
    and the checkpoint is the state as published. Without the hold the same save is dropped (its
    tensors moved), never written torn."""
    from types import SimpleNamespace

    from swarmgrad.peer.state import TrainingState
    from swarmgrad.peer.strategies.diloco import DiLoCo, DiLoCoPolicy
    from swarmgrad.state.server import StateServer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    policy = DiLoCoPolicy(DiLoCo(inner_steps=2), model, optimizer, SimpleNamespace())
    server = StateServer(None, "swarmgrad/test/state")
    policy.before_outer_step = server.retire
    state = TrainingState(model, optimizer, policy)
    server.publish(state.capture(1, {}))
    published = {name: tensor.clone() for name, tensor in server.latest.tensors().items()}
    writing, go_on = threading.Event(), threading.Event()
    original = checkpoint.save_file

    def slow_save_file(*args, **kwargs):
        writing.set()
        go_on.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", slow_save_file)

    async def scenario():
        saver = Checkpointer(tmp_path, "run", 0.0, lambda: server.latest, lambda: {},
                             **({"hold": server.hold} if held else {}))
        saver.save()
        await asyncio.to_thread(writing.wait, 10)
        policy.apply(torch.ones(policy.layout.total))  # the next outer step, mid-write
        server.publish(state.capture(2, {}))
        go_on.set()
        await saver._writing

    asyncio.run(scenario())
    assert not torch.equal(policy.start[:10], published["model/weight"].reshape(-1)[:10])  # the peer stepped on
    loaded = load_checkpoint(tmp_path, "run")
    if not held:
        assert loaded is None  # dropped, not torn
        return
    tensors = loaded[0].tensors()
    for name in ("model/weight", "model/bias", "strategy/momentum/0"):
        assert torch.equal(tensors[name], published[name]), name
    assert sorted(server._snapshots) == [2]  # released: the tensors kept for the save went with it
    assert server.held_bytes()["served_state_copies"] == 0
