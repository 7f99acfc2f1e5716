"""Describing a bound registration for a peer: :func:`describe` (what
``registration.describe(shard=...)`` calls) and :func:`describe_group` read kernel groups
into a :class:`~kvlayout.registration.peers.RegistrationDescription`, checked as a peer's
would be (:func:`~kvlayout.registration.peers.RegistrationDescription.from_json`'s checks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvlayout.errors import as_int
from kvlayout.layout.algebra import size_of
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.address_space import MAX_END, MAX_END_TEXT
from kvlayout.registration.memory import group_placement, memory_keys
from kvlayout.registration.peers import (
    GroupDescription,
    PeerDescriptionError,
    PlaneDescription,
    RegistrationDescription,
    from_data,
    shard_misfit,
    to_data,
)
from kvlayout.registration.shards import Shard, ShardError

__all__ = ["describe", "describe_group"]


def describe(
    kernel_groups: Sequence[Any],
    engine: Any,
    *,
    shard: Shard | None = None,
    block_size: int | None = None,
    at: int | None = None,
) -> RegistrationDescription:
    """The description of a bound registration (its kernel groups and engine, as
    :meth:`Registration.describe` hands them over). ``block_size`` splits
    the page axis of formats that fold blocks and tokens (NB*BS); elsewhere it must be the
    cache's own (a peer reads block ids in the blocks the description gives).

    ``at`` describes the tensors as if laid out one after another from that address
    (page-aligned, a page apart) instead of where they are: for planning from a meta
    registration, which has no memory (it is then described as host memory). Runs never
    cross from one tensor into another, so a map's runs are the same wherever they lie."""
    groups = tuple(_group(g, block_size) for g in kernel_groups)
    if not groups:
        raise PeerDescriptionError("the registration has no kernel group to describe")
    if shard is not None and isinstance(shard, Shard) and (misfit := shard_misfit(groups, shard)) is not None:
        i, heads = misfit
        raise ShardError(
            f"describe(shard={shard}): the shard holds {len(shard.heads)} KV heads, but kernel group {i} of "
            f"this registration holds {heads}: pass the Shard(tp_rank, tp_size, num_kv_heads) this rank "
            "was given, with the model's KV heads"
        )
    device = kernel_groups[0].device
    if at is None and device.type == "meta":  # else refused later as the description's own device type
        raise PeerDescriptionError(
            "describe(): a meta registration has no addresses to describe; pass at= (an address its "
            "tensors are described as laid out from, for planning)"
        )
    if at is None:
        _check_unmoved(kernel_groups)
    else:
        groups = _placed(
            groups, at, [[memory_keys(p.leaves, p.data_ptrs) for p in g.planes] for g in kernel_groups]
        )
        if device.type == "meta":
            device = _HOST
    return _checked(groups, device, shard, engine)


@dataclass(frozen=True)
class _Device:
    type: str
    index: int | None


_HOST = _Device("cpu", None)
_PAGE = 4096


def _placed(
    groups: tuple[GroupDescription, ...], at: int, keys: Sequence[Sequence[list[Hashable] | None]]
) -> tuple[GroupDescription, ...]:
    """``groups`` with every tensor at a made-up address, one after another from ``at``; a
    tensor registered again (``keys``: each plane's :func:`memory_keys`) at its first one's."""
    at = as_int(at, "at")
    if not 0 < at < MAX_END:
        raise PeerDescriptionError(f"at must be a positive address below {MAX_END_TEXT}, got {at!r}")
    out, next_at = [], -(-at // _PAGE) * _PAGE
    for g, g_keys in zip(groups, keys, strict=True):
        planes = []
        for p, p_keys in zip(g.planes, g_keys, strict=True):
            span = p.span
            addresses: list[int] = []
            first: dict[Hashable, int] = {}
            for k in range(len(p.addresses)):
                if p_keys is not None and p_keys[k] in first:
                    addresses.append(addresses[first[p_keys[k]]])
                    continue
                if p_keys is not None:
                    first[p_keys[k]] = k
                addresses.append(next_at)
                next_at += -(-span // _PAGE) * _PAGE + _PAGE
            planes.append(
                PlaneDescription(p.dtype, p.sizes, p.shape, p.strides, p.block_stride, tuple(addresses))
            )
        out.append(replace(g, planes=tuple(planes)))
    return tuple(out)


def describe_group(
    group: Any, *, shard: Shard | None = None, block_size: int | None = None
) -> RegistrationDescription:
    """The description of one kernel group."""
    _check_unmoved([group])
    return _checked((_group(group, block_size),), group.device, shard, group.engine)


def _check_unmoved(kernel_groups: Sequence[Any]) -> None:
    """A peer is told the addresses detection read: refuse where a tensor has moved since
    (the peer would write into memory this process no longer holds)."""
    for g in kernel_groups:
        group_placement(g, PeerDescriptionError)


def _checked(
    groups: tuple[GroupDescription, ...], device: Any, shard: Shard | None, engine: Any
) -> RegistrationDescription:
    if shard is not None and not isinstance(shard, Shard):
        raise TypeError(f"shard must be a kvlayout.transfer.Shard, not {type(shard).__name__}")
    desc = RegistrationDescription(
        groups, device.type, device.index, shard, None if engine is None else str(engine.value)
    )
    checked = from_data(to_data(desc))  # one check for what we make and what peers send
    # the pages' local advice (how they were read, what to do where they do not map), which
    # no description carries: the pages compare equal without it
    if any(g.opaque_pages is not None and g.opaque_pages.advice for g in groups):
        kept = tuple(
            dataclasses.replace(c, opaque_pages=g.opaque_pages)
            for c, g in zip(checked.groups, groups, strict=True)
        )
        checked = dataclasses.replace(checked, groups=kept)
    return checked


def _group(group: Any, block_size: int | None) -> GroupDescription:
    layout = group.layout
    if block_size is not None:
        block_size = as_int(block_size, "block_size")
        if block_size < 1:
            raise PeerDescriptionError(f"describe(block_size={block_size}): a block holds at least 1 token")
    planes = []
    for i, p in enumerate(group.planes):
        leaf = p.leaves[0]
        empty = [f"{name}={n}" for name, n in p.sizes.items() if n == 0]
        if empty:  # said of the cache, as for its dtype: a description of it would blame its own field
            raise PeerDescriptionError(
                f"{layout}: the cache holds no elements ({', '.join(empty)}): "
                "it has no blocks to describe or map"
            )
        dtype = str(p.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:  # said of the cache, before a description of it is checked
            raise PeerDescriptionError(
                f"the cache's {'plane ' + str(i) + ' ' if len(group.planes) > 1 else ''}tensors are {dtype}: "
                f"block maps and descriptions carry {', '.join(DTYPE_SIZES)}"
            )
        planes.append(
            PlaneDescription(
                dtype,
                tuple(p.sizes.items()),
                tuple(p.shape),
                tuple(int(s) for s in leaf.stride()),
                p.block_stride,
                tuple(p.data_ptrs),
            )
        )
    bs = size_of(layout, planes[0].sizes_dict(), Role.TOKEN)
    if bs is None or layout.axis_of(Role.BLOCK) is None:
        bs = block_size
    elif block_size is not None and block_size != bs:  # ignored, a peer would read ids in the wrong blocks
        sizes = "block_map's src_block_size=/dst_block_size="
        address = (
            f"give {sizes}{block_size} to address it in blocks of {block_size}"
            if block_size % bs == 0
            else f"block ids address its blocks, or k of them at once ({sizes}a multiple of {bs}), never less"
        )
        raise PeerDescriptionError(
            f"block_size={block_size}, but {layout}'s blocks hold {bs} tokens (its block axis says so): "
            "block_size splits a folded page axis (NB*BS) only; describe this cache without it, and "
            f"{address}"
        )
    return GroupDescription(
        group.format, tuple(group.layer_ids), group.engine_group, bs, tuple(planes), group.opaque_pages
    )
