"""Token rows with a one-token block axis, read in the engine's blocks by ``tokens_per_block``.

Two real registrations hand a connector their cache as token rows: ATOM's model runner
views an MLA layer as ``[NB*BS, 1, 576]`` (what its own connectors get), and SGLang's
Ascend pool under ``ASCEND_USE_FIA=1`` registers per-layer views ``[NB*BS, 1, NH, HS]``
as K and V lists. Without the hint they read as blocks of one token (block id = token
row); with it, as the engine's blocks, which the hint said before was a contradiction.
"""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import block_map
from kvlayout.types import LayoutHintError

NB, BS = 8, 16


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_atom_mla_token_rows_read_in_atom_s_blocks() -> None:
    src_kv = [_random(NB * BS, 1, 576, seed=i) for i in range(3)]
    dst_kv = [torch.zeros(NB * BS, 1, 576, dtype=torch.bfloat16) for _ in range(3)]
    hints = {"tokens_per_block": BS}
    src, dst = kvlayout.detect(src_kv, "atom", hints), kvlayout.detect(dst_kv, "atom", hints)
    group = src.kernel_groups[0]
    assert (group.format, group.block_size, group.num_blocks) == (F.NL_X_NB_BS_HS, BS, NB)
    assert group.layer_ptrs(0) == [src_kv[0].data_ptr()]  # a view of the registered rows
    m = block_map(src, dst, [5, 2], [1, 6], num_tokens=20)  # a partly filled last block
    m.copy()
    for s, d in zip(src_kv, dst_kv, strict=True):
        assert torch.equal(d[1 * BS : 2 * BS], s[5 * BS : 6 * BS])
        assert torch.equal(d[6 * BS : 6 * BS + 4], s[2 * BS : 2 * BS + 4])
        assert int(d.count_nonzero()) == 20 * 576  # no other row written
    # without the hint: blocks of one token, what the shape alone says
    assert kvlayout.detect(src_kv, "atom").kernel_groups[0].block_size == 1


def test_sglang_ascend_fia_pool_reads_in_pages() -> None:
    """``NPUMHATokenToKVPool`` with ``ASCEND_USE_FIA=1``: ``k_buffer[i].view(-1, 1, H, D)``
    over ``[pages + 1, ps, H, D]`` per layer (SGLang's padding page included)."""
    layers, pages, ps, heads, dim = 3, 4, 16, 2, 64

    def pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        k = _random(layers, pages + 1, ps, heads, dim, seed=seed)
        v = _random(layers, pages + 1, ps, heads, dim, seed=seed + 1)
        return [k[i].view(-1, 1, heads, dim) for i in range(layers)], [
            v[i].view(-1, 1, heads, dim) for i in range(layers)
        ]

    (sk, sv), (dk, dv) = pool(1), pool(3)
    hints = {"kv_list_layout": "k_v", "tokens_per_block": ps}
    src, dst = kvlayout.detect(sk + sv, "sglang", hints), kvlayout.detect(dk + dv, "sglang", hints)
    group = src.kernel_groups[0]
    assert (group.format, group.block_size, group.num_blocks) == (F.TWO_X_NL_X_NB_BS_NH_HS, ps, pages + 1)
    expected = [t.clone() for t in dk + dv]
    for s, e in zip(sk + sv, expected, strict=True):
        e[2 * ps : 3 * ps] = s[4 * ps : 5 * ps]
        e[0 : ps // 2] = s[1 * ps : 1 * ps + ps // 2]
    block_map(src, dst, [4, 1], [2, 0], num_tokens=ps + ps // 2).copy()
    assert all(torch.equal(d, e) for d, e in zip(dk + dv, expected, strict=True))


def test_token_rows_that_do_not_split_into_blocks_are_refused() -> None:
    kv = [torch.zeros(40, 1, 576, dtype=torch.bfloat16) for _ in range(2)]  # ATOM KV is bf16 or fp8
    with pytest.raises(
        LayoutHintError,
        match=r"^ATOM: \(40, 1, 576\) is token rows \(a one-token block axis in NL_X_NB_BS_HS\), and its 40 "
        r"token rows are not divisible by tokens_per_block=16 \(kv_caches\[0\]: shape \(40, 1, 576\)",
    ):
        kvlayout.detect(kv, "atom", {"tokens_per_block": 16})
    # ATOM's MP connector registers a block as one row of its bytes: the rows are blocks, not tokens
    # (or its DSA indexer's one-token pages, which ATOM's detector names a reader for)
    with pytest.raises(LayoutHintError, match=r"tokens_per_block=16 contradicts rows of bytes \[N, 1, W\]"):
        kvlayout.detect([torch.zeros(64, 1, 16 * 1152, dtype=torch.uint8)], "atom", {"tokens_per_block": 16})
    # blocks of more than one token keep contradicting another block size
    with pytest.raises(
        LayoutHintError, match=r"tokens_per_block=16 contradicts NL_X_NB_BS_HS, whose BS is 8"
    ):
        kvlayout.detect([torch.zeros(5, 8, 576, dtype=torch.bfloat16)], "atom", {"tokens_per_block": 16})


def test_sglang_fia_pools_of_fp8_bytes_and_of_two_head_sizes_read_in_pages() -> None:
    """SGLang stores an fp8 pool as uint8 (a head axis says these are token rows, not a
    block's bytes), and MiMo-V2's K and V heads differ (two kernel groups)."""
    pages, ps = 4, 16

    def views(heads: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
        pool = torch.zeros(2, pages + 1, ps, heads, dim, dtype=dtype)
        return [pool[i].view(-1, 1, heads, dim) for i in range(2)]

    hints = {"kv_list_layout": "k_v", "tokens_per_block": ps}
    fp8 = kvlayout.detect(views(2, 64, torch.uint8) + views(2, 64, torch.uint8), "sglang", hints)
    assert [(g.block_size, g.num_blocks) for g in fp8.kernel_groups] == [(ps, pages + 1)]
    mixed = kvlayout.detect(views(2, 192, torch.bfloat16) + views(2, 128, torch.bfloat16), "sglang", hints)
    assert [(g.layers, g.block_size, g.num_blocks) for g in mixed.kernel_groups] == [
        ((0, 1), ps, pages + 1),
        ((2, 3), ps, pages + 1),
    ]
