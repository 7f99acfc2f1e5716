"""MAX's recurrent state pool (``RecurrentStateBuffer``, ``cache_params.py``): per state
leaf, ``[num_blocks, bytes_per_page]`` uint8 pages a device, one request's whole state a
block (``RecurrentStateRegion.rows_of(page)``: the page's ``num_layers`` rows of
``row_shape``). ``to_memory()`` hands them to MAX's transfer engine and host tier, which
copy a page whole; kvlayout reads them so, by MAX's block ids."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import kvlayout
from kvlayout.integrations.max import RecurrentStateError, recurrent_state_pages
from kvlayout.transfer import BlockMapError, block_map

NUM_LAYERS, ROW_SHAPE = 3, (2, 4, 4)  # RecurrentStateRegion: layers of a leaf, one layer's state a device
BLOCKS = 6


def _pool(seed: int, tp: int = 2) -> SimpleNamespace:
    """A RecurrentStateBuffer as MAX builds it: each leaf's float32 state rows
    ``[num_blocks * num_layers, *row_shape]`` a device, viewed as ``[num_blocks,
    bytes_per_page]`` uint8 pages (``bytes_per_page = num_layers * row_elements * 4``)."""
    g = torch.Generator().manual_seed(seed)
    rows = {
        leaf: [torch.randn(BLOCKS * NUM_LAYERS, *ROW_SHAPE, generator=g) for _ in range(tp)]
        for leaf in ("linear/state", "linear/conv")
    }
    pages = {leaf: [r.view(torch.uint8).view(BLOCKS, -1) for r in per] for leaf, per in rows.items()}
    return SimpleNamespace(pages=pages, rows=rows)


def _rows_of(page: int) -> range:
    """``RecurrentStateRegion.rows_of``: the rows a page's layers occupy."""
    return range(page * NUM_LAYERS, (page + 1) * NUM_LAYERS)


@pytest.mark.parametrize("device", [0, 1])
def test_a_requests_state_moves_whole_between_replicas(device: int) -> None:
    """Block 4's state of every leaf into block 1 of another replica's pool, device by
    device: each layer's state row lands where MAX reads it, nothing else is written."""
    src, dst = _pool(1), _pool(2)
    for rows in dst.rows.values():
        for r in rows:
            r.zero_()
    a, b = recurrent_state_pages(src, device), recurrent_state_pages(dst, device)
    assert sorted(a) == ["linear/conv", "linear/state"]
    for leaf in a:
        assert block_map(a[leaf], b[leaf], [4], [1]).copy() == 1
        got, want = dst.rows[leaf][device], src.rows[leaf][device]
        assert torch.equal(got[list(_rows_of(1))], want[list(_rows_of(4))])
        others = [i for i in range(BLOCKS * NUM_LAYERS) if i not in _rows_of(1)]
        assert not got[others].any()
        assert not dst.rows[leaf][1 - device].any()  # the other device is its own registration


def test_pages_are_the_buffer_maxs_transfer_engine_copies() -> None:
    """A map between two pools of one geometry is one run a block, ``base + block *
    bytes_per_page``: MAX's own descriptor for the page."""
    src, dst = _pool(3), _pool(4)
    a = recurrent_state_pages(src)["linear/state"]
    b = recurrent_state_pages(dst)["linear/state"]
    m = block_map(a, b, [2, 5], [0, 3])
    s, d = src.pages["linear/state"][0], dst.pages["linear/state"][0]
    bpp = s.shape[1]
    runs = [(int(x) - s.data_ptr(), int(y) - d.data_ptr(), int(n)) for x, y, n in m.runs]
    assert runs == [(2 * bpp, 0, bpp), (5 * bpp, 3 * bpp, bpp)]


def test_pages_map_only_to_pages_of_the_same_leaf() -> None:
    pool = _pool(5)
    regs = recurrent_state_pages(pool)
    other = SimpleNamespace(pages={"linear/state": [torch.zeros(BLOCKS, 2 * 96, dtype=torch.uint8)]})
    with pytest.raises(BlockMapError):  # another size
        block_map(regs["linear/state"], recurrent_state_pages(other)["linear/state"], [0], [0])
    with pytest.raises(BlockMapError):  # the same size, another state
        block_map(regs["linear/state"], regs["linear/conv"], [0], [0])


def test_the_detector_points_byte_pages_to_this_reader() -> None:
    pool = _pool(6)
    with pytest.raises(
        kvlayout.DetectionError, match=re.escape("kvlayout.integrations.max.recurrent_state_pages")
    ):
        kvlayout.detect(pool.pages["linear/state"][0], "max")


def test_what_is_no_recurrent_state_buffer_is_refused_by_name() -> None:
    with pytest.raises(RecurrentStateError, match="SimpleNamespace is not a RecurrentStateBuffer"):
        recurrent_state_pages(SimpleNamespace(pages=[]))
    pool = _pool(7, tp=1)
    with pytest.raises(
        RecurrentStateError, match=re.escape("pages['linear/state'] holds no device 1 (it holds 1)")
    ):
        recurrent_state_pages(pool, 1)
    bad = SimpleNamespace(pages={"s": [torch.zeros(6, 8, dtype=torch.float32)]})
    with pytest.raises(
        RecurrentStateError,
        match=re.escape("RecurrentStateBuffer.pages['s'][0] is [6, 8] torch.float32, not MAX's [num_blocks"),
    ):
        recurrent_state_pages(bad)
    with pytest.raises(RecurrentStateError, match="device must be a non-negative int"):
        recurrent_state_pages(pool, -1)
    for shape in [(0, 64), (6, 0)]:  # no pages, or pages of no bytes: nothing MAX allocates
        empty = SimpleNamespace(pages={"s": [torch.zeros(shape, dtype=torch.uint8)]})
        with pytest.raises(
            RecurrentStateError, match=re.escape(f"pages['s'][0] is {list(shape)} torch.uint8")
        ):
            recurrent_state_pages(empty)


def test_a_dlpack_buffer_is_read_in_place() -> None:
    """MAX's pages are ``max.driver.Buffer``s: any DLPack producer (numpy here) is read as
    the memory it is, not a copy."""
    np = pytest.importorskip("numpy")
    pages = np.zeros((BLOCKS, 64), dtype=np.uint8)
    reg = recurrent_state_pages(SimpleNamespace(pages={"s": [pages]}))["s"]
    src = torch.arange(BLOCKS * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(BLOCKS, 64)
    assert (
        block_map(recurrent_state_pages(SimpleNamespace(pages={"s": [src]}))["s"], reg, [3], [2]).copy() == 1
    )
    assert (pages[2] == src[3].numpy()).all() and not pages[[0, 1, 3, 4, 5]].any()
