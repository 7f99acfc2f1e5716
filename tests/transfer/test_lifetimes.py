"""What a call holds and when: kvlayout's own copy of the block ids, the caller's code run
before the memory checks, a dropped cache freed at once, and no live addresses pickled."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout import _native
from kvlayout.transfer import BlockMapError, TransferError, block_map, prepare
from kvlayout.transfer.arguments import block_ids_arg
from kvlayout.transfer.block_maps import chunk_side


def cache(layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, 8, 4, 2, 16) for _ in range(layers)]


@pytest.mark.parametrize(
    "given",
    [np.arange(4, dtype=np.int64), torch.arange(4), np.arange(4, dtype=np.int32)],
    ids=["int64 array", "int64 tensor", "int32 array"],
)
def test_block_ids_are_read_from_kvlayout_s_own_copy(given: Any) -> None:
    """Ids are checked once, then read with the GIL released: a write by another thread to
    the caller's array (an id past the pool) must not reach the copy."""
    ids = block_ids_arg("block_ids", given, TransferError)
    caller = given.numpy() if isinstance(given, torch.Tensor) else given
    assert not np.shares_memory(ids, caller) and not ids.flags.writeable
    assert ids.dtype == np.int64 and ids.tolist() == [0, 1, 2, 3]


def test_a_built_map_keeps_its_ids_when_the_caller_reuses_the_array() -> None:
    kv = cache()
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    dst = np.array([2, 3], dtype=np.int64)
    m = block_map(reg, reg, np.array([0, 1]), dst, num_tokens=8)
    dst[:] = [1 << 40, 0]  # the caller's buffer, reused for the next request
    assert m._ids[1].tolist() == [2, 3]
    m.copy()
    assert torch.equal(kv[0][:, 2:4], kv[0][:, 0:2])


def test_first_repeated_block_id_refuses_ids_outside_the_pool() -> None:
    """Its bitmap holds the pool's ids: an id outside it would be a write past the bitmap."""
    with pytest.raises(ValueError, match=r"a block id is outside \[0, num_blocks\)"):
        _native.first_repeated_block_id(np.array([0, 1 << 40], dtype=np.int64), 0, 8)
    assert _native.first_repeated_block_id(np.array([3, 1, 3], dtype=np.int64), 0, 8) == 2


class _FreesTheCache:
    """A thread count whose conversion frees the cache's memory (the caller's code, run
    by ``operator.index``)."""

    def __init__(self, victim: torch.Tensor) -> None:
        self.victim = victim

    def __index__(self) -> int:
        self.victim.untyped_storage().resize_(0)
        return 1


def test_the_memory_checks_come_after_every_argument_is_converted() -> None:
    kv = cache()
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    plan = prepare(reg, fmt)
    chunks = plan.chunks_for(2, 4)
    with pytest.raises(TransferError, match=r"kv_caches\[0\] was re-allocated .* prepare a new plan"):
        plan.store_blocks([0, 1], chunks, num_threads=_FreesTheCache(kv[0]))  # type: ignore[arg-type]


class _Watched(torch.Tensor):
    """A tensor subclass that records what torch calls reach its ``__torch_function__``
    (where a caller's code could free a tensor the checks have passed)."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def test_a_tensor_subclass_s_code_does_not_run_between_the_checks_and_the_copy() -> None:
    """Its hook on ``data_ptr`` could free a chunk (or the other side of a map) after it
    was checked: the copy then wrote into unmapped memory (a segfault)."""
    kv = [t.as_subclass(_Watched) for t in cache()]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    group = reg.only_group()
    plan = prepare(group, group.format)
    chunks = [c.as_subclass(_Watched) for c in plan.chunks_for(2, 4)]
    m = block_map(reg, reg, [0, 1], [2, 3])
    _Watched.calls.clear()
    plan.store_blocks([0, 1], chunks)
    plan.load_blocks([2, 3], chunks)
    m.copy()
    assert _Watched.calls == []
    assert torch.equal(torch.Tensor(kv[0])[:, 2:4], torch.Tensor(kv[0])[:, 0:2])


def test_a_tensor_that_became_a_subclass_after_the_first_copy_runs_no_code_in_the_checks() -> None:
    """The first copy() keeps what later ones check; a tensor whose class is a subclass's
    by then (``t.__class__ = ...``) must not have its hook called by those checks."""
    kv = cache()
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    m = block_map(reg, reg, [0, 1], [2, 3])
    m.copy()
    for t in kv:
        t.__class__ = _Watched
    _Watched.calls.clear()
    m.copy()
    assert _Watched.calls == []
    assert torch.equal(torch.Tensor(kv[1])[:, 2:4], torch.Tensor(kv[1])[:, 0:2])


def test_a_torch_function_mode_the_caller_has_on_runs_no_code_in_a_map_s_checks() -> None:
    """A TorchFunctionMode's hook runs in torch calls on plain tensors too (``data_ptr``,
    ``untyped_storage``): in the checks of a map's copy() (the first and the later ones, a
    joined map's) or a plan's store and load it could free what was just checked. The
    checks run with it off."""
    from torch.overrides import TorchFunctionMode

    from kvlayout.transfer import join_maps

    calls: list[str] = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    kv = cache()
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    m = block_map(reg, reg, [0, 1], [2, 3])
    joined = join_maps([block_map(reg, reg, [4], [5]), block_map(reg, reg, [6], [7])])
    plan = prepare(reg.only_group(), reg.only_group().format)
    chunks = plan.chunks_for(1, 4)
    for _ in range(2):  # the first copy (which makes what later ones read), then a later one
        with Mode():
            m.copy()
            joined.copy()
            plan.store_blocks([0], chunks)
            plan.load_blocks([1], chunks)
    assert calls == []
    assert torch.equal(kv[1][:, 2:4], kv[1][:, 0:2]) and torch.equal(kv[1][:, 7], kv[1][:, 6])


def test_a_cache_used_by_a_block_map_is_freed_when_dropped_without_the_cyclic_collector() -> None:
    """The group keeps its map side in its memo; the side must not keep the group (a
    cycle would hold a dropped cache, GPU memory included, until gc runs)."""
    kv = cache()
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    block_map(reg, reg, [0], [1]).copy()
    gone = weakref.ref(kv[0])
    enabled = gc.isenabled()
    gc.disable()
    try:
        del reg, kv
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_what_holds_live_addresses_is_not_pickled_or_deep_copied() -> None:
    kv = cache()
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    group = reg.kernel_groups[0]
    plan = prepare(group, group.format)
    m = block_map(reg, reg, [0], [1])
    shape, dtype = plan.chunk_shape(4)
    chunk = chunk_side(group, torch.zeros(shape, dtype=dtype))
    for obj in (reg, group, plan, m, m.src, chunk):  # a deep-copied side copied the cache it holds
        name = type(obj).__name__
        message = f"a {name} holds this process's tensor addresses and cannot be pickled or deep-copied"
        with pytest.raises(TypeError, match=message):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match=message):
            copy.deepcopy(obj)
        assert copy.copy(obj) is obj
    text = reg.describe().to_json()  # what another process reads instead
    assert kvlayout.transfer.RegistrationDescription.from_json(text).to_json() == text


def test_prepare_refuses_a_format_the_kernel_group_is_not_in() -> None:
    reg = kvlayout.detect(cache(), "vllm", {"kv_layout": "NHD"})
    group = reg.kernel_groups[0]
    with pytest.raises(
        TransferError,
        match=r"prepare\(group, NL_X_NB_TWO_BS_NH_HS\): the kernel group is NL_X_TWO_NB_BS_NH_HS",
    ):
        prepare(group, kvlayout.EngineKVFormat.NL_X_NB_TWO_BS_NH_HS)
    assert prepare(group, "NL_X_TWO_NB_BS_NH_HS") is prepare(group, group.format)


def test_a_block_map_of_a_hybrid_says_to_map_each_kernel_group() -> None:
    kv = [torch.zeros(2, 8, 4, 2, 16), torch.zeros(2, 8, 4, 2, 16, dtype=torch.float16)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    assert len(reg.kernel_groups) == 2
    with pytest.raises(
        BlockMapError, match=r"a block map moves one: map each of registration\.kernel_groups"
    ):
        block_map(reg, reg, [0], [1])
