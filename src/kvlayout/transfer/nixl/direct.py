"""The direct form: a map's runs as the local and remote descriptor arrays, and the op."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvlayout import _native
from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.sides import _MEM_TYPES, _U64, MapSide, NixlMap, Op, _refuse_moved


class Descriptors(NamedTuple):
    """The direct form of a map: ``(N, 3)`` uint64 rows (address, length, device id) for
    ``get_xfer_descs`` on each side, the op, and each side's NIXL memory type."""

    local: np.ndarray
    remote: np.ndarray
    op: Op
    local_mem: str
    remote_mem: str


class _Sides(NamedTuple):
    op: Op
    local: MapSide
    remote: MapSide
    runs: np.ndarray  # (N, 3) uint64, C-contiguous
    local_col: int  # the runs' column of this side's addresses (0 source, 1 destination)
    block_map: NixlMap  # what the runs are of

    @property
    def remote_col(self) -> int:
        return 1 - self.local_col

    @property
    def local_addr(self) -> np.ndarray:
        return self.runs[:, self.local_col]

    @property
    def remote_addr(self) -> np.ndarray:
        return self.runs[:, self.remote_col]

    @property
    def lengths(self) -> np.ndarray:
        return self.runs[:, 2]

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum(dtype=_U64))


def _mem_type(side: MapSide, which: str) -> str:
    mem = _MEM_TYPES.get(side.device_type)
    if mem is None:
        raise TransferError(
            f"the {which} side is on a {side.device_type!r} device; NIXL moves cpu or cuda memory"
        )
    return mem


def _sides(block_map: NixlMap) -> _Sides:
    runs = _checked_runs(block_map)
    src, dst = block_map.src, block_map.dst
    if src.is_local == dst.is_local:
        where = "this process" if src.is_local else "peers"
        raise TransferError(
            f"both sides of the map are in {where}; NIXL moves a map with one side local, the other a peer's"
            + (" (copy a local map with its copy())" if src.is_local else "")
        )
    if src.is_local:
        return _Sides("WRITE", src, dst, runs, 0, block_map)
    return _Sides("READ", dst, src, runs, 1, block_map)


def _checked_runs(block_map: NixlMap) -> np.ndarray:
    """A map's runs, checked: an ``(N, 3)`` uint64 array of runs of bytes within the
    address space (C-contiguous)."""
    if not all(hasattr(block_map, name) for name in ("runs", "src", "dst")):
        raise TypeError(
            "expected a block map (kvlayout.transfer.block_map) or another NixlMap (runs, src and dst), "
            f"not {type(block_map).__name__}"
        )
    runs = block_map.runs
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 or runs.dtype != _U64:
        what = (
            f"{runs.dtype} array of shape {runs.shape}"
            if isinstance(runs, np.ndarray)
            else type(runs).__name__
        )
        raise TypeError(
            f"a map's runs must be an (N, 3) uint64 array (source, destination, length), not a {what}"
        )
    runs = np.ascontiguousarray(runs)
    problem, run = _native.check_runs(runs)
    if problem is _native.RunProblem.empty:
        raise TransferError(f"run {run} of the map has length 0")
    if problem is not _native.RunProblem.none:
        name = "source" if problem is _native.RunProblem.src_wraps else "destination"
        raise TransferError(f"run {run} of the map runs past the end of the {name} address space")
    return runs


def _rows(addr: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=_U64)
    out[:, 0], out[:, 1], out[:, 2] = addr, lengths, device
    return out


def _direct_rows(s: _Sides) -> tuple[np.ndarray, np.ndarray]:
    """The local and remote descriptor rows of the direct form: one per run."""
    return (
        _native.descriptor_rows(s.runs, s.local_col, s.local.device_index),
        _native.descriptor_rows(s.runs, s.remote_col, s.remote.device_index),
    )


def descriptors(block_map: NixlMap) -> Descriptors:
    """The map's runs as NIXL descriptors (one per run), its op and memory types; refused
    where the local side's memory moved since the map read it (the caller posts them)."""
    s = _sides(block_map)
    _refuse_moved(s.local, "nothing was posted")
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    return Descriptors(*_direct_rows(s), s.op, local_mem, remote_mem)
