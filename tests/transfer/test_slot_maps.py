"""Block maps given slot mappings (``block_map(..., src_slots=, dst_slots=)``), held to the
engines' own indexing, not kvlayout's algebra: token ``t`` of a request is slot
``slots[t]``, block ``slot // BS``, row ``slot % BS`` (LMCache 0.5.6's
``multi_layer_kv_transfer``, lmcache-0.5.6-facts.md 7.5; vLLM 0.33's
``ComputeSlotMappingKernel``: ``block_table[p // BS] * BS + p % BS``, -1 for a padded token or
one another CP rank holds), a slot of -1 neither read nor written. Each engine's row of a
(layer, K/V, block, row) is read through the tensors as the engine indexes them; a chunk
``[kv_size, NL, T, row]`` is LMCache's, its row ``t`` token ``t``. The runs a map holds are
counted against the maximal runs of the moved rows' bytes, found by brute force."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import _native
from kvlayout.transfer import RegistrationDescription, Shard, block_map
from kvlayout.transfer.block_maps import BlockMapError, chunk_shape_for, chunk_side

NL, NH, HS, LATENT = 2, 2, 4, 6

Row = Callable[[Any, int, int, int, int], torch.Tensor]  # (kv, layer, k_or_v, block, row) -> [NH, HS] view


@dataclass(frozen=True)
class Engine:
    """A cache as an engine allocates and indexes it."""

    name: str
    make: Callable[[int, int, Callable[..., torch.Tensor]], Any]  # (NB, BS, fill) -> the caches
    hints: dict[str, Any]
    row: Row
    kv_size: int


ENGINES = [
    Engine("flash-attn NHD", lambda nb, bs, f: [f(2, nb, bs, NH, HS) for _ in range(NL)], {"kv_layout": "NHD"},
           lambda kv, n, k, b, j: kv[n][k, b, j], 2),
    # vLLM allocates HND memory and registers the NHD-shaped view of it
    Engine("flash-attn HND", lambda nb, bs, f: [f(2, nb, NH, bs, HS).permute(0, 1, 3, 2, 4) for _ in range(NL)],
           {"kv_layout": "HND"}, lambda kv, n, k, b, j: kv[n][k, b, j], 2),
    Engine("flash-infer NHD", lambda nb, bs, f: [f(nb, 2, bs, NH, HS) for _ in range(NL)], {"kv_layout": "NHD"},
           lambda kv, n, k, b, j: kv[n][b, k, j], 2),
    Engine("cross-layer", lambda nb, bs, f: f(nb, NL, 2, bs, NH, HS), {"kv_layout": "NHD"},
           lambda kv, n, k, b, j: kv[b, n, k, j], 2),
]  # fmt: skip
MLA = Engine("MLA", lambda nb, bs, f: [f(nb, bs, LATENT) for _ in range(NL)], {},
             lambda kv, n, k, b, j: kv[n][b, j].unsqueeze(0), 1)  # fmt: skip


def _fill(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    return lambda *shape: torch.randn(*shape, generator=gen).to(torch.float16)


class Cache:
    """One side: an engine's cache (``bs`` tokens a block) or LMCache's chunk of ``rows`` tokens."""

    def __init__(
        self, engine: Engine, nb: int, bs: int, gen: torch.Generator, chunk_rows: int | None
    ) -> None:
        self.engine, self.bs = engine, bs
        self.kv = engine.make(nb, bs, _fill(gen))
        self.group = kvlayout.detect(self.kv, "vllm", engine.hints).only_group()
        self.chunk: torch.Tensor | None = None
        self.rows = nb * bs
        if chunk_rows is not None:
            shape, dtype = chunk_shape_for(self.group, chunk_rows)
            self.chunk = torch.randn(*shape, generator=gen).to(dtype)
            self.side: Any = chunk_side(self.group, self.chunk)
            self.rows = chunk_rows
        else:
            self.side = self.group

    def row(self, layer: int, k: int, slot: int) -> torch.Tensor:
        """The engine's (or LMCache's chunk's) row of one layer, K or V and slot: ``[heads, width]``."""
        if self.chunk is not None:
            return self.chunk[k, layer, slot].view(-1, self.chunk.shape[-1] // self.heads)
        return self.engine.row(self.kv, layer, k, slot // self.bs, slot % self.bs)

    @property
    def heads(self) -> int:
        return 1 if self.engine is MLA else NH

    def snapshot(self) -> list[torch.Tensor]:
        if self.chunk is not None:
            return [self.chunk.clone()]
        return [t.clone() for t in (self.kv if isinstance(self.kv, list) else [self.kv])]

    def now(self) -> list[torch.Tensor]:
        if self.chunk is not None:
            return [self.chunk]
        return list(self.kv) if isinstance(self.kv, list) else [self.kv]


def brute_force_runs(src: Cache, dst: Cache, pairs: list[tuple[int, int]]) -> int:
    """The maximal runs of the moved rows' bytes: every (token, layer, K/V, head) row a unit
    of (source address, destination address, length, tensors), sorted by destination and
    merged where the next continues both sides in the same tensors."""
    units = []
    for s, d in pairs:
        for layer in range(NL):
            for k in range(src.engine.kv_size):
                a, b = src.row(layer, k, s), dst.row(layer, k, d)
                for h in range(a.shape[0]):
                    units.append((
                        b[h].data_ptr(), a[h].data_ptr(), a[h].nbytes,
                        a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(),
                    ))  # fmt: skip
    units.sort()
    runs = 0
    for i, (d, s, _, st_, dt_) in enumerate(units):
        if i:
            pd, ps, pn, pst, pdt = units[i - 1]
            if (pst, pdt) == (st_, dt_) and pd + pn == d and ps + pn == s:
                continue
        runs += 1
    return runs


def draw_slots(
    data: st.DataObject, rng: np.random.Generator, tokens: int, rows: int, bs: int, dst: bool
) -> list[int]:
    """A slot mapping of ``tokens`` into a side of ``rows`` slots: vLLM's (a block table of
    distinct blocks, aligned slots) or LMCache's any (unaligned, in any order; a source's may
    repeat), with tokens masked (-1) at random, in runs or alone."""
    how = data.draw(st.sampled_from(["vllm", "any"]))
    if how == "vllm" and -(-tokens // bs) <= rows // bs:
        table = rng.permutation(rows // bs)[: -(-tokens // bs)]
        slots = [int(table[p // bs]) * bs + p % bs for p in range(tokens)]
    elif dst or data.draw(st.booleans()):
        slots = [int(x) for x in rng.permutation(rows)[:tokens]]  # distinct
    else:
        slots = [int(x) for x in rng.integers(0, rows, tokens)]  # a source's may repeat
    mask = data.draw(st.sampled_from([0.0, 0.1, 0.4]))
    for t in np.flatnonzero(rng.random(tokens) < mask):
        slots[int(t)] = -1
    if tokens and data.draw(st.booleans()):  # a masked prefix: LMCache's stored tokens
        cut = data.draw(st.integers(0, tokens))
        slots[:cut] = [-1] * cut
    return slots


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_slot_maps_move_what_the_engines_index(data: st.DataObject) -> None:
    """Random slot mappings (masked tokens, holes, unaligned and repeated source slots), cache
    <-> chunk and cache <-> cache, blocks of 1 to 64: after copy() every moved token's
    destination row holds its source row as the engines index them, nothing else in the
    destination changed, and the map holds the maximal runs."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    direction = data.draw(st.sampled_from(["cache->chunk", "chunk->cache", "cache->cache"]))
    mla = (data.draw(st.booleans()) and direction != "cache->cache") or data.draw(st.integers(0, 9)) == 0
    engines = [MLA, MLA] if mla else [data.draw(st.sampled_from(ENGINES)) for _ in range(2)]
    sizes = [data.draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64])) for _ in range(2)]
    tokens = data.draw(st.integers(0, 40))
    nbs = [max(3, -(-(tokens + 8) // bs)) for bs in sizes]  # 3: [NB, 2, ...] is not [2, NB, ...]
    src = Cache(engines[0], nbs[0], sizes[0], gen, tokens + 3 if direction == "chunk->cache" else None)
    dst = Cache(engines[1], nbs[1], sizes[1], gen, tokens + 3 if direction == "cache->chunk" else None)
    kw: dict[str, Any] = {}
    src_slots = draw_slots(data, rng, tokens, src.rows, src.bs if src.chunk is None else src.rows, False)
    dst_slots = draw_slots(data, rng, tokens, dst.rows, dst.bs if dst.chunk is None else dst.rows, True)
    # a chunk's side in LMCache's call is its one block, row t token t; or slots of its rows
    for name, side, slots in (("src", src, src_slots), ("dst", dst, dst_slots)):
        if side.chunk is not None and data.draw(st.booleans()):
            kw[f"{name}_blocks"] = [0] if tokens else []  # the blocks the tokens fill, as any block list
            slots[:] = list(range(tokens))
        else:
            kw[f"{name}_slots"] = slots
    first = data.draw(st.integers(0, tokens))
    if first:
        kw["first_token"] = first
    if data.draw(st.booleans()):  # the arguments as engines hold them
        for key in ("src_slots", "dst_slots"):
            if key in kw:
                kw[key] = torch.tensor(kw[key], dtype=torch.int32 if "src" in key else torch.int64)
    pairs = [(s, d) for t, (s, d) in enumerate(zip(src_slots, dst_slots, strict=True)) if s >= 0 and d >= 0
             and t >= first]  # fmt: skip
    want = dst.snapshot()
    expect = Cache.__new__(Cache)
    expect.__dict__.update(dst.__dict__)
    # the oracle: LMCache's loop, token by token, on a copy of the destination
    if dst.chunk is not None:
        expect.chunk = want[0]
    else:
        expect.kv = want if isinstance(dst.kv, list) else want[0]
    for s, d in pairs:
        for layer in range(NL):
            for k in range(src.engine.kv_size):
                expect.row(layer, k, d).copy_(src.row(layer, k, s))
    m = block_map(src.side, dst.side, **kw)
    assert m.num_runs == brute_force_runs(src, dst, pairs)
    assert m.num_bytes == len(pairs) * NL * src.engine.kv_size * (LATENT if mla else NH * HS) * 2
    m.copy()
    for got, w in zip(dst.now(), want, strict=True):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16))


def _vllm(nb: int = 8, bs: int = 4, hnd: bool = False) -> tuple[list[torch.Tensor], Any]:
    gen = torch.Generator().manual_seed(nb * bs)
    engine = ENGINES[1] if hnd else ENGINES[0]
    kv = engine.make(nb, bs, _fill(gen))
    return kv, kvlayout.detect(kv, "vllm", engine.hints).only_group()


def test_a_slot_map_is_the_block_map_of_the_same_request() -> None:
    """vLLM's slot mapping of a request is its block table: the same runs, built as one."""
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 8, hnd=True)
    table, tokens = [9, 2, 14, 3, 5, 11], 22
    slots = [table[p // 4] * 4 + p % 4 for p in range(tokens)]
    by_blocks = block_map(src, dst, table, [6, 1, 4], num_tokens=tokens)
    by_slots = block_map(src, dst, src_slots=slots, dst_blocks=[6, 1, 4])
    assert np.array_equal(by_slots.runs, by_blocks.runs)
    assert (by_slots.kind, by_slots.num_tokens) == (by_blocks.kind, tokens)
    rows = [b * 8 + p % 8 for b in (6, 1, 4) for p in range(8)][:tokens]
    assert np.array_equal(block_map(src, dst, src_slots=np.array(slots), dst_slots=rows).runs, by_blocks.runs)
    # from token 5 on, a block-id map and a slot map of the tokens before as -1 agree
    later = block_map(src, dst, table, [6, 1, 4], num_tokens=tokens, first_token=5)
    masked = block_map(src, dst, src_slots=[-1] * 5 + slots[5:], dst_blocks=[6, 1, 4])
    assert np.array_equal(masked.runs, later.runs)


def test_a_sub_paged_caches_slots_count_the_same() -> None:
    """vLLM's kernel block expansion: a scheduler block of 8 tokens is 2 kernel pages of 4 in
    order, and a slot counted over either is the same row."""
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 4)
    slots = [[5, 2][p // 8] * 8 + p % 8 for p in range(13)]
    by_blocks = block_map(src, dst, [5, 2], [1, 3, 0, 6], num_tokens=13, src_block_size=8)
    assert np.array_equal(block_map(src, dst, src_slots=slots, dst_blocks=[1, 3, 0, 6]).runs, by_blocks.runs)


def test_a_context_parallel_ranks_slot_mapping_and_block_ids() -> None:
    """vLLM's DCP slot mapping for rank r of c (ComputeSlotMappingKernel): a token another rank
    holds is -1, its own the k-th it holds at block_table[k // BS] * BS + k % BS. A map from a
    side without CP by that mapping moves what the rank's block ids do."""
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 4)
    shard = Shard(0, 1, NH, cp_rank=1, cp_size=2, cp_interleave=1)
    table, tokens = [3, 6, 1], 21
    own = [p for p in range(tokens) if p % 2 == 1]
    slots = [-1] * tokens
    for k, p in enumerate(own):
        slots[p] = table[k // 4] * 4 + k % 4
    by_blocks = block_map(src, dst, list(range(6)), table, num_tokens=tokens, dst_shard=shard)
    by_slots = block_map(src, dst, list(range(6)), dst_slots=slots, num_tokens=tokens)
    assert np.array_equal(by_slots.runs, by_blocks.runs)
    # the other way: the block-id side is the CP rank's, its tokens those of its own rank
    back = block_map(dst, src, table, src_slots=None, dst_slots=list(range(tokens)), src_shard=shard)
    assert back.num_bytes == len(own) * NL * 2 * NH * HS * 2
    assert np.array_equal(
        np.sort(back.runs[:, 0]), np.sort(block_map(dst, src, table, list(range(6)), num_tokens=tokens,
                                                     src_shard=shard).runs[:, 0]))  # fmt: skip


def test_a_peers_description_takes_slots() -> None:
    """A slot map to a peer's description: the runs a transfer engine moves, checked inside
    what the peer described (NIXL)."""
    _, src = _vllm(16, 4)
    peer_kv, peer = _vllm(8, 4)
    description = RegistrationDescription.from_json(
        kvlayout.detect(peer_kv, "vllm", {"kv_layout": "NHD"}).describe().to_json()
    )
    slots = [13, 14, 15, -1, 4, 5, 30]
    m = block_map(src, description, [2, 7], dst_slots=slots)
    local = block_map(src, peer, [2, 7], dst_slots=slots)
    assert np.array_equal(m.runs, local.runs) and m.num_runs == 3 * NL * 2  # 3 stretches a layer and K/V
    with pytest.raises(BlockMapError, match="RegistrationDescription"):
        m.copy()


def test_slot_map_errors_name_the_token_and_slot() -> None:
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 4)
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "dst_slots[3] = 9 repeats dst_slots[1]: tokens 1 and 3 both write slot 9 (block 2, row 1); each "
            "destination slot is written once"
        ),
    ):
        block_map(src, dst, [0, 1], dst_slots=[8, 9, 10, 9, 12])
    # a source slot read twice is no error, nor a destination slot named again for a token masked
    block_map(src, dst, src_slots=[3, 3, 3], dst_slots=[8, 9, 7])
    block_map(src, dst, src_slots=[3, -1, 3], dst_slots=[8, 8, 7])
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "dst_slots[2] = 32 (token 2) is out of range for the dst cache's 32 slots (8 blocks of 4)"
        ),
    ):
        block_map(src, dst, [0], dst_slots=[0, 1, 32])
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "src_slots[1] = -2 (token 1) is negative: -1 marks a token not moved, no other slot is negative"
        ),
    ):
        block_map(src, dst, src_slots=[0, -2], dst_blocks=[0])
    chunk = torch.zeros(chunk_shape_for(dst, 4)[0], dtype=torch.float16)
    with pytest.raises(
        BlockMapError,
        match=re.escape("src_slots[0] = 64 (token 0) is out of range for the src cache's 64 slots"),
    ):
        block_map(src, chunk_side(dst, chunk), src_slots=[64], dst_blocks=[0])
    with pytest.raises(
        BlockMapError,
        match=re.escape("dst_slots[1] = 4 (token 1) is out of range for the dst chunk's 4 token rows"),
    ):
        block_map(src, chunk_side(dst, chunk), [0], dst_slots=[0, 4])
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "dst_blocks[1] and dst_blocks[0] are block 2: tokens 0 and 4 both write slot 8 (block 2, row 0); "
            "each destination slot is written once"
        ),
    ):
        block_map(src, dst, dst_blocks=[2, 2], src_slots=list(range(5)))
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "src_slots has 3 slots; the request has 5 tokens (num_tokens): a slot mapping holds one slot per "
            "token, -1 for a token not moved"
        ),
    ):
        block_map(src, dst, src_slots=[0, 1, 2], dst_blocks=[0, 1], num_tokens=5)
    with pytest.raises(
        BlockMapError, match=re.escape("src_slots has 3 slots and dst_slots 2: one slot a token on each side")
    ):
        block_map(src, dst, src_slots=[0, 1, 2], dst_slots=[0, 1])
    with pytest.raises(TypeError, match="block_map takes dst_blocks or dst_slots for the dst side, not both"):
        block_map(src, dst, [0], [0], dst_slots=[1])
    with pytest.raises(
        TypeError, match="block_map takes src_blocks or src_slots for the src side, not neither"
    ):
        block_map(src, dst, dst_blocks=[0])
    with pytest.raises(BlockMapError, match=re.escape("dst_slots must be integers, got torch.float32")):
        block_map(src, dst, [0], dst_slots=torch.zeros(2))
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "dst_blocks has 1 block ids; the request's 5 tokens (the length of src_slots) fill 2 blocks of 4"
        ),
    ):
        block_map(src, dst, src_slots=list(range(5)), dst_blocks=[0])


def test_a_chunk_cut_into_pages_is_walked_in_its_order() -> None:
    """A slot map into a chunk with a hole in its tokens cuts the chunk (one block) into pages
    of a token: the pages are a level inside the chunk's (layer, K/V) planes, so the builder
    walks the chunk in memory order, with no sort (each page walking every plane went back
    in the chunk at every token: 620 us where this takes 24, 1024 tokens of 8 layers)."""
    _, src = _vllm(16, 4)
    chunk = torch.zeros(chunk_shape_for(src, 20)[0], dtype=torch.float16)
    slots = [[9, 2, 14, 3, 5][p // 4] * 4 + p % 4 for p in range(20)]
    slots[7:10] = [-1] * 3
    m = block_map(src, chunk_side(src, chunk), src_slots=slots, dst_blocks=[0])
    p, (src_ids, dst_ids), (first, end) = m._pair, m._ids, m._slots
    assert m._page_sizes == (1, 1) and p.order == (0, 1, 2, 3)  # slab, block (the pages), slot, head
    _, runs, in_order = _native.build_groups(
        p.slabs, p.group_starts, p.order, len(p.heads), end, src_ids, 1, dst_ids, 1,
        p.src_classes, p.dst_classes, False, False, False, first, *m._page_slots,
    )  # fmt: skip
    assert in_order and runs == m.num_runs == NL * 2 * 5  # a run a block's moved tokens
    assert np.array_equal(m.runs, m._build(force_sort=True))


def test_a_hybrid_models_attention_takes_slots_and_its_state_pages_do_not() -> None:
    """vLLM's edited Qwen3.5 registration: the attention group's slot mapping (blocks of 544
    tokens, vLLM's scheduler's) moves what its block ids do; a Mamba group's pages are state,
    rows that are no tokens, which move whole by block ids: a slot mapping is refused."""
    from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
    from kvlayout.testing import vllm as vx

    engine = vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=9)
    buf, kv_caches = vx.allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    )
    hints = {"kv_layout": engine.layout.name}
    layers, groups = transfer_layers(
        engine.config, apply_kv_cache_group_edits(engine.config, kv_caches, hints)
    )
    registration = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    state, attention = registration.kernel_groups[0], registration.kernel_groups[-1]
    assert state.opaque_pages is not None and attention.opaque_pages is None
    tokens, table, bs = 600, [5, 2], attention.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(tokens)]
    chunk = torch.zeros(chunk_shape_for(attention, tokens)[0], dtype=chunk_shape_for(attention, tokens)[1])
    side = chunk_side(attention, chunk)
    by_slots = block_map(attention, side, src_slots=slots, dst_blocks=[0])
    assert np.array_equal(by_slots.runs, block_map(attention, side, table, [0], num_tokens=tokens).runs)
    state_chunk = torch.zeros(chunk_shape_for(state, 1)[0], dtype=chunk_shape_for(state, 1)[1])
    with pytest.raises(
        BlockMapError,
        match=r"a slot mapping names token rows, but the map moves opaque pages \(mamba-state-rows: .*\) whose "
        r"rows are no tokens \(state, or a kernel's page\): they move whole pages, by block ids",
    ):
        block_map(state, chunk_side(state, state_chunk), src_slots=[5 * 544], dst_blocks=[0])


def test_a_context_parallel_ranks_slot_mapping_names_only_its_own_tokens() -> None:
    """vLLM's ``BlockTable.compute_slot_mapping`` under DCP writes
    ``np.where(mask, slot_mapping, -1)``: a token another CP rank holds is -1 in a rank's
    mapping. A mapping given with a CP shard that names a slot for such a token (the whole
    request's mapping, say) was taken as it stood, moving 21 tokens into (or out of) a rank
    that holds 10: refused, naming the token."""
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 4)
    shard = Shard(0, 1, NH, cp_rank=1, cp_size=2, cp_interleave=1)
    tokens = 21
    own = [-1 if p % 2 == 0 else p // 2 for p in range(tokens)]  # the rank's own k-th token at row k
    m = block_map(src, dst, list(range(6)), dst_slots=own, dst_shard=shard)
    assert m.num_bytes == 10 * NL * 2 * NH * HS * 2
    message = (
        "{}_slots[0] = 0, but token 0 is not among the tokens of CP rank 1 of 2 (1 at a time) ({}_shard): "
        "a context-parallel rank's slot mapping is -1 for the tokens other ranks hold"
    )
    with pytest.raises(BlockMapError, match=re.escape(message.format("dst", "dst"))):
        block_map(src, dst, list(range(6)), dst_slots=list(range(tokens)), dst_shard=shard)
    with pytest.raises(BlockMapError, match=re.escape(message.format("src", "src"))):
        block_map(dst, src, src_slots=list(range(tokens)), dst_blocks=list(range(6)), src_shard=shard)


def test_a_masked_prefix_keeps_the_block_tables_pages_whole() -> None:
    """LMCache masks a stored prefix with -1: past it, a block table's slot mapping is still
    its blocks, in their phase (the first moved token, 9, is row 1 of its block). The pages
    the builder walks are whole blocks from the moved token's block on, one padding row
    before it (not single tokens, nor the prefix's blocks walked as padding), and the runs
    are those of the block-id map from first_token 9."""
    _, src = _vllm(16, 4)
    _, dst = _vllm(8, 4)
    table, tokens, dst_ids = [9, 2, 14, 3, 5, 11], 22, [6, 1, 4, 0, 7, 2]
    slots = [table[p // 4] * 4 + p % 4 for p in range(tokens)]
    m = block_map(src, dst, src_slots=[-1] * 9 + slots[9:], dst_blocks=dst_ids)
    assert np.array_equal(m.runs, block_map(src, dst, table, dst_ids, num_tokens=tokens, first_token=9).runs)
    assert m._page_sizes == (4, 4) and m._slots == (1, 14)
    assert m._ids[0].tolist() == table[2:] and m._ids[1].tolist() == dst_ids[2:]
