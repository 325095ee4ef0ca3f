"""The ``lm`` task: streamed, sharded text (textstream.py), the byte GPT (gpt.py), held-out loss and
bits per byte, the schedule and clipping hyperparameters (train.py), and ``swarmgrad peer lm``."""

from __future__ import annotations

import json
import math
import os
import tracemalloc

import pytest
import torch
from peer_processes import Swarm

from swarmgrad.errors import ConfigError
from swarmgrad.tasks import endless_batches, get_task
from swarmgrad.tasks.gpt import SIZES, parameter_count
from swarmgrad.tasks.textstream import Corpus, TextStream, list_corpus
from swarmgrad.tasks.train import clip_gradients, make_optimizer, make_schedule, train_locally


def write_corpus(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def stream_bytes(stream: TextStream) -> list[bytes]:
    return [bytes(inputs.to(torch.uint8).tolist()) + bytes([int(targets[-1])]) for inputs, targets in stream]


def test_named_sizes_span_a_few_million_to_125m_parameters():
    counts = {size: parameter_count(size, 256) for size in SIZES}
    assert counts == {"tiny": 3_290_624, "small": 10_844_160, "medium": 19_177_472, "base": 127_976_448}
    model = get_task("lm", {"size": "tiny", "context": 32}).make_model()
    assert model.embed.weight is not None and model(torch.zeros(2, 32, dtype=torch.long)).shape == (2, 32, 256)
    with pytest.raises(ConfigError, match="size"):
        get_task("lm", {"size": "huge"})


def test_shards_cut_the_text_by_offset_disjoint_and_covering(tmp_path):
    lines = {f"d/f{i:02d}.{'py' if i % 2 else 'md'}": "".join(f"file {i} line {j}\n" for j in range(200))
             for i in range(12)}
    write_corpus(tmp_path, lines)
    corpus = Corpus.split(list_corpus(tmp_path), every=5)
    assert [f.name for f in corpus.heldout] == ["d/f04.md", "d/f09.py"]  # fixed by file
    streams = [TextStream(corpus.train, shard, 3, seed=1, context=16) for shard in range(3)]
    assert streams[0].start == 0 and streams[-1].stop == sum(f.size for f in corpus.train)
    assert all(a.stop == b.start for a, b in zip(streams, streams[1:]))
    windows = [stream_bytes(stream) for stream in streams]
    assert all(len(w) == len(s) for w, s in zip(windows, streams))  # __len__ is exact for plain text
    text = b"".join((tmp_path / f.name).read_bytes() for f in corpus.train)
    for stream, shard_windows in zip(streams, windows):
        piece = text[stream.start:stream.stop + 1]
        assert all(window in piece for window in shard_windows)
    held = b"".join((tmp_path / f.name).read_bytes() for f in corpus.heldout)
    assert not any(window[:16] in held for shard_windows in windows for window in shard_windows)
    again = stream_bytes(TextStream(corpus.train, 1, 3, seed=1, context=16))
    assert again == windows[1]  # the same order on every peer given (seed, shard, pass)
    assert stream_bytes(streams[1]) != windows[1] and sorted(stream_bytes(streams[1])) == sorted(windows[1])


def test_jsonl_text_fields_are_read_and_bad_lines_refused(tmp_path):
    records = [{"text": f"record {i} ünïcode"} for i in range(300)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "b.txt").write_text("held out text " * 20)
    corpus = Corpus.split(list_corpus(tmp_path))
    assert [f.name for f in corpus.heldout] == ["b.txt"]
    text = b"".join(stream_bytes(TextStream(corpus.train, 0, 1, 0, 8)))
    assert "ünïcode".encode() in text and b'"text"' not in text
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{broken\n")
    with pytest.raises(ConfigError, match=r"a.jsonl: byte 15: not a JSON line"):
        stream_bytes(TextStream(Corpus.split(list_corpus(tmp_path)).train, 0, 1, 0, 2))
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ConfigError, match='string field "text"'):
        stream_bytes(TextStream(Corpus.split(list_corpus(tmp_path)).train, 0, 1, 0, 2))


def test_fingerprint_covers_tokenizer_context_and_every_file(tmp_path):
    for name in ("one", "two"):
        write_corpus(tmp_path / name, {"a.txt": "alpha " * 100, "b.py": "beta = 1\n" * 100})
    def fingerprint(name, **options):
        return get_task("lm", options, tmp_path / name).data_fingerprint()
    assert fingerprint("one") == fingerprint("two")  # the same text elsewhere: the same data
    assert fingerprint("one").startswith("lm:tokenizer=bytes-v1:context=256:")
    assert fingerprint("one", context=128) != fingerprint("one")
    (tmp_path / "two" / "b.py").write_text("beta = 2\n" * 100)  # same size, other bytes
    assert fingerprint("one") != fingerprint("two")
    stdlib = get_task("lm").data_fingerprint()
    assert stdlib.startswith("lm:") and stdlib != fingerprint("one")


def test_parameter_groups_schedule_and_clipping():
    model = get_task("lm", {"size": "tiny", "context": 16}).make_model()
    hparams = {**get_task("lm").default_hparams, "warmup_steps": 4, "decay_steps": 10, "lr": 1.0}
    optimizer = make_optimizer(model.parameters(), hparams)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in kept["params"])
    assert len(kept["params"]) == 4 * (4 + 4) + 2  # per block 2 norms' gains and biases and 4 linear biases; final norm
    assert len(make_optimizer(model.parameters(), {"optimizer": "adamw"}).param_groups) == 1
    schedule = make_schedule(optimizer, hparams)
    rates = []
    for _ in range(16):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[4] == pytest.approx(1.0) and rates[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert rates[14:] == pytest.approx([0.1, 0.1])
    assert make_schedule(optimizer, {}) is None
    task = get_task("lm", {"size": "tiny", "context": 16})
    inputs, targets = next(endless_batches(task.test_data(), 4))
    task.loss_fn(model(inputs), targets).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    clip_gradients(model.parameters(), {"grad_clip": float(norm) / 4})
    assert float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) == pytest.approx(float(norm) / 4)


def test_tiny_lm_learns_on_the_standard_library():
    """Held-out loss falls well below the uniform 8 bits per byte; bits per byte is loss in bits."""
    task = get_task("lm", {"size": "tiny", "context": 32})
    torch.set_num_threads(1)
    run = train_locally(task, max_steps=40, eval_every=20, eval_batches=4,
                        hparams={"batch_size": 8, "warmup_steps": 5, "lr": 2e-3})
    first_loss = task.evaluate(get_task("lm", {"size": "tiny", "context": 32}).make_model(), max_batches=4)["loss"]
    final = run.final
    assert first_loss > 5.0  # near uniform: ln 256 = 5.55
    assert final["loss"] < first_loss - 1.5, run.history
    assert final["bits_per_byte"] == pytest.approx(final["loss"] / math.log(2))


def anonymous_rss_bytes() -> int:
    """Resident anonymous memory: the heap's data, not the pages of torch's libraries a first call maps in."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_a_1gb_corpus_is_streamed_in_4_shards_in_little_memory(tmp_path):
    """1 GiB of text (hard links to one 4 MiB file: no disk used; 5 files held out) in 4 shards, with windows of 8 bytes:
    134M samples, so an index of them (a randperm: 1 GiB) could not fit the 200 MB allowed."""
    source = tmp_path / "source.txt"
    source.write_bytes((b"def f(x):\n    return x * 2  # a line of code\n" * 100_000)[: 4 << 20])
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i in range(262):
        os.link(source, corpus_dir / f"part{i:03d}.txt")
    tracemalloc.start()
    peak_rss, base_rss = 0, anonymous_rss_bytes()
    try:
        task = get_task("lm", {"size": "tiny", "context": 8}, corpus_dir)
        for shard in range(4):
            stream = task.train_data(shard, 4, 0)
            assert len(stream) * 8 >= (1 << 30) // 4 - 8
            batches = endless_batches(stream, 64)
            for _ in range(5):
                inputs, targets = next(batches)
                peak_rss = max(peak_rss, anonymous_rss_bytes() - base_rss)
            assert inputs.shape == (64, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
            del batches, stream
        _, peak_python = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"1 GiB corpus, 4 shards: peak Python allocations {peak_python / 1e6:.1f} MB, anonymous RSS growth {peak_rss / 1e6:.1f} MB")
    assert peak_python < 200e6 and peak_rss < 200e6, (peak_python, peak_rss)


@pytest.mark.slow  # a peer process: imports, p2pd, 30 steps and the final evaluation (64 s at load 15 here)
def test_swarmgrad_peer_lm_trains_and_reports_bits_per_byte():
    """The CLI path: the runner streams the task, clips, schedules, and its evaluations carry bits per byte."""
    run = Swarm("lm-cli")
    try:
        peer = run.peer("--create", "--task-option", "size=tiny", "--task-option", "context=32",
                        "--hparam", "batch_size=8", "--hparam", "warmup_steps=5", "--hparam", "lr=0.002",
                        "--max-steps", "30", "--eval-every", "0", "--eval-batches", "4", "--inner-steps", "10",
                        task="lm", initial_peers=False, name="lm")
        peer.ready(120)
        done = peer.done(240)
        assert peer.wait_exit(20) == 0, peer.describe()
    finally:
        run.close()
    assert done["reason"] == "max_steps" and done["step"] == 30, done
    final = done["final"]
    assert final["loss"] < math.log(256) - 1.0 and final["bits_per_byte"] == pytest.approx(final["loss"] / math.log(2))
