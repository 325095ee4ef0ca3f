"""Codecs on DiLoCo pseudo-gradients: bytes per round against held-out accuracy, offline and seeded.

    python benchmarks/codec_diloco.py [--json] [--quick] [--task digits] [--codecs none,int8,sparse]
                                      [--rounds 60] [--inner-steps 20] [--workers 8] [--seeds 0,...,7]

--workers DiLoCo workers live in this one process (no network). They start from the task's model
built under torch seed S, each with its own inner optimizer (the task's default hparams) and its
own shard of the training set (task.train_data(i, workers, S)). Every outer round, each worker
takes --inner-steps steps, fills its pseudo-gradient with DiLoCoPolicy.prepare, and the group
of all workers does exactly what the all-reduce does on the wire (``WireGroup``): on the run's
chunk grid (layout.Schema) every worker encodes each chunk through its own ErrorFeedback, framed
as it would be sent; each chunk's owner (layout.assign_parts, equal shares) decodes the frames,
adds them weighted by samples in member order and divides, encodes the average with the return
codec (allreduce.gather_codec_for) and decodes it, as every member does; error feedback is
committed; every worker applies the same average with DiLoCoPolicy.apply (the outer Nesterov
step, swarmgrad's DiLoCo defaults). After --rounds rounds the common model is scored on the task's
held-out set. Each codec runs once per seed; the table shows the mean over seeds, and the gap to
``none`` as the mean of per-seed differences (same start, data and batches) with its standard error.

Why 60 rounds: on digits uncompressed DiLoCo has plateaued by round 15 (96.1% at 15, 30 and 60),
while sparse codecs, which deliver each update over several rounds through error feedback, still
trail it at 30 rounds (by 0.9 points at 2 of 256) and are level with it by 60. A full run (7
codecs x 8 seeds) takes ~3.5 minutes on 2 cores, --quick a few seconds.

Over a short budget the ranking changes (``--task fashion-mnist-large --rounds 6 --workers 4
--seeds 0,1``, session 19; MB a round a worker): none 85.46%; q2 85.35% (0.11 behind, 2.37 MB);
sign 83.61% (1.85 behind, 1.42 MB); sparse:0.12 83.49% (1.97, 1.58 MB); sparse:0.06 81.91% (3.55,
0.89 MB); sparse:0.03 81.38% (4.08, 0.53 MB). Six rounds is the bandwidth sweep's budget, so q2 is
its best codec (benchmarks/bandwidth_sweep.py). Error feedback at the owners on the averages they
send back, tried then, widened every gap (q2 0.34, sign 2.41).

Bytes per round per worker: the codec payloads a worker sends in one round, both directions (its
chunks to their owners, and its part's averages to the other members), averaged over workers,
for the group of --workers that the simulation runs; fp32 is ``none``'s. Index bytes are payload,
so they count. Frame headers (msgpack, ~100 bytes a chunk frame, the same for every codec and
independent of the model's size) are shown in their own column and not in the ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from swarmgrad.averaging.allreduce import gather_codec_for
from swarmgrad.averaging.codecs import ErrorFeedback, get_codec
from swarmgrad.averaging.frames import decode_chunk, encode_chunk, encoded_to_frame
from swarmgrad.averaging.layout import Schema, assign_parts
from swarmgrad.net.wire import pack_prefix_and_header
from swarmgrad.peer.strategies.diloco import DiLoCo, DiLoCoPolicy
from swarmgrad.tasks import endless_batches, get_task
from swarmgrad.tasks.train import make_optimizer

CODECS = ["none", "int8", "q4", "q2", "topk:0.01", "sparse:0.01", "sparse"]
QUICK = {"codecs": ["none", "sparse"], "rounds": 4, "inner_steps": 5, "seeds": [0]}


class WireGroup:
    """One group's all-reduce rounds as the wire runs them, all members in this process."""

    def __init__(self, spec: str, schema: Schema, members: int):
        self.codec = get_codec(spec)
        self.gather = gather_codec_for(self.codec)
        self.schema, self.members = schema, members
        self.feedback = [ErrorFeedback(self.codec) if self.codec.lossy else None for _ in range(members)]
        parts = assign_parts(schema.chunks, [1.0] * members)
        self.owner = {index: member for member, part in enumerate(parts) for index in part}

    def _send(self, member: int, values: torch.Tensor, index: int) -> tuple[dict, bytes]:
        feedback = self.feedback[member]  # allreduce._encode_contribution
        if feedback is not None:
            header, payload = encoded_to_frame(feedback.encode(f"c{index}", values))
        else:
            header, payload = encode_chunk(self.codec, values)
        return header, bytes(payload)

    def round(self, contributions: list[torch.Tensor], weights: list[float]) -> tuple[torch.Tensor, int, int]:
        """The average every member ends with, and the payload and header bytes all members sent."""
        result = torch.empty(self.schema.total)
        payload_bytes = header_bytes = 0
        for chunk in self.schema.chunks:
            owner = self.owner[chunk.index]
            decoded = []
            for member, contribution in enumerate(contributions):
                values = contribution[chunk.start : chunk.start + chunk.length].view(chunk.view)
                header, payload = self._send(member, values, chunk.index)
                decoded.append(decode_chunk(self.codec, header, payload, chunk.view))
                if member != owner:
                    payload_bytes += len(payload)
                    header_bytes += len(pack_prefix_and_header({"t": "chunk", "c": chunk.index, **header}, 0))
            # the owner starts from its own share and adds the others' as they arrive (here: in order)
            total = decoded[owner] * weights[owner]
            for member in range(self.members):
                if member != owner:
                    total.add_(decoded[member], alpha=weights[member])
            average = total.div_(sum(weights))
            header, payload = encode_chunk(self.gather, average.view(chunk.view))
            if self.gather.lossy:  # every member, the owner included, keeps exactly what was sent
                average = decode_chunk(self.gather, header, bytes(payload), chunk.view)
            result[chunk.start : chunk.start + chunk.length] = average
            payload_bytes += (self.members - 1) * len(payload)
            header_bytes += (self.members - 1) * len(pack_prefix_and_header({"t": "avg", "c": chunk.index, **header}, 0))
        for feedback in self.feedback:  # the round succeeded
            if feedback is not None:
                feedback.commit()
        return result, payload_bytes, header_bytes


@dataclass
class Run:
    codec: str
    seed: int
    accuracy: float
    loss: float
    bytes_per_round: float  # payload per worker per round, both directions
    header_bytes_per_round: float
    seconds: float


def run_diloco(task_name: str, spec: str, seed: int, rounds: int, inner_steps: int, workers: int) -> Run:
    started = time.perf_counter()
    task = get_task(task_name)
    hparams = dict(task.default_hparams)
    batch_size = int(hparams.get("batch_size", 64))
    settings = DiLoCo(inner_steps=inner_steps)  # outer lr and momentum: swarmgrad's defaults
    torch.manual_seed(seed)
    model = task.make_model()
    policies, streams = [], []
    for worker in range(workers):
        replica = copy.deepcopy(model)
        policies.append(DiLoCoPolicy(settings, replica, make_optimizer(replica.parameters(), hparams), None))
        streams.append(endless_batches(task.train_data(worker, workers, seed), batch_size, seed * 1000 + worker))
    schema = Schema.of(list(policies[0].contribution_views().items()))
    group = WireGroup(spec, schema, workers)
    weight = float(inner_steps * batch_size)  # samples behind each contribution (DESIGN invariant 5)
    sent = headers = 0
    for _ in range(rounds):
        for policy, stream in zip(policies, streams):
            policy.model.train()
            for _ in range(inner_steps):
                inputs, targets = next(stream)
                task.loss_fn(policy.model(inputs), targets).backward()
                policy.optimizer.step()
                policy.optimizer.zero_grad(set_to_none=True)
            policy.prepare()
        average, payload_bytes, header_bytes = group.round([p.contribution for p in policies], [weight] * workers)
        sent, headers = sent + payload_bytes, headers + header_bytes
        for policy in policies:
            policy.apply(average)
    for policy in policies[1:]:  # every worker applied the very same averages
        assert torch.equal(policy.start, policies[0].start), "workers diverged"
    metrics = task.evaluate(policies[0].model)
    return Run(spec, seed, metrics["accuracy"], metrics["loss"], sent / workers / rounds,
               headers / workers / rounds, time.perf_counter() - started)


@dataclass
class Row:
    codec: str
    average_codec: str
    bytes_per_round: float
    header_bytes_per_round: float
    ratio: float
    accuracy: float  # mean over seeds
    accuracy_sd: float
    gap: float  # mean over seeds of the accuracy points below none's with the same seed (positive: worse)
    gap_se: float  # its standard error
    accuracies: list[float] = field(default_factory=list)


def run(task: str, codecs: list[str], rounds: int, inner_steps: int, workers: int, seeds: list[int]) -> dict:
    torch.set_num_threads(1)
    if "none" not in codecs:
        codecs = ["none", *codecs]
    runs = {spec: [run_diloco(task, spec, seed, rounds, inner_steps, workers) for seed in seeds] for spec in codecs}
    fp32 = statistics.fmean(r.bytes_per_round for r in runs["none"])
    baseline = [r.accuracy for r in runs["none"]]
    rows = []
    for spec, results in runs.items():
        accuracies = [r.accuracy for r in results]
        gaps = [100 * (base - accuracy) for base, accuracy in zip(baseline, accuracies)]
        sent = statistics.fmean(r.bytes_per_round for r in results)
        rows.append(Row(spec, gather_codec_for(get_codec(spec)).spec, sent,
                        statistics.fmean(r.header_bytes_per_round for r in results), fp32 / sent,
                        statistics.fmean(accuracies), statistics.pstdev(accuracies), statistics.fmean(gaps),
                        statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0, accuracies))
    return {"task": task, "workers": workers, "group": workers, "rounds": rounds, "inner_steps": inner_steps,
            "seeds": seeds, "fp32_bytes_per_round": fp32, "rows": [asdict(row) for row in rows],
            "runs": [asdict(r) for results in runs.values() for r in results]}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    seeds = result["seeds"]
    table = Table(title=f"DiLoCo on {result['task']}: {result['workers']} workers in one group, "
                        f"{result['rounds']} rounds x {result['inner_steps']} inner steps, "
                        f"mean of {len(seeds)} seed{'s' * (len(seeds) > 1)}")
    for column in ("codec", "return codec", "bytes/round/worker", "vs fp32", "header B", "accuracy %",
                   "sd", "gap to none", "gap se"):
        table.add_column(column, justify="left" if "codec" in column else "right")
    for row in result["rows"]:
        table.add_row(row["codec"], row["average_codec"], f"{row['bytes_per_round']:,.0f}", f"{row['ratio']:.1f}x",
                      f"{row['header_bytes_per_round']:,.0f}", f"{100 * row['accuracy']:.2f}",
                      f"{100 * row['accuracy_sd']:.2f}", f"{row['gap']:+.2f}", f"{row['gap_se']:.2f}")
    Console(width=max(Console().width, 120)).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="a seconds-long run (none and sparse, 4 short rounds)")
    parser.add_argument("--task", default="digits", help="a built-in task (digits is fast on 2 cores)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec specs")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated torch seeds; the mean is reported")
    args = parser.parse_args()
    options = {"codecs": args.codecs.split(","), "rounds": args.rounds, "inner_steps": args.inner_steps,
               "seeds": [int(seed) for seed in args.seeds.split(",")]}
    if args.quick:
        options.update(QUICK)
    result = run(args.task, workers=args.workers, **options)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
