"""Tensor codecs: error bounds, error feedback, hostile input, wire format, spec parsing."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

import swarmgrad.averaging.codecs as codecs
from swarmgrad.averaging.codecs import CODEC_NAMES, Codec, CodecError, Encoded, ErrorFeedback, get_codec
from swarmgrad.averaging.codecs.int8 import Int8Codec
from swarmgrad.averaging.codecs.powersgd import PowerSGDCodec
from swarmgrad.averaging.codecs.topk import TopKCodec

ROOT = Path(__file__).resolve().parents[2]  # the checkout, for the subprocesses
RETURN_ONLY = {"nonzero"}  # carries sparse's averages back: not a codec a run chooses
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


def test_every_codec_the_package_defines_is_registered() -> None:
    """Every named Codec class in codecs/ but the helpers is in CODEC_NAMES under its name, and get_codec
    builds it (a scan of the files, apart from the package's own discovery)."""
    defined = set()
    for path in Path(codecs.__file__).parent.glob("*.py"):
        module = importlib.import_module(f"{codecs.__name__}.{path.stem}")
        defined |= {cls.name for _, cls in inspect.getmembers(module, inspect.isclass)  # a named codec class
                    if issubclass(cls, Codec) and isinstance(vars(cls).get("name"), str)}
    assert "int8" in defined and defined - RETURN_ONLY == set(CODEC_NAMES), defined
    assert len(set(CODEC_NAMES)) == len(CODEC_NAMES)
    assert all(get_codec(name).name == name for name in CODEC_NAMES)


NEW_CODEC = '''
from dataclasses import dataclass
from typing import ClassVar

from swarmgrad.averaging.codecs.base import int_param
from swarmgrad.averaging.codecs.cast import RawCodec


@dataclass(frozen=True, repr=False)
class RepeatCodec(RawCodec):
    """float32 as it is; `times` only shows that the module parses its own parameter."""

    times: int = 1

    name: ClassVar[str] = "repeat"
    order: ClassVar[int] = 15

    @classmethod
    def from_param(cls, text):
        return cls() if text is None else cls(int_param(text))
'''

CHECK_NEW_CODEC = '''
import sys

import swarmgrad.averaging.codecs as package

package.__path__.append(sys.argv[1])  # as if the new module were in the package

import torch

from swarmgrad.averaging.codecs import CODEC_NAMES, CodecError, get_codec
from swarmgrad.averaging.settings import check_codec

codec = get_codec("repeat:3")
assert codec.times == 3 and check_codec("repeat") == "repeat", codec
x = torch.randn(5)
assert torch.equal(codec.decode(codec.encode(x)), x)
try:
    get_codec("repeat:x")
    raise SystemExit("a bad parameter was accepted")
except CodecError as error:
    assert str(error) == "bad parameter 'x' for codec 'repeat' (spec 'repeat:x')", error
print(" ".join(CODEC_NAMES))
'''


def check_new_codec(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", CHECK_NEW_CODEC, str(directory)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


def test_a_new_codec_is_one_module(tmp_path: Path) -> None:
    """A codec module dropped into the package is found by name, builds from its own parameter and is
    listed where its `order` puts it, with codecs/__init__.py untouched."""
    (tmp_path / "repeat.py").write_text(NEW_CODEC)
    done = check_new_codec(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["none", "repeat", *CODEC_NAMES[1:]]


def test_a_codec_name_taken_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "repeat.py").write_text(NEW_CODEC)
    (tmp_path / "echo.py").write_text(NEW_CODEC.replace("RepeatCodec", "EchoCodec"))
    done = check_new_codec(tmp_path)
    assert done.returncode == 1 and "two codecs are named 'repeat'" in done.stderr, done.stderr


def test_get_codec_parses_specs() -> None:
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
