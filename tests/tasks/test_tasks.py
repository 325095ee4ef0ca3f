"""Built-in tasks: the IDX reader on real and broken files, sharding, models, short training runs, get_task."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TORCH_THREADS
from torch.utils.data import TensorDataset

from swarmgrad.errors import ConfigError
from swarmgrad.tasks import TASKS, Task, TaskFactory, TaskOptions, get_task, shard_indices
from swarmgrad.tasks.charlm import unigram_entropy
from swarmgrad.tasks.digits import load_digits_split
from swarmgrad.tasks.fashion_mnist import DEFAULT_DATA_DIR, load_split
from swarmgrad.tasks.idx import parse_idx, read_idx
from swarmgrad.tasks.registry import find_tasks
from swarmgrad.tasks.train import train_locally

needs_fashion = pytest.mark.skipif(not (DEFAULT_DATA_DIR / "t10k-labels-idx1-ubyte.gz").exists(),
                                   reason="Debian's dataset-fashion-mnist is not installed")


@pytest.fixture(autouse=True)
def torch_threads():
    """The machines here have 2 cores; more threads only fight each other (conftest.TORCH_THREADS)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(previous)


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = struct.pack(">HBB", 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_fashion_dir(directory: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for prefix in ("train", "t10k"):
        (directory / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (directory / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(labels))  # raw works too
    return directory


# --- IDX reader ---------------------------------------------------------------------------------------------

@needs_fashion
def test_real_fashion_mnist_files_load_with_the_right_shapes():
    for split, count in (("train", 60000), ("test", 10000)):
        images, labels = load_split(DEFAULT_DATA_DIR, split)
        assert images.shape == (count, 1, 28, 28) and images.dtype == torch.float32
        assert labels.shape == (count,) and labels.dtype == torch.int64
        assert int(labels.min()) == 0 and int(labels.max()) == 9
        assert torch.bincount(labels).tolist() == [count // 10] * 10  # Fashion-MNIST is balanced
    images, _ = load_split(DEFAULT_DATA_DIR, "train")
    assert abs(float(images.mean())) < 0.05 and abs(float(images.std()) - 1) < 0.05  # normalised
    assert load_split(DEFAULT_DATA_DIR, "train")[0] is images  # decoded once per process
    raw = read_idx(DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz")
    assert raw.shape == (10000, 28, 28) and raw.dtype == np.uint8


def test_idx_round_trip_for_every_type():
    for type_code, dtype in ((0x08, np.uint8), (0x09, np.int8), (0x0B, np.int16), (0x0C, np.int32),
                             (0x0D, np.float32), (0x0E, np.float64)):
        array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
        parsed = parse_idx(idx_bytes(array, type_code))
        assert parsed.dtype == dtype and np.array_equal(parsed, array)


def test_truncated_gzip_raises_a_clear_error(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    images = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    path.write_bytes(gzip.compress(idx_bytes(images))[:20000])  # a download cut short
    with pytest.raises(ConfigError, match="corrupt or truncated gzip") as error:
        read_idx(path)
    assert str(path) in str(error.value)


def test_truncated_wrong_magic_and_oversized_idx_raise_config_error(tmp_path):
    good = idx_bytes(np.zeros((10, 28, 28), np.uint8))
    with pytest.raises(ConfigError, match=r"truncated: header declares shape \(10, 28, 28\)"):
        parse_idx(good[:-7], "x")
    with pytest.raises(ConfigError, match="longer than its header says"):
        parse_idx(good + b"\0", "x")
    with pytest.raises(ConfigError, match="bad magic number 0x504b0304"):
        parse_idx(b"PK\x03\x04" + good[4:], "x")  # a zip file, not IDX
    with pytest.raises(ConfigError, match="not even a header"):
        parse_idx(b"\0\0", "x")
    with pytest.raises(ConfigError, match=r"magic 0x00000801 \(1 dimensions\), expected 3"):
        parse_idx(idx_bytes(np.zeros(10, np.uint8)), "labels", expect_ndim=3)


def test_fashion_loader_checks_that_files_belong_together(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    write_fashion_dir(tmp_path / "ok", images, np.arange(20, dtype=np.uint8) % 10)
    task = get_task("fashion-mnist", data_dir=tmp_path / "ok")
    assert len(task.test_data()) == 20 and len(task.train_data(0, 2, 0)) == 10
    write_fashion_dir(tmp_path / "short", images, np.zeros(19, np.uint8))
    with pytest.raises(ConfigError, match="19 uint8 labels for 20 images"):
        get_task("fashion-mnist", data_dir=tmp_path / "short").test_data()
    write_fashion_dir(tmp_path / "badlabel", images, np.full(20, 12, np.uint8))
    with pytest.raises(ConfigError, match="label 12, expected 0..9"):
        get_task("fashion-mnist", data_dir=tmp_path / "badlabel").test_data()


def test_missing_data_directory_names_the_path_and_the_debian_package(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as error:
        get_task("fashion-mnist", data_dir=missing)
    assert str(missing) in str(error.value) and "dataset-fashion-mnist" in str(error.value)
    assert "--data-dir" in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte"):
        get_task("fashion-mnist", data_dir=tmp_path / "empty")


# --- sharding -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,shards", [(60000, 4), (1438, 3), (10, 10), (7, 1)])
def test_shards_are_disjoint_cover_everything_and_are_deterministic(size, shards):
    parts = [shard_indices(size, k, shards, seed=5) for k in range(shards)]
    joined = torch.cat(parts)
    assert len(joined) == size and torch.equal(joined.sort().values, torch.arange(size))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
    assert all(torch.equal(p, shard_indices(size, k, shards, seed=5)) for k, p in enumerate(parts))
    if size > 10 and shards > 1:
        assert not torch.equal(parts[0], shard_indices(size, 0, shards, seed=6))  # the seed matters


def test_bad_shard_arguments_raise_config_error():
    for shard, shards in ((4, 4), (-1, 4), (0, 0)):
        with pytest.raises(ConfigError, match="0 <= shard < num_shards"):
            shard_indices(100, shard, shards, 0)
    with pytest.raises(ConfigError, match="non-empty shards"):
        shard_indices(3, 0, 4, 0)


def test_task_shards_hold_exactly_the_indexed_samples():
    task = get_task("digits")
    inputs, _ = load_digits_split()["train"]
    for k in range(3):
        part = task.train_data(k, 3, 11)
        assert isinstance(part, TensorDataset)
        assert torch.equal(part.tensors[0], inputs[shard_indices(len(inputs), k, 3, 11)])
    assert sum(len(task.train_data(k, 3, 11)) for k in range(3)) == len(inputs)


# --- models and short training runs ---------------------------------------------------------------------------

def small_charlm() -> Task:
    return get_task("charlm", {"context": 32, "max_bytes": 2**20})


@pytest.mark.parametrize("name,output", [("fashion-mnist", (8, 10)), ("digits", (8, 10)), ("charlm", (8, 32, 256))])
def test_models_forward_backward_and_are_deterministic(name, output):
    if name == "fashion-mnist" and not DEFAULT_DATA_DIR.exists():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    task = small_charlm() if name == "charlm" else get_task(name)
    inputs, targets = next(iter(torch.utils.data.DataLoader(task.train_data(0, 1, 0), batch_size=8)))
    torch.manual_seed(3)
    model = task.make_model()
    logits = model(inputs)
    assert logits.shape == output
    task.loss_fn(logits, targets).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.manual_seed(3)
    again = task.make_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_evaluate_is_batched_restores_mode_and_respects_max_batches():
    task = get_task("digits")
    model = task.make_model().train()
    full = task.evaluate(model)
    assert model.training and set(full) >= {"loss", "accuracy"} and full["samples"] == len(task.test_data())
    assert task.evaluate(model, max_batches=2, batch_size=50)["samples"] == 100
    assert 0.0 <= full["accuracy"] <= 0.3  # untrained: about chance


def test_digits_trains_past_90_percent():
    run = train_locally(get_task("digits"), max_steps=300, eval_every=100)
    assert run.final["accuracy"] > 0.90, run.history


def test_a_time_budget_holds_between_evaluations():
    """max_seconds stops training mid-way to an evaluation (it was checked only at evaluations: a 60 s
    budget with evaluations 10^6 steps apart trained for minutes), and the run ends with one."""
    run = train_locally(get_task("digits"), max_seconds=0.5, eval_every=10**6)
    assert 0.5 <= run.train_seconds < 2.0 and 0 < run.steps < 10**6, (run.train_seconds, run.steps)
    assert len(run.history) == 1 and run.history[0]["step"] == run.steps


@needs_fashion
def test_fashion_mnist_trains_past_70_percent_in_300_steps():
    run = train_locally(get_task("fashion-mnist"), max_steps=300, eval_every=300)
    assert run.final["accuracy"] > 0.70, run.history


def test_charlm_beats_the_unigram_baseline():
    task = small_charlm()
    targets = task.test_data().tensors[1]
    baseline = unigram_entropy(targets)
    majority = float(torch.bincount(targets.reshape(-1)).max()) / targets.numel()  # always guessing ' ': ~0.29
    run = train_locally(task, max_steps=150, eval_every=150, eval_batches=4,
                        hparams={"batch_size": 16, "lr": 3e-3})
    assert run.final["loss"] < baseline, (run.history, baseline)
    assert run.final["accuracy"] > majority  # next-byte accuracy


# --- get_task -----------------------------------------------------------------------------------------------

class TinyOptions(TaskOptions):
    hidden: int = 4


def tiny_task(options: TinyOptions, data_dir: Path | None) -> Task:
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    return Task(name="tiny",
                make_model=lambda: torch.nn.Sequential(torch.nn.Linear(3, options.hidden),
                                                       torch.nn.Linear(options.hidden, 2)),
                loss_fn=torch.nn.functional.cross_entropy,
                train_data=lambda shard, shards, seed: data, test_data=lambda: data)


TINY = tiny_task(TinyOptions(), None)
TINY_TASK = TaskFactory("tiny", tiny_task, TinyOptions)
NOT_A_TASK = 42
RETURNS_A_STRING = TaskFactory("stringy", lambda options, data_dir: "nope")


def test_get_task_accepts_module_attribute_specs():
    assert get_task(f"{__name__}:TINY") is TINY
    task = get_task(f"{__name__}:TINY_TASK", {"hidden": 7})
    assert task.name == "tiny" and task.make_model()[0].out_features == 7
    assert task.evaluate(task.make_model())["samples"] == 16


def test_a_task_option_reaches_the_model():
    assert get_task("charlm", {"context": 256}).make_model().context == 256
    assert get_task("charlm", {"context": "48"}).make_model().context == 48  # as a flag's text arrives
    assert get_task("charlm").make_model().context == 64


@pytest.mark.parametrize("spec,options,message", [
    ("fashion_mnist", {}, "unknown task 'fashion_mnist'. Did you mean 'fashion-mnist'"),
    ("nonsense", {}, "Built-in tasks: charlm, digits, fashion-mnist, fashion-mnist-large, lm; or pass module:attribute"),
    ("no_such_module_xyz:task", {}, "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
    (f"{__name__}:missing", {}, "has no attribute 'missing'"),
    (f"{__name__}:NOT_A_TASK", {}, "is a int, not a swarmgrad.tasks.Task or TaskFactory"),
    (f"{__name__}:tiny_task", {}, "is a function, not a swarmgrad.tasks.Task or TaskFactory"),
    (f"{__name__}:RETURNS_A_STRING", {}, "task 'stringy' built a str, expected a swarmgrad.tasks.Task"),
    (f"{__name__}:TINY", {"hidden": 3}, "ready-made Task and takes no options"),
    ("digits", {"context": 3}, "^task 'digits' has no option 'context'; it takes: no options$"),
    ("charlm", {"contxt": 3},
     "^task 'charlm' has no option 'contxt'; it takes: context, max_bytes, dim, layers, heads$"),
    ("charlm", {"context": 1},
     r"^task 'charlm': option context: Input should be greater than or equal to 2 \(got 1\)$"),
    ("charlm", {"context": "wide"}, "^task 'charlm': option context: Input should be a valid integer"),
    ("charlm", {"dim": 10}, "^task 'charlm': charlm needs .* dim divisible by heads"),
    (":x", {}, "must look like 'package.module:attribute'"),
])
def test_bad_task_specs_and_options_raise_one_config_error(spec, options, message):
    with pytest.raises(ConfigError, match=message) as error:
        get_task(spec, options)
    assert "\n" not in str(error.value)


def test_tasks_that_read_no_files_ignore_the_data_directory(tmp_path):
    assert get_task("digits", data_dir=tmp_path).name == "digits"
    assert get_task("charlm", {"context": 32, "max_bytes": 2**20}, tmp_path).name == "charlm"


NEW_TASK = '''
"""A task written as one module."""

import torch
from torch.utils.data import TensorDataset

from swarmgrad.tasks.base import Task, TaskFactory, TaskOptions


class LineOptions(TaskOptions):
    slope: float = 2.0


def line_task(options, data_dir):
    inputs = torch.linspace(0, 1, 32)[:, None]
    data = TensorDataset(inputs, (options.slope * inputs[:, 0] > 1).long())
    return Task(name="line", make_model=lambda: torch.nn.Linear(1, 2), loss_fn=torch.nn.functional.cross_entropy,
                train_data=lambda shard, shards, seed: data, test_data=lambda: data)


LINE = TaskFactory("line", line_task, LineOptions)
'''


def test_the_runner_loads_every_task_the_same_way(tmp_path):
    from swarmgrad.peer.config import RunConfig
    from swarmgrad.peer.runner import load_task

    config = RunConfig(task="charlm", task_options={"context": 32, "max_bytes": 2**20})
    assert load_task(config.task, str(tmp_path), config.task_options).make_model().context == 32
    assert load_task("digits", str(tmp_path), {}).name == "digits"


def test_the_readme_lists_every_task_and_its_options():
    section = (Path(__file__).parents[2] / "README.md").read_text().split("## Built-in tasks")[1].split("\n## ")[0]
    for name, factory in TASKS.items():
        assert f'"{name}"' in section, name
        assert all(f"`{option}`" in section for option in factory.options.model_fields), name


def test_a_new_task_is_one_module(tmp_path, monkeypatch):
    import swarmgrad.tasks as package
    from swarmgrad.tasks import registry

    (tmp_path / "line.py").write_text(NEW_TASK)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])  # as if line.py were in it
    monkeypatch.delitem(sys.modules, "swarmgrad.tasks.line", raising=False)
    found = find_tasks()
    assert set(found) == set(TASKS) | {"line"}
    monkeypatch.setattr(registry, "TASKS", found)
    assert len(get_task("line", {"slope": 4}).test_data()) == 32
    with pytest.raises(ConfigError, match="task 'line' has no option 'slop'; it takes: slope"):
        get_task("line", {"slop": 4})


def test_tasks_import_nothing_from_the_network_layers():
    code = ("import sys, swarmgrad.tasks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hivemind' "
            "or m.startswith(('swarmgrad.dht', 'swarmgrad.averaging', 'swarmgrad.peer', 'sklearn'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"  # scikit-learn too: it loads only when the digits task is used


def test_single_process_runner_prints_a_json_summary(capsys):
    from swarmgrad.tasks.__main__ import main

    assert main(["digits", "--steps", "100", "--eval-every", "100", "--target", "0.5", "--json"]) == 0
    assert '"task": "digits"' in capsys.readouterr().out
    assert main(["nonsense"]) == 2
