"""Codecs at their edges: every refusal checked by its message, every range at both ends, the
sampled top-k search, PowerSGD's meta, overflow bound and warm start, error feedback's state. The
round trips, bounds and hostile-input basics are in test_codecs.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_codecs import f32, random_tensor, sample, with_part

from swarmgrad.averaging.codecs import CodecError, Encoded, ErrorFeedback, get_codec
from swarmgrad.averaging.codecs.base import all_finite
from swarmgrad.averaging.codecs.int8 import Int8Codec
from swarmgrad.averaging.codecs.powersgd import PowerSGDCodec
from swarmgrad.averaging.codecs.topk import TopKCodec

# ---- every refusal says what is wrong ---------------------------------------------------------------

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
    with pytest.raises(CodecError, match="^unknown codec 'zip'; choose one of none, fp16, bf16, int8, q4, q2, sign, topk, sparse, powersgd$"):
        get_codec("zip")
    with pytest.raises(CodecError, match="^codec 'fp16' takes no parameter, got 'fp16:3'$"):
        get_codec("fp16:3")
    with pytest.raises(CodecError, match=r"^bad parameter '\+4' for codec 'powersgd' \(spec 'powersgd:\+4'\)$"):
        get_codec("powersgd:+4")
    with pytest.raises(CodecError, match=r"^bad parameter 'nan' for codec 'topk' \(spec 'topk:nan'\)$"):
        get_codec("topk:nan")
    assert get_codec(" int8:64 ") == Int8Codec(64)


def test_decoded_tensors_have_the_declared_shape_and_float32():
    for spec in ("none", "fp16", "int8", "topk", "powersgd:1"):
        codec = get_codec(spec)
        for shape in ((0,), (3, 0), (6, 5)):
            decoded = codec.decode(codec.encode(torch.ones(shape)))
            assert decoded.shape == shape and decoded.dtype == torch.float32, (spec, shape)

# ---- int8 and the casts at the ends of their ranges -------------------------------------------------

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

# ---- the sampled top-k search -----------------------------------------------------------------------

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

# ---- PowerSGD: meta, overflow bound, warm start -----------------------------------------------------

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


def test_powersgd_takes_no_warm_start_from_a_raw_encoding_whatever_its_rank_says():
    codec = PowerSGDCodec(rank=2)
    raw = dataclasses.replace(codec.encode(torch.ones(4)), meta={"raw": 1, "rank": 2}, parts={"q": bytes(8 * 4)})
    assert codec.next_warm_start(raw) is None

# ---- error feedback state ---------------------------------------------------------------------------

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


@pytest.mark.parametrize("spec, kept_as", [("int8", torch.bfloat16), ("q4", torch.bfloat16), ("q2", torch.bfloat16),
                                           ("topk:0.1", torch.float32), ("sign", torch.float32)])
def test_error_feedback_residual_is_a_fresh_tensor_and_the_payload_keeps_the_callers_dtype(spec, kept_as):
    """A block quantizer drops at most a step of its block (int8 half of 1/127 of the block's largest
    value, q2 a quarter): its residuals are kept as bfloat16 (2 bytes an element); a codec whose
    residuals build up over rounds (a sparsifier, signs) keeps them as float32."""
    feedback = ErrorFeedback(get_codec(spec))
    update = random_tensor((100,), seed=9)
    encoded = feedback.encode("w", update)
    feedback.commit()
    residual = feedback._residual["w"]
    assert residual.dtype == kept_as and residual.shape == (100,)
    assert feedback.held_bytes() == 100 * residual.element_size()
    torch.testing.assert_close(residual, (update - get_codec(spec).decode(encoded)).to(kept_as))
    assert encoded.dtype == "float32" and encoded is not None
    assert feedback.encode("w", update.double()).dtype == "float64"
    feedback.discard()
    assert feedback.residual_norm("w") == pytest.approx(float(residual.float().norm()))
    assert feedback.residual_norm("unknown") == 0.0

# ---- the structure of an encoded tensor -------------------------------------------------------------

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


def test_all_finite_is_exact_where_the_sum_it_tries_first_is_not():
    """A finite sum proves every element finite; where finite values add up past float32's range
    (or cancel an inf), the exact min/max check decides."""
    huge = torch.full((1000,), 3e38)
    assert not math.isfinite(float(huge.sum())) and all_finite(huge)
    assert all_finite(torch.tensor([3e38, -3e38, 3e38, 3e38]))
    for bad in (math.inf, -math.inf, math.nan):
        for neighbours in (torch.zeros(9), torch.full((9,), 3e38)):
            values = torch.cat([neighbours, torch.tensor([bad])])
            assert not all_finite(values) and not all_finite(values.flip(0))
    assert not all_finite(torch.tensor([math.inf, -math.inf]))  # a sum of nan
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))
