"""The helper facade: golden descriptors and pointer orders (facts sheet 8.3, 8.4),
shape strings for every format, block strides, grouping, and the consumer-code rules."""

from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import KVLayoutError, PageBufferShapeDesc
from kvlayout import facade as facade_module
from kvlayout.registration.registration import bound
from tests.layout.test_golden import any_registration, registration


def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def desc_fields(d: PageBufferShapeDesc) -> tuple[int, ...]:
    return (d.kv_size, d.nl, d.nb, d.bs, d.nh, d.hs, d.element_size, d.block_stride_elems)


# -- facts sheet 8.4 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "fmt", "nl", "nb", "bs", "expected"),
    [
        ([t(2, 32, 16, 8, 64) for _ in range(4)], F.NL_X_TWO_NB_BS_NH_HS, 4, 32, 16, (2, 4, 32, 16, 8, 64, 2, 0)),
        ([t(32, 2, 16, 8, 64, dtype=torch.float16) for _ in range(2)], F.NL_X_NB_TWO_BS_NH_HS, 2, 32, 16, (2, 2, 32, 16, 8, 64, 2, 0)),
        ([t(32, 16, 512) for _ in range(3)], F.NL_X_NB_BS_HS, 3, 32, 16, (1, 3, 32, 16, 1, 512, 2, 0)),
        ([t(512, 1, 128) for _ in range(2)], F.NL_X_NBBS_ONE_HS, 2, 32, 16, (1, 2, 32, 16, 1, 128, 2, 0)),
        ([[t(512, 8, 64) for _ in range(4)] for _ in range(2)], F.TWO_X_NL_X_NBBS_NH_HS, 4, 32, 16, (2, 4, 32, 16, 8, 64, 2, 0)),
    ],
)  # fmt: skip
def test_golden_page_buffer_shape_desc(
    kv: Any, fmt: F, nl: int, nb: int, bs: int, expected: tuple[int, ...]
) -> None:
    assert desc_fields(kvlayout.make_page_buffer_shape_desc(kv, fmt, 0, nl, nb, bs)) == expected


def test_golden_per_layer_accessor_honours_layer_idx() -> None:
    kv = [t(2, 32, 16, nh, 64) for nh in (8, 9, 10)]
    assert kvlayout.get_num_heads(kv, F.NL_X_TWO_NB_BS_NH_HS, 2) == 10
    assert kvlayout.make_page_buffer_shape_desc(kv, F.NL_X_TWO_NB_BS_NH_HS, 2, 1, 32, 16).nh == 10


def test_golden_pointer_orders() -> None:
    kv = [t(2, 4, 16, 8, 64) for _ in range(4)]
    assert kvlayout.get_group_data_ptrs(kv, 1, [0, 2, 3]) == [kv[i].data_ptr() for i in (0, 2, 3)]
    two = [[t(64, 8, 64) for _ in range(3)], [t(64, 8, 64) for _ in range(3)]]
    assert kvlayout.get_group_data_ptrs(two, F.TWO_X_NL_X_NBBS_NH_HS, [0, 1, 2]) == [
        two[k][i].data_ptr() for k in (0, 1) for i in range(3)
    ]
    cross = t(32, 80, 2, 16, 8, 64)
    assert kvlayout.get_group_data_ptrs(cross, F.NB_NL_TWO_BS_NH_HS, [0, 5]) == [cross.data_ptr()]


def test_golden_kv_tuples() -> None:
    """(K, V) tuples, NB 8, NL 3, BS 4, NH 2, HS 8, fp32 (facts sheet 8.5)."""
    kv = [(t(8, 4, 2, 8, dtype=torch.float32), t(8, 4, 2, 8, dtype=torch.float32)) for _ in range(3)]
    fmt, out = kvlayout.normalize_kv_and_discover_format(kv, "vllm")
    assert fmt == F.NL_X_TWO_X_NB_BS_NH_HS and not kvlayout.is_mla(fmt)
    got = [kvlayout.get_num_layers(out, fmt), kvlayout.get_num_blocks(out, fmt), kvlayout.get_block_size(out, fmt),
           kvlayout.get_num_heads(out, fmt), kvlayout.get_head_size(out, fmt), kvlayout.get_hidden_dim_size(out, fmt),
           kvlayout.get_page_buffer_size(out, fmt), kvlayout.get_tokens_per_layer(out, fmt),
           kvlayout.get_elements_per_layer(out, fmt)]  # fmt: skip
    assert got == [3, 8, 4, 2, 8, 16, 32, 32, 1024]
    assert kvlayout.get_group_data_ptrs(out, fmt, [0, 2]) == [p.data_ptr() for i in (0, 2) for p in kv[i]]
    groups = kvlayout.group_layers_by_identity(out, [fmt] * 3)
    assert len(groups) == 1
    desc = kvlayout.make_page_buffer_shape_desc(out, fmt, 0, 3, 8, 4)
    assert desc_fields(desc)[:6] == (2, 3, 8, 4, 2, 8)


# -- shape strings (facts sheet 8.3; every format renders) ----------------------------------------


@pytest.mark.parametrize(
    ("fmt", "fields", "expected"),
    [
        (F.NL_X_TWO_NB_BS_NH_HS, (2, 32, 2048, 16, 8, 128), "32 x [2, 2048, 16, 8, 128]"),
        (F.NL_X_NB_BS_HS, (1, 61, 1024, 64, 1, 512), "61 x [1024, 64, 512]"),
        (F.NL_X_NBBS_ONE_HS, (1, 2, 32, 16, 1, 128), "2 x [512, 1, 128]"),
        (F.NL_X_TWO_NB_BS_NH_HS, (2, 4, 128, 16, 8, 64), "4 x [2, 128, 16, 8, 64]"),
        (F.NL_X_TWO_NB_BS_NH_HS, (2, 2, 128, 16, 16, 64), "2 x [2, 128, 16, 16, 64]"),
        # LMCache 0.5.6 renders these three as "Unknown (...)".
        (F.NL_X_NB_NH_BS_CS, (1, 5, 7, 3, 2, 8), "5 x [7, 2, 3, 8]"),
        (F.NL_X_NB_BS_NH_CS, (1, 5, 7, 3, 2, 8), "5 x [7, 3, 2, 8]"),
        (F.NL_X_NB_BSV_BSS, (1, 5, 7, 3, 1, 132), "5 x [7, 3, 3]"),
        (F.NL_X_NB_NH_BS_TWO_HS, (1, 5, 7, 3, 2, 8), "5 x [7, 2, 3, 2, 4]"),
        (F.TWO_X_NL_X_NBBS_NH_HS, (2, 5, 7, 3, 2, 4), "2 x 5 x [21, 2, 4]"),
        (F.NB_NL_TWO_NH_BS_HS, (2, 5, 7, 3, 2, 4), "[7, 5, 2, 2, 3, 4]"),
    ],
)
def test_shape_from_shape_desc(fmt: F, fields: tuple[int, int, int, int, int, int], expected: str) -> None:
    kv_size, nl, nb, bs, nh, hs = fields
    desc = PageBufferShapeDesc(kv_size, nl, nb, bs, nh, hs, 2, 0)
    assert kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt) == expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_every_format_renders_from_its_registration_and_its_descriptor(fmt: F) -> None:
    kv = any_registration(fmt)
    spec = kvlayout.get_spec(kv, fmt)
    concrete = kvlayout.get_concrete_engine_kv_shape(kv, fmt)
    assert concrete == spec.concrete_shape_str()
    if spec.is_pbs_fused:  # the page axis split into blocks of more than one token
        bs = next(b for b in (3, 5, 7, 1) if spec.page_buffer_size() % b == 0)
        nb = spec.page_buffer_size() // bs
    else:
        nb, bs = spec.num_blocks(), spec.block_size()
    desc = kvlayout.make_page_buffer_shape_desc(kv, fmt, 0, spec.num_layers(), nb, bs)
    assert kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt) == concrete
    assert kvlayout.get_engine_kv_shape_description(fmt) == kvlayout.describe_shape(fmt)
    assert kvlayout.get_attention_backend(fmt) == spec.attention_backends[0]


UNKNOWN = max(F) + 1  # one past the last format's value


def test_unknown_formats_are_diagnosed_not_raised() -> None:
    assert kvlayout.get_attention_backend(UNKNOWN) == f"Unknown ({UNKNOWN})"
    assert kvlayout.get_engine_kv_shape_description("NL_X_FOO") == "Unknown (NL_X_FOO)"
    assert kvlayout.get_concrete_engine_kv_shape([t(7, 3, 4)], 99) == "Unknown (99)"
    desc = PageBufferShapeDesc(2, 1, 1, 1, 1, 1, 2, 0)
    assert kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, -3) == "Unknown (-3)"
    # a registration that does not fit the format
    assert kvlayout.get_concrete_engine_kv_shape([t(7, 3, 4)], F.NL_X_TWO_NB_BS_NH_HS) == (
        "Unknown (NL_X_TWO_NB_BS_NH_HS)"
    )
    assert kvlayout.get_attention_backend(F.NL_X_TWO_NB_BS_NH_HS) == "vLLM non-MLA flash attention"


# -- accessors ------------------------------------------------------------------------------------


def test_accessors_accept_values_and_names_and_misfits_are_clear() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(3)]
    assert kvlayout.get_block_size(kv, 1) == kvlayout.get_block_size(kv, "NL_X_TWO_NB_BS_NH_HS") == 3
    assert kvlayout.get_dtype(kv, 1, 2) == torch.bfloat16
    assert kvlayout.get_device(kv) == torch.device("cpu")
    with pytest.raises(KVLayoutError, match=re.escape("layer 7 is out of range for 3 layers")):
        kvlayout.get_num_heads(kv, 1, 7)
    with pytest.raises(
        KVLayoutError,
        match=re.escape("kv[0] has rank 3 (shape [7, 3, 4]); NL_X_TWO_NB_BS_NH_HS needs rank 5"),
    ):
        kvlayout.get_head_size([t(7, 3, 4)], F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(KVLayoutError, match=re.escape(f"unknown engine KV format value {UNKNOWN}")):
        kvlayout.get_num_layers(kv, UNKNOWN)
    with pytest.raises(kvlayout.UndefinedSizeError, match="num_blocks is undefined for the fused format"):
        kvlayout.get_num_blocks([t(21, 1, 4)], F.NL_X_NBBS_ONE_HS)
    with pytest.raises(KVLayoutError, match=re.escape("kv_caches is an empty list")):
        kvlayout.get_device([])


def test_hybrid_accessors_answer_for_the_format_asked() -> None:
    kv = [torch.zeros(2, 4, 3, 8, 16) for _ in range(2)] + [torch.zeros(4, 3, 576) for _ in range(2)]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(
        kv, [[0, 1], [2, 3]], "vllm", {"kv_layout": "NHD"}
    )
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS] * 2 + [F.NL_X_NB_BS_HS] * 2
    assert (
        kvlayout.get_kv_size(out, F.NL_X_NB_BS_HS) == 1
        and kvlayout.get_kv_size(out, F.NL_X_TWO_NB_BS_NH_HS) == 2
    )
    assert kvlayout.get_concrete_engine_kv_shape(out, F.NL_X_NB_BS_HS) == "2 x [4, 3, 576]"


def test_concrete_shape_is_the_whole_registration_not_its_first_kernel_group() -> None:
    # 7 layers split into kernel groups: by engine group (one shape), or by shape.
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    one_shape = [t(2, 10, 16, 8, 128) for _ in range(7)]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(
        one_shape, [[0, 1, 2, 3], [4, 5, 6]], "vllm", {"kv_layout": "NHD"}
    )
    assert formats == [fmt] * 7
    assert len(bound(out, fmt).kernel_groups) == 2
    assert kvlayout.get_concrete_engine_kv_shape(out, fmt) == "7 x [2, 10, 16, 8, 128]"
    two_shapes = [t(2, 10, 16, 8, 128) for _ in range(4)] + [t(2, 5, 16, 8, 128) for _ in range(3)]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(
        two_shapes, [list(range(7))], "vllm", {"kv_layout": "NHD"}
    )
    expected = "4 x [2, 10, 16, 8, 128] + 3 x [2, 5, 16, 8, 128]"
    assert kvlayout.get_concrete_engine_kv_shape(out, fmt) == expected
    # the engine's own list, bound on the call, reads the same
    assert kvlayout.get_concrete_engine_kv_shape(two_shapes, fmt) == expected
    reg = kvlayout.detect(two_shapes, "vllm", {"kv_layout": "NHD"})
    assert reg.concrete_shape(fmt) == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([3, 5, 6]), st.integers(0, 2)), min_size=1, max_size=9))
def test_concrete_shape_counts_each_shape_once_in_order_of_its_first_layer(
    layers: list[tuple[int, int]],
) -> None:
    """Layers of random block counts in random engine groups: each shape appears once,
    with all its layers, however the kernel groups split them."""
    kv = [t(2, nb, 4, 2, 8) for nb, _ in layers]
    groups: dict[int, list[int]] = {}
    for i, (_, engine_group) in enumerate(layers):
        groups.setdefault(engine_group, []).append(i)
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(
        kv, list(groups.values()), "vllm", {"kv_layout": "NHD"}
    )
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS] * len(layers)
    counts = Counter(nb for nb, _ in layers)
    expected = " + ".join(
        f"{counts[nb]} x [2, {nb}, 4, 2, 8]" for nb in dict.fromkeys(nb for nb, _ in layers)
    )
    assert kvlayout.get_concrete_engine_kv_shape(out, F.NL_X_TWO_NB_BS_NH_HS) == expected


def test_pointer_tables_follow_the_layout_pointer_order() -> None:
    for value in (1, 4, 9, 16, 17, 0):
        fmt = F(value)
        kv = registration(value)
        spec = kvlayout.get_spec(kv, fmt)
        expected = []
        for path in spec.layout.pointer_order(spec.sizes(), [3, 1]):
            node = kv
            for i in path:
                node = node[i]
            expected.append(node.data_ptr())
        assert kvlayout.get_group_data_ptrs(kv, fmt, [3, 1]) == expected


# -- block strides ----------------------------------------------------------------------------------


def test_block_strides_where_dim0_is_the_block_axis() -> None:
    # flash-infer [NB, 2, BS, NH, HS] with padded block rows: LMCache rejects it; dim 0 is NB here.
    padded = [torch.zeros(7, 2 * 3 * 2 * 4 + 4)[:, : 2 * 3 * 2 * 4].view(7, 2, 3, 2, 4) for _ in range(2)]
    assert kvlayout.resolve_block_stride_and_log_layout(padded, F.NL_X_NB_TWO_BS_NH_HS, 1, 0) == 52
    desc = kvlayout.make_page_buffer_shape_desc(padded, F.NL_X_NB_TWO_BS_NH_HS, 0, 2, 7, 3, 52)
    assert desc.block_stride_elems == 52
    cross = t(7, 5, 2, 3, 2, 4)
    assert (
        kvlayout.resolve_block_stride_and_log_layout(cross, F.NB_NL_TWO_BS_NH_HS, 0, 0) == 5 * 2 * 3 * 2 * 4
    )
    # K/V-first: dim 0 is the K/V pair, so padding there has no block stride to go to
    kv_first = [torch.zeros(2, 7 * 24 + 8)[:, : 7 * 24].view(2, 7, 3, 2, 4)]
    with pytest.raises(
        KVLayoutError,
        match=re.escape(
            "kv[0] has dim-0 padding (8 elements per dim-0 row; shape [2, 7, 3, 2, 4], strides [176, 24, 8, "
            "4, 1]), but dim 0 of NL_X_TWO_NB_BS_NH_HS is not its block axis"
        ),
    ):
        kvlayout.resolve_block_stride_and_log_layout(kv_first, F.NL_X_TWO_NB_BS_NH_HS, 0, 3)
    assert kvlayout.resolve_block_stride_and_log_layout([t(2, 7, 3, 2, 4)], 1, 0, 0) is None


def test_k_and_v_must_share_a_block_stride() -> None:
    k = torch.zeros(7, 3 * 2 * 4 + 2)[:, :24].view(7, 3, 2, 4)
    v = t(7, 3, 2, 4, dtype=torch.float32)
    with pytest.raises(
        KVLayoutError,
        match=re.escape("kv[0][1] and kv[0][0] have dim-0 strides 24 and 26; the tensors of one plane share"),
    ):
        kvlayout.resolve_block_stride_and_log_layout([(k, v)], F.NL_X_TWO_X_NB_BS_NH_HS, 0, 0)


def test_block_stride_logs_an_audit_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvlayout"):
        kvlayout.resolve_block_stride_and_log_layout([t(7, 3, 4)], F.NL_X_NB_BS_HS, 0, 2)
    assert "Group 2 first-layer tensor: layer_idx=0 shape=(7, 3, 4) stride=(12, 4, 1)" in caplog.text


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((F.NL_X_TWO_NB_BS_NH_HS, 0, 1, 7, 3, 100), KVLayoutError, "dim 0 is not the block axis"),
        (
            (F.NL_X_NB_TWO_BS_NH_HS, 0, 1, 7, 3, 10),
            KVLayoutError,
            "block stride 10 is smaller than a block's 48",
        ),
        ((F.NL_X_NB_TWO_BS_NH_HS, 0, 0, 7, 3), KVLayoutError, "num_layers_in_group must be >= 1, got 0"),
        ((F.NL_X_NB_TWO_BS_NH_HS, 0, 1, 7, True), TypeError, "block_size must be an int, not bool"),
        ((F.NL_X_NB_TWO_BS_NH_HS, 0, 1, -1, 3), KVLayoutError, "num_blocks must be >= 0, got -1"),
    ],
)
def test_descriptor_arguments_are_checked(
    args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    kv = [t(2, 7, 3, 2, 4)] if args[0] == F.NL_X_TWO_NB_BS_NH_HS else [t(7, 2, 3, 2, 4)]
    with pytest.raises(error, match=re.escape(message)):
        kvlayout.make_page_buffer_shape_desc(kv, *args)


# -- grouping -------------------------------------------------------------------------------------------


def test_group_layers_by_identity() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(3)] + [t(7, 3, 4) for _ in range(2)]
    formats = [F.NL_X_TWO_NB_NH_BS_HS] * 3 + [F.NL_X_NB_BS_HS] * 2
    groups = kvlayout.group_layers_by_identity(kv, formats)
    assert [layers for _, layers in groups] == [[0, 1, 2], [3, 4]]
    identity = groups[1][0]
    assert identity[:7] == (1, 1, 4, 3, 0, torch.bfloat16, F.NL_X_NB_BS_HS)  # LMCache's 7 fields
    assert identity.block_stride_elems == 12
    groups = kvlayout.group_layers_by_identity(kv, formats, [0, 1, 0, -1, 2])
    assert [(g.engine_group_idx, layers) for g, layers in groups] == [(0, [0, 2]), (1, [1]), (2, [4])]


def test_grouping_errors() -> None:
    kv = [t(7, 3, 4) for _ in range(2)]
    fmt = F.NL_X_NB_BS_HS
    with pytest.raises(
        KVLayoutError, match=re.escape("per_layer_engine_group_idx has 3 entries but engine_kv_formats has 2")
    ):
        kvlayout.group_layers_by_identity(kv, [fmt, fmt], [0, 0, 0])
    with pytest.raises(
        KVLayoutError, match=re.escape("layer 1 has no format (it was in no detection group)")
    ):
        kvlayout.group_layers_by_identity(kv, [fmt, None], [0, 0])
    assert [ls for _, ls in kvlayout.group_layers_by_identity(kv, [fmt, None], [0, -1])] == [[0]]
    with pytest.raises(
        KVLayoutError, match=re.escape("engine_kv_formats has 3 layers but the registration has 2")
    ):
        kvlayout.group_layers_by_identity(kv, [fmt] * 3)


def test_grouping_never_crashes_for_folded_or_cross_layer_formats() -> None:
    sglang = [[t(21, 2, 4) for _ in range(4)], [t(21, 2, 4) for _ in range(4)]]
    groups = kvlayout.group_layers_by_identity(sglang, [F.TWO_X_NL_X_NBBS_NH_HS] * 4)
    assert [(g.block_size, layers) for g, layers in groups] == [(None, [0, 1, 2, 3])]
    cross = t(7, 5, 2, 3, 2, 4)
    groups = kvlayout.group_layers_by_identity(cross, [F.NB_NL_TWO_BS_NH_HS] * 5)
    assert [(g.block_size, g.block_stride_elems, layers) for g, layers in groups] == [
        (3, 240, [0, 1, 2, 3, 4])
    ]


def test_layers_from_pools_with_different_padding_are_not_grouped_together() -> None:
    pool_a = torch.zeros(6, 2, 3, 4)  # blocks-first pools of two and three layers
    pool_b = torch.zeros(6, 3, 3, 4)
    kv = [pool_a[:, 0], pool_a[:, 1], pool_b[:, 0]]
    groups = kvlayout.group_layers_by_identity(kv, [F.NL_X_NB_BS_HS] * 3)
    assert [(g.block_stride_elems, layers) for g, layers in groups] == [(24, [0, 1]), (36, [2])]


# -- consumer code rules (the seed's forbidden patterns) ------------------------------------------------


def test_the_facade_follows_the_consumer_code_rules() -> None:
    source = inspect.getsource(facade_module)
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    forbidden = {
        "layout sniffing with isinstance on lists": r"isinstance\([^)]*\b(list|tuple)\b",
        "raw shape indexing": r"\.shape\[|len\([^)]*\.shape\)",
        "a format list at a call site": r"EngineKVFormat\.[A-Z]|\bin \(\s*\d",
        "copy repairs": r"\.contiguous\(|\.clone\(",
        "hand-assembled pointers": r"\.data_ptr\(",
        "list-depth probing": r"while isinstance",
    }
    for what, pattern in forbidden.items():
        assert not re.search(pattern, code), what


def test_the_accessors_take_the_registration_detect_returns() -> None:
    """docs/vllm-group-edits.md passes ``kvlayout.detect``'s Registration to the accessors;
    mypy --strict checks this test, so the parameter types and the unpacked
    ``get_shape_and_dtype`` result are pinned too."""
    kv = [t(2, 32, 16, 8, 64) for _ in range(3)]
    registration = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    fmt = registration.format
    assert kvlayout.get_concrete_engine_kv_shape(registration, fmt) == "3 x [2, 32, 16, 8, 64]"
    assert kvlayout.get_num_blocks(registration, fmt) == 32
    assert kvlayout.get_device(registration) == torch.device("cpu")
    ((shape, dtype),) = kvlayout.get_shape_and_dtype(registration, [1])
    assert (shape[0], dtype.itemsize) == (2, 2)
    ((shape, dtype),) = kvlayout.get_shape_and_dtype(kv, [0])
    assert (shape, dtype) == ((2, 32, 16, 8, 64), torch.bfloat16)


def test_a_name_kvlayout_does_not_export_is_an_attribute_error() -> None:
    """``kvlayout`` imports its names lazily: a misspelt one is Python's usual error,
    which ``hasattr`` and ``from kvlayout import ...`` read."""
    with pytest.raises(AttributeError, match=r"^module 'kvlayout' has no attribute 'bind_kv'$"):
        kvlayout.bind_kv  # noqa: B018
    assert not hasattr(kvlayout, "bind_kv") and hasattr(kvlayout, "bind")
