"""SGLang's DeepSeek-V4 compressor states (``CompressStatePool``), read as whole rings.

The oracle allocates and addresses them as SGLang does (``deepseek_v4_compress_state.py``):
``kv_score`` is ``[round_up(size + ring_size + 1, ratio), 2 * (1 + overlap) * head_dim]``
(online C128: ``3 * head_dim``, a ring of one row); C4's state of a token lives at
``translate_from_swa_loc_to_state_loc`` (``swa_loc // swa_page_size * ring_size + swa_loc %
ring_size``), C128's at ``translate_from_req_position_to_state_loc`` (``req * ring_size + pos
% ring_size``); HiCache's ``DeepSeekV4StateHostPool`` views the device state as its bytes
``[:rows // ring_size * ring_size]`` reshaped to ``[-1, ring_size * row bytes]``, a host page a
ring. It knows nothing of kvlayout's rows or runs; every byte outside the moved rings keeps its
value.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.integrations.sglang import DeepSeekV4PoolError, compress_state_rings, flashmla_kv_pages
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import BlockMapError, Shard, block_map

NL = 3
HEAD_DIM, INDEXER_HEAD_DIM = 512, 128  # qk_nope_head_dim + qk_rope_head_dim; indexer_head_dim


def state(size: int, ring: int, ratio: int, width: int, seed: int | None) -> list[torch.Tensor]:
    """``CompressStatePool(size, ring_size, ...).kv_score_buffer.kv_score`` of each layer."""
    rows = -(-(size + ring + 1) // ratio) * ratio
    if seed is None:
        return [torch.zeros(rows, width) for _ in range(NL)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=gen) for _ in range(NL)]


def swa_state_locs(swa_page: int, swa_page_size: int, ring: int) -> torch.Tensor:
    """The state rows of every token of SWA page ``swa_page`` (C4, separate KV)."""
    swa_loc = swa_page * swa_page_size + torch.arange(swa_page_size)
    return swa_loc // swa_page_size * ring + swa_loc % ring


def req_state_locs(req: int, ring: int, positions: int) -> torch.Tensor:
    """The state rows of request slot ``req``'s first ``positions`` positions (C128)."""
    return req * ring + torch.arange(positions) % ring


def untouched(dst: torch.Tensor, before: torch.Tensor, rows: torch.Tensor) -> bool:
    keep = torch.ones(dst.shape[0], dtype=torch.bool)
    keep[rows] = False
    return torch.equal(dst[keep], before[keep])


@pytest.mark.parametrize(("ring", "width"), [(8, 4 * HEAD_DIM), (16, 4 * INDEXER_HEAD_DIM)])
def test_c4_rings_move_by_swa_page(ring: int, width: int) -> None:
    """C4 (attention's or the indexer's; 16 rows under speculative decoding): a ring is an
    SWA page's, block id the SWA page index get_state_buf_infos moves."""
    swa_page_size, pages = 128, 6
    src, dst = state(pages * ring, ring, 4, width, 1), state(pages * ring, ring, 4, width, None)
    before = [t.clone() for t in dst]
    moves = [(4, 1), (0, 5), (2, 2)]
    m = block_map(
        compress_state_rings(src, ring),
        compress_state_rings(dst, ring),
        [s for s, _ in moves],
        [d for _, d in moves],
    )
    assert m.kind == "same layout" and m.num_tokens == 3 * ring
    m.copy()
    for layer in range(NL):
        written = []
        for s, d in moves:
            s_rows = swa_state_locs(s, swa_page_size, ring)
            d_rows = swa_state_locs(d, swa_page_size, ring)
            assert torch.equal(dst[layer][d_rows], src[layer][s_rows]), (layer, s, d)
            written.append(d_rows)
        assert untouched(dst[layer], before[layer], torch.cat(written))


@pytest.mark.parametrize("ring", [128, 256])
def test_c128_rings_move_by_request_slot(ring: int) -> None:
    """C128 (offline): a request slot's raw-token ring; 256 rows under speculative decoding."""
    slots = 4
    src, dst = (
        state(slots * ring, ring, 128, 2 * HEAD_DIM, 2),
        state(slots * ring, ring, 128, 2 * HEAD_DIM, None),
    )
    block_map(compress_state_rings(src, ring), compress_state_rings(dst, ring), [3, 1], [0, 2]).copy()
    for layer in range(NL):
        for s, d in ((3, 0), (1, 2)):
            assert torch.equal(
                dst[layer][req_state_locs(d, ring, 3 * ring)], src[layer][req_state_locs(s, ring, 3 * ring)]
            )
        assert not dst[layer][req_state_locs(1, ring, ring)].any() and not dst[layer][4 * ring :].any()


def c128_pd_page(req: int, seq_len: int, ring: int) -> int:
    """disaggregation/utils.py get_dsv4_c128_state_indices (offline): the 128-row page of
    the ring that holds the open compression window, the item P/D moves."""
    return req * (ring // 128) + ((seq_len - 1) % ring) // 128


def test_speculative_c128_rings_read_in_sglangs_pd_pages() -> None:
    """Under speculative decoding C128's ring is 256 rows, but SGLang's P/D moves it by pages
    of 128 (get_request_state_buf_infos' item; get_dsv4_c128_state_indices): read at
    ring_size=128, block ids are those pages."""
    ring, slots = 256, 3
    src, dst = (
        state(slots * ring, ring, 128, 2 * HEAD_DIM, 8),
        state(slots * ring, ring, 128, 2 * HEAD_DIM, None),
    )
    src_req, dst_req, seq_len = 2, 0, 3 * 128 + 5  # the window of positions 384..388: the ring's second half
    page_of_src, page_of_dst = c128_pd_page(src_req, seq_len, ring), c128_pd_page(dst_req, seq_len, ring)
    block_map(
        compress_state_rings(src, 128), compress_state_rings(dst, 128), [page_of_src], [page_of_dst]
    ).copy()
    window = torch.arange(seq_len - seq_len % 128, seq_len)
    for layer in range(NL):
        s_rows, d_rows = src_req * ring + window % ring, dst_req * ring + window % ring
        assert torch.equal(dst[layer][d_rows], src[layer][s_rows])
        assert untouched(dst[layer], torch.zeros_like(dst[layer]), dst_req * ring + 128 + torch.arange(128))


def test_online_c128_state_is_a_row_a_request() -> None:
    """Online C128: ring_size 1, a slot's (max, sum, kv) row of 3 * head_dim; MTP banks after
    the committed rows are rows too (get_request_state_buf_infos moves bank 0's)."""
    slots, banks = 5, 2
    rows = (slots + 2) * banks
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(rows, 3 * HEAD_DIM, generator=gen) for _ in range(NL)]
    dst = [torch.zeros(rows, 3 * HEAD_DIM) for _ in range(NL)]
    block_map(compress_state_rings(src, 1), compress_state_rings(dst, 1), [4], [1]).copy()
    for layer in range(NL):
        assert torch.equal(dst[layer][1], src[layer][4]) and not dst[layer][[0, *range(2, rows)]].any()


def host_view(kv_score: torch.Tensor, ring: int) -> torch.Tensor:
    """DeepSeekV4StateHostPool._init_device_page_views: the device's rings as byte pages."""
    raw = kv_score.view(torch.uint8).reshape(kv_score.shape[0], -1)
    return raw[: kv_score.shape[0] // ring * ring].reshape(-1, ring * raw.shape[1])


def test_rings_move_to_and_from_hicache_host_pages() -> None:
    """HiCache's host pool of compressor states: uint8 [pages, ring_size * row bytes] per layer."""
    ring, width, pages = 8, 4 * HEAD_DIM, 6
    dev = state(pages * ring, ring, 4, width, 4)
    host = [torch.zeros(4, ring * width * 4, dtype=torch.uint8) for _ in range(NL)]
    device, hosted = compress_state_rings(dev, ring), compress_state_rings(host, ring)
    block_map(device, hosted, [5, 2], [0, 3]).copy()
    for layer in range(NL):
        assert torch.equal(host[layer][0], host_view(dev[layer], ring)[5])
        assert torch.equal(host[layer][3], host_view(dev[layer], ring)[2])
        assert not host[layer][[1, 2]].any()
    back = state(pages * ring, ring, 4, width, None)
    block_map(hosted, compress_state_rings(back, ring), [3], [1]).copy()
    assert torch.equal(back[2][swa_state_locs(1, 128, ring)], dev[2][swa_state_locs(2, 128, ring)])


def pools(kv: list[torch.Tensor], ring: int | None) -> list[Any]:
    """CompressStatePool as SGLang holds it (compress_state_pools' entries of one ratio)."""
    return [SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=t), ring_size=ring) for t in kv]


def test_pools_say_their_ring_size() -> None:
    src, dst = state(48, 16, 4, 4 * INDEXER_HEAD_DIM, 5), state(48, 16, 4, 4 * INDEXER_HEAD_DIM, None)
    reg = compress_state_rings(pools(src, 16))
    assert reg.only_group().block_size == 16
    block_map(reg, compress_state_rings(pools(dst, 16), 16), [2], [0]).copy()
    assert torch.equal(dst[1][:16], src[1][32:48])


def test_ring_size_is_any_integer_but_a_bool() -> None:
    """A connector may read the ring size from SGLang's pool or config as a NumPy or torch int."""
    kv = state(32, 8, 4, 4 * HEAD_DIM, None)
    for ring in (np.int64(8), torch.tensor(8)):
        assert compress_state_rings(kv, ring).only_group().block_size == 8  # type: ignore[arg-type]
    assert compress_state_rings(pools(kv, np.int64(8))).only_group().block_size == 8  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ranks",
    [(Shard(0, 1, 1), Shard(1, 2, 1)), (Shard(3, 4, 1), Shard(0, 8, 1)), (Shard(0, 2, 2), Shard(1, 2, 2))],
    ids=str,
)
def test_every_rank_holds_the_states_whole(ranks: tuple[Shard, Shard]) -> None:
    """The compressor's wkv_gate is a ReplicatedLinear of 2 * coff * head_dim: each rank's
    state is the whole one, whatever the shards say of the model's KV heads."""
    src, dst = state(32, 8, 4, 4 * HEAD_DIM, 6), state(32, 8, 4, 4 * HEAD_DIM, None)
    block_map(
        compress_state_rings(src, 8),
        compress_state_rings(dst, 8),
        [1],
        [3],
        src_shard=ranks[0],
        dst_shard=ranks[1],
    ).copy()
    assert torch.equal(dst[0][24:32], src[0][8:16]) and not dst[0][:24].any()


def test_a_description_round_trips_and_maps_as_the_registration() -> None:
    src, dst = state(32, 8, 4, 4 * HEAD_DIM, 7), state(32, 8, 4, 4 * HEAD_DIM, None)
    a, b = compress_state_rings(src, 8), compress_state_rings(dst, 8)
    peer = RegistrationDescription.from_json(b.describe().to_json())
    assert block_map(a, peer, [1, 2], [3, 0]).num_bytes == block_map(a, b, [1, 2], [3, 0]).num_bytes


def refusal(src: Any, dst: Any) -> str:
    with pytest.raises(BlockMapError) as info:
        block_map(src, dst, [0], [0])
    return str(info.value)


def test_maps_between_other_states_are_refused() -> None:
    c4 = compress_state_rings(state(32, 8, 4, 4 * HEAD_DIM, None), 8)
    c4_spec = compress_state_rings(state(32, 16, 4, 4 * HEAD_DIM, None), 16)
    indexer = compress_state_rings(state(32, 8, 4, 4 * INDEXER_HEAD_DIM, None), 8)
    c128 = compress_state_rings(state(256, 128, 128, 2 * HEAD_DIM, None), 128)
    assert "blocks of 8 and 16 rows" in refusal(c4, c4_spec)
    for other in (indexer, c128):
        assert "do not hold the same state" in refusal(c4, other) or "blocks of" in refusal(c4, other)
    # a FlashMLA KV page is no state, though a V4.1 page of 16 slots (8704 bytes) is also 16 rows of 544
    kv = flashmla_kv_pages([torch.zeros(4, 8704, dtype=torch.uint8) for _ in range(NL)], 16)
    ring = compress_state_rings([torch.zeros(4, 8704, dtype=torch.uint8) for _ in range(NL)], 16)
    assert "do not hold the same state" in refusal(kv, ring)


def test_refuses_what_is_no_compressor_state() -> None:
    good = state(32, 8, 4, 4 * HEAD_DIM, None)
    cases: list[tuple[Any, Any, str]] = [
        (good, None, "ring_size must be a positive int (the pool's ring_size"),
        (good, 0, "ring_size must be a positive int"),
        (good, True, "ring_size must be a positive int"),
        (good[0], 8, "states is Tensor, not a non-empty list of per-layer tensors"),
        ([], 8, "states is list, not a non-empty list"),
        ([t.to(torch.int32) for t in good], 8, "is [44, 2048] torch.int32, not a compressor state"),
        ([t.view(44, 2, -1) for t in good], 8, "is [44, 2, 1024] torch.float32, not a compressor state"),
        (good, 45, "no whole ring of ring_size=45 rows"),
        ([torch.zeros(0, 64, dtype=torch.uint8)], 8, "states[0] is [0, 64]: it holds no rings"),
        (
            [torch.zeros(4, 100, dtype=torch.uint8)],
            8,
            "a host page of 100 bytes, which is no ring of ring_size=8 equal rows",
        ),
        ([torch.zeros(40, 4096)[:, ::2]], 8, "is not contiguous pages, one after another"),
        ([*pools(good, 8)[:2], None], None, "states[2] is NoneType, not a CompressStatePool"),
        (pools(good, None), None, "states[0] is SimpleNamespace, not a CompressStatePool"),  # no ring_size
        ([*pools(good, 8)[:2], *pools(good, 16)[:1]], None, "the pools' rings are of [8, 16] rows"),
        (pools(good, 8), 16, "ring_size=16, but the pools' rings are of 8 rows"),
    ]
    for states, ring, message in cases:
        with pytest.raises(DeepSeekV4PoolError, match=re.escape(message)):
            compress_state_rings(states, ring)


def test_detect_names_the_reading() -> None:
    """A compressor state's ring size is the pool's (get_compress_state_ring_size), not its
    tensor's: detect refuses it, naming compress_state_rings."""
    for states in (
        state(32, 8, 4, 4 * HEAD_DIM, None),
        state(256, 128, 128, 2 * HEAD_DIM, None),
        [torch.zeros(4, 8 * 4 * HEAD_DIM * 4, dtype=torch.uint8) for _ in range(NL)],  # host pages
    ):
        with pytest.raises(
            kvlayout.DetectionError, match=re.escape("compress_state_rings(states, ring_size)")
        ):
            kvlayout.detect(states, "sglang")


def pair_ring_size(num_draft_tokens: int | None) -> int:
    """get_compress_state_ring_size(2, ...): a pair's two positions, or under speculative
    decoding the power of two past 1 + the drafts."""
    return 2 if num_draft_tokens is None else 1 << (num_draft_tokens + 1).bit_length()


@pytest.mark.parametrize("drafts", [None, 3])
def test_v41_pair_rings_move_by_request_slot(drafts: int | None) -> None:
    """V4.1's ratio-2 pending-pair state (_make_pair_state_pool: CompressStatePool(size=
    num_req_slots * ring_size, ratio=2, overlap=False, head_dim=512, float32,
    request_scoped=True)): a request slot's ring of ring_size rows of (kv, score), which
    get_request_state_buf_infos moves whole (item t[0].nbytes * ring_size). Its pools say
    their ring size; block ids are request slots."""
    ring, slots = pair_ring_size(drafts), 4
    src, dst = (
        state(slots * ring, ring, 2, 2 * HEAD_DIM, 11),
        state(slots * ring, ring, 2, 2 * HEAD_DIM, None),
    )
    assert src[0].shape[0] == -(-(slots * ring + ring + 1) // 2) * 2
    m = block_map(
        compress_state_rings(pools(src, ring)), compress_state_rings(pools(dst, ring)), [3, 0], [1, 2]
    )
    assert m.num_bytes == NL * 2 * src[0][0].nbytes * ring  # two of SGLang's items a layer
    m.copy()
    seq_len = 9  # positions 0..8: the ring holds the latest ring_size of them
    for layer in range(NL):
        for s, d in ((3, 1), (0, 2)):
            assert torch.equal(
                dst[layer][req_state_locs(d, ring, seq_len)], src[layer][req_state_locs(s, ring, seq_len)]
            )
        assert untouched(dst[layer], torch.zeros_like(dst[layer]), torch.arange(ring, 3 * ring))


def test_pair_rings_map_to_no_other_state() -> None:
    pair = compress_state_rings(state(16, 2, 2, 2 * HEAD_DIM, None), 2)
    c4 = compress_state_rings(state(32, 8, 4, 4 * HEAD_DIM, None), 8)
    online_c128 = compress_state_rings([torch.zeros(12, 3 * HEAD_DIM) for _ in range(NL)], 1)
    assert "blocks of 2 and 8 rows" in refusal(pair, c4)
    assert "blocks of 2 and 1 rows" in refusal(pair, online_c128)


def test_freed_buffers_and_a_layout_that_is_no_name_are_refused_by_name() -> None:
    """A shut-down pool's freed buffers, and a layout= of another type, are DeepSeekV4PoolErrors."""
    states = [torch.zeros(16, 8) for _ in range(2)]
    states[1].untyped_storage().resize_(0)
    with pytest.raises(
        DeepSeekV4PoolError, match=r"states\[1\] \[16, 8\] has no memory: its storage holds 0"
    ):
        compress_state_rings(states, 4)
    pages = [torch.zeros(4, 1024, dtype=torch.uint8)]
    pages[0].untyped_storage().resize_(0)
    with pytest.raises(DeepSeekV4PoolError, match=r"kv_buffer\[0\] \[4, 1024\] has no memory"):
        flashmla_kv_pages(pages, 1, "v41")
    for layout in (["v41"], 4, "V41"):
        with pytest.raises(
            DeepSeekV4PoolError, match=r"layout=.* is no FlashMLA page layout: one of v4, v41"
        ):
            flashmla_kv_pages([torch.zeros(4, 1024, dtype=torch.uint8)], 1, layout)  # type: ignore[arg-type]
