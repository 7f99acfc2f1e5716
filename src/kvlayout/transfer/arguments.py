"""The ints and block ids a caller hands the transfers (a plan's calls, block maps), read
the same way everywhere, each entry point raising its own error class."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import KVLayoutError, as_int, is_bool
from kvlayout.registration.nesting import not_strided


def int_arg(name: str, value: object, error: type[KVLayoutError]) -> int:
    """``value`` as an int (NumPy and torch integers too, never a bool)."""
    try:
        return as_int(value, name)
    except TypeError:
        raise error(f"{name} must be an int, got {value!r}") from None


MAX_THREADS: int = _native.max_threads()  # more are capped: the worker pool never has more


def threads_arg(value: object, error: type[KVLayoutError]) -> int:
    """``num_threads``: a positive int, capped at the worker pool's size."""
    threads = int_arg("num_threads", value, error)
    if threads < 1:
        raise error(f"num_threads must be a positive int, got {value!r}")
    return min(threads, MAX_THREADS)


def block_ids_arg(name: str, value: Any, error: type[KVLayoutError], count: int | None = None) -> np.ndarray:
    """Block ids as a contiguous 1-D int64 array of kvlayout's own (read-only): a list, a
    NumPy array or a dense tensor of integers on any device (a CUDA tensor is copied to the
    host, which waits for its stream). Never the caller's memory: ids are checked once and
    then read while the GIL is released, so another thread's writes to the caller's array
    must not reach them. Ranges are the caller's to check; ids past int64 are refused here,
    since an int64 cast would wrap them to negative ones. Given the ``count`` of blocks the
    ids index, a ``range`` is checked against it before it is built: its ids are distinct, so
    one in range holds at most ``count`` (``range(10**9)`` would otherwise take 8 GB first)."""
    if isinstance(value, range) and count is not None:
        check_range_in_range(name, value, count, error)
    if isinstance(value, torch.Tensor):
        if value.is_neg() and value.device.type != "meta":
            value = value.resolve_neg()  # a few ids: their values, not a negated view's bytes
        if value.device.type == "meta" or not_strided(value) is not None:
            raise error(f"{name} must hold values (a list, array or dense tensor), not {value!r}")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise error(f"{name} must be integers, got {value.dtype}")
        host = value.detach().cpu()
        ids = host.numpy() if host.dtype == torch.uint64 else host.to(torch.int64).numpy()
    else:
        _refuse_masked(name, value, error)
        try:
            ids = np.asarray(value)
        except ValueError:  # NumPy's "inhomogeneous shape": a list holding lists of other lengths
            raise error(_ragged(name, value)) from None
        if ids.size and ids.dtype.kind not in "iu" and _all_ints(value):
            ids = _exact_ints(name, value, error)  # ints NumPy promoted to float64 (int64 with uint64)
        if ids.size and ids.dtype.kind not in "iu":
            raise error(
                f"{name} must be a 1-D sequence of ints, got {ids.dtype} with shape {list(ids.shape)}"
            )
        _refuse_bools(name, value, ids, error)
    if ids.ndim != 1:
        raise error(f"{name} must be a 1-D sequence of ints, got shape {list(ids.shape)}")
    if ids.size and ids.dtype.kind == "u" and int(ids.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(ids > np.iinfo(np.int64).max))
        raise error(f"{name}[{i}] = {int(ids[i])} is out of range for any cache (above 2**63 - 1)")
    owned = np.array(ids, dtype=np.int64, order="C", copy=True)
    owned.setflags(write=False)
    return owned


def _refuse_masked(name: str, value: Any, error: type[KVLayoutError]) -> None:
    """A NumPy masked array with masked entries: ``np.asarray`` drops the mask, and the
    masked slots' leftover values would be moved as block ids. (``numpy.ma`` is looked up,
    not imported: a masked array exists only once it is.)"""
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(value, ma.MaskedArray) and ma.is_masked(value):
        at = np.argwhere(ma.getmaskarray(value))[0]
        where = "".join(f"[{int(i)}]" for i in at)
        raise error(f"{name}{where} is masked, which is no block id: fill or compress the masked array first")


def _refuse_bools(name: str, value: Any, ids: np.ndarray, error: type[KVLayoutError]) -> None:
    """A bool among a sequence's ints (``ids``, NumPy's reading of ``value``): NumPy reads
    ``[True, 1]`` as ``[1, 1]``, block 1 twice. Only an entry read as 0 or 1 can be one, so
    only those are looked at: a list of ids is not walked per request. (An array or tensor
    of bools is refused by its dtype.)"""
    if not isinstance(value, Sequence) or isinstance(value, range) or ids.ndim != 1:
        return
    for i in np.flatnonzero((ids == 0) | (ids == 1)).tolist():
        v = value[i]
        if is_bool(v):
            raise error(f"{name}[{i}] is a bool ({v!r}), not an int: {_ONE_D}")


def _ragged(name: str, value: Any) -> str:
    """Why NumPy could not make one array of ``value`` (a sequence holding sequences of other
    lengths, or beside ints), for the message."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if not isinstance(v, (int, np.integer)):
                text = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
                return f"{name}[{i}] is a {type(v).__name__} ({text}), not an int: {_ONE_D}"
    return f"{name} holds sequences of different lengths: {_ONE_D}"


_ONE_D = "block ids are a 1-D sequence of ints"


def _all_ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    )


def _exact_ints(name: str, value: Sequence[int], error: type[KVLayoutError]) -> np.ndarray:
    """Python or NumPy ints as int64, each exactly (no float on the way)."""
    ints = [int(v) for v in value]
    for i, v in enumerate(ints):
        if not 0 <= v <= np.iinfo(np.int64).max:
            what = "negative" if v < 0 else "out of range for any cache (above 2**63 - 1)"
            raise error(f"{name}[{i}] = {v} is {what}")
    return np.array(ints, dtype=np.int64)


def check_ids_in_range(name: str, ids: np.ndarray, count: int, error: type[KVLayoutError]) -> None:
    """Refuse the first of ``ids`` (:func:`block_ids_arg`'s) not below ``count``."""
    bad = _native.first_bad_block_id(ids, count)
    if bad >= 0:
        raise error(f"{name}[{bad}] = {int(ids[bad])} is out of range for {_blocks(count)}")


def check_range_in_range(name: str, ids: range, count: int, error: type[KVLayoutError]) -> None:
    """:func:`check_ids_in_range` of a ``range``, without building it: its ids run one way,
    so the first outside ``[0, count)`` is found by arithmetic."""
    if not ids:
        return
    start, step = ids.start, ids.step
    if not 0 <= start < count:
        bad = 0
    elif step > 0:
        bad = -(-(count - start) // step)  # the first index whose id reaches count
    else:
        bad = start // -step + 1  # the first index whose id is negative
    if bad < len(ids):
        raise error(f"{name}[{bad}] = {ids[bad]} is out of range for {_blocks(count)}")


def _blocks(count: int) -> str:
    return "1 block" if count == 1 else f"{count} blocks"


def lmcache_object_hint(name: str, shape: Sequence[int], kv_size: int, layers: int, row: int) -> str:
    """What to pass for LMCache's 3-D memory object ``[NL, T, row]`` (its buffer for a
    cache of one plane: MLA, fused K/V) where a chunk ``[1, NL, T, row]`` is needed: the
    same bytes, one axis short. Empty for any other shape."""
    if kv_size == 1 and len(shape) == 3 and shape[0] == layers and shape[2] == row:
        return f"; LMCache's [NL, T, row] object holds the same bytes: pass {name}.unsqueeze(0)"
    return ""


def check_written_once(
    name: str,
    ids: np.ndarray,
    start: int,
    count: int,
    error: type[KVLayoutError],
    why: str,
    hint: Callable[[int], str] | None = None,
) -> None:
    """Refuse the first of ``ids[start:]`` (in range of ``count``) that repeats an earlier
    one there, naming both: a block written twice holds whichever copy lands last.
    ``hint(again)`` adds what to do, given the repeat's index."""
    again = _native.first_repeated_block_id(ids, start, count)
    if again >= 0:
        earlier = start + int(np.flatnonzero(ids[start:again] == ids[again])[0])
        told = "" if hint is None else hint(again)
        raise error(f"{name}[{again}] = {int(ids[again])} repeats {name}[{earlier}]: {why}{told}")
