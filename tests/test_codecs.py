"""Tensor codecs: error bounds, error feedback, hostile input, wire format, spec parsing."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest
import torch

from swarmgrad.averaging.codecs import (
    CODEC_NAMES,
    Codec,
    CodecError,
    Encoded,
    ErrorFeedback,
    Int8Codec,
    PowerSGDCodec,
    TopKCodec,
    get_codec,
)

SPECS = ["none", "fp16", "bf16", "int8", "int8:100", "topk", "topk:0.1", "powersgd", "powersgd:2"]
SHAPES = [(0,), (1,), (7,), (33, 65), (2, 3, 4, 5), (1000, 1000), (1_000_000,)]


def random_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * 3


def wire(encoded: Encoded) -> Encoded:
    return Encoded.from_msgpack(msgpack.unpackb(msgpack.packb(encoded.to_msgpack())))


def check_bound(codec: Codec, x: torch.Tensor, decoded: torch.Tensor) -> None:
    """Each codec's documented error bound (see the codec modules)."""
    err = (decoded - x).abs()
    if codec.name == "none":
        assert torch.equal(decoded, x)
    elif codec.name == "fp16":
        assert bool((err <= 2.0**-11 * x.abs() + 2.0**-25).all())
    elif codec.name == "bf16":
        assert bool((err <= 2.0**-8 * x.abs()).all())
    elif codec.name == "int8":
        block = codec.block_size
        padded = torch.cat([x.reshape(-1), x.new_zeros(-x.numel() % block)]).view(-1, block)
        absmax = padded.abs().amax(dim=1).clamp_min(2.0**-100).repeat_interleave(block)[: x.numel()]
        assert bool((err.reshape(-1) <= absmax / 254 + absmax * 2.0**-21).all())  # + fp32 rounding
    elif codec.name == "topk":
        flat, out = x.reshape(-1), decoded.reshape(-1)
        kept = out != 0
        k = min(flat.numel(), max(1, math.ceil(codec.fraction * flat.numel()))) if flat.numel() else 0
        assert int(kept.sum()) == k
        assert torch.equal(out[kept], flat[kept])  # exact where kept
        if 0 < k < flat.numel():  # and what was kept is the k largest magnitudes
            assert flat[kept].abs().min() >= flat[~kept].abs().max()
    elif codec.name == "powersgd":
        dims = codec.matrix_dims(tuple(x.shape))
        if dims is None:
            assert torch.equal(decoded, x)  # raw fallback is lossless
            return
        matrix, approx = x.view(dims), decoded.view(dims)
        # rank <= r, seen through a random sketch (a full SVD of 1000x1000 takes seconds)
        sketch = torch.linalg.svdvals(approx @ torch.randn(dims[1], codec.rank + 2))
        assert sketch[codec.rank] <= 1e-4 * sketch[0]
        # P Q^T = P P^T M is an orthogonal projection: the error is orthogonal to what was sent.
        assert abs(float((matrix - approx).flatten() @ approx.flatten())) <= 1e-4 * float(matrix.norm()) ** 2
        assert approx.norm() <= matrix.norm() * (1 + 1e-5)
    else:
        raise AssertionError(codec.name)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_within_bound(spec: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(spec)
    x = random_tensor(shape)
    before = x.clone()
    encoded = codec.encode(x)
    assert torch.equal(x, before)  # encode never touches its input
    assert encoded == codec.encode(x)  # and is deterministic (powersgd: seeded init)
    assert encoded.codec == codec.name and encoded.shape == shape and encoded.dtype == "float32"
    assert encoded.nbytes() == codec.encoded_nbytes(shape)
    decoded = codec.decode(wire(encoded))
    assert decoded.shape == shape and decoded.dtype == torch.float32
    check_bound(codec, x, decoded)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_are_recorded_and_decode_to_float32(dtype: torch.dtype) -> None:
    x = random_tensor((10, 20)).to(dtype)
    encoded = get_codec("int8").encode(x)
    assert encoded.dtype == str(dtype).removeprefix("torch.")
    decoded = get_codec("int8").decode(encoded)
    assert decoded.dtype == torch.float32
    assert torch.allclose(decoded, x.float(), atol=float(x.float().abs().max()) / 254 * 1.01)


def test_out_of_range_values_are_clamped_not_inf() -> None:
    x = torch.tensor([1e6, -1e6, 3.4e38, 1.0])
    assert get_codec("fp16").decode(get_codec("fp16").encode(x)).tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    bf16 = get_codec("bf16").decode(get_codec("bf16").encode(x))
    assert bool(torch.isfinite(bf16).all()) and bf16[2] == torch.finfo(torch.bfloat16).max


def test_ratios() -> None:
    x = torch.zeros(1000, 1000)
    assert get_codec("none").ratio(x) == 1.0
    assert get_codec("fp16").ratio(x) == 2.0
    assert get_codec("int8").ratio(x) == 4e6 / (1e6 + 4 * 977)  # 977 blocks of 1024, the last one short
    assert get_codec("topk:0.01").ratio(x) == 50.0
    assert get_codec("powersgd:4").ratio(x) == 1000 * 1000 / (4 * 2000)
    assert get_codec("powersgd").ratio(torch.zeros(1000)) == 1.0  # 1-D: raw fallback
    assert get_codec("topk").ratio(torch.zeros(0)) == 1.0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_rejects_non_finite(spec: str, bad: float) -> None:
    for shape, where in [((40, 50), 7), ((300_000,), 123_457)]:  # the large one takes topk's sampled path
        x = random_tensor(shape)
        x.view(-1)[where] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(spec).encode(x)


def test_encode_rejects_non_float() -> None:
    with pytest.raises(CodecError, match="float"):
        get_codec("none").encode(torch.arange(5))


# ---- error feedback ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, shape", [("topk:0.1", (1000,)), ("powersgd:4", (32, 48))])
def test_error_feedback_tracks_the_running_sum(spec: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(spec)
    feedback = ErrorFeedback(codec)
    torch.manual_seed(1)
    true_sum, sent_sum, plain_sum = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    residuals, plain_errors = [], []
    for _ in range(100):
        update = torch.randn(shape)
        sent_sum += codec.decode(wire(feedback.encode("w", update)))
        feedback.commit()
        true_sum += update
        plain_sum += codec.decode(codec.encode(update))  # no feedback, for contrast
        residuals.append(feedback.residual_norm("w"))
        plain_errors.append(float((true_sum - plain_sum).norm()))
        assert float((true_sum - sent_sum).norm()) == pytest.approx(residuals[-1], rel=1e-4, abs=1e-4)
    # bounded: after warm-up the residual stops growing, while the sum itself grows like sqrt(t)
    assert max(residuals[49:]) <= 1.5 * max(residuals[19:30])
    assert residuals[-1] <= 0.35 * float(true_sum.norm())
    assert plain_errors[-1] >= 2.5 * plain_errors[9]  # without feedback the error keeps growing


@pytest.mark.parametrize("spec", ["topk:0.1", "powersgd:2", "int8"])
def test_error_feedback_discard_keeps_state_and_commit_applies_it(spec: str) -> None:
    feedback = ErrorFeedback(get_codec(spec))
    first, second = random_tensor((20, 30), 1), random_tensor((20, 30), 2)
    feedback.encode("w", first)
    feedback.discard()
    assert feedback.residual_norm("w") == 0.0 and len(feedback) == 0
    feedback.encode("w", first)
    feedback.commit()
    committed = feedback.residual_norm("w")
    assert committed > 0
    attempt = feedback.encode("w", second)
    feedback.discard()  # a failed round: residual and warm start (powersgd) stay as they were
    assert feedback.residual_norm("w") == committed
    retry = feedback.encode("w", second)
    assert retry == attempt
    feedback.commit()
    assert feedback.residual_norm("w") != committed
    feedback.reset()
    assert feedback.residual_norm("w") == 0.0 and len(feedback) == 0


def test_powersgd_warm_start_improves_on_a_fixed_matrix() -> None:
    codec = PowerSGDCodec(rank=2)
    low_rank = random_tensor((50, 2), 3) @ random_tensor((2, 40), 4) + 0.01 * random_tensor((50, 40), 5)
    cold = codec.decode(codec.encode(low_rank))
    warm_start = codec.next_warm_start(codec.encode(low_rank))
    assert warm_start is not None and warm_start.shape == (40, 2)
    warm = codec.decode(codec.encode(low_rank, warm_start=warm_start))
    assert (low_rank - warm).norm() <= (low_rank - cold).norm()
    assert (low_rank - warm).norm() <= 0.05 * low_rank.norm()
    assert codec.next_warm_start(codec.encode(torch.zeros(5))) is None  # raw fallback has no state


def test_error_feedback_lossless_is_pass_through() -> None:
    feedback = ErrorFeedback(get_codec("none"))
    x = random_tensor((10,))
    assert torch.equal(get_codec("none").decode(feedback.encode("w", x)), x)
    feedback.commit()
    assert len(feedback) == 0 and feedback.residual_norm("w") == 0.0


def test_error_feedback_keeps_dtype_and_rejects_shape_change() -> None:
    feedback = ErrorFeedback(get_codec("topk"))
    assert feedback.encode("w", random_tensor((100,)).to(torch.bfloat16)).dtype == "bfloat16"
    feedback.commit()
    with pytest.raises(CodecError, match="changed shape"):
        feedback.encode("w", random_tensor((101,)))


# ---- hostile input ----------------------------------------------------------------------------


def sample(spec: str, shape: tuple[int, ...] = (16, 32)) -> tuple[Codec, Encoded]:
    codec = get_codec(spec)
    return codec, codec.encode(random_tensor(shape))


def with_part(encoded: Encoded, key: str, data: bytes) -> Encoded:
    return dataclasses.replace(encoded, parts={**encoded.parts, key: data})


def f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("spec", SPECS)
def test_rejects_wrong_codec_and_bad_part_lengths(spec: str) -> None:
    codec, encoded = sample(spec)
    other = get_codec("fp16" if codec.name == "none" else "none")
    with pytest.raises(CodecError, match="cannot decode"):
        other.decode(encoded)
    for key, part in encoded.parts.items():
        for bad in (part[:-1], part + b"\0", b""):
            if bad != part:
                with pytest.raises(CodecError, match="bytes, expected"):
                    codec.decode(with_part(encoded, key, bad))
    with pytest.raises(CodecError, match="parts must be"):
        codec.decode(with_part(encoded, "extra", b""))
    with pytest.raises(CodecError, match="parts must be"):
        codec.decode(dataclasses.replace(encoded, parts={}))


BAD_SHAPES = [((-1, 4), 1 << 31), ((10**6, 10**6), 1 << 31), ((0, 10**30), 1 << 31), ((100,), 99)]


@pytest.mark.parametrize(
    "spec, shape, max_elements",
    [(spec, *case) for spec in ("none", "int8", "topk", "powersgd") for case in BAD_SHAPES]
    # a caller allowing 1e13 elements: dense payloads are then too short; a sparse (topk) one is
    # valid for any allowed shape, so for topk max_elements is the only guard
    + [(spec, (10**6, 10**6), 10**13) for spec in ("none", "int8", "powersgd")],
)
def test_rejects_bad_shapes_before_allocating(
    spec: str, shape: tuple[int, ...], max_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec, encoded = sample(spec)
    encoded = dataclasses.replace(encoded, shape=shape)
    if spec == "powersgd" and encoded.meta["raw"] == 0:
        encoded = dataclasses.replace(encoded, meta={"raw": 1, "rank": 0}, parts={"raw": b""})

    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("allocated before validating")

    for name in ("empty", "zeros", "frombuffer", "randn"):
        monkeypatch.setattr(torch, name, no_allocation)
    with pytest.raises(CodecError):
        codec.decode(encoded, max_elements=max_elements)


@pytest.mark.parametrize(
    "spec, key, data, match",  # key "p+q": the same data in both parts
    [
        ("none", "data", f32(1, math.nan, 3, 4), "NaN or Inf"),
        ("none", "data", f32(1, 2, math.inf, 4), "NaN or Inf"),
        ("fp16", "data", torch.tensor([1, math.inf], dtype=torch.float16).numpy().tobytes(), "NaN or Inf"),
        ("bf16", "data", torch.tensor([math.nan, 1]).to(torch.bfloat16).view(torch.int16).numpy().tobytes(), "NaN"),
        ("int8", "scale", f32(math.nan), "scales"),
        ("int8", "scale", f32(-1.0), "scales"),
        ("int8", "scale", f32(3e38), "scales"),  # 127 * 3e38 would overflow
        ("topk", "val", f32(math.inf), "NaN or Inf"),
        ("topk", "idx", torch.tensor([4], dtype=torch.int32).numpy().tobytes(), "indices"),
        ("topk", "idx", torch.tensor([-1], dtype=torch.int32).numpy().tobytes(), "indices"),
        ("powersgd", "p", f32(math.nan, 0, 0, 0, 0, 0, 0, 0), "NaN or Inf"),
        ("powersgd", "p+q", f32(1e30, 0, 0, 0, 0, 0, 0, 0), "overflow"),  # 1e30 * 1e30
    ],
)
def test_rejects_bad_values(spec: str, key: str, data: bytes, match: str) -> None:
    shape = {"none": (4,), "fp16": (2,), "bf16": (2,), "int8": (3,), "topk": (4,), "powersgd": (8, 8)}[spec]
    codec = get_codec(spec) if spec != "powersgd" else PowerSGDCodec(rank=1)
    encoded = codec.encode(torch.ones(shape) if spec != "topk" else torch.arange(4.0))
    assert torch.isfinite(codec.decode(encoded)).all()  # the untouched payload decodes
    for part in key.split("+"):
        encoded = with_part(encoded, part, data)
    with pytest.raises(CodecError, match=match):
        codec.decode(encoded)


@pytest.mark.parametrize(
    "spec, meta",
    [
        ("none", {"k": 1}),
        ("int8", {}),
        ("int8", {"block": 0}),
        ("int8", {"block": 1.5}),
        ("int8", {"block": True}),
        ("int8", {"block": 1024, "extra": 1}),
        ("topk", {"k": 10**9}),
        ("topk", {"k": -1}),
        ("powersgd", {"raw": 2, "rank": 4}),
        ("powersgd", {"raw": 0, "rank": 0}),
        ("powersgd", {"raw": 0, "rank": 17}),
        ("powersgd", {"raw": 1, "rank": 4}),
        ("powersgd", {"raw": 0}),
    ],
)
def test_rejects_bad_meta(spec: str, meta: dict[str, int | float]) -> None:
    codec, encoded = sample(spec)
    with pytest.raises(CodecError, match="meta"):
        codec.decode(dataclasses.replace(encoded, meta=meta))


def test_rejects_bad_header_fields() -> None:
    codec, encoded = sample("none")
    for change in [
        {"dtype": "int32"},
        {"dtype": "float8"},
        {"shape": (16.0, 32)},
        {"shape": (True, 32)},
        {"shape": [16, 32]},
        {"shape": (1,) * 33},
        {"codec": ""},
        {"parts": {"data": bytearray(encoded.parts["data"])}},
        {"meta": {"x": "1"}},
    ]:
        with pytest.raises(CodecError):
            codec.decode(dataclasses.replace(encoded, **change))
    with pytest.raises(CodecError, match="expected Encoded"):
        codec.decode(encoded.to_msgpack())  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", SPECS)
def test_msgpack_round_trip(spec: str) -> None:
    _, encoded = sample(spec)
    packed = msgpack.packb(encoded.to_msgpack())
    assert Encoded.from_msgpack(msgpack.unpackb(packed)) == encoded


@pytest.mark.parametrize(
    "change",
    [
        {"codec": 1},
        {"shape": "16,32"},
        {"shape": [16, "32"]},
        {"shape": [16, 32.0]},
        {"dtype": None},
        {"parts": [b""]},
        {"parts": {"data": "text"}},
        {"parts": {1: b""}},
        {"meta": {"k": None}},
        {"meta": {"k": False}},
        {"meta": []},
        {"extra": 1},
    ],
)
def test_from_msgpack_rejects_wrong_types(change: dict[str, object]) -> None:
    obj = {**sample("topk")[1].to_msgpack(), **change}
    with pytest.raises(CodecError):
        Encoded.from_msgpack(obj)


@pytest.mark.parametrize("obj", [None, [], b"x", {"codec": "none"}])
def test_from_msgpack_rejects_non_maps_and_missing_fields(obj: object) -> None:
    with pytest.raises(CodecError):
        Encoded.from_msgpack(obj)


# ---- specs ------------------------------------------------------------------------------------


def test_get_codec_parses_specs() -> None:
    assert CODEC_NAMES == ("none", "fp16", "bf16", "int8", "topk", "powersgd")
    assert get_codec("topk") == TopKCodec(0.01) and get_codec("topk:0.05") == TopKCodec(0.05)
    assert get_codec("powersgd") == PowerSGDCodec(4) and get_codec("powersgd:8") == PowerSGDCodec(8)
    assert get_codec("int8:4096") == Int8Codec(4096)
    for spec in [*SPECS, "topk:0.05", "int8:4096", "powersgd:8"]:
        codec = get_codec(spec)
        assert get_codec(codec.spec) == codec
        assert codec.lossy == (codec.name != "none")


@pytest.mark.parametrize(
    "spec",
    ["zip", "", "TOPK", "topk:", "topk:0", "topk:1.5", "topk:abc", "topk:nan", "powersgd:0", "powersgd:2.5",
     "powersgd:-1", "powersgd:+4", "int8:0", "fp16:3", "none:1", 3, None],
)
def test_get_codec_rejects_bad_specs(spec: object) -> None:
    with pytest.raises(CodecError):
        get_codec(spec)  # type: ignore[arg-type]


# ---- every refusal says what is wrong; edges of every range -------------------------------------

NAN_ROW = torch.tensor([[1.0, math.nan, 2.0, 3.0]] * 8)


@pytest.mark.parametrize("spec, tensor, message", [
    ("none", torch.tensor([1.0, math.inf]), "^tensor to encode has NaN or Inf values$"),
    ("fp16", torch.tensor([1.0, math.nan]), "^cannot encode a tensor with NaN or Inf values$"),
    ("bf16", torch.tensor([-math.inf, 1.0]), "^cannot encode a tensor with NaN or Inf values$"),
    ("int8:2", torch.tensor([1.0, 2.0, math.nan]), "^cannot encode a tensor with NaN or Inf values$"),
    ("topk:0.5", torch.tensor([1.0, math.nan, 2.0, 3.0]), "^tensor to encode has NaN or Inf values$"),
    ("powersgd:1", torch.tensor([1.0, math.nan]), "^tensor to encode has NaN or Inf values$"),  # raw fallback
    ("powersgd:1", NAN_ROW, "^tensor to encode has NaN or Inf values$"),
    ("powersgd:1", torch.full((1000, 2), 2e37),  # P = M q fits; Q = M^T P = 2e37 * sqrt(1000) does not
     r"^tensor to encode \(values too large for a float32 low-rank factor\) has NaN or Inf values$"),
])
def test_encoding_non_finite_values_names_the_problem(spec, tensor, message):
    with pytest.raises(CodecError, match=message):
        get_codec(spec).encode(tensor)


@pytest.mark.parametrize("spec, key, data, message", [
    ("none", "data", f32(math.nan), "^none payload has NaN or Inf values$"),
    ("fp16", "data", torch.tensor([math.inf], dtype=torch.float16).numpy().tobytes(), "^fp16 payload has NaN"),
    ("bf16", "data", torch.tensor([math.nan]).to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
     "^bf16 payload has NaN"),
    ("topk:1.0", "val", f32(math.inf), "^topk values has NaN or Inf values$"),
    ("powersgd:1", "raw", f32(math.nan), "^powersgd raw payload has NaN or Inf values$"),
])
def test_decoding_non_finite_values_names_the_part(spec, key, data, message):
    codec = get_codec(spec)
    encoded = codec.encode(torch.ones(1))
    with pytest.raises(CodecError, match=message):
        codec.decode(with_part(encoded, key, data))


def test_powersgd_factors_are_named_when_they_hold_nan():
    codec = PowerSGDCodec(rank=1)
    encoded = codec.encode(torch.ones(8, 8))
    with pytest.raises(CodecError, match="^powersgd P has NaN or Inf values$"):
        codec.decode(with_part(encoded, "p", f32(math.nan, *[0.0] * 7)))
    with pytest.raises(CodecError, match="^powersgd Q has NaN or Inf values$"):
        codec.decode(with_part(encoded, "q", f32(math.nan, *[0.0] * 7)))
    with pytest.raises(CodecError, match="^powersgd factors are too large: their product would overflow float32$"):
        codec.decode(with_part(with_part(encoded, "p", f32(1e20, *[0.0] * 7)), "q", f32(1e19, *[0.0] * 7)))


def test_powersgd_overflow_guard_uses_the_largest_row_norms():
    """|(P Q^T)_ij| <= |P_i| |Q_j|: rows are checked, not the whole factor (whose norm could pass
    while one row's product overflows) and the limit is fp32 max / 2."""
    codec = PowerSGDCodec(rank=1)
    encoded = codec.encode(torch.ones(8, 8))
    limit = float(torch.finfo(torch.float32).max) / 2
    p, q = [1.0] + [0.0] * 7, [limit / 1.0001] + [0.0] * 7
    assert torch.isfinite(codec.decode(with_part(with_part(encoded, "p", f32(*p)), "q", f32(*q)))).all()
    q = [limit * 1.0001] + [0.0] * 7
    with pytest.raises(CodecError, match="too large"):
        codec.decode(with_part(with_part(encoded, "p", f32(*p)), "q", f32(*q)))
    # two rank-2 rows: the largest row norm is sqrt(2) * 1e19 per factor, 2e38 > limit
    codec2 = PowerSGDCodec(rank=2)
    encoded2 = codec2.encode(torch.randn(8, 8))
    row = [1e19, 1e19] + [0.0] * 14
    with pytest.raises(CodecError, match="too large"):
        codec2.decode(with_part(with_part(encoded2, "p", f32(*row)), "q", f32(*row)))


@pytest.mark.parametrize("make, message", [
    (lambda: Int8Codec(0), r"^int8 block size must be an int in \[1, 16777216\], got 0$"),
    (lambda: Int8Codec((1 << 24) + 1), r"^int8 block size must be an int in \[1, 16777216\], got 16777217$"),
    (lambda: TopKCodec(0.0), r"^topk fraction must be a number in \(0, 1\], got 0.0$"),
    (lambda: TopKCodec(1.5), r"^topk fraction must be a number in \(0, 1\], got 1.5$"),
    (lambda: PowerSGDCodec(0), r"^powersgd rank must be an int in \[1, 1024\], got 0$"),
    (lambda: PowerSGDCodec(1025), r"^powersgd rank must be an int in \[1, 1024\], got 1025$"),
    (lambda: PowerSGDCodec(4, seed=1.0), "^powersgd seed must be an int, got 1.0$"),
])
def test_codec_parameters_out_of_range_are_refused_by_name(make, message):
    with pytest.raises(CodecError, match=message):
        make()


def test_codec_parameters_at_the_ends_of_their_ranges_are_accepted():
    assert Int8Codec(1 << 24).block_size == 1 << 24 and Int8Codec(1).block_size == 1
    assert TopKCodec(1.0).fraction == 1.0 and TopKCodec(1).fraction == 1
    assert PowerSGDCodec(1024).rank == 1024 and PowerSGDCodec(1).rank == 1
    everything = TopKCodec(1.0).encode(torch.arange(5.0))
    assert everything.meta == {"k": 5}


def test_get_codec_says_which_part_of_the_spec_is_wrong():
    with pytest.raises(CodecError, match="^codec spec must be a string, got int$"):
        get_codec(3)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="^unknown codec 'zip'; choose one of none, fp16, bf16, int8, topk, powersgd$"):
        get_codec("zip")
    with pytest.raises(CodecError, match="^codec 'fp16' takes no parameter, got 'fp16:3'$"):
        get_codec("fp16:3")
    with pytest.raises(CodecError, match=r"^bad parameter '\+4' for codec 'powersgd' \(spec 'powersgd:\+4'\)$"):
        get_codec("powersgd:+4")
    with pytest.raises(CodecError, match=r"^bad parameter 'nan' for codec 'topk' \(spec 'topk:nan'\)$"):
        get_codec("topk:nan")
    assert get_codec(" int8:64 ") == Int8Codec(64)


def test_structure_errors_name_the_field():
    _, encoded = sample("none")
    with pytest.raises(CodecError, match="^encoded tensor must be a map, got list$"):
        Encoded.from_msgpack([])
    with pytest.raises(CodecError, match=r"^encoded tensor must have exactly the fields \('codec', 'shape', 'dtype', "
                                         r"'parts', 'meta'\), got \['codec'\]$"):
        Encoded.from_msgpack({"codec": "none"})
    with pytest.raises(CodecError, match=r"^shape \(-1, 4\) has a negative dim or one above max_elements=100$"):
        get_codec("none").decode(dataclasses.replace(encoded, shape=(-1, 4)), max_elements=100)
    with pytest.raises(CodecError, match=r"^shape \(20, 20\) has 400 elements, above max_elements=399$"):
        get_codec("none").decode(dataclasses.replace(encoded, shape=(20, 20)), max_elements=399)
    assert get_codec("none").decode(dataclasses.replace(encoded, shape=(16, 32)), max_elements=512).shape == (16, 32)
    assert repr(get_codec("topk:0.5")) == "TopKCodec('topk:0.5')"


def test_int8_scale_limits_are_inclusive():
    codec = Int8Codec(1)
    encoded = codec.encode(torch.tensor([1.0, 2.0]))
    zero = codec.decode(with_part(encoded, "scale", f32(0.0, 0.0)))  # a zero scale is a valid all-zero block
    assert torch.equal(zero, torch.zeros(2))
    top = float(torch.finfo(torch.float32).max) / 128
    assert torch.isfinite(codec.decode(with_part(encoded, "scale", f32(top, top)))).all()
    with pytest.raises(CodecError, match="scales"):
        codec.decode(with_part(encoded, "scale", f32(top * 1.0001, 1.0)))


def test_int8_blocks_line_up_when_the_tail_is_short():
    """Full blocks and the short last block are quantised and decoded each against their own scale."""
    tensor = torch.tensor([1.0, -1.0, 100.0, 50.0, 0.001])  # blocks of 2: [1, -1], [100, 50], [0.001]
    codec = Int8Codec(2)
    encoded = codec.encode(tensor)
    scales = torch.frombuffer(bytearray(encoded.parts["scale"]), dtype=torch.float32)
    torch.testing.assert_close(scales, torch.tensor([1.0, 100.0, 0.001]) / 127)
    torch.testing.assert_close(codec.decode(encoded), tensor, rtol=1 / 127, atol=0)
    short = Int8Codec(8).encode(torch.tensor([3.0, -6.0]))  # only a short block
    torch.testing.assert_close(Int8Codec(8).decode(short), torch.tensor([3.0, -6.0]), rtol=1 / 127, atol=0)


def test_casts_clamp_exactly_at_the_wire_range():
    limit = 65504.0
    decoded = get_codec("fp16").decode(get_codec("fp16").encode(torch.tensor([-limit, limit, -1e6, 1e6])))
    assert decoded.tolist() == [-limit, limit, -limit, limit]
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    decoded = get_codec("bf16").decode(get_codec("bf16").encode(torch.tensor([-3.4e38, 3.4e38])))
    assert decoded.tolist() == [-bf16_max, bf16_max]


def test_decoded_tensors_have_the_declared_shape_and_float32():
    for spec in ("none", "fp16", "int8", "topk", "powersgd:1"):
        codec = get_codec(spec)
        for shape in ((0,), (3, 0), (6, 5)):
            decoded = codec.decode(codec.encode(torch.ones(shape)))
            assert decoded.shape == shape and decoded.dtype == torch.float32, (spec, shape)


def test_the_sampled_top_k_search_is_exact():
    """Above 2^16 elements the search samples a threshold first; the result is the same set as a
    full torch.topk, including when many values tie and when the sample is unlucky."""
    from swarmgrad.averaging.codecs.topk import top_k_indices

    generator = torch.Generator().manual_seed(3)
    cases = [torch.randn(1 << 17, generator=generator).abs(), torch.randn(300_000, generator=generator).abs()]
    spiky = torch.zeros(1 << 17)
    spiky[torch.randperm(1 << 17, generator=generator)[:50]] = torch.rand(50, generator=generator) + 1
    cases.append(spiky)  # the strided sample sees almost none of the 50 large values
    for magnitude in cases:
        for k in (1, 7, 100, 1000, magnitude.numel() // 4, magnitude.numel() // 4 + 1):
            got = top_k_indices(magnitude, k)
            assert got.numel() == k and got.unique().numel() == k
            want = torch.topk(magnitude, k).values
            torch.testing.assert_close(magnitude[got].sort().values, want.sort().values, rtol=0, atol=0)


def test_error_feedback_carries_the_powersgd_warm_start_per_tensor():
    """PowerSGD's Q is kept per tensor key and committed with the round: with it, one power
    iteration per round converges on a fixed matrix; the state follows commit/discard/reset."""
    codec = PowerSGDCodec(rank=2)
    feedback = ErrorFeedback(codec)
    matrix = random_tensor((32, 24), seed=5)
    first = feedback.encode("a", matrix)
    assert feedback._warm == {}  # staged only
    feedback.commit()
    warm = feedback._warm["a"]
    assert torch.equal(warm, codec.next_warm_start(first))
    second = feedback.encode("a", torch.zeros(32, 24))
    assert second.parts != codec.encode(torch.zeros(32, 24) + feedback._residual["a"]).parts  # used the warm start
    assert second.parts == codec.encode(torch.zeros(32, 24) + feedback._residual["a"], warm_start=warm).parts
    feedback.discard()
    assert torch.equal(feedback._warm["a"], warm)
    feedback.encode("b", random_tensor((4,)))  # raw fallback: no warm start for "b"
    feedback.commit()
    assert set(feedback._warm) == {"a"} and set(feedback._residual) == {"a", "b"}
    feedback._warm["b"] = warm
    feedback.encode("b", random_tensor((4,)))
    feedback.commit()
    assert "b" not in feedback._warm  # a raw round drops a stale warm start
    feedback.reset("a")
    assert set(feedback._warm) == set() and set(feedback._residual) == {"b"} and len(feedback) == 1
    feedback.encode("b", random_tensor((4,)))
    feedback.reset("b")
    assert len(feedback) == 0 and feedback._staged == {}
    feedback.encode("c", random_tensor((4,)))
    feedback.reset()  # everything, staged included
    feedback.commit()
    assert len(feedback) == 0


def test_error_feedback_residual_is_a_fresh_tensor_and_the_payload_keeps_the_callers_dtype():
    feedback = ErrorFeedback(get_codec("int8"))
    update = random_tensor((100,), seed=9)
    encoded = feedback.encode("w", update)
    feedback.commit()
    residual = feedback._residual["w"]
    assert residual.dtype == torch.float32 and residual.shape == (100,)
    torch.testing.assert_close(residual, update - get_codec("int8").decode(encoded))
    assert encoded.dtype == "float32" and encoded is not None
    assert feedback.encode("w", update.double()).dtype == "float64"
    feedback.discard()
    assert feedback.residual_norm("w") == pytest.approx(float(residual.norm()))
    assert feedback.residual_norm("unknown") == 0.0


def test_powersgd_sends_raw_exactly_when_low_rank_would_not_be_smaller():
    codec = PowerSGDCodec(rank=2)
    assert codec.matrix_dims((4, 4)) is None  # 2 * (4 + 4) == 16: no gain, so raw
    assert codec.matrix_dims((5, 4)) == (5, 4)  # 18 < 20
    assert codec.matrix_dims((3, 2, 2)) is None and codec.matrix_dims((5, 2, 2)) == (5, 4)
    assert type(PowerSGDCodec(1).encoded_nbytes((8, 5))) is int  # a buffer size: allocated with bytearray()
    assert PowerSGDCodec(1).encoded_nbytes((8, 5)) == 4 * (8 + 5)


@pytest.mark.parametrize("shape, meta, message", [
    ((16, 32), {"raw": 2, "rank": 0}, r"meta\['raw'\] must be an int in \[0, 1\], got 2"),
    ((16, 32), {"raw": 1, "rank": 1}, r"meta\['rank'\] must be an int in \[0, 0\], got 1"),
    ((16, 2), {"raw": 0, "rank": 3}, r"meta\['rank'\] must be an int in \[1, 2\], got 3"),  # rank above m
    ((2, 16), {"raw": 0, "rank": 3}, r"meta\['rank'\] must be an int in \[1, 2\], got 3"),  # rank above n
    ((0, 5), {"raw": 0, "rank": 1}, r"meta\['rank'\] must be an int in \[1, 0\], got 1"),  # no rows
    ((40,), {"raw": 0, "rank": 1}, r"^powersgd low-rank payload needs a shape with >= 2 dims, got \(40,\)$"),
])
def test_powersgd_meta_must_fit_the_shape(shape, meta, message):
    codec, encoded = sample("powersgd")
    with pytest.raises(CodecError, match=message):
        codec.decode(dataclasses.replace(encoded, shape=shape, meta=meta))


def test_powersgd_rank_is_capped_by_max_rank_even_for_large_matrices():
    codec = PowerSGDCodec(rank=4)
    n, rank = 1100, 1025
    parts = {"p": bytes(4 * n * rank), "q": bytes(4 * n * rank)}
    encoded = Encoded("powersgd", (n, n), "float32", parts, {"raw": 0, "rank": rank})
    with pytest.raises(CodecError, match=r"meta\['rank'\] must be an int in \[1, 1024\], got 1025"):
        codec.decode(encoded)
    ok = Encoded("powersgd", (n, n), "float32", {"p": bytes(4 * n * 1024), "q": bytes(4 * n * 1024)},
                 {"raw": 0, "rank": 1024})
    assert not codec.decode(ok).any()


def test_powersgd_overflow_bound_is_per_row_and_strict():
    codec = PowerSGDCodec(rank=1)
    encoded = codec.encode(torch.ones(8, 8))
    limit = float(torch.finfo(torch.float32).max) / 2  # exact in float32 and float64
    rows = f32(*[1e19] * 8)  # every row 1e19, each factor's whole norm 2.8e19: the product of rows fits
    assert torch.isfinite(codec.decode(with_part(with_part(encoded, "p", rows), "q", rows))).all()
    at_limit = with_part(with_part(encoded, "p", f32(1.0, *[0.0] * 7)), "q", f32(limit, *[0.0] * 7))
    with pytest.raises(CodecError, match="too large"):
        codec.decode(at_limit)


def test_powersgd_warm_start_is_taken_in_float32_on_the_cpu():
    codec = PowerSGDCodec(rank=2)
    matrix = random_tensor((12, 10), seed=2)
    warm = torch.randn(10, 2, generator=torch.Generator().manual_seed(1))
    assert codec.encode(matrix, warm_start=warm.double()).parts == codec.encode(matrix, warm_start=warm).parts


def test_powersgd_next_warm_start_only_from_its_own_low_rank_encodings():
    codec = PowerSGDCodec(rank=2)
    encoded = codec.encode(random_tensor((12, 10), seed=3))
    warm = codec.next_warm_start(encoded)
    assert warm.shape == (10, 2) and torch.equal(warm, torch.frombuffer(bytearray(encoded.parts["q"]),
                                                                      dtype=torch.float32).view(10, 2))
    assert codec.next_warm_start(dataclasses.replace(encoded, codec="int8")) is None
    assert codec.next_warm_start(codec.encode(torch.ones(4))) is None  # raw
    assert PowerSGDCodec(rank=3).next_warm_start(encoded) is None  # another rank
    assert codec.next_warm_start(with_part(encoded, "q", encoded.parts["q"][:-4])) is None  # not whole rows
    assert codec.next_warm_start(dataclasses.replace(encoded, parts={"p": encoded.parts["p"]})) is None  # no Q


def test_the_sampled_top_k_search_falls_back_when_the_sample_misleads():
    """Sampled positions hold the large values: the threshold then admits fewer than k candidates,
    and the full topk must run instead (still exact)."""
    from swarmgrad.averaging.codecs.topk import top_k_indices

    generator = torch.Generator().manual_seed(8)
    magnitude = torch.rand(1 << 17, generator=generator) * 0.5
    magnitude[::2] = 1 + torch.rand(1 << 16, generator=generator)  # exactly what the stride-2 sample sees
    got = top_k_indices(magnitude, 1000)
    assert got.numel() == 1000
    torch.testing.assert_close(magnitude[got].sort().values, torch.topk(magnitude, 1000).values.sort().values,
                               rtol=0, atol=0)


def test_empty_buffers_keep_their_dtype_and_shape_errors_name_the_type():
    from swarmgrad.averaging.codecs.base import tensor_from

    assert tensor_from(b"", torch.int32).dtype == torch.int32 and tensor_from(b"", torch.float16).dtype == torch.float16
    with pytest.raises(CodecError, match="^shape must be a list, got str$"):
        Encoded.from_msgpack({**sample("none")[1].to_msgpack(), "shape": "16,32"})


@pytest.mark.parametrize("change, message", [
    ({"codec": ""}, "^codec name must be a short string, got ''$"),
    ({"codec": "c" * 65}, "^codec name must be a short string, got 'c{64}"),
    ({"shape": (1,) * 33}, "^shape must be a tuple of at most 32 ints$"),
    ({"parts": {f"p{i}": b"" for i in range(9)}}, "^parts must be a map of at most 8 buffers$"),
    ({"parts": {1: b""}}, "^parts must map str to bytes, got int -> bytes$"),
    ({"parts": {"data": "text"}}, "^parts must map str to bytes, got str -> str$"),
    ({"meta": {f"m{i}": 1 for i in range(9)}}, "^meta must be a map of at most 8 numbers$"),
    ({"meta": {"k": None}}, "^meta must map str to int/float, got 'k' -> NoneType$"),
    ({"meta": {"k": True}}, "^meta must map str to int/float, got 'k' -> bool$"),
])
def test_structure_limits_name_what_broke_them(change, message):
    from swarmgrad.averaging.codecs.base import check_structure

    encoded = dataclasses.replace(sample("none")[1], **change)
    with pytest.raises(CodecError, match=message):
        check_structure(encoded)
    with pytest.raises(CodecError, match="^expected Encoded, got dict$"):
        check_structure(encoded.to_msgpack())  # type: ignore[arg-type]


def test_structure_limits_are_inclusive():
    from swarmgrad.averaging.codecs.base import check_structure

    encoded = sample("none")[1]
    for change in ({"codec": "c" * 64}, {"codec": "c"}, {"shape": (1,) * 32}, {"parts": {f"p{i}": b"" for i in range(8)}},
                   {"meta": {f"m{i}": 1.5 for i in range(8)}}):
        check_structure(dataclasses.replace(encoded, **change))
    with pytest.raises(CodecError, match="^can only encode torch tensors, got list$"):
        get_codec("none").encode([1.0])  # type: ignore[arg-type]


def test_powersgd_takes_no_warm_start_from_a_raw_encoding_whatever_its_rank_says():
    codec = PowerSGDCodec(rank=2)
    raw = dataclasses.replace(codec.encode(torch.ones(4)), meta={"raw": 1, "rank": 2}, parts={"q": bytes(8 * 4)})
    assert codec.next_warm_start(raw) is None
