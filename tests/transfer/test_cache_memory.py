"""The memory behind a cache and its chunks: a plan used after the engine re-allocated
its cache in place raises instead of copying through stale pointers, and tensors with no
memory (fake tensors, freed or shrunk storages, subclasses without storage) are refused
by detection and transfer alike; meta tensors stay readable by detection, not movable.

Calls that crashed the process (SIGSEGV) run in a subprocess, so on code without the
checks these tests fail instead of killing the run."""

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
from torch._subclasses.fake_tensor import FakeTensorMode

import kvlayout
from kvlayout import DetectionError
from kvlayout import EngineKVFormat as F
from kvlayout.registration.describing import describe_group
from kvlayout.transfer import BlockMapError, PeerDescriptionError, TransferError, block_map, prepare
from kvlayout.transfer.block_maps import chunk_side

HINTS = {"kv_layout": "NHD"}


# The start of a script that posts a hand-built map between two agents of one process: its
# imports, NIXL's logger quieted, and ``Map`` (runs and two sides: what ``transfer`` takes).
_MAP_SCRIPT_HEAD = """
    import gc, logging, re, numpy as np, torch
    from dataclasses import dataclass
    from kvlayout.transfer import TransferError
    from kvlayout.transfer import nixl as nx
    import nixl._api
    logging.getLogger("nixl").setLevel(logging.WARNING)

    @dataclass(frozen=True)
    class Map:
        runs: np.ndarray
        src: object
        dst: object
"""

# The end of a script that posts 8 rows of 1 KiB from ``kv`` (ones) to ``dst`` (zeros) through
# ``prefill`` to ``peer``, and prints whether exactly those bytes landed or the refusal.
_POST_EIGHT_ROWS = """
    there = nx.LocalSide("cpu", 0, nx.local_side(dst).tensor_spans, is_local=False)
    rows = [[kv.data_ptr() + 4096 * i, dst.data_ptr() + 1024 * i, 1024] for i in range(8)]
    request = Map(np.array(rows, np.uint64), nx.local_side(kv), there)
    try:
        nx.transfer(prefill, peer, request, strategy="direct").wait(timeout=30)
        print("posted", bool((dst[:8192] == 1).all()), bool((dst[8192:] == 0).all()))
    except TransferError as e:
        print(type(e).__name__, re.sub("0x[0-9a-f]+", "ADDR", str(e)))
"""


def isolated(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; its stdout lines (a crash fails the test)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout.splitlines()


def cache(n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, 8, 4, 2, 16) for _ in range(n)]


def fake_cache(n: int = 2) -> list[torch.Tensor]:
    with FakeTensorMode():
        return [torch.zeros(2, 8, 4, 2, 16) for _ in range(n)]


# -- a plan after the engine re-allocated its cache in place --------------------------------------


REALLOCATIONS = {
    "storage resized to 0": "t.untyped_storage().resize_(0)",
    "t.data = new": "t.data = torch.randn(2, 8, 4, 2, 16)",
    "t.set_(other)": "t.set_(torch.randn(2, 8, 4, 2, 16))",
    "t.resize_(bigger)": "t.resize_(2, 80, 4, 2, 16)",
    "storage resized": "t.untyped_storage().resize_(t.untyped_storage().nbytes() * 2)",
}


def test_a_plan_used_after_the_cache_was_reallocated_raises_instead_of_crashing() -> None:
    """Each way an engine re-allocates a tensor in place, after prepare: every call
    raises (the process used to die with SIGSEGV copying through the old pointers)."""
    code = """
        import gc, torch, kvlayout
        from kvlayout.transfer import TransferError, prepare
        for label, change in REALLOCATIONS.items():
            kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(2)]
            fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
            plan = prepare(reg, fmt)
            chunk = torch.zeros(plan.chunk_shape(4 * 8)[0])
            plan.store_blocks(list(range(8)), [chunk])
            t = kv[1]
            exec(change)
            gc.collect()
            for move in (plan.load_blocks, plan.store_blocks):
                try:
                    move(list(range(8)), [chunk])
                    print(label, "| moved")
                except TransferError as e:
                    print(label, "|", e)
    """
    lines = isolated(f"REALLOCATIONS = {REALLOCATIONS!r}\n" + textwrap.dedent(code))
    assert len(lines) == 2 * len(REALLOCATIONS), lines
    for line in lines:
        message = line.partition(" | ")[2]
        assert re.search(r"^(the storage of )?kv_caches\[1\]('s storage)? was re-allocated", message), line
        assert message.endswith("detect the registration again and prepare a new plan"), line


def test_a_storage_swapped_at_the_same_address_is_caught_by_its_size() -> None:
    """The data pointer alone misses a storage re-made at the same address: the check
    reads the storage's address and size too."""
    memory = np.zeros(2 * 2 * 8 * 4 * 2 * 16, dtype=np.float32)
    kv = [torch.from_numpy(memory[i * 2048 : (i + 1) * 2048]).view(2, 8, 4, 2, 16) for i in range(2)]
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    plan = prepare(reg, fmt)
    chunk = torch.zeros(plan.chunk_shape(4)[0])
    plan.store_blocks([3], [chunk])
    smaller = torch.from_numpy(memory[2048 : 2048 + 16]).untyped_storage()  # kv[1]'s first 64 bytes
    kv[1].set_(smaller, 0, (16,), (1,))
    assert kv[1].data_ptr() == plan.jobs[0].plane.data_ptrs[1]  # same address, a 64-byte storage now
    with pytest.raises(TransferError) as info:
        plan.store_blocks([3], [chunk])
    assert "kv_caches[1]" in str(info.value) and "64 bytes at" in str(info.value)
    assert "detect the registration again" in str(info.value)


def test_a_cache_reallocated_between_detection_and_prepare_is_refused() -> None:
    kv = cache()
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    kv[0].data = torch.randn(2, 8, 4, 2, 16)
    with pytest.raises(TransferError, match=r"kv_caches\[0\] was re-allocated after detection .*detect the"):
        prepare(reg, fmt)


def test_a_cache_that_did_not_move_passes_the_check_on_every_call() -> None:
    kv = cache(3)
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    plan = prepare(reg, fmt)
    chunk = torch.zeros(plan.chunk_shape(8)[0])
    for ids in ([0, 1], [5, 7], [2, 3]):
        plan.store_blocks(ids, [chunk])
        plan.load_blocks(ids, [chunk])
    kv[2].mul_(2)  # writes in place change no address
    plan.store_blocks([4, 6], [chunk])
    assert torch.equal(chunk[0, 2, :4], kv[2][0, 4].reshape(4, 32))


# -- tensors with no memory -------------------------------------------------------------------------


def test_detection_refuses_a_fake_tensor_cache_naming_the_layer() -> None:
    with pytest.raises(DetectionError, match=re.escape("kv_caches[0] is a FakeTensor")):
        kvlayout.normalize_kv_and_discover_format(fake_cache(), "vllm", HINTS)


def test_layers_with_no_memory_are_refused_not_called_overlapping() -> None:
    """Two freed layers used to read "overlap in memory (bytes 0x0-...)"."""
    kv = cache()
    for t in kv:
        t.untyped_storage().resize_(0)
    with pytest.raises(DetectionError) as info:
        kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    assert str(info.value) == (
        "kv_caches[0] has no memory: its storage holds 0 bytes (freed, or resized to 0); "
        "a KV cache tensor needs its memory"
    )


def test_a_view_past_its_shrunk_storage_is_refused() -> None:
    """A view into a pool whose storage was resized: its data pointer is not 0, but its
    storage no longer holds the bytes it views."""
    pool = torch.zeros(3 * 2048)
    kv = [pool[i * 2048 : (i + 1) * 2048].view(2, 8, 4, 2, 16) for i in range(3)]
    pool.untyped_storage().resize_(2 * 8192 + 16)  # kv[1] still fits, kv[2] does not
    with pytest.raises(DetectionError) as info:
        kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    message = str(info.value)
    assert message.startswith("kv_caches[2] views 8192 bytes from 0x") and "holds 16400 bytes at" in message


def test_a_permuted_view_without_memory_is_an_error_of_the_family() -> None:
    """vLLM's HND cache (a permuted view) with its storage freed: re-viewing it in memory
    order raised torch's RuntimeError ("setStorage: ... out of bounds")."""
    kv = [torch.zeros(2, 8, 2, 4, 16).transpose(2, 3) for _ in range(2)]
    kv[1].untyped_storage().resize_(0)
    with pytest.raises(kvlayout.KVLayoutError) as info:
        kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND"})
    assert str(info.value) == (
        "kv_caches[1]: has no memory: its storage holds 0 bytes (freed, or resized to 0); "
        "a KV cache tensor needs its memory"
    )


def test_a_tensor_subclass_without_storage_is_refused() -> None:
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem: torch.Tensor) -> Wrapper:
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch types it as its disabled default
            raise NotImplementedError(f"{func}: no data")

    kv = [Wrapper(t) for t in cache()]
    with pytest.raises(DetectionError, match=re.escape("kv_caches[0] has no memory")):
        kvlayout.detect(kv, "vllm", HINTS)


def test_a_plain_list_bound_for_a_transfer_is_refused_too() -> None:
    kv = cache()
    kv[1].untyped_storage().resize_(0)
    with pytest.raises(TransferError, match=re.escape("kv[1] has no memory")):
        prepare(kv, F.NL_X_TWO_NB_BS_NH_HS)


def test_meta_caches_are_detected_but_never_prepared() -> None:
    kv = [torch.empty(2, 8, 4, 2, 16, device="meta") for _ in range(2)]
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
    assert (fmt, kvlayout.get_num_blocks(reg, fmt)) == (F.NL_X_TWO_NB_BS_NH_HS, 8)
    with pytest.raises(TransferError, match="the cache is meta tensors, which have no memory by design"):
        prepare(reg, fmt)


BAD_CHUNKS = {
    "fake": ("from torch._subclasses.fake_tensor import FakeTensorMode\n"
             "with FakeTensorMode():\n    bad = torch.zeros(shape)", "chunks[0] is a FakeTensor"),
    "freed": ("bad = torch.zeros(shape)\nbad.untyped_storage().resize_(0)",
              "chunks[0] has no memory: its storage holds 0 bytes"),
    "shrunk": ("pool = torch.zeros(2 * numel)\nbad = pool[numel:].view(shape)\n"
               "pool.untyped_storage().resize_(numel * 4)", "chunks[0] views"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BAD_CHUNKS))
def test_chunks_with_no_memory_are_refused_before_a_byte_moves(kind: str) -> None:
    make, message = BAD_CHUNKS[kind]
    code = f"""
import torch, kvlayout
from kvlayout.transfer import TransferError, prepare
kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(2)]
fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {{"kv_layout": "NHD"}})
plan = prepare(reg, fmt)
shape = plan.chunk_shape(8)[0]
numel = torch.Size(shape).numel()
{make}
before = [t.clone() for t in kv]
for move in (plan.store_blocks, plan.load_blocks):
    try:
        move([1, 2], [bad])
        print("moved")
    except TransferError as e:
        print(e)
print(all(torch.equal(a, b) for a, b in zip(before, kv)))
"""
    *errors, unchanged = isolated(code)
    assert len(errors) == 2 and all(e.startswith(message) for e in errors), errors
    assert unchanged == "True"


# -- block maps and NIXL requests after the engine re-allocated its cache ----------------------


# What the block-map reallocation scripts share: two caches built alike, each its tensors
# and its registration.
_TWO_CACHES = textwrap.dedent("""
    import gc, torch, kvlayout
    from kvlayout.transfer import BlockMapError, block_map
    def cache():  # 1 MiB layers: freed memory is unmapped, so a stale copy crashes
        kv = [torch.randn(2, 64, 16, 2, 64) for _ in range(2)]
        return kv, kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
""")


def test_a_block_map_copied_after_either_cache_was_reallocated_raises_instead_of_crashing() -> None:
    """Each way an engine re-allocates a tensor in place, on either side, after the map was
    built; and a chunk side's chunk freed: copy() raises and copies nothing (it used to
    copy through the old addresses: SIGSEGV on memory the allocator had returned)."""
    code = """
        from kvlayout.transfer.block_maps import chunk_side
        for side in ("src", "dst"):
            for label, change in REALLOCATIONS.items():
                (src_kv, src), (dst_kv, dst) = cache(), cache()
                m = block_map(src, dst, [3, 9, 4], [7, 0, 60])
                t = (src_kv if side == "src" else dst_kv)[1]
                exec(change)
                gc.collect()
                try:
                    m.copy()
                    print(side, label, "| copied")
                except BlockMapError as e:
                    print(side, label, "|", e)
        kv, reg = cache()
        chunk = torch.zeros(2, 2, 64, 128)
        m = block_map(reg, chunk_side(reg, chunk), list(range(4)), [0])
        chunk.untyped_storage().resize_(0)
        try:
            m.copy()
            print("chunk | copied")
        except BlockMapError as e:
            print("chunk |", e)
    """
    changes = {**REALLOCATIONS, "t.resize_(bigger)": "t.resize_(2, 80, 16, 2, 64)"}  # these layers' bigger
    lines = isolated(f"REALLOCATIONS = {changes!r}\n" + _TWO_CACHES + textwrap.dedent(code))
    assert len(lines) == 2 * len(REALLOCATIONS) + 1, lines
    for line in lines[:-1]:
        side, message = line.split(" ")[0], line.partition(" | ")[2]
        assert re.search(rf"^{side}: (the storage of )?kv_caches\[1\] was re-allocated", message), line
        assert "since the map's addresses were read" in message, line
        assert message.endswith("detect the registration again and build a new map; nothing was copied"), line
    assert lines[-1].startswith("chunk | dst: the chunk was re-allocated (data pointer 0x0"), lines[-1]
    assert lines[-1].endswith("make its chunk_side() and the map again; nothing was copied"), lines[-1]


def test_a_block_map_copied_before_the_cache_was_reallocated_refuses_the_next_copy() -> None:
    """The first copy() keeps what later calls check (both sides' pointers and storages,
    the runs validated once): each way an engine re-allocates or shrinks a tensor after it
    (``t.resize_(0)`` and a storage of another size at the same address too) is refused as
    before it, naming the tensor, and copies nothing (a stale copy crashes here)."""
    code = """
        for side in ("src", "dst"):
            for label, change in REALLOCATIONS.items():
                (src_kv, src), (dst_kv, dst) = cache(), cache()
                m = block_map(src, dst, [3, 9, 4], [7, 0, 60])
                m.copy()
                t = (src_kv if side == "src" else dst_kv)[1]
                exec(change)
                gc.collect()
                before = [x.clone() for x in dst_kv if x is not t]  # t may have no memory now
                for _ in range(2):  # and again: a refusal keeps nothing that lets the next one pass
                    try:
                        m.copy()
                        print(side, label, "| copied")
                    except BlockMapError as e:
                        print(side, label, "|", e)
                after = [x for x in dst_kv if x is not t]
                print(side, label, "| unchanged" if all(map(torch.equal, before, after)) else "| written")
    """
    changes = {
        **REALLOCATIONS,
        "t.resize_(bigger)": "t.resize_(2, 80, 16, 2, 64)",  # these layers' bigger
        "t.resize_(0)": "t.resize_(0)",  # its data pointer is 0 now: no elements
    }
    lines = isolated(f"REALLOCATIONS = {changes!r}\n" + _TWO_CACHES + textwrap.dedent(code))
    assert len(lines) == 2 * 3 * len(changes), lines
    for line in lines:
        side, message = line.split(" ")[0], line.partition(" | ")[2]
        if message in ("unchanged", "written"):
            assert message == "unchanged", line
            continue
        assert re.search(rf"^{side}: (the storage of )?kv_caches\[1\] was re-allocated", message), line
        assert message.endswith("detect the registration again and build a new map; nothing was copied"), line


def test_a_storage_swapped_at_the_same_address_after_a_copy_is_caught_by_its_size() -> None:
    memory = np.zeros(2 * 2 * 8 * 4 * 2 * 16, dtype=np.float32)
    kv = [torch.from_numpy(memory[i * 2048 : (i + 1) * 2048]).view(2, 8, 4, 2, 16) for i in range(2)]
    reg = kvlayout.detect(kv, "vllm", HINTS)
    dst_kv = cache()
    m = block_map(reg, kvlayout.detect(dst_kv, "vllm", HINTS), [3], [5])
    m.copy()
    smaller = torch.from_numpy(memory[2048 : 2048 + 16]).untyped_storage()  # kv[1]'s first 64 bytes
    kv[1].set_(smaller, 0, (16,), (1,))
    assert kv[1].data_ptr() == reg.only_group().planes[0].data_ptrs[1]  # same address, a 64-byte storage now
    with pytest.raises(BlockMapError, match=r"^src: the storage of kv_caches\[1\] .*\(64 bytes at"):
        m.copy()


def test_what_the_first_copy_keeps_watches_each_tensor_and_storage_once() -> None:
    """A map within one cache watches its tensors once, not once a side; a tensor whose
    class became a subclass since takes the checks with subclasses' hooks disabled."""
    from kvlayout.transfer.memory_watch import MemoryWatch

    kv = cache(3)
    reg = kvlayout.detect(kv, "vllm", HINTS)
    m = block_map(reg, reg, [0, 1], [4, 5])
    m.copy()
    placement = m.src._placement
    assert placement is m.dst._placement and placement is not None
    watch = MemoryWatch([placement, placement])
    assert len(watch._tensors) == 3 and len(watch._owners) == 3 and len(watch._expected) == 9
    assert watch.unmoved()
    kv[2].mul_(2)  # writes in place change no address
    assert watch.unmoved()
    kv[2].__class__ = torch.nn.Parameter  # no method of it is called to answer
    assert not watch.unmoved()
    m.copy()  # the slow way: the checks pass
    assert torch.equal(kv[2][:, 4:6], kv[2][:, 0:2])
    kv[2].__class__ = torch.Tensor
    kv[0].untyped_storage().resize_(0)
    assert not watch.unmoved()
    with pytest.raises(BlockMapError, match=r"^src: kv_caches\[0\] was re-allocated .* nothing was copied$"):
        m.copy()


def test_a_watch_answers_false_under_a_torch_function_mode_and_never_calls_its_hook() -> None:
    """The watch's one native pass asks whether a TorchFunctionMode is on before it reads
    any tensor: under one it answers False (copy() then checks with the mode off), and the
    mode's hook, which could free what was just checked, never runs."""
    from torch.overrides import TorchFunctionMode

    from kvlayout.transfer.memory_watch import MemoryWatch

    calls: list[str] = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    kv = cache(2)
    reg = kvlayout.detect(kv, "vllm", HINTS)
    m = block_map(reg, reg, [0, 1], [4, 5])
    m.copy()
    placement = m.src._placement
    assert placement is not None
    watch = MemoryWatch([placement])
    assert watch.unmoved()
    with Mode():
        assert not watch.unmoved()
        assert m._fast.copy_watched(1) == -2  # copy()'s one step leaves it to the full checks
        assert m.copy() == 1
    assert calls == []
    assert watch.unmoved() and torch.equal(kv[1][:, 4:6], kv[1][:, 0:2])


def test_a_native_watch_refuses_expected_values_that_do_not_fit_its_tensors() -> None:
    """The native comparison reads one data pointer per tensor, then a start and a size per
    storage: a list of another length is a clear error, not a read past its end."""
    from kvlayout import _native
    from kvlayout.registration.backing import _DATA_PTR, _STORAGE, _STORAGE_BYTES, _STORAGE_PTR
    from kvlayout.transfer.memory_watch import _FUNCTION_MODE_ON

    t = torch.zeros(4)
    accessors = (_FUNCTION_MODE_ON, _DATA_PTR, _STORAGE, _STORAGE_PTR, _STORAGE_BYTES)
    fits = [t.data_ptr(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()]
    assert _native.TensorWatch((t,), (t,), fits, torch.Tensor, *accessors).unmoved()
    with pytest.raises(ValueError, match="a data pointer per tensor, then a start per storage, then a size"):
        _native.TensorWatch((t,), (t,), fits[:2], torch.Tensor, *accessors)
    with pytest.raises(TypeError, match="plain must be a type"):
        _native.TensorWatch((t,), (t,), fits, "torch.Tensor", *accessors)


def test_a_block_map_of_a_cache_reallocated_after_detection_is_refused_when_built() -> None:
    kv, other = cache(), cache()
    reg, dst = (kvlayout.detect(c, "vllm", HINTS) for c in (kv, other))
    kv[0].data = torch.randn(2, 8, 4, 2, 16)
    with pytest.raises(
        BlockMapError, match=r"^src: kv_caches\[0\] was re-allocated after detection .*detect the"
    ):
        block_map(reg, dst, [1], [2])


def test_reallocating_a_tensor_detection_re_viewed_is_caught_too() -> None:
    """vLLM 0.33 hands each layer as a ``[B, H, N, C]`` permute of NHD memory; detection
    reads its own physically ordered view, which keeps the old memory alive after
    ``t.data = new``: the check watches the caller's tensor, not that view."""

    def layers() -> list[torch.Tensor]:
        return [torch.randn(8, 4, 2, 32).transpose(1, 2) for _ in range(2)]  # [B, H, N, C], NHD memory

    kv, other = layers(), layers()
    reg, dst = (kvlayout.detect(c, "vllm", HINTS) for c in (kv, other))
    assert reg.format is F.NL_X_NB_BS_NH_CS and reg.only_group().planes[0].leaves[0] is not kv[0]
    m = block_map(reg, dst, [1, 2], [3, 4])
    plan = prepare(dst.only_group(), dst.format)
    chunks = plan.chunks_for(2, 8)
    other[0].data = torch.zeros_like(other[0])  # the engine re-allocates layer 0 in place
    with pytest.raises(BlockMapError, match=r"^dst: kv_caches\[0\] was re-allocated"):
        m.copy()
    with pytest.raises(
        TransferError, match=r"^kv_caches\[0\] was re-allocated .*after this plan was prepared"
    ):
        plan.load_blocks([3, 4], chunks)
    assert not other[0].any()  # the tensor the engine now uses: nothing written, nothing lost
    with pytest.raises(BlockMapError, match=r"kv_caches\[0\] was re-allocated"):
        block_map(reg, dst, [1], [2]).copy()


def test_a_block_map_between_caches_that_did_not_move_copies_on_every_call() -> None:
    kv, other = cache(3), [torch.zeros(2, 8, 4, 2, 16) for _ in range(3)]
    reg, dst = (kvlayout.detect(c, "vllm", HINTS) for c in (kv, other))
    for ids in ([0, 1], [5, 7]):
        block_map(reg, dst, ids, ids).copy()
    kv[2].mul_(2)  # writes in place change no address
    block_map(reg, dst, [5], [6]).copy()
    assert torch.equal(other[2][:, 6], kv[2][:, 5])


@pytest.mark.parametrize("kind", list(BAD_CHUNKS))
def test_a_chunk_side_with_no_memory_is_refused(kind: str) -> None:
    make, message = BAD_CHUNKS[kind]
    reg = kvlayout.detect(cache(), "vllm", HINTS)
    shape = (2, 2, 8, 32)
    numel = torch.Size(shape).numel()
    scope: dict[str, Any] = {"torch": torch, "shape": shape, "numel": numel}
    exec(make, scope)
    with pytest.raises(BlockMapError, match="^" + re.escape(message.replace("chunks[0]", "the chunk"))):
        chunk_side(reg, scope["bad"])


def test_a_local_side_says_which_of_its_tensors_moved() -> None:
    """nx.local_side of a registration watches its tensors: a request through a side
    whose cache moved is refused by what moved() says (None while nothing did)."""
    from kvlayout.transfer import nixl as nx

    kv = cache(3)
    side = nx.local_side(kvlayout.detect(kv, "vllm", HINTS))
    assert side.moved() is None
    kv[1].data = torch.randn(2, 8, 4, 2, 16)
    moved = side.moved()
    assert moved is not None and moved.startswith("kv_caches[1] was re-allocated (data pointer 0x")
    there = nx.LocalSide("cpu", 0, side.tensor_spans, is_local=False)
    runs = np.array([[int(side.tensor_spans[0, 0]), int(side.tensor_spans[2, 0]), 64]], dtype=np.uint64)
    with pytest.raises(
        nx.NixlError, match=r"^the local side: kv_caches\[1\] was re-allocated \(data pointer 0x"
    ):
        nx.plan(SimpleNamespace(runs=runs, src=side, dst=there))._refuse_moved("nothing was posted")


def test_a_nixl_request_whose_local_cache_moved_is_refused_and_holds_nothing() -> None:
    """The NIXL layer's own copies and posts, after the local cache was re-allocated
    since its map was built: refused, nothing posted or copied, the staging buffer
    free again (the staged copies used to crash on the freed memory, and a direct
    request to read it). One process, its agent posting to itself."""
    code = """
        import torch, kvlayout
        from kvlayout.transfer import RegistrationDescription, block_map
        from kvlayout.transfer import nixl as nx
        NAME = "kvl-moved"
        agent = nx.make_agent(NAME, progress_thread=False)
        def cache(fill):  # 4 MiB layers: freed memory is unmapped
            kv = [torch.full((2, 64, 16, 8, 128), fill, dtype=torch.bfloat16) for _ in range(2)]
            return kv, kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
        def described(reg):
            return RegistrationDescription.from_json(reg.describe().to_json())
        def free(kv):
            kv[1].untyped_storage().resize_(0)
        ids = list(range(16))
        for case in ("transfer", "start", "copy", "peer copy", "descriptors"):
            (src_kv, src), (dst_kv, dst) = cache(1.0), cache(0.0)
            write = block_map(src, described(dst), ids, ids)  # posted where src is
            read = block_map(described(src), dst, ids, ids)  # posted where dst is
            with nx.register(agent, src), nx.register(agent, dst), nx.Staging(agent, 1 << 23) as here:
                try:
                    if case == "transfer":
                        free(src_kv)
                        nx.transfer(agent, NAME, write, strategy="direct").wait(10)
                    elif case == "start":
                        xfer = nx.prepare_transfer(agent, NAME, write, strategy="staged", staging=here)
                        free(src_kv)
                        xfer.start()
                        xfer.wait(10)
                    elif case == "copy":
                        plan = nx.plan(read, strategy="staged", staging=here)
                        free(dst_kv)
                        plan.copy()
                    elif case == "peer copy":
                        copy = nx.prepare_unstage(read, here)
                        free(dst_kv)
                        copy.run()
                    else:
                        free(dst_kv)
                        nx.descriptors(read)
                    print(case, "| moved")
                except nx.NixlError as e:
                    print(case, "|", e, "| busy" if here.busy else "| free")
    """
    lines = [line for line in isolated(textwrap.dedent(code)) if " | " in line]
    assert [line.partition(" | ")[0] for line in lines] == [
        "transfer",
        "start",
        "copy",
        "peer copy",
        "descriptors",
    ]
    for line in lines:
        case, message, staging = line.split(" | ")
        assert message.startswith("the local side: kv_caches[1] was re-allocated (data pointer 0x0, was"), (
            line
        )
        nothing = "copied" if case in ("copy", "peer copy") else "posted"
        assert message.endswith(f"build a new map; nothing was {nothing}"), line
        assert staging == "free", line


def test_a_local_side_says_what_moved_since_it_read_the_addresses() -> None:
    from kvlayout.transfer import nixl as nx

    kv = cache(3)
    reg = kvlayout.detect(kv, "vllm", HINTS)
    of_registration, of_tensors = nx.local_side(reg), nx.local_side(list(kv))
    assert of_registration.moved() is None and of_tensors.moved() is None
    kv[2].data = torch.randn(2, 8, 4, 2, 16)
    assert re.match(
        r"kv_caches\[2\] was re-allocated \(data pointer 0x[0-9a-f]+, was", of_registration.moved() or ""
    )
    assert re.match(r"tensor 2 was re-allocated", of_tensors.moved() or "")
    with pytest.raises(TransferError, match=r"^kv_caches\[2\] was re-allocated after detection .*detect the"):
        nx.local_side(reg)


def test_a_registration_whose_cache_moved_is_not_described_to_a_peer() -> None:
    """The peer would write into memory this process no longer holds."""
    kv = cache()
    reg = kvlayout.detect(kv, "vllm", HINTS)
    reg.describe()
    kv[1].untyped_storage().resize_(0)
    with pytest.raises(
        PeerDescriptionError,
        match=r"^kv_caches\[1\] was re-allocated after detection .*; detect the registration again",
    ):
        reg.describe()
    with pytest.raises(PeerDescriptionError, match=r"^kv_caches\[1\] was re-allocated after detection"):
        describe_group(reg.kernel_groups[0])


def test_a_registration_whose_cache_moved_is_not_registered_with_nixl() -> None:
    """Its maps and descriptions use the addresses detection read: registering the new
    memory instead would leave them pointing at memory no agent holds."""
    from kvlayout.transfer import nixl as nx

    class Agent:  # stands for nixl_agent: nothing may reach it
        name = "never-called"

        def register_memory(self, *args: Any) -> None:
            raise AssertionError("registered memory of a moved cache")

    kv = cache()
    reg = kvlayout.detect(kv, "vllm", HINTS)
    kv[0].data = torch.randn(2, 8, 4, 2, 16)
    with pytest.raises(TransferError, match=r"^kv_caches\[0\] was re-allocated after detection .*detect the"):
        nx.register(Agent(), reg)


def test_a_prepared_nixl_request_whose_memory_was_deregistered_since_is_refused_not_posted() -> None:
    """NIXL posts a prepared request through the regions it was made with: deregistered
    since, the local one was posted anyway, and an agent posting to itself crashed
    (SIGSEGV) on the destination's. Each is refused at start(), nothing posted."""
    code = """
    import logging, torch, kvlayout
    from kvlayout.transfer import RegistrationDescription, block_map
    from kvlayout.transfer import nixl as nx
    import nixl._api
    logging.getLogger("nixl").setLevel(logging.WARNING)
    for side in ("source", "destination"):
        src = [torch.ones(2, 64, 16, 8, 64) for _ in range(2)]  # layers of 4 MiB
        dst = [torch.zeros(2, 64, 16, 8, 64) for _ in range(2)]
        a, b = (kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}) for kv in (src, dst))
        m = block_map(a, RegistrationDescription.from_json(b.describe().to_json()), [1, 2], [3, 4])
        agent = nx.make_agent(f"kvl-self-{side}", progress_thread=False)
        held = {"source": nx.register(agent, a), "destination": nx.register(agent, b)}
        ahead = nx.prepare_transfer(agent, f"kvl-self-{side}", m)
        held[side].deregister()
        try:
            ahead.start()
        except nx.RefusedDescriptorError as e:
            print(type(e).__name__, str(e).split(": ")[-1], bool(dst[0].any()))
    """
    lines = isolated(code)
    assert lines == [
        "RefusedDescriptorError nothing was posted False",
        "RefusedDescriptorError nothing was posted False",
    ]


def test_an_agent_posting_to_itself_refuses_its_own_memory_deregistered_or_resized_as_a_peer_s() -> None:
    """Posting to itself, the remote rows are this process's memory, which no map side
    watches (they come from a description). Prepped lists made before the destination was
    deregistered were posted through NIXL's stale handles (SIGSEGV, 3 in 3 runs); a
    destination whose registered storage was resized in place was written through the
    freed memory (the list form: no error; prepped lists: SIGSEGV). The first is refused
    when the request is made, the second at start(), nothing posted."""
    code = """
    import logging, re, torch, kvlayout
    from kvlayout.transfer import RegistrationDescription, block_map
    from kvlayout.transfer import nixl as nx
    import nixl._api
    logging.getLogger("nixl").setLevel(logging.WARNING)
    for case in ("deregistered", "resized, lists", "resized, prepped"):
        src = [torch.ones(2, 64, 4, 2, 64) for _ in range(2)]
        dst = [torch.zeros(2, 64, 4, 2, 64) for _ in range(2)]
        a, b = (kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}) for kv in (src, dst))
        m = block_map(a, RegistrationDescription.from_json(b.describe().to_json()), [1, 2], [3, 4])
        name = "kvl-self-" + case.replace(", ", "-")
        agent = nx.make_agent(name, progress_thread=False)
        held = nx.register(agent, a), nx.register(agent, b)
        lists = nx.prep_lists(agent, name, m.src, m.dst, 128)
        try:
            if case == "deregistered":
                held[1].deregister()
                nx.transfer(agent, name, m, prepped=lists)
            else:
                ahead = nx.prepare_transfer(agent, name, m, prepped=lists if "prepped" in case else None)
                dst[1].untyped_storage().resize_(0)
                ahead.start()
        except kvlayout.transfer.TransferError as e:
            print(case, type(e).__name__, re.sub("0x[0-9a-f]+", "ADDR", str(e)))
        print(case, "landed" if dst[0].any() else "nothing landed")
    """
    resized = (
        "TransferError the remote descriptors reach the 262144 bytes at ADDR registered on agent "
        "'kvl-self-resized-{}', whose storage was resized in place since (it now holds 0 bytes at ADDR): NIXL "
        "would move bytes through freed memory; nothing was posted (never resize a registered cache)"
    )
    assert isolated(code) == [
        "deregistered RefusedDescriptorError remote descriptor 0 (ADDR, 4096 bytes) is outside every region "
        "registered on agent 'kvl-self-deregistered' (2 DRAM regions on device 0): register the registration "
        "(and staging) first",
        "deregistered nothing landed",
        "resized, lists " + resized.format("lists"),
        "resized, lists nothing landed",
        "resized, prepped " + resized.format("prepped"),
        "resized, prepped nothing landed",
    ]


def test_a_peer_agent_of_this_process_whose_memory_was_freed_is_refused_not_written() -> None:
    """Two agents of one process (a test harness, an engine with several workers in one
    process): the remote rows are this process's memory, which no map side watches, and
    the metadata loaded at the handshake still names what the peer deregistered or
    resized. NIXL wrote through the freed memory (SIGSEGV, every run); now refused, nothing
    posted, as for an agent posting to itself."""
    code = (
        _MAP_SCRIPT_HEAD
        + """
    for case in ("resized", "deregistered, freed", "deregistered after prepare"):
        name = "kvl-peer-" + case.replace(", ", "-").replace(" ", "-")
        prefill, decode = nx.make_agent(name + "-p", progress_thread=False), nx.make_agent(name)
        kv = torch.ones(32768, dtype=torch.uint8)
        dst = torch.zeros(32768, dtype=torch.uint8)
        ours, theirs = nx.register(prefill, kv), nx.register(decode, dst)
        peer = prefill.add_remote_agent(decode.get_agent_metadata())
        there = nx.LocalSide("cpu", 0, nx.local_side(dst).tensor_spans, is_local=False)
        rows = [[kv.data_ptr() + 4096 * i, dst.data_ptr() + 1024 * i, 1024] for i in range(8)]
        request = Map(np.array(rows, np.uint64), nx.local_side(kv), there)
        try:
            if case == "resized":
                dst.untyped_storage().resize_(0)
                nx.transfer(prefill, peer, request, strategy="direct").wait(timeout=30)
            elif case == "deregistered, freed":
                theirs.deregister()
                dst.untyped_storage().resize_(0)
                nx.transfer(prefill, peer, request, strategy="direct").wait(timeout=30)
            else:
                ahead = nx.prepare_transfer(prefill, peer, request, strategy="direct")
                theirs.deregister()
                dst.untyped_storage().resize_(0)
                ahead.start()
            print(case, "| posted")
        except TransferError as e:
            print(case, "|", type(e).__name__, re.sub("0x[0-9a-f]+", "ADDR", str(e)))
        gc.collect()
    """
    )
    lines = isolated(code)
    assert lines == [
        "resized | TransferError the remote descriptors reach the 32768 bytes at ADDR registered on agent "
        "'kvl-peer-resized', whose storage was resized in place since (it now holds 0 bytes at ADDR): NIXL "
        "would move bytes through freed memory; nothing was posted (never resize a registered cache)",
        "deregistered, freed | RefusedDescriptorError remote descriptor 0 (ADDR, 1024 bytes) is outside every "
        "region registered on agent 'kvl-peer-deregistered-freed' (0 DRAM regions on device 0): register the "
        "registration (and staging) first",
        "deregistered after prepare | RefusedDescriptorError remote descriptor 0 (ADDR, 1024 bytes) is outside "
        "every region registered on agent 'kvl-peer-deregistered-after-prepare' (0 DRAM regions on device 0): "
        "register the registration (and staging) first; peer 'kvl-peer-deregistered-after-prepare' (an agent "
        "of this process) deregistered it after the request was prepared: nothing was posted",
    ], lines


def test_an_agent_of_this_process_merely_named_like_the_peer_is_not_taken_for_it() -> None:
    """The peer is found among this process's agents by its name: an agent here that shares
    the name (a loopback agent, an example's "decode") while the real peer is another (in
    practice another process; here a second agent of that name, its cache registered by
    NIXL directly) had its regions taken for the peer's and the request refused, though
    NIXL accepted the rows and the peer's memory is in place. An agent that never
    deregistered a region never held the rows: the request posts and the bytes land."""
    code = (
        _MAP_SCRIPT_HEAD
        + """
    bystander = nx.make_agent("kvl-named-decode", progress_thread=False)
    keep = nx.register(bystander, torch.zeros(4096, dtype=torch.uint8))
    prefill = nx.make_agent("kvl-named-prefill", progress_thread=False)
    decode = nx.make_agent("kvl-named-decode")
    kv, dst = torch.ones(32768, dtype=torch.uint8), torch.zeros(32768, dtype=torch.uint8)
    ours = nx.register(prefill, kv)
    decode.register_memory(decode.get_reg_descs(dst))
    peer = prefill.add_remote_agent(decode.get_agent_metadata())
    """
    )
    assert isolated(code + _POST_EIGHT_ROWS) == ["posted True True"]


def test_a_peer_made_again_under_its_name_in_this_process_is_the_one_holding_the_rows() -> None:
    """A decode agent shut down (its cache deregistered) and made again under its name in
    this process, the old agent not yet collected: the peer was the first agent of that
    name found, the old one, and the request to the new one was refused as stale ("outside
    every region registered on agent ...: register the registration first"). The agent
    whose registered memory holds the rows is the peer: the request posts, the bytes land."""
    code = (
        _MAP_SCRIPT_HEAD
        + """
    old = nx.make_agent("kvl-again-decode")
    nx.register(old, torch.zeros(32768, dtype=torch.uint8)).deregister()  # shut down, still referenced
    prefill = nx.make_agent("kvl-again-prefill", progress_thread=False)
    decode = nx.make_agent("kvl-again-decode")  # made again under its name
    kv, dst = torch.ones(32768, dtype=torch.uint8), torch.zeros(32768, dtype=torch.uint8)
    ours, theirs = nx.register(prefill, kv), nx.register(decode, dst)
    peer = prefill.add_remote_agent(decode.get_agent_metadata())
    """
    )
    assert isolated(code + _POST_EIGHT_ROWS) == ["posted True True"]
