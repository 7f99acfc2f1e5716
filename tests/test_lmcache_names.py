"""Every name an LMCache 0.5.6 caller of the layout subsystem uses (issue 20, items 1-10).

Each test is written from LMCache's documented behaviour (the facts sheets
`lmcache-0.5.6-facts.md` and `lmcache-branch-facts.md`, cited by section), with
kvlayout's deliberate differences asserted where they apply (docs/migrating-from-lmcache.md).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import KVLayoutError, PageBufferShapeDesc, RegistrationError
from kvlayout.layout import description
from kvlayout.layout.description import Axis, Grouping, KVPacking

B, C, H, KV, L, N = Axis.B, Axis.C, Axis.H, Axis.KV, Axis.L, Axis.N
NB, NL, BS, NH, HS = 7, 5, 3, 2, 4  # the facts sheet's test dims (section 8)


def t(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# -- 1. extract_kv_cache_shapes (facts 5.1) --------------------------------------------------


def test_extract_kv_cache_shapes_is_the_set_of_every_leaf_shape() -> None:
    hybrid = [t(2, NB, BS, NH, HS) for _ in range(3)] + [t(NB, BS, HS), t(NB, BS, HS, dtype=torch.bfloat16)]
    assert kvlayout.extract_kv_cache_shapes(hybrid) == {
        torch.Size([2, NB, BS, NH, HS]),
        torch.Size([NB, BS, HS]),
    }
    pairs = [(t(NB, BS, NH, HS), t(NB, BS, NH, HS)) for _ in range(NL)]  # Ascend (K, V) tuples
    assert kvlayout.extract_kv_cache_shapes(pairs) == {torch.Size([NB, BS, NH, HS])}
    assert kvlayout.extract_kv_cache_shapes(t(NB, NL, 2, BS, NH, HS)) == {torch.Size([NB, NL, 2, BS, NH, HS])}
    hnd_as_nhd = [t(2, NB, NH, BS, HS).permute(0, 1, 3, 2, 4)]  # shapes as registered, not memory order
    assert kvlayout.extract_kv_cache_shapes(hnd_as_nhd) == {torch.Size([2, NB, BS, NH, HS])}
    with pytest.raises(TypeError, match=re.escape("kv_caches[1]: is None")):
        kvlayout.extract_kv_cache_shapes([t(NB, BS, HS), None])  # type: ignore[list-item]


# -- 2. get_shape_and_dtype (facts 6.2) -------------------------------------------------------


def test_get_shape_and_dtype_keys_each_entry_nested_as_registered() -> None:
    k, v = t(NB, BS, NH, HS), t(NB, BS, NH, HS, dtype=torch.bfloat16)
    kv: list[Any] = [t(2, NB, BS, NH, HS), (k, v), [t(NB, BS, HS)]]
    keys = kvlayout.get_shape_and_dtype(kv)
    assert keys == [
        ((2, NB, BS, NH, HS), torch.float16),
        (((NB, BS, NH, HS), torch.float16), ((NB, BS, NH, HS), torch.bfloat16)),
        (((NB, BS, HS), torch.float16),),
    ]
    assert (
        len({*keys, *kvlayout.get_shape_and_dtype([t(2, NB, BS, NH, HS)])}) == 3
    )  # hashable, equal keys merge
    assert kvlayout.get_shape_and_dtype(kv, layer_indices=[2, 0]) == [keys[2], keys[0]]
    with pytest.raises(TypeError, match=re.escape("kv_caches is one tensor")):
        kvlayout.get_shape_and_dtype(t(NB, NL, 2, BS, NH, HS))
    with pytest.raises(TypeError, match=re.escape("kv_caches[1][0]: is a str")):
        kvlayout.get_shape_and_dtype([t(NB, BS, HS), ["K"]])
    with pytest.raises(KVLayoutError, match="layer index 3 is out of range for kv_caches of 3 entries"):
        kvlayout.get_shape_and_dtype(kv, [3])
    with pytest.raises(TypeError, match=re.escape("a layer index is an int, not str ('0')")):
        kvlayout.get_shape_and_dtype(kv, ["0"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=re.escape("a layer index is an int, not bool (True)")):
        kvlayout.get_shape_and_dtype(kv, [True])


# -- 3. KVFormatSpec.paged_layer_shape (facts 3.6) ------------------------------------------

PAGED = {  # (num_heads, head_size) -> shape, with NB 7, BS 3
    F.NL_X_TWO_NB_BS_NH_HS: ((NH, HS), (2, NB, BS, NH, HS)),
    F.NL_X_NB_TWO_BS_NH_HS: ((NH, HS), (NB, 2, BS, NH, HS)),
    F.NL_X_TWO_NB_NH_BS_HS: ((NH, HS), (2, NB, NH, BS, HS)),
    F.NL_X_NB_TWO_NH_BS_HS: ((NH, HS), (NB, 2, NH, BS, HS)),
    F.NL_X_NB_BS_HS: ((1, HS), (NB, BS, HS)),
    F.NL_X_NBBS_ONE_HS: ((1, HS), (NB * BS, 1, HS)),
    F.NL_X_NB_NH_BS_CS: ((NH, 2 * HS), (NB, NH, BS, 2 * HS)),
    F.NL_X_NB_BS_NH_CS: ((NH, 2 * HS), (NB, BS, NH, 2 * HS)),
    F.NL_X_NB_BSV_BSS: ((1, 132), (NB, BS, 132)),
    F.NL_X_NB_BSK: ((1, 256), (NB, BS, 256)),
    F.NL_X_NB_BSV4_BSS4: ((1, 68), (NB, BS, 68)),
    F.NL_X_NB_BS_NH_HS: ((NH, HS), (NB, BS, NH, HS)),
    F.NL_X_NH_NB_BS_CS: ((NH, 2 * HS), (NH, NB, BS, 2 * HS)),  # kvlayout's (vLLM's LHBNC)
    # kvlayout keeps every axis: LMCache squeezes 15 to 5-D and folds 10/11 to 4-D
    F.NL_X_TWO_NB_NH_ONE_BS_HS: ((NH, HS), (2, NB, NH, 1, BS, HS)),
    F.NL_X_NB_NH_BS_TWO_HS: ((NH, 2 * HS), (NB, NH, BS, 2, HS)),
    F.NL_X_NB_BS_NH_TWO_HS: ((NH, 2 * HS), (NB, BS, NH, 2, HS)),
}


def test_paged_layer_shape_is_one_layers_tensor_for_every_per_layer_format() -> None:
    for fmt in F:
        cls = kvlayout.get_spec_class(fmt)
        assert isinstance(inspect.getattr_static(cls, "paged_layer_shape"), classmethod)
        if fmt in PAGED:
            (nh, hs), shape = PAGED[fmt]
            assert cls.paged_layer_shape(NB, BS, nh, hs) == shape, fmt
        elif kvlayout.layout_of(fmt).is_layer_list and kvlayout.layout_of(fmt).kv_size is None:
            # one tensor per layer whose K/V axis the tensors size (MAX's per-layer buffers)
            with pytest.raises(ValueError, match=f"{fmt.name}: this needs a size for KV"):
                cls.paged_layer_shape(NB, BS, NH, HS)
        else:  # cross-layer, K/V lists, per-layer tuples
            with pytest.raises(ValueError, match=f"{fmt.name} does not have one paged tensor per layer"):
                cls.paged_layer_shape(NB, BS, NH, HS)
    mla, indexer = kvlayout.get_spec_class(F.NL_X_NB_BS_HS), kvlayout.get_spec_class(F.NL_X_NB_BSV_BSS)
    with pytest.raises(
        KVLayoutError, match=r"NL_X_NB_BS_HS cannot have num_heads=8 \(its layout has num_heads=1\)"
    ):
        mla.paged_layer_shape(NB, BS, 8, HS)
    with pytest.raises(KVLayoutError, match=r"cannot have head_size=128 .* head_size=132"):
        indexer.paged_layer_shape(NB, BS, 1, 128)
    with pytest.raises(KVLayoutError, match="head_size must be a multiple of 2, got 7"):
        kvlayout.get_spec_class(F.NL_X_NB_NH_BS_TWO_HS).paged_layer_shape(NB, BS, NH, 7)
    with pytest.raises(TypeError, match="block_size must be an int, not float"):
        mla.paged_layer_shape(NB, 3.0, 1, HS)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:NL_X_NB_.*_TWO_HS is deprecated:DeprecationWarning")
@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(PAGED)),
    st.integers(0, 9),
    st.integers(1, 9),
    st.integers(1, 5),
    st.integers(1, 6),
)
def test_paged_layer_shape_reads_back_as_its_sizes(fmt: F, nb: int, bs: int, nh: int, row: int) -> None:
    cls = kvlayout.get_spec_class(fmt)
    (nh0, hs0), _ = PAGED[fmt]
    nh = nh if nh0 == NH else 1
    hs = hs0 if kvlayout.is_indexer(fmt) else row * (2 if hs0 == 2 * HS else 1)  # a record's width is fixed
    spec = kvlayout.get_spec([torch.empty(cls.paged_layer_shape(nb, bs, nh, hs), device="meta")], fmt)
    assert (spec.num_heads(), spec.head_size(), spec.page_buffer_size()) == (nh, hs, nb * bs)
    if not cls.is_pbs_fused:
        assert (spec.num_blocks(), spec.block_size()) == (nb, bs)


# -- 4. PageBufferShapeDesc built field by field (facts 3.6, 8.3) -----------------------------


def test_concrete_shape_takes_lmcaches_size_of_a_label() -> None:
    # LMCache's concrete_shape(fmt, size) calls size(label) for each rendered label that is
    # not ONE/TWO/NP (facts 3.6); the strings are its spec-geometry golden values (facts 8.2)
    sizes = {"NB": NB, "NL": NL, "BS": BS, "NH": NH, "HS": HS, "CS": 2 * HS, "PBS": NB * BS}
    blocked = {**sizes, "HS": 132, "BSxVALS": BS, "BSxSCALES": BS}  # the rows of a blocked-scale page
    asked: list[str] = []

    def size(label: str) -> int:
        asked.append(label)
        return blocked[label]

    golden = {
        F.NB_NL_TWO_BS_NH_HS: "[7, 5, 2, 3, 2, 4]", F.NB_NL_TWO_NH_BS_HS: "[7, 5, 2, 2, 3, 4]",
        F.NL_X_TWO_NB_BS_NH_HS: "5 x [2, 7, 3, 2, 4]", F.NL_X_NB_TWO_BS_NH_HS: "5 x [7, 2, 3, 2, 4]",
        F.NL_X_TWO_NB_NH_BS_HS: "5 x [2, 7, 2, 3, 4]", F.NL_X_TWO_NB_NH_ONE_BS_HS: "5 x [2, 7, 2, 1, 3, 4]",
        F.NL_X_NB_TWO_NH_BS_HS: "5 x [7, 2, 2, 3, 4]", F.NL_X_NB_BS_HS: "5 x [7, 3, 4]",
        F.TWO_X_NL_X_NBBS_NH_HS: "2 x 5 x [21, 2, 4]", F.TWO_X_NL_X_NB_BS_NH_HS: "2 x 5 x [7, 3, 2, 4]",
        F.NL_X_NBBS_ONE_HS: "5 x [21, 1, 4]", F.NL_X_NB_NH_BS_CS: "5 x [7, 2, 3, 8]",
        F.NL_X_NB_BS_NH_CS: "5 x [7, 3, 2, 8]", F.NL_X_TWO_X_NB_BS_NH_HS: "5 x 2 x [7, 3, 2, 4]",
        F.NL_X_NB_BS_NH_HS: "5 x [7, 3, 2, 4]",
    }  # fmt: skip
    for fmt, want in golden.items():
        assert kvlayout.concrete_shape(fmt, lambda label: sizes[label]) == want, fmt
        assert kvlayout.concrete_shape(fmt, sizes) == want, fmt  # a mapping, as before
    assert kvlayout.concrete_shape(F.NL_X_NB_BSV_BSS, size) == "5 x [7, 3, 3]"  # facts 3.2 item 1
    assert asked == ["NL", "NB", "BSxVALS", "BSxSCALES"]
    with pytest.raises(TypeError, match=r"^sizes must be a mapping or a callable of a label, not int$"):
        kvlayout.concrete_shape(F.NL_X_NB_BS_HS, 3)  # type: ignore[arg-type]


def test_page_buffer_shape_desc_builds_empty_then_field_by_field() -> None:
    desc = PageBufferShapeDesc()  # as LMCache's connectors and its shape-spec parser build it
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 2, 32, 2048, 16, 8, 128
    desc.element_size = torch.bfloat16.itemsize
    desc.dtype = torch.bfloat16  # LMCache's side channel
    assert desc.block_stride_elems == 0  # never assigned: tightly packed
    assert desc.validate() is desc
    shape = kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, F.NL_X_TWO_NB_BS_NH_HS)
    assert shape == "32 x [2, 2048, 16, 8, 128]"
    half = PageBufferShapeDesc()
    half.kv_size = 2
    with pytest.raises(KVLayoutError, match=re.escape("PageBufferShapeDesc.nl is 0 (0: never assigned?)")):
        kvlayout.get_concrete_engine_kv_shape_from_shape_desc(half, F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(TypeError, match=r"^shape_desc must be a PageBufferShapeDesc, not dict$"):
        kvlayout.get_concrete_engine_kv_shape_from_shape_desc({"nl": 32}, F.NL_X_TWO_NB_BS_NH_HS)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        desc.n_heads = 8  # type: ignore[attr-defined]  # a misspelt field is no silent new attribute
    with pytest.raises(KVLayoutError, match=re.escape("PageBufferShapeDesc.bs is 0")):
        PageBufferShapeDesc.checked(2, 1, 4, 0, 1, 8, 2, 0)
    with pytest.raises(TypeError, match=re.escape("PageBufferShapeDesc.hs must be an int, not float")):
        PageBufferShapeDesc.checked(2, 1, 4, 4, 1, 8.0, 2, 0)
    made = kvlayout.make_page_buffer_shape_desc(
        [t(2, 32, 16, 8, 64) for _ in range(4)], F.NL_X_TWO_NB_BS_NH_HS, 0, 4, 32, 16
    )
    assert made == PageBufferShapeDesc(2, 4, 32, 16, 8, 64, 2, 0, torch.float16)  # facts 8.4, dtype set


# -- 5. LayerGroupIdentity / KernelGroupIdentity (facts 9.1) ----------------------------------


def test_layer_group_identity_is_built_from_lmcaches_seven_fields() -> None:
    seven: dict[str, Any] = {
        "kv_size": 2, "num_heads": NH, "head_size": HS, "block_size": BS, "engine_group_idx": 0,
        "dtype": torch.float16, "engine_kv_format": F.NL_X_TWO_NB_BS_NH_HS,
    }  # fmt: skip
    identity = kvlayout.LayerGroupIdentity(**seven)
    assert kvlayout.KernelGroupIdentity is kvlayout.LayerGroupIdentity
    assert kvlayout.KernelGroupIdentity(*seven.values()) == identity
    assert (identity.block_stride_elems, identity.num_blocks) == (None, None)
    kv = [t(2, NB, BS, NH, HS) for _ in range(NL)]
    [(grouped, layers)] = kvlayout.group_layers_by_identity(kv, [F.NL_X_TWO_NB_BS_NH_HS] * NL)
    assert grouped[:7] == identity[:7] and layers == list(range(NL))


# -- 6. resolve_vllm_kv_layout (facts 5.2 step A; branch facts 5) ------------------------------


def test_resolve_vllm_kv_layout_hint_wins_else_hnd_on_the_cpu() -> None:
    resolve = kvlayout.resolve_vllm_kv_layout
    assert resolve({}, cpu_attention_backend=True) == "HND"
    assert resolve(None, cpu_attention_backend=False) == resolve({}) == "NHD"
    assert resolve({"kv_layout": "NHD"}, cpu_attention_backend=True) == "NHD"  # PR #4798: the hint wins
    assert resolve(kvlayout.LayoutHints(kv_layout="BLHNC"), cpu_attention_backend=False) == "BLHNC"
    assert resolve({"kv_layout": "lhbnc"}, cpu_attention_backend=True) == "LHBNC"  # heads outside blocks
    assert resolve({"kv_layout": "bhlnc"}, cpu_attention_backend=False) == "BHLNC"  # layers inside heads
    with pytest.raises(ValueError, match="kv_layout='HLBNC': heads outside both the layers and the blocks"):
        resolve({"kv_layout": "HLBNC"}, cpu_attention_backend=False)
    with pytest.raises(ValueError, match="kv_layout='XYZ' is not one of NHD, HND"):
        resolve({"kv_layout": "XYZ"})
    with pytest.raises(TypeError, match="cpu_attention_backend must be a bool"):
        resolve({}, cpu_attention_backend="cpu")  # type: ignore[arg-type]
    # detection reads what it resolves: CPU tensors without a hint are HND
    fmt, _ = kvlayout.normalize_kv_and_discover_format([t(2, NB, NH, BS, HS) for _ in range(2)], "vllm")
    assert (
        fmt is F.NL_X_TWO_NB_NH_BS_HS and resolve({}, cpu_attention_backend=True) in kvlayout.HND_KV_LAYOUTS
    )


# -- 7. SGLang: "not divisible" (facts 5.3 steps 2 and 3) --------------------------------------


@pytest.mark.parametrize(
    ("kv", "hints"),
    [
        ([t(22, NH, HS) for _ in range(4)], {"kv_list_layout": "k_v", "tokens_per_block": 4}),
        ([t(22, 1, HS) for _ in range(2)], {"tokens_per_block": 4}),
    ],
    ids=["mha-k_v", "mla"],
)
def test_sglang_page_buffer_that_does_not_split_says_not_divisible(
    kv: list[torch.Tensor], hints: dict[str, object]
) -> None:
    with pytest.raises(
        ValueError,
        match=r"SGLang: kv_caches\[0\].*: PBS=22 token slots are not divisible by tokens_per_block=4",
    ):
        kvlayout.normalize_kv_and_discover_format(kv, "sglang", hints)


# -- 8. the group-edits module (facts 9.4; seed 000) -------------------------------------------


def test_group_edits_module_has_lmcaches_rule_names_signature_logger_and_vllm_kinds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    edits = importlib.import_module("kvlayout.integrations.vllm.edits")
    rules = edits.KV_CACHE_GROUP_EDITS
    # kvlayout's own rules (head-slot-pages, packed-head-rows) have no LMCache name
    assert [r.lmcache_name for r in rules if r.lmcache_name is not None] == [
        "mamba-unified-view", "mamba-page-view", "subpaged-mla-attention-view", "subpaged-attention-view",
    ]  # fmt: skip
    for rule in rules:
        assert list(inspect.signature(rule.apply).parameters) == ["spec", "value", "layout_hints"]
    assert isinstance(edits.logger, logging.Logger) and edits.logger.name == edits.__name__

    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvlayout.integrations.vllm.edits import KVCacheSpecKind, get_kv_cache_spec_kind
    from kvlayout.integrations.vllm.specs import spec_kind
    from kvlayout.testing import vllm as vx

    assert KVCacheSpecKind is interface.KVCacheSpecKind
    assert get_kv_cache_spec_kind is interface.get_kv_cache_spec_kind
    from kvlayout.integrations.vllm import edits

    with pytest.raises(
        AttributeError, match=r"^module 'kvlayout\.integrations\.vllm\.edits' has no attribute 'KVCacheSpec'$"
    ):
        edits.KVCacheSpec  # noqa: B018  # only the two names LMCache imports from here
    engine = vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=4, layout=vx.KVCacheLayout.LBNHC)
    for group in engine.config.kv_cache_groups:  # kvlayout's structural kinds are vLLM's
        assert spec_kind(group.kv_cache_spec).value == get_kv_cache_spec_kind(group.kv_cache_spec).value
    _, kv_caches = vx.allocate_v033(engine)
    with caplog.at_level(logging.INFO, logger=edits.__name__):
        edits.apply_kv_cache_group_edits(engine.config, kv_caches, {"kv_layout": "NHD"})
    [line] = [r.getMessage() for r in caplog.records if "edits applied" in r.getMessage()]
    assert "LMCache's names: {'mamba-unified-view': 18, 'subpaged-attention-view': 6}" in line


def test_the_vllm_kind_names_need_vllm_only_when_asked_for() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvlayout.integrations.vllm.edits as e\n"
        "try:\n    from kvlayout.integrations.vllm.edits import KVCacheSpecKind\n"
        "except ImportError:\n    pass\n"
        "else:\n    sys.exit('imported without vLLM')\n"
        "assert not hasattr(e, 'get_kv_cache_spec_kind')\n"
        "try:\n    e.KVCacheSpecKind\n"
        "except AttributeError as exc:\n    assert 'classifies specs without vLLM' in str(exc), exc\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# -- 9. the layout descriptor under LMCache's names (branch facts 6) ---------------------------


def test_layout_descriptor_lmcache_names_table_and_constructor() -> None:
    table = kvlayout.ENGINE_KV_FORMAT_DESCRIPTORS
    assert list(table) == [fmt.name for fmt in F]
    for fmt in F:
        assert kvlayout.from_engine_kv_format(fmt) is table[fmt.name]
        assert kvlayout.to_engine_kv_format_name(table[fmt.name]) == fmt.name
    # example 2, built the way LMCache's callers build it: by keyword, no list levels
    view = kvlayout.KVLayoutDescriptor(
        extents={KV: 2, B: 8, N: 16, H: 2, C: 64},
        dims=((B,), (KV,), (N,), (H,), (C,)),
        grouping=Grouping.PER_LAYER,
        kv_packing=KVPacking.SPLIT,
        storage_dtype="float16",
        dim_strides={0: 4 * 2 * 16 * 2 * 64},
    )
    assert view.lists == (L,) and isinstance(view, kvlayout.LayoutDescription)
    assert view.resolved_strides() == (16384, 2048, 128, 64, 1)
    assert kvlayout.to_engine_kv_format_name(view) == "NL_X_NB_TWO_BS_NH_HS"
    assert description.with_block_stride(view, 0).resolved_strides() == (4096, 2048, 128, 64, 1)
    # the DSA indexer row: quant beside regions, each derived from the other
    quant = kvlayout.QuantSpec("float32", 128, kvlayout.ScalePlacement.BLOCK_REGION)
    canonical = table["NL_X_NB_BSV_BSS"]
    assert canonical.quant == quant and [(r.width, r.dtype) for r in canonical.regions] == [
        (128, "float8_e4m3fn"),
        (4, "float32"),
    ]
    assert (canonical.storage_dtype, canonical.logical_dtype) == ("uint8", "float8_e4m3fn")
    values, scales = (getattr(torch, str(r.dtype)) for r in canonical.regions)  # real dtypes, as counted
    assert (128 // values.itemsize) // (4 // scales.itemsize) == quant.values_per_scale
    shared: dict[str, Any] = {
        "dims": ((B,), (N,), (C,)),
        "grouping": Grouping.PER_LAYER,
        "kv_packing": KVPacking.SHARED,
    }
    indexer = kvlayout.KVLayoutDescriptor(
        extents={KV: 1, H: 1, C: 132},
        storage_dtype="uint8",
        logical_dtype="float8_e4m3fn",
        quant=quant,
        **shared,
    )
    assert kvlayout.to_engine_kv_format_name(indexer) == "NL_X_NB_BSV_BSS" and indexer.is_indexer
    # the MXFP4 indexer row: 64 packed e2m1 bytes and 4 ue8m0 scale bytes, read as bytes
    mxfp4 = table["NL_X_NB_BSV4_BSS4"]
    assert [(r.width, r.dtype) for r in mxfp4.regions] == [(64, "uint8"), (4, "uint8")]
    assert mxfp4.quant == kvlayout.QuantSpec("uint8", 16, kvlayout.ScalePlacement.BLOCK_REGION)
    assert (
        kvlayout.to_engine_kv_format_name(
            kvlayout.KVLayoutDescriptor(
                extents={KV: 1, H: 1, C: 68}, storage_dtype="uint8", quant=mxfp4.quant, **shared
            )
        )
        == "NL_X_NB_BSV4_BSS4"
    )
    assert kvlayout.to_engine_kv_format_name(kvlayout.KVLayoutDescriptor(**shared)) == "NL_X_NB_BS_HS"
    other = kvlayout.QuantSpec("float32", 64, kvlayout.ScalePlacement.BLOCK_REGION)
    with pytest.raises(ValueError, match="contradicts the regions, which say QuantSpec"):
        kvlayout.KVLayoutDescriptor(regions=canonical.regions, quant=other, **shared)
    with pytest.raises(ValueError, match="no EngineKVFormat member has this structure"):
        kvlayout.to_engine_kv_format_name(
            kvlayout.KVLayoutDescriptor(
                quant=kvlayout.QuantSpec("float32", 32, kvlayout.ScalePlacement.INLINE_PER_HEAD), **shared
            )
        )


# -- 10. KVLayerGroupsManager (facts 9.2) ----------------------------------------------------


def test_kv_layer_groups_manager_reads_the_registrations_kernel_groups() -> None:
    # a hybrid registration: 3 flash-attn layers and 2 MLA layers, two engine groups
    nhd = {"kv_layout": "NHD"}
    kv = [t(2, NB, 16, NH, HS) for _ in range(3)] + [t(NB, 16, HS) for _ in range(2)]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(kv, [[0, 1, 2], [3, 4]], "vllm", nhd)
    manager = kvlayout.KVLayerGroupsManager(out, formats)
    assert manager.num_groups == manager.num_kernel_groups == 2
    first, second = manager.kv_layer_groups
    assert (first.layer_indices, second.layer_indices) == ([0, 1, 2], [3, 4])
    assert manager.get_shape_desc(0) == PageBufferShapeDesc(2, 3, NB, 16, NH, HS, 2, 0, torch.float16)
    assert manager.get_shape_desc(1) == PageBufferShapeDesc(1, 2, NB, 16, 1, HS, 2, 16 * HS, torch.float16)
    assert (first.hidden_dim_size, first.slots_per_block, first.slots_per_chunk) == (NH * HS, 16, 256)
    indices: list[Any] = [0, np.int64(1)]  # a NumPy integer as every int argument takes
    assert [manager.get_slots_per_chunk(g) for g in indices] == [256, second.slots_per_chunk]
    with pytest.raises(TypeError, match=r"^group_idx must be an int, not float \(1\.0\)$"):
        manager.get_shape_desc(1.0)  # type: ignore[arg-type]
    assert [g.identity for g in manager.kernel_groups] == [
        g.identity for g in manager.registration.kernel_groups
    ]
    assert isinstance(out, kvlayout.RegisteredKV) and manager.registration is out.registration
    assert manager.num_blocks == NB
    # layers differing in heads or dtype are apart
    for other in (t(2, NB, 16, NH + 1, HS), t(2, NB, 16, NH, HS, dtype=torch.bfloat16)):
        mixed, fmts = kvlayout.normalize_and_discover_per_layer_formats(
            [t(2, NB, 16, NH, HS), other], None, "vllm", nhd
        )
        assert [g.layer_indices for g in kvlayout.KVLayerGroupsManager(mixed, fmts).kv_layer_groups] == [
            [0],
            [1],
        ]
    # descriptors carry the block stride resolve_block_stride_and_log_layout gives (blocks-first views)
    pool = torch.zeros(6, 3, 2, 16, 8)
    fmt, views = kvlayout.normalize_kv_and_discover_format(
        [pool[:, i] for i in range(3)], "vllm", {"kv_layout": "BLHNC"}
    )
    desc = kvlayout.KVLayerGroupsManager(views, fmt).get_shape_desc(0)
    assert (
        desc.block_stride_elems
        == kvlayout.resolve_block_stride_and_log_layout(views, fmt, 0, 0)
        == 3 * 2 * 16 * 8
    )
    # engine group infos split identical layers, and bring the engine's tokens per block
    same = [t(2, NB, 16, NH, HS) for _ in range(4)]
    fmt, kv4 = kvlayout.normalize_kv_and_discover_format(same, "vllm", nhd)
    infos = [SimpleNamespace(engine_group_id=0, layer_indices=[0, 1], tokens_per_block=64),
             SimpleNamespace(engine_group_id=1, layer_indices=[2, 3], tokens_per_block=0)]  # fmt: skip
    split = kvlayout.KVLayerGroupsManager(kv4, fmt, infos)
    assert [(g.layer_indices, g.engine_group_idx, g.tokens_per_block, g.slots_per_chunk) for g in split.kernel_groups] == [
        ([0, 1], 0, 64, 64), ([2, 3], 1, 16, 256),
    ]  # fmt: skip
    # LMCache's counts (facts 9.2): slots = tokens * slots_per_block // tokens_per_block, then
    # whole blocks of them; group 0 packs 64 tokens into a block's 16 slots, group 1 does not
    assert [split.kernel_groups[0].calculate_slots(n) for n in (256, 100, 63)] == [64, 25, 15]
    assert [split.kernel_groups[1].calculate_slots(n) for n in (256, 100)] == [256, 100]
    assert [split.calculate_num_blocks(0, n) for n in (256, 100, 63)] == [4, 1, 0]
    assert [split.calculate_num_blocks(1, n) for n in (256, 100, 0)] == [16, 6, 0]
    with pytest.raises(RegistrationError, match=r"^num_tokens must be >= 0, got -1$"):
        split.calculate_num_blocks(1, -1)
    with pytest.raises(TypeError, match=r"^num_tokens must be an int, not float \(2\.0\)$"):
        split.kernel_groups[0].calculate_slots(2.0)  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="kernel group 2 is out of range for 2 groups"):
        split.calculate_num_blocks(2, 16)
    # 0.5.6's manager reads each group's block count (facts 9.2); an older LMCache took
    # num_blocks third, where 0.5.6 and kvlayout take the engine group infos
    with pytest.raises(
        TypeError,
        match=r"^engine_group_infos must be a sequence of engine group infos, not int \(16\); the manager takes no num_blocks",
    ):
        kvlayout.KVLayerGroupsManager(kv4, fmt, 16)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="group 0: lmcache_tokens_per_chunk 100 must be a multiple of tokens_per_block 16"
    ):
        kvlayout.KVLayerGroupsManager(kv4, fmt, lmcache_tokens_per_chunk=100)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "engine_group_infos[1] is a tuple, not an engine group info (engine_group_id, layer_indices)"
        ),
    ):
        kvlayout.KVLayerGroupsManager(kv4, fmt, [infos[0], (1, [2, 3])])
    twice = SimpleNamespace(engine_group_id=1, layer_indices=[1, 2], tokens_per_block=0)
    with pytest.raises(
        RegistrationError, match=re.escape("layer 1 is in engine groups 0 and 1; a layer is in one")
    ):
        kvlayout.KVLayerGroupsManager(kv4, fmt, [infos[0], twice])
    with pytest.raises(
        ValueError, match="group 0: tokens_per_block 24 must be a multiple of slots_per_block 16"
    ):
        kvlayout.KVLayerGroupsManager(
            kv4, fmt, [SimpleNamespace(engine_group_id=0, layer_indices=[0], tokens_per_block=24)]
        )
    with pytest.raises(ValueError, match="kernel group 2 is out of range for 2 groups"):
        split.get_shape_desc(2)
    folded, pages = kvlayout.normalize_kv_and_discover_format([t(NB * BS, 1, HS) for _ in range(2)], "sglang")
    with pytest.raises(ValueError, match=r"NL_X_NBBS_ONE_HS folds its blocks .* the tokens_per_block hint"):
        kvlayout.KVLayerGroupsManager(pages, folded)
    with pytest.raises(
        TypeError, match="engine_kv_formats is needed unless kv_caches is what detection returned"
    ):
        kvlayout.KVLayerGroupsManager(list(kv))
    registration = kvlayout.detect(kv, "vllm", nhd, layer_groups=[[0, 1, 2], [3, 4]])
    assert kvlayout.KVLayerGroupsManager(registration).get_shape_desc(1) == manager.get_shape_desc(1)


# -- 11. GPUKVFormat, LMCache's alias of EngineKVFormat (docs/migrating-from-lmcache.md) -------


def test_gpu_kv_format_is_the_engine_kv_format_alias() -> None:
    from kvlayout import GPUKVFormat

    assert GPUKVFormat is kvlayout.GPUKVFormat is F
    assert GPUKVFormat(1) is F.NL_X_TWO_NB_BS_NH_HS
    assert "GPUKVFormat" in kvlayout.__all__ and "GPUKVFormat" in dir(kvlayout)


# -- 12. get_attention_backend and KV_LAYOUT_NAMES (facts 1, 2; the guide's differences) --------


def test_attention_backends_are_lmcaches_except_where_the_guide_says() -> None:
    # LMCache 0.5.6's first attention_backends entry per format (facts 1, the specs' tuples)
    lmcache = {
        0: "vLLM CROSS_LAYER", 1: "vLLM non-MLA flash attention", 2: "vLLM non-MLA flash infer",
        4: "SGLang MHA (flash attention and flash infer)", 5: "SGLang MLA",
        6: "vLLM non-MLA flash attention (HND layout)", 7: "vLLM non-MLA flash infer (HND layout)",
        8: "TRT-LLM cross-layer (HND layout)", 9: "SGLang MHA via MP daemon (4-D inner)",
        10: "vLLM non-MLA blocks-first, fused K/V", 11: "vLLM non-MLA blocks-first, fused K/V (NHD)",
        12: "vLLM non-MLA blocks-first, fused K/V (HND)", 13: "vLLM non-MLA blocks-first, fused K/V (NHD)",
        15: "vLLM-RBLN attention (HND layout)", 16: "vLLM-Ascend: per-layer (K, V) tuples",
        17: "vLLM-Ascend MLA (latent, rope) tuples", 18: "SGLang unified MP independent components",
    }  # fmt: skip
    for value, backend in lmcache.items():
        assert kvlayout.get_attention_backend(F(value)) == backend, value
    # the guide's "Backends are listed one engine each": LMCache says 'vLLM MLA / SGLang MLA (MP)'
    # for 3 and 'vLLM MLA' for 14
    assert kvlayout.get_spec_class(F(3)).attention_backends[:2] == ("vLLM MLA", "SGLang MLA (MP)")
    assert kvlayout.get_attention_backend(F(14)) == "vLLM MLA (DSA indexer k-cache)"
    # KV_LAYOUT_NAMES holds LMCache's four and vLLM's own spellings (membership, not positions)
    assert {"NHD", "HND", "BLHNC", "BLNHC"} < set(kvlayout.KV_LAYOUT_NAMES)
    assert {"LBNHC", "LBHNC", "LHBNC", "BHLNC"} < set(kvlayout.KV_LAYOUT_NAMES)


# -- 13. LMCache's EngineType members name the engine (facts 5.1) ---------------------------


def test_lmcaches_engine_type_members_name_the_engine() -> None:
    import enum

    class EngineType(enum.Enum):  # lmcache.utils.EngineType's members and values (facts 5.1)
        VLLM = "vllm"
        ATOM = "atom"
        SGLANG = "sglang"
        TRTLLM = "trtllm"
        MOCK = "mock"

    vllm = [t(2, NB, BS, NH, HS) for _ in range(NL)]
    fmt, _ = kvlayout.normalize_kv_and_discover_format(vllm, EngineType.VLLM, {"kv_layout": "NHD"})
    assert fmt is F.NL_X_TWO_NB_BS_NH_HS
    assert (
        kvlayout.detect(vllm, EngineType.VLLM, {"kv_layout": "NHD"}).engine
        is kvlayout.detect(vllm, "vllm", {"kv_layout": "NHD"}).engine
    )
    sglang = [t(NB * BS, NH, HS) for _ in range(2 * NL)]
    hints = {"kv_list_layout": "k_v", "tokens_per_block": BS}
    assert (
        kvlayout.normalize_kv_and_discover_format(sglang, EngineType.SGLANG, hints)[0]
        is F.TWO_X_NL_X_NB_BS_NH_HS
    )
    trtllm = t(NB, NL, 2, NH, BS, HS)
    assert kvlayout.normalize_kv_and_discover_format(trtllm, EngineType.TRTLLM)[0] is F.NB_NL_TWO_NH_BS_HS
    # LMCache has no detector for MOCK; kvlayout names the engines it knows
    with pytest.raises(KVLayoutError, match=r"^unknown serving engine 'mock'; known engines: vllm, "):
        kvlayout.normalize_kv_and_discover_format(vllm, EngineType.MOCK)

    class Numbered(enum.Enum):
        VLLM = 1

    with pytest.raises(TypeError, match=r"an enum member whose value is a str, not Numbered$"):
        kvlayout.normalize_kv_and_discover_format(vllm, Numbered.VLLM)
