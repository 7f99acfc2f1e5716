"""The C++ side agrees with the Python side: the format table, and every offset."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat, _native
from kvlayout._generated.formats import SIZE_SYMBOLS
from kvlayout.layout.algebra import COORD_FIELDS, Coord, offset, resolve_sizes, tensor_index
from kvlayout.layout.ast import FACTS
from kvlayout.testing.strategies import coords_for, fixed_sizes, sizes_for
from tests.layout.test_algebra import all_coords, leaf


def native_sizes(layout: kvlayout.Layout, sizes: dict[str, int]) -> list[int]:
    resolved = resolve_sizes(layout, sizes)
    return [resolved.get(symbol, sizes.get(symbol, 0)) for symbol in SIZE_SYMBOLS]


def test_format_table_matches_python() -> None:
    rows = _native.format_table()
    assert [r["value"] for r in rows] == [int(f) for f in EngineKVFormat]
    for row in rows:
        fmt = EngineKVFormat(row["value"])
        layout = kvlayout.layout_of(fmt)
        assert row["name"] == fmt.name
        assert row["shape"] == layout.describe_shape()
        assert row["kv_size"] == (layout.kv_size or 0)  # 0: read from the registration
        assert row["list_depth"] == layout.list_depth
        assert row["deprecated"] == (kvlayout.catalog.registry.format_info(fmt).replaced_by is not None)
        assert {k: row[k] for k in FACTS} == {k: getattr(layout, k) for k in FACTS}
        assert set(row) == {"value", "name", "shape", "kv_size", "list_depth", "deprecated", *FACTS}


def test_size_fields_match_python() -> None:
    assert tuple(_native.size_fields()) == SIZE_SYMBOLS


@given(st.data())
def test_cpp_indexer_equals_oracle_equals_torch(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(list(EngineKVFormat)))
    layout = kvlayout.layout_of(fmt)
    sizes = data.draw(sizes_for(layout, max_side=6))
    pad = data.draw(st.integers(0, 5)) if layout.has_leading_block_axis else 0
    t = leaf(layout, sizes, pad)
    block_stride = t.stride(0) if pad else 0
    coord = data.draw(coords_for(layout, sizes))
    expected = offset(layout, coord, sizes, block_stride or None)
    got = _native.locate(
        int(fmt), native_sizes(layout, sizes), block_stride, tuple(coord.get(f) for f in COORD_FIELDS)
    )
    ptr, index = tensor_index(layout, coord, sizes)
    assert got == expected == (ptr, sum(i * s for i, s in zip(index, t.stride(), strict=True)))


@pytest.mark.parametrize("fmt", list(EngineKVFormat), ids=lambda f: f.name)
def test_cpp_indexer_on_every_coordinate(fmt: EngineKVFormat) -> None:
    layout = kvlayout.layout_of(fmt)
    sizes = fixed_sizes(layout)
    coords = all_coords(layout, sizes)
    array = np.array([[c.get(f) for f in COORD_FIELDS] for c in coords], dtype=np.int64)
    got = _native.locate_many(int(fmt), native_sizes(layout, sizes), 0, array)
    assert [tuple(r) for r in got.tolist()] == [offset(layout, c, sizes) for c in coords]


def test_native_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown engine KV format value 99"):
        _native.locate(99, [1] * len(SIZE_SYMBOLS), 0, (0, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match=f"expected {len(SIZE_SYMBOLS)} sizes"):
        _native.locate(1, [1, 2], 0, (0, 0, 0, 0, 0, 0))


def test_coord_fields_are_the_cpp_coord() -> None:
    assert tuple(f for f in Coord.__dataclass_fields__) == COORD_FIELDS
