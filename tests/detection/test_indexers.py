"""DSA indexer key caches: SGLang's flat uint8 page lists, the `is_indexer` fact, and the
helpers that tell indexer caches apart (`is_indexer_cache`, `drop_indexer_caches`).

Worked examples from LMCache's branches (facts sheet `lmcache-branch-facts.md` sections 2
and 3: test_kv_format_specs @1fc34b40, test_dsa_support @2bb4608e); where kvlayout
answers differently, the test says why.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import EngineType
from kvlayout.layout.description import Axis, RegionPart
from kvlayout.transfer import prepare

INDEXER = F.NL_X_NB_BSV_BSS


def detect(kv: Any, engine: str | EngineType, hints: Any = None) -> tuple[F, Any]:
    """Detection, its normalized registration typed loosely (tests index into it)."""
    return kvlayout.normalize_kv_and_discover_format(kv, engine, hints)


def u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


def f16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float16)


def test_is_indexer_is_a_layout_fact_of_exactly_the_region_pages() -> None:
    # the engines' per-layer pages, SGLang's HiCache host pools of them (one tensor), and
    # SGLang's bf16 keys without scales (index_cache_dtype bfloat16), and vLLM's MXFP4
    # pages (indexer_kv_dtype mxfp4: packed e2m1 values, then ue8m0 scales), and TRT-LLM's
    # FP4 indexer pool of them (indexer_k_dtype fp4, one tensor)
    assert {f for f in F if kvlayout.is_indexer(f)} == {
        INDEXER,
        F.NL_NB_BSV_BSS,
        F.NB_NL_BSV_BSS,
        F.NL_X_NB_BSK,
        F.NL_X_NB_BSV4_BSS4,
        F.NB_NL_BSV4_BSS4,
    }
    assert kvlayout.layout_of(INDEXER).is_indexer and kvlayout.get_spec_class(INDEXER).is_indexer
    assert kvlayout.catalog.registry.format_info(INDEXER).engines == ("vllm", "sglang")


# -- SGLang's DSA indexer pages (section 3) ------------------------------------------------


def test_example_1_pages_are_re_viewed_with_the_page_size_from_the_width() -> None:
    kv = [u8(7, 528) for _ in range(5)]
    fmt, out = detect(kv, "sglang", {"tokens_per_block": 4})
    assert fmt is INDEXER
    assert [tuple(t.shape) for t in out] == [(7, 4, 132)] * 5
    assert out[0].dim() == 3 and out[0].data_ptr() == kv[0].data_ptr()
    assert (kvlayout.get_block_size(out, fmt), kvlayout.get_num_blocks(out, fmt)) == (4, 7)


def test_examples_2_and_3_no_hint_is_needed() -> None:
    fmt, out = detect([u8(7, 264) for _ in range(5)], "sglang")
    assert fmt is INDEXER and tuple(out[0].shape) == (7, 2, 132)
    fmt, out = detect([u8(7, 528) for _ in range(5)], "sglang", {})
    assert fmt is INDEXER and tuple(out[0].shape) == (7, 4, 132)


def test_a_contradicting_tokens_per_block_is_an_error() -> None:
    """LMCache's branch ignores the hint here (its example 2 reads a page of 2 under
    tokens_per_block=4); kvlayout checks every hint it is given."""
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape(
            "layout hint tokens_per_block=4 contradicts its indexer row, which is 2 records of NL_X_NB_BSV_BSS"
        ),
    ):
        detect([u8(7, 264) for _ in range(5)], "sglang", {"tokens_per_block": 4})


def test_pages_that_are_not_indexer_records_are_errors() -> None:
    with pytest.raises(
        kvlayout.DetectionError,
        match=re.escape(
            "a flat list of 2-D uint8 tensors is a DSA indexer cache [pages, page_size * W] (W = 132 or 68 bytes), but its "
            "row is not a positive multiple of any record width"
        ),
    ):
        detect([u8(7, 100) for _ in range(5)], "sglang")
    padded = [u8(7, 600)[:, :528] for _ in range(2)]
    with pytest.raises(kvlayout.DetectionError, match="an indexer page with padded rows cannot be split"):
        detect(padded, "sglang")


@pytest.mark.parametrize(
    ("groups", "hints", "latent"),
    [
        ([list(range(5)), list(range(5, 10))], {"tokens_per_block": 4}, F.NL_X_NB_BS_HS),
        ((), {"tokens_per_block": 4}, F.NL_X_NB_BS_HS),
        ([list(range(5)), list(range(5, 10))], {}, F.NL_X_NBBS_ONE_HS),
        ((), {}, F.NL_X_NBBS_ONE_HS),
    ],
)
def test_example_4_latents_and_indexers_split_by_layer_group(
    groups: list[list[int]], hints: dict[str, int], latent: F
) -> None:
    """LMCache's branch test expects the latents to stay folded (5) under tokens_per_block;
    kvlayout's SGLang detector un-folds them by it (3), as LMCache 0.5.6's does."""
    kv = [f16(28, 1, 4) for _ in range(5)] + [u8(7, 528) for _ in range(5)]
    out: Any
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(kv, groups, "sglang", hints)
    assert formats == [latent] * 5 + [INDEXER] * 5
    assert [tuple(t.shape) for t in out[5:]] == [(7, 4, 132)] * 5
    reg = kvlayout.detect(kv, "sglang", hints, layer_groups=groups or None)
    assert [(g.format, g.layers) for g in reg.kernel_groups] == [
        (latent, (0, 1, 2, 3, 4)),
        (INDEXER, (5, 6, 7, 8, 9)),
    ]


def test_an_indexer_group_moves_values_then_scales() -> None:
    pages = [torch.randint(0, 256, (6, 2 * 132), dtype=torch.uint8) for _ in range(3)]
    reg = kvlayout.detect(pages, "sglang")
    plan = prepare(reg.kernel_groups[0], INDEXER)
    shape, dtype = plan.chunk_shape(4)
    assert shape == (1, 3, 4, 132) and dtype == torch.uint8
    chunks = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    original = [p.clone() for p in pages]
    plan.store_blocks([4, 1, 0, 5], chunks)
    page = original[2][4].view(264)  # block 4 of layer 2: 2 tokens' values, then their scales
    token1 = torch.cat([page[128:256], page[256 + 4 : 256 + 8]])
    assert torch.equal(chunks[0][0, 2, 1], token1)
    for p in pages:
        p.zero_()
    plan.load_blocks([4, 1, 0, 5], chunks)
    for p, o in zip(pages, original, strict=True):
        assert torch.equal(p[[4, 1, 0, 5]], o[[4, 1, 0, 5]]) and not p[[2, 3]].any()


def test_the_description_has_the_regions() -> None:
    desc = kvlayout.describe(INDEXER)
    assert desc.dims == ((Axis.B,), (Axis.N,), (Axis.C,))
    assert desc.regions == (RegionPart("BSV", 128, "float8_e4m3fn"), RegionPart("BSS", 4, "float32"))
    assert desc.is_indexer
    assert desc.extents[Axis.C] == 132 and desc.is_mla


# -- is_indexer_cache and drop_indexer_caches (section 2) -------------------------------


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (u8(7, 3, 132), True),  # example 1
        (f16(7, 3, 4), False),  # example 2: the MLA main cache
        (f16(7, 3, 132), False),  # example 3: the dtype decides
        (f16(2, 7, 3, 2, 4), False),  # example 4
        (u8(7, 1, 3, 132), True),  # a rank-4 single-head page (vLLM squeezes it)
        (f16(7), False),  # no vLLM format at all: LMCache answers False too
    ],
)
def test_is_indexer_cache_for_vllm(tensor: torch.Tensor, expected: bool) -> None:
    assert kvlayout.is_indexer_cache(tensor, "vllm") is expected


def test_is_indexer_cache_for_other_engines_and_bad_input() -> None:
    assert kvlayout.is_indexer_cache(u8(7, 528), "sglang") is True
    assert kvlayout.is_indexer_cache(f16(28, 1, 4), "sglang") is False
    assert kvlayout.is_indexer_cache(f16(4, 2, 3, 16, 2, 8), "max") is False
    with pytest.raises(kvlayout.LayoutHintError, match="unknown layout hint 'page'"):
        kvlayout.is_indexer_cache(u8(7, 3, 132), "vllm", {"page": 3})
    with pytest.raises(TypeError, match="kv_cache is a list, not a tensor"):
        kvlayout.is_indexer_cache([u8(7, 3, 132)], "vllm")  # type: ignore[arg-type]


def test_example_5_drop_keeps_order_and_objects(caplog: pytest.LogCaptureFixture) -> None:
    caches: dict[str, torch.Tensor] = {}
    for layer in range(5):
        caches[f"model.layers.{layer}.self_attn.attn"] = f16(7, 3, 4)
        if layer % 2 == 0:
            caches[f"model.layers.{layer}.self_attn.indexer.k_cache"] = u8(7, 3, 132)
    with caplog.at_level(logging.INFO, logger="kvlayout"):
        kept = kvlayout.drop_indexer_caches(caches, "vllm")
    assert list(kept) == [f"model.layers.{layer}.self_attn.attn" for layer in range(5)]
    assert all(kept[name] is caches[name] for name in kept)
    assert [r.getMessage() for r in caplog.records] == ["Dropped 3 DSA indexer cache(s); kept 5 KV cache(s)"]


def test_example_6_nothing_to_drop_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caches = {f"model.layers.{layer}.attn": f16(2, 7, 3, 2, 4) for layer in range(5)}
    with caplog.at_level(logging.INFO, logger="kvlayout"):
        kept = kvlayout.drop_indexer_caches(caches, "vllm")
    assert list(kept) == list(caches) and all(kept[k] is caches[k] for k in caches)
    assert not caplog.records
    with pytest.raises(TypeError, match="kv_caches is a list, not a mapping"):
        kvlayout.drop_indexer_caches([f16(7, 3, 4)], "vllm")  # type: ignore[arg-type]
