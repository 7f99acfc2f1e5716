"""One regression test per hardening finding: every bad input gets a clear error, nothing
is silently misread or lost (the fuzz suite, tests/test_fuzz.py, covers the rest)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout import DetectionError, KVLayoutError, LayoutHintError
from kvlayout import EngineKVFormat as F
from kvlayout.integrations.vllm import KVCacheGroupEditError, validate_kv_cache_groups
from kvlayout.integrations.vllm.errors import UnsupportedKVCacheGroupsError
from kvlayout.transfer import TransferError, prepare


def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# -- wrong answers ------------------------------------------------------------------------------


def test_1_size_1_dims_stay_where_the_caller_put_them() -> None:
    hnd = torch.zeros(2 * 8 * 3 * 8).as_strided((2, 8, 3, 1, 8), (192, 24, 8, 0, 1))
    fmt, kv = kvlayout.normalize_kv_and_discover_format([hnd], "vllm", {"kv_layout": "HND"})
    assert fmt == F.NL_X_TWO_NB_NH_BS_HS
    assert (kvlayout.get_block_size(kv, fmt), kvlayout.get_head_size(kv, fmt)) == (1, 8)
    rows = torch.zeros(9 * 132, dtype=torch.uint8).as_strided((9, 1, 132), (132, 1188, 1))
    fmt, kv = kvlayout.normalize_kv_and_discover_format([rows], "vllm")
    assert fmt == F.NL_X_NB_BSV_BSS
    assert (kvlayout.get_num_blocks(kv, fmt), kvlayout.get_block_size(kv, fmt)) == (9, 1)


def test_1_identical_layers_with_other_size_1_strides_are_one_format() -> None:
    canonical = t(2, 8, 3, 1, 8)
    zero = torch.zeros(2 * 8 * 3 * 8, dtype=torch.bfloat16).as_strided((2, 8, 3, 1, 8), (192, 24, 8, 0, 1))
    odd = torch.zeros(2 * 8 * 3 * 8, dtype=torch.bfloat16).as_strided((2, 8, 3, 1, 8), (192, 24, 8, 5, 1))
    _, formats = kvlayout.normalize_and_discover_per_layer_formats([canonical, zero, odd], None, "vllm")
    assert formats == [F.NL_X_TWO_NB_NH_BS_HS] * 3


def test_1_one_head_hnd_exposed_as_nhd_still_reads_hnd() -> None:
    physical = t(2, 7, 1, 3, 4)  # [2, NB, NH=1, BS, HS], handed over as [2, NB, BS, NH, HS]
    fmt, kv = kvlayout.normalize_kv_and_discover_format(
        [physical.transpose(2, 3)], "vllm", {"kv_layout": "HND"}
    )
    assert fmt == F.NL_X_TWO_NB_NH_BS_HS and kvlayout.get_block_size(kv, fmt) == 3


def test_1_one_block_one_head_hnd_layer_of_a_blocks_first_pool_reads_hnd() -> None:
    pool = t(1, 2, 1, 2, 2)  # [NB=1, NL, NH=1, BS, CS]: the layer's NB stride spans the pool
    layers = [pool[:, i].transpose(1, 2) for i in range(2)]  # handed over as [NB, BS, NH, CS]
    fmt, kv = kvlayout.normalize_kv_and_discover_format(layers, "vllm", {"kv_layout": "HND"})
    assert fmt == F.NL_X_NB_NH_BS_CS
    assert (kvlayout.get_block_size(kv, fmt), kvlayout.get_num_heads(kv, fmt)) == (2, 1)


def test_2_layer_major_pools_are_refused_naming_the_axes() -> None:
    pool = t(32, 64, 2, 8 * 16 * 128).permute(
        1, 0, 2, 3
    )  # allocated [NL, NB, ...], handed over [NB, NL, ...]
    hints = {"num_kv_heads": 8, "tokens_per_block": 16, "head_dim": 128}
    with pytest.raises(
        DetectionError, match=re.escape("kv_caches: dim 1 (size 32, stride 2097152) is outer to dim 0")
    ):
        kvlayout.normalize_kv_and_discover_format(pool, "trtllm", hints)
    cross = t(5, 7, 2, 3, 2, 4).transpose(0, 1)  # a vLLM cross-layer tensor, layer-major in memory
    with pytest.raises(DetectionError, match="a layer-major pool"):
        kvlayout.normalize_kv_and_discover_format(cross, "vllm", {"kv_layout": "NHD"})
    square = t(4, 4, 2, 3, 2, 4).transpose(0, 1)  # NL == NB: only the addressing would be wrong
    with pytest.raises(DetectionError, match="a layer-major pool"):
        kvlayout.normalize_kv_and_discover_format(square, "vllm", {"kv_layout": "NHD"})


def test_3_vllm_size_hints_decide_and_are_checked() -> None:
    kv = [t(2, 7, 16, 8, 128) for _ in range(2)]  # NHD on the CPU, where no hint means HND
    fmt, out = kvlayout.normalize_kv_and_discover_format(
        kv, "vllm", {"num_kv_heads": 8, "tokens_per_block": 16}
    )
    assert fmt == F.NL_X_TWO_NB_BS_NH_HS and kvlayout.get_num_heads(out, fmt) == 8
    with pytest.raises(
        LayoutHintError,
        match=re.escape(
            "vLLM: layout hint num_kv_heads=4 contradicts NL_X_TWO_NB_BS_NH_HS, whose NH is 8 (kv_caches[0]: shape"
        ),
    ):
        kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD", "num_kv_heads": 4})
    with pytest.raises(LayoutHintError, match=re.escape("layout hint head_dim=64 contradicts")):
        kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"head_dim": 64})


def test_4_padded_dim_0_says_flash_infer() -> None:
    padded = [torch.zeros(2, 2 * 3 * 2 * 4 + 4)[:, :48].view(2, 2, 3, 2, 4) for _ in range(2)]
    fmt, _ = kvlayout.normalize_kv_and_discover_format(padded, "vllm", {"kv_layout": "HND"})
    assert fmt == F.NL_X_NB_TWO_NH_BS_HS


def test_5_a_left_out_k_v_entry_says_why() -> None:
    kv = [t(21, 2, 4) for _ in range(10)]
    with pytest.raises(DetectionError, match=re.escape("its entries cannot be left out of the layer groups")):
        kvlayout.normalize_and_discover_per_layer_formats(
            kv, [list(range(9))], "sglang", {"tokens_per_block": 3, "kv_list_layout": "k_v"}
        )


# -- crashes, hangs and other exceptions ------------------------------------------------------------


def test_6_thousands_of_threads_are_capped_and_never_abort() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvlayout import _native
        from kvlayout.transfer import prepare
        plan = prepare([torch.randn(2, 64, 4, 2, 16) for _ in range(2)], 1)
        shape, dtype = plan.chunk_shape(4 * 64)
        plan.store_blocks(list(range(64)), [torch.zeros(shape, dtype=dtype)], num_threads=20_000)
        print(_native.pool_workers() < _native.max_threads())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_7_a_list_that_contains_itself_is_an_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(KVLayoutError, match="nested more than 8 list levels deep"):
        kvlayout.get_device(loop)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: kvlayout.get_num_blocks({"layer.0": t(7, 3, 16)}, F.NL_X_NB_BS_HS), KVLayoutError, "kv is a dict"),  # type: ignore[arg-type]
        (lambda: kvlayout.get_num_blocks([np.zeros((7, 3, 16))], F.NL_X_NB_BS_HS), KVLayoutError, "kv[0] is a ndarray, not a tensor"),  # type: ignore[list-item]
        (lambda: kvlayout.normalize_kv_and_discover_format([np.zeros((7, 3, 16))], "vllm"), TypeError, "kv_caches[0]: is a ndarray"),  # type: ignore[list-item]
        (lambda: kvlayout.normalize_kv_and_discover_format([t(7, 3, 16).to_sparse()], "vllm"), TypeError, "layout torch.sparse_coo"),
        (lambda: kvlayout.get_num_blocks([torch.zeros(7, 48).to_sparse_csr()], F.NL_X_NB_BS_HS), TypeError, "layout torch.sparse_csr"),
        (lambda: kvlayout.normalize_kv_and_discover_format(torch.nested.nested_tensor([t(7, 3, 16)]), "vllm"), TypeError, "is a nested tensor"),
        (lambda: kvlayout.normalize_kv_and_discover_format([torch.zeros(7, 3, 16).to_mkldnn()], "vllm"), TypeError, "layout torch._mkldnn"),
        (lambda: kvlayout.get_num_heads([t(7, 3, 16)], F.NL_X_NB_BS_HS, True), TypeError, "layer_idx must be an int, not bool"),
    ],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")  # torch's beta notices
def test_8_foreign_values_are_errors_of_the_family(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)


def test_8_numpy_integers_are_integers() -> None:
    kv = [t(7, 3, 16) for _ in range(3)]
    assert kvlayout.get_num_heads(kv, F.NL_X_NB_BS_HS, np.int64(2)) == 1  # type: ignore[arg-type]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    shape, dtype = plan.chunk_shape(np.int32(6))  # type: ignore[arg-type]
    chunks = [torch.zeros(shape, dtype=dtype)]
    skip: Any = np.int64(1)
    threads: Any = np.int8(2)
    plan.store_blocks(
        np.array([1, 2], dtype=np.uint64), chunks, skip_prefix_n_blocks=skip, num_threads=threads
    )


def test_8_block_ids_without_values_or_beyond_int64() -> None:
    plan = prepare([t(7, 3, 16)], F.NL_X_NB_BS_HS)
    chunk = torch.zeros(plan.chunk_shape(3)[0], dtype=torch.bfloat16)
    with pytest.raises(TransferError, match="block_ids must hold values"):
        plan.store_blocks(torch.empty(1, dtype=torch.int64, device="meta"), [chunk])
    with pytest.raises(TransferError, match="18446744073709551615"):
        plan.store_blocks(np.array([2**64 - 1], dtype=np.uint64), [chunk])


def test_9_a_load_of_a_repeated_block_is_refused() -> None:
    kv = [torch.randn(7, 3, 16)]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    chunk = torch.randn(plan.chunk_shape(9)[0])
    before = kv[0].clone()
    with pytest.raises(
        TransferError, match=re.escape("block_ids[2] = 4 repeats block_ids[0]: a load writes each block once")
    ):
        plan.load_blocks([4, 1, 4], [chunk])
    assert torch.equal(kv[0], before)
    plan.store_blocks([4, 1, 4], [chunk])  # a store may copy one block twice
    plan.load_blocks([4, 1, 4], [chunk], skip_prefix_n_blocks=1)  # the skipped one is not written


def test_9_a_chunk_of_a_partial_block_is_refused() -> None:
    plan = prepare([t(7, 4, 16)], F.NL_X_NB_BS_HS)
    with pytest.raises(TransferError, match="num_tokens=7 is not a whole number of blocks of 4 tokens"):
        plan.chunk_shape(7)


@pytest.mark.parametrize(
    ("kv", "what"),
    [([t(0, 3, 16)], "NB=0"), ([t(7, 0, 16)], "BS=0"), ([t(2, 7, 3, 0, 4)], "a token row of 0 elements")],
)
def test_9_an_empty_cache_says_what_is_empty(kv: list[torch.Tensor], what: str) -> None:
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})  # accepted
    with pytest.raises(TransferError, match=re.escape(f"the cache holds no blocks to move ({what})")):
        prepare(normalized, fmt)


def test_9_explain_refuses_an_unknown_size() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlayout", "explain", "NL_X_NB_BS_HS", "--sizes", "FOO=3"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "'FOO' is not a size token" in done.stderr


def test_10_groups_without_layer_names_are_still_checked() -> None:
    cross = type("CrossAttentionSpec", (), {"block_size": 16})()
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=cross)])
    with pytest.raises(UnsupportedKVCacheGroupsError, match=re.escape("group 0: CrossAttentionSpec")):
        validate_kv_cache_groups(config)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (SimpleNamespace(layer_names=["a"]), "group 0: the group has no kv_cache_spec"),
        (
            SimpleNamespace(layer_names=["a"], kv_cache_spec=SimpleNamespace()),
            "block_size=None: block ids need",
        ),
        (SimpleNamespace(layer_names=["a"], kv_cache_spec=SimpleNamespace(block_size=0)), "block_size=0"),
        (
            SimpleNamespace(layer_names=["a"], kv_cache_spec=SimpleNamespace(block_size="16")),
            "block_size='16'",
        ),
    ],
)
def test_8_duck_typed_specs_missing_fields_are_reported(group: Any, message: str) -> None:
    with pytest.raises(UnsupportedKVCacheGroupsError, match=re.escape(message)):
        validate_kv_cache_groups(SimpleNamespace(kv_cache_groups=[group]))


def test_8_rule_matching_never_raises_on_a_spec_missing_fields() -> None:
    from kvlayout.integrations.vllm import KV_CACHE_GROUP_EDITS

    mamba = type("MambaSpec", (), {})()
    attention = type("FullAttentionSpec", (), {})()
    for edit in KV_CACHE_GROUP_EDITS:
        for spec in (mamba, attention):
            edit.matches(spec, t(4, 2, 8, 2, 16))
    with pytest.raises(KVCacheGroupEditError, match="MambaSpec has page_size_bytes=None"):
        KV_CACHE_GROUP_EDITS[0].apply(
            type("MambaSpec", (), {"block_size": 4})(), t(4, 1, 1, 64, dtype=torch.int8)
        )


# -- round 4 probes: lazy views, ids NumPy promotes, sizes past the cache ----------------------


def _flash(n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, 8, 4, 2, 16) for _ in range(n)]


@pytest.mark.parametrize(("lazy", "dtype"), [(torch._neg_view, torch.float32), (torch.conj, torch.complex64)])
def test_11_lazily_negated_or_conjugated_views_are_refused(lazy: Any, dtype: torch.dtype) -> None:
    """A neg view (what ``-x`` of a conj view gives) and ``x.conj()`` of a complex tensor
    are views whose bytes are not their values: moved as bytes, the sign or conjugation
    would be lost."""
    base = [torch.randn(2, 8, 4, 2, 16, dtype=dtype) for _ in range(2)]
    views = [lazy(b) for b in base]
    assert all(v.is_neg() or v.is_conj() for v in views)
    with pytest.raises(TypeError, match=r"kv_caches\[0\] is a view with its (negative|conjugate) bit set"):
        kvlayout.detect(views, "vllm", {"kv_layout": "NHD"})
    plan = prepare(kvlayout.detect(base, "vllm", {"kv_layout": "NHD"}).only_group(), F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(TransferError, match=r"chunks\[0\] is a view with its (negative|conjugate) bit set"):
        plan.store_blocks([0], [lazy(plan.chunks_for(1, 4)[0])])


def test_11_block_ids_numpy_promotes_to_float_are_read_exactly() -> None:
    from kvlayout.transfer import BlockMapError, block_map

    a, b = (kvlayout.detect(_flash(), "vllm", {"kv_layout": "NHD"}) for _ in range(2))
    assert block_map(a, b, [np.int64(1), np.uint64(2)], [3, 4]).num_tokens == 8  # NumPy: float64
    with pytest.raises(
        BlockMapError, match=r"^src_blocks\[0\] = 9223372036854775808 is out of range for any"
    ):
        block_map(a, b, [2**63, 0], [3, 4])
    with pytest.raises(BlockMapError, match=r"^src_blocks must be a 1-D sequence of ints, got shape \[\]"):
        block_map(a, b, torch.tensor(1), [3], num_tokens=4)
    ids = torch._neg_view(torch.tensor([-1, -2]))  # reads as [1, 2]
    assert block_map(a, b, ids, [3, 4]).num_tokens == 8


def test_11_block_sizes_are_ints_and_fit_the_cache() -> None:
    from kvlayout.transfer import BlockMapError, block_map

    a, b = (kvlayout.detect(_flash(), "vllm", {"kv_layout": "NHD"}) for _ in range(2))
    assert block_map(a, b, [1], [3, 4], src_block_size=np.int64(8)).num_tokens == 8  # type: ignore[arg-type]
    with pytest.raises(BlockMapError, match=r"^src_block_size must be an int, got 4.0"):
        block_map(a, b, [1], [3], src_block_size=4.0)  # type: ignore[arg-type]
    with pytest.raises(
        BlockMapError, match=r"^src_block_size=64 is 16 of the src cache's blocks, but it has 8"
    ):
        block_map(a, b, [0], [0, 1], src_block_size=64, num_tokens=8)


def test_11_thread_counts_past_any_pool_are_capped_for_block_maps_too() -> None:
    from kvlayout.transfer import block_map

    a, b = (kvlayout.detect(_flash(), "vllm", {"kv_layout": "NHD"}) for _ in range(2))
    assert 1 <= block_map(a, b, [0], [1]).copy(num_threads=2**31) <= 2**31 - 1


def test_11_chunks_for_more_blocks_than_the_cache_holds_is_refused_up_front() -> None:
    plan = prepare(
        kvlayout.detect(_flash(), "vllm", {"kv_layout": "NHD"}).only_group(), F.NL_X_TWO_NB_BS_NH_HS
    )
    assert len(plan.chunks_for(8, 4)) == 8
    with pytest.raises(TransferError, match=r"^num_blocks=1099511627776 is outside \[0, 8\]"):
        plan.chunks_for(2**40, 4)


def test_11_a_block_map_of_meta_registrations_says_how_to_plan_one() -> None:
    from kvlayout.transfer import BlockMapError, block_map

    meta, real = (
        kvlayout.detect(
            [torch.empty(2, 8, 4, 2, 16, device=d) for _ in range(2)], "vllm", {"kv_layout": "NHD"}
        )
        for d in ("meta", "cpu")
    )
    with pytest.raises(
        BlockMapError, match=r"^src is a meta registration, which has no addresses: plan from"
    ):
        block_map(meta, real, [0], [1])
    assert block_map(meta.describe(at=1 << 40), real.describe(at=1 << 44), [0], [1]).num_runs == 4
    # describe() without at= says the same of the registration (it blamed "description.device.type")
    from kvlayout.transfer import PeerDescriptionError

    with pytest.raises(
        PeerDescriptionError,
        match=r"^describe\(\): a meta registration has no addresses to describe; pass at=",
    ):
        meta.describe()


def test_11_a_cache_of_no_blocks_is_said_to_be_empty_not_freed() -> None:
    """Detection reads a cache of 0 blocks (or 0-element heads); a block map or a
    description of it said its memory was "freed, or resized to 0" (block_map) or blamed
    the description's own field (describe): both now name the empty size."""
    from kvlayout.transfer import BlockMapError, PeerDescriptionError, block_map

    def vllm(nb: int, hs: int) -> Any:
        kv = [torch.zeros(2, nb, 4, 2, hs) for _ in range(2)]
        return kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})

    empty, real = vllm(0, 16), vllm(8, 16)
    with pytest.raises(
        BlockMapError, match=r"^src: NL_X_TWO_NB_BS_NH_HS: the cache holds no elements \(NB=0\): it has no"
    ):
        block_map(empty, real, [], [], num_tokens=0)
    with pytest.raises(PeerDescriptionError, match=r"^NL_X_TWO_NB_BS_NH_HS: .* no elements \(HS=0\)"):
        vllm(8, 0).describe()


# -- round 12: a hostile caller's inputs (each raised torch's, NumPy's or Python's own error) --


@pytest.mark.parametrize("engine", ["vllm", "sglang", "atom", "max", "kvbm"])
@pytest.mark.parametrize("where", ["every entry", "the second entry", "inside a tuple"])
@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
def test_12_a_nested_tensor_in_a_list_is_named_before_any_detector_reads_shapes(
    engine: str, where: str
) -> None:
    """A nested tensor has no shape: vLLM's view pooling and MAX's mixed-shape check read
    ``.shape`` of the entries first, and torch raised "Internal error: NestedTensorImpl
    doesn't support sizes" (SGLang's K/V split did for one inside a tuple)."""
    nested = torch.nested.nested_tensor([t(16, 2, 64), t(16, 2, 64)])
    kv: Any
    path: str
    kv, path = {
        "every entry": ([nested, nested], "kv_caches[0]"),
        "the second entry": ([t(2, 8, 16, 2, 64), nested], "kv_caches[1]"),
        "inside a tuple": ([(nested, nested), (nested, nested)], "kv_caches[0][0]"),
    }[where]
    for call in (kvlayout.detect, kvlayout.normalize_kv_and_discover_format):
        with pytest.raises(
            TypeError, match=re.escape(f"{path}: is a nested tensor; a KV cache is a strided tensor")
        ):
            call(kv, engine)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[1], [2, 3]], "[0] is a list ([1]), not an int: block ids are a 1-D sequence of ints"),
        ([1, [2], 3], "[1] is a list ([2]), not an int: block ids are a 1-D sequence of ints"),
        ((1, np.array([2, 3])), "[1] is a ndarray (array([2, 3])), not an int"),
    ],
)
def test_12_ragged_block_ids_are_named_not_numpy_s_inhomogeneous_shape(ids: Any, message: str) -> None:
    """NumPy's "setting an array element with a sequence. The requested array has an
    inhomogeneous shape ..." reached the caller from both a plan's calls and block maps."""
    from kvlayout.transfer import BlockMapError, block_map

    kv = [t(7, 3, 16) for _ in range(2)]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    with pytest.raises(TransferError, match=re.escape("block_ids" + message)):
        plan.store_blocks(ids, plan.chunks_for(3, 9))
    reg = kvlayout.bind(kv, F.NL_X_NB_BS_HS)
    with pytest.raises(BlockMapError, match=re.escape("src_blocks" + message)):
        block_map(reg, reg, ids, [4, 5, 6])


def test_12_masked_block_ids_are_refused_not_read_through_the_mask() -> None:
    """``np.asarray`` of a masked array drops its mask: the masked slot's leftover value
    (here 5) was moved as a block id."""
    kv = [torch.randn(7, 3, 16)]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    chunks = plan.chunks_for(3, 9)
    masked = np.ma.masked_array([1, 5, 3], mask=[False, True, False])
    with pytest.raises(TransferError, match=re.escape("block_ids[1] is masked, which is no block id")):
        plan.store_blocks(masked, chunks)
    plan.store_blocks(np.ma.masked_array([1, 5, 3], mask=False), chunks)  # nothing masked: its values
    assert torch.equal(chunks[0][0, 0, 3:6], kv[0][5])


def test_12_a_range_of_ids_outside_the_cache_is_refused_before_it_is_built() -> None:
    """``range(2**62)`` as block ids, layer indices or layer ids was built first (NumPy's or
    Python's MemoryError at best; a range(10**9) takes 8 to 36 GB before anything says no):
    a range's first id outside the cache is found by arithmetic, and a list longer than the
    call can take is refused by its length."""
    from kvlayout.transfer import BlockMapError, block_map

    kv = [t(7, 3, 16) for _ in range(2)]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    chunks = plan.chunks_for(3, 9)
    with pytest.raises(TransferError, match=re.escape("block_ids[7] = 7 is out of range for 7 blocks")):
        plan.store_blocks(range(2**62), chunks)
    with pytest.raises(TransferError, match=re.escape("block_ids[0] = -1 is out of range for 7 blocks")):
        plan.store_blocks(range(-1, 2**62), chunks)
    with pytest.raises(TransferError, match=re.escape("block_ids[4] = -2 is out of range for 7 blocks")):
        plan.store_blocks(range(6, -(2**62), -2), chunks)
    plan.store_blocks(range(6, 0, -2), chunks)  # in range: built and moved as any ids
    reg = kvlayout.bind(kv, F.NL_X_NB_BS_HS)
    with pytest.raises(BlockMapError, match=re.escape("src_blocks[7] = 7 is out of range for 7 blocks")):
        block_map(reg, reg, range(2**62), range(2**62))
    with pytest.raises(
        BlockMapError, match=re.escape(f"dst_blocks has {2**62} block ids; the request's 9 tokens")
    ):
        block_map(reg, reg, [1, 2, 3], range(2**62), num_tokens=9)
    with pytest.raises(
        kvlayout.RegistrationError, match="layer_indices has more than 2 entries, but the registration"
    ):
        reg.data_ptrs(range(2**62))
    with pytest.raises(
        kvlayout.RegistrationError, match="layer_ids has more than 2 entries for the registration's 2"
    ):
        reg.numbered(range(2**62))
    assert reg.data_ptrs(range(2)) == [x.data_ptr() for x in kv]


def test_12_a_shard_of_more_heads_or_ranks_than_any_model_is_refused_when_made() -> None:
    """A Shard took any int: 2**70 heads reached ``len(shard.heads)`` when the registration
    was described (OverflowError: Python int too large to convert to C ssize_t)."""
    from kvlayout.transfer import Shard, ShardError

    for field in ("tp_size", "num_kv_heads"):
        fields = {"tp_rank": 0, "tp_size": 1, "num_kv_heads": 2, field: 2**70}
        with pytest.raises(
            ShardError, match=re.escape(f"Shard.{field}={2**70} is 2**32 or more: no model has")
        ):
            Shard(**fields)
    kv = [t(2, 16, 16, 2, 64) for _ in range(2)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    assert reg.describe(shard=Shard(0, 1, 2)).shard == Shard(0, 1, 2)


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
def test_12_the_lmcache_named_readers_name_a_nested_tensor_and_never_print_a_tensor() -> None:
    """get_shape_and_dtype and extract_kv_cache_shapes read ``.shape`` of a nested tensor
    (torch's "Internal error: NestedTensorImpl doesn't support sizes"); the "Unknown (...)"
    labels wrote out whatever was passed as the format, and ``str()`` of a freed tensor
    raised torch's "setStorage: ... out of bounds for storage of size 0" from the label."""
    nested = torch.nested.nested_tensor([t(16, 2, 64)])
    with pytest.raises(
        TypeError, match=re.escape("kv_caches[1][1]: is a nested tensor; a KV cache is a strided")
    ):
        kvlayout.get_shape_and_dtype([t(3), (t(2), nested)])
    for kv, where in (([t(2), nested], "kv_caches[1]"), (nested, "kv_caches")):
        with pytest.raises(TypeError, match=re.escape(f"{where}: is a nested tensor")):
            kvlayout.extract_kv_cache_shapes(kv)
    freed = t(2, 8, 16, 2, 64)
    freed.untyped_storage().resize_(0)
    assert kvlayout.get_engine_kv_shape_description([freed]) == "Unknown (a list)"  # type: ignore[arg-type]
    assert kvlayout.get_attention_backend(freed, "vllm") == "Unknown (a Tensor)"  # type: ignore[arg-type]
    assert kvlayout.get_engine_kv_shape_description(np.int64(999)) == "Unknown (999)"  # type: ignore[arg-type]


# -- round 13: a hostile user of what holds addresses across calls ---------------------------


@pytest.mark.parametrize(
    "change",
    [
        "t.resize_(0)",
        "t.untyped_storage().resize_(0)",
        "t.set_(torch.zeros(2, 8, 4, 2, 16))",
        "t.data = torch.zeros(2, 8, 4, 2, 16)",
    ],
)
@pytest.mark.parametrize("before", [False, True])
def test_13_a_pointer_table_of_a_cache_re_allocated_since_detection_is_refused(
    change: str, before: bool
) -> None:
    """``get_group_data_ptrs`` (the LMCache flow: detect once, then ask for the table),
    ``Registration.data_ptrs`` and ``KernelGroup.layer_ptrs`` handed out the pointers
    detection read after the engine had re-allocated or freed a layer: a kernel given them
    writes freed memory. ``before``: the table was asked for once while the cache was in
    place (the later call compares with what the first read)."""
    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(2)]
    fmt, registered = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    reg = registered.registration  # type: ignore[union-attr]  # a RegisteredKV
    if before:
        assert kvlayout.get_group_data_ptrs(registered, fmt, [0, 1]) == [x.data_ptr() for x in kv]
        assert reg.data_ptrs([1]) == [kv[1].data_ptr()]
        assert reg.only_group().layer_ptrs(1) == [kv[1].data_ptr()]
    exec(change, {"torch": torch, "t": kv[1]})
    moved = r"kv_caches\[1\]('s storage)? was re-allocated"
    for call, label in (
        (lambda: kvlayout.get_group_data_ptrs(registered, fmt, [0, 1]), "data_ptrs()"),
        (lambda: reg.data_ptrs([1]), "data_ptrs()"),
        (lambda: reg.data_ptrs([0]), "data_ptrs()"),  # one group: any of its tensors moved
        (lambda: reg.only_group().layer_ptrs(1), "layer_ptrs(1)"),
    ):
        with pytest.raises(kvlayout.RegistrationError, match=rf"^{re.escape(label)}: (the storage of )?"):
            call()
        with pytest.raises(kvlayout.RegistrationError, match=rf"{moved}.*detect the registration again$"):
            call()


def test_13_a_pointer_table_of_a_cross_layer_pool_re_allocated_since_detection_is_refused() -> None:
    """A cross-layer pool's table was read from the live tensor: a freed pool gave 0."""
    pool = torch.randn(8, 2, 2, 4, 2, 16)
    fmt, registered = kvlayout.normalize_kv_and_discover_format(pool, "vllm", {"kv_layout": "NHD"})
    assert kvlayout.get_group_data_ptrs(registered, fmt, [0, 1]) == [pool.data_ptr()]
    pool.untyped_storage().resize_(0)
    with pytest.raises(
        kvlayout.RegistrationError, match=r"^data_ptrs\(\): kv_caches was re-allocated \(data pointer 0x0, "
    ):
        kvlayout.get_group_data_ptrs(registered, fmt, [0, 1])


def test_13_a_chunk_past_any_tensor_s_size_is_refused_when_its_shape_is_asked() -> None:
    """``chunk_shape(2**62)`` answered a shape whose bytes overflow int64: torch's "Storage
    size calculation overflowed" came later, from the caller's ``torch.empty``."""
    from kvlayout.transfer import BlockMapError
    from kvlayout.transfer.block_maps import chunk_shape_for

    group = kvlayout.detect(_flash(), "vllm", {"kv_layout": "NHD"}).only_group()
    plan = prepare(group, F.NL_X_TWO_NB_BS_NH_HS)
    too_many = 2**62  # 2 x 2 layers x 2**62 tokens x 128 bytes
    with pytest.raises(TransferError, match=rf"^num_tokens={too_many} makes a chunk of {2**71} bytes, more"):
        plan.chunk_shape(too_many)
    with pytest.raises(BlockMapError, match=rf"^num_tokens={too_many} makes a chunk of {2**71} bytes, more"):
        chunk_shape_for(group, too_many)
    largest = (2**63 - 1) // 512 // 4 * 4  # still a tensor's size: answered
    assert plan.chunk_shape(largest)[0] == (2, 2, largest, 32)
    assert chunk_shape_for(group, largest)[0] == (2, 2, largest, 32)
    # the bound is torch's: a chunk of exactly 2**63 bytes overflows, one block fewer does not
    exact = 2**63 // 512  # 2**54 tokens, 1 << 63 bytes
    with pytest.raises(TransferError, match=rf"^num_tokens={exact} makes a chunk of {2**63} bytes, more"):
        plan.chunk_shape(exact)
    with pytest.raises(BlockMapError, match=rf"^num_tokens={exact} makes a chunk of {2**63} bytes, more"):
        chunk_shape_for(group, exact)
    with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
        torch.empty((2, 2, exact, 32), device="meta")
    for shape, dtype in (plan.chunk_shape(exact - 4), chunk_shape_for(group, exact - 4)):
        assert torch.empty(shape, dtype=dtype, device="meta").nbytes == 2**63 - 4 * 512
