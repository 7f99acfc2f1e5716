"""A P/D connector for vLLM 0.33 hybrid models, as docs/pd-connectors.md tells one to write it,
through real NIXL between two processes (UCX over TCP loopback in the peer), byte-exact
against an oracle from vLLM's own indexing (``pd_hybrid.expected``).

Each rank's cache is what vLLM 0.33 allocates (``pd_hybrid``): a gpt-oss-like model of
sliding-window and full attention (two KV cache groups, the window's dropped blocks vLLM's
null block 0) and a Qwen3-Next-like Gated DeltaNet hybrid (three state groups beside full
attention, Mamba ``'none'`` mode; ``'align'`` mode at TP 1 <-> 2; in ``LBHNC``, the layout
vLLM's NixlConnector asks for, FlashInfer's HND kernel pages at TP 1 <-> 2), at prefill TP 2
-> decode TP 4 and TP 4 -> TP 2. One
request of 300 tokens on scattered block ids moves as the docs say: per rank pair, each
kernel group mapped with its KV cache group's block ids (the sliding window from its first
kept block with ``first_token``, a state by its one block id), an attention group only
where ``sends_to`` picks the pair, a state group from every pair, empty maps skipped, the
rest joined into one transfer with one notification. Posted by decode (a READ from each
prefill rank, vLLM's NixlConnector's way) and by prefill (a WRITE into each decode rank),
direct, staged and peer-staged (the peer gathering or scattering the same joined map,
checked by its fingerprint). The peer process holds one rank at a time
(``NixlPeer.built_cache``).

Bounded: caches of 1-4 MiB, one peer for the module, every wait with a deadline, and a
hard limit on the module (faulthandler).
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvlayout.testing.nixl_peer import AgentPair, Part, agent_pair, tcp_tls
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map, join_maps
from kvlayout.transfer import nixl as nx
from tests.integrations.vllm import pd_hybrid as ph

MODULE_LIMIT_S = 400
TOKENS = 300
BUILDER = "tests.integrations.vllm.pd_hybrid:peer_cache"
SEEDS = {"prefill": 100, "decode": 200}


Pair = AgentPair


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        with agent_pair("kvl-pd-hybrid", [4096], 4 << 20, env={"UCX_TLS": tcp_tls()}) as p:
            yield p
    finally:
        faulthandler.cancel_dump_traceback_later()


def hold(pair: Pair, kind: str, role: str, tp: int, rank: int, staging: bool) -> tuple[Any, Any]:
    """The peer builds the rank (the handshake): its description and, with ``staging``, the
    staging buffer it takes peer-staged requests in (made before its metadata is loaded)."""
    shard = (rank, tp, ph.HEADS[kind])
    text = pair.peer.built_cache(BUILDER, shard, kind=kind, tp=tp, rank=rank, seed=SEEDS[role] + rank)
    at_peer = pair.peer.staging(4 << 20) if staging else None
    pair.agent.remove_remote_agent(pair.name)
    assert pair.agent.add_remote_agent(pair.peer.metadata) == pair.name.encode()
    return RegistrationDescription.from_json(text), at_peer


def request_maps(
    src: Any, dst: Any, src_rank: ph.Rank, dst_rank: ph.Rank, tables: Any
) -> tuple[list[Any], list[Part]]:
    """One rank pair's maps (``pd_hybrid.pair_maps``), and the same as the peer maps its
    half of them (the shards in the descriptions)."""
    maps = ph.pair_maps(src, dst, src_rank, dst_rank, tables, TOKENS)
    return [m for *_, m in maps], [Part(i, *ids, kw) for i, ids, kw, _ in maps]


def wait_notif(pair: Pair, tag: bytes) -> None:
    got = pair.peer.notifs(expect=1, wait=30)
    assert got == [tag], got


# 'align' mode: the small model's blocks are 48 tokens at TP 1 and 2; Qwen3-Next's 544 at TP 2
# and 272 at TP 4, where its 2 KV heads replicate and the attention page per token stops
# shrinking while the state's halves (the running state moves between the two)
PAIRS = [("swa", 2, 4), ("swa", 4, 2), ("gdn", 2, 4), ("gdn", 4, 2), ("gdn-align", 1, 2), ("gdn-align", 2, 1),
         ("gdn-hnd", 1, 2), ("gdn-hnd", 2, 1)]  # fmt: skip
# gdn-hnd: LBHNC, FlashInfer's HND kernel pages read as their kernel pages between the degrees
READ_PAIRS = [*PAIRS, ("qwen3-next-align", 2, 4), ("qwen3-next-align", 4, 2)]  # 6 MiB a rank: READs only


@pytest.mark.parametrize("strategy", ["direct", "staged", "peer-staged"])
@pytest.mark.parametrize(
    ("kind", "ptp", "dtp"), READ_PAIRS, ids=[f"{k} TP {p}->{d}" for k, p, d in READ_PAIRS]
)
def test_decode_reads_a_hybrid_request_from_every_prefill_rank(
    pair: Pair, kind: str, ptp: int, dtp: int, strategy: nx.Strategy
) -> None:
    """Peer-staged: prefill gathers each request into its staging buffer first (``nx.stage``
    of the same joined map, planned from decode's description), as the docs say for a
    decode that READs what prefill slices (TP 2 -> 4: ``kvlayout plan``'s choice)."""
    decode = [ph.rank_of(kind, dtp, d, SEEDS["decode"] + d) for d in range(dtp)]
    prefill = [ph.rank_of(kind, ptp, p, SEEDS["prefill"] + p) for p in range(ptp)]  # twins of the peer's
    rng = np.random.default_rng(5)
    tables = ph.block_tables(prefill[0].engine, TOKENS, rng), ph.block_tables(decode[0].engine, TOKENS, rng)
    before = [d.buf.clone() for d in decode]
    held = [nx.register(pair.agent, d.registration) for d in decode]
    try:
        for p in prefill:
            there, at_peer = hold(pair, kind, "prefill", ptp, p.rank, strategy == "peer-staged")
            for d in decode:
                maps, parts = request_maps(there, d.registration, p, d, tables)
                if not maps:
                    continue
                request = join_maps(maps)
                if at_peer is not None:  # decode's description went to prefill at the handshake
                    here = d.registration.describe(shard=Shard(d.rank, dtp, ph.HEADS[kind])).to_json()
                    pair.peer.stage_joined(here, parts, expect=request.fingerprint)
                tag = f"req-{kind}-{p.rank}-{d.rank}-{strategy}".encode()
                x = nx.transfer(pair.agent, pair.name, request, strategy=strategy, staging=pair.staging,
                                peer_staging=at_peer, notif=tag)  # fmt: skip
                assert x.wait(timeout=30).strategy == strategy
                wait_notif(pair, tag)
    finally:
        for h in held:
            h.deregister()
    for d, b in zip(decode, before, strict=True):
        want = ph.expected(d, b, prefill, tables, TOKENS)
        assert torch.equal(d.buf, want), f"decode rank {d.rank}: {int((d.buf != want).sum())} bytes differ"
        assert not torch.equal(d.buf, b)


@pytest.mark.parametrize("strategy", ["direct", "staged", "peer-staged"])
@pytest.mark.parametrize(("kind", "ptp", "dtp"), PAIRS, ids=[f"{k} TP {p}->{d}" for k, p, d in PAIRS])
def test_prefill_writes_a_hybrid_request_into_every_decode_rank(
    pair: Pair, kind: str, ptp: int, dtp: int, strategy: nx.Strategy
) -> None:
    """Peer-staged: decode scatters each WRITE from its staging buffer once it landed
    (``nx.unstage`` of the same joined map), as the docs say for TP 4 -> 2."""
    prefill = [ph.rank_of(kind, ptp, p, SEEDS["prefill"] + p) for p in range(ptp)]
    rng = np.random.default_rng(6)
    decode_engine = ph.engine_of(kind, dtp)
    tables = ph.block_tables(prefill[0].engine, TOKENS, rng), ph.block_tables(decode_engine, TOKENS, rng)
    held = [nx.register(pair.agent, p.registration) for p in prefill]
    try:
        for d in range(dtp):
            there, at_peer = hold(pair, kind, "decode", dtp, d, strategy == "peer-staged")
            twin = ph.rank_of(kind, dtp, d, SEEDS["decode"] + d)  # the peer's cache as built
            for p in prefill:
                maps, parts = request_maps(p.registration, there, p, twin, tables)
                if not maps:
                    continue
                request = join_maps(maps)
                tag = f"req-{kind}-{p.rank}-{d}-{strategy}".encode()
                x = nx.transfer(pair.agent, pair.name, request, strategy=strategy, staging=pair.staging,
                                peer_staging=at_peer, notif=tag)  # fmt: skip
                assert x.wait(timeout=30).strategy == strategy
                wait_notif(pair, tag)
                if at_peer is not None:  # prefill's description went to decode at the handshake
                    here = p.registration.describe(shard=Shard(p.rank, ptp, ph.HEADS[kind])).to_json()
                    pair.peer.unstage_joined(here, parts, expect=request.fingerprint)
            got = torch.from_numpy(pair.peer.cache_bytes()[0].copy()).view(torch.int8)
            want = ph.expected(twin, twin.buf, prefill, tables, TOKENS)
            assert torch.equal(got, want), f"decode rank {d}: {int((got != want).sum())} bytes differ"
            assert not torch.equal(got, twin.buf)
    finally:
        for h in held:
            h.deregister()


def test_an_align_mode_running_state_moves_between_blocks_of_other_sizes() -> None:
    """Qwen3-Next's sizes in 'align' mode: blocks of 544 tokens at TP 2 and 272 at TP 4 (17
    kernel pages both, so vLLM's NixlConnector serves the pair with prefix caching on,
    moving the running state 1:1). The running state maps by its one block id a side; a map
    of several blocks of state (snapshots at other tokens) stays refused."""
    prefill, decode = ph.rank_of("qwen3-next-align", 2, 0, 1), ph.rank_of("qwen3-next-align", 4, 1, 2)
    assert [r.engine.config.kv_cache_groups[0].kv_cache_spec.block_size for r in (prefill, decode)] == [
        544,
        272,
    ]
    assert [r.engine.kernel_block_sizes[-1] for r in (prefill, decode)] == [32, 16]
    rng = np.random.default_rng(5)
    tables = ph.block_tables(prefill.engine, TOKENS, rng), ph.block_tables(decode.engine, TOKENS, rng)
    before = decode.buf.clone()
    maps, _ = request_maps(prefill.registration, decode.registration, prefill, decode, tables)
    assert [m.kind for m in maps] == ["resharded state"] * 3 + ["re-blocked"]  # one KV head a rank
    join_maps(maps).copy()
    assert torch.equal(decode.buf, ph.expected(decode, before, [prefill], tables, TOKENS))
    with pytest.raises(
        BlockMapError, match=r"blocks of 544 and 272 rows: .* but for a request's running state"
    ):
        block_map(prefill.registration.kernel_groups[0], decode.registration.kernel_groups[0], [1, 2], [3, 4],
                  src_shard=Shard(0, 2, 2), dst_shard=Shard(1, 4, 2))  # fmt: skip
    # one id of a block of two state pages (a src_block_size of twice the cache's) is no one
    # state: a map of blocks of one size reads it as pages 2-3, so the running state's path,
    # which read page 1, refuses it
    refused = r"blocks of 544 and 272 rows: .* but for a request's running state: one block id a side"
    a, b = prefill.registration.kernel_groups[0], decode.registration.kernel_groups[0]
    p0, d1 = Shard(0, 2, 2), Shard(1, 4, 2)
    with pytest.raises(BlockMapError, match=r"of the cache's own blocks \(no other src_block_size"):
        block_map(a, b, [1], [3], src_shard=p0, dst_shard=d1, src_block_size=1088)
    # several blocks on either side, a num_tokens or a first_token: blocks of tokens, not the running state
    cases: list[tuple[list[int], list[int], int | None, int]] = [
        ([1, 2], [3], None, 0), ([1], [3, 4], None, 0), ([1], [3], 1, 0), ([1], [3], 544, 543), ([1], [3], None, 1),
    ]  # fmt: skip
    for src_ids, dst_ids, num_tokens, first_token in cases:
        with pytest.raises(BlockMapError, match=refused):
            block_map(a, b, src_ids, dst_ids, src_shard=p0, dst_shard=d1, num_tokens=num_tokens,
                      first_token=first_token)  # fmt: skip
    # a 'none'-mode state (one row a block: prefix caching off) against an 'align'-mode one
    none_mode = ph.rank_of("gdn", 2, 0, 3).registration.kernel_groups[0]
    align_mode = ph.rank_of("gdn-align", 2, 0, 4).registration.kernel_groups[0]
    for pair in ((none_mode, align_mode), (align_mode, none_mode)):
        with pytest.raises(BlockMapError, match="a 'none'-mode state is one row"):
            block_map(*pair, [1], [2], src_shard=Shard(0, 2, 2), dst_shard=Shard(0, 2, 2))
