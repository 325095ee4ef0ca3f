"""The chunk layout (averaging/layout.py) on hand-picked cases: which tensors keep a 2-D view,
where chunks are cut, how parts follow shares, what the schema digest covers. The properties
(every element in exactly one chunk, parts cover every chunk) are in test_properties.py."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.averaging.layout import (
    MIN_MATRIX_ELEMENTS,
    Chunk,
    Schema,
    TensorSpec,
    assign_parts,
    check_averager_name,
)
from swarmgrad.errors import ConfigError


def grid(*shapes: tuple[int, ...], limit: int = 1000) -> list[tuple[int, int, tuple[int, ...]]]:
    schema = Schema([TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(shapes)], limit)
    assert [chunk.index for chunk in schema.chunks] == list(range(len(schema.chunks)))
    return [(chunk.start, chunk.length, chunk.view) for chunk in schema.chunks]


def test_a_matrix_is_cut_into_whole_rows():
    assert grid((64, 64)) == [(row * 64, rows * 64, (rows, 64))
                              for row, rows in zip(range(0, 64, 15), [15, 15, 15, 15, 4])]


def test_a_matrix_of_exactly_the_minimum_size_keeps_its_rows_and_a_smaller_one_is_packed_flat():
    rows = MIN_MATRIX_ELEMENTS // 64
    assert grid((rows, 64), limit=1 << 20) == [(0, MIN_MATRIX_ELEMENTS, (rows, 64))]
    assert grid((rows - 1, 64), limit=1 << 20) == [(0, MIN_MATRIX_ELEMENTS - 64, (MIN_MATRIX_ELEMENTS - 64,))]


def test_rows_as_long_as_the_limit_go_one_per_chunk_and_longer_ones_flat():
    assert grid((5, 1000), limit=1000) == [(row * 1000, 1000, (1, 1000)) for row in range(5)]
    assert grid((5, 1001), limit=1000) == [(0, 1000, (1000,)), (1000, 1000, (1000,)), (2000, 1000, (1000,)),
                                           (3000, 1000, (1000,)), (4000, 1000, (1000,)), (5000, 5, (5,))]


def test_higher_dimensional_tensors_are_matrices_of_their_first_dim_and_vectors_stay_flat():
    assert grid((4, 32, 32), limit=2048) == [(0, 2048, (2, 1024)), (2048, 2048, (2, 1024))]
    assert grid((5000,), limit=2000) == [(0, 2000, (2000,)), (2000, 2000, (2000,)), (4000, 1000, (1000,))]


def test_small_tensors_are_packed_together_and_a_matrix_closes_the_pending_run():
    # 300 + 300 + 600 flat elements, then a matrix, then 10 more flat
    assert grid((300,), (300,), (600,), (64, 64), (10,)) == [
        (0, 1000, (1000,)), (1000, 200, (200,)),
        *[(1200 + row * 64, rows * 64, (rows, 64)) for row, rows in zip(range(0, 64, 15), [15, 15, 15, 15, 4])],
        (1200 + 4096, 10, (10,)),
    ]
    assert grid((0, 5), (3,)) == [(0, 3, (3,))]  # an empty tensor takes no room


def test_the_digest_covers_names_shapes_dtypes_and_the_chunk_size():
    base = Schema([TensorSpec("a", (2, 3), "float32")], 100)
    assert base.chunk_elements == 100 and base.total == 6
    assert len(base.digest) == 32 and int(base.digest, 16) >= 0
    assert Schema([TensorSpec("a", (2, 3), "float32")], 100).digest == base.digest
    for other in (Schema([TensorSpec("b", (2, 3), "float32")], 100), Schema([TensorSpec("a", (3, 2), "float32")], 100),
                  Schema([TensorSpec("a", (2, 3), "float16")], 100), Schema([TensorSpec("a", (2, 3), "float32")], 101)):
        assert other.digest != base.digest


def test_a_schema_of_tensors_records_their_names_shapes_and_dtypes():
    schema = Schema.of([("w", torch.zeros(4, 5)), ("b", torch.zeros(3, dtype=torch.float16))], chunk_elements=7)
    assert schema.specs == (TensorSpec("w", (4, 5), "float32"), TensorSpec("b", (3,), "float16"))
    assert schema.chunk_elements == 7 and max(chunk.length for chunk in schema.chunks) == 7
    assert schema.digest == Schema(schema.specs, 7).digest


def chunks_of(*lengths: int) -> list[Chunk]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [Chunk(i, start, length, (length,)) for i, (start, length) in enumerate(zip(starts, lengths))]


@pytest.mark.parametrize("lengths, shares, parts", [
    ((10,) * 10, [1, 1], [range(0, 5), range(5, 10)]),
    ((10,) * 10, [3, 1], [range(0, 8), range(8, 10)]),  # boundary 75: chunk 7's middle (75) goes left
    ((10,) * 10, [1, 3], [range(0, 3), range(3, 10)]),  # boundary 25: chunk 2's middle (25) is on it, goes left
    ((10,) * 10, [1, 0, 1], [range(0, 5), range(5, 5), range(5, 10)]),
    ((10,) * 10, [0, 1], [range(0, 0), range(0, 10)]),
    ((10,) * 10, [1, 1, 0], [range(0, 5), range(5, 10), range(10, 10)]),
    ((100, 10, 10, 10), [1, 1], [range(0, 1), range(1, 4)]),  # the big chunk's middle (50) is below 65
    ((10, 10, 100), [1, 1], [range(0, 2), range(2, 3)]),
    # more members than chunks: boundaries 6.7, 13.3, 20, 26.7, 33.3, 40 against middles 5, 15, 25, 35
    ((10,) * 4, [1, 1, 1, 1, 1, 1], [range(0, 1), range(1, 1), range(1, 2), range(2, 3), range(3, 3), range(3, 4)]),
])
def test_a_chunk_goes_to_the_member_whose_share_covers_its_middle(lengths, shares, parts):
    assert assign_parts(chunks_of(*lengths), shares) == parts


def test_parts_when_nobody_has_a_share_or_there_is_nothing_to_share():
    assert assign_parts(chunks_of(10, 10), [0, 0]) == [range(0), range(0)]
    assert assign_parts([], [1, 2]) == [range(0), range(0)]


@pytest.mark.parametrize("name", ["params", "delta_2", "A-b", "x" * 32])
def test_plain_averager_names_are_accepted(name):
    assert check_averager_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 33, "a b", "a/b", "é", 5, None])
def test_other_averager_names_are_refused_by_name(name):
    with pytest.raises(ConfigError, match=r"^averager name .*: use 1-32 letters, digits, '_' or '-'$"):
        check_averager_name(name)
