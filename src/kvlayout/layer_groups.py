"""LMCache's layer-group manager, as a thin layer over a bound registration's kernel groups.

``KVLayerGroupsManager(kv_caches, engine_kv_formats)`` is what LMCache's connectors build
after detection: the layers bucketed into groups one transfer kernel moves (same format,
K/V planes, heads, head size, block size and dtype within one engine group), each with
its :class:`~kvlayout.PageBufferShapeDesc`. kvlayout's registration already holds
exactly that (:attr:`kvlayout.Registration.kernel_groups`), so the manager only reads it:
one :class:`KVLayerGroupInfo` per kernel group, whose descriptor is built with the block
stride :func:`~kvlayout.resolve_block_stride_and_log_layout` gives (padded pools and
blocks-first views included).

Engine groups come from ``engine_group_infos`` (objects with ``engine_group_id``,
``layer_indices`` and optionally ``tokens_per_block``, as LMCache's ``EngineGroupInfo``)
or, without them, from the registration (its ``layer_groups``). Unlike LMCache, one
engine group may hold several kernel groups (layers of one group that differ), so an
info describes an engine group, not a kernel group.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlayout._generated.descriptors import PageBufferShapeDesc
from kvlayout._generated.formats import EngineKVFormat
from kvlayout.catalog.registry import FormatLike
from kvlayout.errors import as_int
from kvlayout.facade import resolve_block_stride_and_log_layout
from kvlayout.registration.kernel_groups import EXCLUDED_ENGINE_GROUP, KernelGroup, LayerGroupIdentity
from kvlayout.registration.registration import (
    RegisteredKV,
    Registration,
    RegistrationError,
    bound,
    bound_per_layer,
)

__all__ = ["KVLayerGroupInfo", "KVLayerGroupsManager", "KernelGroupInfo"]


@dataclass(frozen=True)
class KVLayerGroupInfo:
    """One kernel group as LMCache's manager lists it.

    ``tokens_per_block``: the engine's logical tokens per block id (its engine group
    info's, else the block size: uncompressed); ``slots_per_chunk``: physical slots in
    one LMCache chunk of ``lmcache_tokens_per_chunk`` tokens. ``kernel_group`` is
    kvlayout's own group (pointer table, transfer plans).
    """

    layer_indices: list[int]
    shape_desc: PageBufferShapeDesc
    dtype: torch.dtype
    tokens_per_block: int
    slots_per_chunk: int
    engine_group_idx: int
    kernel_group: KernelGroup

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def hidden_dim_size(self) -> int:
        """Elements of one token row of one plane (``nh * hs``)."""
        return self.shape_desc.nh * self.shape_desc.hs

    @property
    def slots_per_block(self) -> int:
        """Physical token slots per block, as the tensors have them."""
        return self.shape_desc.bs

    @property
    def identity(self) -> LayerGroupIdentity:
        return self.kernel_group.identity

    def calculate_slots(self, num_tokens: int) -> int:
        """Physical slots ``num_tokens`` logical tokens take in this group, as LMCache
        counts them: ``num_tokens * slots_per_block // tokens_per_block`` (a compressed
        group's partial slot is not counted)."""
        tokens = _int("num_tokens", num_tokens, 0)
        return tokens * self.slots_per_block // self.tokens_per_block


KernelGroupInfo = KVLayerGroupInfo
"""LMCache's newer name for :class:`KVLayerGroupInfo` (the canonical one)."""


class KVLayerGroupsManager:
    """A registration's kernel groups with their descriptors (see the module docstring).

    ``kv_caches`` is what detection returned (or a :class:`~kvlayout.Registration`);
    ``engine_kv_formats`` its format, or one format (or None) per layer as
    ``normalize_and_discover_per_layer_formats`` returns them; None: the registration's
    own. Anything else is bound and checked now. Raises
    :class:`~kvlayout.RegistrationError` for engine group infos that do not fit the
    registration, and for chunk sizes that are not whole blocks.
    """

    def __init__(
        self,
        kv_caches: Any,
        engine_kv_formats: FormatLike | Sequence[FormatLike | None] | None = None,
        engine_group_infos: Sequence[Any] = (),
        lmcache_tokens_per_chunk: int = 256,
    ) -> None:
        self.registration = _registration(kv_caches, engine_kv_formats)
        self.lmcache_tokens_per_chunk = _int("lmcache_tokens_per_chunk", lmcache_tokens_per_chunk, 1)
        reg = self.registration
        engine_groups, tokens_per_block = _engine_groups(reg, engine_group_infos)
        registered = reg.registered_kv  # what the facade answers from without binding again
        groups: list[KVLayerGroupInfo] = []
        for group_idx, g in enumerate(reg.group_by(engine_groups)):
            if g.geometry.block_size is None:
                raise RegistrationError(
                    f"{g.format.name} folds its blocks and their tokens into one axis, so layers "
                    f"{list(g.layers)} have no block size to group by; detect the registration with "
                    "the tokens_per_block hint (SGLang's MP layouts) to give it one"
                )
            stride = resolve_block_stride_and_log_layout(registered, g.format, g.layers[0], group_idx)
            desc = g.descriptor(len(g.layers), g.num_blocks, g.block_size, stride)
            tpb = tokens_per_block.get(g.engine_group, desc.bs)
            groups.append(
                KVLayerGroupInfo(
                    layer_indices=list(g.layers),
                    shape_desc=desc,
                    dtype=g.dtype,
                    tokens_per_block=tpb,
                    slots_per_chunk=self._slots_per_chunk(group_idx, desc.bs, tpb),
                    engine_group_idx=g.engine_group,
                    kernel_group=g,
                )
            )
        self._groups = groups

    def __repr__(self) -> str:
        return f"KVLayerGroupsManager({self.num_groups} groups: {self.registration!r})"

    def _slots_per_chunk(self, group_idx: int, slots_per_block: int, tokens_per_block: int) -> int:
        chunk = self.lmcache_tokens_per_chunk
        if tokens_per_block % slots_per_block:
            raise RegistrationError(
                f"group {group_idx}: tokens_per_block {tokens_per_block} must be a multiple of "
                f"slots_per_block {slots_per_block}"
            )
        if chunk % tokens_per_block:
            raise RegistrationError(
                f"group {group_idx}: lmcache_tokens_per_chunk {chunk} must be a multiple of "
                f"tokens_per_block {tokens_per_block}"
            )
        return chunk // tokens_per_block * slots_per_block

    @property
    def kv_layer_groups(self) -> list[KVLayerGroupInfo]:
        """One entry per kernel group, in order of first layer."""
        return list(self._groups)

    @property
    def kernel_groups(self) -> list[KVLayerGroupInfo]:
        """LMCache's newer name for :attr:`kv_layer_groups` (the canonical one)."""
        return self.kv_layer_groups

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_kernel_groups(self) -> int:
        """LMCache's newer name for :attr:`num_groups` (the canonical one)."""
        return self.num_groups

    @property
    def num_blocks(self) -> int:
        """The first group's block count."""
        return self.get_shape_desc(0).nb

    def get_shape_desc(self, group_idx: int) -> PageBufferShapeDesc:
        """The descriptor of kernel group ``group_idx``."""
        return self._group(group_idx).shape_desc

    def get_slots_per_chunk(self, group_idx: int) -> int:
        """Physical slots in one chunk of group ``group_idx`` (LMCache 0.5.6 deprecates it
        for hybrid models: kvlayout answers per group, so it serves them)."""
        return self._group(group_idx).slots_per_chunk

    def calculate_num_blocks(self, group_idx: int, num_tokens: int) -> int:
        """Whole blocks of group ``group_idx`` that ``num_tokens`` logical tokens fill, as
        LMCache counts them: the group's slots for the tokens
        (:meth:`KVLayerGroupInfo.calculate_slots`), in whole blocks (a partly filled last
        block is not counted)."""
        group = self._group(group_idx)
        return group.calculate_slots(num_tokens) // group.shape_desc.bs

    def _group(self, group_idx: int) -> KVLayerGroupInfo:
        group_idx = as_int(group_idx, "group_idx")  # a NumPy or torch integer too, as everywhere
        if not 0 <= group_idx < len(self._groups):
            raise RegistrationError(
                f"kernel group {group_idx} is out of range for {len(self._groups)} groups"
            )
        return self._groups[group_idx]


def _registration(kv: Any, formats: FormatLike | Sequence[FormatLike | None] | None) -> Registration:
    if formats is None:
        if type(kv) is Registration:
            return kv
        if type(kv) is RegisteredKV:
            registration: Registration = kv.registration
            return registration
        raise TypeError(
            "engine_kv_formats is needed unless kv_caches is what detection returned "
            f"(a Registration or its registered list), not a {type(kv).__name__}"
        )
    if isinstance(formats, (EngineKVFormat, int, str)):
        return bound(kv, formats)
    return bound_per_layer(kv, formats)


def _engine_groups(reg: Registration, infos: Sequence[Any]) -> tuple[tuple[int, ...], dict[int, int]]:
    """Each layer's engine group (-1: in none) and the engine's tokens per block id per
    engine group, from LMCache-style engine group infos (or the registration's groups)."""
    if infos is not None and (isinstance(infos, str) or not isinstance(infos, Sequence)):
        raise TypeError(
            f"engine_group_infos must be a sequence of engine group infos, not {type(infos).__name__} "
            f"({infos!r}); the manager takes no num_blocks (LMCache's older third argument): each "
            "group's block count is its tensors'"
        )
    if not infos:
        return reg.engine_groups, {}
    groups = [EXCLUDED_ENGINE_GROUP] * reg.num_layers
    tokens: dict[int, int] = {}
    for n, info in enumerate(infos):
        try:
            group_id, layers = info.engine_group_id, info.layer_indices
        except AttributeError:
            raise TypeError(
                f"engine_group_infos[{n}] is a {type(info).__name__}, not an engine group info "
                "(engine_group_id, layer_indices)"
            ) from None
        group_id = _int(f"engine_group_infos[{n}].engine_group_id", group_id, 0)
        for raw in layers:
            layer = _int(f"engine_group_infos[{n}].layer_indices", raw, 0)
            if layer >= reg.num_layers:
                raise RegistrationError(
                    f"engine_group_infos[{n}]: layer {layer} is out of range for {reg.num_layers} layers"
                )
            if groups[layer] != EXCLUDED_ENGINE_GROUP:
                raise RegistrationError(
                    f"layer {layer} is in engine groups {groups[layer]} and {group_id}; a layer is in one"
                )
            groups[layer] = group_id
        tpb = getattr(info, "tokens_per_block", 0) or 0
        if tpb:
            tokens[group_id] = _int(f"engine_group_infos[{n}].tokens_per_block", tpb, 1)
    return tuple(groups), tokens


def _int(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__} ({value!r})") from None
    if number < minimum:
        raise RegistrationError(f"{what} must be >= {minimum}, got {number}")
    return number
