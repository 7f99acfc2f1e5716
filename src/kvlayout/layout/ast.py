"""The layout AST: a parsed format name and the static facts derived from it.

A name such as ``TWO_X_NL_X_NBBS_NH_HS`` has two parts. The tokens before the last
``X`` are *list levels*, outermost first (here a 2-list of NL-lists); the tokens after it
are the axes of the leaf tensor, outermost first (here ``[NB*BS, NH, HS]``). A name
without ``X`` is one bare tensor. ``str(layout)`` gives the name back exactly.

Every fact LMCache declares by hand on its spec classes is a property here, computed
from the tokens' roles; nothing is declared per format.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvlayout.errors import LayoutSemanticError
from kvlayout.layout import algebra
from kvlayout.layout.vocabulary import Role, Token

__all__ = ["FACTS", "REQUIRED_ROLES", "STRUCTURE_FACTS", "Layout", "fact_doc"]

# The boolean facts every format carries (Python class attributes, C++ constexpr), in order.
FACTS = (
    "is_cross_layer",
    "is_kv_list",
    "is_layer_list",
    "is_mla",
    "is_hnd",
    "is_fused_packed",
    "is_two_major",
    "is_pbs_fused",
    "is_kv_second_tuple",
    "is_single_kv",
    "has_leading_block_axis",
    "is_indexer",
    "is_head_outer",
    "is_layer_inner",
)
# Exactly one of these holds for every layout.
STRUCTURE_FACTS = ("is_cross_layer", "is_kv_list", "is_layer_list")

_LIST_ROLES = (Role.LAYER, Role.KV, Role.ELEMENT)
_SINGLE_ROLES = (Role.LAYER, Role.KV, Role.BLOCK, Role.TOKEN, Role.HEAD)
REQUIRED_ROLES = (Role.LAYER, Role.BLOCK, Role.TOKEN, Role.ELEMENT)
"""The roles every layout has (the parser names the vocabulary's tokens for a missing one)."""


@dataclass(frozen=True)
class Layout:
    """A KV-cache layout: list levels (outermost first) around a leaf tensor's axes.

    Immutable; every derived fact is computed once per layout (detection and the
    accessors ask them on hot paths) and the hash is cached for the algebra's caches.
    """

    lists: tuple[Token, ...]
    tensor: tuple[Token, ...]

    def __post_init__(self) -> None:
        _check(self)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.lists, self.tensor))

    # -- the name ---------------------------------------------------------------

    def __str__(self) -> str:
        return "_X_".join([t.name for t in self.lists] + ["_".join(t.name for t in self.tensor)])

    @property
    def name(self) -> str:
        return str(self)

    def spans(self) -> Iterator[tuple[Token, int, int]]:
        """Each token with its ``[start, end)`` span in the name."""
        pos = 0
        for token in self.lists:
            yield token, pos, pos + len(token.name)
            pos += len(token.name) + len("_X_")
        for token in self.tensor:
            yield token, pos, pos + len(token.name)
            pos += len(token.name) + 1

    def describe_shape(self) -> str:
        """The symbolic shape: ``TWO_X_NL_X_NBBS_NH_HS`` -> ``2 x NL x [PBS, NH, HS]``."""
        inner = "[" + ", ".join(t.shape_label for t in self.tensor) + "]"
        return " x ".join([t.shape_label for t in self.lists] + [inner])

    # -- where each role sits ------------------------------------------------------

    @functools.cached_property
    def tensor_parts(self) -> tuple[Token, ...]:
        """The tensor's tokens with fusions expanded (``NBBS`` -> ``NB, BS``); a region
        stands for its rows token."""
        out: list[Token] = []
        for t in self.tensor:
            out.extend((t.region.rows,) if t.region is not None else t.parts)
        return tuple(out)

    def _part_position(self, role: Role) -> int | None:
        for i, part in enumerate(self.tensor_parts):
            if part.role is role:
                return i
        return None

    def _list_position(self, role: Role) -> int | None:
        for i, level in enumerate(self.lists):
            if level.role is role:
                return i
        return None

    def role_order(self, roles: Collection[Role]) -> tuple[Role, ...]:
        """``roles`` in the order their axes come, outermost first: list levels, then the
        tensor's parts (a fused axis's roles in its order); each role at its first place
        (a blocked page's two regions both stand for its token rows)."""
        return tuple(
            dict.fromkeys(
                t.role for t in (*self.lists, *self.tensor_parts) if t.role is not None and t.role in roles
            )
        )

    # -- static facts, all derived ----------------------------------------------

    @functools.cached_property
    def is_cross_layer(self) -> bool:
        """All layers live in one tensor (NL is a tensor axis)."""
        return self._part_position(Role.LAYER) is not None

    @functools.cached_property
    def is_kv_list(self) -> bool:
        """The outermost list level is the K/V pair (``[K layers, V layers]``)."""
        return bool(self.lists) and self.lists[0].role is Role.KV

    @functools.cached_property
    def is_layer_list(self) -> bool:
        """The outermost list level is the layers."""
        return bool(self.lists) and self.lists[0].role is Role.LAYER

    @functools.cached_property
    def is_kv_second_tuple(self) -> bool:
        """Each layer is a tuple of tensors (a list level inside the layer list)."""
        layer = self._list_position(Role.LAYER)
        return layer is not None and layer + 1 < len(self.lists)

    @functools.cached_property
    def has_kv(self) -> bool:
        """The layout stores a K/V pair somewhere (a list level, an axis or packed)."""
        return self._list_position(Role.KV) is not None or self._part_position(Role.KV) is not None

    @functools.cached_property
    def is_fused_packed(self) -> bool:
        """K and V of one head sit side by side in one row: a token that fuses the K/V
        pair into its content (CS), or a K/V axis inner to the block, token and head axes."""
        if any(Role.KV in t.roles and t.fuses for t in self.tensor):
            return True
        kv = self._part_position(Role.KV)
        if kv is None:
            return False
        outer = [self._part_position(r) for r in (Role.BLOCK, Role.TOKEN, Role.HEAD)]
        return all(p is None or p < kv for p in outer)

    @functools.cached_property
    def kv_size(self) -> int | None:
        """Planes per token row in a chunk: 2 for split K/V, else 1; None where a K/V axis
        of its own size (``KV``, 1 or 2 planes) leaves it to the tensors
        (:func:`kvlayout.layout.algebra.kv_size` answers for given sizes)."""
        if not self.has_kv or self.is_fused_packed:
            return 1
        pair = next(t for t in (*self.lists, *self.tensor_parts) if t.role is Role.KV)
        return pair.literal

    @functools.cached_property
    def is_mla(self) -> bool:
        """One latent row per token: no K/V pair and no head axis."""
        return not self.has_kv and self._part_position(Role.HEAD) is None

    @functools.cached_property
    def is_single_kv(self) -> bool:
        """Heads but no K/V pair: each tensor holds K or V alone."""
        return not self.has_kv and self._part_position(Role.HEAD) is not None

    @functools.cached_property
    def is_hnd(self) -> bool:
        """Heads are outer to tokens inside a block."""
        head = self._part_position(Role.HEAD)
        token = self._part_position(Role.TOKEN)
        return head is not None and token is not None and head < token

    @functools.cached_property
    def orders_heads_and_tokens(self) -> bool:
        """Heads and tokens are both axes inside a block, so the layout orders them (NHD
        or HND); a latent row per token orders nothing."""
        return self._part_position(Role.HEAD) is not None and self._part_position(Role.TOKEN) is not None

    @functools.cached_property
    def is_head_outer(self) -> bool:
        """Heads are outer to blocks: a block is one run per head, each head's blocks
        one after another (vLLM's ``LHBNC``)."""
        head = self._part_position(Role.HEAD)
        block = self._part_position(Role.BLOCK)
        return head is not None and block is not None and head < block

    @functools.cached_property
    def is_layer_inner(self) -> bool:
        """Layers are inner to heads: a block holds each head's rows of every layer
        together (vLLM's ``BHLNC``, one allocation read as a cross-layer tensor)."""
        head = self._part_position(Role.HEAD)
        layer = self._part_position(Role.LAYER)
        return head is not None and layer is not None and head < layer

    @functools.cached_property
    def is_two_major(self) -> bool:
        """An unpacked K/V axis outer to the block axis (K/V-first tensors)."""
        kv = self._part_position(Role.KV)
        block = self._part_position(Role.BLOCK)
        return kv is not None and not self.is_fused_packed and block is not None and kv < block

    @functools.cached_property
    def is_pbs_fused(self) -> bool:
        """Blocks and tokens are folded into one axis (NB*BS)."""
        return any(Role.BLOCK in t.roles and Role.TOKEN in t.roles and t.region is None for t in self.tensor)

    @functools.cached_property
    def has_leading_block_axis(self) -> bool:
        """Dim 0 of each tensor is the block axis alone, so a tensor may carry dim-0
        padding (a block stride wider than the block's content)."""
        first = self.tensor[0]
        return first.role is Role.BLOCK and not first.fuses

    @functools.cached_property
    def is_indexer(self) -> bool:
        """Each token's row is a record of a block's regions (a blocked-scale record, the
        block's value region before its scale region, or keys alone): the DSA indexer's
        key cache."""
        return any(t.region is not None for t in self.tensor)

    @functools.cached_property
    def list_depth(self) -> int:
        return len(self.lists)

    @functools.cached_property
    def tensor_rank(self) -> int:
        """The rank of each leaf tensor (a run of regions is stored as two axes)."""
        return sum(len(m.storage) for m in algebra.structure(self).modes)

    # -- the algebra with sizes (see kvlayout.layout.algebra) -------------------------------

    def concrete_shape(self, sizes: Mapping[str, int]) -> str:
        return algebra.concrete_shape(self, sizes)

    def list_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return algebra.list_shape(self, sizes)

    def tensor_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return algebra.tensor_shape(self, sizes)

    def tensor_strides(self, sizes: Mapping[str, int], block_stride: int | None = None) -> tuple[int, ...]:
        return algebra.tensor_strides(self, sizes, block_stride)

    def axis_of(self, role: Role) -> int | None:
        return algebra.axis_of(self, role)

    def symbol_of(self, role: Role) -> str | None:
        return algebra.symbol_of(self, role)

    def size_of(self, sizes: Mapping[str, int], role: Role) -> int | None:
        return algebra.size_of(self, sizes, role)

    def num_heads(self, sizes: Mapping[str, int]) -> int:
        return algebra.num_heads(self, sizes)

    def head_size(self, sizes: Mapping[str, int]) -> int:
        return algebra.head_size(self, sizes)

    def offset(
        self, coord: algebra.Coord, sizes: Mapping[str, int], block_stride: int | None = None
    ) -> tuple[int, int]:
        return algebra.offset(self, coord, sizes, block_stride)

    def pointer_order(
        self, sizes: Mapping[str, int], layer_indices: Sequence[int] | None = None, limit: int | None = None
    ) -> list[tuple[int, ...]]:
        return algebra.pointer_order(self, sizes, layer_indices, limit)

    def copy_plan(self, sizes: Mapping[str, int], chunk_row: int | None = None) -> algebra.CopyPlan:
        return algebra.copy_plan(self, sizes, chunk_row)

    def row_run(self, sizes: Mapping[str, int]) -> int:
        return algebra.row_run(self, sizes)


def _fail(layout: Layout, token: Token, problem: str) -> LayoutSemanticError:
    for t, start, end in layout.spans():
        if t is token:
            return LayoutSemanticError(str(layout), start, end, problem)
    return LayoutSemanticError(str(layout), 0, len(str(layout)), problem)


def _check(layout: Layout) -> None:
    """The semantic rules a parsed name must satisfy (positions point into the name)."""
    name = str(layout)
    if not layout.tensor:
        raise LayoutSemanticError(name, len(name) - 1, len(name), "a name must end with tensor axes")
    for level in layout.lists:
        if level.role not in _LIST_ROLES or level.fuses or level.region is not None:
            raise _fail(
                layout, level, f"{level.name} cannot be a list level (only layer, K/V or plane tokens can)"
            )
    seen_tokens: set[str] = set()
    owner: dict[Role, Token] = {}
    region_rows: Token | None = None
    for token, start, end in layout.spans():
        if token.name in seen_tokens:
            raise LayoutSemanticError(name, start, end, f"{token.name} appears twice")
        seen_tokens.add(token.name)
        if token.region is not None:
            if region_rows is not None and token.region.rows != region_rows:
                raise LayoutSemanticError(name, start, end, "regions of one page must share their rows")
            if region_rows is not None:
                continue  # a run of regions addresses its rows once
            region_rows = token.region.rows
        for role in token.roles:
            if role not in _SINGLE_ROLES:
                continue
            if role in owner:
                prior = owner[role]
                parts = (token.region.rows,) if token.region is not None else token.parts
                part = next((p for p in parts if p.role is role), token)
                if part is not token and part.name == prior.name:
                    problem = f"{token.name} fuses {part.name}, which the name already has"
                elif prior.fuses and part in prior.parts:
                    problem = f"{part.name} is already folded into {prior.name}"
                else:
                    problem = (
                        f"{token.name} addresses the {role.value} axis, which {prior.name} already addresses"
                    )
                raise LayoutSemanticError(name, start, end, problem)
            owner[role] = token
    regions = [i for i, t in enumerate(layout.tensor) if t.region is not None]
    if regions and regions != list(range(len(layout.tensor) - len(regions), len(layout.tensor))):
        raise _fail(layout, layout.tensor[regions[0]], "regions must be the last axes of the tensor")
    roles = {r for t in (*layout.lists, *layout.tensor) for r in t.roles}
    for role in REQUIRED_ROLES:
        if role not in roles:
            raise LayoutSemanticError(name, 0, len(name), f"the name has no {role.value} role")


def fact_doc(name: str) -> str:
    """A fact's meaning in one line (its docstring, whitespace folded)."""
    return " ".join((getattr(Layout, name).__doc__ or "").split())
