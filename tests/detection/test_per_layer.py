"""normalize_and_discover_per_layer_formats: hybrid registrations, groups, layers in no
group, and agreement with whole-structure detection."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import DetectionError, KVLayoutError
from kvlayout import EngineKVFormat as F
from kvlayout.registration.contiguity import attempt_permute_to_contiguous_view
from kvlayout.registration.nesting import leaves
from kvlayout.testing.registrations import RegistrationCase, flatten, registrations

per_layer = kvlayout.normalize_and_discover_per_layer_formats


def t(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def test_golden_uniform_hnd() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(5)]
    out, formats = per_layer(kv, None, "vllm", {"kv_layout": "HND"})
    assert formats == [F.NL_X_TWO_NB_NH_BS_HS] * 5
    assert all(o is i for o, i in zip(out, kv, strict=True))


def test_golden_groups_with_two_formats() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(3)] + [t(7, 3, 4) for _ in range(2)]
    _, formats = per_layer(kv, [[0, 1, 2], [3, 4]], "vllm", {"kv_layout": "HND"})
    assert formats == [F.NL_X_TWO_NB_NH_BS_HS] * 3 + [F.NL_X_NB_BS_HS] * 2


def test_layers_of_another_rank_are_not_read_as_the_first() -> None:
    """An MHA layer and an MLA layer of the same bytes in memory (every dim but one of
    size 1): each keeps its own rank's format (the first was applied to both)."""
    kv = [t(2, 1, 1, 1, 1), t(1, 1, 2)]
    _, formats = per_layer(kv, [[0, 1]], "vllm", {"kv_layout": "NHD"})
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS]


def test_golden_rank4_fused_groups_of_different_widths() -> None:
    """LMCache #4263: whole detection applied the first tensor's width to every layer."""
    kv = [t(7, 3, 2, 8) for _ in range(3)] + [t(7, 3, 2, 16) for _ in range(2)]
    out, formats = per_layer(kv, None, "vllm", {"kv_layout": "HND"})
    assert formats == [F.NL_X_NB_NH_BS_CS] * 5
    assert [o.shape for o in out] == [i.shape for i in kv]  # type: ignore[union-attr]
    assert [kvlayout.get_head_size(out, F.NL_X_NB_NH_BS_CS, i) for i in range(5)] == [8, 8, 8, 16, 16]


def test_golden_sglang_flat_k_v_list_stays_whole() -> None:
    kv = [t(21, 2, 4) for _ in range(10)]
    out, formats = per_layer(kv, None, "sglang", {"tokens_per_block": 3, "kv_list_layout": "k_v"})
    assert formats == [F.TWO_X_NL_X_NB_BS_NH_HS] * 5
    assert out[0][0].shape == (7, 3, 2, 4)  # type: ignore[union-attr]


def test_a_cross_layer_tensor_gives_every_layer_its_format() -> None:
    _out, formats = per_layer(t(7, 5, 2, 3, 2, 4), None, "vllm", {"kv_layout": "NHD"})
    assert formats == [F.NB_NL_TWO_BS_NH_HS] * 5
    _, formats = per_layer(t(7, 5, 2, 3, 2, 4), [[0, 1, 2]], "vllm", {"kv_layout": "NHD"})
    assert formats == [F.NB_NL_TWO_BS_NH_HS] * 3 + [None, None]


def test_dsa_indexer_caches_in_their_own_group() -> None:
    """LMCache #5002: vLLM registers uint8 indexer caches beside the layers."""
    layers = [t(2, 7, 3, 2, 4) for _ in range(4)]
    indexers = [t(7, 3, 132, dtype=torch.uint8) for _ in range(2)]
    _out, formats = per_layer([*layers, *indexers], [[0, 1, 2, 3], [4, 5]], "vllm", {"kv_layout": "NHD"})
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS] * 4 + [F.NL_X_NB_BSV_BSS] * 2
    # One group may mix shapes too: each shape is detected on its own.
    _, mixed = per_layer([*layers, *indexers], None, "vllm", {"kv_layout": "NHD"})
    assert mixed == formats


def test_layers_in_no_group_are_returned_as_given_with_no_format() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(4)]
    odd = t(3, 3)  # e.g. a scratch cache: not interpreted, so not an error
    out, formats = per_layer([*kv, odd], [[0, 1], [3]], "vllm", {"kv_layout": "NHD"})
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS, None, F.NL_X_TWO_NB_BS_NH_HS, None]
    assert out[2] is kv[2] and out[4] is odd
    groups = kvlayout.group_layers_by_identity(out, formats)
    assert [layers for _, layers in groups] == [[0, 1], [3]]  # layer groups are engine groups


@pytest.mark.parametrize(
    ("groups", "error", "message"),
    [
        ([[0, 1], [1, 2]], KVLayoutError, "layer 1 is in layer groups 0 and 1; a layer belongs to one group"),
        ([[0, 5]], KVLayoutError, "layer_index_groups[0]: layer 5 is out of range for 4 entries"),
        ([[0, -1]], KVLayoutError, "layer -1 is out of range"),
        ([[0, True]], TypeError, "layer_index_groups[0] holds True, not a layer index"),
        ([[0, "1"]], TypeError, "layer_index_groups[0] holds '1', not a layer index"),
        (["01"], TypeError, "layer_index_groups[0] is a str, not a sequence of layer indices"),
    ],
)
def test_bad_groups(groups: Any, error: type[Exception], message: str) -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(4)]
    with pytest.raises(error, match=re.escape(message)):
        per_layer(kv, groups, "vllm", {"kv_layout": "NHD"})


def test_bucket_errors_name_the_layers() -> None:
    kv = [t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4), t(7, 4), t(7, 4)]
    with pytest.raises(
        DetectionError, match=re.escape("kv_caches entries [2, 3], detected together as a list of 2: ")
    ):
        per_layer(kv, None, "vllm", {"kv_layout": "NHD"})


def test_registrations_that_cannot_be_split_per_layer() -> None:
    kv = [t(21, 2, 4) for _ in range(10)]
    with pytest.raises(DetectionError, match=re.escape("cannot be left out of the layer groups")):
        per_layer(kv, [list(range(8))], "sglang", {"kv_list_layout": "k_v"})
    hybrid = [*[t(21, 2, 4) for _ in range(2)], *[t(21, 2, 8) for _ in range(2)]] * 2
    with pytest.raises(DetectionError, match=re.escape("is not one entry per layer")):
        per_layer(hybrid, None, "sglang", {"kv_list_layout": "k_v"})


def test_mixed_devices_across_buckets_are_an_error() -> None:
    kv = [t(2, 7, 3, 2, 4), torch.zeros(7, 3, 4, device="meta")]
    with pytest.raises(
        DetectionError, match=re.escape("kv_caches[1]: device meta differs from kv_caches[0] (cpu)")
    ):
        per_layer(kv, None, "vllm", {"kv_layout": "NHD"})


@pytest.mark.parametrize(
    ("kv", "error", "message"),
    [
        ([], DetectionError, "kv_caches is empty"),
        (None, TypeError, "kv_caches is None"),
        ({"a": t(2)}, TypeError, "kv_caches is a dict"),
        ([t(7, 3, 4), None], TypeError, "kv_caches[1]: is None"),
    ],
)
def test_bad_registrations(kv: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        per_layer(kv, None, "vllm")


def _alike_but_shaped_apart(parts: list[RegistrationCase]) -> bool:
    """Whether tensors of two parts, in the same place of an entry and physically ordered,
    have one dtype, rank and long dims (size and stride of each dim longer than 1) but
    different shapes."""
    shapes: dict[tuple[Any, ...], set[tuple[int, ...]]] = {}
    for part in parts:
        for entry in attempt_permute_to_contiguous_view(list(part.kv)):
            for path, t in leaves(entry):
                long_dims = tuple((n, st_) for n, st_ in zip(t.shape, t.stride(), strict=True) if n != 1)
                shapes.setdefault((path, t.dtype, t.dim(), long_dims), set()).add(tuple(t.shape))
    return any(len(v) > 1 for v in shapes.values())


@settings(max_examples=200)
@given(
    st.lists(
        registrations("vllm", 1)
        | registrations("vllm", 3)
        | registrations("vllm", 13)
        | registrations("vllm", 16),
        min_size=1,
        max_size=3,
    ),
    st.randoms(use_true_random=False),
)
def test_hybrid_registrations_agree_with_detecting_each_part(parts: list[RegistrationCase], rnd: Any) -> None:
    """Layers of several formats, shuffled: each layer gets the format (and the normalized
    tensors) that detecting its own part alone gives. Parts whose tensors lie alike in
    memory but are shaped apart (a size-1 dim elsewhere) are left out: one registration
    reads such layers as the first of them reads (``test_size_1_axes``)."""
    assume(not _alike_but_shaped_apart(parts))
    hints = {"kv_layout": "NHD"}
    entries: list[tuple[Any, F, Any]] = []
    for part in parts:
        fmt, whole = kvlayout.normalize_kv_and_discover_format(part.kv, "vllm", hints)
        entries += [(raw, fmt, norm) for raw, norm in zip(part.kv, whole, strict=True)]
    rnd.shuffle(entries)
    split = rnd.randrange(len(entries) + 1)
    groups = [list(range(split)), list(range(split, len(entries)))]
    out, formats = per_layer([e[0] for e in entries], groups, "vllm", hints)
    assert formats == [e[1] for e in entries]
    for got, (_, _, want) in zip(out, entries, strict=True):
        assert [(x.shape, x.stride(), x.data_ptr()) for x in flatten(got)] == [
            (x.shape, x.stride(), x.data_ptr()) for x in flatten(want)
        ]
    groups_by_identity = kvlayout.group_layers_by_identity(out, formats)
    assert sorted(i for _, layers in groups_by_identity for i in layers) == list(range(len(entries)))
