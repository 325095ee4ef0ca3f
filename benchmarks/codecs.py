"""Codec speed and quality, side by side with hivemind's own compression.

    python benchmarks/codecs.py [--json] [--size-mb 64] [--repeats 5]

One random normal float32 tensor of --size-mb, viewed as a (rows, 1024) matrix so PowerSGD has
a matrix to work on. For every codec: compression ratio, relative error ||x - dec|| / ||x||, and
encode / decode / encode+decode throughput in GB/s of fp32 input (median of --repeats runs, after
a warm-up run that also first-touches every buffer). torch runs on one thread so numbers compare
per core. hivemind's codecs are timed through compress(tensor, info) + extract(serialized); ours
through encode + decode (neither includes msgpack/protobuf serialisation of the result).

"bytes/round": one all-reduce round of a 4-member group on the run's chunk grid, as the wire does
it (codec_diloco.WireGroup: contributions through error feedback to each chunk's owner, averages
back with the return codec): the codec payload bytes each member sends, both directions, and
fp32's (`none`) over it. The members hold the test tensor and three independent random tensors
like it: for top-k codecs that is the worst case, the union of the supports is 4 times one.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from codec_diloco import WireGroup  # benchmarks/ is the script's directory

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.layout import Schema

OUR_SPECS = ["none", "fp16", "bf16", "int8", "q4", "q2", "sign", "topk:0.01", "sparse:0.01", "sparse", "powersgd:4"]
GROUP = 4  # members of the simulated all-reduce round
# our codec -> the hivemind codec it is compared with in the "speed vs hivemind" column
BASELINES = {"none": "NoCompression", "fp16": "Float16Compression", "int8": "Uniform8BitQuantization"}
HIVEMIND_CODECS = [
    "NoCompression",
    "Float16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
]


@dataclass
class Row:
    codec: str
    source: str  # "swarmgrad" or "hivemind"
    ratio: float | None = None
    rel_error: float | None = None
    encode_gbps: float | None = None
    decode_gbps: float | None = None
    gbps: float | None = None  # encode + decode
    vs_hivemind: float | None = None  # our encode+decode speed / the baseline's
    round_bytes: float | None = None  # payload a member of a GROUP-member round sends, both directions
    round_ratio: float | None = None  # fp32's round_bytes / this codec's
    note: str = ""


def measure(
    tensor: torch.Tensor, encode: Callable[[], object], decode: Callable[[object], torch.Tensor], repeats: int
) -> tuple[float, float, float, object, torch.Tensor]:
    """Median encode, decode and encode+decode seconds; plus the last payload and decoded tensor."""
    payload = encode()  # warm-up: first touch of buffers, lazy imports, allocator growth
    decoded = decode(payload)
    enc_times, dec_times, total_times = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        payload = encode()
        middle = time.perf_counter()
        decoded = decode(payload)
        end = time.perf_counter()
        enc_times.append(middle - start)
        dec_times.append(end - middle)
        total_times.append(end - start)
    return (
        statistics.median(enc_times),
        statistics.median(dec_times),
        statistics.median(total_times),
        payload,
        decoded,
    )


def fill(
    row: Row, tensor: torch.Tensor, times: tuple[float, float, float], payload_bytes: int, decoded: torch.Tensor
) -> Row:
    size = tensor.numel() * 4
    row.ratio = size / payload_bytes
    row.rel_error = float((tensor - decoded.reshape(tensor.shape).float()).norm() / tensor.norm())
    row.encode_gbps, row.decode_gbps, row.gbps = (size / 1e9 / seconds for seconds in times)
    return row


def bench_ours(spec: str, tensor: torch.Tensor, repeats: int) -> Row:
    codec = get_codec(spec)
    enc, dec, total, payload, decoded = measure(tensor, lambda: codec.encode(tensor), codec.decode, repeats)
    return fill(Row(spec, "swarmgrad"), tensor, (enc, dec, total), payload.nbytes(), decoded)


def round_bytes(spec: str, members: list[torch.Tensor]) -> float:
    """Payload bytes per member of one all-reduce round among `members` (codec_diloco.WireGroup)."""
    group = WireGroup(spec, Schema.of([("x", members[0])]), len(members))
    _, sent, _ = group.round([member.reshape(-1) for member in members], [1.0] * len(members))
    return sent / len(members)


def extract_quantized(serialized: object, codebook_dtype: type, indices_dtype: type) -> torch.Tensor:
    """hivemind 1.1.12's Quantization.extract, line for line, but for `int(array[0])`.

    The original calls int() on a 1-element array, which numpy 2.4 (installed here) rejects with
    TypeError, so its 8-bit codecs cannot decode at all. The fix costs nothing measurable.
    """
    buffer, size = serialized.buffer, tuple(serialized.size)
    codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(size)
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))
    return codebook[quantized].requires_grad_(serialized.requires_grad)


def bench_hivemind(name: str, tensor: torch.Tensor, repeats: int) -> Row:
    import hivemind.compression as compression

    codec = getattr(compression, name)()
    info = compression.CompressionInfo.from_tensor(tensor)
    extract: Callable[[object], torch.Tensor] = codec.extract
    note = ""
    try:
        extract(codec.compress(tensor[:2], compression.CompressionInfo.from_tensor(tensor[:2])))
    except ImportError as error:  # BlockwiseQuantization needs bitsandbytes
        return Row(name, "hivemind", note=f"unavailable: {str(error).splitlines()[0]}")
    except TypeError:
        extract = functools.partial(
            extract_quantized, codebook_dtype=codec.codebook_dtype, indices_dtype=codec.indices_dtype
        )
        note = "extract() patched for numpy 2 (int() of a 1-elem array)"
    enc, dec, total, payload, decoded = measure(
        tensor, lambda: codec.compress(tensor, info, allow_inplace=False), extract, repeats
    )
    return fill(Row(name, "hivemind", note=note), tensor, (enc, dec, total), len(payload.buffer), decoded)


def steady_allocator() -> str:
    """Keep freed buffers in the heap instead of returning them to the kernel (glibc only).

    By default glibc mmaps every buffer above its threshold (32 MiB at most) and unmaps it on
    free, so each run pays a page fault per 4 KiB of every output buffer; which codec pays how
    much depends on allocation order, not on the codec. A long-running peer reuses its heap, so
    we measure that steady state, the same for both sides.
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return "default"
    try:
        libc = ctypes.CDLL(path)
        m_trim_threshold, m_mmap_max = -1, -4  # from malloc.h
        if libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 1 << 30):
            return "glibc heap, no mmap, no trim"
    except (OSError, AttributeError):  # not glibc
        pass
    return "default"


def run(size_mb: float, repeats: int) -> dict[str, object]:
    # hivemind's Uniform8BitQuantization uses torch.quantize_per_tensor, deprecated in torch 2.13
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
    allocator = steady_allocator()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cols = 1024
    rows = max(1, int(size_mb * 2**20) // 4 // cols)
    tensor = torch.randn(rows, cols)
    ours = [bench_ours(spec, tensor, repeats) for spec in OUR_SPECS]
    members = [tensor, *(torch.randn(rows, cols) for _ in range(GROUP - 1))]
    for row in ours:
        row.round_bytes = round_bytes(row.codec, members)
    fp32 = next(row.round_bytes for row in ours if row.codec == "none")
    for row in ours:
        row.round_ratio = fp32 / row.round_bytes
    del members
    theirs = [bench_hivemind(name, tensor, repeats) for name in HIVEMIND_CODECS]
    by_name = {row.codec: row for row in theirs}
    for row in ours:
        baseline = by_name.get(BASELINES.get(row.codec, ""))
        if baseline is not None and baseline.gbps and row.gbps:
            row.vs_hivemind = row.gbps / baseline.gbps
    for row in theirs:
        if row.codec == "Quantile8BitQuantization":
            row.note = "; ".join(filter(None, [row.note, "np.quantile on a thread pool: not pinned to 1 thread"]))
    return {
        "rows": [asdict(row) for row in ours + theirs],
        "size_mb": tensor.numel() * 4 / 2**20,
        "shape": list(tensor.shape),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "allocator": allocator,
        "round_group": GROUP,
    }


def print_table(result: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table = Table(
        title=f"codecs on {result['size_mb']:.0f} MiB fp32 {tuple(result['shape'])}, "
        f"{result['threads']} torch thread, median of {result['repeats']} runs, allocator: {result['allocator']}"
    )
    table.add_column("codec", no_wrap=True)
    for column in ("ratio", "rel error", "enc GB/s", "dec GB/s", "enc+dec GB/s", "speed vs hivemind",
                   f"bytes/round ({GROUP})", "vs fp32"):
        table.add_column(column, justify="right")
    notes: list[str] = []
    for index, row in enumerate(result["rows"]):
        if index and row["source"] != result["rows"][index - 1]["source"]:
            table.add_section()
        name = row["codec"] if row["source"] == "swarmgrad" else f"hivemind {row['codec']}"
        if row["note"]:  # footnotes keep the table narrow enough for an 80-column pipe
            notes.append(row["note"])
            name += f" [{len(notes)}]"
        table.add_row(
            name,
            num(row["ratio"], ".2f"),
            num(row["rel_error"], ".2e"),
            num(row["encode_gbps"], ".2f"),
            num(row["decode_gbps"], ".2f"),
            num(row["gbps"], ".2f"),
            "-" if row["vs_hivemind"] is None else f"{row['vs_hivemind']:.1f}x",
            "-" if row["round_bytes"] is None else f"{row['round_bytes'] / 2**20:.2f} MiB",
            "-" if row["round_ratio"] is None else f"{row['round_ratio']:.1f}x",
        )
    console = Console(width=max(Console().width, 140))
    console.print(table)
    for number, note in enumerate(notes, 1):
        console.print(f"[{number}] {note}", markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--size-mb", type=float, default=64.0, help="size of the fp32 test tensor in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per codec (the median is reported)")
    args = parser.parse_args()
    result = run(args.size_mb, max(5, args.repeats))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
