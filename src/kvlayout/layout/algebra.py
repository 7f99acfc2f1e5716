"""The layout algebra: shapes, strides, offsets and copy plans of a :class:`Layout`.

Pure Python, no torch. This is the oracle the generated C++/CUDA indexers are tested
against, and the generator renders those indexers from the same :func:`structure`.

The model, in CuTe's terms: a layout is list levels (pointer tables) around one tensor
whose axes are *modes*. A logical coordinate ``(layer, kv, block, token, head, elem)``
selects a pointer (mixed radix over the list levels) and an element offset (the sum over
modes of ``index * stride``, strides row-major over the modes' extents, dim 0 optionally
widened to a padded block stride). ``elem`` runs over a head's row in the chunk
(``head_size`` elements); it is split over the *element factors* (the planes of an NP
level, a packed K/V axis, HS or CS, a run of regions) by mixed radix, outermost first.

A run of region tokens (``BSV_BSS``) is one mode that concatenates its regions: region
``r`` holds ``rows`` rows of ``width`` elements after all rows of the regions before it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from kvlayout.errors import SizeError, as_int, or_list
from kvlayout.layout.vocabulary import Role, Token

if TYPE_CHECKING:
    from kvlayout.layout.ast import Layout

__all__ = [
    "COORD_FIELDS",
    "Coord",
    "CopyPlan",
    "ElementFactor",
    "Level",
    "Loop",
    "Mode",
    "Piece",
    "RegionSpan",
    "Structure",
    "Term",
    "axis_of",
    "check_choices",
    "concrete_shape",
    "copy_plan",
    "head_size",
    "kv_size",
    "level_of",
    "list_shape",
    "num_heads",
    "offset",
    "pointer_order",
    "resolve_sizes",
    "role_problem",
    "row_run",
    "size_of",
    "size_symbols",
    "sizes_by_role",
    "structure",
    "symbol_of",
    "tensor_index",
    "tensor_shape",
    "tensor_size_axes",
    "tensor_strides",
    "with_size",
]

Factor = int | str
"""A literal or a size symbol (a token name)."""
Product = tuple[Factor, ...]

COORD_FIELDS = ("layer", "kv", "block", "token", "head", "elem")
_ROLE_COORD = {
    Role.LAYER: "layer",
    Role.KV: "kv",
    Role.BLOCK: "block",
    Role.TOKEN: "token",
    Role.HEAD: "head",
}


@dataclass(frozen=True, slots=True)
class Coord:
    """A logical coordinate: which layer, K or V, block, token of the block, head, and
    element of that head's row (the chunk's view of a token)."""

    layer: int = 0
    kv: int = 0
    block: int = 0
    token: int = 0
    head: int = 0
    elem: int = 0

    def get(self, name: str) -> int:
        return as_int(getattr(self, name), f"Coord.{name}")  # 1.5 is no head (int() truncated it)


@dataclass(frozen=True, slots=True)
class Term:
    """One addend of an index: ``(coord // div) % mod * weight``."""

    coord: str
    weight: Product = ()
    div: Product = ()
    mod: Product | None = None


@dataclass(frozen=True, slots=True)
class RegionSpan:
    """One region of a region run: its element columns ``[start, start + width)``."""

    token: Token
    start: int
    width: int


@dataclass(frozen=True, slots=True)
class Mode:
    """One axis of the leaf tensor in index space (or a run of regions).

    ``storage`` is the mode's contribution to the torch tensor's shape: one axis, or
    ``(rows, total width)`` for a run of regions.
    """

    tokens: tuple[Token, ...]
    extent: Product
    storage: tuple[Product, ...]
    terms: tuple[Term, ...] = ()
    regions: tuple[RegionSpan, ...] = ()
    rows: str | None = None


@dataclass(frozen=True, slots=True)
class Level:
    """One list level: its token, its length, and the coordinate that selects an entry."""

    token: Token
    extent: Product
    term: Term


@dataclass(frozen=True, slots=True)
class ElementFactor:
    """One factor of a head's row: ``elem`` digit ``(elem // div) % extent``."""

    token: Token | None  # None for a run of regions
    extent: Product
    div: Product
    level: int | None = None  # list level index (a plane tuple)
    mode: int | None = None  # tensor mode index


@dataclass(frozen=True, slots=True)
class Structure:
    """A layout resolved into levels, modes and element factors (no sizes yet)."""

    layout: Layout
    levels: tuple[Level, ...]
    modes: tuple[Mode, ...]
    elements: tuple[ElementFactor, ...]

    @property
    def region_mode(self) -> Mode | None:
        return next((m for m in self.modes if m.regions), None)

    @property
    def region_dtypes(self) -> tuple[str | None, ...]:
        """What each region of a record holds, in order (None where a region names no
        dtype); empty for a layout without regions."""
        run = self.region_mode
        return tuple(span.token.region.dtype for span in run.regions if span.token.region) if run else ()


def _symbol(token: Token) -> Product:
    return (token.literal,) if token.literal is not None else (token.name,)


def _role_term(token: Token, weight: Product = ()) -> Term:
    assert token.role is not None
    return Term(_ROLE_COORD[token.role], weight)


def _is_element(layout: Layout, token: Token) -> bool:
    """Does this tensor token index into a head's row (HS, CS, a packed K/V axis)?"""
    roles = set(token.roles)
    if not roles:
        return False
    if Role.KV in roles:
        return layout.is_fused_packed and roles <= {Role.KV, Role.ELEMENT}
    return roles == {Role.ELEMENT}


@functools.lru_cache(maxsize=256)
def structure(layout: Layout) -> Structure:
    """Resolve a layout into its list levels, tensor modes and element factors."""
    # Element factors, outermost first: plane levels, then tensor element axes.
    element_tokens: list[tuple[Token | None, Product, int | None, int | None]] = []
    for i, level in enumerate(layout.lists):
        if level.role is Role.ELEMENT:
            element_tokens.append((level, _symbol(level), i, None))
    modes_tokens: list[tuple[Token, ...]] = []
    for token in layout.tensor:
        if token.region is not None and modes_tokens and modes_tokens[-1][-1].region is not None:
            modes_tokens[-1] = (*modes_tokens[-1], token)
        else:
            modes_tokens.append((token,))
    for m, tokens in enumerate(modes_tokens):
        if tokens[0].region is not None:
            element_tokens.append((None, (sum(t.region.width for t in tokens if t.region),), None, m))
        elif _is_element(layout, tokens[0]):
            element_tokens.append((tokens[0], _symbol(tokens[0]), None, m))
    elements: list[ElementFactor] = []
    for i, (tok, extent, level_index, mode_index) in enumerate(element_tokens):
        inner = tuple(f for _, e, _, _ in element_tokens[i + 1 :] for f in e)
        elements.append(ElementFactor(tok, extent, inner, level_index, mode_index))

    def element_term(*, level: int | None = None, mode: int | None = None) -> Term:
        f = next(e for e in elements if e.level == level and e.mode == mode)
        return Term("elem", (), f.div, f.extent)

    levels = tuple(
        Level(t, _symbol(t), element_term(level=i) if t.role is Role.ELEMENT else _role_term(t))
        for i, t in enumerate(layout.lists)
    )
    modes: list[Mode] = []
    for m, tokens in enumerate(modes_tokens):
        token = tokens[0]
        if token.region is not None:
            rows = token.region.rows
            spans, start = [], 0
            for t in tokens:
                assert t.region is not None
                spans.append(RegionSpan(t, start, t.region.width))
                start += t.region.width
            modes.append(
                Mode(
                    tokens, (rows.name, start), ((rows.name,), (start,)), regions=tuple(spans), rows=rows.name
                )
            )
        elif _is_element(layout, token):
            modes.append(Mode(tokens, _symbol(token), (_symbol(token),), (element_term(mode=m),)))
        else:
            parts = [p for p in token.parts if p.role is not None]
            terms = tuple(
                _role_term(p, tuple(f for q in parts[i + 1 :] for f in _symbol(q)))
                for i, p in enumerate(parts)
            )
            modes.append(Mode(tokens, _symbol(token), (_symbol(token),), terms))
    return Structure(layout, levels, tuple(modes), tuple(elements))


# -- sizes --------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def size_symbols(layout: Layout) -> tuple[Token, ...]:
    """Every sized token the layout names (fused tokens and their parts, region rows)."""
    out: list[Token] = []

    def add(t: Token) -> None:
        if t.literal is None and t not in out:
            out.append(t)
        for f in t.fuses:
            add(f)
        if t.region is not None:
            add(t.region.rows)

    for t in (*layout.lists, *layout.tensor):
        if t.region is None:
            add(t)
        else:
            add(t.region.rows)
    return tuple(out)


class _Resolved(dict[str, int]):
    """Sizes :func:`resolve_sizes` made for ``layout``: passing them on is free, so they
    are read-only (a changed size would skip its checks and leave fused sizes stale)."""

    __slots__ = ("layout",)

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("resolved sizes are read-only; copy them with dict(...)")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _read_only

    def __reduce__(self) -> tuple[type, tuple[dict[str, int]]]:
        return dict, (dict(self),)  # copies and pickles are plain dicts


def resolve_sizes(layout: Layout, sizes: Mapping[str, int]) -> Mapping[str, int]:
    """The sizes a layout needs, keyed by token name.

    A fused token's size defaults to the product of its parts (``NBBS = NB*BS``,
    ``CS = 2*HS``) and may be given by its label too (``PBS``). A size that cannot be
    found is simply absent: the functions that need it raise :class:`SizeError`.
    Sizes this returned for the same layout come back as they are (the algebra's
    functions call each other with resolved sizes). Treat the result as read-only.
    """
    if type(sizes) is _Resolved and sizes.layout is layout:
        return sizes
    out = _Resolved(layout)

    def lookup(t: Token) -> int | None:
        if t.literal is not None:
            return t.literal
        for key in (t.name, t.label):
            if key is not None and key in sizes:
                value = sizes[key]
                if type(value) is not int:  # NumPy and torch integers too, never a bool
                    try:
                        value = as_int(value, key)
                    except TypeError:
                        raise SizeError(f"{layout}: size {key}={value!r} is not a non-negative int") from None
                if value < 0:
                    raise SizeError(f"{layout}: size {key}={value!r} is not a non-negative int")
                if t.choices and value not in t.choices:
                    raise SizeError(f"{layout}: size {key}={value} is not one of {or_list(t.choices)}")
                return value
        if t.fuses:
            parts = [lookup(f) for f in t.fuses]
            if all(p is not None for p in parts):
                return math.prod(p for p in parts if p is not None)
        return None

    for t in size_symbols(layout):
        value = lookup(t)
        if value is not None:
            dict.__setitem__(out, t.name, value)
    return out


def check_choices(layout: Layout, sizes: Mapping[str, int]) -> None:
    """Raise :class:`SizeError` for a size outside its token's ``choices`` (a K/V axis of
    3 planes)."""
    resolve_sizes(layout, sizes)


def _evaluate(layout: Layout, product: Iterable[Factor], sizes: Mapping[str, int]) -> int:
    total = 1
    for f in product:
        if isinstance(f, int):
            total *= f
        elif f in sizes:
            total *= sizes[f]
        else:
            raise SizeError(f"{layout}: this needs a size for {f}")
    return total


def num_heads(layout: Layout, sizes: Mapping[str, int]) -> int:
    """Heads per token row: NH, or 1 when the layout has no head axis."""
    s = resolve_sizes(layout, sizes)
    head = symbol_of(layout, Role.HEAD)
    return 1 if head is None else _evaluate(layout, (head,), s)


def kv_size(layout: Layout, sizes: Mapping[str, int]) -> int:
    """Planes per token row in a chunk: the K/V pair's size where K and V are apart (a
    literal 2, or a K/V axis the tensors size, 1 or 2), else 1 (packed, MLA or single)."""
    static = layout.kv_size
    if static is not None:
        return static
    s = resolve_sizes(layout, sizes)
    symbol = symbol_of(layout, Role.KV)
    assert symbol is not None  # only a sized K/V pair leaves kv_size to the tensors
    return _evaluate(layout, (symbol,), s)


def is_latent(layout: Layout, sizes: Mapping[str, int]) -> bool:
    """One latent row per token (MLA) at these sizes: a layout with neither K/V pair nor
    head axis, or one whose K/V axis the tensors size holds one plane of one head (the
    ``KV`` token's 1: MAX registers MLA so). Latents have no heads to shard: every TP
    rank holds them whole."""
    if layout.is_mla:
        return True
    return layout.kv_size is None and kv_size(layout, sizes) == 1 and num_heads(layout, sizes) == 1


def head_size(layout: Layout, sizes: Mapping[str, int]) -> int:
    """Elements of one head's row in the chunk (the product of the element factors)."""
    s = resolve_sizes(layout, sizes)
    return _evaluate(layout, (f for e in structure(layout).elements for f in e.extent), s)


# -- shapes and strings -------------------------------------------------------------


def _display_size(layout: Layout, token: Token, sizes: Mapping[str, int]) -> str:
    if token.keep_label or token.literal is not None:
        return token.shape_label
    if token.region is not None:
        token = token.region.rows
    return str(_evaluate(layout, (token.name,), sizes))


def concrete_shape(layout: Layout, sizes: Mapping[str, int]) -> str:
    """The shape with numbers: ``NL_X_TWO_NB_BS_NH_HS`` -> ``5 x [2, 7, 3, 2, 4]``.

    Literal and plane tokens keep their label; a region shows its rows.
    """
    s = resolve_sizes(layout, sizes)
    inner = "[" + ", ".join(_display_size(layout, t, s) for t in layout.tensor) + "]"
    return " x ".join([_display_size(layout, t, s) for t in layout.lists] + [inner])


def list_shape(layout: Layout, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The length of each list level, outermost first."""
    s = resolve_sizes(layout, sizes)
    return tuple(_evaluate(layout, lv.extent, s) for lv in structure(layout).levels)


def tensor_shape(layout: Layout, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of each leaf tensor (a run of regions is stored as ``(rows, width)``)."""
    s = resolve_sizes(layout, sizes)
    return tuple(_evaluate(layout, ax, s) for m in structure(layout).modes for ax in m.storage)


def _mode_strides(layout: Layout, sizes: Mapping[str, int], block_stride: int | None) -> list[int]:
    modes = structure(layout).modes
    strides = [0] * len(modes)
    acc = 1
    for i in range(len(modes) - 1, -1, -1):
        strides[i] = acc
        acc *= _evaluate(layout, modes[i].extent, sizes)
    if block_stride:
        if not layout.has_leading_block_axis:
            raise SizeError(f"{layout}: dim 0 is not the block axis, so a block stride cannot apply")
        if block_stride < strides[0]:
            raise SizeError(
                f"{layout}: block stride {block_stride} is smaller than a block's "
                f"{strides[0]} elements (blocks would overlap)"
            )
        strides[0] = block_stride
    return strides


def tensor_strides(
    layout: Layout, sizes: Mapping[str, int], block_stride: int | None = None
) -> tuple[int, ...]:
    """Contiguous strides of each leaf tensor, dim 0 widened to ``block_stride`` if given."""
    s = resolve_sizes(layout, sizes)
    out: list[int] = []
    for mode, stride in zip(structure(layout).modes, _mode_strides(layout, s, block_stride), strict=True):
        if mode.regions:
            out.extend((_evaluate(layout, mode.storage[1], s), 1))
        else:
            out.append(stride)
    return tuple(out)


# -- roles: where each coordinate lives (what hand code asks instead of token names) ------


def _single(mode: Mode) -> Token | None:
    """The mode's one token when it is a plain axis (not a region run)."""
    return mode.tokens[0] if len(mode.tokens) == 1 and not mode.regions else None


def _is_page(token: Token) -> bool:
    return token.region is None and Role.BLOCK in token.roles and Role.TOKEN in token.roles


def axis_of(layout: Layout, role: Role) -> int | None:
    """The leaf tensor axis that holds ``role`` alone, or None.

    A token that fuses the role with others holds no axis of its own (``NB`` of ``NBBS``),
    except for the derived roles: ``PAGE`` is the axis of a token fusing the block and
    token roles, ``REGION`` the concatenated width of a region run, whose rows are the
    ``TOKEN`` axis.
    """
    axis = 0
    for mode in structure(layout).modes:
        token = _single(mode)
        if mode.regions:
            if role is Role.TOKEN:
                return axis
            if role is Role.REGION:
                return axis + 1
        elif token is not None and (token.role is role or (role is Role.PAGE and _is_page(token))):
            return axis
        axis += len(mode.storage)
    return None


def level_of(layout: Layout, role: Role) -> int | None:
    """The list level whose entries are ``role`` (layers, the K/V pair, planes), or None."""
    return next((i for i, t in enumerate(layout.lists) if t.role is role), None)


def symbol_of(layout: Layout, role: Role) -> str | None:
    """The key of ``role``'s size in a sizes mapping: the sized token addressing it (the
    part of a fused token), the fused page token for ``PAGE``; None where no sized token
    addresses it (a literal K/V pair, no heads, a region)."""
    if role is Role.PAGE:
        return next((t.name for t in layout.tensor if _is_page(t)), None)
    for t in (*layout.tensor_parts, *layout.lists):  # a row's own element before planes
        if t.role is role and t.literal is None:
            return t.name
    return None


def size_of(layout: Layout, sizes: Mapping[str, int], role: Role) -> int | None:
    """``role``'s size under ``sizes`` (None when it has none or it is not given); the
    page is ``NB*BS`` when not given folded."""
    s = resolve_sizes(layout, sizes)
    symbol = symbol_of(layout, role)
    if symbol is not None:
        return s.get(symbol)
    if role is Role.PAGE:
        block, token = size_of(layout, s, Role.BLOCK), size_of(layout, s, Role.TOKEN)
        return None if block is None or token is None else block * token
    return None


def with_size(layout: Layout, sizes: Mapping[str, int], role: Role, value: int) -> dict[str, int]:
    """``sizes`` with ``role``'s size set to ``value``."""
    symbol = symbol_of(layout, role)
    if symbol is None:
        raise SizeError(f"{layout}: no sized token addresses the {role.value} role")
    return {**sizes, symbol: value}


def sizes_by_role(layout: Layout, values: Mapping[Role, int]) -> dict[str, int]:
    """A sizes mapping from sizes by role (roles the layout has no token for are skipped)."""
    out: dict[str, int] = {}
    for role, value in values.items():
        symbol = symbol_of(layout, role)
        if symbol is not None:
            out[symbol] = value
    return out


def fold_reason(layout: Layout, role: Role) -> str | None:
    """Why ``role`` has no size of its own, or None: the token that folds it with others
    into one axis (a page ``NBBS`` folds the blocks and their tokens)."""
    page = next((tok for tok in layout.tensor if tok.fuses and role in tok.roles), None)
    if page is None:
        return None
    others = " and ".join(p.name for p in page.parts if p.role is not role and p.literal is None)
    return f"{page.name} folds {symbol_of(layout, role)} and {others} into one axis"


def split_pages(layout: Layout, sizes: Mapping[str, int], block_size: int, what: str) -> dict[str, int]:
    """``sizes`` with the page's token slots (a folded ``NB*BS`` axis) split into blocks of
    ``block_size`` tokens; a ``SizeError`` naming the page axis and ``what`` (the argument
    that gave the block size) where they are not a whole number of them."""
    total = size_of(layout, sizes, Role.PAGE)
    if total is None:  # callers name the layout
        given = resolve_sizes(layout, sizes)
        wanted = [
            symbol_of(layout, r)
            for r in ((Role.PAGE,) if symbol_of(layout, Role.PAGE) else (Role.BLOCK, Role.TOKEN))
        ]
        missing = " and ".join(str(w) for w in wanted if w not in given)
        raise SizeError(f"the sizes {sorted(sizes)} give no page size: {missing} missing")
    if block_size <= 0 or total % block_size:
        label = layout.tensor[axis_of(layout, Role.PAGE) or 0].shape_label
        raise SizeError(  # LMCache's words: "not divisible by tokens_per_block"
            f"{label}={total} token slots are not divisible by {what}={block_size}, so they are not a whole "
            "number of blocks"
        )
    return {**sizes, **sizes_by_role(layout, {Role.BLOCK: total // block_size, Role.TOKEN: block_size})}


@functools.lru_cache(maxsize=256)
def tensor_size_axes(layout: Layout) -> tuple[tuple[str, int], ...]:
    """The sizes a leaf tensor's shape gives: ``(symbol, axis)`` for every axis that is
    one sized token (a region run's rows included)."""
    out: list[tuple[str, int]] = []
    axis = 0
    for mode in structure(layout).modes:
        token = _single(mode)
        if mode.regions and mode.rows is not None:
            out.append((mode.rows, axis))
        elif token is not None and token.literal is None:
            out.append((token.name, axis))
        axis += len(mode.storage)
    return tuple(out)


def role_problem(layout: Layout, role: Role) -> str | None:
    """Why a spec accessor cannot read ``role`` off this layout's structure, or None.

    A fused token may fold blocks with tokens (the page axis) or K/V with a row's elements
    (a packed row), nothing else. Then: the layer role must be a list level or an axis;
    block and token each an axis, or folded together into the page axis; the head role an
    axis, or absent (one head).
    """
    folds = [
        t
        for t in (*layout.lists, *layout.tensor)
        if t.fuses and set(t.roles) not in ({Role.BLOCK, Role.TOKEN}, {Role.KV, Role.ELEMENT}, {Role.ELEMENT})
    ]
    for t in folds:
        roles = set(t.roles)
        if role in (Role.BLOCK, Role.TOKEN) and role in roles:
            return (
                f"the block and token roles are neither apart nor one page axis "
                f"({t} folds {' and '.join(r.value for r in t.roles)})"
            )
        if role in roles:
            return f"the {role.value} role is folded into {t} with {', '.join(r.value for r in t.roles)}"
    if folds:  # the structure cannot be resolved; the roles folded above say why
        return None
    if role is Role.LAYER and axis_of(layout, role) is None and level_of(layout, role) is None:
        return "no axis or list level holds the layer role"
    if role in (Role.BLOCK, Role.TOKEN, Role.PAGE):
        apart = all(axis_of(layout, r) is not None for r in (Role.BLOCK, Role.TOKEN))
        if not apart and axis_of(layout, Role.PAGE) is None:
            return "the block and token roles are neither apart nor one page axis"
    return None


# -- addressing -----------------------------------------------------------------------


def _check_coord(layout: Layout, coord: Coord, s: Mapping[str, int]) -> None:
    def by_role(role: Role) -> tuple[str, int | None]:
        return symbol_of(layout, role) or role.value, size_of(layout, s, role)

    limits = {
        "layer": by_role(Role.LAYER),
        "kv": ("kv_size", kv_size(layout, s)),
        "block": by_role(Role.BLOCK),
        "token": by_role(Role.TOKEN),
        "head": (symbol_of(layout, Role.HEAD) or "heads", num_heads(layout, s)),
        "elem": ("head_size", head_size(layout, s)),
    }
    for name in COORD_FIELDS:
        symbol, limit = limits[name]
        value = coord.get(name)
        if limit is None:
            raise SizeError(f"{layout}: addressing a {name} needs a size for {symbol}")
        if not 0 <= value < limit:
            raise SizeError(f"{layout}: {name} {value} is out of range for {symbol}={limit}")


def _term(layout: Layout, term: Term, coord: Coord, s: Mapping[str, int]) -> int:
    value = coord.get(term.coord) // _evaluate(layout, term.div, s)
    if term.mod is not None:
        value %= _evaluate(layout, term.mod, s)
    return value * _evaluate(layout, term.weight, s)


def _mode_index(layout: Layout, mode: Mode, coord: Coord, s: Mapping[str, int]) -> int:
    """The index along a mode; for a region run, the element offset inside the run."""
    if not mode.regions:
        return sum(_term(layout, t, coord, s) for t in mode.terms)
    elements = structure(layout).elements
    factor = next(e for e in elements if e.token is None)
    col = coord.elem // _evaluate(layout, factor.div, s) % _evaluate(layout, factor.extent, s)
    rows = _evaluate(layout, (mode.rows,) if mode.rows else (), s)
    span = next(r for r in mode.regions if r.start <= col < r.start + r.width)
    return rows * span.start + coord.token * span.width + (col - span.start)


def pointer_index(layout: Layout, coord: Coord, sizes: Mapping[str, int]) -> int:
    """Which entry of the pointer table (list levels in mixed radix) holds ``coord``."""
    s = resolve_sizes(layout, sizes)
    index = 0
    for level in structure(layout).levels:
        index = index * _evaluate(layout, level.extent, s) + _term(layout, level.term, coord, s)
    return index


def offset(
    layout: Layout, coord: Coord, sizes: Mapping[str, int], block_stride: int | None = None
) -> tuple[int, int]:
    """``(pointer index, element offset)`` of a logical coordinate: the oracle."""
    s = resolve_sizes(layout, sizes)
    _check_coord(layout, coord, s)
    modes = structure(layout).modes
    strides = _mode_strides(layout, s, block_stride)
    elems = sum(_mode_index(layout, m, coord, s) * st for m, st in zip(modes, strides, strict=True))
    return pointer_index(layout, coord, s), elems


def tensor_index(layout: Layout, coord: Coord, sizes: Mapping[str, int]) -> tuple[int, tuple[int, ...]]:
    """``(pointer index, index into the leaf tensor)`` of a logical coordinate."""
    s = resolve_sizes(layout, sizes)
    _check_coord(layout, coord, s)
    index: list[int] = []
    for mode in structure(layout).modes:
        i = _mode_index(layout, mode, coord, s)
        if mode.regions:
            width = _evaluate(layout, mode.storage[1], s)
            index.extend(divmod(i, width))
        else:
            index.append(i)
    return pointer_index(layout, coord, s), tuple(index)


def pointer_order(
    layout: Layout,
    sizes: Mapping[str, int],
    layer_indices: Sequence[int] | None = None,
    limit: int | None = None,
) -> list[tuple[int, ...]]:
    """The pointer table: one list-level index path per pointer, in table order (its first
    ``limit`` entries if given: a table of any size costs only what is read).

    Levels vary row-major (outermost slowest), the layer level over ``layer_indices``:
    ``[K layers, V layers]`` gives all K then all V; per-layer tuples interleave.
    """
    s = resolve_sizes(layout, sizes)
    ranges: list[Sequence[int]] = []
    for level in structure(layout).levels:
        if level.token.role is Role.LAYER and layer_indices is not None:
            ranges.append(list(layer_indices))
        else:
            ranges.append(range(_evaluate(layout, level.extent, s)))
    return [tuple(p) for p in itertools.islice(_product(ranges), limit)]


def _product(ranges: Sequence[Sequence[int]]) -> Iterator[list[int]]:
    if not ranges:
        yield []
        return
    for head in ranges[0]:
        for rest in _product(ranges[1:]):
            yield [head, *rest]


# -- copy plans -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loop:
    extent: int
    chunk_stride: int
    cache_stride: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a block's copy that stays on one pointer: it starts at row element
    ``elem`` of token 0, head 0, and copies ``run`` contiguous elements per step of the
    loop nest (outermost loop first)."""

    elem: int
    loops: tuple[Loop, ...]
    run: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How one (kv, layer, block) of the cache maps onto its ``BS`` rows of a chunk.

    A chunk holds token rows of ``row`` elements (``num_heads * head_size``); the block's
    rows are consecutive. Both sides of each innermost copy are contiguous.
    """

    row: int
    pieces: tuple[Piece, ...]


def _coalesce(loops: list[Loop]) -> list[Loop]:
    """Merge loops (innermost first) whose strides continue each other, dropping unit loops."""
    out: list[Loop] = []
    for loop in loops:
        if loop.extent == 1:
            continue
        if out:
            inner = out[-1]
            if (
                loop.chunk_stride == inner.extent * inner.chunk_stride
                and loop.cache_stride == inner.extent * inner.cache_stride
            ):
                out[-1] = Loop(inner.extent * loop.extent, inner.chunk_stride, inner.cache_stride)
                continue
        out.append(loop)
    return out


def _pieces(
    layout: Layout, s: Mapping[str, int], *, tokens: int, chunk_row: int | None = None
) -> list[Piece]:
    st = structure(layout)
    strides = _mode_strides(layout, s, None)
    hs = head_size(layout, s)
    nh = num_heads(layout, s)
    row = chunk_row if chunk_row is not None else nh * hs

    def cache_stride(coord: str, mode: Mode | None = None) -> int:
        for m, stride in zip(st.modes, strides, strict=True):
            if mode is not None and m is not mode:
                continue
            for t in m.terms:
                if t.coord == coord:
                    return stride * _evaluate(layout, t.weight, s)
        return 0

    region = st.region_mode
    # Factors that change pointer or region split the row into pieces; the rest loop.
    splitting = [e for e in st.elements if e.level is not None or e.token is None]
    looping = [e for e in st.elements if e not in splitting]
    starts: list[tuple[int, int | None]] = [(0, None)]  # (elem start, region width)
    for factor in splitting:
        div = _evaluate(layout, factor.div, s)
        if factor.token is None:
            assert region is not None
            starts = [(e0 + r.start * div, r.width) for e0, _ in starts for r in region.regions]
        else:
            n = _evaluate(layout, factor.extent, s)
            starts = [(e0 + d * div, w) for e0, w in starts for d in range(n)]
    pieces: list[Piece] = []
    for elem, width in starts:
        loops = [
            Loop(
                _evaluate(layout, e.extent, s),
                _evaluate(layout, e.div, s),
                strides[e.mode] if e.mode is not None else 0,
            )
            for e in reversed(looping)
        ]
        if width is not None:  # inside one region: columns, then the region's rows
            loops.insert(0, Loop(width, 1, 1))
            token_stride = width
        else:
            token_stride = cache_stride("token")
        loops.append(Loop(nh, hs, cache_stride("head")))
        loops.append(Loop(tokens, row, token_stride))
        merged = _coalesce(loops)
        run = 1
        if merged and merged[0].chunk_stride == 1 and merged[0].cache_stride == 1:
            run = merged.pop(0).extent
        ordered = sorted(merged, key=lambda lp: -lp.cache_stride)  # read the cache in order
        pieces.append(Piece(elem, tuple(ordered), run))
    return pieces


def copy_plan(layout: Layout, sizes: Mapping[str, int], chunk_row: int | None = None) -> CopyPlan:
    """The plan that copies one (kv, layer, block) between the cache and a chunk.

    ``chunk_row`` is the chunk's token stride in elements when a token's row holds more
    than this layout's ``num_heads * head_size`` (several plane tensors share one row).
    """
    s = resolve_sizes(layout, sizes)
    tokens = size_of(layout, s, Role.TOKEN)
    if tokens is None:
        raise SizeError(f"{layout}: a copy plan needs a size for {symbol_of(layout, Role.TOKEN)}")
    row = num_heads(layout, s) * head_size(layout, s)
    if chunk_row is not None and chunk_row < row:
        raise SizeError(f"{layout}: a chunk row of {chunk_row} elements cannot hold a {row}-element row")
    pieces = _pieces(layout, s, tokens=tokens, chunk_row=chunk_row)
    return CopyPlan(row if chunk_row is None else chunk_row, tuple(pieces))


def row_run(layout: Layout, sizes: Mapping[str, int]) -> int:
    """The largest run that tiles every token row contiguously on both sides."""
    s = resolve_sizes(layout, sizes)
    return math.gcd(*(p.run for p in _pieces(layout, s, tokens=1)))
