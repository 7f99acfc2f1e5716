"""Fuzzing: random structures, every dtype, odd shapes and strides, foreign values,
tensors without memory (fake, freed or shrunk storages), bad block ids, chunks, threads
and hints, caches re-allocated after a plan was prepared, duck-typed vLLM configs, and
registrations whose layers share memory (exactly: one KV cache shared by layers; or
partly: refused),
thrown at detection, the facade, transfer and the vLLM integration. Only the
``KVLayoutError`` family (or ``TypeError``) may escape; a call that raises changes no
byte of the cache or of a chunk; a call that succeeds moves the right bytes. Calls that
start threads, or that crashed the process before (memory-less chunks, re-allocated
caches), run in a subprocess too, so a crash fails a test instead of killing the run."""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import kvlayout
from kvlayout import EngineKVFormat, KVLayoutError, layout_of
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, validate_kv_cache_groups
from kvlayout.testing.registrations import RegistrationCase, flatten, registrations
from kvlayout.transfer import load_blocks, prepare, store_blocks

DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
)  # fmt: skip
ALLOWED = (KVLayoutError, TypeError)
FUZZ = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype and rank 0-6, sizes 0-4, strided any way over one buffer
    (permuted, padded, overlapping, broadcast), sometimes sparse, on the meta device, a
    fake tensor, or without memory (its storage freed, or shrunk under an offset view)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=6)))
    kind = draw(
        st.sampled_from(
            ["contiguous", "strided", "strided", "permuted", "meta", "sparse", "fake", "freed", "shrunk"]
        )
    )
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "fake":
        with FakeTensorMode():
            return torch.zeros(shape, dtype=dtype)
    if kind in ("freed", "shrunk"):
        n = math.prod(shape)
        pool = torch.zeros(2 * n + 1, dtype=dtype)
        view = pool[n + 1 :].view(shape)  # an offset view: its data pointer stays non-zero
        pool.untyped_storage().resize_(0 if kind == "freed" else (n + 1) * dtype.itemsize)
        return view
    base = torch.zeros(shape, dtype=dtype)
    if kind == "sparse" and base.dim() and dtype.is_floating_point and dtype.itemsize > 1:
        return base.to_sparse()
    if kind == "permuted" and base.dim() > 1:
        return base.permute(*draw(st.permutations(range(base.dim()))))
    if kind == "strided" and base.dim():
        strides = tuple(draw(st.lists(st.integers(0, 40), min_size=base.dim(), max_size=base.dim())))
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if base.numel() else 1
        return torch.zeros(span, dtype=dtype).as_strided(shape, strides)
    return base


def foreign() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.just({"layer": torch.zeros(2, 3)}),
        st.just(np.zeros((2, 3, 4))),
    )


def structures() -> st.SearchStrategy[Any]:
    leaf = st.one_of(tensors(), tensors(), tensors(), foreign())
    return st.recursive(
        leaf, lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids)), max_leaves=10
    )


HINT_VALUES = st.one_of(
    st.none(),
    st.integers(-2, 20),
    st.booleans(),
    st.sampled_from(
        ["NHD", "HND", "BLHNC", "BLNHC", "LBNHC", "LHBNC", "nhd", "k_v", "unified", "x", "NB_KV_NL_BS_NH_HS"]
    ),
)
HINTS = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(
            [
                "kv_layout",
                "kv_list_layout",
                "num_kv_heads",
                "tokens_per_block",
                "head_dim",
                "kv_pair_axis",
                "num_layers",
                "kv_dim",
                "page_size",
                "total_num_blocks",
                "layout_format",
                "bogus",
            ]
        ),
        HINT_VALUES,
        max_size=4,
    ),
)
ENGINES = st.sampled_from(["vllm", "sglang", "trtllm", "atom", "TRT-LLM", "max", 3, None])
FORMATS = st.one_of(
    st.sampled_from(list(EngineKVFormat)),
    st.integers(-1, 22),
    st.sampled_from(["NL_X_NB_BS_HS", "nope"]),
    st.none(),
)


def _quietly(call: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse tensors and deprecated formats warn
        return call()


@FUZZ
@given(
    structures(),
    ENGINES,
    HINTS,
    st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 6), max_size=4), max_size=3)),
)
def test_detection_raises_only_errors_of_the_family(kv: Any, engine: Any, hints: Any, groups: Any) -> None:
    for call in (
        lambda: kvlayout.normalize_kv_and_discover_format(kv, engine, hints),
        lambda: kvlayout.normalize_and_discover_per_layer_formats(kv, groups, engine, hints),
        lambda: kvlayout.detect(kv, engine, hints, layer_groups=groups),
        lambda: kvlayout.attempt_permute_to_contiguous_view(kv),
    ):
        with contextlib.suppress(*ALLOWED):
            _quietly(call)


@FUZZ
@given(
    structures(),
    FORMATS,
    st.one_of(st.integers(-2, 6), st.just(np.int64(1)), st.none()),
    st.lists(st.integers(-1, 5), max_size=4),
)
def test_the_facade_raises_only_errors_of_the_family(
    kv: Any, fmt: Any, layer: Any, layers: list[int]
) -> None:
    calls = [
        lambda: kvlayout.get_device(kv),
        lambda: kvlayout.get_num_layers(kv, fmt),
        lambda: kvlayout.get_num_blocks(kv, fmt, layer),
        lambda: kvlayout.get_block_size(kv, fmt, layer),
        lambda: kvlayout.get_head_size(kv, fmt, layer),
        lambda: kvlayout.get_dtype(kv, fmt, layer),
        lambda: kvlayout.get_group_data_ptrs(kv, fmt, layers),
        lambda: kvlayout.group_layers_by_identity(kv, [fmt] * len(layers), layers or None),
        lambda: kvlayout.make_page_buffer_shape_desc(kv, fmt, layer, 1, 2, 3, layer),
        lambda: kvlayout.resolve_block_stride_and_log_layout(kv, fmt, layer, 0),
        lambda: kvlayout.get_concrete_engine_kv_shape(kv, fmt),
        lambda: kvlayout.bind(kv, fmt),
    ]
    for call in calls:
        with contextlib.suppress(*ALLOWED):
            _quietly(call)


def _replace(node: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    if node is old:
        return new
    if isinstance(node, (list, tuple)):
        return type(node)(_replace(child, old, new) for child in node)
    return node


@settings(max_examples=80, deadline=None)
@given(registrations(), st.data(), st.sampled_from(["fake", "freed", "shrunk"]))
def test_a_registration_with_a_tensor_without_memory_is_refused(
    case: RegistrationCase, data: st.DataObject, kind: str
) -> None:
    """Any tensor of a real registration without memory behind its view (a fake tensor,
    its storage freed, or shrunk under it) is refused by detection, naming a tensor; never
    a torch ``RuntimeError`` from a re-view (those check the storage) or an acceptance."""
    leaf = data.draw(st.sampled_from(flatten(case.kv)))
    kv = case.kv
    if kind == "fake":
        with FakeTensorMode() as mode:
            kv = _replace(kv, leaf, mode.from_tensor(leaf))
        expected = "is a FakeTensor (torch._subclasses.fake_tensor)"
    else:
        storage = leaf.untyped_storage()
        end = leaf.data_ptr() - storage.data_ptr() + _view_bytes(leaf)
        storage.resize_(0 if kind == "freed" else end - 1)  # the view's last byte is gone
        expected = "has no memory" if kind == "freed" or end == 1 else "views "
    try:  # (a failure is reported as text: printing a tensor without memory would crash)
        _quietly(lambda: kvlayout.normalize_kv_and_discover_format(kv, case.engine, case.hints))
        message = "accepted"
    except KVLayoutError as e:
        message = str(e)
    except Exception as e:  # any other escape is the failure reported
        message = f"{type(e).__name__}: {e}"
    named = re.match(r"(kv_caches\S*|layers \[.*) ", message) is not None
    if not (named and expected in message):
        pytest.fail(f"{case!r}, {kind} tensor: {message}", pytrace=False)


def _view_bytes(t: torch.Tensor) -> int:
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


# -- transfer: bad calls change nothing, good calls move the right bytes ---------------------------


BAD_IDS = (
    [-1],
    [0.5],
    np.array([2**64 - 1], dtype=np.uint64),
    torch.zeros(2, 2, dtype=torch.int64),
    torch.empty(2, dtype=torch.int64, device="meta"),
    "01",
    [True, False],
)


@st.composite
def transfer_calls(draw: st.DrawFn) -> tuple[RegistrationCase, Any, list[torch.Tensor], Any, Any, int]:
    """A right call on a random registration, then (mostly) one thing made wrong."""
    case = draw(registrations())
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    block_size = 1 if case.nb is None else None
    plan = prepare(kv, fmt, block_size=block_size)
    ids: Any = draw(st.lists(st.integers(0, plan.num_blocks - 1), max_size=plan.num_blocks, unique=True))
    per_chunk = draw(st.integers(1, 3))
    shape, dtype = plan.chunk_shape(per_chunk * plan.block_size)
    chunks = [torch.randn(shape).to(dtype) for _ in range(-(-len(ids) // per_chunk))]
    skip: Any = draw(st.integers(0, len(ids)))
    threads: Any = draw(st.sampled_from([1, 2, 3, 1_000]))
    wrong = draw(st.sampled_from(["nothing", "ids", "out of range", "repeat", "dtype", "short", "transposed",
                                  "alias", "twice", "count", "skip", "threads"]))  # fmt: skip
    if wrong == "ids":
        ids = draw(st.sampled_from(BAD_IDS))
    elif wrong == "out of range":
        ids = [*ids, draw(st.sampled_from([-1, plan.num_blocks, 2**40]))]
    elif wrong == "repeat" and ids:
        ids = [*ids, ids[0]]
    elif wrong == "count":
        chunks = chunks[1:] if chunks else [torch.zeros(shape, dtype=dtype)] * 2
    elif wrong == "skip":
        skip = draw(st.sampled_from([-1, len(ids) + 1, True, 0.5]))
    elif wrong == "threads":
        threads = draw(st.sampled_from([0, -1, False, 2.0]))
    elif chunks:
        if wrong == "dtype":
            chunks[0] = chunks[0].to(torch.float64 if dtype != torch.float64 else torch.float32)
        elif wrong == "short":
            chunks[0] = chunks[0][:, :, :1]
        elif wrong == "transposed":
            chunks[0] = chunks[0].transpose(0, 1)
        elif wrong == "twice":
            chunks.append(chunks[0])
        elif wrong == "alias":  # a chunk over the cache's own first bytes
            leaf = flatten(kv)[0]
            storage = torch.empty(0, dtype=torch.uint8).set_(leaf.untyped_storage())
            nbytes = chunks[0].numel() * chunks[0].element_size()
            start = leaf.storage_offset() * leaf.element_size()
            if storage.numel() - start >= nbytes and start % dtype.itemsize == 0:
                chunks[0] = storage[start : start + nbytes].view(dtype).view(shape)
    return case, ids, chunks, skip, threads, 0 if block_size is None else 1


@FUZZ
@given(transfer_calls(), st.booleans())
def test_a_transfer_that_raises_writes_nothing(
    call: tuple[RegistrationCase, Any, list[torch.Tensor], Any, Any, int], load: bool
) -> None:
    case, ids, chunks, skip, threads, folded = call
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    for leaf in flatten(kv):
        leaf.view(torch.uint8).copy_(torch.randint(0, 256, leaf.view(torch.uint8).shape, dtype=torch.uint8))
    cache = [leaf.clone() for leaf in flatten(kv)]
    before = [c.clone() for c in chunks]
    move = load_blocks if load else store_blocks
    try:
        move(kv, fmt, ids, chunks, skip_prefix_n_blocks=skip, num_threads=threads, block_size=folded or None)
    except ALLOWED:
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(cache, flatten(kv), strict=True)
        )
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, chunks, strict=True)
        )


@settings(max_examples=60, deadline=None)
@given(registrations(), st.data())
def test_store_then_load_restores_the_blocks(case: RegistrationCase, data: st.DataObject) -> None:
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    plan = prepare(kv, fmt, block_size=1 if case.nb is None else None)
    for leaf in flatten(kv):
        leaf.view(torch.uint8).copy_(torch.randint(0, 256, leaf.view(torch.uint8).shape, dtype=torch.uint8))
    ids = data.draw(
        st.lists(st.integers(0, plan.num_blocks - 1), min_size=1, max_size=plan.num_blocks, unique=True)
    )
    shape, dtype = plan.chunk_shape(plan.block_size)
    chunks = [torch.zeros(shape, dtype=dtype) for _ in ids]
    plan.store_blocks(ids, chunks, num_threads=data.draw(st.integers(1, 4)))
    saved = [leaf.clone() for leaf in flatten(kv)]
    for leaf in flatten(kv):
        leaf.view(torch.uint8).zero_()
    plan.load_blocks(ids, chunks)
    again = [torch.zeros_like(c) for c in chunks]
    plan.store_blocks(ids, again)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(chunks, again, strict=True)
    )
    # blocks not moved stay zero, moved ones are back: every restored byte was saved
    for leaf, old in zip(flatten(kv), saved, strict=True):
        changed = leaf.view(torch.uint8) != 0
        assert torch.equal(leaf.view(torch.uint8)[changed], old.view(torch.uint8)[changed])


# -- layers sharing memory: exact aliases are one KV cache, anything else is refused ---------------


@st.composite
def aliased(draw: st.DrawFn) -> tuple[RegistrationCase, list[Any], int, int, int]:
    """A layer list with layer ``s`` registered as layer ``t``'s memory: exactly (the same
    entry, or a new view of exactly its bytes; ``shift`` 0) or partly (its view ``shift``
    elements further on)."""
    case = draw(registrations().filter(lambda c: isinstance(c.kv, list) and layout_of(c.fmt).is_layer_list))
    kv = list(case.kv)
    kv.append(kv[-1])  # one more layer, so there is always a pair
    t, s = sorted(draw(st.lists(st.integers(0, len(kv) - 1), min_size=2, max_size=2, unique=True)))
    shift = draw(st.sampled_from([0, 0, 1, 2, 3]))
    if shift == 0:
        again = draw(st.booleans())
        kv[s] = (
            kv[t] if again else _map(kv[t], lambda x: x.as_strided(x.shape, x.stride(), x.storage_offset()))
        )
    else:  # layer t moved to a buffer with room after it, layer s a few elements further on
        kv[t] = _map(kv[t], lambda x: _rehomed(x, shift))
        kv[s] = _map(kv[t], lambda x: x.as_strided(x.shape, x.stride(), shift))
    return case, kv, t, s, shift


def _map(entry: Any, fn: Any) -> Any:
    return fn(entry) if isinstance(entry, torch.Tensor) else type(entry)(fn(x) for x in entry)


def _span(x: torch.Tensor) -> int:
    """Elements from a tensor's first to past its last."""
    return 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) if x.numel() else 0


def _share_elements(a: Any, b: Any) -> bool:
    """Whether two entries (over the same buffers, one dtype each) address a common element."""

    def addressed(x: torch.Tensor) -> set[int]:
        index = torch.arange(int(x.storage_offset()) + _span(x)).as_strided(
            x.shape, x.stride(), x.storage_offset()
        )
        return set(index.flatten().tolist())

    return any(addressed(x) & addressed(y) for x, y in zip(flatten(a), flatten(b), strict=True))


def _rehomed(x: torch.Tensor, room: int) -> torch.Tensor:
    """``x``'s view (shape and strides) over a new buffer with ``room`` elements to spare."""
    return torch.zeros(_span(x) + room, dtype=x.dtype).as_strided(x.shape, x.stride(), 0)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(aliased(), st.data())
def test_layers_sharing_memory_are_one_kv_cache_or_refused(
    call: tuple[RegistrationCase, list[Any], int, int, int], data: st.DataObject
) -> None:
    case, kv, t, s, shift = call
    leaves = flatten(kv)
    try:
        reg = kvlayout.detect(kv, case.engine, case.hints)
    except ALLOWED:
        assert shift, "an exact alias is a shared KV cache, never refused"
        return
    if shift:  # a view shifted into its target's bytes is refused (unless it misses them)
        assert not _share_elements(kv[t], kv[s]), f"a partial overlap was accepted: {reg}"
        return
    assert any(t in shared and s in shared for shared in reg.shared_layers), reg
    group = reg.only_group()
    plan = prepare(group, group.format, block_size=1 if case.nb is None else None)
    for x in leaves:
        x.view(torch.uint8).copy_(torch.randint(0, 256, x.view(torch.uint8).shape, dtype=torch.uint8))
    ids = data.draw(
        st.lists(st.integers(0, plan.num_blocks - 1), min_size=1, max_size=plan.num_blocks, unique=True)
    )
    shape, dtype = plan.chunk_shape(plan.block_size)
    chunks = [torch.zeros(shape, dtype=dtype) for _ in ids]
    threads = data.draw(st.integers(1, 4))
    plan.store_blocks(ids, chunks, num_threads=threads)
    for c in chunks:  # every layer's slot filled, the sharer's with its target's bytes
        assert torch.equal(c[:, s].view(torch.uint8), c[:, t].view(torch.uint8))
    saved = [x.clone() for x in leaves]
    before = [c.clone() for c in chunks]
    with contextlib.suppress(*ALLOWED):  # a bad call (a repeated id) changes no byte
        plan.load_blocks([*ids, ids[0]], [*chunks, chunks[0]], num_threads=threads)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(saved, leaves, strict=True)
    )
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, chunks, strict=True)
    )
    for x in leaves:
        x.view(torch.uint8).zero_()
    plan.load_blocks(ids, chunks, num_threads=threads)  # store then load restores
    again = [torch.zeros_like(c) for c in chunks]
    plan.store_blocks(ids, again)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(chunks, again, strict=True)
    )


def test_threaded_fuzzing_never_aborts_the_process() -> None:
    """Random valid and invalid calls on up to 64 threads, in a subprocess."""
    code = textwrap.dedent(
        """
        import random, torch
        from kvlayout import KVLayoutError
        from kvlayout.transfer import prepare
        rng = random.Random(0)
        for step in range(300):
            nb = rng.randint(1, 9)
            kv = [torch.randn(2, nb, 2, 2, 8) for _ in range(rng.randint(1, 3))]
            plan = prepare(kv, 1)
            shape, dtype = plan.chunk_shape(2 * rng.randint(1, 3))
            ids = [rng.randint(-1, nb) for _ in range(rng.randint(0, 8))]
            chunks = [torch.zeros(shape, dtype=dtype) for _ in range(rng.randint(0, 4))]
            try:
                (plan.store_blocks if rng.random() < 0.5 else plan.load_blocks)(
                    ids, chunks, num_threads=rng.choice([1, 2, 64, 10_000]))
            except (KVLayoutError, TypeError):
                pass
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


MEMORY_FUZZ = """
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import kvlayout
from kvlayout import KVLayoutError
from kvlayout.testing.registrations import flatten, registrations
from kvlayout.transfer import TransferError, prepare

# How an engine re-allocates a tensor in place (the plan's own, or the caller's that
# detection re-viewed), and chunks without memory. "storage": the change moves the
# tensor's storage, which the plan's tensors may share; "tensor": it moves the tensor
# alone; None: the plan's memory stays intact (a call may succeed).
CACHE = {
    "storage freed": (lambda t: t.untyped_storage().resize_(0), "storage"),
    "storage regrown": (lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes() + 64), "storage"),
    "data swapped": (lambda t: setattr(t, "data", torch.zeros(t.shape, dtype=t.dtype)), "tensor"),
    "set_ elsewhere": (lambda t: t.set_(torch.zeros(t.numel() + 1, dtype=t.dtype).untyped_storage()), "tensor"),
    "resized bigger": (lambda t: t.resize_(t.numel() * 3 + 7), None),
    "resized smaller": (lambda t: t.resize_(1), None),
}


def chunk_without_memory(kind, shape, dtype):
    if kind == "fake":
        with FakeTensorMode():
            return torch.zeros(shape, dtype=dtype)
    n = torch.Size(shape).numel()
    pool = torch.zeros(2 * n, dtype=dtype)
    chunk = pool[n:].view(shape)
    pool.untyped_storage().resize_(0 if kind == "freed" else n * dtype.itemsize)
    return chunk


def readable(t):
    # a copy of the bytes a tensor views, or None where they are not all memory of its storage
    # (reading past a storage would crash the check itself)
    if type(t) is not torch.Tensor or t.numel() == 0 or t.data_ptr() == 0:
        return None
    storage = t.untyped_storage()
    end = t.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    if t.data_ptr() < storage.data_ptr() or end > storage.data_ptr() + storage.nbytes():
        return None
    return t.clone()


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(registrations(), st.data())
def fuzz(case, data):
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    block_size = 1 if case.nb is None else None
    plan = prepare(kv, fmt, block_size=block_size)
    ids = data.draw(st.lists(st.integers(0, plan.num_blocks - 1), min_size=1, max_size=plan.num_blocks, unique=True))
    shape, dtype = plan.chunk_shape(plan.block_size)
    chunks = [torch.randn(shape).to(dtype) for _ in ids]
    plan.store_blocks(ids, chunks)  # the plan works before the change
    what = data.draw(st.sampled_from([*CACHE, "fake chunk", "freed chunk", "shrunk chunk"]))
    moves = what.endswith("chunk")
    if moves:
        chunks[data.draw(st.integers(0, len(chunks) - 1))] = chunk_without_memory(what.split()[0], shape, dtype)
    else:
        change, scope = CACHE[what]
        held = [t for job in plan.jobs for t in job.plane.leaves]  # the tensors the plan copies through
        own = data.draw(st.booleans())  # one of them, or the caller's (detection may have re-viewed it)
        target = data.draw(st.sampled_from(held if own else flatten(case.kv)))
        storage = target.untyped_storage()._cdata
        moves = (scope == "tensor" and any(target is t for t in held)) or (
            scope == "storage" and any(t.untyped_storage()._cdata == storage for t in held)
        )
        change(target)
    cache = [readable(t) for t in flatten(kv) + flatten(case.kv)]
    before = [readable(c) for c in chunks]
    load = data.draw(st.booleans())
    try:
        (plan.load_blocks if load else plan.store_blocks)(ids, chunks, num_threads=data.draw(st.sampled_from([1, 2])))
    except (KVLayoutError, TypeError) as e:
        assert isinstance(e, TransferError), e
        for old, t in zip(cache + before, flatten(kv) + flatten(case.kv) + chunks):
            now = readable(t)
            assert old is None or now is None or torch.equal(old.view(torch.uint8), now.view(torch.uint8)), what
        return
    assert not moves, f"{what}: a call through memory the plan no longer holds did not raise"


fuzz()
print("done")
"""


def test_memoryless_chunks_and_caches_changed_after_prepare_never_crash() -> None:
    """Random registrations whose cache is re-allocated in place after prepare (storage
    freed or regrown, ``t.data`` swapped, ``set_``, ``resize_``; the plan's own tensor or
    the caller's), or whose chunks have no memory (fake, freed, shrunk): every call that
    would copy through memory the plan does not hold raises a ``TransferError`` and
    changes no byte. In a subprocess: without the checks these calls crash the process."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_FUZZ.replace("EXAMPLES", "120")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]


# -- the vLLM integration with duck-typed configs ------------------------------------------------


def specs() -> st.SearchStrategy[Any]:
    kinds = st.sampled_from(
        ["FullAttentionSpec", "MambaSpec", "MLAAttentionSpec", "CrossAttentionSpec", "Other"]
    )
    fields = st.dictionaries(
        st.sampled_from(
            ["block_size", "page_size_bytes", "mamba_cache_mode", "tokens_per_state", "num_kv_heads"]
        ),
        st.one_of(st.none(), st.integers(-2, 64), st.text(max_size=2), st.just("align")),
        max_size=5,
    )
    return st.builds(lambda kind, f: type(kind, (), dict(f))(), kinds, fields)


def configs() -> st.SearchStrategy[Any]:
    group = st.builds(
        lambda spec, names, drop: SimpleNamespace(
            **{k: v for k, v in {"kv_cache_spec": spec, "layer_names": names}.items() if k not in drop}
        ),
        st.one_of(specs(), st.none()),
        st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True),
        st.sets(st.sampled_from(["kv_cache_spec", "layer_names"]), max_size=1),
    )
    return st.one_of(
        st.none(), st.builds(lambda gs: SimpleNamespace(kv_cache_groups=gs), st.lists(group, max_size=3))
    )


@FUZZ
@given(
    configs(),
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]), st.one_of(tensors(), st.lists(tensors(), max_size=2)), max_size=3
    ),
)
def test_the_vllm_integration_raises_only_errors_of_the_family(
    config: Any, kv_caches: dict[str, Any]
) -> None:
    for call in (
        lambda: validate_kv_cache_groups(config),
        lambda: apply_kv_cache_group_edits(config, kv_caches, {"kv_layout": "NHD"}),
    ):
        with contextlib.suppress(*ALLOWED):
            _quietly(call)
