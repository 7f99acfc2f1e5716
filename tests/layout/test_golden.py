"""The golden table: LMCache's formats (values 0..18) pinned, shape strings, facts and
accessors; every later format checked against what its layout says.

Sizes NB=7, NL=5, BS=3, NH=2, HS=4 (PBS=21), as in LMCache's own spec tests, so a wrong
axis shows up as a wrong number. Values come from the LMCache 0.5.6 facts sheet
(sections 1, 8.1 and 8.2); where kvlayout deliberately differs, the row says so. Formats
added after LMCache's 19 need no row here: the tests below build their registrations
from the layout and compare the generated accessors with the algebra.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import UndefinedSizeError
from kvlayout.layout.algebra import kv_size, size_of
from kvlayout.layout.vocabulary import Role
from kvlayout.testing.strategies import fixed_sizes
from tests.transfer.registrations import make_registration

SIZES = {"NB": 7, "NL": 5, "BS": 3, "NH": 2, "HS": 4}
W1, W2 = 4, 6  # the two plane widths of format 17

# value: (describe_shape, concrete_shape, (C, K, L, M, T), (H, F, 2M, P), single_kv, kv_size)
STATIC = {
    0: ("[NB, NL, 2, BS, NH, HS]", "[7, 5, 2, 3, 2, 4]", "TFFFF", "FFFF", False, 2),
    1: ("NL x [2, NB, BS, NH, HS]", "5 x [2, 7, 3, 2, 4]", "FFTFF", "FFTF", False, 2),
    2: ("NL x [NB, 2, BS, NH, HS]", "5 x [7, 2, 3, 2, 4]", "FFTFF", "FFFF", False, 2),
    3: ("NL x [NB, BS, HS]", "5 x [7, 3, 4]", "FFTTF", "FFFF", False, 1),
    4: ("2 x NL x [PBS, NH, HS]", "2 x 5 x [21, 2, 4]", "FTFFF", "FFFT", False, 2),
    5: ("NL x [PBS, 1, HS]", "5 x [21, 1, 4]", "FFTTF", "FFFT", False, 1),
    6: ("NL x [2, NB, NH, BS, HS]", "5 x [2, 7, 2, 3, 4]", "FFTFF", "TFTF", False, 2),
    7: ("NL x [NB, 2, NH, BS, HS]", "5 x [7, 2, 2, 3, 4]", "FFTFF", "TFFF", False, 2),
    8: ("[NB, NL, 2, NH, BS, HS]", "[7, 5, 2, 2, 3, 4]", "TFFFF", "TFFF", False, 2),
    9: ("2 x NL x [NB, BS, NH, HS]", "2 x 5 x [7, 3, 2, 4]", "FTFFF", "FFFF", False, 2),
    10: ("NL x [NB, NH, BS, 2, HS]", "5 x [7, 2, 3, 2, 4]", "FFTFF", "TTFF", False, 1),
    11: ("NL x [NB, BS, NH, 2, HS]", "5 x [7, 3, 2, 2, 4]", "FFTFF", "FTFF", False, 1),
    12: ("NL x [NB, NH, BS, CS]", "5 x [7, 2, 3, 8]", "FFTFF", "TTFF", False, 1),
    13: ("NL x [NB, BS, NH, CS]", "5 x [7, 3, 2, 8]", "FFTFF", "FTFF", False, 1),
    14: ("NL x [NB, BSxVALS, BSxSCALES]", "5 x [7, 3, 3]", "FFTTF", "FFFF", False, 1),
    15: ("NL x [2, NB, NH, 1, BS, HS]", "5 x [2, 7, 2, 1, 3, 4]", "FFTFF", "TFTF", False, 2),
    16: ("NL x 2 x [NB, BS, NH, HS]", "5 x 2 x [7, 3, 2, 4]", "FFTFT", "FFFF", False, 2),
    17: ("NL x NP x [NB, BS, 1, HS]", f"5 x NP x [7, 3, 1, {W1 + W2}]", "FFTTT", "FFFF", False, 1),
    18: ("NL x [NB, BS, NH, HS]", "5 x [7, 3, 2, 4]", "FFTFF", "FFFF", True, 1),
}

# value: (nl, nb, bs, pbs, nh, hidden, hs, tokens, elements); None = raises (NB*BS fused)
GEOMETRY: dict[int, tuple[Any, ...]] = {
    0: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    1: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    2: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    3: (5, 7, 3, 21, 1, 4, 4, 21, 84),
    4: (5, None, None, 21, 2, 8, 4, 21, 336),
    5: (5, None, None, 21, 1, 4, 4, 21, 84),
    6: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    7: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    8: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    9: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    # 10/11: LMCache reports hidden_dim NH*HS = 8 beside head_size 2*HS = 8; kvlayout keeps
    # hidden_dim = num_heads * head_size = 16 for every format (the chunk's row width).
    10: (5, 7, 3, 21, 2, 16, 8, 21, 336),
    11: (5, 7, 3, 21, 2, 16, 8, 21, 336),
    12: (5, 7, 3, 21, 2, 16, 8, 21, 336),
    13: (5, 7, 3, 21, 2, 16, 8, 21, 336),
    14: (5, 7, 3, 21, 1, 132, 132, 21, 2772),
    15: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    16: (5, 7, 3, 21, 2, 8, 4, 21, 336),
    17: (5, 7, 3, 21, 1, W1 + W2, W1 + W2, 21, 21 * (W1 + W2)),
    18: (5, 7, 3, 21, 2, 8, 4, 21, 168),
}


def registration(value: int) -> Any:
    """A registration of each format built from explicit shapes (not from the algebra)."""

    def t(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    per_layer = {
        1: (2, 7, 3, 2, 4), 2: (7, 2, 3, 2, 4), 3: (7, 3, 4), 5: (21, 1, 4), 6: (2, 7, 2, 3, 4),
        7: (7, 2, 2, 3, 4), 10: (7, 2, 3, 2, 4), 11: (7, 3, 2, 2, 4), 12: (7, 2, 3, 8), 13: (7, 3, 2, 8),
        15: (2, 7, 2, 1, 3, 4), 18: (7, 3, 2, 4),
    }  # fmt: skip
    if value in per_layer:
        return [t(*per_layer[value]) for _ in range(5)]
    if value == 0:
        return t(7, 5, 2, 3, 2, 4)
    if value == 8:
        return t(7, 5, 2, 2, 3, 4)
    if value == 4:
        return [[t(21, 2, 4) for _ in range(5)] for _ in range(2)]
    if value == 9:
        return [[t(7, 3, 2, 4) for _ in range(5)] for _ in range(2)]
    if value == 14:
        return [t(7, 3, 132, dtype=torch.uint8) for _ in range(5)]
    if value == 16:
        return [(t(7, 3, 2, 4), t(7, 3, 2, 4)) for _ in range(5)]
    if value == 17:
        return [(t(7, 3, 1, W1), t(7, 3, 1, W2)) for _ in range(5)]
    raise AssertionError(f"no golden registration for {value}")


# The first attention-backend label of each format (LMCache's get_attention_backend).
BACKENDS = {
    0: "vLLM CROSS_LAYER", 1: "vLLM non-MLA flash attention", 2: "vLLM non-MLA flash infer", 3: "vLLM MLA",
    4: "SGLang MHA (flash attention and flash infer)", 5: "SGLang MLA",
    6: "vLLM non-MLA flash attention (HND layout)", 7: "vLLM non-MLA flash infer (HND layout)",
    8: "TRT-LLM cross-layer (HND layout)", 9: "SGLang MHA via MP daemon (4-D inner)",
    10: "vLLM non-MLA blocks-first, fused K/V", 11: "vLLM non-MLA blocks-first, fused K/V (NHD)",
    12: "vLLM non-MLA blocks-first, fused K/V (HND)", 13: "vLLM non-MLA blocks-first, fused K/V (NHD)",
    14: "vLLM MLA (DSA indexer k-cache)", 15: "vLLM-RBLN attention (HND layout)",
    16: "vLLM-Ascend: per-layer (K, V) tuples", 17: "vLLM-Ascend MLA (latent, rope) tuples",
    18: "SGLang unified MP independent components",
}  # fmt: skip


LMCACHE = 19  # LMCache 0.5.6's values are 0..18; later values are kvlayout's own
PINNED = [f for f in F if int(f) < LMCACHE]


def test_lmcache_formats_are_pinned() -> None:
    assert sorted(STATIC) == sorted(GEOMETRY) == sorted(BACKENDS) == list(range(LMCACHE))
    assert [int(f) for f in PINNED] == list(range(LMCACHE))


@pytest.mark.parametrize("fmt", PINNED, ids=lambda f: f.name)
def test_backend_labels(fmt: F) -> None:
    assert kvlayout.get_spec_class(fmt).attention_backends[0] == BACKENDS[int(fmt)]
    assert kvlayout.get_attention_backend(fmt) == BACKENDS[int(fmt)]


@pytest.mark.parametrize("fmt", PINNED, ids=lambda f: f.name)
def test_static_facts(fmt: F) -> None:
    shape, concrete, ckmlt, hf2p, single, kv_size = STATIC[int(fmt)]
    layout = kvlayout.layout_of(fmt)
    cls = kvlayout.get_spec_class(fmt)
    assert kvlayout.describe_shape(fmt) == shape == cls.describe_shape()
    if int(fmt) != 17:  # 17's row width comes from its planes, see test_spec_geometry
        assert kvlayout.concrete_shape(fmt, SIZES) == concrete
    flags = "".join(
        "T" if getattr(layout, n) else "F"
        for n in ("is_cross_layer", "is_kv_list", "is_layer_list", "is_mla", "is_kv_second_tuple")
    )
    mods = "".join(
        "T" if getattr(layout, n) else "F"
        for n in ("is_hnd", "is_fused_packed", "is_two_major", "is_pbs_fused")
    )
    assert (flags, mods, layout.is_single_kv, layout.kv_size) == (ckmlt, hf2p, single, kv_size)
    for name in ("is_cross_layer", "is_kv_list", "is_layer_list", "is_mla", "is_kv_second_tuple", "is_hnd",
                 "is_fused_packed", "is_two_major", "is_pbs_fused", "is_single_kv"):  # fmt: skip
        assert getattr(cls, name) == getattr(layout, name), name


def test_structure_flags_partition_the_formats() -> None:
    for fmt in F:
        layout = kvlayout.layout_of(fmt)
        assert [layout.is_cross_layer, layout.is_kv_list, layout.is_layer_list].count(True) == 1, fmt


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", PINNED, ids=lambda f: f.name)
def test_spec_geometry(fmt: F) -> None:
    nl, nb, bs, pbs, nh, hidden, hs, tokens, elements = GEOMETRY[int(fmt)]
    spec = kvlayout.get_spec(registration(int(fmt)), fmt)
    assert spec.num_layers() == nl
    for accessor, expected in (("num_blocks", nb), ("block_size", bs)):
        if expected is None:
            with pytest.raises(
                UndefinedSizeError,
                match=f"{accessor} is undefined for the fused format {fmt.name}: NBBS folds",
            ):
                getattr(spec, accessor)()
        else:
            assert getattr(spec, accessor)() == expected
    got = (spec.page_buffer_size(), spec.num_heads(), spec.hidden_dim(), spec.head_size(),
           spec.tokens_per_layer(), spec.elements_per_layer())  # fmt: skip
    assert got == (pbs, nh, hidden, hs, tokens, elements)
    assert spec.kv_size() == STATIC[int(fmt)][5]
    assert spec.concrete_shape_str() == STATIC[int(fmt)][1]


def layout_registration(fmt: F) -> Any:
    """A registration built from the format's layout (distinct sizes; uint8 for byte pages)."""
    layout = kvlayout.layout_of(fmt)
    dtype = torch.uint8 if layout.is_indexer else torch.float16
    return make_registration(layout, fixed_sizes(layout, (5, 7, 3)), dtype).kv


def any_registration(fmt: F) -> Any:
    """The golden registration of an LMCache format, else one built from the layout."""
    return registration(int(fmt)) if int(fmt) < LMCACHE else layout_registration(fmt)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_every_spec_answers_as_its_layout_says(fmt: F) -> None:
    """The generated accessors read what the algebra says each role's size is."""
    layout = kvlayout.layout_of(fmt)
    kv = layout_registration(fmt)
    spec = kvlayout.get_spec(kv, fmt)
    sizes = spec.sizes()
    assert layout.tensor_shape(sizes) == tuple(_first(kv).shape)
    assert spec.num_layers() == size_of(layout, sizes, Role.LAYER)
    assert spec.page_buffer_size() == size_of(layout, sizes, Role.PAGE)
    for accessor, role in (("num_blocks", Role.BLOCK), ("block_size", Role.TOKEN)):
        if layout.axis_of(role) is None:
            with pytest.raises(UndefinedSizeError, match=f"{accessor} is undefined for the fused format"):
                getattr(spec, accessor)()
        else:
            assert getattr(spec, accessor)() == size_of(layout, sizes, role)
    assert spec.kv_size() == kv_size(layout, sizes)
    assert spec.num_heads() == layout.num_heads(sizes)
    assert spec.head_size() == layout.head_size(sizes)
    assert spec.hidden_dim() == spec.num_heads() * spec.head_size()
    for name in kvlayout.layout.ast.FACTS:
        assert getattr(type(spec), name) == getattr(layout, name), name
        assert getattr(kvlayout, name)(fmt) == getattr(layout, name), name
    assert kvlayout.get_attention_backend(fmt) == kvlayout.catalog.registry.format_info(fmt).backends[0]


def _first(kv: Any) -> torch.Tensor:
    while isinstance(kv, (list, tuple)):
        kv = kv[0]
    assert isinstance(kv, torch.Tensor)
    return kv


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_pointer_table_lengths_and_order(fmt: F) -> None:
    kv = any_registration(fmt)
    spec = kvlayout.get_spec(kv, fmt)
    ptrs = spec.data_ptrs([0, 2, 3])
    if spec.is_cross_layer:
        assert ptrs == [kv.data_ptr()]
    elif spec.is_kv_list:  # all K, then all V
        assert ptrs == [kv[k][i].data_ptr() for k in (0, 1) for i in (0, 2, 3)]
    elif spec.is_kv_second_tuple:  # each layer's tuple, interleaved
        assert ptrs == [p.data_ptr() for i in (0, 2, 3) for p in kv[i]]
    else:
        assert ptrs == [kv[i].data_ptr() for i in (0, 2, 3)]


def test_per_layer_accessors_read_that_layer() -> None:
    kv = [torch.zeros(32, 16, nh, 64) for nh in (8, 9, 10)]
    spec = kvlayout.get_spec(kv, F.NL_X_NB_BS_NH_HS)
    assert [spec.num_heads(i) for i in range(3)] == [8, 9, 10]


def test_deprecated_formats_warn_once() -> None:
    kvlayout.get_spec_class(F.NL_X_NB_NH_BS_TWO_HS)._warned = False
    with pytest.warns(DeprecationWarning, match="NL_X_NB_NH_BS_TWO_HS is deprecated: use NL_X_NB_NH_BS_CS"):
        kvlayout.get_spec(registration(10), F.NL_X_NB_NH_BS_TWO_HS)


def test_plane_widths_must_share_a_dtype_multiple() -> None:
    kv = [(torch.zeros(7, 3, 1, 3, dtype=torch.uint8), torch.zeros(7, 3, 1, 2, dtype=torch.float16))]
    spec = kvlayout.get_spec(kv, F.NL_X_NP_X_NB_BS_ONE_HS)
    assert spec.head_size() == 7  # 3 bytes + 4 bytes, in uint8 elements
    kv = [(torch.zeros(7, 3, 1, 2, dtype=torch.float16), torch.zeros(7, 3, 1, 3, dtype=torch.uint8))]
    with pytest.raises(
        kvlayout.KVLayoutError,
        match="plane rows total 7 bytes, which is not a multiple of the first plane's element size 2",
    ):
        kvlayout.get_spec(kv, F.NL_X_NP_X_NB_BS_ONE_HS).head_size()


@pytest.mark.parametrize("bad", [max(F) + 1, -1, "NL_X_FOO", 1.5, True])  # one past the last value
def test_unknown_formats_are_clear_errors(bad: object) -> None:
    with pytest.raises(kvlayout.KVLayoutError, match="engine KV format"):
        kvlayout.get_spec_class(bad)  # type: ignore[arg-type]


def test_formats_accept_values_and_names() -> None:
    assert (
        kvlayout.get_spec_class(1)
        is kvlayout.get_spec_class("NL_X_TWO_NB_BS_NH_HS")
        is kvlayout.get_spec_class(F(1))
    )
