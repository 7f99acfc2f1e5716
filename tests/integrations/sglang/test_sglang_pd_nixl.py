"""SGLang's prefill/decode KV transfer written on kvlayout, as a connector author would from
README.md, docs/pd-connectors.md, docs/nixl.md and docs/block-maps.md, through real NIXL
(two agents, UCX loopback), byte-exact against an oracle from SGLang's own indexing.

What SGLang does (read in sgl-project/sglang):

- ``mem_cache/memory_pool.py``: ``MHATokenToKVPool`` allocates per layer ``k_buffer[i]`` and
  ``v_buffer[i]`` of ``[size + page_size, head_num, head_dim]`` (contiguous: strides
  ``(head_num * head_dim, head_dim, 1)``), ``MLATokenToKVPool`` per layer ``kv_buffer[i]`` of
  ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``; ``get_contiguous_buf_infos()``
  hands the transfer backend every K pointer then every V pointer (MLA: every layer's
  pointer), each item a page (``buf[0].nbytes * page_size``). ``SWAKVPool`` holds the
  sliding-window layers in ``swa_kv_pool`` and the others in ``full_kv_pool``, two MHA pools
  of their own sizes; ``translate_loc_from_full_to_swa`` maps a full slot to its SWA slot.
- Token ``t`` of a request is slot ``req_to_token[req_pool_idx, t]``; the paged allocator
  hands out whole pages from 1 (page 0 holds the padded slot), so that slot is
  ``page[t // page_size] * page_size + t % page_size``, and both sides hand their backend
  ``kv_to_page_indices(slots) = slots[::page_size] // page_size``
  (``disaggregation/utils.py``). The SWA state's pages are those of the window only:
  ``window_start = max(0, seq_len - window)`` floored to a page, then
  ``kv_to_page_indices(translate_loc_from_full_to_swa(req_to_token[window_start:seq_len]))``
  on both sides (``prefill.py`` / ``decode.py``).
- ``disaggregation/common/conn.py`` (``CommonKVReceiver``): a decode rank ``d`` of TP
  ``dtp`` takes its KV from prefill rank ``d // (dtp // ptp)`` where decode has more ranks,
  from prefill ranks ``[d * r, (d + 1) * r)`` (``r = ptp // dtp``) where it has fewer, all of
  them real for MHA, only the first for MLA (the others are sent a dummy request).
- ``disaggregation/mooncake/conn.py`` / ``nixl/conn.py``: prefill WRITEs. At equal TP whole
  pages (``index * item_len``, runs of consecutive page pairs joined); between TP degrees
  (``send_kvcache_slice``) one descriptor per token slot of each page and each layer's K and
  V: the heads both ranks hold (replicated heads, ``total_kv_heads < tp``, by
  ``tp_rank // (tp // total_kv_heads)``). Both take ``bytes_per_token = item_len //
  page_size`` with the prefill's ``page_size`` for the decode's pages too and zip the two
  page lists one to one (``nixl/conn.py`` asserts they are as long): prefill and decode
  must use the same page size. Whole pages move, the last page's slots past the prompt
  included.

- Pipeline parallelism (``common/conn.py``): decode's PP size is prefill's or 1; a
  stage's pool holds layers ``[start_layer, end_layer)`` and ``get_mha_kv_ptrs_with_pp`` /
  ``get_mla_kv_ptrs_with_pp`` pair its entry ``i`` with decode's layer
  ``prefill_start_layer + i``. Speculative decoding (``prefill.py`` / ``decode.py``
  ``_init_kv_manager``): the draft pool's buffers follow the target's in
  ``kv_data_ptrs``, moved with the same page ids. Decode's radix cache:
  ``decode_prefix_len`` (page-aligned) skips the pages decode holds
  (``req.start_send_idx``). NSA (DeepSeek-V3.2, ``NSATokenToKVPool``): the indexer's
  ``index_k_with_scale_buffer`` in ``state_data_ptrs`` (state type ``"nsa"``), a page per
  KV page.

kvlayout moves the request's tokens only (a partly filled last page moves its tokens), and
also between page sizes. The oracle below is SGLang's: decode ``buffer[layer][slot, head, :]``
for each token and head the decode rank holds equals the prefill rank's that holds the head,
and every other byte of every decode rank stays zero.
"""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import torch

pytest.importorskip("nixl")

import kvlayout
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map, join_maps
from kvlayout.transfer import nixl as nx

LAYERS, HEAD_DIM, LATENT = 2, 16, 48  # LATENT: kv_lora_rank 32 + qk_rope_head_dim 16
PAGE, TOKENS = 16, 150  # 150 tokens: 9 whole pages and 6 tokens of a tenth
MODULE_LIMIT_S = 300
WINDOW = 40  # the sliding window (gpt-oss-like: sliding layers 0 and 2, full 1 and 3)


def agent_pair(prefix: str) -> Iterator[tuple[Any, Any]]:
    """Prefill's and decode's NIXL agents (progress threads on, as the docs have them),
    named ``prefix``-prefill and -decode, under a hard limit on the module using them
    (every wait has its own deadline too)."""
    import logging

    import nixl._api  # noqa: F401  (importing it sets NIXL's logger to INFO)

    logging.getLogger("nixl").setLevel(logging.WARNING)
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        yield nx.make_agent(f"{prefix}-prefill"), nx.make_agent(f"{prefix}-decode")
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Any, Any]]:
    yield from agent_pair("sgl-pd")


# --- SGLang's side: pools, rank heads, slots, rank pairs ---------------------------------


def mha_pool(pages: int, page: int, heads: int, seed: int | None, layers: int = LAYERS) -> list[torch.Tensor]:
    """``MHATokenToKVPool``'s ``k_buffer + v_buffer`` (every K layer, then every V layer, as
    ``get_contiguous_buf_infos`` lists them): per layer ``[size + page_size, head_num,
    head_dim]`` (``size = pages * page``), seeded noise or zeros. ``layers``: the pool's
    ``layer_num`` (a pipeline stage's ``end_layer - start_layer``, an EAGLE draft's 1)."""
    shape = (pages * page + page, heads, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2 * layers)]


def mla_pool(pages: int, page: int, seed: int | None, layers: int = LAYERS) -> list[torch.Tensor]:
    """``MLATokenToKVPool.kv_buffer``: per layer ``[size + page_size, 1, kv_lora_rank +
    qk_rope_head_dim]``."""
    shape = (pages * page + page, 1, LATENT)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(layers)]


def rank_heads(rank: int, tp: int, heads: int) -> list[int]:
    """The model's KV heads TP rank ``rank`` holds (SGLang's ``QKVParallelLinear``: a
    contiguous range, or one head replicated over ``tp // heads`` ranks)."""
    if tp <= heads:
        return list(range(rank * heads // tp, (rank + 1) * heads // tp))
    return [rank // (tp // heads)]


def sglang_targets(d: int, dtp: int, ptp: int, mla: bool) -> list[int]:
    """The prefill ranks decode rank ``d`` takes real (not dummy) KV from
    (``CommonKVReceiver.__init__`` and ``_setup_bootstrap_infos``)."""
    if dtp == ptp:
        return [d]
    if dtp > ptp:
        return [d // (dtp // ptp)]
    r = ptp // dtp
    ranks = list(range(d * r, (d + 1) * r))
    return ranks[:1] if mla else ranks


def slots_of(pages: Sequence[int], page: int, tokens: int) -> list[int]:
    """``req_to_token[req_pool_idx, :tokens]`` of a request given whole pages."""
    return [pages[t // page] * page + t % page for t in range(tokens)]


def kv_to_page_indices(slots: Sequence[int], page: int) -> list[int]:
    """``disaggregation/utils.py``'s ``kv_to_page_indices``: ``slots[::page] // page``."""
    return [s // page for s in slots[::page]]


def scattered_pages(count: int, total: int, seed: int) -> list[int]:
    """``count`` distinct pages of ``1..total`` (page 0 is SGLang's padding), out of order."""
    return [int(p) + 1 for p in torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:count]]


# --- the connector: a rank's pool, registered; the handshake; posting ---------------------


@dataclass
class Rank:
    """One rank's pool as kvlayout sees it: its tensors (in ``get_contiguous_buf_infos``
    order), its detected registration and its NIXL registration."""

    tensors: list[torch.Tensor]
    registration: Any
    shard: Shard
    held: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def detect_rank(tensors: list[torch.Tensor], page: int, shard: Shard, *, mha: bool = True) -> Rank:
    hints: dict[str, Any] = {"tokens_per_block": page}
    if mha:
        hints["kv_list_layout"] = "k_v"
    return Rank(tensors, kvlayout.detect(tensors, "sglang", hints), shard)


def handshake(decode: Rank) -> RegistrationDescription:
    """Decode sends ``describe(shard=...)`` as JSON; prefill parses it as untrusted."""
    there = RegistrationDescription.from_json(decode.registration.describe(shard=decode.shard).to_json())
    assert there.shard == decode.shard
    return there


def shard_of(there: RegistrationDescription) -> Shard:
    """The shard a decode rank's description carries."""
    assert there.shard is not None
    return there.shard


def await_notifs(agent: Any, expect: dict[str, int], deadline_s: float = 30.0) -> None:
    """Decode polls until every expected notification has arrived (prefill WRITEs)."""
    got: dict[str, int] = {}
    end = time.monotonic() + deadline_s
    while any(got.get(k, 0) < n for k, n in expect.items()):
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                got[m.decode()] = got.get(m.decode(), 0) + 1
        if time.monotonic() > end:
            raise AssertionError(f"notifications {got} of {expect} after {deadline_s} s")
        time.sleep(0.005)


class Link:
    """Both sides' agents with their ranks registered, and prefill's view of decode's agent."""

    def __init__(
        self, agents: tuple[Any, Any], prefill: list[Rank], decode: list[Rank], landing_bytes: int = 0
    ) -> None:
        self.prefill_agent, self.decode_agent = agents
        for r in prefill:
            r.held = nx.register(self.prefill_agent, r.registration)
        for r in decode:
            r.held = nx.register(self.decode_agent, r.registration)
        # decode's staging buffer for peer-staged WRITEs, made before its metadata is taken
        self.landing = nx.Staging(self.decode_agent, landing_bytes) if landing_bytes else None
        self.peer = self.prefill_agent.add_remote_agent(self.decode_agent.get_agent_metadata())

    def close(self, ranks: Sequence[Rank]) -> None:
        self.prefill_agent.remove_remote_agent(self.peer)
        if self.landing is not None:
            self.landing.close()
        for r in ranks:
            r.held.deregister()


def post(
    link: Link,
    maps: dict[tuple[int, int], Any],
    strategy: Literal["direct", "staged", "peer-staged"],
    staging_bytes: int,
    halves: dict[tuple[int, int], Any] | None = None,
) -> None:
    """Prefill WRITEs each rank pair's map (one notification each), decode waits for them.
    Peer-staged: each WRITE lands in decode's staging buffer, and decode scatters it with
    its own half (``halves``: the same map planned from prefill's description), checked by
    the poster's fingerprint, before the next request takes the buffer."""
    staging = nx.Staging(link.prefill_agent, staging_bytes) if strategy == "staged" else None
    try:
        for (p, d), m in maps.items():
            tag = f"req-{p}-{d}"
            landing = link.landing if strategy == "peer-staged" else None
            at_peer = None if landing is None else nx.PeerStaging(landing.address, landing.nbytes)
            x = nx.transfer(
                link.prefill_agent,
                link.peer,
                m,
                notif=tag.encode(),
                strategy=strategy,
                staging=staging,
                peer_staging=at_peer,
            )
            assert x.wait(timeout=30).strategy == strategy
            if landing is not None:
                assert halves is not None
                await_notifs(link.decode_agent, {tag: 1})
                nx.unstage(halves[p, d], landing, expect=m.fingerprint)
        if strategy != "peer-staged":
            await_notifs(link.decode_agent, {f"req-{p}-{d}": 1 for p, d in maps})
    finally:
        if staging is not None:
            staging.close()


# --- (a) MHA pools between TP degrees ----------------------------------------------------


@pytest.mark.parametrize(
    ("ptp", "dtp", "heads", "strategy"),
    [
        (2, 4, 8, "direct"),
        (4, 2, 8, "staged"),
        (4, 2, 8, "peer-staged"),
        (2, 4, 2, "staged"),
        (4, 2, 2, "direct"),
    ],
)
def test_mha_pool_between_tp_degrees(
    agents: tuple[Any, Any],
    ptp: int,
    dtp: int,
    heads: int,
    strategy: Literal["direct", "staged", "peer-staged"],
) -> None:
    """Prefill TP ``ptp`` into decode TP ``dtp`` (8 KV heads, or 2: replicated at TP 4),
    page 16 on both, a request of 150 tokens on scattered pages, addressed as SGLang
    addresses it: block ids are ``kv_to_page_indices`` of ``req_to_token`` (the same runs as
    ``src_slots=`` / ``dst_slots=`` of the slots themselves)."""
    pages = -(-TOKENS // PAGE)
    p_slots = slots_of(scattered_pages(pages, 12, 1), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 14, 2), PAGE, TOKENS)
    src_pages, dst_pages = kv_to_page_indices(p_slots, PAGE), kv_to_page_indices(d_slots, PAGE)

    prefill, decode = [], []
    for p in range(ptp):  # replicated heads (2 heads at TP 4) hold the same bytes
        held = rank_heads(p, ptp, heads)
        prefill.append(detect_rank(mha_pool(12, PAGE, len(held), 10 + held[0]), PAGE, Shard(p, ptp, heads)))
    for d in range(dtp):
        held = rank_heads(d, dtp, heads)
        decode.append(detect_rank(mha_pool(14, PAGE, len(held), None), PAGE, Shard(d, dtp, heads)))
    assert prefill[0].registration.kernel_groups[0].format.name == "TWO_X_NL_X_NB_BS_NH_HS"

    link = Link(agents, prefill, decode, landing_bytes=1 << 20 if strategy == "peer-staged" else 0)
    try:
        maps, halves = {}, {}
        for d, dr in enumerate(decode):
            there = handshake(dr)
            for p, pr in enumerate(prefill):
                m = block_map(
                    pr.registration, there, src_pages, dst_pages, num_tokens=TOKENS, src_shard=pr.shard
                )
                by_slots = block_map(
                    pr.registration, there, src_slots=p_slots, dst_slots=d_slots, src_shard=pr.shard
                )
                assert by_slots.fingerprint == m.fingerprint
                if m.kind != "empty" and pr.shard.sends_to(shard_of(there), latents=m.latents):
                    maps[p, d] = m
                    # decode's half, from prefill's description (its handshake the other way)
                    source = RegistrationDescription.from_json(
                        pr.registration.describe(shard=pr.shard).to_json()
                    )
                    halves[p, d] = block_map(
                        source, dr.registration, src_pages, dst_pages, num_tokens=TOKENS, dst_shard=dr.shard
                    )
        # kvlayout posts a subset of SGLang's pairs; where SGLang also sends replicated heads
        # from a second prefill rank (GQA, TP 4 -> 2 of 2 heads) those are the same bytes.
        for p, d in maps:
            assert p in sglang_targets(d, dtp, ptp, mla=False), (p, d)
        post(link, maps, strategy, 1 << 20, halves)
    finally:
        link.close(prefill + decode)

    for d, dr in enumerate(decode):
        for i, t in enumerate(dr.tensors):
            want = torch.zeros_like(t)
            for h_local, h in enumerate(rank_heads(d, dtp, heads)):
                src = next(p for p in sglang_targets(d, dtp, ptp, False) if h in rank_heads(p, ptp, heads))
                h_src = rank_heads(src, ptp, heads).index(h)
                for tok in range(TOKENS):
                    want[d_slots[tok], h_local] = prefill[src].tensors[i][p_slots[tok], h_src]
            assert torch.equal(t, want), (d, i)


def test_mha_pool_between_page_sizes(agents: tuple[Any, Any]) -> None:
    """What SGLang's own connectors cannot pair (page lists zipped one to one, the
    prefill's page size taken for both): prefill pages of 16 at TP 2 into decode pages of 64
    at TP 4, by the slots of each side's ``req_to_token``; by block ids the same runs."""
    heads, ptp, dtp, d_page = 8, 2, 4, 64
    p_slots = slots_of(scattered_pages(-(-TOKENS // PAGE), 12, 3), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(-(-TOKENS // d_page), 5, 4), d_page, TOKENS)
    prefill = [
        detect_rank(mha_pool(12, PAGE, 4, seed=20 + p), PAGE, Shard(p, ptp, heads)) for p in range(ptp)
    ]
    decode = [
        detect_rank(mha_pool(5, d_page, 2, seed=None), d_page, Shard(d, dtp, heads)) for d in range(dtp)
    ]
    link = Link(agents, prefill, decode)
    try:
        maps = {}
        for d, dr in enumerate(decode):
            there = handshake(dr)
            p = d * ptp // dtp
            m = block_map(
                prefill[p].registration,
                there,
                src_slots=p_slots,
                dst_slots=d_slots,
                src_shard=prefill[p].shard,
            )
            pages = block_map(
                prefill[p].registration,
                there,
                kv_to_page_indices(p_slots, PAGE),
                kv_to_page_indices(d_slots, d_page),
                num_tokens=TOKENS,
                src_shard=prefill[p].shard,
            )
            assert pages.fingerprint == m.fingerprint and prefill[p].shard.sends_to(shard_of(there))
            maps[p, d] = m
        post(link, maps, "direct", 0)
    finally:
        link.close(prefill + decode)
    for d, dr in enumerate(decode):
        p = d * ptp // dtp
        for i, t in enumerate(dr.tensors):
            want = torch.zeros_like(t)
            for tok in range(TOKENS):
                want[d_slots[tok]] = prefill[p].tensors[i][p_slots[tok], 2 * (d % 2) : 2 * (d % 2) + 2]
            assert torch.equal(t, want), (d, i)


def test_chunked_prefill_sends_each_chunk_as_sglang_cuts_it(agents: tuple[Any, Any]) -> None:
    """Chunked prefill (``prefill.py`` ``send_kv_chunk``): each chunk is ``req_to_token[
    start_send_idx:end_idx]``, a non-last chunk's end floored to a page (its partial page
    goes with the next), its ``kv_to_page_indices`` zipped with the decode's pages from
    ``start_send_idx // page_size``. Each chunk maps alone (its pages, its tokens) or as
    ``first_token`` of the request's pages so far: the same runs. TP 2 into TP 4."""
    heads, ptp, dtp, chunk = 8, 2, 4, 50
    pages = -(-TOKENS // PAGE)
    p_slots = slots_of(scattered_pages(pages, 12, 13), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 14, 14), PAGE, TOKENS)
    cuts, start = [], 0
    while start < TOKENS:
        end = min(start + chunk, TOKENS)
        end = end if end == TOKENS else end - end % PAGE
        cuts.append((start, end))
        start = end
    assert cuts == [(0, 48), (48, 96), (96, 144), (144, 150)]
    prefill = [
        detect_rank(mha_pool(12, PAGE, 4, seed=70 + p), PAGE, Shard(p, ptp, heads)) for p in range(ptp)
    ]
    decode = [detect_rank(mha_pool(14, PAGE, 2, seed=None), PAGE, Shard(d, dtp, heads)) for d in range(dtp)]
    link = Link(agents, prefill, decode)
    try:
        for c, (a, b) in enumerate(cuts):
            src_pages = kv_to_page_indices(p_slots[a:b], PAGE)  # what SGLang's sender gets
            dst_pages = kv_to_page_indices(d_slots, PAGE)[a // PAGE : a // PAGE + len(src_pages)]
            maps = {}
            for d, dr in enumerate(decode):
                there = handshake(dr)
                p = d * ptp // dtp
                m = block_map(
                    prefill[p].registration,
                    there,
                    src_pages,
                    dst_pages,
                    num_tokens=b - a,
                    src_shard=prefill[p].shard,
                )
                so_far = block_map(
                    prefill[p].registration,
                    there,
                    kv_to_page_indices(p_slots[:b], PAGE),
                    kv_to_page_indices(d_slots[:b], PAGE),
                    num_tokens=b,
                    first_token=a,
                    src_shard=prefill[p].shard,
                )
                assert so_far.fingerprint == m.fingerprint, c
                maps[p, d] = m
            post(link, maps, "direct", 0)
            for d, dr in enumerate(decode):  # after each chunk: its tokens and those before it
                p = d * ptp // dtp
                for i, t in enumerate(dr.tensors):
                    want = torch.zeros_like(t)
                    for tok in range(b):
                        want[d_slots[tok]] = prefill[p].tensors[i][
                            p_slots[tok], 2 * (d % 2) : 2 * (d % 2) + 2
                        ]
                    assert torch.equal(t, want), (c, d, i)
    finally:
        link.close(prefill + decode)


# --- (b) MLA pools -------------------------------------------------------------------------


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1), (2, 4)])
def test_mla_pool_between_tp_degrees(agents: tuple[Any, Any], ptp: int, dtp: int) -> None:
    """MLA latents, whole on every rank: each decode rank takes them from the one prefill
    rank SGLang picks (``sends_to(latents=m.latents)``), whatever head count the shards
    carry (here the model's 16 attention heads, as a connector knows them)."""
    model_heads = 16
    pages = -(-TOKENS // PAGE)
    p_slots = slots_of(scattered_pages(pages, 11, 5), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 13, 6), PAGE, TOKENS)
    prefill = [
        detect_rank(mla_pool(11, PAGE, 30 + p), PAGE, Shard(p, ptp, model_heads), mha=False)
        for p in range(ptp)
    ]
    decode = [
        detect_rank(mla_pool(13, PAGE, None), PAGE, Shard(d, dtp, model_heads), mha=False) for d in range(dtp)
    ]
    assert prefill[0].registration.kernel_groups[0].format.name == "NL_X_NB_BS_HS"
    link = Link(agents, prefill, decode)
    try:
        maps = {}
        for d, dr in enumerate(decode):
            there = handshake(dr)
            for p, pr in enumerate(prefill):
                m = block_map(
                    pr.registration, there, src_slots=p_slots, dst_slots=d_slots, src_shard=pr.shard
                )
                assert m.latents
                if pr.shard.sends_to(shard_of(there), latents=m.latents):
                    maps[p, d] = m
        assert sorted(maps) == sorted(
            (p, d) for d in range(dtp) for p in sglang_targets(d, dtp, ptp, mla=True)
        )
        post(link, maps, "direct", 0)
    finally:
        link.close(prefill + decode)
    for d, dr in enumerate(decode):
        (src,) = sglang_targets(d, dtp, ptp, mla=True)
        for i, t in enumerate(dr.tensors):
            want = torch.zeros_like(t)
            for tok in range(TOKENS):
                want[d_slots[tok], 0] = prefill[src].tensors[i][p_slots[tok], 0]
            assert torch.equal(t, want), (d, i)


# --- (c) SWAKVPool: full and sliding-window layers ----------------------------------------


@dataclass
class SwaRank:
    full: Rank
    swa: Rank
    full_slots: list[int]
    swa_slots: list[int]  # translate_loc_from_full_to_swa of the window's full slots


def swa_rank(
    rank: int, tp: int, heads: int, seed: int | None, full_pages: int, swa_pages: int, order: int
) -> SwaRank:
    """A rank's ``SWAKVPool``: ``full_kv_pool`` of the full layers (1, 3) and
    ``swa_kv_pool`` of the sliding ones (0, 2), MHA pools of their own sizes; the request's
    full slots, and the SWA slots ``full_to_swa_index_mapping`` gives the window's (the SWA
    allocator pages the SWA pool alike: a full page's tokens share an SWA page)."""
    h = len(rank_heads(rank, tp, heads))
    full = detect_rank(mha_pool(full_pages, PAGE, h, seed), PAGE, Shard(rank, tp, heads))
    swa = detect_rank(
        mha_pool(swa_pages, PAGE, h, None if seed is None else seed + 1), PAGE, Shard(rank, tp, heads)
    )
    full_slots = slots_of(scattered_pages(-(-TOKENS // PAGE), full_pages, order), PAGE, TOKENS)
    start = window_start()
    window_pages = scattered_pages(-(-(TOKENS - start) // PAGE), swa_pages, order + 1)
    swa_slots = [window_pages[(t - start) // PAGE] * PAGE + t % PAGE for t in range(start, TOKENS)]
    return SwaRank(full, swa, full_slots, swa_slots)


def window_start() -> int:
    """SGLang's ``window_start``: ``max(0, seq_len - window)`` floored to a page."""
    return max(0, TOKENS - WINDOW) // PAGE * PAGE


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 4), (4, 2)])
def test_swa_hybrid_pool(agents: tuple[Any, Any], ptp: int, dtp: int) -> None:
    """gpt-oss-like ``SWAKVPool`` (8 KV heads): the full pool moves every token by the
    request's pages, the SWA pool the window's pages SGLang sends (from ``window_start``),
    the pages before it SGLang's padding page 0 on both sides (or, by slots, -1), each
    rank pair's two maps joined into one WRITE."""
    heads, start = 8, window_start()
    prefill = [swa_rank(p, ptp, heads, 40 + 2 * rank_heads(p, ptp, heads)[0], 12, 5, 7) for p in range(ptp)]
    decode = [swa_rank(d, dtp, heads, None, 14, 6, 9) for d in range(dtp)]
    skipped = start // PAGE
    link = Link(
        agents, [r for s in prefill for r in (s.full, s.swa)], [r for s in decode for r in (s.full, s.swa)]
    )
    try:
        maps = {}
        for d, ds in enumerate(decode):
            full_there, swa_there = handshake(ds.full), handshake(ds.swa)
            for p, ps in enumerate(prefill):
                kv = block_map(
                    ps.full.registration,
                    full_there,
                    kv_to_page_indices(ps.full_slots, PAGE),
                    kv_to_page_indices(ds.full_slots, PAGE),
                    num_tokens=TOKENS,
                    src_shard=ps.full.shard,
                )
                swa = block_map(
                    ps.swa.registration,
                    swa_there,
                    [0] * skipped + kv_to_page_indices(ps.swa_slots, PAGE),
                    [0] * skipped + kv_to_page_indices(ds.swa_slots, PAGE),
                    num_tokens=TOKENS,
                    first_token=start,
                    src_shard=ps.swa.shard,
                )
                by_slots = block_map(
                    ps.swa.registration,
                    swa_there,
                    src_slots=[-1] * start + ps.swa_slots,
                    dst_slots=[-1] * start + ds.swa_slots,
                    src_shard=ps.swa.shard,
                )
                assert by_slots.fingerprint == swa.fingerprint
                if kv.kind != "empty" and ps.full.shard.sends_to(shard_of(full_there), latents=kv.latents):
                    maps[p, d] = join_maps([kv, swa])
        for p, d in maps:
            assert p in sglang_targets(d, dtp, ptp, mla=False), (p, d)
        post(link, maps, "direct", 0)
    finally:
        link.close([r for s in prefill + decode for r in (s.full, s.swa)])

    def expect(d: int, pool: str, i: int, t: torch.Tensor, first: int) -> torch.Tensor:
        want = torch.zeros_like(t)
        for h_local, h in enumerate(rank_heads(d, dtp, heads)):
            src = next(p for p in sglang_targets(d, dtp, ptp, False) if h in rank_heads(p, ptp, heads))
            s = prefill[src]
            h_src = rank_heads(src, ptp, heads).index(h)
            src_t = (s.full if pool == "full" else s.swa).tensors[i]
            for tok in range(first, TOKENS):
                d_slot = decode[d].full_slots[tok] if pool == "full" else decode[d].swa_slots[tok - first]
                s_slot = s.full_slots[tok] if pool == "full" else s.swa_slots[tok - first]
                want[d_slot, h_local] = src_t[s_slot, h_src]
        return want

    for d, ds in enumerate(decode):
        for i, t in enumerate(ds.full.tensors):
            assert torch.equal(t, expect(d, "full", i, t, 0)), ("full", d, i)
        for i, t in enumerate(ds.swa.tensors):
            assert torch.equal(t, expect(d, "swa", i, t, start)), ("swa", d, i)


# --- (d) HybridLinearKVPool: full attention beside Mamba state (Qwen3-Next-like) ----------


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 4), (4, 2)])
def test_mamba_hybrid_pool(agents: tuple[Any, Any], ptp: int, dtp: int) -> None:
    """Qwen3-Next-like: 2 KV heads of full attention (replicated at TP 4) in an MHA pool,
    and the Gated DeltaNet states (``MambaPool``: per state ``[NL, size + 1, *state]``,
    the request's slot its ``mamba_pool_idx``), sharded by sub-projection and SSM head.
    Each rank pair maps the state (every pair: ``sends_to`` is about replicated heads), the
    KV only where ``sends_to`` picks the pair, joined into one WRITE; a pair with nothing
    in common posts nothing. The state oracle is SGLang's weight sharding (``shard``)."""
    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import LinearModel, device_pool, shard

    heads, slots = 2, 3
    model = LinearModel("gdn_attn", num_layers=2, num_heads=8, head_dim=4, state_size=4, n_groups=4)
    whole = device_pool(model, 1, slots, generator=torch.Generator().manual_seed(50))
    whole_states = [*whole.mamba_cache.conv, whole.mamba_cache.temporal]
    pages = -(-TOKENS // PAGE)
    p_slots = slots_of(scattered_pages(pages, 12, 11), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 14, 12), PAGE, TOKENS)
    p_idx, d_idx = 2, 1  # the request's mamba_pool_idx on each side

    def ranks(tp: int, seeded: bool) -> list[tuple[Rank, dict[str, Rank], list[torch.Tensor]]]:
        out = []
        for r in range(tp):
            h = rank_heads(r, tp, heads)
            kv = detect_rank(
                mha_pool(12 if seeded else 14, PAGE, len(h), 60 + h[0] if seeded else None),
                PAGE,
                Shard(r, tp, heads),
            )
            pool = device_pool(model, tp, slots)
            states = [*pool.mamba_cache.conv, pool.mamba_cache.temporal]
            if seeded:
                for t, part in zip(states, shard(model, whole_states, tp, r), strict=True):
                    t.copy_(part)
            regs = mamba_state_pools(pool, "gdn_attn")
            out.append((kv, {n: Rank(list(states), reg, kv.shard) for n, reg in regs.items()}, states))
        return out

    prefill, decode = ranks(ptp, True), ranks(dtp, False)
    every = [r for kv, st, _ in prefill + decode for r in (kv, *st.values())]
    link = Link(
        agents,
        [r for kv, st, _ in prefill for r in (kv, *st.values())],
        [r for kv, st, _ in decode for r in (kv, *st.values())],
    )
    try:
        maps, state_pairs = {}, set()
        for d, (dkv, dst, _) in enumerate(decode):
            kv_there = handshake(dkv)
            state_there = {n: handshake(r) for n, r in dst.items()}
            for p, (pkv, pst, _) in enumerate(prefill):
                parts = []
                kv = block_map(
                    pkv.registration, kv_there, src_slots=p_slots, dst_slots=d_slots, src_shard=pkv.shard
                )
                if kv.kind != "empty" and pkv.shard.sends_to(shard_of(kv_there), latents=kv.latents):
                    parts.append(kv)
                for n, r in pst.items():
                    m = block_map(r.registration, state_there[n], [p_idx], [d_idx], src_shard=r.shard)
                    if m.kind != "empty":
                        parts.append(m)
                        state_pairs.add((p, d))
                if parts:
                    maps[p, d] = join_maps(parts)
        # the pairs a state slice moves between are the rank pairs SGLang's receiver sets up
        assert state_pairs == {(p, d) for d in range(dtp) for p in sglang_targets(d, dtp, ptp, mla=False)}
        post(link, maps, "direct", 0)
    finally:
        link.close(every)

    for d, (dkv, _, states) in enumerate(decode):
        for got, want in zip(states, shard(model, whole_states, dtp, d), strict=True):
            assert torch.equal(got[:, d_idx], want[:, p_idx]), d
            assert not got[:, [i for i in range(slots + 1) if i != d_idx]].any(), d
        for i, t in enumerate(dkv.tensors):
            want = torch.zeros_like(t)
            for h_local, hd in enumerate(rank_heads(d, dtp, heads)):
                src = next(p for p in sglang_targets(d, dtp, ptp, False) if hd in rank_heads(p, ptp, heads))
                h_src = rank_heads(src, ptp, heads).index(hd)
                for tok in range(TOKENS):
                    want[d_slots[tok], h_local] = prefill[src][0].tensors[i][p_slots[tok], h_src]
            assert torch.equal(t, want), (d, i)


# --- (e) pipeline parallelism: a stage's layers into decode's -----------------------------

PP_LAYERS = 4  # the model's layers, two a stage at PP 2 (SGLang's even split, layers 0-1 and 2-3)


def stage_layers(stage: int, pp: int) -> range:
    """The layers PP rank ``stage`` holds: its pool's ``[start_layer, end_layer)``."""
    per = PP_LAYERS // pp
    return range(stage * per, (stage + 1) * per)


@pytest.mark.parametrize(
    ("kind", "ptp", "dtp", "dpp"), [("mha", 2, 4, 1), ("mha", 2, 2, 2), ("mla", 1, 2, 1)]
)
def test_pipeline_stages(agents: tuple[Any, Any], kind: str, ptp: int, dtp: int, dpp: int) -> None:
    """Prefill at PP 2 into decode at PP 1 or 2 (``CommonKVReceiver``: decode's PP size is
    prefill's or 1). Each prefill stage's pool holds its layers only (``MHATokenToKVPool``
    of ``start_layer``/``end_layer``: ``end_layer - start_layer`` K and V buffers, layer
    ``l`` at ``k_buffer[l - start_layer]``), its ``get_contiguous_buf_infos`` lists them,
    and ``get_mha_kv_ptrs_with_pp`` / ``get_mla_kv_ptrs_with_pp`` pair its layer ``i`` with
    decode's entry ``prefill_start_layer + i`` (K and V) where decode holds every layer
    (``target_pp_ranks``: every prefill stage), with decode's same stage where PP sizes
    match. As a connector: each stage numbers its registration with its layers, decode
    describes its pool (at PP 2 numbered alike), and each stage maps into the description
    cut to its layers (``for_layers``), each stage with its own ``req_to_token`` pages."""
    heads, ppp = 8, 2
    mla = kind == "mla"
    pages = -(-TOKENS // PAGE)

    def rank(stage: int, pp: int, r: int, tp: int, seed: int | None, total: int) -> Rank:
        layers = stage_layers(stage, pp)
        if mla:
            tensors = mla_pool(total, PAGE, seed, layers=len(layers))
            got = detect_rank(tensors, PAGE, Shard(r, tp, heads), mha=False)
        else:
            h = rank_heads(r, tp, heads)
            tensors = mha_pool(total, PAGE, len(h), seed, layers=len(layers))
            got = detect_rank(tensors, PAGE, Shard(r, tp, heads))
        got.registration = got.registration.numbered(layers)
        got.extra["layers"] = layers
        return got

    prefill = {(s, p): rank(s, ppp, p, ptp, 80 + 10 * s + p, 12) for s in range(ppp) for p in range(ptp)}
    decode = {(s, d): rank(s, dpp, d, dtp, None, 14) for s in range(dpp) for d in range(dtp)}
    p_slots = {s: slots_of(scattered_pages(pages, 12, 20 + s), PAGE, TOKENS) for s in range(ppp)}
    d_slots = {s: slots_of(scattered_pages(pages, 14, 30 + s), PAGE, TOKENS) for s in range(dpp)}

    # a stage's registration as detected (layers from 0) is refused against decode's whole pool
    unnumbered = kvlayout.detect(
        prefill[1, 0].tensors,
        "sglang",
        {"tokens_per_block": PAGE} | ({} if mla else {"kv_list_layout": "k_v"}),
    )
    if dpp == 1:
        with pytest.raises(BlockMapError, match=r"for_layers"):
            block_map(unnumbered, handshake(decode[0, 0]), [1] * pages, [1] * pages, num_tokens=TOKENS)

    link = Link(agents, list(prefill.values()), list(decode.values()))
    try:
        maps = {}
        for (ds, d), dr in decode.items():
            there = handshake(dr)
            for (s, p), pr in prefill.items():
                if not set(pr.extra["layers"]) & set(dr.extra["layers"]):
                    continue  # SGLang pairs equal PP sizes stage to stage
                m = block_map(
                    pr.registration,
                    there.for_layers(pr.extra["layers"]),
                    kv_to_page_indices(p_slots[s], PAGE),
                    kv_to_page_indices(d_slots[ds], PAGE),
                    num_tokens=TOKENS,
                    src_shard=pr.shard,
                )
                if m.kind != "empty" and pr.shard.sends_to(shard_of(there), latents=m.latents):
                    maps[s * ptp + p, ds * dtp + d] = m
        for p, d in maps:
            assert p % ptp in sglang_targets(d % dtp, dtp, ptp, mla), (p, d)
        assert {p // ptp for p, _ in maps} == set(range(ppp))
        post(link, maps, "direct", 0)
    finally:
        link.close([*prefill.values(), *decode.values()])

    # SGLang's oracle: decode layer g (entry g - its start_layer, K then V) holds, for each
    # token and head, the prefill stage's layer g (entry g - that stage's start_layer)
    for (ds, d), dr in decode.items():
        nl = len(dr.extra["layers"])
        for i, t in enumerate(dr.tensors):
            g = dr.extra["layers"][i % nl]
            s = g // (PP_LAYERS // ppp)
            j = (i // nl) * (PP_LAYERS // ppp) + g - stage_layers(s, ppp).start  # the stage's entry
            want = torch.zeros_like(t)
            if mla:
                (src,) = sglang_targets(d, dtp, ptp, mla=True)
                for tok in range(TOKENS):
                    want[d_slots[ds][tok]] = prefill[s, src].tensors[j][p_slots[s][tok]]
            else:
                for h_local, h in enumerate(rank_heads(d, dtp, heads)):
                    src = next(
                        p for p in sglang_targets(d, dtp, ptp, False) if h in rank_heads(p, ptp, heads)
                    )
                    h_src = rank_heads(src, ptp, heads).index(h)
                    for tok in range(TOKENS):
                        want[d_slots[ds][tok], h_local] = prefill[s, src].tensors[j][p_slots[s][tok], h_src]
            assert torch.equal(t, want), (ds, d, i)


# --- (f) speculative decoding: the draft model's KV pool beside the target's ---------------


@pytest.mark.parametrize(
    ("kind", "ptp", "dtp", "prefill_draft"),
    [("mha", 2, 4, True), ("mha", 4, 2, True), ("mla", 1, 2, True), ("mha", 2, 2, False)],
)
def test_speculative_draft_pool(
    agents: tuple[Any, Any], kind: str, ptp: int, dtp: int, prefill_draft: bool
) -> None:
    """EAGLE / MTP (``prefill.py`` and ``decode.py`` ``_init_kv_manager``): where the
    worker has a ``draft_token_to_kv_pool``, its ``get_contiguous_buf_infos()`` is appended
    to the target's in ``kv_data_ptrs`` (MHA ``[K..., V..., draft K..., draft V...]``,
    MLA ``[kv..., draft kv...]``), "the indices are always shared with a target model":
    the request's one page list moves the target's pages and the draft's. (EAGLE's hidden
    states travel in the metadata buffers, one row a request, not in a KV pool.) Here
    the draft is one layer (an EAGLE head over Llama: the target's 8 KV heads, sharded
    alike; DeepSeek's NextN: one MLA layer). As a connector: detect the target's pool and
    the draft's apart, map both with the same page ids, ``join_maps`` them into one WRITE.
    Decode with a draft pool facing a prefill without one (``get_mha_kv_ptrs_with_pp``'s
    "Decode has draft model KV while Prefill is deployed without speculative decoding")
    moves the target alone and leaves decode's draft pool as it was."""
    heads, mla = 8, kind == "mla"
    pages = -(-TOKENS // PAGE)
    p_slots = slots_of(scattered_pages(pages, 12, 41), PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 14, 42), PAGE, TOKENS)

    def rank(r: int, tp: int, seed: int | None, total: int, layers: int) -> Rank:
        if mla:
            return detect_rank(mla_pool(total, PAGE, seed, layers), PAGE, Shard(r, tp, heads), mha=False)
        h = rank_heads(r, tp, heads)
        return detect_rank(mha_pool(total, PAGE, len(h), seed, layers), PAGE, Shard(r, tp, heads))

    def side(tp: int, seeded: bool, total: int, draft: bool) -> list[tuple[Rank, Rank | None]]:
        out = []
        for r in range(tp):
            seed = 90 + 2 * (rank_heads(r, tp, heads)[0] if not mla else r) if seeded else None
            target = rank(r, tp, seed, total, LAYERS)
            out.append((target, rank(r, tp, None if seed is None else seed + 1, total, 1) if draft else None))
        return out

    prefill, decode = side(ptp, True, 12, prefill_draft), side(dtp, False, 14, True)
    every = [r for pair in prefill + decode for r in pair if r is not None]
    # decode's draft pool holds what it held before (here noise): a map writes only its pages
    for _, dd in decode:
        assert dd is not None
        for i, t in enumerate(dd.tensors):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype))
    before = [t.clone() for _, dd in decode if dd is not None for t in dd.tensors]
    src_pages, dst_pages = kv_to_page_indices(p_slots, PAGE), kv_to_page_indices(d_slots, PAGE)
    link = Link(
        agents,
        [r for pair in prefill for r in pair if r is not None],
        [r for pair in decode for r in pair if r is not None],
    )
    try:
        maps = {}
        for d, (dt, dd) in enumerate(decode):
            assert dd is not None
            target_there, draft_there = handshake(dt), handshake(dd)
            for p, (pt, pd) in enumerate(prefill):
                kv = block_map(
                    pt.registration, target_there, src_pages, dst_pages, num_tokens=TOKENS, src_shard=pt.shard
                )
                if kv.kind == "empty" or not pt.shard.sends_to(shard_of(target_there), latents=kv.latents):
                    continue
                parts = [kv]
                if pd is not None:  # the draft's pages are the target's page ids
                    parts.append(
                        block_map(
                            pd.registration,
                            draft_there,
                            src_pages,
                            dst_pages,
                            num_tokens=TOKENS,
                            src_shard=pd.shard,
                        )
                    )
                maps[p, d] = join_maps(parts)
        for p, d in maps:
            assert p in sglang_targets(d, dtp, ptp, mla), (p, d)
        post(link, maps, "direct", 0)
    finally:
        link.close(every)

    def sources(d: int) -> list[tuple[int | slice, int, int | slice]]:
        """Decode rank ``d``'s heads (MLA: its latents), each with the prefill rank SGLang
        takes it from and that rank's head."""
        if mla:
            return [(slice(None), sglang_targets(d, dtp, ptp, mla=True)[0], slice(None))]
        out: list[tuple[int | slice, int, int | slice]] = []
        for h_local, h in enumerate(rank_heads(d, dtp, heads)):
            src = next(p for p in sglang_targets(d, dtp, ptp, False) if h in rank_heads(p, ptp, heads))
            out.append((h_local, src, rank_heads(src, ptp, heads).index(h)))
        return out

    def expect(d: int, pool: int, i: int, base: torch.Tensor) -> torch.Tensor:
        """SGLang's indexing: decode ``buffer[i][slot, head]`` of each token and head it
        holds is its source rank's ``buffer[i][slot, head]``; every other byte ``base``'s."""
        want = base.clone()
        for h_local, src, h_src in sources(d):
            source = prefill[src][pool]
            assert source is not None
            for tok in range(TOKENS):
                want[d_slots[tok], h_local] = source.tensors[i][p_slots[tok], h_src]
        return want

    k = 0
    for d, (dt, dd) in enumerate(decode):
        assert dd is not None
        for i, t in enumerate(dt.tensors):
            assert torch.equal(t, expect(d, 0, i, torch.zeros_like(t))), ("target", d, i)
        for i, t in enumerate(dd.tensors):
            want = expect(d, 1, i, before[k]) if prefill_draft else before[k]
            k += 1
            assert torch.equal(t, want), ("draft", d, i)


# --- (g) decode's radix cache: the pages it holds already are not sent ---------------------


@pytest.mark.parametrize(("prefix", "tokens"), [(64, TOKENS), (144, 144)])
def test_decode_radix_cache_prefix(agents: tuple[Any, Any], prefix: int, tokens: int) -> None:
    """``--disaggregation-decode-enable-radix-cache``: decode matches the prompt in its
    radix cache (page-aligned), its receiver sends prefill ``decode_prefix_len`` with the
    page list of the tokens after it (``kv_to_page_indices(req_to_token[prefix:len])``),
    and prefill starts its sender there (``req.start_send_idx = decode_prefix_len``,
    ``send_kv_chunk``'s ``req_to_token[start_send_idx:end_idx]``). A full hit sends no page
    (``TransferInfo.is_dummy``: not a dummy, its aux and state still go). As a connector:
    map the pages after the prefix on both sides (tokens counted from it), or the whole
    rows with ``first_token=decode_prefix_len``: the same runs; the prefix's pages, shared
    with other requests in decode's radix tree, are neither read nor written."""
    heads, ptp, dtp = 8, 2, 4
    pages = -(-tokens // PAGE)
    p_slots = slots_of(scattered_pages(pages, 12, 51), PAGE, tokens)
    d_slots = slots_of(scattered_pages(pages, 14, 52), PAGE, tokens)
    prefill = [detect_rank(mha_pool(12, PAGE, 4, 95 + p), PAGE, Shard(p, ptp, heads)) for p in range(ptp)]
    decode = [detect_rank(mha_pool(14, PAGE, 2, 99 + d), PAGE, Shard(d, dtp, heads)) for d in range(dtp)]
    before = [[t.clone() for t in dr.tensors] for dr in decode]
    skip = prefix // PAGE
    link = Link(agents, prefill, decode)
    try:
        maps = {}
        for d, dr in enumerate(decode):
            there = handshake(dr)
            p = d * ptp // dtp
            sent = block_map(
                prefill[p].registration,
                there,
                kv_to_page_indices(p_slots[prefix:], PAGE),  # what prefill's sender gets
                kv_to_page_indices(d_slots[prefix:], PAGE),  # what decode's receiver sent
                num_tokens=tokens - prefix,
                src_shard=prefill[p].shard,
            )
            whole = block_map(
                prefill[p].registration,
                there,
                kv_to_page_indices(p_slots, PAGE),
                kv_to_page_indices(d_slots, PAGE),
                num_tokens=tokens,
                first_token=prefix,
                src_shard=prefill[p].shard,
            )
            assert whole.fingerprint == sent.fingerprint
            assert len(kv_to_page_indices(d_slots[prefix:], PAGE)) == pages - skip
            if sent.num_bytes:
                maps[p, d] = sent
            else:  # a full hit: nothing of the KV to post
                assert prefix == tokens and sent.num_runs == 0
        post(link, maps, "direct", 0)
    finally:
        link.close(prefill + decode)
    for d, dr in enumerate(decode):
        p = d * ptp // dtp
        for i, t in enumerate(dr.tensors):
            want = before[d][i].clone()
            for tok in range(prefix, tokens):
                want[d_slots[tok]] = prefill[p].tensors[i][p_slots[tok], 2 * (d % 2) : 2 * (d % 2) + 2]
            assert torch.equal(t, want), (d, i)


# --- (h) NSA (DeepSeek-V3.2): FP8 latents and the indexer's key pages ----------------------

NSA_PAGE, NSA_RECORD, INDEX_DIM = 64, 656, 128  # SGLang asserts page_size 64 for NSA on CUDA


def nsa_pool(
    pages: int, seed: int | None, layers: int = LAYERS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``NSATokenToKVPool`` under ``fp8_e4m3``: per layer ``kv_buffer`` uint8 ``[size +
    page_size, 1, 656]`` (``get_contiguous_buf_infos``) and ``index_k_with_scale_buffer``
    uint8 ``[(size + page_size + 1) // page_size, page_size * (128 + 4)]``
    (``get_state_buf_infos``, state type ``"nsa"``): page ``i``'s fp8 keys
    ``buf[i, :page_size * 128]``, then their float32 scales."""
    size = pages * NSA_PAGE
    kv_shape = (size + NSA_PAGE, 1, NSA_RECORD)
    index_shape = ((size + NSA_PAGE + 1) // NSA_PAGE, NSA_PAGE * (INDEX_DIM + INDEX_DIM // 128 * 4))
    if seed is None:
        return (
            [torch.zeros(kv_shape, dtype=torch.uint8) for _ in range(layers)],
            [torch.zeros(index_shape, dtype=torch.uint8) for _ in range(layers)],
        )
    gen = torch.Generator().manual_seed(seed)
    return (
        [torch.randint(0, 256, kv_shape, dtype=torch.uint8, generator=gen) for _ in range(layers)],
        [torch.randint(0, 256, index_shape, dtype=torch.uint8, generator=gen) for _ in range(layers)],
    )


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1)])
def test_nsa_pool_with_indexer(agents: tuple[Any, Any], ptp: int, dtp: int) -> None:
    """DeepSeek-V3.2's ``NSATokenToKVPool``: the latents by the request's KV pages, the
    indexer's key pages (``state_data_ptrs``) by the same page ids (the indexer's page
    ``p`` holds the keys of KV page ``p``'s tokens: ``get_cpu_copy`` takes both by
    ``indices[::page_size] // page_size``), both whole on every rank, so each decode rank
    takes them from the one prefill rank SGLang picks (MLA), joined into one WRITE."""
    model_heads = 16
    pages = -(-TOKENS // NSA_PAGE)
    p_slots = slots_of(scattered_pages(pages, 5, 61), NSA_PAGE, TOKENS)
    d_slots = slots_of(scattered_pages(pages, 6, 62), NSA_PAGE, TOKENS)
    src_pages, dst_pages = kv_to_page_indices(p_slots, NSA_PAGE), kv_to_page_indices(d_slots, NSA_PAGE)

    def ranks(tp: int, total: int, seeded: bool) -> list[tuple[Rank, Rank]]:
        out = []
        for r in range(tp):
            kv, index = nsa_pool(total, 70 + r if seeded else None)
            shard = Shard(r, tp, model_heads)
            out.append(
                (detect_rank(kv, NSA_PAGE, shard, mha=False), detect_rank(index, NSA_PAGE, shard, mha=False))
            )
        return out

    prefill, decode = ranks(ptp, 5, True), ranks(dtp, 6, False)
    assert prefill[0][1].registration.kernel_groups[0].format.name == "NL_X_NB_BSV_BSS"
    link = Link(agents, [r for pair in prefill for r in pair], [r for pair in decode for r in pair])
    try:
        maps = {}
        for d, (dkv, dindex) in enumerate(decode):
            kv_there, index_there = handshake(dkv), handshake(dindex)
            for p, (pkv, pindex) in enumerate(prefill):
                kv = block_map(
                    pkv.registration, kv_there, src_pages, dst_pages, num_tokens=TOKENS, src_shard=pkv.shard
                )
                index = block_map(
                    pindex.registration,
                    index_there,
                    src_pages,
                    dst_pages,
                    num_tokens=TOKENS,
                    src_shard=pindex.shard,
                )
                assert kv.latents and index.latents
                if pkv.shard.sends_to(shard_of(kv_there), latents=kv.latents):
                    maps[p, d] = join_maps([kv, index])
        assert sorted(maps) == sorted(
            (p, d) for d in range(dtp) for p in sglang_targets(d, dtp, ptp, mla=True)
        )
        post(link, maps, "direct", 0)
    finally:
        link.close([r for pair in prefill + decode for r in pair])

    keys = NSA_PAGE * INDEX_DIM  # where a page's scales start
    for d, (dkv, dindex) in enumerate(decode):
        (src,) = sglang_targets(d, dtp, ptp, mla=True)
        skv, sindex = prefill[src]
        for i, t in enumerate(dkv.tensors):
            want = torch.zeros_like(t)
            for tok in range(TOKENS):
                want[d_slots[tok], 0] = skv.tensors[i][p_slots[tok], 0]
            assert torch.equal(t, want), ("latents", d, i)
        for i, t in enumerate(dindex.tensors):
            want = torch.zeros_like(t)
            for tok in range(TOKENS):
                a, b, r = src_pages[tok // NSA_PAGE], dst_pages[tok // NSA_PAGE], tok % NSA_PAGE
                k, s = slice(r * INDEX_DIM, (r + 1) * INDEX_DIM), slice(keys + 4 * r, keys + 4 * r + 4)
                want[b, k], want[b, s] = sindex.tensors[i][a, k], sindex.tensors[i][a, s]
            assert torch.equal(t, want), ("indexer", d, i)
