"""vLLM 0.33's other ``CircularBufferSpec`` rings, beside DeepSeek-V4.1's compressor ring,
mapped between TP degrees as a P/D connector maps them:

- GLM5-Next's indexer tail ring (``models/glm5next/common/attention.py``,
  ``Glm5NextTailCache``): two head slots, ``[K, gate score]`` bf16, paged by
  ``KpoolTailBackend`` (BLHNC only); K from a ``disable_tp=True`` linear, the gate from an
  unsharded parameter, so every rank holds it whole;
- Qwen4's QSA raw-key ring (``models/qwen4_exp/common/qsa_cache.py``,
  ``QSAKeyStateCache``): one bf16 head from a ``ReplicatedLinear``, capacity
  ``round_up(ratio + speculative tokens, ratio)``;
- Step5's CSA tail ring (``models/step5/nvidia/csa_tail_ring.py``): one main KV page of
  1 KiB ``[index_k | index_z]`` rows (the one index K head every rank loads:
  ``config.py`` allows no other), registered as ``head_size = page / (block * 2)`` at the
  main block size, ``block_stride_alignment`` 1 KiB.

Each is built as vLLM plans it beside its model's other caches (``planned_engine``), and
each outcome is the ring's whole page, where vLLM's writer addresses it and where vLLM's
NixlConnector puts it (read whole from prefill rank ``d * P // D``), or a refusal naming
the ring: the tail ring's page array declared one head slot of two, so between pages
laid out otherwise a map moved half a page (and the wrong half)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvlayout
import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.transfer import BlockMapError, Shard, block_map

pytest.importorskip("vllm.v1.kv_cache_interface")
from tests.integrations.vllm import nixl_connector as nc

kvi = vx.kvi
BF16, NB, LAYERS = torch.bfloat16, 6, 2
TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4)]
ANY = vx.Backend("any", multiple_of=1)  # KpoolTailBackend, QSAStateBackend: MultipleOf(1)


def glm5_next(tp: int) -> dict[str, Any]:
    """MLA latents, the kpool indexer's keys (``Glm5NextIndexerCache``: ``tokens_per_state``
    the pool, 4) and the tail ring (``index_kpool`` 4, one speculative token: 8 slots),
    the same at every TP degree."""
    mla = kvi.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    keys = kvi.MLAAttentionSpec(
        block_size=128, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )  # fmt: skip
    tail = kvi.CircularBufferSpec(
        block_size=8, num_kv_heads=2, head_size=128, head_size_v=0, dtype=BF16, dcp_sharded=False
    )
    return _layers(
        {
            "attn": mla,
            "indexer.k_cache": dataclasses.replace(keys, tokens_per_state=4),
            "indexer.tail_cache": tail,
        }
    )


def qwen4_qsa(tp: int) -> dict[str, Any]:
    """4 KV heads of attention (``4 // tp`` a rank), the compressed keys and the raw-key
    ring (ratio 4, no speculative tokens: 4 rows)."""
    main = kvi.FullAttentionSpec(block_size=64, num_kv_heads=4 // tp, head_size=128, dtype=BF16)
    compressed = kvi.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=128, dtype=BF16, tokens_per_state=4
    )
    ring = kvi.CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=128, head_size_v=0, dtype=BF16)
    return _layers({"attn": main, "indexer.compressed_key_cache": compressed, "indexer.raw_key_cache": ring})


def step5(tp: int, kv_heads: int = 4) -> dict[str, Any]:
    """Attention of ``kv_heads`` KV heads (``index_tp_size`` must equal them) and the CSA
    tail ring sized to the rank's attention page (``Step5CSATailRing.get_kv_cache_spec``)."""
    main = kvi.FullAttentionSpec(
        block_size=64, num_kv_heads=max(kv_heads // tp, 1), head_size=128, dtype=BF16
    )
    ring = kvi.CircularBufferSpec(
        block_size=64, num_kv_heads=1, head_size=main.page_size_bytes // (64 * 2), head_size_v=0, dtype=BF16,
        block_stride_alignment=1024,
    )  # fmt: skip
    return _layers({"attn": main, "attn.csa_tail_ring": ring})


def _layers(caches: dict[str, Any]) -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.{name}": s for i in range(LAYERS) for name, s in caches.items()}


def is_ring(spec: Any) -> bool:
    return isinstance(spec, kvi.CircularBufferSpec)


# -- each ring as its writer addresses it ------------------------------------------------


def glm_rows(view: torch.Tensor, block: int) -> torch.Tensor:
    """``KpoolTailMetadataBuilder``'s slot ``block * ring + p % ring`` over the
    ``[block, head, state, content]`` view: ``[2, ring, C]``, K then the gate score."""
    return view[block]


def qsa_rows(view: torch.Tensor, block: int) -> torch.Tensor:
    """``_QSAStateCache.bind_kv_cache``'s ``[B, N, 1, C]`` view, row ``p % N``."""
    return view.transpose(1, 2)[block]


def step5_rows(view: torch.Tensor, block: int) -> torch.Tensor:
    """``Step5CSATailRing.bind_kv_cache``: 512-element rows, block ``b``'s ring rows
    ``[b * rows_per_block, + capacity)``, ``capacity`` the page's 1 KiB rows."""
    per_block, capacity = view.stride(0) // 512, view[0].numel() // 512
    rows = view.as_strided(((view.shape[0] - 1) * per_block + capacity, 512), (512, 1))
    return rows[block * per_block : block * per_block + capacity]


# each model's specs at a TP degree, the layouts its ring's backend takes, the ring's rows
# as its writer addresses them, and the model's KV heads (the shards' num_kv_heads)
MODELS: dict[str, tuple[Callable[[int], dict[str, Any]], list[Any], Callable[..., torch.Tensor], int]] = {
    "glm5-next-tail": (glm5_next, [vx.KVCacheLayout.BLHNC], glm_rows, 1),
    "qwen4-qsa": (qwen4_qsa, [vx.KVCacheLayout.BLNHC, vx.KVCacheLayout.BLHNC], qsa_rows, 4),
    "step5-csa-tail": (step5, [vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.BLHNC], step5_rows, 4),
    "step5-csa-tail-1-kv-head": (lambda tp: step5(tp, kv_heads=1), [vx.KVCacheLayout.BLHNC], step5_rows, 1),
}


@dataclasses.dataclass
class Worker:
    tp: int
    rank: int
    specs: dict[str, Any]
    buf: torch.Tensor
    kv: dict[str, torch.Tensor]
    registration: Any
    ring: Any  # the ring's kernel group
    rings: list[str]  # its layers, in the group's order


def worker(specs: dict[str, Any], layout: Any, tp: int, rank: int, seed: int) -> Worker:
    """A P/D worker's registration (``prefix_reuse=False``: the ring registered too)."""
    engine = vx.planned_engine(specs, ANY, layout=layout, num_blocks=NB)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, seed)
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, edited)
    registration = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    names = [n for n in kv if n in edited]
    ring = next(g for g in registration.kernel_groups if is_ring(specs[names[g.layers[0]]]))
    return Worker(tp, rank, specs, buf, kv, registration, ring, [names[i] for i in ring.layers])


def described(w: Worker, shard: Shard) -> Any:
    """The ring's group as a peer describes it."""
    return w.registration.describe(shard=shard).group(w.registration.kernel_groups.index(w.ring))


def connector_rank(w: Worker, layout: Any) -> Any:
    """The ring's regions as vLLM's NixlConnector registers them, each layer's page read
    whole (rings count as attention there; ``mla``: whole, from rank ``d * P // D``)."""
    return nc.Rank(w.tp, w.rank, 1, layout, w.buf, {n: w.kv[n] for n in w.rings}, mla=True)


def rebased(view: torch.Tensor, buf: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``view`` (of ``buf``) over ``other``, a buffer of ``buf``'s size."""
    offset = (view.data_ptr() - buf.data_ptr()) // view.element_size()
    return other.view(view.dtype).as_strided(view.shape, view.stride(), offset)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)  # random bytes hold NaNs: compare the bits


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
@pytest.mark.parametrize(
    ("model", "layout"),
    [(m, layout) for m, (_, layouts, _, _) in MODELS.items() for layout in layouts],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_a_ring_moves_whole_or_is_refused_naming_the_ring(
    model: str, layout: Any, src_tp: int, dst_tp: int
) -> None:
    """Each decode rank takes the ring from the prefill rank ``sends_to`` picks (vLLM's:
    ``d * P // D``), its whole page, where the writer reads it, as vLLM's connector lands
    it, other blocks untouched; a described peer maps the same bytes. Pages that differ
    (Step5's ring is the rank's attention page: its capacity changes with the heads a
    rank holds) are refused, naming the ring."""
    make, _, rows, heads = MODELS[model]
    prefill = [worker(make(src_tp), layout, src_tp, p, 10 + p) for p in range(src_tp)]
    for d in range(dst_tp):
        ours, theirs = (worker(make(dst_tp), layout, dst_tp, d, 50 + d) for _ in range(2))
        before = ours.buf.clone()
        dst_shard = Shard(d, dst_tp, heads)
        alike = prefill[0].ring.opaque_pages == ours.ring.opaque_pages
        for p in prefill:
            src_shard = Shard(p.rank, src_tp, heads)
            if not alike:
                with pytest.raises(
                    BlockMapError, match=r"ring-buffer-pages.*A ring \(vLLM's CircularBufferSpec\)"
                ):
                    block_map(p.ring, ours.ring, [3], [1], src_shard=src_shard, dst_shard=dst_shard)
                continue
            m = block_map(p.ring, ours.ring, [3], [1], src_shard=src_shard, dst_shard=dst_shard)
            page = p.kv[p.rings[0]][0].numel() * 2
            assert m.latents and m.num_bytes == LAYERS * page  # every layer's ring, whole
            peers = block_map(described(p, src_shard), described(ours, dst_shard), [3], [1])
            assert peers.num_bytes == m.num_bytes
            if src_shard.sends_to(dst_shard, latents=m.latents):
                assert p.rank == d * src_tp // dst_tp
                m.copy()
        if not alike:
            assert torch.equal(ours.buf, before)
            continue
        nc.decode_read(
            connector_rank(theirs, layout), [connector_rank(p, layout) for p in prefill], [1], [3], 1
        )
        sender, expected = prefill[d * src_tp // dst_tp], before.clone()
        for name in ours.rings:
            view = ours.kv[name]
            assert torch.equal(bits(rows(view, 1)), bits(rows(sender.kv[name], 3)))  # where the writer reads
            rebased(view, ours.buf, expected)[1] = sender.kv[name][3]
        assert torch.equal(ours.buf, expected)  # the ring's block 1, no other byte
        assert torch.equal(ours.buf, theirs.buf)  # as vLLM's connector lands it


@pytest.mark.parametrize("model", list(MODELS))
def test_each_ring_declares_its_whole_page_as_every_rank_s(model: str) -> None:
    """The array every rank holds whole is the ring's page, every head slot of it: the
    tail ring declared ``[8, 128]`` of its ``[2, 8, 128]`` page, its K slot alone."""
    make, layouts, _, _ = MODELS[model]
    w = worker(make(1), layouts[0], 1, 0, 1)
    pages = w.ring.opaque_pages
    assert pages is not None and not pages.rows_are_tokens and all(x.replicated for x in pages.arrays)
    view = w.kv[w.rings[0]]
    assert len(pages.arrays) == 1 and pages.arrays_end == view[0].numel() * view.element_size()
    if model == "glm5-next-tail":
        assert pages.arrays[0].shape == (1, 2, 8, 128)  # [K, gate score] slots, then rows


def test_tail_rings_of_two_memory_orders_are_refused_not_halved() -> None:
    """GLM5-Next's tail ring as vLLM registers it (BLHNC: each slot's rows together) and
    as a BLNHC page would hold it (each row's K and gate together; ``KpoolTailBackend``
    takes BLHNC alone, so only a peer's description says so): the same bytes in two
    orders. Read as one slot's array, the map moved 4096 of the page's 8192 bytes, the K
    slot's rows from the interleaved page; it is refused, naming the ring, at any ranks."""
    blhnc = worker(glm5_next(1), vx.KVCacheLayout.BLHNC, 1, 0, 1)
    blnhc = worker(glm5_next(2), vx.KVCacheLayout.BLNHC, 2, 1, 2)
    before = blnhc.buf.clone()
    for shards in ((None, None), (Shard(0, 1, 1), Shard(1, 2, 1))):
        for src, dst in ((blhnc, blnhc), (blnhc, blhnc)):
            with pytest.raises(
                BlockMapError, match=r"do not hold the same state.*bfloat16 \[1, 2, 8, 128\]"
            ) as info:
                block_map(src.ring, dst.ring, [3], [1], src_shard=shards[0], dst_shard=shards[1])
            assert "A ring (vLLM's CircularBufferSpec) is one block a request" in str(info.value)
    assert torch.equal(blnhc.buf, before)
