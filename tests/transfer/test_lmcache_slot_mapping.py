"""LMCache's in-process moves by slot mapping, done as docs/migrating-from-lmcache.md says
(a block map of the kernel group and the chunk given the slot mapping), held to
LMCache 0.5.6's own chunk layout and slot indexing (lmcache-0.5.6-facts.md 7.1, 7.5): token
``t`` of a chunk ``[kv_size, NL, T, row]`` is slot ``slot_mapping[t]`` (block ``s // BS``,
row ``s % BS``), a slot of -1 is skipped both ways, and each engine's element of a token
row is read through the tensors as the engine registers them (facts 7.2, "engine element").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.transfer import TransferError, block_map, prepare
from kvlayout.transfer.block_maps import BlockMapError, chunk_shape_for, chunk_side

NL, NB, BS, NH, HS, LATENT = 3, 24, 4, 2, 8, 24
TOKENS, CHUNK = 22, 8  # chunks of 8, 8 and 6 tokens; the last block holds 2 of its 4
STORE_TABLE, LOAD_TABLE = [17, 3, 9, 0, 22, 5], [2, 11, 19, 7, 14, 20]
MASKED = {0, 1, 2, 3, 4, 13, 14}  # a stored prefix cutting block 1, and a hole inside block 3
SENTINEL = -7.0

Row = Callable[[Any, int, int, int, int], torch.Tensor]  # (kv, layer, k_or_v, block, row) -> view
Fill = Callable[..., torch.Tensor]


def _fused_row(kv: Any, layer: int, k: int, b: int, j: int) -> torch.Tensor:
    heads: torch.Tensor = kv[layer][b, :, j]  # vLLM 0.33's view [NB, NH, BS, 2*HS]: packed K|V rows
    return heads


# name, engine, hints, LMCache's format (-1: LMCache refuses it), the registration, row, kv_size, width
CASES: list[tuple[str, str, dict[str, Any], int, Callable[[Fill], Any], Row, int, int]] = [
    ("flash-attn NHD", "vllm", {"kv_layout": "NHD"}, 1,
     lambda f: [f(2, NB, BS, NH, HS) for _ in range(NL)], lambda kv, n, k, b, j: kv[n][k, b, j], 2, NH * HS),
    ("flash-infer NHD", "vllm", {"kv_layout": "NHD"}, 2,
     lambda f: [f(NB, 2, BS, NH, HS) for _ in range(NL)], lambda kv, n, k, b, j: kv[n][b, k, j], 2, NH * HS),
    # vLLM allocates HND memory and registers the NHD-shaped view of it
    ("flash-attn HND", "vllm", {"kv_layout": "HND"}, 6,
     lambda f: [f(2, NB, NH, BS, HS).permute(0, 1, 3, 2, 4) for _ in range(NL)],
     lambda kv, n, k, b, j: kv[n][k, b, j], 2, NH * HS),
    ("flash-infer HND", "vllm", {"kv_layout": "HND"}, 7,
     lambda f: [f(NB, 2, NH, BS, HS).permute(0, 1, 3, 2, 4) for _ in range(NL)],
     lambda kv, n, k, b, j: kv[n][b, k, j], 2, NH * HS),
    ("MLA", "vllm", {}, 3, lambda f: [f(NB, BS, LATENT) for _ in range(NL)],
     lambda kv, n, k, b, j: kv[n][b, j], 1, LATENT),
    ("cross-layer", "vllm", {"kv_layout": "NHD"}, 0, lambda f: f(NB, NL, 2, BS, NH, HS),
     lambda kv, n, k, b, j: kv[b, n, k, j], 2, NH * HS),
    ("vLLM 0.33 LBNHC", "vllm", {"kv_layout": "NHD"}, 13,
     lambda f: [f(NB, BS, NH, 2 * HS).permute(0, 2, 1, 3) for _ in range(NL)], _fused_row, 1, NH * 2 * HS),
    ("vLLM 0.33 LHBNC", "vllm", {"kv_layout": "LHBNC"}, -1,
     lambda f: [f(NH, NB, BS, 2 * HS).permute(1, 0, 2, 3) for _ in range(NL)], _fused_row, 1, NH * 2 * HS),
    # SGLang's pools [PBS, NH, HS], K layers then V layers; the slot is the pool row b*BS + j
    ("SGLang MHA, MP", "sglang", {"tokens_per_block": BS, "kv_list_layout": "k_v"}, 9,
     lambda f: [f(NB * BS, NH, HS) for _ in range(2 * NL)],
     lambda kv, n, k, b, j: kv[k * NL + n][b * BS + j], 2, NH * HS),
    ("SGLang MHA, in-process", "sglang", {}, 4,
     lambda f: [[f(NB * BS, NH, HS) for _ in range(NL)] for _ in range(2)],
     lambda kv, n, k, b, j: kv[k][n][b * BS + j], 2, NH * HS),
]  # fmt: skip


def slot_mapping(table: list[int]) -> list[int]:
    """vLLM's slot mapping of the request's tokens, with LMCache's masked tokens as -1."""
    return [-1 if p in MASKED else table[p // BS] * BS + p % BS for p in range(TOKENS)]


def lmcache_store(row: Row, kv: Any, chunk: torch.Tensor, slots: list[int]) -> None:
    for t, s in enumerate(slots):
        if s >= 0:
            for layer in range(chunk.shape[1]):
                for k in range(chunk.shape[0]):
                    chunk[k, layer, t] = row(kv, layer, k, s // BS, s % BS).reshape(-1)


def lmcache_load(row: Row, kv: Any, chunk: torch.Tensor, slots: list[int]) -> None:
    for t, s in enumerate(slots):
        if s >= 0:
            for layer in range(chunk.shape[1]):
                for k in range(chunk.shape[0]):
                    view = row(kv, layer, k, s // BS, s % BS)
                    view.copy_(chunk[k, layer, t].view(view.shape))


def flat(kv: Any) -> torch.Tensor:
    if isinstance(kv, torch.Tensor):
        return kv.reshape(-1)
    return torch.cat([flat(x) for x in kv])


@pytest.mark.parametrize(("name", "engine", "hints", "lmcache_fmt", "make", "row", "kv_size", "width"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_slot_mapping_store_and_load_are_lmcaches(
    name: str, engine: str, hints: dict[str, Any], lmcache_fmt: int, make: Callable[[Fill], Any],
    row: Row, kv_size: int, width: int,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(len(name))
    kv = make(lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16))
    group = kvlayout.detect(kv, engine, hints).only_group()
    if lmcache_fmt >= 0:
        assert int(group.format) == lmcache_fmt
    size = BS if kvlayout.is_pbs_fused(group.format) else None  # NB*BS pools: the slots' block size
    slots = slot_mapping(STORE_TABLE)
    chunks = []
    for c0 in range(0, TOKENS, CHUNK):
        part = slots[c0 : c0 + CHUNK]
        shape, dtype = chunk_shape_for(group, len(part), block_size=size)
        assert (shape, dtype) == ((kv_size, NL, len(part), width), torch.bfloat16)  # LMCache's chunk
        chunk = torch.full(shape, SENTINEL, dtype=dtype)
        side = chunk_side(group, chunk, block_size=size)
        block_map(group, side, src_slots=part, dst_blocks=[0], src_block_size=size).copy()
        want = torch.full(shape, SENTINEL, dtype=dtype)
        lmcache_store(row, kv, want, part)
        assert torch.equal(chunk, want), f"chunk at token {c0}"
        chunks.append(chunk)

    def blank(*shape: int) -> torch.Tensor:
        return torch.full(shape, SENTINEL, dtype=torch.bfloat16)

    fresh, want_cache = make(blank), make(blank)
    target = kvlayout.detect(fresh, engine, hints).only_group()
    slots = slot_mapping(LOAD_TABLE)
    for chunk, c0 in zip(chunks, range(0, TOKENS, CHUNK), strict=True):
        part = slots[c0 : c0 + CHUNK]
        side = chunk_side(target, chunk, block_size=size)
        block_map(side, target, [0], dst_slots=torch.tensor(part), dst_block_size=size).copy()
        lmcache_load(row, want_cache, chunk, part)
    got, want = flat(fresh), flat(want_cache)
    assert torch.equal(got, want)  # the request's slots are LMCache's, every other byte untouched
    assert int((want != SENTINEL).sum()) == (TOKENS - len(MASKED)) * NL * kv_size * width


def test_lmcaches_three_axis_object_is_named_and_its_view_moves() -> None:
    """LMCache allocates a one-plane cache's memory object (MLA, fused K/V) as [NL, T, row],
    byte-identical to [1, NL, T, row] (facts 7.1): MLA's obj[l, t] = L_l[b, j] (facts 7.2)."""
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(NB, BS, LATENT, generator=gen) for _ in range(NL)]
    group = kvlayout.detect(kv, "vllm", {}).only_group()
    plan = prepare(group)
    obj = torch.zeros(NL, 2 * BS, LATENT)
    hint = "LMCache's [NL, T, row] object holds the same bytes: pass "
    with pytest.raises(
        TransferError,
        match=re.escape(
            f"needs [1, {NL}, T, {LATENT}] (kv_size, layers, tokens, row); {hint}chunks[0].unsqueeze(0)"
        ),
    ):
        plan.store_blocks([5, 2], [obj])
    with pytest.raises(BlockMapError, match=re.escape(f"{hint}chunk.unsqueeze(0)")):
        chunk_side(group, obj)
    with pytest.raises(
        TransferError, match=r"\(kv_size, layers, tokens, row\)$"
    ):  # no hint: not [NL, T, row]
        plan.store_blocks([5, 2], [torch.zeros(NL + 1, 2 * BS, LATENT)])
    plan.store_blocks([5, 2], [obj.unsqueeze(0)])
    for layer in range(NL):
        assert torch.equal(obj[layer], torch.cat([kv[layer][5], kv[layer][2]]))
