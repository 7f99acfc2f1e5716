"""MLA latents between P prefill and D decode TP ranks. Every rank holds them whole, so
every (prefill rank, decode rank) pair's map moves the same bytes, and one prefill rank
sends them to each decode rank: vLLM's NixlConnector reads the whole block from prefill
rank ``d * P // D`` (``compute_tp_mapping``; pd-transfer-facts.md 1.4, 1.7), SGLang's
decode picks one prefill rank as its source. ``Shard.sends_to(dst, latents=m.latents)``
says which whatever head count the shards carry: the model's attention heads, as a user
might pass (DeepSeek-V3's 128), or a drafter's KV heads beside an MLA target's latents
(one registration, one shard). Without ``latents`` a shard of as many heads as ranks
made every prefill rank a sender of the whole latents."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import kvlayout
from kvlayout.transfer import Shard, block_map

NB, BS, NL, TOKENS = 6, 16, 2, 40  # 40 tokens: two whole blocks and a part of a third
SRC_IDS, DST_IDS = [4, 0, 2], [1, 5, 3]
TP = [1, 2, 4, 8]


def mla_rank(seed: int | None) -> tuple[list[torch.Tensor], object]:
    """One rank's vLLM MLA registration (``[NB, 1, BS, 576]`` a layer, ``kv_dim=1``):
    random latents of ``seed`` (each prefill rank its own, so what a decode rank holds
    says which rank sent it), or zeros."""
    gen = torch.Generator().manual_seed(seed or 0)
    kv = [
        torch.randn(NB, 1, BS, 576, generator=gen).to(torch.bfloat16)
        if seed is not None
        else torch.zeros(NB, 1, BS, 576, dtype=torch.bfloat16)
        for _ in range(NL)
    ]
    return kv, kvlayout.detect(kv, "vllm", {"kv_dim": 1})


def moved(kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The request's ``TOKENS`` rows of every layer, from blocks ``ids`` in order."""
    return torch.stack([torch.cat([t[b, 0] for b in ids])[:TOKENS] for t in kv])


@pytest.mark.parametrize("heads", [1, 8, 128])
@pytest.mark.parametrize(("src_tp", "dst_tp"), list(itertools.product(TP, TP)))
def test_each_decode_rank_receives_the_latents_once(src_tp: int, dst_tp: int, heads: int) -> None:
    prefill = [mla_rank(seed=1 + p) for p in range(src_tp)]
    for d in range(dst_tp):
        dst_shard = Shard(d, dst_tp, heads)
        out, into = mla_rank(None)
        maps = [
            block_map(reg, into, SRC_IDS, DST_IDS, num_tokens=TOKENS,
                      src_shard=Shard(p, src_tp, heads), dst_shard=dst_shard)
            for p, (_, reg) in enumerate(prefill)
        ]  # fmt: skip
        assert all(m.latents and m.kind != "empty" for m in maps)
        # every pair's map moves the same bytes, the whole latents: each its own rank's
        assert len({(m.num_bytes, m.num_runs) for m in maps}) == 1
        assert maps[0].num_bytes == NL * TOKENS * 576 * 2
        for (kv, _), m in zip(prefill, maps, strict=True):
            for t in out:
                t.zero_()
            m.copy()
            assert torch.equal(moved(out, DST_IDS), moved(kv, SRC_IDS))
        # one sender, vLLM's: decode rank d reads prefill rank d * P // D
        senders = [
            p for p, m in enumerate(maps) if Shard(p, src_tp, heads).sends_to(dst_shard, latents=m.latents)
        ]
        assert senders == [d * src_tp // dst_tp], (d, senders)
        # num_kv_heads=1 (the documented latent shard) picks the same rank without the flag
        assert [p for p in range(src_tp) if Shard(p, src_tp, 1).sends_to(Shard(d, dst_tp, 1))] == senders


def test_a_head_count_on_latents_without_the_flag_makes_every_rank_a_sender() -> None:
    """What the flag is for: the rule of heads reads a shard of 8 heads at TP 4 as 2 heads
    a rank, no replicas, so every prefill rank "sends what it holds", which for latents is
    the whole cache, four times over."""
    assert [p for p in range(4) if Shard(p, 4, 8).sends_to(Shard(0, 2, 8))] == [0, 1, 2, 3]
    assert [p for p in range(4) if Shard(p, 4, 8).sends_to(Shard(0, 2, 8), latents=True)] == [0]


def test_heads_are_not_latents() -> None:
    """A map of KV heads keeps the rule of heads (``latents`` False): 8 heads at TP 2 into
    TP 4, decode rank 1 takes heads 2-3 from prefill rank 0, and prefill rank 1 (heads
    4-7) has none of them: its map is empty."""
    nhd = {"kv_layout": "NHD"}
    src = [kvlayout.detect([torch.randn(2, NB, BS, 4, 8) for _ in range(NL)], "vllm", nhd) for _ in range(2)]
    dst = kvlayout.detect([torch.zeros(2, NB, BS, 2, 8) for _ in range(NL)], "vllm", nhd)
    maps = [
        block_map(src[p], dst, [1], [2], src_shard=Shard(p, 2, 8), dst_shard=Shard(1, 4, 8)) for p in range(2)
    ]
    assert [(m.latents, m.kind) for m in maps] == [(False, "head slice"), (False, "empty")]
    assert Shard(0, 2, 8).sends_to(Shard(1, 4, 8), latents=maps[0].latents)


@pytest.mark.parametrize("kv_heads", [None, 8, 128])
def test_plan_sends_the_latents_to_each_decode_rank_once(
    capsys: pytest.CaptureFixture[str], kv_heads: int | None
) -> None:
    """``kvlayout plan``'s P x D pairing of MLA latents, with and without the model's
    heads on its command line: each decode rank one sender, vLLM's, the same bytes."""
    from kvlayout.tools.cli import main

    heads = ["--kv-heads", str(kv_heads)] if kv_heads else []
    for src_tp, dst_tp in itertools.product(TP, TP):
        code = main(["plan", "--src-engine", "vllm", "--src-shape", "2x[6,16,576]", "--src-tp", str(src_tp),
                     "--dst-engine", "vllm", "--dst-shape", "2x[6,16,576]", "--dst-tp", str(dst_tp),
                     "--tokens", "40", *heads, "--json"])  # fmt: skip
        out, _ = capsys.readouterr()
        assert code == 0
        pairs = json.loads(out)["pairs"]
        assert len(pairs) == src_tp * dst_tp
        sending = [(p["src_rank"], p["dst_rank"]) for p in pairs if p["runs"]]
        assert sending == [(d * src_tp // dst_tp, d) for d in range(dst_tp)], (src_tp, dst_tp)
        assert {p["bytes"] for p in pairs if p["runs"]} == {2 * 40 * 576 * 2}
        assert all(p["kind"] == "replica" for p in pairs if not p["runs"])


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 2), (2, 4), (4, 2)])
def test_pages_every_rank_holds_whole_are_latents(src_tp: int, dst_tp: int) -> None:
    """SGLang's DeepSeek-V4 FlashMLA pages (opaque pages of one array every TP rank holds
    whole) are latents: each decode rank takes them from one prefill rank,
    ``d * P // D``, whatever head count the shards carry (here as many as ranks, which
    without ``latents`` made every prefill rank a sender). ``m.latents`` was False for
    any opaque page, so a connector asking it sent the same page P times."""
    from kvlayout.integrations.sglang import flashmla_kv_pages

    pools = [[torch.randint(0, 256, (4, 9792), dtype=torch.uint8) for _ in range(NL)] for _ in range(src_tp)]
    for d in range(dst_tp):
        dst = [torch.zeros(4, 9792, dtype=torch.uint8) for _ in range(NL)]
        senders = []
        for p in range(src_tp):
            src_shard, dst_shard = (
                Shard(p, src_tp, max(src_tp, dst_tp)),
                Shard(d, dst_tp, max(src_tp, dst_tp)),
            )
            m = block_map(
                flashmla_kv_pages(pools[p], 16), flashmla_kv_pages(dst, 16), [3, 1], [0, 2],
                src_shard=src_shard, dst_shard=dst_shard,
            )  # fmt: skip
            assert m.latents and m.num_bytes == 2 * NL * 9792
            if src_shard.sends_to(dst_shard, latents=m.latents):
                senders.append(p)
                m.copy()
        assert senders == [d * src_tp // dst_tp]
        for layer in range(NL):
            assert torch.equal(dst[layer][0], pools[senders[0]][layer][3])
            assert torch.equal(dst[layer][2], pools[senders[0]][layer][1])
