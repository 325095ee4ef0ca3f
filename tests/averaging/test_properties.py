"""Property-based tests (hypothesis) of the pure core: wire frames, signed records, the chunk
layout, the int8 codec's error bound, the privacy budget and push-sum's mass. Seeded (derandomized) and small, so the whole file runs
in seconds; each property is stated as the module under test states it."""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from swarmgrad.averaging.codecs import CodecError, get_codec
from swarmgrad.averaging.layout import Schema, TensorSpec, assign_parts
from swarmgrad.net.wire import (
    MAX_HEADER_BYTES,
    PREFIX,
    WIRE_VERSION,
    FrameError,
    RemoteError,
    check_lengths,
    pack_prefix_and_header,
    parse_header,
)

settings.register_profile("swarmgrad", derandomize=True, max_examples=150, deadline=None)
# scripts/mutation.sh: one failing example kills a mutant, so no shrinking, and fewer examples for
# each of its thousands of runs
settings.register_profile("mutation", settings.get_profile("swarmgrad"), max_examples=40,
                          phases=[Phase.explicit, Phase.generate])
settings.load_profile(os.environ.get("SWARMGRAD_HYPOTHESIS_PROFILE", "swarmgrad"))

# ---- wire frames ---------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.binary(max_size=40))
headers = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda key: key not in ("t", "v")),
                          st.one_of(scalars, st.lists(scalars, max_size=4)), max_size=6)
kinds = st.text(min_size=1, max_size=12).filter(lambda kind: kind != "error")


@given(kinds, headers, st.integers(0, 2**32 - 1))
def test_a_frame_header_round_trips(kind, fields, payload_length):
    packed = pack_prefix_and_header({"t": kind, **fields}, payload_length)
    header_length, length = PREFIX.unpack(packed[:PREFIX.size])
    assert (header_length, length) == (len(packed) - PREFIX.size, payload_length)
    assert parse_header(packed[PREFIX.size:]) == {"v": WIRE_VERSION, "t": kind, **fields}


@given(kinds, headers, st.data())
def test_a_corrupted_header_is_refused_or_still_a_valid_header(kind, fields, data):
    """Truncation or any flipped bit gives a FrameError (never another exception), or, when the
    bytes still decode, a map that passes every check parse_header makes."""
    body = bytearray(pack_prefix_and_header({"t": kind, **fields}, 0)[PREFIX.size:])
    if data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body) - 1))]
    else:
        position = data.draw(st.integers(0, len(body) - 1))
        body[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        header = parse_header(bytes(body))
    except RemoteError:
        return  # the flip spelled "error": an error frame, handled as one
    except FrameError:
        return
    assert isinstance(header, dict) and isinstance(header["t"], str) and header["v"] == WIRE_VERSION


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**31))
def test_length_lies_are_refused_before_anything_is_read(header_length, payload_length, max_payload):
    fits = 1 <= header_length <= MAX_HEADER_BYTES and payload_length <= max_payload
    if fits:
        check_lengths(header_length, payload_length, max_payload)
    else:
        with pytest.raises(FrameError):
            check_lengths(header_length, payload_length, max_payload)


def test_a_header_too_large_to_send_is_refused():
    with pytest.raises(FrameError):
        pack_prefix_and_header({"t": "x", "blob": b"\0" * MAX_HEADER_BYTES}, 0)


# ---- the chunk layout ----------------------------------------------------------------------------

shapes = st.lists(st.lists(st.integers(0, 70), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6)


@given(shapes, st.integers(1, 5000))
def test_the_chunk_grid_covers_every_element_exactly_once(tensor_shapes, chunk_elements):
    schema = Schema([TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(tensor_shapes)], chunk_elements)
    covered = np.zeros(schema.total, dtype=np.int64)
    for index, chunk in enumerate(schema.chunks):
        assert chunk.index == index and 0 < chunk.length <= chunk_elements
        assert math.prod(chunk.view) == chunk.length
        covered[chunk.start : chunk.start + chunk.length] += 1
    assert (covered == 1).all()
    assert schema.total == sum(math.prod(shape) for shape in tensor_shapes)


@given(shapes, st.integers(1, 5000), st.lists(st.floats(0, 100), min_size=1, max_size=8))
def test_parts_are_contiguous_cover_every_chunk_and_skip_zero_shares(tensor_shapes, chunk_elements, shares):
    schema = Schema([TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(tensor_shapes)], chunk_elements)
    parts = assign_parts(schema.chunks, shares)
    assert len(parts) == len(shares)
    if sum(shares) <= 0 or not schema.chunks:
        assert all(len(part) == 0 for part in parts)
        return
    assert [index for part in parts for index in part] == list(range(len(schema.chunks)))
    for part, share in zip(parts, shares):
        if share == 0:
            assert len(part) == 0
    # each chunk goes to the first member whose share boundary covers its middle (the last takes the rest)
    boundaries = [schema.total * sum(shares[: m + 1]) / sum(shares) for m in range(len(shares))]
    middles = [chunk.start + chunk.length / 2 - schema.chunks[0].start for chunk in schema.chunks]
    owners = [next((m for m, b in enumerate(boundaries) if shares[m] > 0 and mid <= b),
                   max(m for m, share in enumerate(shares) if share > 0)) for mid in middles]
    assert [m for m, part in enumerate(parts) for _ in part] == owners


@given(shapes, st.integers(0, 2**32 - 1))
def test_flatten_and_unflatten_round_trip(tensor_shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=generator) for shape in tensor_shapes]
    schema = Schema.of([(f"t{i}", t) for i, t in enumerate(tensors)])
    flat = schema.flatten_into(tensors, torch.empty(schema.total))
    back = [torch.empty_like(t) for t in tensors]
    schema.unflatten_into(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


# ---- the int8 codec's error bound ----------------------------------------------------------------

values = st.floats(-2.0**100, 2.0**100, allow_nan=False, allow_subnormal=True, width=32)


@given(st.lists(values, min_size=0, max_size=300), st.integers(1, 64))
def test_int8_meets_its_stated_error_bound(items, block):
    """|x - decoded| <= max(absmax_block, 2^-100) / 254 + absmax_block * 2^-22 (int8.py's docstring)."""
    tensor = torch.tensor(items, dtype=torch.float32)
    codec = get_codec(f"int8:{block}")
    decoded = codec.decode(codec.encode(tensor)).reshape(-1)
    for start in range(0, len(items), block):
        original = tensor[start : start + block].double()
        absmax = float(original.abs().max())
        bound = max(absmax, 2.0**-100) / 254 + absmax * 2.0**-22
        assert float((original - decoded[start : start + block].double()).abs().max()) <= bound


@given(st.lists(values, min_size=1, max_size=50), st.sampled_from([math.nan, math.inf, -math.inf]), st.data())
def test_int8_refuses_nan_and_inf(items, bad, data):
    tensor = torch.tensor(items, dtype=torch.float32)
    tensor[data.draw(st.integers(0, len(items) - 1))] = bad
    with pytest.raises(CodecError):
        get_codec("int8").encode(tensor)


# ---- the other codecs' bounds and error feedback --------------------------------------------------

FP16_MAX, BF16_MAX = 65504.0, float(torch.finfo(torch.bfloat16).max)
wide_values = st.floats(-2.0**127, 2.0**127, allow_nan=False, allow_subnormal=True, width=32)


@given(st.lists(wide_values, max_size=300))
def test_fp16_meets_its_stated_bound_and_clamps_instead_of_overflowing(items):
    """|err| <= 2^-11 |x| + 2^-25 for |x| <= 65504; beyond, the value becomes +-65504 (cast.py)."""
    tensor = torch.tensor(items, dtype=torch.float32)
    decoded = get_codec("fp16").decode(get_codec("fp16").encode(tensor)).double()
    original = tensor.double()
    inside = original.abs() <= FP16_MAX
    assert ((original - decoded).abs()[inside] <= 2.0**-11 * original.abs()[inside] + 2.0**-25).all()
    assert torch.equal(decoded[~inside], original[~inside].sign() * FP16_MAX)


@given(st.lists(wide_values, max_size=300))
def test_bf16_meets_its_stated_bound(items):
    """|err| <= 2^-8 |x| + 2^-134 (cast.py), and never an inf: the range is fp32's."""
    tensor = torch.tensor(items, dtype=torch.float32)
    decoded = get_codec("bf16").decode(get_codec("bf16").encode(tensor)).double()
    original = tensor.double()
    assert torch.isfinite(decoded).all()
    below = original.abs() <= BF16_MAX
    assert ((original - decoded).abs()[below] <= 2.0**-8 * original.abs()[below] + 2.0**-134).all()
    assert (decoded[~below].abs() == BF16_MAX).all()


@given(st.lists(values, min_size=1, max_size=400), st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_k_largest_magnitudes_and_zeroes_the_rest(items, fraction):
    tensor = torch.tensor(items, dtype=torch.float32)
    codec = get_codec(f"topk:{fraction!r}")
    encoded = codec.encode(tensor)
    decoded = codec.decode(encoded)
    k = min(len(items), max(1, math.ceil(fraction * len(items))))
    kept = torch.zeros(len(items), dtype=torch.bool)
    kept[torch.frombuffer(bytearray(encoded.parts["idx"]), dtype=torch.int32).long()] = True
    assert int(kept.sum()) == k == encoded.meta["k"]
    assert torch.equal(decoded[kept], tensor[kept]) and not decoded[~kept].any()
    if not kept.all():  # no dropped element is larger than a kept one
        assert float(tensor[~kept].abs().max()) <= float(tensor[kept].abs().min())


@given(st.integers(2, 24), st.integers(2, 24), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_powersgd_is_a_projection_exact_on_low_rank_matrices(rows, cols, rank, seed):
    """decode = P P^T M with orthonormal P: never larger than M, and exactly M when rank(M) <= rank."""
    generator = torch.Generator().manual_seed(seed)
    codec = get_codec(f"powersgd:{rank}")
    matrix = torch.randn(rows, cols, generator=generator)
    decoded = codec.decode(codec.encode(matrix))
    if codec.matrix_dims((rows, cols)) is None:  # low rank would not be smaller: sent raw, exactly
        assert torch.equal(decoded, matrix)
        return
    assert float(decoded.norm()) <= float(matrix.norm()) * (1 + 1e-5)
    assert float((matrix - decoded).norm()) <= float(matrix.norm()) * (1 + 1e-5)
    low_rank = torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator)
    torch.testing.assert_close(codec.decode(codec.encode(low_rank)), low_rank, atol=1e-4 * float(low_rank.abs().max()), rtol=0)


def contraction(spec: str, numel: int) -> float:
    """sqrt(1 - delta) with ||C(x) - x||^2 <= (1 - delta) ||x||^2 for the codec."""
    if spec.startswith("topk"):
        return math.sqrt(1 - min(numel, max(1, math.ceil(0.01 * numel))) / numel)
    return {"fp16": 2.0**-11, "bf16": 2.0**-8, "int8:32": 1 / 254 * math.sqrt(32)}[spec]


moderate = st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=True, width=32)


@settings(max_examples=60)
@given(st.sampled_from(["fp16", "bf16", "int8:32", "topk"]), st.integers(1, 100),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]), st.integers(1, 8), st.data())
def test_error_feedback_delivers_every_update_and_its_residual_stays_bounded(spec, numel, dtype, rounds, data):
    """Over any updates u_t: sum(decoded_t) + e_T = sum(u_t) (feedback.py), and for a contractive
    codec (||C(x) - x|| <= c ||x||, c < 1) ||e_t|| <= c / (1 - c) * max ||u_s||, from
    ||e_t|| <= c (||u_t|| + ||e_t-1||)."""
    from swarmgrad.averaging.codecs import ErrorFeedback

    codec = get_codec(spec)
    feedback = ErrorFeedback(codec)
    updates = [torch.tensor(data.draw(st.lists(moderate, min_size=numel, max_size=numel))).to(dtype)
               for _ in range(rounds)]
    delivered = torch.zeros(numel, dtype=torch.float64)
    c = contraction(spec, numel)
    for t, update in enumerate(updates, 1):
        encoded = feedback.encode("w", update)
        assert encoded.dtype == str(dtype).removeprefix("torch.")
        delivered += codec.decode(encoded).double()
        feedback.commit()
        residual = feedback._residual["w"].double()
        sent = sum(u.double() for u in updates[:t])
        scale = max(float(u.double().norm()) for u in updates[:t])
        assert float((sent - delivered - residual).norm()) <= 1e-5 * (1 + t * scale)
        # the casts' additive term (subnormals) and fp32 rounding: far below any real residual
        assert float(residual.norm()) <= c / (1 - c) * scale * (1 + 1e-3) + numel**0.5 * 2.0**-24


# ---- the privacy budget --------------------------------------------------------------------------


@settings(max_examples=25)  # each epsilon is an RDP computation (milliseconds): fewer, longer cases
@given(st.floats(0.5, 4.0), st.floats(0.05, 1.0), st.floats(0.5, 12.0), st.integers(1, 8))
def test_epsilon_never_decreases_never_passes_the_limit_and_a_refusal_leaves_no_trace(noise, rate, limit, attempts):
    from swarmgrad.averaging.privacy import BudgetExhausted, PrivacyBudget

    budget = PrivacyBudget(noise, rate, 1e-5, limit)
    spent = [budget.epsilon]
    for _ in range(attempts):
        before = (budget.releases, budget.state_dict()["history"], budget.epsilon)
        try:
            budget.check()
        except BudgetExhausted:
            assert (budget.releases, budget.state_dict()["history"], budget.epsilon) == before
            assert budget.exhausted
            continue
        budget.commit()
        spent.append(budget.epsilon)
        assert budget.epsilon <= limit
    assert spent == sorted(spent) and budget.releases == len(spent) - 1


# ---- push-sum mass ------------------------------------------------------------------------------

operations = st.lists(st.tuples(st.sampled_from(["push", "lost push", "refused push", "merge"]),
                                st.integers(0, 2), st.integers(0, 2), st.floats(0.05, 0.95)), max_size=30)


@settings(max_examples=60)
@given(operations, st.integers(0, 2**32 - 1))
def test_push_sum_conserves_mass_for_any_sequence_of_pushes_and_merges(ops, seed):
    """The sum of w x over the peers and the pushes in flight never changes: a push gives away what
    arrives (even when the codec changed it on the way), a refused push is taken back, a merge only
    moves mass; a lost push loses exactly its share, never more (gossip.py's mass accounting)."""
    from test_gossip import lone_averager

    from swarmgrad.averaging.pushsum import Push

    generator = torch.Generator().manual_seed(seed)
    peers = [lone_averager(torch.randn(64, generator=generator), weight=float(i + 1)) for i in range(3)]
    in_flight: list[tuple[int, Push]] = []  # (receiver, push) not merged yet

    def mass() -> tuple[float, torch.Tensor]:
        weights = sum(p.weight for p in peers) + sum(push.weight for _, push in in_flight)
        total = sum(p.weight * p._values.double() for p in peers)
        return weights, total + sum(push.weight * push.values.double() for _, push in in_flight)

    weight0, total0 = mass()
    lost_weight, lost_total = 0.0, torch.zeros(64, dtype=torch.float64)
    for op, sender, receiver, fraction in ops:
        peer = peers[sender]
        if op == "merge":
            peer._pending = [push for who, push in in_flight if who == sender]
            in_flight = [(who, push) for who, push in in_flight if who != sender]
            peer._merge()
            continue
        given = peer.weight * fraction
        arrives = peer._values + 1e-3 * torch.randn(64, generator=generator)  # what a lossy codec delivers
        before = peer._give(given, arrives)
        if op == "push" and receiver != sender:
            in_flight.append((receiver, Push(given, arrives)))
        elif op == "refused push":
            peer._take_back(given, before)
        else:  # lost on the way (or pushed to itself, which the graph never does): its share is gone
            lost_weight += given
            lost_total += given * arrives.double()
    weight, total = mass()
    assert math.isclose(weight + lost_weight, weight0, rel_tol=1e-9)
    torch.testing.assert_close(total + lost_total, total0, rtol=1e-4, atol=1e-4)


# ---- signed records ------------------------------------------------------------------------------

@functools.cache
def _identity():
    from swarmgrad.dht.identity import Identity

    return Identity.generate()


@settings(max_examples=100)
@given(st.integers(0, 10**9), st.floats(0, 1e6), st.text(max_size=20), st.data())
def test_a_signed_record_altered_anywhere_is_refused(step, rate, run, data):
    """Flip any bit of a sealed presence record: it is refused (RecordError), or, if it still opens,
    nothing it says changed (records.py: the signature covers kind, key, subkey, expiry and body)."""
    import time

    from swarmgrad.dht.membership import MemberRecord, Progress
    from swarmgrad.dht.records import RecordError, open_envelope, seal

    body = MemberRecord(maddrs=[f"/ip4/127.0.0.1/tcp/{1 + step % 65535}"], role="peer", version="0.1.0", step=step,
                        samples_per_second=rate, updated_at=time.time(),
                        progress=Progress(epoch=step % 100, samples=step, steps=step % 7, steps_per_second=rate,
                                          settings=run))
    key, expires = f"swarmgrad/r{len(run)}/members", time.time() + 30
    envelope = bytearray(seal(_identity(), key, body, expires))
    original = open_envelope(bytes(envelope))
    position = data.draw(st.integers(0, len(envelope) - 1))
    envelope[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        opened = open_envelope(bytes(envelope))
    except RecordError:
        return
    assert (opened.key, opened.owner, opened.expires, opened.body) == \
        (original.key, original.owner, original.expires, original.body)
