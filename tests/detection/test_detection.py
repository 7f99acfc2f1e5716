"""Detection: the facts sheet's golden cases (section 8.5), engine quirks, hints, and
every family of bad input with the error it gets."""

from __future__ import annotations

import copy
import enum
import pickle
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlayout
from kvlayout import DetectionError, EngineType, KVLayoutError, LayoutHintError, LayoutHints, StridedViewError
from kvlayout import EngineKVFormat as F
from kvlayout._generated.formats import FORMAT_INFO
from kvlayout.registration.nesting import CallerRoot, describe_path
from kvlayout.transfer import BlockMapError, Shard, block_map

detect = kvlayout.normalize_kv_and_discover_format


def t(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def layers(shape: tuple[int, ...], n: int = 5, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    return [t(*shape, dtype=dtype) for _ in range(n)]


# -- golden cases (facts sheet 8.5; NB=7, NL=5, BS=3, NH=2, HS=4) ---------------------------------


@pytest.mark.parametrize(
    ("engine", "kv", "hints", "expected"),
    [
        ("vllm", t(7, 5, 2, 3, 2, 4), {"kv_layout": "NHD"}, F.NB_NL_TWO_BS_NH_HS),
        ("vllm", layers((2, 7, 3, 2, 4)), {"kv_layout": "NHD"}, F.NL_X_TWO_NB_BS_NH_HS),
        ("vllm", layers((2, 7, 2, 3, 4)), {"kv_layout": "HND"}, F.NL_X_TWO_NB_NH_BS_HS),
        ("vllm", layers((7, 2, 3, 2, 4)), {"kv_layout": "NHD"}, F.NL_X_NB_TWO_BS_NH_HS),
        ("vllm", layers((7, 3, 4)), {}, F.NL_X_NB_BS_HS),
        ("vllm", layers((7, 2, 3, 8)), {"kv_layout": "HND"}, F.NL_X_NB_NH_BS_CS),
        ("sglang", layers((21, 1, 4)), {}, F.NL_X_NBBS_ONE_HS),
        ("sglang", [layers((21, 2, 4)), layers((21, 2, 4))], {}, F.TWO_X_NL_X_NBBS_NH_HS),
        ("sglang", layers((7, 3, 1, 4)), {}, F.NL_X_NB_BS_HS),  # page-major MLA views, unfolded MLA
        ("sglang", layers((7, 3 * 128), dtype=torch.bfloat16), {}, F.NL_X_NB_BSK),  # bf16 DSA indexer keys
        ("sglang", layers((7, 3 * 132), dtype=torch.uint8), {}, F.NL_X_NB_BSV_BSS),  # fp8 DSA indexer records
        ("trtllm", t(7, 5, 2, 2, 3, 4), {}, F.NB_NL_TWO_NH_BS_HS),
    ],
)
def test_golden_detection(engine: str, kv: Any, hints: dict[str, Any], expected: F) -> None:
    fmt, _out = detect(kv, engine, hints)
    assert fmt == expected


def test_vllm_rank4_fused_cache_is_kept_as_registered() -> None:
    kv = layers((7, 2, 3, 8))
    fmt, out = detect(kv, "vllm", {"kv_layout": "HND"})
    assert fmt == F.NL_X_NB_NH_BS_CS  # 0.5.6 (older LMCache split it into 10)
    assert all(o is i for o, i in zip(out, kv, strict=True))
    assert kvlayout.get_head_size(out, fmt) == 8 and kvlayout.get_num_heads(out, fmt) == 2


def test_sglang_flat_k_v_list_with_tokens_per_block() -> None:
    kv = layers((21, 2, 4), 10)
    fmt, out = detect(kv, "sglang", {"tokens_per_block": 3, "kv_list_layout": "k_v"})
    assert fmt == F.TWO_X_NL_X_NB_BS_NH_HS
    assert out[0][0].shape == (7, 3, 2, 4)  # type: ignore[union-attr]
    assert out[1][0].data_ptr() == kv[5].data_ptr()  # type: ignore[union-attr]


def test_blocks_first_views_detect_and_keep_their_strides() -> None:
    """NB 6, NL 3, NH 2, BS 4, CS 8: views buf[:, l] of one [NB, NL, ...] pool."""
    hnd = torch.zeros(6, 3, 2, 4, 8)
    nhd = torch.zeros(6, 3, 4, 2, 8)
    for hint, buf, expected in (("BLHNC", hnd, F.NL_X_NB_NH_BS_CS), ("BLNHC", nhd, F.NL_X_NB_BS_NH_CS)):
        kv = [buf[:, i] for i in range(3)]
        fmt, out = detect(kv, "vllm", {"kv_layout": hint})
        assert fmt == expected
        for o, i in zip(out, kv, strict=True):
            assert (o.data_ptr(), o.shape, o.stride()) == (i.data_ptr(), i.shape, i.stride())
        assert kvlayout.resolve_block_stride_and_log_layout(out, fmt, 0, 0) == 192
    fmt, out = detect(layers((6, 2, 4, 8), 3), "vllm", {"kv_layout": "BLHNC"})
    assert (fmt, kvlayout.resolve_block_stride_and_log_layout(out, fmt, 0, 0)) == (F.NL_X_NB_NH_BS_CS, 64)
    two_groups = torch.zeros(6, 2 * 3, 2, 4, 8)  # two interleaved groups share the pool
    fmt, out = detect([two_groups[:, i] for i in range(0, 6, 2)], "vllm", {"kv_layout": "BLHNC"})
    assert kvlayout.resolve_block_stride_and_log_layout(out, fmt, 0, 0) == 2 * 3 * 2 * 4 * 8
    gaps = torch.zeros(6 * 2 * 4 * 16).as_strided((6, 2, 4, 8), (2 * 4 * 16, 4 * 16, 16, 1))
    with pytest.raises(StridedViewError, match=re.escape("dim-0 padding only")):
        detect([gaps] * 3, "vllm", {"kv_layout": "BLHNC"})


def test_a_2d_vllm_list_is_an_error_naming_the_shape() -> None:
    with pytest.raises(
        DetectionError, match=re.escape("vLLM: no vLLM format has list depth 1 and tensor rank 2")
    ):
        detect(layers((7, 4)), "vllm")


# -- vLLM quirks ------------------------------------------------------------------------------------


def test_vllm_without_a_hint_is_hnd_on_the_cpu_and_nhd_elsewhere() -> None:
    assert detect(layers((2, 7, 3, 2, 4)), "vllm")[0] == F.NL_X_TWO_NB_NH_BS_HS
    meta = [t(2, 7, 3, 2, 4, device="meta") for _ in range(3)]
    assert detect(meta, "vllm")[0] == F.NL_X_TWO_NB_BS_NH_HS
    assert detect(meta, "vllm", {"kv_layout": "HND"})[0] == F.NL_X_TWO_NB_NH_BS_HS  # a hint always wins
    assert detect(layers((2, 7, 3, 2, 4)), "vllm", {"kv_layout": "NHD"})[0] == F.NL_X_TWO_NB_BS_NH_HS


def test_two_blocks_default_to_kv_first_and_kv_pair_axis_settles_it() -> None:
    kv = layers((2, 2, 3, 2, 4))
    assert detect(kv, "vllm", {"kv_layout": "NHD"})[0] == F.NL_X_TWO_NB_BS_NH_HS
    fmt, out = detect(kv, "vllm", {"kv_layout": "NHD", "kv_pair_axis": 1})
    assert fmt == F.NL_X_NB_TWO_BS_NH_HS and kvlayout.get_num_blocks(out, fmt) == 2
    assert detect(kv, "vllm", {"kv_layout": "HND", "kv_pair_axis": 1})[0] == F.NL_X_NB_TWO_NH_BS_HS
    with pytest.raises(DetectionError, match=re.escape("NL_X_NB_TWO_BS_NH_HS needs dim 1 == 2 (got 7)")):
        detect(layers((2, 7, 3, 2, 4)), "vllm", {"kv_layout": "NHD", "kv_pair_axis": 1})


def test_bare_tensors_are_cross_layer_only_with_the_cross_layer_rank() -> None:
    with pytest.raises(DetectionError, match=re.escape("no vLLM format has list depth 0 and tensor rank 5")):
        detect(t(2, 7, 3, 2, 4), "vllm", {"kv_layout": "NHD"})
    with pytest.raises(DetectionError, match=re.escape("NB_NL_TWO_BS_NH_HS needs dim 2 == 2 (got 3)")):
        detect(t(7, 5, 3, 3, 2, 4), "vllm", {"kv_layout": "NHD"})
    physical = t(7, 5, 2, 2, 3, 4)  # vLLM's HND cross-layer allocation, exposed as NHD
    fmt, out = detect(physical.transpose(3, 4), "vllm", {"kv_layout": "HND"})
    assert fmt == F.NB_NL_TWO_NH_BS_HS
    assert out.stride() == physical.stride()  # type: ignore[union-attr]


def test_dsa_indexer_caches() -> None:
    kv = [t(7, 3, 132, dtype=torch.uint8) for _ in range(4)]
    assert detect(kv, "vllm")[0] == F.NL_X_NB_BSV_BSS
    assert detect(layers((7, 3, 132)), "vllm")[0] == F.NL_X_NB_BS_HS  # not bytes: plain MLA
    single_head = [t(7, 3, 1, 132, dtype=torch.uint8) for _ in range(4)]
    fmt, out = detect(single_head, "vllm", {"kv_layout": "NHD"})
    assert fmt == F.NL_X_NB_BSV_BSS and out[0].shape == (7, 3, 132)  # type: ignore[union-attr]
    assert out[0].data_ptr() == single_head[0].data_ptr()  # type: ignore[union-attr]
    hnd = [t(7, 1, 3, 132, dtype=torch.uint8) for _ in range(4)]
    assert detect(hnd, "vllm", {"kv_layout": "HND"})[0] == F.NL_X_NB_BSV_BSS
    # Whole-registration detection of layers plus indexer caches (LMCache #5002) names the mix.
    with pytest.raises(
        DetectionError, match=re.escape("kv_caches[5]: rank 3 differs from kv_caches[0] (rank 5)")
    ):
        detect([*layers((2, 7, 3, 2, 4)), *kv], "vllm", {"kv_layout": "NHD"})


def test_per_layer_tuples() -> None:
    fmt, out = detect([[t(8, 4, 2, 8), t(8, 4, 2, 8)] for _ in range(3)], "vllm")
    assert fmt == F.NL_X_TWO_X_NB_BS_NH_HS and all(type(x) is tuple for x in out)
    assert detect([(t(7, 3, 1, 4), t(7, 3, 1, 4))], "vllm")[0] == F.NL_X_TWO_X_NB_BS_NH_HS  # equal: K, V
    assert detect([(t(7, 3, 1, 4),)], "vllm")[0] == F.NL_X_NP_X_NB_BS_ONE_HS
    mixed = [(t(7, 3, 1, 4, dtype=torch.int8), t(7, 3, 1, 2, dtype=torch.float16)) for _ in range(2)]
    fmt, out = detect(mixed, "vllm")
    assert fmt == F.NL_X_NP_X_NB_BS_ONE_HS and kvlayout.get_head_size(out, fmt) == 8
    with pytest.raises(
        DetectionError, match=re.escape("NL_X_TWO_X_NB_BS_NH_HS needs K and V of equal shape")
    ):
        detect([(t(7, 3, 2, 4), t(7, 3, 2, 8))], "vllm")


def test_rbln_six_dim_tensors() -> None:
    fmt, _ = detect(layers((2, 7, 2, 1, 3, 4)), "vllm", {"kv_layout": "NHD"})
    assert fmt == F.NL_X_TWO_NB_NH_ONE_BS_HS  # no NHD twin: the hint does not apply
    with pytest.raises(DetectionError, match=re.escape("NL_X_TWO_NB_NH_ONE_BS_HS needs dim 3 == 1 (got 2)")):
        detect(layers((2, 7, 2, 2, 3, 4)), "vllm")


# -- SGLang, TRT-LLM, ATOM ------------------------------------------------------------------------


def test_sglang_structures() -> None:
    fmt, out = detect(layers((21, 1, 4)), "sglang", {"tokens_per_block": 3})
    assert fmt == F.NL_X_NB_BS_HS and out[0].shape == (7, 3, 4)  # type: ignore[union-attr]
    fmt, out = detect([layers((21, 2, 4)), layers((21, 2, 4))], "sglang", {"tokens_per_block": 3})
    assert fmt == F.TWO_X_NL_X_NB_BS_NH_HS and out[0][0].shape == (7, 3, 2, 4)  # type: ignore[union-attr]
    assert detect(layers((21, 2, 4), 10), "sglang", {"kv_list_layout": "k_v"})[0] == F.TWO_X_NL_X_NBBS_NH_HS
    assert detect(layers((7, 3, 2, 4)), "sglang", {"kv_list_layout": "unified"})[0] == F.NL_X_NB_BS_NH_HS
    assert detect(layers((7, 3, 4)), "sglang", {"kv_list_layout": "unified"})[0] == F.NL_X_NB_BS_HS


def test_sglang_page_major_mla_views_and_bf16_indexer_pages_read_as_views() -> None:
    """SGLang's page-major MLA pool: views ``(pages, page_size, 1, C)`` whose page stride
    is the envelope of every layer's latents, layer L ``L * page_size`` rows in; they
    read as the MLA device format, the block stride the envelope. The NSA indexer's bf16
    keys ``[pages, page_size * 128]`` read as their bytes, one 256-byte key row a token."""
    raw = t(5 * 3 * 4 * 8)
    views = [torch.as_strided(raw, (5, 4, 1, 8), (3 * 4 * 8, 8, 8, 1), layer * 4 * 8) for layer in range(3)]
    fmt, out = detect(views, "sglang", {"tokens_per_block": 4})
    assert fmt == F.NL_X_NB_BS_HS
    assert [(o.shape, o.stride(), o.data_ptr()) for o in out] == [  # type: ignore[union-attr]
        ((5, 4, 8), (96, 8, 1), v.data_ptr()) for v in views
    ]
    idx = layers((6, 64 * 128), 3, dtype=torch.bfloat16)
    fmt, out = detect(idx, "sglang", {"tokens_per_block": 64})
    assert fmt == F.NL_X_NB_BSK
    assert [(o.dtype, o.shape, o.data_ptr()) for o in out] == [  # type: ignore[union-attr]
        (torch.uint8, (6, 64, 256), i.data_ptr()) for i in idx
    ]


@pytest.mark.parametrize("form", ["[K, V]", "k_v"])
def test_sglang_hnd_pool_reads_heads_before_tokens(form: str) -> None:
    """SGLang's pool under SGLANG_USE_HND_KVCACHE (trtllm_mha): K and V per layer
    ``[pages, heads, page_size, head_dim]``. Under kv_layout=HND it is the HND twin, its
    page size and heads read where they are (it was read as NHD, the heads as tokens);
    without the hint, a page size given contradicts the NHD reading by name."""
    k, v = layers((7, 2, 3, 4)), layers((7, 2, 3, 4))
    kv: Any = [k, v] if form == "[K, V]" else k + v
    hints: dict[str, Any] = {} if form == "[K, V]" else {"kv_list_layout": "k_v"}
    reg = kvlayout.detect(kv, "sglang", {**hints, "kv_layout": "HND", "tokens_per_block": 3})
    assert reg.format == F.TWO_X_NL_X_NB_NH_BS_HS
    assert (kvlayout.get_block_size(reg, reg.format), kvlayout.get_num_heads(reg, reg.format)) == (3, 2)
    with pytest.raises(
        LayoutHintError, match="tokens_per_block=3 contradicts TWO_X_NL_X_NB_BS_NH_HS, whose BS is 2"
    ):
        kvlayout.detect(kv, "sglang", {**hints, "tokens_per_block": 3})


@pytest.mark.parametrize(
    ("kv", "hints", "error", "message"),
    [
        (layers((21, 2, 4), 10), {"tokens_per_block": 3}, DetectionError,
         "is not MLA (an MLA page buffer is [NB*BS, 1, HS]); for K layers then V layers pass layout hint "
         "kv_list_layout='k_v'"),
        (layers((21, 2, 4), 5), {"kv_list_layout": "k_v"}, DetectionError,
         "expects K layers then V layers (an even count), got 5 tensors"),
        ([layers((21, 2, 4), 5), layers((21, 2, 4), 4)], {}, DetectionError,
         "kv_caches[1] has 4 entries, but kv_caches[0] has 5"),
        ([layers((21, 2, 4)), layers((21, 2, 4)), layers((21, 2, 4))], {}, DetectionError,
         "TWO_X_NL_X_NBBS_NH_HS needs 2 entries at list level 0 (got 3)"),
        ([layers((21, 2, 4)), layers((21, 2, 8))], {}, DetectionError,
         "SGLang: K layers [21, 2, 4] and V layers [21, 2, 8] differ in head size (4 and 8"),
        ([[t(21, 2, 4), t(21, 2, 8)], [t(21, 2, 4), t(21, 2, 8)]], {}, DetectionError,
         "kv_caches[0][1] has shape [21, 2, 8], but kv_caches[0][0] makes TWO_X_NL_X_NBBS_NH_HS [21, 2, 4]"),
        (layers((22, 1, 4)), {"tokens_per_block": 3}, DetectionError,
         "PBS=22 token slots are not divisible by tokens_per_block=3"),
        (layers((7, 3, 4)), {"kv_list_layout": "unified", "tokens_per_block": 4}, LayoutHintError,
         "tokens_per_block=4 contradicts NL_X_NB_BS_HS, whose BS is 3"),
        (layers((7, 3, 2, 4)), {}, DetectionError, "unless layout hint kv_list_layout says 'k_v'"),
        (layers((7, 3, 1, 4)), {"tokens_per_block": 7}, LayoutHintError,
         "SGLang page-major MLA pool kv_caches[0]: shape (7, 3, 1, 4), dtype torch.float16, in a list of 5: "
         "layout hint tokens_per_block=7 contradicts its views' page_size 3"),
        (layers((7, 3 * 128 + 2), dtype=torch.bfloat16), {}, DetectionError,
         "a flat list of 2-D bfloat16 tensors is a DSA indexer cache [pages, page_size * W] (W = 256 bytes), "
         "but its row is not a positive multiple of any record width"),
        (layers((7, 3 * 128), dtype=torch.bfloat16), {"tokens_per_block": 4}, LayoutHintError,
         "tokens_per_block=4 contradicts its indexer row, which is 3 records of NL_X_NB_BSK"),
        (layers((9, 96, 3)), {}, DetectionError, "kv_list_layout='k_v'; a hybrid's Mamba state buffers (conv "
         "[slots, conv_dim, K-1], temporal [slots, H, head_dim, state]) are one state per request slot, not KV "
         "pages: kvlayout.integrations.sglang.mamba_state_pools(pool) reads them"),
        (layers((3, 2, 4, 8)), {"kv_list_layout": "unified", "kv_layout": "HND"}, DetectionError,
         "layout hint kv_layout=HND, but no SGLang format of list depth 1 and tensor rank 4 holds heads before "
         "tokens"),
        (layers((12, 2, 8)) * 2, {"kv_list_layout": "k_v", "kv_layout": "HND"}, DetectionError,
         "layout hint kv_layout=HND, but no SGLang format of list depth 2 and tensor rank 3 holds heads before "
         "tokens"),
        (t(21, 2, 4), {}, DetectionError, "SGLang registers lists of per-layer tensors, not one tensor"),
        ([[layers((7, 3, 4))]], {}, DetectionError, "no SGLang format has list depth 3"),
    ],
)  # fmt: skip
def test_sglang_errors(kv: Any, hints: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        detect(kv, "sglang", hints)


def test_sglang_k_and_v_of_different_head_sizes_are_named_and_served_apart() -> None:
    """``MHATokenToKVPool(v_head_dim=128)`` beside a head_dim of 192 (MiMo-V2): one layout
    holds one head size, so where ``detect`` cannot serve them apart (no page size, a layer
    unlike the others) and through LMCache's one-format function, the error says so and
    how (it said the layers could not be detected apart, or judged the K list alone)."""
    nl, ps, nh = 3, 4, 2
    k = [torch.randn(5 * ps, nh, 12) for _ in range(nl)]
    v = [torch.randn(5 * ps, nh, 8) for _ in range(nl)]
    refused: list[tuple[Any, dict[str, Any]]] = [
        (k + v, {"kv_list_layout": "k_v"}),
        ([k, v], {"kv_list_layout": "k_v"}),
        ([k, [k[0].clone(), *v[1:]]], {"tokens_per_block": ps}),  # only later layers differ
    ]
    message = re.escape("SGLang: K layers [20, 2, 12] and V layers [20, 2, 8] differ in head size (12 and 8")
    for kv, hints in refused:
        with pytest.raises(DetectionError, match=message):
            kvlayout.detect(kv, "sglang", hints)
    for kv, hints in [*refused, ([k, v], {"tokens_per_block": ps})]:
        with pytest.raises(DetectionError, match=message):  # LMCache's name reads one format
            kvlayout.normalize_kv_and_discover_format(kv, "sglang", hints)
    # 0-d tensors: the hook read their shape[-1]
    with pytest.raises(TypeError, match=r"kv_caches\[0\]\[1\]: is None"):
        kvlayout.detect(((torch.tensor(0.0), None), [torch.tensor(0.0)]), "sglang")  # type: ignore[arg-type]
    unified = {"kv_list_layout": "unified"}
    for buffers in (k, v):  # what the message says to do: each side detects, and maps byte for byte
        reg = kvlayout.detect([t.view(-1, ps, nh, t.shape[-1]) for t in buffers], "sglang", unified)
        copy = [torch.zeros_like(t) for t in buffers]
        other = kvlayout.detect([t.view(-1, ps, nh, t.shape[-1]) for t in copy], "sglang", unified)
        block_map(reg, other, [3, 1], [0, 4], num_tokens=6).copy()
        for src, dst in zip(buffers, copy, strict=True):
            assert torch.equal(dst[0:4], src[12:16]) and torch.equal(dst[16:18], src[4:6])
            assert not dst[4:16].any() and not dst[18:].any()


@pytest.mark.parametrize("form", ["k_v", "two lists"])
def test_sglang_k_and_v_of_different_head_sizes_detect_as_two_kernel_groups(form: str) -> None:
    """With its page size, ``detect`` serves MiMo-V2's pool as the unified connector's
    components: the K layers one kernel group, the V layers another, each moving its heads
    (TP resharding included) and its chunks like any SGLang cache (it was refused)."""
    nl, ps, nh = 3, 4, 4
    k = [torch.randn(6 * ps, nh, 12) for _ in range(nl)]
    v = [torch.randn(6 * ps, nh, 8) for _ in range(nl)]
    hints: dict[str, Any] = {"tokens_per_block": ps}

    def registration(k: list[torch.Tensor], v: list[torch.Tensor]) -> kvlayout.Registration:
        if form == "k_v":
            return kvlayout.detect(k + v, "sglang", {**hints, "kv_list_layout": "k_v"})
        return kvlayout.detect([k, v], "sglang", hints)

    src = registration(k, v)
    k_group, v_group = src.kernel_groups
    assert (k_group.layers, v_group.layers) == ((0, 1, 2), (3, 4, 5))
    assert {g.format for g in src.kernel_groups} == {F.NL_X_NB_BS_NH_HS}
    assert [g.descriptor().hs for g in src.kernel_groups] == [12, 8]
    # into TP 2 rank 1 (heads 2-3), token by token of blocks [3, 1] -> [0, 4]
    half_k = [torch.zeros(6 * ps, nh // 2, 12) for _ in range(nl)]
    half_v = [torch.zeros(6 * ps, nh // 2, 8) for _ in range(nl)]
    dst = registration(half_k, half_v)
    for s, d in zip(src.kernel_groups, dst.kernel_groups, strict=True):
        block_map(s, d, [3, 1], [0, 4], num_tokens=6, dst_shard=Shard(1, 2, nh)).copy()
    for whole, half in zip(k + v, half_k + half_v, strict=True):
        assert torch.equal(half[0:4], whole[12:16, 2:]) and torch.equal(half[16:18], whole[4:6, 2:])
        assert not half[4:16].any() and not half[18:].any()
    # a chunk of each group, and the groups' pointer tables: K's then V's
    for group, rows in ((k_group, nh * 12), (v_group, nh * 8)):
        plan = kvlayout.transfer.prepare(group)
        shape, _ = plan.chunk_shape(2 * ps)
        assert shape == (1, nl, 2 * ps, rows)
    assert src.data_ptrs(range(6)) == [t.data_ptr() for t in k + v]
    with pytest.raises(BlockMapError, match=r"src holds layers 0-2 and dst layers 3-5"):  # K is not V
        block_map(k_group, v_group, [0], [0])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda k, v: ([k, v], {"tokens_per_block": 5}), "PBS=24 token slots are not divisible by tokens_per_block=5"),
        (lambda k, v: ([k, v[:2]], {"tokens_per_block": 4}), "but there are 3 K layers and 2 V"),
        (lambda k, v: ([k, v], {}), "which needs tokens_per_block (SGLang's page_size)"),
        (lambda k, v: ([k, [*v[:2], v[2].to(torch.float16)]], {"tokens_per_block": 4}),
         "layer 2's V is [24, 4, 8] torch.float16 on cpu, layer 0's [24, 4, 8] torch.float32"),
        (lambda k, v: ([k, [*v[:2], v[2].to("meta")]], {"tokens_per_block": 4}), "layer 2's V is"),
        (lambda k, v: ([k, [t.view(-1)[: 24 * 4 * 4].view(24, 4, 4) for t in k]], {"tokens_per_block": 4}),
         "overlap in memory"),  # V carved out of K's bytes
    ],
)  # fmt: skip
def test_sglang_k_and_v_of_different_head_sizes_refuse_what_two_groups_cannot_hold(
    build: Any, message: str
) -> None:
    """A split into two kernel groups needs pages, alike layers and K and V memory apart
    (one engine group, so overlap is checked across them); each refusal names its cause."""
    k = [torch.randn(24, 4, 12) for _ in range(3)]
    v = [torch.randn(24, 4, 8) for _ in range(3)]
    kv, hints = build(k, v)
    with pytest.raises(DetectionError, match=re.escape(message)):
        kvlayout.detect(kv, "sglang", hints)


@pytest.mark.parametrize(
    ("form", "names"),
    [("two lists", ["kv_caches[0][0]", "kv_caches[1][0]", "kv_caches[1][1]"]),
     ("k_v", ["kv_caches[0]", "kv_caches[3]", "kv_caches[4]"])],
)  # fmt: skip
def test_sglang_split_names_the_callers_tensors(form: str, names: list[str]) -> None:
    """Served as one flat list of components (K layers, then V), a registration of two
    lists still names the tensors the caller passed: ``kv_caches[1][1]`` for the second V
    layer (messages said ``kv_caches[4]``, an entry the caller's list does not have)."""
    first_k, first_v, second_v = names
    k = [torch.randn(24, 4, 12) for _ in range(3)]
    v = [torch.randn(24, 4, 8) for _ in range(3)]

    def registration(k: list[torch.Tensor], v: list[torch.Tensor]) -> kvlayout.Registration:
        if form == "k_v":
            return kvlayout.detect(k + v, "sglang", {"tokens_per_block": 4, "kv_list_layout": "k_v"})
        return kvlayout.detect([k, v], "sglang", {"tokens_per_block": 4})

    carved = k[0].view(-1)[: 24 * 4 * 8].view(24, 4, 8)  # the first V layer in the first K layer's bytes
    with pytest.raises(DetectionError, match=re.escape(f"{first_v} and {first_k} overlap in memory")):
        registration(k, [carved, *v[1:]])
    reg = registration(k, v)
    v[1].data = torch.randn(24, 4, 8)  # the engine re-allocates one V layer in place
    for call in (reg.describe, lambda: kvlayout.transfer.prepare(reg.kernel_groups[1])):
        with pytest.raises(KVLayoutError, match=re.escape(f"{second_v} was re-allocated after detection")):
            call()
    kvlayout.transfer.prepare(reg.kernel_groups[0])  # the K layers are where they were


def test_caller_root_survives_copy_and_pickle() -> None:
    root = CallerRoot("kv_caches", {(4,): (1, 1)})
    for again in (copy.deepcopy(root), pickle.loads(pickle.dumps(root))):
        assert (
            describe_path((4,), again) == "kv_caches[1][1]"
            and describe_path((2, 3), again) == "kv_caches[2][3]"
        )
    assert f"{root} is empty" == "kv_caches is empty"


def test_sglang_split_takes_the_layer_groups_it_makes_or_none() -> None:
    k = [torch.randn(8, 2, 12) for _ in range(2)]
    v = [torch.randn(8, 2, 8) for _ in range(2)]
    hints = {"kv_list_layout": "k_v", "tokens_per_block": 4}
    for groups in ([[0, 1, 2, 3]], [[2, 3], [0, 1]]):
        assert len(kvlayout.detect(k + v, "sglang", hints, layer_groups=groups).kernel_groups) == 2
    with pytest.raises(
        DetectionError, match=r"layer_groups \[\[0, 1\]\] are neither one group of every entry"
    ):
        kvlayout.detect(k + v, "sglang", hints, layer_groups=[[0, 1]])


def test_trtllm_pools() -> None:
    pool = t(7, 5, 2, 2 * 3 * 4)
    hints = {"num_kv_heads": 2, "tokens_per_block": 3, "head_dim": 4}
    for kv in (pool, [pool]):
        fmt, out = detect(kv, "trtllm", hints)
        assert fmt == F.NB_NL_TWO_NH_BS_HS and out.shape == (7, 5, 2, 2, 3, 4)  # type: ignore[union-attr]
        assert out.data_ptr() == pool.data_ptr()  # type: ignore[union-attr]
    padded = torch.zeros(7, 5 * 2 * 24 + 6)[:, : 5 * 2 * 24].view(7, 5, 2, 24)
    fmt, out = detect(padded, "trtllm", hints)
    assert kvlayout.resolve_block_stride_and_log_layout(out, fmt, 0, 0) == 5 * 2 * 24 + 6


def test_trtllm_pools_written_by_an_nhd_backend_are_read_tokens_first() -> None:
    """TRT-LLM's FlashInfer and Vanilla backends write the pool through
    ``get_buffers(layer, kv_layout="NHD")``: ``[NB, 2, BS, NH, HS]`` per layer. The hint
    says so (the shape cannot); read as HND, each token's heads came from other tokens."""
    nb, nl, nh, bs, hs = 7, 5, 2, 3, 4
    pool = torch.arange(nb * nl * 2 * nh * bs * hs, dtype=torch.float32).view(nb, nl, 2, nh * bs * hs)
    sizes = {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hs}
    for kv, hints in (
        (pool, {**sizes, "kv_layout": "NHD"}),
        ([pool], {**sizes, "kv_layout": "NHD"}),
        (pool.view(nb, nl, 2, bs, nh, hs), {"kv_layout": "NHD"}),
    ):
        fmt, out = detect(kv, "trtllm", hints)
        assert fmt == F.NB_NL_TWO_BS_NH_HS and out.data_ptr() == pool.data_ptr()  # type: ignore[union-attr]
        reg = kvlayout.detect(kv, "trtllm", hints)
        layer = 3  # what the backend's kernels see: get_buffers(3, "NHD")
        seen = pool[:, layer].reshape(nb, 2, bs, nh, hs)
        (group,) = reg.kernel_groups
        d = group.descriptor()
        assert (d.nb, d.nl, d.bs, d.nh, d.hs) == (nb, nl, bs, nh, hs)
        assert isinstance(out, torch.Tensor) and torch.equal(out[:, layer], seen)
    assert detect(pool, "trtllm", sizes)[0] == F.NB_NL_TWO_NH_BS_HS  # TRT-LLM's own kernels: HND
    # a 6-D pool whose size hints fit tokens first only reads so (as vLLM's do), not as a contradiction
    assert detect(pool.view(nb, nl, 2, bs, nh, hs), "trtllm", sizes)[0] == F.NB_NL_TWO_BS_NH_HS
    with pytest.raises(DetectionError, match=r"\(with no kv_layout hint; the size hints fit NHD only\)"):
        detect(torch.zeros(nb, nl, 3, bs, nh, hs), "trtllm", sizes)


def test_trtllm_mla_pools_are_read_as_latents() -> None:
    """TRT-LLM's MLA cache (DeepSeek: CacheType.SELFKONLY) is a K-only pool, kv factor 1:
    ``get_unique_primary_pool()`` is ``[NB, NL, 1, BS*HS]``, one latent head per token."""
    pool = t(7, 5, 1, 3 * 576)
    for kv, hints in (
        (pool, {"tokens_per_block": 3, "head_dim": 576}),
        ([pool], {"num_kv_heads": 1, "tokens_per_block": 3, "head_dim": 576}),
        (pool.view(7, 5, 1, 1, 3, 576), {}),
        (pool.view(7, 5, 1, 3, 1, 576), {"tokens_per_block": 3}),  # Dynamo KVBM's export
    ):
        fmt, out = detect(kv, "trtllm", hints)
        assert fmt == F.NB_NL_ONE_BS_HS and out.shape == (7, 5, 1, 3, 576)  # type: ignore[union-attr]
        assert out.data_ptr() == pool.data_ptr()  # type: ignore[union-attr]
    reg = kvlayout.detect(pool, "trtllm", {"tokens_per_block": 3, "head_dim": 576})
    (group,) = reg.kernel_groups
    d = group.descriptor()
    assert group.layout.is_mla and (d.kv_size, d.nl, d.nb, d.bs, d.nh, d.hs) == (1, 5, 7, 3, 1, 576)


@pytest.mark.parametrize(
    ("kv", "hints", "error", "message"),
    [
        (t(7, 5, 1, 24), {"tokens_per_block": 3}, LayoutHintError,
         "K-only (MLA) pool [NB, NL, 1, BS*HS] (7, 5, 1, 24) needs layout hints tokens_per_block and head_dim "
         "to split its rows; missing: head_dim"),
        (t(7, 5, 1, 24), {"tokens_per_block": 3, "head_dim": 5}, LayoutHintError,
         "flat dim 24 != tokens_per_block (3) * head_dim (5) = 15"),
        (t(7, 5, 1, 24), {"num_kv_heads": 2, "tokens_per_block": 3, "head_dim": 8}, LayoutHintError,
         "a K-only (MLA) pool of one latent head; layout hint num_kv_heads=2 contradicts it"),
        (t(7, 5, 1, 2, 3, 4), {}, DetectionError, "but neither dim 3 nor dim 4 is 1: an MLA pool holds one"),
        (t(7, 5, 1, 1, 3, 4), {"head_dim": 8}, LayoutHintError,
         "TRT-LLM: layout hint head_dim=8 contradicts NB_NL_ONE_BS_HS, whose HS is 4"),
    ],
)  # fmt: skip
def test_trtllm_mla_errors(kv: Any, hints: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        detect(kv, "trtllm", hints)


@pytest.mark.parametrize(
    ("kv", "hints", "error", "message"),
    [
        (t(7, 5, 2, 24), {"num_kv_heads": 2}, LayoutHintError, "missing: tokens_per_block, head_dim"),
        (t(7, 5, 2, 24), {"num_kv_heads": 2, "tokens_per_block": 3, "head_dim": 5}, LayoutHintError,
         "flat dim 24 != num_kv_heads (2) * tokens_per_block (3) * head_dim (5) = 30"),
        (t(7, 5, 2, 24), {"num_kv_heads": 4, "tokens_per_block": 3, "head_dim": 4}, LayoutHintError,
         "flat dim 24 != num_kv_heads (4) * tokens_per_block (3) * head_dim (4) = 48: num_kv_heads is this "
         "rank's KV heads (the model's over the TP degree), and 2 fits"),
        (t(7, 5, 3, 24), {"num_kv_heads": 2, "tokens_per_block": 3, "head_dim": 4}, DetectionError,
         "the K/V axis (dim 2) is 3, not 2 or 1"),
        ([t(7, 5, 2, 2, 3, 4)] * 2, {}, DetectionError, "TRT-LLM registers one KV pool tensor, got a list of 2 entries (a model whose layers differ in KV heads or attention window has a pool each: detect each on its own)"),
        (t(7, 5, 2, 2, 3, 4), {"tokens_per_block": 4}, LayoutHintError,
         "TRT-LLM: layout hint tokens_per_block=4 contradicts NB_NL_TWO_NH_BS_HS, whose BS is 3"),
        (t(7, 5, 3, 2, 3, 4), {}, DetectionError, "NB_NL_TWO_NH_BS_HS needs dim 2 == 2 (got 3)"),
        (layers((7, 3, 4)), {}, DetectionError, "TRT-LLM registers one KV pool tensor, got a list of 5"),
        (torch.zeros(7, 5, 2, 12, dtype=torch.int8), {"num_kv_heads": 2, "tokens_per_block": 3, "head_dim": 4},
         LayoutHintError, "flat dim 12 != num_kv_heads (2) * tokens_per_block (3) * head_dim (4) = 24: a byte "
         "pool half that size is NVFP4, two values a byte, whose block scales TRT-LLM keeps in another pool; "
         "detect it with head_dim=2"),
    ],
)  # fmt: skip
def test_trtllm_errors(kv: Any, hints: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        detect(kv, "trtllm", hints)


def test_atom() -> None:
    assert detect(layers((7, 3, 4)), "atom")[0] == F.NL_X_NB_BS_HS
    with pytest.raises(DetectionError, match=re.escape("no ATOM format has list depth 1 and tensor rank 5")):
        detect(layers((2, 7, 3, 2, 4)), "atom")


# -- engines and hints ------------------------------------------------------------------------------


def test_engines_are_enums_or_strings() -> None:
    kv = layers((7, 3, 4))
    for engine in (EngineType.VLLM, "vllm", "VLLM", " vLLM "):
        assert detect(kv, engine)[0] == F.NL_X_NB_BS_HS
    assert detect(t(7, 5, 2, 2, 3, 4), "TRT-LLM")[0] == detect(t(7, 5, 2, 2, 3, 4), "trt_llm")[0]
    assert {str(e) for e in EngineType} == {"vllm", "sglang", "trtllm", "atom", "max", "kvbm"}
    assert detect(t(7, 2, 5, 3, 2, 4), "Max")[0] == F.NB_KV_NL_BS_NH_HS
    with pytest.raises(KVLayoutError, match=re.escape("unknown serving engine 'mock'; known engines: vllm")):
        detect(kv, "mock")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "a serving engine is an EngineType, a str or an enum member whose value is a str, not int"
        ),
    ):
        detect(kv, 3)  # type: ignore[arg-type]


def test_every_engine_has_a_detector_found_by_module_discovery() -> None:
    from kvlayout.detection.registry import detectors

    assert set(detectors()) == set(EngineType)


class _Layout(enum.Enum):
    """vLLM's ``KVCacheLayout`` (``cache_config.get_resolved_kv_cache_layout()``): a member
    is named as the hint, its value the stride order."""

    LBHNC = (0, 1, 2, 3, 4)
    OTHER = (4, 3, 2, 1, 0)


def test_a_layout_enum_member_reads_as_its_name() -> None:
    """A connector holds vLLM's layout as ``get_resolved_kv_cache_layout()``, an enum
    member: it reads as the layout of its name (it was refused, being no str)."""
    kv = layers((7, 3, 4))
    assert (
        detect(kv, "vllm", {"kv_layout": _Layout.LBHNC})[0] == detect(kv, "vllm", {"kv_layout": "LBHNC"})[0]
    )
    with pytest.raises(
        TypeError,
        match=r"^layout hint kv_layout must be a str, not _Layout \(<_Layout.OTHER: "
        r"\(4, 3, 2, 1, 0\)>\)$",
    ):  # no layout of that name: nothing to suggest
        detect(layers((7, 3, 4)), "vllm", {"kv_layout": _Layout.OTHER})


@pytest.mark.parametrize(
    ("hints", "error", "message"),
    [
        ({"kv_layuot": "NHD"}, LayoutHintError, "unknown layout hint 'kv_layuot'; known hints: attn_backend, head_dim"),
        ({"kv_layout": "NDH"}, LayoutHintError, "layout hint kv_layout='NDH' is not one of NHD, HND, BHLNC, BLHNC, BLNHC"),
        ({"kv_layout": 1}, TypeError, "layout hint kv_layout must be a str, not int"),
        ({"tokens_per_block": 0}, LayoutHintError, "layout hint tokens_per_block must be a positive int, got 0"),
        ({"tokens_per_block": -1}, LayoutHintError, "layout hint tokens_per_block must be a positive int, got -1"),
        ({"tokens_per_block": True}, TypeError, "layout hint tokens_per_block must be an int, not bool"),
        ({"num_kv_heads": 2.0}, TypeError, "layout hint num_kv_heads must be an int, not float"),
        ({"head_dim": "128"}, TypeError, "layout hint head_dim must be an int, not str"),
        ({"kv_list_layout": "kv"}, LayoutHintError, "layout hint kv_list_layout='kv' is not one of k_v, unified"),
        ({"kv_pair_axis": 2}, LayoutHintError, "layout hint kv_pair_axis must be 0 (K/V first"),
        ({"kv_pair_axis": False}, TypeError, "layout hint kv_pair_axis must be an int, not bool"),
        (["kv_layout"], TypeError, "layout_hints must be a LayoutHints or a dict, not list"),
    ],
)  # fmt: skip
def test_bad_hints(hints: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        detect(layers((7, 3, 4)), "vllm", hints)


@pytest.mark.parametrize(
    ("engine", "kv", "hints", "message"),
    [
        ("sglang", [t(64, 8, 16) for _ in range(4)], {"kv_list_layout": "k_v", "tokens_per_block": 16, "num_kv_heads": 4},
         "SGLang: layout hint num_kv_heads=4 contradicts TWO_X_NL_X_NB_BS_NH_HS, whose NH is 8"),
        ("atom", [t(7, 3, 576)], {"head_dim": 7}, "ATOM: layout hint head_dim=7 contradicts NL_X_NB_BS_HS, whose HS is 576"),
    ],
)  # fmt: skip
def test_every_engine_checks_its_size_hints(
    engine: str, kv: Any, hints: dict[str, Any], message: str
) -> None:
    with pytest.raises(LayoutHintError, match=re.escape(message)):
        detect(kv, engine, hints)


def test_hints_as_an_object_or_a_dict() -> None:
    hints = LayoutHints(kv_layout="NHD", tokens_per_block=16)
    assert LayoutHints.coerce(hints) is hints
    assert LayoutHints.coerce({"kv_layout": "NHD", "tokens_per_block": 16, "head_dim": None}) == hints
    assert LayoutHints.coerce(None) == LayoutHints()
    assert detect(layers((2, 7, 3, 2, 4)), "vllm", LayoutHints(kv_layout="NHD"))[0] == F.NL_X_TWO_NB_BS_NH_HS
    with pytest.raises(LayoutHintError, match="positive int"):
        LayoutHints(tokens_per_block=0)


# -- bad structures ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "error", "message"),
    [
        ([], DetectionError, "kv_caches is empty"),
        ([[], []], DetectionError, "kv_caches[0] is an empty list"),
        ([[t(7, 3, 4)], []], DetectionError, "kv_caches[1] has 0 entries, but kv_caches[0] has 1"),
        ({"model.layers.0": t(7, 3, 4)}, TypeError, "kv_caches: is a dict; pass the tensors as a list"),
        ("kv_caches", TypeError, "kv_caches: is a str, not a tensor"),
        (None, TypeError, "kv_caches: is None"),
        ([t(7, 3, 4), None], TypeError, "kv_caches[1]: is None"),
        ([t(7, 3, 4), [t(7, 3, 4)]], DetectionError, "kv_caches[1] is a list, but kv_caches[0] is a tensor"),
        ([[t(7, 3, 4)], t(7, 3, 4)], DetectionError, "kv_caches[1] is a tensor, but kv_caches[0] is a list"),
        ([[t(7, 3, 4), [t(7, 3, 4)]]], DetectionError, "kv_caches[0][1] is a list, but kv_caches[0][0] is a tensor"),
        ([[[t(7, 3, 4)], t(7, 3, 4)]], DetectionError, "kv_caches[0][1] is a tensor, but kv_caches[0][0] is a list"),
        ([[t(7, 3, 2, 4), t(7, 3, 4)]], DetectionError, "kv_caches[0][1]: rank 3 differs from kv_caches[0][0] (rank 4)"),
        ([[[[t(2)]]]], DetectionError, "no vLLM format has list depth 4"),
        ([*layers((7, 3, 4)), t(7, 3, 4, dtype=torch.bfloat16)], DetectionError,
         "kv_caches[5]: dtype torch.bfloat16 differs from kv_caches[0] (torch.float16)"),
        ([*layers((7, 3, 4)), t(7, 3, 8)], DetectionError,
         "kv_caches[5]: shape (7, 3, 8) differs from kv_caches[0] (7, 3, 4); one detection reads one structure"),
        ([*layers((7, 3, 4)), t(7, 3, 4, device="meta")], DetectionError,
         "kv_caches[5]: device meta differs from kv_caches[0] (cpu)"),
        ([t(4, 3, 5)[..., :2]], StridedViewError, "kv_caches[0]: tensor is non-contiguous"),
        ([torch.zeros(64).as_strided((4, 3, 2), (5, 2, 1))], StridedViewError, "(overlapping blocks)"),
    ],
)  # fmt: skip
def test_bad_structures(kv: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        detect(kv, "vllm", {"kv_layout": "NHD"})


@pytest.mark.parametrize("view", ["values", "keys", "items"])
def test_a_dict_view_gets_the_dicts_hint(view: str) -> None:
    caches = {f"model.layers.{i}": t(2, 7, 3, 2, 4) for i in range(2)}
    kv = getattr(caches, view)()
    message = (
        f"kv_caches is a dict_{view}; pass the tensors as a list "
        "(for example list(kv_caches.values()) in registration order)"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    with pytest.raises(TypeError, match=re.escape(message.replace("kv_caches is", "kv_caches: is"))):
        detect(kv, "vllm", {"kv_layout": "NHD"})


def test_the_dtype_mismatch_message_is_exact() -> None:
    kv = [t(2, 7, 3, 2, 4, dtype=torch.bfloat16) for _ in range(3)] + [t(2, 7, 3, 2, 4)]
    with pytest.raises(DetectionError) as info:
        detect(kv, "vllm", {"kv_layout": "NHD"})
    assert str(info.value) == "kv_caches[3]: dtype torch.float16 differs from kv_caches[0] (torch.bfloat16)"


junk = st.recursive(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.builds(torch.zeros, st.lists(st.integers(0, 3), max_size=6)),
        st.dictionaries(st.text(max_size=2), st.none(), max_size=2),
    ),
    lambda children: st.one_of(st.lists(children, max_size=3), st.tuples(children, children)),
    max_leaves=8,
)


@given(junk, st.sampled_from([e.value for e in EngineType]))
def test_anything_is_detected_or_rejected_with_a_clear_error(kv: Any, engine: str) -> None:
    try:
        fmt, _ = detect(kv, engine, {"kv_layout": "NHD"} if engine == "vllm" else {})
    except (KVLayoutError, TypeError) as exc:
        assert str(exc)
    else:  # one of the engine's formats (vLLM also reads the HND cross-layer layout)
        assert engine in FORMAT_INFO[fmt].engines or kvlayout.layout_of(fmt).is_cross_layer


def test_pick_reports_formats_its_decisions_do_not_separate() -> None:
    """A detector that forgets a decision gets an error, never an arbitrary answer."""
    from kvlayout.detection.base import pick, probe

    p = probe([t(2, 7, 3, 2, 4)])
    with pytest.raises(
        DetectionError, match=re.escape("fits several formats (NL_X_TWO_NB_BS_NH_HS, NL_X_TWO_NB_NH_BS_HS)")
    ):
        pick(EngineType.VLLM, p, formats=(F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS))
    assert pick(EngineType.VLLM, p, decide=[("kv_layout", "is_hnd", True)]) == F.NL_X_TWO_NB_NH_BS_HS


def test_zero_and_one_sized_registrations_detect() -> None:
    fmt, out = detect([t(0, 3, 4), t(0, 3, 4)], "vllm")
    assert fmt == F.NL_X_NB_BS_HS and kvlayout.get_num_blocks(out, fmt) == 0
    assert kvlayout.make_page_buffer_shape_desc(out, fmt, 0, 2, 0, 3).nb == 0
    fmt, out = detect([t(1, 1, 1)], "vllm")
    assert (fmt, kvlayout.get_block_size(out, fmt), kvlayout.get_head_size(out, fmt)) == (
        F.NL_X_NB_BS_HS,
        1,
        1,
    )
    fmt, out = detect([t(2, 1, 1, 1, 1)], "vllm", {"kv_layout": "NHD"})
    assert fmt == F.NL_X_TWO_NB_BS_NH_HS and out[0].shape == (2, 1, 1, 1, 1)  # type: ignore[union-attr]


def test_a_layer_detected_apart_is_named_by_the_callers_index() -> None:
    """kvlayout.detect buckets layers by structure; a bucket's error names the caller's
    entries (not its own list's), and a layer group only when the caller passed groups."""
    kv = [*layers((2, 7, 3, 2, 4), n=3), t(7, 3, 2, 4, 2)]
    with pytest.raises(DetectionError) as caught:
        kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    message = str(caught.value)
    assert message.startswith(
        "kv_caches[3], detected on its own: vLLM: the registration (kv_caches[3]: shape (7, 3, 2, 4, 2), "
    )
    assert "kv_caches[0]" not in message and "layer group" not in message
    with pytest.raises(DetectionError) as caught:
        kvlayout.detect(
            [*kv[::-1], t(7, 3, 2, 4, 2)], "vllm", {"kv_layout": "NHD"}, layer_groups=[[1], [0, 2, 3, 4]]
        )
    assert str(caught.value).startswith(
        "kv_caches entries [0, 4] of layer group 1, detected together as a list of 2: vLLM: the registration "
        "(kv_caches[0]: shape (7, 3, 2, 4, 2)"
    )


def test_an_hnd_hint_that_rules_out_the_only_fitting_format_says_so() -> None:
    """vLLM-Ascend's per-layer (K, V) tuples are NHD only: under kv_layout=HND the one
    format that fits would read the heads as tokens, so nothing fits, and the message
    names the hint and the format it ruled out."""
    kv = [(t(4, 16, 8, 64), t(4, 16, 8, 64)) for _ in range(2)]
    assert kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}).format == F.NL_X_TWO_X_NB_BS_NH_HS
    with pytest.raises(
        DetectionError, match=r"kv_layout=HND, which rules out NL_X_TWO_X_NB_BS_NH_HS \(tokens before"
    ):
        kvlayout.detect(kv, "vllm", {"kv_layout": "HND"})
