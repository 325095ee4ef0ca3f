"""The one-bit `sign` codec: its exact error, sizes, spec, hostile payloads and error feedback."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import pytest
import torch

from swarmgrad.averaging.allreduce import gather_codec_for
from swarmgrad.averaging.codecs import CodecError, Encoded, ErrorFeedback, get_codec
from swarmgrad.averaging.codecs.sign import SignCodec

SHAPES = [(0,), (1,), (7,), (63,), (64,), (65,), (33, 65), (1000, 300)]


def random_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def wire(encoded: Encoded) -> Encoded:
    return Encoded.from_msgpack(msgpack.unpackb(msgpack.packb(encoded.to_msgpack())))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", [64, 5, 1000])
def test_each_block_decodes_to_its_signs_times_its_mean_magnitude(shape: tuple[int, ...], block: int) -> None:
    codec = SignCodec(block)
    x = random_tensor(shape)
    encoded = codec.encode(x)
    assert encoded.nbytes() == codec.encoded_nbytes(shape) == 4 * -(-x.numel() // block) + -(-x.numel() // 8)
    decoded = codec.decode(wire(encoded))
    assert decoded.shape == shape and decoded.dtype == torch.float32
    for original, got in zip(x.reshape(-1).split(block), decoded.reshape(-1).split(block)):
        if not original.numel():
            continue  # an empty tensor splits into one empty block
        scale = original.abs().mean()
        assert torch.equal(got.sign(), original.sign())  # no zeros in random data
        assert torch.allclose(got.abs(), scale.expand_as(got))
        # the least squared error of any code +-s: the block's energy less its code's
        error = float((original - got).pow(2).sum())
        assert error == pytest.approx(float(original.pow(2).sum() - original.numel() * scale**2), rel=1e-4, abs=1e-4)


def test_zero_blocks_are_exact_and_a_lone_zero_decodes_to_plus_the_scale() -> None:
    codec = SignCodec(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, -2.0, 0.0, 4.0])
    assert codec.decode(codec.encode(x)).tolist() == [0.0, 0.0, 0.0, 0.0, 2.0, -2.0, 2.0, 2.0]


def test_sizes_spec_and_return_codec() -> None:
    assert SignCodec().ratio(torch.zeros(1 << 20)) == 4 / (1 / 8 + 4 / 64)  # 21.3x
    assert get_codec("sign") == SignCodec(64) and get_codec("sign:256") == SignCodec(256)
    assert SignCodec(256).spec == "sign:256" and get_codec(SignCodec().spec) == SignCodec()
    assert gather_codec_for(SignCodec(32)) == SignCodec(32)
    for spec, message in [("sign:0", "block size must be an int"), ("sign:1.5", "bad parameter")]:
        with pytest.raises(CodecError, match=message):
            get_codec(spec)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_nan_and_inf(bad: float) -> None:
    x = random_tensor((300,))
    x[299] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        SignCodec().encode(x)


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_bad_scales_padding_and_sizes_are_refused(value: float) -> None:
    codec = SignCodec()
    encoded = codec.encode(random_tensor((70,)))  # 2 blocks; 70 bits: 2 padding bits
    scale, q = encoded.parts["scale"], encoded.parts["q"]
    with pytest.raises(CodecError, match=r"^sign block scales must be finite and in \[0, 3.4e\+38\]$"):
        codec.decode(dataclasses.replace(encoded, parts={"scale": np.float32(value).tobytes() + scale[4:], "q": q}))
    with pytest.raises(CodecError, match="padding bits"):
        codec.decode(dataclasses.replace(encoded, parts={"scale": scale, "q": q[:-1] + bytes([q[-1] | 0x80])}))
    with pytest.raises(CodecError, match="bytes, expected"):
        codec.decode(dataclasses.replace(encoded, parts={"scale": scale, "q": q + b"\0"}))
    with pytest.raises(CodecError, match="meta"):
        codec.decode(dataclasses.replace(encoded, meta={"block": 0}))


def test_error_feedback_delivers_every_update_only_delayed() -> None:
    codec, generator = SignCodec(), torch.Generator().manual_seed(1)
    feedback = ErrorFeedback(codec)
    true_sum, sent_sum, plain_sum = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    for _ in range(200):
        update = torch.randn(4096, generator=generator) + 0.3
        sent_sum += codec.decode(wire(feedback.encode("w", update)))
        feedback.commit()
        plain_sum += codec.decode(codec.encode(update))
        true_sum += update
        assert float((true_sum - sent_sum).norm()) == pytest.approx(feedback.residual_norm("w"), rel=1e-3, abs=1e-3)
    assert float((true_sum - sent_sum).norm()) <= 0.1 * float((true_sum - plain_sum).norm())
