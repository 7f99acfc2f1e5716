"""Several block maps of one request moved as one: a hybrid model's kernel groups
(attention beside Mamba state, full beside sliding-window attention) or SGLang's KV pool
beside its Mamba state pools, each mapped on its own (its own block ids, its own sides),
then posted as one NIXL transfer with one notification, or copied as one.

vLLM's NixlConnector posts a hybrid request so: one transfer whose descriptors are every
group's (attention's, then the state's). A block map moves one group (the sides are a
group each), so :func:`join_maps` joins the maps a request needs; the NIXL layer reads
the joined map as it reads one (its runs, one side local and one a peer's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import numpy as np
import torch

from kvlayout import _native
from kvlayout.registration.memory import HoldsAddresses
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.registration.shards import Shard
from kvlayout.transfer.arguments import threads_arg
from kvlayout.transfer.block_maps import _PROBLEMS, BlockMap, fingerprint
from kvlayout.transfer.map_sides import BlockMapError, Side

__all__ = ["JoinedMap", "JoinedSide", "join_maps"]


class JoinedSide:
    """One side of a :class:`JoinedMap`: the parts' sides of that end, read as one
    (``is_local``, device, every tensor's span; ``moved()`` asks each part's side)."""

    def __init__(self, sides: tuple[Side, ...]) -> None:
        self.sides = sides

    def __repr__(self) -> str:
        return f"JoinedSide({', '.join(side.label for side in self.sides)})"

    def moved(self) -> str | None:
        return next((m for m in (side.moved() for side in self.sides) if m is not None), None)

    @property
    def live(self) -> bool:
        return self.sides[0].live

    @property
    def is_local(self) -> bool:
        return self.sides[0].is_local

    @property
    def device_type(self) -> str:
        return self.sides[0].device_type

    @property
    def device_index(self) -> int:
        return self.sides[0].device_index

    @functools.cached_property
    def tensor_spans(self) -> np.ndarray:
        """``(K, 2)`` uint64: each tensor's first byte and byte span, every part's, each
        tensor once (parts of one registration share its tensors)."""
        spans = np.unique(np.concatenate([side.tensor_spans for side in self.sides]), axis=0)
        spans.setflags(write=False)
        return spans

    @functools.cached_property
    def descriptions(self) -> tuple[RegistrationDescription, ...]:
        """The parts' whole descriptions, each once (:attr:`Side.descriptions`: every
        tensor the peer described); a part with none (a live side) adds none, its tensors
        being in :attr:`tensor_spans`, which a reader checks too."""
        return tuple({id(d): d for side in self.sides for d in side.descriptions}.values())

    @functools.cached_property
    def spans(self) -> np.ndarray:
        """``(K, 4)`` uint64 block spans of every part's tensors (what validation reads)."""
        return np.unique(np.concatenate([side.spans for side in self.sides]), axis=0)


class JoinedMap(HoldsAddresses):
    """Block maps of one request moved as one (see :func:`join_maps`): ``runs`` are the
    parts' runs one part after another, ``src`` and ``dst`` the parts' sides of each end.
    ``nx.transfer`` posts it as one transfer (one notification); ``copy()`` copies every
    part. ``maps`` are the parts, in order."""

    def __init__(self, maps: tuple[BlockMap, ...]) -> None:
        self.maps = maps
        self.src = JoinedSide(tuple(m.src for m in maps))
        self.dst = JoinedSide(tuple(m.dst for m in maps))

    def __repr__(self) -> str:
        return f"JoinedMap({len(self.maps)} maps, {self.num_runs} runs, {self.num_bytes} bytes)"

    @functools.cached_property
    def runs(self) -> np.ndarray:
        """The ``(N, 3)`` uint64 runs of every part, part after part, read-only."""
        runs = np.concatenate([m.runs for m in self.maps])
        runs.setflags(write=False)
        return runs

    @property
    def num_runs(self) -> int:
        return sum(m.num_runs for m in self.maps)

    @property
    def num_bytes(self) -> int:
        return sum(m.num_bytes for m in self.maps)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The joined runs digested (:func:`~kvlayout.transfer.block_maps.fingerprint`):
        what a peer-staged request's two halves compare, as for one map."""
        return fingerprint(self.runs)

    def copy(self, num_threads: int = 1) -> int:
        """Copy every part, after every part's sides are checked (none a peer's, none
        moved) and every part's runs validated as its own ``copy()`` does, so that a
        refusal copies nothing;
        the parts were checked at the join not to write the same bytes nor read what
        another writes. Returns the most threads a part used."""
        threads = threads_arg(num_threads, BlockMapError)
        with torch._C.DisableTorchFunction():  # as BlockMap.copy(): no caller code in the checks
            for check in (BlockMap._check_copy, BlockMap._check_runs):  # every part's runs before any copies
                for i, m in enumerate(self.maps):
                    try:
                        check(m)
                    except BlockMapError as exc:
                        raise BlockMapError(f"maps[{i}]: {exc}") from None
            return max(m._copy_checked(threads) for m in self.maps)


def join_maps(maps: Iterable[BlockMap]) -> JoinedMap:
    """The block maps of one request (``maps``: one per kernel group, or per SGLang pool)
    as one :class:`JoinedMap`, which ``nx.transfer`` posts as one transfer (one
    notification) and ``copy()`` copies. Every part must have its sources on one end
    (all in this process or all a peer's) and its destinations on the other, each end on
    one device, and a peer's end the descriptions of one peer (one TP and CP rank, its
    pools described with their own head counts where they differ); no two parts may write
    the same bytes, and between two live ends no part may read bytes another writes (the
    parts would then depend on their order). Refused otherwise, naming the parts."""
    if not isinstance(maps, (BlockMap, Iterable)):
        raise TypeError(f"join_maps takes an iterable of block maps (block_map's), not {type(maps).__name__}")
    parts = tuple(maps) if not isinstance(maps, BlockMap) else (maps,)
    if not parts:
        raise BlockMapError("join_maps needs one block map at least, got none")
    for i, m in enumerate(parts):
        if not isinstance(m, BlockMap):
            raise TypeError(f"join_maps: maps[{i}] is a {type(m).__name__}, not a BlockMap (block_map's)")
    for end in ("src", "dst"):
        first: Side = getattr(parts[0], end)
        for i, m in enumerate(parts[1:], 1):
            side: Side = getattr(m, end)
            if side.live != first.live:
                where = {True: "in this process", False: "a peer's description"}
                raise BlockMapError(
                    f"join_maps: maps[0]'s {end} is {where[first.live]} but maps[{i}]'s is "
                    f"{where[side.live]}; a joined map has one end here and the other a peer's (or both here)"
                )
            if not side.live and not _one_peer(first.shard, side.shard):  # two TP ranks' descriptions
                raise BlockMapError(
                    f"join_maps: maps[0]'s {end} is the description of a peer at {first.shard} but "
                    f"maps[{i}]'s of one at {side.shard}; a joined map goes to one peer (join each peer's "
                    "maps apart)"
                )
            if side.device != first.device:
                raise BlockMapError(
                    f"join_maps: maps[0]'s {end} is on {_device(first)} but maps[{i}]'s on {_device(side)}; "
                    "each end of a joined map is on one device (one NIXL memory type and device id)"
                )
    joined = JoinedMap(parts)
    _check_parts(joined)
    return joined


def _one_peer(a: Shard | None, b: Shard | None) -> bool:
    """Whether two descriptions' shards name one peer: the same TP (and CP) rank and
    degree. Its pools may be described with other head counts: an SWA pool's sliding
    layers have KV heads of their own (MiMo-V2-Flash, Inkling), a Mamba state none."""
    if a == b:
        return True
    return a is not None and b is not None and dataclasses.replace(b, num_kv_heads=a.num_kv_heads) == a


def _device(side: Side) -> str:
    kind, index = side.device
    return kind if index is None else f"{kind}:{index}"


def _check_parts(joined: JoinedMap) -> None:
    """The parts' runs together: no two write the same bytes; with both ends here, none
    reads what another writes. Each part was validated alone when built. (With one end a
    peer's, its addresses are another process's: only the destinations are compared.)"""
    if len(joined.maps) == 1:
        return
    runs = np.ascontiguousarray(joined.runs)
    if joined.src.live and joined.dst.live:
        problem, run, other = _native.validate_runs(runs, joined.src.spans, joined.dst.spans)
    else:
        problem, run, other = _native.MapProblem.none, -1, -1
        order = np.argsort(runs[:, 1], kind="stable")
        starts, ends = runs[order, 1], runs[order, 1] + runs[order, 2]
        clash = np.flatnonzero(starts[1:] < ends[:-1])
        if len(clash):
            problem = _native.MapProblem.dst_overlap
            run, other = sorted((int(order[clash[0]]), int(order[clash[0] + 1])))
    if problem is _native.MapProblem.none:
        return
    ends_at = np.cumsum([m.num_runs for m in joined.maps])
    part, other_part = (int(np.searchsorted(ends_at, r, side="right")) for r in (run, other))
    why = _PROBLEMS[problem].format(other=f"{other} (maps[{other_part}])")
    raise BlockMapError(
        f"join_maps: run {run} (maps[{part}]) is refused: {why}; join the maps of one request, each "
        "group's or pool's once"
    )
