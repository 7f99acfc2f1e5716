"""The edit rules and their page arithmetic, one failure mode at a time."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from kvlayout.integrations.vllm import (
    KV_CACHE_GROUP_EDITS,
    KVCacheGroupEdit,
    KVCacheGroupEditError,
    MambaStateListEdit,
    MambaStateRowsEdit,
    PackedHeadRowsEdit,
    SubpagedAttentionEdit,
    SubpagedMLAEdit,
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
)
from kvlayout.integrations.vllm.pages import opaque_page_view, page_runs
from tests.integrations.vllm.models import kvi, legacy_mamba_states

NB = 3


def _attn(block_size: int = 64, heads: int = 2, head: int = 16) -> Any:
    return kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
    )


def _mamba(block_size: int = 64, padded: int | None = None) -> Any:
    return kvi.MambaSpec(
        block_size=block_size,
        shapes=((3, 40), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=padded,
        mamba_cache_mode="align",
    )


def _config(**layers: Any) -> Any:
    groups = [kvi.KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec) for name, spec in layers.items()]
    return kvi.KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)


# -- page arithmetic --------------------------------------------------------------------


def test_page_runs_reads_pages_in_memory_order() -> None:
    t = torch.zeros(4, 6, 2, 5, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # logical [4, 2, 6, 5]
    runs = page_runs(t)
    assert (runs.num_pages, runs.page_bytes, runs.stride_bytes, runs.offset_bytes) == (4, 120, 120, 0)
    padded = torch.zeros(4, 70, dtype=torch.bfloat16)[1:, :60]  # 3 pages of 60, 70 apart, from element 70
    runs = page_runs(padded)
    assert (runs.num_pages, runs.page_bytes, runs.stride_bytes, runs.offset_bytes) == (3, 120, 140, 140)


def test_page_runs_refuses_a_tensor_of_no_pages() -> None:
    with pytest.raises(
        KVCacheGroupEditError, match=r"^expected a non-empty paged tensor, got shape \(0, 4\)$"
    ):
        page_runs(torch.zeros(0, 4))
    with pytest.raises(KVCacheGroupEditError, match=r"^expected a non-empty paged tensor, got shape \(\)$"):
        page_runs(torch.zeros(()))


def test_page_runs_rejects_interior_padding() -> None:
    t = torch.zeros(4, 2, 8, dtype=torch.bfloat16)[:, :, :6]
    with pytest.raises(
        KVCacheGroupEditError, match=r"pages are not one contiguous run each: .*dim 1 stride 8 != tight 6"
    ):
        page_runs(t)


def test_page_runs_rejects_kv_outside_the_pages() -> None:
    # A plain flash-attn (2, N, B, H, D) tensor: K and V of a block are two runs.
    t = torch.zeros(2, 4, 8, 2, 4, dtype=torch.bfloat16)
    runs = page_runs(t)  # reads the K/V axis as the pages: one run per plane, not per block
    assert runs.num_pages == 2
    spec = _attn(block_size=32, heads=2, head=4)
    with pytest.raises(KVCacheGroupEditError, match="do not tile the logical page"):
        SubpagedAttentionEdit().apply(spec, t)


def test_a_cache_of_one_element_a_page_is_refused_by_its_bytes_not_an_index_error() -> None:
    """No axis longer than 1: reading where its heads lie raised IndexError."""
    spec = _attn(block_size=16, heads=1, head=1)
    with pytest.raises(
        KVCacheGroupEditError, match=r"16 kernel pages of 1 tokens .* do not tile the logical page"
    ):
        apply_kv_cache_group_edits(
            _config(a=spec), {"a": torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)}, {"kv_layout": "NHD"}
        )


def test_opaque_page_view_is_a_view_of_exactly_the_pages() -> None:
    storage = torch.arange(100, dtype=torch.int8)
    view = opaque_page_view(
        storage, num_blocks=3, block_size=4, page_bytes=24, block_stride_bytes=30, offset_bytes=5
    )
    assert tuple(view.shape) == (3, 4, 6) and view.stride() == (30, 6, 1)
    assert view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    assert view[1].flatten().tolist() == list(range(35, 59))
    # pages that end at the storage's last byte are addressable
    last = opaque_page_view(
        storage, num_blocks=3, block_size=4, page_bytes=24, block_stride_bytes=38, offset_bytes=0
    )
    assert last[2].flatten().tolist() == list(range(76, 100))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(block_size=5, page_bytes=24, block_stride_bytes=24), "does not split into block_size=5"),
        (
            dict(block_size=4, page_bytes=24, block_stride_bytes=20),
            "20 bytes apart, less than the 24-byte page",
        ),
        (
            dict(block_size=4, page_bytes=24, block_stride_bytes=23),  # one byte of overlap
            "23 bytes apart, less than the 24-byte page",
        ),
        (
            dict(block_size=4, page_bytes=24, block_stride_bytes=40),
            "end at byte 104, past the 100-byte storage",
        ),
    ],
)
def test_opaque_page_view_refuses_what_it_cannot_address(kwargs: dict[str, int], message: str) -> None:
    storage = torch.zeros(100, dtype=torch.int8)
    with pytest.raises(KVCacheGroupEditError, match=message):
        opaque_page_view(storage, num_blocks=3, offset_bytes=0, **kwargs)


# -- the rules -------------------------------------------------------------------------


def test_registry_order_and_first_match() -> None:
    assert [e.name for e in KV_CACHE_GROUP_EDITS] == [
        "cpu-attn-pages",
        "mamba-state-rows",
        "mamba-state-list",
        "ring-buffer-pages",
        "head-slot-pages",
        "packed-head-rows",
        "paged-scale-mla",
        "subpaged-mla-attention",
        "subpaged-attention",
    ]
    mamba = _mamba(padded=4096)
    raw = torch.zeros(NB * mamba.page_size_bytes, dtype=torch.int8)
    assert isinstance(
        find_kv_cache_group_edit(mamba, legacy_mamba_states(raw, mamba, NB)), MambaStateListEdit
    )
    assert isinstance(find_kv_cache_group_edit(mamba, raw.view(NB, 1, 1, -1)), MambaStateRowsEdit)
    attn = _attn()
    assert isinstance(
        find_kv_cache_group_edit(attn, torch.zeros(NB * 4, 2, 16, 2, 16)), SubpagedAttentionEdit
    )
    assert find_kv_cache_group_edit(attn, torch.zeros(NB, 2, 64, 2, 16)) is None  # already logical pages


@pytest.mark.parametrize("value", [None, "x", {"a": 1}, [], [1, 2], torch.tensor(1.0), torch.zeros(4)])
def test_matches_never_raises(value: Any) -> None:
    for spec in (
        _attn(),
        _mamba(),
        kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype=torch.bfloat16),
    ):
        for edit in KV_CACHE_GROUP_EDITS:
            edit.matches(spec, value)


def test_mamba_states_must_be_back_to_back() -> None:
    mamba = _mamba(padded=4096)
    raw = torch.zeros(NB * mamba.page_size_bytes, dtype=torch.int8)
    conv, ssm = legacy_mamba_states(raw, mamba, NB)
    overlapping = torch.as_strided(raw.view(torch.float32), ssm.shape, ssm.stride(), 0)  # ssm over conv
    with pytest.raises(KVCacheGroupEditError, match=r"state 1 .* starts at byte 0, not at byte 240"):
        MambaStateListEdit().apply(mamba, [conv, overlapping])
    other = legacy_mamba_states(torch.zeros_like(raw), mamba, NB)[1]
    with pytest.raises(KVCacheGroupEditError, match="state 1 lives in another allocation"):
        MambaStateListEdit().apply(mamba, [conv, other])
    with pytest.raises(
        KVCacheGroupEditError,
        match=r"state 1 \(2, 2, 8, 8\) has 2 blocks 4096 bytes apart, state 0 has 3 blocks 4096 bytes apart",
    ):
        MambaStateListEdit().apply(mamba, [conv, ssm[:2]])
    # as many blocks, but another page stride: the ssm state's blocks are not the conv's pages
    halved = torch.as_strided(ssm, ssm.shape, (ssm.stride(0) // 2, *ssm.stride()[1:]))
    with pytest.raises(
        KVCacheGroupEditError,
        match=r"state 1 \(3, 2, 8, 8\) has 3 blocks 2048 bytes apart, state 0 has 3 blocks 4096 bytes apart",
    ):
        MambaStateListEdit().apply(mamba, [conv, halved])


def test_mamba_states_must_fit_the_page() -> None:
    mamba = _mamba()
    bigger = _mamba(padded=mamba.page_size_bytes + 64)
    raw = torch.zeros(NB * bigger.page_size_bytes, dtype=torch.int8)
    states = legacy_mamba_states(raw, bigger, NB)
    small = kvi.MambaSpec(block_size=8, shapes=((3, 40),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    with pytest.raises(KVCacheGroupEditError, match="more than the spec's 240-byte page"):
        MambaStateListEdit().apply(small, states)
    row = raw.view(NB, 1, 1, -1)[..., : small.page_size_bytes + 8]
    with pytest.raises(
        KVCacheGroupEditError, match="state row is 248 bytes, more than the spec's 240-byte page"
    ):
        MambaStateRowsEdit().apply(small, row)


def test_kernel_block_must_divide_the_block() -> None:
    with pytest.raises(
        KVCacheGroupEditError, match="kernel pages of 24 tokens do not divide the 64-token block"
    ):
        SubpagedAttentionEdit().apply(_attn(), torch.zeros(NB * 3, 2, 24, 2, 16, dtype=torch.bfloat16))


def test_kernel_pages_must_make_whole_blocks() -> None:
    with pytest.raises(KVCacheGroupEditError, match="7 kernel pages do not make whole blocks of 4 pages"):
        SubpagedAttentionEdit().apply(_attn(), torch.zeros(7, 2, 16, 2, 16, dtype=torch.bfloat16))


def test_flash_attention_kernel_pages_group_by_block() -> None:
    # FlashAttention's K/V-first tensor re-strided block-major: kernel pages are still
    # one run each, so k of them make a block.
    spec = _attn(block_size=64, heads=2, head=16)
    hidden = 16 * 2 * 16
    raw = torch.zeros(NB * spec.page_size_bytes // 2, dtype=torch.bfloat16)
    kv = raw.view(2, NB * 4, 16, 2, 16)
    kv = kv.as_strided(kv.shape, (hidden, 2 * hidden, *kv.stride()[2:]))
    view = SubpagedAttentionEdit().apply(spec, kv)
    assert tuple(view.shape) == (NB, 64, spec.page_size_bytes // 64)
    view[1] = 3
    assert bool((kv[:, 4:8] != 0).all()) and not kv[:, :4].any() and not kv[:, 8:].any()


@pytest.mark.parametrize("shape", [(NB * 4, 16, 24), (NB * 4, 1, 16, 24), (NB * 4, 16, 1, 24)])
def test_mla_kernel_pages(shape: tuple[int, ...]) -> None:
    spec = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=24, dtype=torch.bfloat16)
    value = torch.zeros(shape, dtype=torch.bfloat16)
    edit = find_kv_cache_group_edit(spec, value)
    assert isinstance(edit, SubpagedMLAEdit)
    view = edit.apply(spec, value)
    assert tuple(view.shape) == (NB, 64, 48)


def test_whole_pages_refuse_a_memory_order_vllm_never_makes() -> None:
    """Pages re-viewed whole must be outermost, or each head's pages one after another
    (LHBNC); tokens outermost is neither, refused, not read as either."""
    spec = dataclasses.replace(_attn(), head_size_v=8)
    value = torch.zeros(64, NB, 2, 24, dtype=torch.bfloat16).permute(1, 2, 0, 3)  # [NB, H, N, C], N outermost
    assert isinstance(find_kv_cache_group_edit(spec, value), PackedHeadRowsEdit)
    with pytest.raises(
        KVCacheGroupEditError,
        match=r"its pages \(strides \(48, 24, 144, 1\)\) are in no memory order vLLM's KVCacheLayout makes",
    ):
        PackedHeadRowsEdit().apply(spec, value)


def test_mla_with_several_heads_is_not_an_mla_registration() -> None:
    spec = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=24, dtype=torch.bfloat16)
    assert find_kv_cache_group_edit(spec, torch.zeros(NB * 4, 2, 16, 24)) is None


def test_fractional_tokens_per_state_is_left_alone() -> None:
    from fractions import Fraction

    spec = kvi.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, tokens_per_state=Fraction(1, 2)
    )
    assert find_kv_cache_group_edit(spec, torch.zeros(NB, 2, 32, 32)) is None


# -- invariants hold for any rule, user rules included ----------------------------------


class _CopyingEdit(KVCacheGroupEdit):
    name: ClassVar[str] = "copying"

    def matches(self, spec: Any, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def apply(self, spec: Any, value: Any, layout_hints: object = None) -> torch.Tensor:
        tensor: torch.Tensor = value
        return tensor.reshape(tensor.shape[0], spec.block_size, -1).clone()


class _WrongBlockEdit(KVCacheGroupEdit):
    name: ClassVar[str] = "wrong-block"

    def matches(self, spec: Any, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def apply(self, spec: Any, value: Any, layout_hints: object = None) -> torch.Tensor:
        tensor: torch.Tensor = value
        return tensor.view(torch.int8).view(tensor.shape[0], 1, -1)


class _NotATensorEdit(_CopyingEdit):
    name: ClassVar[str] = "not-a-tensor"

    def apply(self, spec: Any, value: Any, layout_hints: object = None) -> torch.Tensor:
        return value.numpy()  # type: ignore[no-any-return]  # the same bytes, but no tensor


class _CopyingBlocksEdit(_CopyingEdit):
    """A rule whose whole-block view (read in the engine's own format) is a copy."""

    name: ClassVar[str] = "copying-blocks"

    def block_view(self, spec: Any, value: Any) -> torch.Tensor | None:
        tensor: torch.Tensor = value
        return tensor.clone()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_CopyingEdit(), "edit 'copying' did not return a view of the registered storage"),
        (_NotATensorEdit(), "edit 'not-a-tensor' did not return a view of the registered storage"),
        (_CopyingBlocksEdit(), "edit 'copying-blocks' did not return a view of the registered storage"),
        (
            _WrongBlockEdit(),
            "edit 'wrong-block' produced a view whose block size reads as 1 under NL_X_NB_BS_HS, not the spec's block_size 64",
        ),
    ],
)
def test_invariants_are_enforced_on_every_rule(edit: KVCacheGroupEdit, message: str) -> None:
    mamba = _mamba(padded=4096)
    value = torch.zeros(NB, 1, 1, mamba.page_size_bytes, dtype=torch.int8)
    with pytest.raises(KVCacheGroupEditError, match=f"layer 'lin' \\(KV cache group 0\\): {message}"):
        apply_kv_cache_group_edits(_config(lin=mamba), {"lin": value}, edits=[edit])


def test_a_user_rule_on_a_spec_of_no_whole_slots_is_refused() -> None:
    """A spec whose slots are no whole number of tokens (Whisper's pooled halves) gives
    no block size to check an edited view against: a user rule that edits it is refused."""
    from fractions import Fraction

    spec = kvi.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, tokens_per_state=Fraction(1, 2)
    )
    with pytest.raises(
        KVCacheGroupEditError,
        match=r"layer 'enc' \(KV cache group 0\): edit 'wrong-block' edited a FullAttentionSpec, which "
        "declares no whole number of slots per block",
    ):
        apply_kv_cache_group_edits(
            _config(enc=spec), {"enc": torch.zeros(NB, 2, 32, 32)}, edits=[_WrongBlockEdit()]
        )
