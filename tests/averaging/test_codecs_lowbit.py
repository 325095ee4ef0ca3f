"""Low-bit and sparse low-bit codecs: q4 and q2 (blockwise), sparse (chunked top-k with low-bit
values) and nonzero (how sparse averages travel back): bounds, packing edges, hostile payloads,
error feedback, the return path, a real 4-peer round, and the DiLoCo benchmark's --quick run."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from conftest import run_async

from swarmgrad.averaging import Averager, Moshpit
from swarmgrad.averaging.allreduce import gather_codec_for
from swarmgrad.averaging.codecs import CodecError, Encoded, ErrorFeedback, get_codec
from swarmgrad.averaging.codecs.bits import pack_fields, unpack_fields
from swarmgrad.averaging.codecs.lowbit import Q2Codec, Q4Codec
from swarmgrad.averaging.codecs.nonzero import NonzeroCodec, low_bits
from swarmgrad.averaging.codecs.sparse import SparseCodec
from swarmgrad.averaging.frames import decode_chunk, encode_chunk
from swarmgrad.averaging.layout import Schema
from swarmgrad.averaging.settings import check_codec
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.errors import ConfigError
from swarmgrad.net.network_runtime import NetworkRuntime

ROOT = Path(__file__).resolve().parents[2]
QUANT_SPECS = ["q4", "q2", "q4:5", "q2:1000"]
SPARSE_SPECS = ["sparse", "sparse:0.01", "sparse:0.004:8", "sparse:0.02:4", "sparse:1.0:2"]
# odd lengths, one element, block and chunk (256) and group (4096) boundaries, 2-D
SHAPES = [(0,), (1,), (3,), (7,), (63,), (64,), (65,), (255,), (256,), (257,), (4095,), (4097,), (33, 65),
          (1000, 300)]


def random_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def wire(encoded: Encoded) -> Encoded:
    return Encoded.from_msgpack(msgpack.unpackb(msgpack.packb(encoded.to_msgpack())))


def with_part(encoded: Encoded, key: str, data: bytes) -> Encoded:
    return dataclasses.replace(encoded, parts={**encoded.parts, key: data})


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def blocks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(flat.split(size)) if flat.numel() else []


# ---- round trips and bounds ---------------------------------------------------------------------


def check_quant_bound(codec: Q4Codec | Q2Codec, x: torch.Tensor, decoded: torch.Tensor) -> None:
    """|x - decoded| <= m / 2^bits per block of absmax m (+ fp32 rounding); all-zero blocks exact."""
    levels = 1 << codec.bits
    for original, got in zip(blocks(x.reshape(-1), codec.block_size), blocks(decoded.reshape(-1), codec.block_size)):
        absmax = float(original.abs().max())
        assert float((original - got).abs().max()) <= absmax / levels + absmax * 2.0**-21
        assert float(got.abs().max()) <= absmax  # centres are inside [-m, m]


def check_sparse_bound(codec: SparseCodec, x: torch.Tensor, decoded: torch.Tensor) -> None:
    """Each chunk of 256 keeps its k largest magnitudes, signs exact, magnitudes within half a cell
    (a whole cell in a group that kept a zero, whose lowest cell decodes to 0)."""
    flat, out = x.reshape(-1), decoded.reshape(-1)
    k = min(256, max(1, round(codec.fraction * 256)))
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    for start in range(0, flat.numel(), 256):
        chunk = flat[start : start + 256].abs()
        top = torch.topk(chunk, min(k, chunk.numel())).indices + start
        kept[top] = True
        inside = kept[start : start + 256]
        if not inside.all():
            assert chunk[inside].min() >= chunk[~inside].max()
    assert torch.equal(out[~kept], torch.zeros(int((~kept).sum())))
    cells = 1 << (codec.bits - 1)
    for start in range(0, flat.numel(), 4096):
        group = kept[start : start + 4096]
        original, got = flat[start : start + 4096][group], out[start : start + 4096][group]
        lo, hi = float(original.abs().min()), float(original.abs().max())
        assert torch.equal(torch.sign(got[got != 0]), torch.sign(original[got != 0]))
        width = (hi - lo) / (cells if lo == 0 else 2 * cells)
        assert float((original - got).abs().max()) <= width + hi * 2.0**-21
        if lo > 0:
            assert bool((got != 0).all())


def check_nonzero_bound(codec: NonzeroCodec, x: torch.Tensor, decoded: torch.Tensor) -> None:
    """Zeros stay exact, nonzeros stay nonzero, within m / 2^bits per group of 64 nonzeros."""
    flat, out = x.reshape(-1), decoded.reshape(-1)
    support = flat != 0
    assert torch.equal(out != 0, support)
    for original, got in zip(blocks(flat[support], 64), blocks(out[support], 64)):
        absmax = float(original.abs().max())
        assert float((original - got).abs().max()) <= absmax / (1 << codec.bits) + absmax * 2.0**-21


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", QUANT_SPECS + SPARSE_SPECS)
def test_round_trip_within_bound(spec: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(spec)
    x = random_tensor(shape)
    before = x.clone()
    encoded = codec.encode(x)
    assert torch.equal(x, before)  # encode never touches its input
    assert encoded == codec.encode(x)  # and is deterministic
    assert encoded.codec == codec.name and encoded.shape == shape and encoded.nbytes() == codec.encoded_nbytes(shape)
    decoded = codec.decode(wire(encoded))
    assert decoded.shape == shape and decoded.dtype == torch.float32
    (check_quant_bound if codec.name in ("q4", "q2") else check_sparse_bound)(codec, x, decoded)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.3, 1.0])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (64,), (65,), (20_000,), (70, 90)], ids=str)
def test_nonzero_round_trip_within_bound(shape: tuple[int, ...], bits: int, density: float) -> None:
    codec = NonzeroCodec(bits)
    generator = torch.Generator().manual_seed(bits)
    x = random_tensor(shape) * (torch.rand(shape, generator=generator) < density)
    encoded = codec.encode(x)
    assert encoded.meta["n"] == int((x != 0).sum())
    assert encoded.nbytes() <= codec.encoded_nbytes(shape)  # what a receiver allows bounds every payload
    check_nonzero_bound(codec, x, codec.decode(wire(encoded)))


def test_nonzero_positions_cost_about_two_plus_log2_bits() -> None:
    x = torch.zeros(1 << 18)
    x[torch.randperm(1 << 18, generator=torch.Generator().manual_seed(0))[: 1 << 14]] = 1.0  # 1 in 16
    encoded = NonzeroCodec().encode(x)
    position_bits = 8 * (len(encoded.parts["high"]) + len(encoded.parts["low"])) / (1 << 14)
    assert low_bits(1 << 14, 1 << 18) == 4 and 5.9 < position_bits <= 6.0  # a byte per gap would be 8


def test_ratios_and_sizes() -> None:
    x = torch.zeros(1 << 20)
    assert Q4Codec().ratio(x) == 4 / (0.5 + 4 / 64) and Q2Codec().ratio(x) == 4 / (0.25 + 4 / 64)
    assert Q4Codec(1 << 20).encoded_nbytes((1 << 20,)) == (1 << 19) + 4
    assert SparseCodec().ratio(x) == 4 / (2 / 256 * 1.25 + 8 / 4096)  # 341x
    assert SparseCodec(0.01).ratio(x) == 4 / (3 / 256 * 1.25 + 8 / 4096)  # 241x
    assert SparseCodec(0.01, 4).encoded_nbytes((300,)) == 6 + 3 + 8  # a chunk of 256 and a tail of 44 keep 3 each
    assert SparseCodec(0.01, 4).encoded_nbytes((258,)) == 5 + 3 + 8  # the tail of 2 keeps 2


def test_spec_strings_round_trip_and_name_their_defaults() -> None:
    assert get_codec("q4") == Q4Codec(64) and get_codec("q2:128") == Q2Codec(128)
    assert get_codec("sparse") == SparseCodec(1 / 128, 2) and get_codec("sparse:0.01") == SparseCodec(0.01, 2)
    assert get_codec("sparse:0.02:4") == SparseCodec(0.02, 4)
    for spec in ["q4", "q2", "q4:128", "sparse", "sparse:0.01", "sparse:0.02:4", "sparse:0.0078125:8"]:
        codec = get_codec(spec)
        assert get_codec(codec.spec) == codec and codec.lossy
    assert SparseCodec(1 / 128, 4).spec == "sparse:0.0078125:4" and SparseCodec().spec == "sparse"
    assert check_codec("sparse:0.01:2") == "sparse:0.01:2"


@pytest.mark.parametrize("spec, message", [
    ("q3", r"^unknown codec 'q3'; choose one of none, fp16, bf16, int8, q4, q2, sign, topk, sparse, powersgd$"),
    ("q4:0", r"^q4 block size must be an int in \[1, 16777216\], got 0$"),
    ("q2:abc", r"^bad parameter 'abc' for codec 'q2' \(spec 'q2:abc'\)$"),
    ("sparse:0", r"^sparse fraction must be a number in \(0, 1\], got 0.0$"),
    ("sparse:1.5", r"^sparse fraction must be a number in \(0, 1\], got 1.5$"),
    ("sparse:nan", r"^bad parameter 'nan' for codec 'sparse' \(spec 'sparse:nan'\)$"),
    ("sparse:0.01:3", r"^sparse value bits must be one of 2, 4, 8, got 3$"),
    ("sparse:0.01:1", r"^sparse value bits must be one of 2, 4, 8, got 1$"),
    ("sparse:0.01:", r"^bad parameter '0.01:' for codec 'sparse' \(spec 'sparse:0.01:'\)$"),
    ("sparse:0.01:2:1", r"^bad parameter '0.01:2:1' for codec 'sparse' \(spec 'sparse:0.01:2:1'\)$"),
    ("sparse::2", r"^bad parameter ':2' for codec 'sparse' \(spec 'sparse::2'\)$"),
])
def test_bad_specs_get_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        get_codec(spec)
    with pytest.raises(ConfigError, match=message):
        check_codec(spec)


def test_codec_parameters_are_range_checked() -> None:
    with pytest.raises(CodecError, match=r"^q2 block size must be an int in \[1, 16777216\], got 1.5$"):
        Q2Codec(1.5)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="^sparse value bits must be one of 2, 4, 8, got True$"):
        SparseCodec(0.01, True)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="^nonzero value bits must be one of 2, 4, 8, got 1$"):
        NonzeroCodec(1)
    assert Q4Codec(1 << 24).block_size == 1 << 24 and SparseCodec(1 / 512).encode(torch.ones(256)).meta["k"] == 1


# ---- packing edges --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["q4", "q2", "q2:3"])
def test_all_zero_blocks_decode_to_exact_zeros(spec: str) -> None:
    codec = get_codec(spec)
    x = random_tensor((700,))
    x[192:384] = 0.0  # whole blocks of 64, and of 3
    decoded = codec.decode(codec.encode(x))
    assert torch.equal(decoded[192:384], torch.zeros(192))
    assert torch.equal(codec.decode(codec.encode(torch.zeros(5))), torch.zeros(5))


@pytest.mark.parametrize("codec", [Q4Codec(), Q2Codec()])
def test_every_code_decodes_to_its_cells_centre(codec) -> None:
    """code_values' affine form gives exactly the centres `levels` lists, for every code."""
    from swarmgrad.averaging.codecs.bits import pack
    from swarmgrad.averaging.codecs.lowbit import levels

    count = 1 << codec.bits
    codes = np.tile(np.arange(count, dtype=np.uint8), 3)
    values = codec.code_values(pack(codes, codec.bits), codes.size)
    assert values.dtype == np.float32 and np.array_equal(values, levels(codec.bits)[codes])
    assert np.array_equal(np.unique(values), (2 * np.arange(count) + 1 - count) / count)


def test_sparse_keeps_zeros_exact_when_a_chunk_has_fewer_than_k_nonzeros() -> None:
    codec = SparseCodec(3 / 256)
    x = torch.zeros(600)
    x[300] = -2.0  # every chunk keeps 3 elements: here 8 of the 9 kept are zeros
    decoded = codec.decode(codec.encode(x))
    assert decoded.nonzero().view(-1).tolist() == [300] and float(decoded[300]) == -1.5  # lo = 0, hi = 2
    assert torch.equal(codec.decode(codec.encode(torch.zeros(5000))), torch.zeros(5000))
    same = torch.full((256,), 0.5)  # ties: still exactly k, and lo = hi decodes exactly
    assert codec.decode(codec.encode(same)).unique().tolist() == [0.0, 0.5]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 7, 8, 9])
def test_bit_packing_round_trips_and_refuses_set_padding(bits: int, count: int) -> None:
    from swarmgrad.averaging.codecs.bits import byte_table, lookup, pack, packed_size, unpack

    codes = (np.arange(count) % (1 << bits)).astype(np.uint8)
    packed = pack(codes, bits)
    assert len(packed) == packed_size(count, bits) and np.array_equal(unpack(packed, count, bits), codes)
    values = np.linspace(-1, 1, 1 << bits, dtype=np.float32) * 3  # a table lookup gives each code's value
    if bits < 8:
        table = byte_table(values, bits)
        assert np.array_equal(lookup(packed, count, bits, table), values[codes])
    fields = np.arange(count, dtype=np.int64) * 37 % (1 << 11)
    assert np.array_equal(unpack_fields(pack_fields(fields, 11), count, 11), fields)
    if count * bits % 8:
        spoiled = packed[:-1] + bytes([packed[-1] | 0x80])
        with pytest.raises(CodecError, match="padding bits"):
            unpack(spoiled, count, bits)
        with pytest.raises(CodecError, match="padding bits"):
            lookup(spoiled, count, bits, table)
    if count * 11 % 8:
        raw = pack_fields(fields, 11)
        with pytest.raises(CodecError, match="padding bits"):
            unpack_fields(raw[:-1] + bytes([raw[-1] | 0x80]), count, 11)


@pytest.mark.parametrize("spec", ["q4", "q2", "sparse", "sparse:1.0:8", "nonzero"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_nan_and_inf(spec: str, bad: float) -> None:
    codec = NonzeroCodec() if spec == "nonzero" else get_codec(spec)
    for size, where in [(5, 4), (300, 299), (70_000, 12_345)]:  # the sparse tail chunk, a full chunk
        x = random_tensor((size,))
        x[where] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            codec.encode(x)


# ---- hostile payloads -----------------------------------------------------------------------------


def sample(codec, shape: tuple[int, ...] = (600,)) -> Encoded:
    x = random_tensor(shape)
    if isinstance(codec, NonzeroCodec):
        x = x * (torch.arange(x.numel()).view(shape) % 7 == 0)
    return codec.encode(x)


CODECS = [Q4Codec(), Q2Codec(5), SparseCodec(), SparseCodec(0.02, 4), NonzeroCodec(), NonzeroCodec(8)]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_wrong_part_sizes_are_refused(codec) -> None:
    encoded = sample(codec)
    assert torch.isfinite(codec.decode(encoded)).all()
    for key, part in encoded.parts.items():
        for bad in (part[:-1], part + b"\0", b""):
            if bad != part:
                with pytest.raises(CodecError, match="bytes, expected"):
                    codec.decode(with_part(encoded, key, bad))
    with pytest.raises(CodecError, match="parts must be"):
        codec.decode(with_part(encoded, "extra", b""))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("shape, max_elements", [((-1, 4), 1 << 31), ((10**6, 10**6), 1 << 31), ((0, 10**30), 1 << 31),
                                                 ((100,), 99), ((10**6, 10**6), 10**13)])
def test_huge_declared_shapes_are_refused_before_allocating(codec, shape, max_elements, monkeypatch) -> None:
    encoded = dataclasses.replace(sample(codec), shape=shape)

    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("allocated before validating")

    for name in ("empty", "zeros", "frombuffer", "full"):
        monkeypatch.setattr(torch, name, no_allocation)
    for name in ("unpackbits", "zeros", "empty", "frombuffer"):
        monkeypatch.setattr(np, name, no_allocation)
    with pytest.raises(CodecError):
        codec.decode(encoded, max_elements=max_elements)


@pytest.mark.parametrize("codec, meta", [
    (Q4Codec(), {"block": 0}), (Q4Codec(), {"block": True}), (Q2Codec(), {}), (Q2Codec(), {"block": 64, "k": 1}),
    (SparseCodec(), {"k": 0, "bits": 2}), (SparseCodec(), {"k": 257, "bits": 2}), (SparseCodec(), {"k": 2, "bits": 3}),
    (SparseCodec(), {"k": 2, "bits": 16}), (SparseCodec(), {"k": 2, "bits": 1}), (SparseCodec(), {"k": 2.0, "bits": 2}), (SparseCodec(), {"k": 2}),
    (NonzeroCodec(), {"n": 601, "bits": 2}), (NonzeroCodec(), {"n": -1, "bits": 2}),
    (NonzeroCodec(), {"n": 86, "bits": 1}), (NonzeroCodec(), {"n": 86, "bits": 2, "len": 86}),
])
def test_bad_meta_is_refused(codec, meta) -> None:
    with pytest.raises(CodecError, match="meta"):
        codec.decode(dataclasses.replace(sample(codec), meta=meta))


def sparse_sample(numel: int = 300, fraction: float = 3 / 256) -> tuple[SparseCodec, Encoded]:
    codec = SparseCodec(fraction)
    return codec, codec.encode(random_tensor((numel,)))


@pytest.mark.parametrize("idx, message", [
    (bytes([5, 5, 9, 1, 2, 3]), "increase strictly"),  # a duplicate index in the first chunk
    (bytes([9, 5, 1, 1, 2, 3]), "increase strictly"),  # decreasing
    (bytes([1, 2, 3, 1, 1, 2]), "increase strictly"),  # a duplicate in the tail chunk
    (bytes([1, 2, 3, 1, 2, 44]), "past the last chunk's 44 elements"),  # out of range: the tail has 44
    (bytes([1, 2, 3, 1, 2, 255]), "past the last chunk's 44 elements"),
])
def test_sparse_refuses_duplicate_unordered_and_out_of_range_indices(idx: bytes, message: str) -> None:
    codec, encoded = sparse_sample()
    with pytest.raises(CodecError, match=message):
        codec.decode(with_part(encoded, "idx", idx))
    assert codec.decode(with_part(encoded, "idx", bytes([1, 2, 3, 1, 2, 43]))).numel() == 300  # the ends are fine


@pytest.mark.parametrize("lo, hi, message", [
    (f32(-1.0), f32(2.0), "0 <= lo <= hi"), (f32(3.0), f32(2.0), "0 <= lo <= hi"),
    (f32(math.nan), f32(2.0), "0 <= lo <= hi"), (f32(1.0), f32(math.inf), "NaN or Inf"),
    (f32(1.0), f32(math.nan), "NaN or Inf"),
])
def test_sparse_refuses_bad_ranges(lo: bytes, hi: bytes, message: str) -> None:
    codec, encoded = sparse_sample()
    with pytest.raises(CodecError, match=message):
        codec.decode(with_part(with_part(encoded, "lo", lo), "hi", hi))
    decoded = codec.decode(with_part(with_part(encoded, "lo", f32(0.0)), "hi", f32(3e38)))
    assert torch.isfinite(decoded).all()  # the widest range stays finite


def test_sparse_refuses_set_padding_bits_in_values() -> None:
    codec, encoded = sparse_sample()  # 6 values of 2 bits: 4 padding bits
    val = encoded.parts["val"]
    with pytest.raises(CodecError, match="padding bits"):
        codec.decode(with_part(encoded, "val", val[:-1] + bytes([val[-1] | 0x40])))


@pytest.mark.parametrize("codec", [Q4Codec(), Q2Codec(5)], ids=repr)
@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf, -math.inf])
def test_quant_refuses_bad_block_maxima(codec, value: float) -> None:
    encoded = codec.encode(random_tensor((7,)))
    absmax = encoded.parts["absmax"]
    with pytest.raises(CodecError, match=r"^q[24] block scales must be finite and in \[0, 3.4e\+38\]$"):
        codec.decode(with_part(encoded, "absmax", f32(value) + absmax[4:]))
    largest = codec.decode(with_part(encoded, "absmax", f32(3.4e38) + absmax[4:]))
    assert torch.isfinite(largest).all()


def nonzero_payload(numel: int, positions: list[int], *, high: bytes | None = None) -> tuple[NonzeroCodec, Encoded]:
    """A hand-made nonzero payload: positions coded as given (even if invalid)."""
    codec, count = NonzeroCodec(8), len(positions)
    low = low_bits(count, numel)
    where = np.array(positions, dtype=np.int64)
    bits = np.zeros(count + ((numel - 1) >> low), dtype=np.uint8)
    for i, p in enumerate(where):
        bits[(p >> low) + i] = 1
    parts = {"high": high if high is not None else np.packbits(bits, bitorder="little").tobytes(),
             "low": pack_fields(where & ((1 << low) - 1), low), "val": bytes([200] * count),
             "absmax": f32(1.0) * -(-count // 64)}
    return codec, Encoded("nonzero", (numel,), "float32", parts, {"n": count, "bits": 8})


def test_nonzero_hand_made_payload_decodes_and_refuses_duplicates_and_overruns() -> None:
    codec, encoded = nonzero_payload(8, [1, 6])
    assert codec.decode(encoded).nonzero().view(-1).tolist() == [1, 6]
    with pytest.raises(CodecError, match="^nonzero positions must increase strictly and stay below 8$"):
        codec.decode(nonzero_payload(8, [1, 1])[1])  # same high part, same low bits: a duplicate
    with pytest.raises(CodecError, match="^nonzero positions must increase strictly and stay below 8$"):
        codec.decode(nonzero_payload(8, [3, 1])[1])  # the same high part, low bits decreasing
    with pytest.raises(CodecError, match="^nonzero positions must increase strictly and stay below 5$"):
        codec.decode(nonzero_payload(5, [6])[1])  # L = 2: high part 1 (the most (5 - 1) >> 2 allows), low 2
    with pytest.raises(CodecError, match="^nonzero positions hold 1 high parts, meta says 2$"):
        codec.decode(nonzero_payload(8, [1, 6], high=bytes([0b001]))[1])
    with pytest.raises(CodecError, match="^the padding bits after 3 nonzero position bits must be zero$"):
        codec.decode(nonzero_payload(8, [1, 6], high=bytes([0b1000_0101]))[1])


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_nonzero_refuses_bad_value_maxima(value: float) -> None:
    codec, encoded = nonzero_payload(100, [3, 50])
    with pytest.raises(CodecError, match="^nonzero value maxima must be finite and not negative$"):
        codec.decode(with_part(encoded, "absmax", f32(value)))


# ---- error feedback -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["q4", "q2", "sparse", "sparse:0.02:4"])
def test_error_feedback_makes_the_decoded_sum_track_the_input_sum(spec: str) -> None:
    codec = get_codec(spec)
    feedback = ErrorFeedback(codec)
    generator = torch.Generator().manual_seed(1)
    shape = (64, 80)
    true_sum, sent_sum, plain_sum = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    residuals, plain_errors = [], []
    for t in range(1, 401):  # sparse keeps 2 of 256: its residual levels off after ~200 rounds
        update = torch.randn(shape, generator=generator) + 0.3  # a drift that dropped mass would lose
        sent_sum += codec.decode(wire(feedback.encode("w", update))).double()
        feedback.commit()
        true_sum += update.double()
        plain_sum += codec.decode(codec.encode(update)).double()
        residuals.append(feedback.residual_norm("w"))
        plain_errors.append(float((true_sum - plain_sum).norm()))
        # what was sent plus what is kept is what came in, less the roundings of the kept residuals
        # (bfloat16 for the block quantizers: each at most 2^-8 of itself, unbiased, so they add up
        # like a random walk, not like t of them; float32 for sparse: ~nothing)
        drift = float((true_sum - sent_sum - feedback._residual["w"].double()).norm())
        assert drift <= 2.0**-8 * t**0.5 * max(residuals) + 1e-3, (t, drift)
    assert max(residuals[300:]) <= 1.1 * max(residuals[200:300])  # bounded: it stops growing
    assert residuals[-1] <= 0.2 * float(true_sum.norm())
    assert plain_errors[-1] >= 4 * residuals[-1] and plain_errors[-1] >= 1.3 * plain_errors[199]  # grows without


@pytest.mark.parametrize("spec", ["int8", "q2", "sparse", "powersgd"])
def test_error_feedback_read_again_at_commit_keeps_the_same_residuals_and_stages_only_the_encoding(spec) -> None:
    """``encode(..., source)``: the residual is formed at commit from the values read again, in the
    committed one's place. Round by round (a failed one between) it is the residual staged the
    usual way to the bit, and until the commit only the encoding is held beside the committed one."""
    codec = get_codec(spec)
    staged, deferred = ErrorFeedback(codec), ErrorFeedback(codec)
    generator = torch.Generator().manual_seed(3)
    shape = (48, 64)
    for t in range(6):
        update = torch.randn(shape, generator=generator)
        held = deferred.held_bytes()
        one = staged.encode("w", update)
        read_again = update.clone()
        other = deferred.encode("w", update.clone(), source=lambda: read_again)
        assert one.parts == other.parts  # the same encoding either way
        if codec.residual_dtype == torch.bfloat16 and t > 0:
            # the encoding beside the committed residual, not a second residual of 2 bytes an element
            assert deferred.held_bytes() - held == other.nbytes() < update.numel() * 2
        if t == 3:  # a failed round: nothing staged is kept, either way
            staged.discard()
            deferred.discard()
            continue
        committed = deferred._residual.get("w")
        staged.commit()
        deferred.commit()
        assert torch.equal(staged._residual["w"], deferred._residual["w"])
        if committed is not None and committed.dtype == deferred._residual["w"].dtype:
            assert deferred._residual["w"] is committed  # written in its place


# ---- the return path ------------------------------------------------------------------------------


def test_each_codec_names_its_return_codec() -> None:
    assert gather_codec_for(SparseCodec()) == NonzeroCodec(2)
    assert gather_codec_for(SparseCodec(0.01, 4)) == NonzeroCodec(4)
    assert gather_codec_for(SparseCodec(0.01, 8)) == NonzeroCodec(8)
    assert gather_codec_for(Q4Codec(32)) == Q4Codec(32) and gather_codec_for(get_codec("int8")).name == "int8"
    assert gather_codec_for(get_codec("topk")).name == "fp16" and gather_codec_for(get_codec("powersgd")).name == "fp16"


def sparse_average(members: int, shape: tuple[int, ...], codec: SparseCodec) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decoded sparse contributions of `members` random tensors and their weighted average, summed
    as an owner does (its own first, then the others')."""
    decoded = [codec.decode(codec.encode(random_tensor(shape, seed))) for seed in range(members)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][:members]
    total = decoded[0] * weights[0]
    for contribution, weight in zip(decoded[1:], weights[1:]):
        total.add_(contribution, alpha=weight)
    return decoded, total.div_(sum(weights))


def test_the_sparse_average_travels_on_the_union_of_the_supports() -> None:
    codec = SparseCodec()
    decoded, average = sparse_average(4, (40, 1000), codec)
    union = torch.stack([d != 0 for d in decoded]).any(dim=0)
    assert torch.equal(average != 0, union)  # the owner reduced every contribution, none dropped
    assert int(union.sum()) <= 4 * 2 * 40_000 // 256
    returned = gather_codec_for(codec)
    back = returned.decode(wire(returned.encode(average)))
    assert torch.equal(back != 0, union)
    check_nonzero_bound(returned, average, back)
    assert returned.encode(average).nbytes() < 4 * 40_000 * 4 / 150  # union and all: < 1/150 of fp32


DECODE_IN_A_FRESH_PROCESS = """
import hashlib, sys, msgpack, torch
from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.frames import decode_chunk
torch.set_num_threads(2)
header, payload, shape = msgpack.unpackb(open(sys.argv[1], "rb").read())
codec = get_codec("sparse").average_codec()
print(hashlib.sha256(decode_chunk(codec, header, payload, tuple(shape)).numpy().tobytes()).hexdigest())
"""


def test_every_member_decodes_the_bit_identical_average(tmp_path: Path) -> None:
    codec = SparseCodec()
    returned = gather_codec_for(codec)
    _, average = sparse_average(8, (64, 512), codec)
    header, payload = encode_chunk(returned, average)
    owner_keeps = decode_chunk(returned, header, payload, average.shape)  # what the owner writes to itself
    digest = hashlib.sha256(owner_keeps.numpy().tobytes()).hexdigest()
    frame = msgpack.packb([header, bytes(payload), list(average.shape)])
    for _ in range(3):  # every member decodes its own copy of the frame
        header_copy, payload_copy, _ = msgpack.unpackb(frame)
        member = decode_chunk(returned, header_copy, bytearray(payload_copy), average.shape)
        assert hashlib.sha256(member.numpy().tobytes()).hexdigest() == digest
    (tmp_path / "frame").write_bytes(frame)
    elsewhere = subprocess.run([sys.executable, "-c", DECODE_IN_A_FRESH_PROCESS, str(tmp_path / "frame")],
                               capture_output=True, text=True, timeout=120, check=True)
    assert elsewhere.stdout.strip() == digest


# ---- a real 4-peer round --------------------------------------------------------------------------


def test_four_real_peers_average_sparse_contributions_identically_with_50x_fewer_bytes() -> None:
    """One moshpit round of 4 peers on loopback with `sparse`, one with `none` for the byte count.
    Every member ends with the very same tensor: the weighted mean of the 4 decoded contributions,
    on the union of their supports, within the return codec's bound."""
    weights = [1.0, 2.0, 3.0, 4.0]
    shapes = [(1_000_000,), (512, 1024)]

    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            nodes = [first, *await asyncio.gather(*(stack.enter_async_context(
                SwarmNode(NodeConfig(initial_peers=first.maddrs))) for _ in range(3)))]
            runtimes = await asyncio.gather(*(stack.enter_async_context(
                NetworkRuntime("lowbit-test", node=node)) for node in nodes))
            tensors = {codec: [[random_tensor(shape, 10 * member + i) for i, shape in enumerate(shapes)]
                               for member in range(4)] for codec in ("none", "sparse")}
            inputs = [[t.clone() for t in ts] for ts in tensors["sparse"]]
            reports = {}
            for codec in ("none", "sparse"):
                averagers = [await stack.enter_async_context(Averager(
                    runtime, ts, name=codec, settings=Moshpit(group_size=4, matchmaking_seconds=0.5),
                    grid_dims=1, codec=codec)) for runtime, ts in zip(runtimes, tensors[codec])]
                reports[codec] = await asyncio.gather(*(a.step(weight=w) for a, w in zip(averagers, weights)))
                assert all(r.ok and len(r.group) == 4 for r in reports[codec]), [r.error for r in reports[codec]]
            return inputs, tensors["sparse"], reports

    inputs, results, reports = run_async(scenario())
    for result in results[1:]:
        assert all(torch.equal(got, want) for got, want in zip(result, results[0]))
    # what each member sent, decoded as the owners did (first round: no residual yet)
    schema, codec = Schema.of([(str(i), t) for i, t in enumerate(inputs[0])]), SparseCodec()
    flats = [torch.cat([t.reshape(-1) for t in ts]) for ts in inputs]
    expected = torch.zeros(schema.total)
    for chunk in schema.chunks:
        for flat, weight in zip(flats, weights):
            values = flat[chunk.start : chunk.start + chunk.length].view(chunk.view)
            expected[chunk.start : chunk.start + chunk.length] += weight * codec.decode(codec.encode(values)).reshape(-1)
    expected /= sum(weights)
    got = torch.cat([t.reshape(-1) for t in results[0]])
    assert torch.equal(got != 0, expected != 0)
    assert float((got - expected).abs().max()) <= 0.26 * float(expected.abs().max())
    # per member on average (parts are whole chunks, so one member may own more than another)
    sparse_sent = sum(r.bytes_sent for r in reports["sparse"]) / 4
    dense_sent = sum(r.bytes_sent for r in reports["none"]) / 4
    assert dense_sent >= 50 * sparse_sent, (dense_sent, sparse_sent)


# ---- the DiLoCo benchmark --------------------------------------------------------------------------


def test_codec_diloco_quick_reports_real_compression() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec_diloco.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    result = json.loads(run.stdout)
    assert {"task", "workers", "group", "rounds", "inner_steps", "seeds", "fp32_bytes_per_round", "rows"} <= set(result)
    assert result["workers"] == result["group"] == 8 and result["task"] == "digits"
    rows = {row["codec"]: row for row in result["rows"]}
    assert list(rows) == ["none", "sparse"]
    # fp32: every worker sends 7/8 of its 17,226 parameters and 7 copies of its 1/8 part of the average
    assert rows["none"]["bytes_per_round"] == result["fp32_bytes_per_round"] == 2 * 7 / 8 * 4 * 17_226
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["gap"] == 0.0
    assert rows["sparse"]["average_codec"] == "nonzero" and rows["sparse"]["ratio"] >= 80
    for row in rows.values():
        assert set(row) >= {"bytes_per_round", "ratio", "accuracy", "gap", "gap_se", "header_bytes_per_round"}
        assert 0.0 <= row["accuracy"] <= 1.0 and len(row["accuracies"]) == len(result["seeds"])


def test_codecs_benchmark_reports_each_codecs_ratio_and_error_beside_hivemind() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codecs.py"), "--size-mb", "0.25", "--repeats", "1",
                          "--json"], capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    result = json.loads(run.stdout)
    ours = {row["codec"]: row for row in result["rows"] if row["source"] == "swarmgrad"}
    assert {"none", "int8", "q4", "q2", "sign", "sparse"} <= set(ours)
    assert any(row["source"] == "hivemind" for row in result["rows"])
    assert ours["none"]["ratio"] == 1.0 and ours["none"]["rel_error"] == 0.0
    # the payload ratios the codecs' docstrings give, and error growing as the bits shrink
    for codec, ratio in {"int8": 3.98, "q4": 7.11, "q2": 12.8, "sign": 21.33}.items():
        assert ours[codec]["ratio"] == pytest.approx(ratio, abs=0.01)
    errors = [ours[codec]["rel_error"] for codec in ("int8", "q4", "q2", "sign")]
    assert 0 < errors[0] < errors[1] < errors[2] < errors[3] < 1
    assert ours["sparse"]["round_ratio"] >= 100  # the best codec: 100x fewer bytes a round than fp32
