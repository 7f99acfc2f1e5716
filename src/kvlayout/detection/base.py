"""What every detector shares: structure checks, the probe, and the format picker.

A detector never re-lists format facts. It measures the registration (list depth, list
lengths, leaf shapes and dtype), states what its engine's hints decide (HND or NHD, a
folded page buffer or not, where the K/V axis is), and :func:`pick` asks the layout
algebra which of the engine's formats fits: same list depth, same tensor rank, every
literal axis (a K/V pair of 2, a singleton) and literal list level the right size, an axis
of bounded size (a K/V axis of 1 or 2) one of its sizes, a region width (a blocked-scale
page) matched in bytes, K/V pairs of equal shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlayout._generated.formats import FORMAT_INFO, LAYOUTS, EngineKVFormat
from kvlayout.errors import SizeError, or_list
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.binding import RegistrationError
from kvlayout.registration.nesting import describe_path, leaves, map_leaves
from kvlayout.types import ENGINE_LABELS, SIZE_HINTS, EngineType, LayoutHintError

__all__ = [
    "AITER_VECTOR_BYTES",
    "SIZE_HINTS",
    "DetectionError",
    "FormatShape",
    "Probe",
    "check_size_hints",
    "engine_formats",
    "format_shape",
    "match",
    "pick",
    "probe",
    "size_hint_conflict",
    "unfold_shape",
    "unfolded_twin",
    "validate",
]


class DetectionError(RegistrationError):
    """A registration whose structure is inconsistent or fits none of its engine's formats
    (binding's errors, raised while detecting, come as this class)."""


# -- the registration's structure ------------------------------------------------------


AITER_VECTOR_BYTES = 16
"""The bytes of AITER's SHUFFLE layout's innermost vector: ``X = 16 // itemsize`` elements."""


@dataclass(frozen=True, slots=True)
class Probe:
    """A validated registration as detectors read it: the first path's list lengths and
    the tensors at its innermost level inside entry 0 (the other entries match entry 0,
    so a flat list is represented by its first tensor)."""

    depth: int
    lengths: tuple[int, ...]
    leaves: tuple[torch.Tensor, ...]

    @property
    def first(self) -> torch.Tensor:
        return self.leaves[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.leaves[0].shape)

    @property
    def rank(self) -> int:
        return self.leaves[0].dim()

    @property
    def device(self) -> torch.device:
        return self.leaves[0].device

    def describe(self) -> str:
        where = describe_path([0] * self.depth)
        shapes = sorted({tuple(t.shape) for t in self.leaves})
        shape = str(shapes[0]) if len(shapes) == 1 else " / ".join(map(str, shapes))
        if not self.lengths:
            lists = ""
        elif len(self.lengths) == 1:
            lists = f", in a list of {self.lengths[0]}"
        else:
            lists = f", in nested lists of {' x '.join(map(str, self.lengths))}"
        return f"{where}: shape {shape}, dtype {self.first.dtype}{lists}"

    @property
    def aiter_shuffled(self) -> bool:
        """Rank 5 ending in 16-byte vectors: AITER's SHUFFLE K ``[NB, H, D // X, BS, X]`` or V
        ``[NB, H, BS // X, D, X]`` (SGLang's ``vectorized_5d`` pool, ATOM's MHA pool)."""
        return self.rank == 5 and self.first.shape[-1] * self.first.element_size() == AITER_VECTOR_BYTES


def probe(kv: Any) -> Probe:
    """Measure a registration already checked by :func:`validate` (follows entry 0)."""
    node, lengths, siblings = kv, list[int](), (kv,)
    while isinstance(node, (list, tuple)):
        lengths.append(len(node))
        siblings = tuple(node)
        node = node[0]
    return Probe(len(lengths), tuple(lengths), siblings if len(lengths) > 1 else (node,))


def validate(kv: Any) -> Probe:
    """Check a physically ordered registration (containers are lists) and measure it.

    Every path has the same list depth, lists are non-empty, every leaf has the same
    rank and device; every top-level entry has the same structure, shapes and dtypes as
    entry 0. Tensors inside one entry may differ (the planes of an MLA tuple); detectors,
    and binding the result to its format, check what the format needs there.
    """
    node, lengths, path = kv, list[int](), list[int]()
    while isinstance(node, list):
        if not node:
            raise DetectionError(f"{describe_path(path)} is an empty list" if path else "kv_caches is empty")
        lengths.append(len(node))
        parent, node = node, node[0]
        path.append(0)
    leaf0: torch.Tensor = node
    if not lengths:
        return Probe(0, (), (kv,))
    if len(lengths) > 1:
        _check_inner(kv[0], len(lengths) - 1, [0], leaf0)
    if len(lengths) == 1:
        _check_flat(kv, leaf0)
    else:
        for i in range(1, len(kv)):
            _check_same(kv[i], kv[0], [i], [0])
    return Probe(len(lengths), tuple(lengths), tuple(parent) if len(lengths) > 1 else (leaf0,))


def _check_flat(kv: list[Any], leaf0: torch.Tensor) -> None:
    # The common case (one tensor per layer), kept to a few attribute reads per leaf.
    shape, dtype, device = leaf0.shape, leaf0.dtype, leaf0.device
    for i, t in enumerate(kv):
        if not isinstance(t, torch.Tensor):
            raise DetectionError(
                f"{describe_path([i])} is a list, but kv_caches[0] is a tensor (mixed list depths)"
            )
        if t.shape != shape or t.dtype is not dtype or t.device != device:
            _explain(t, leaf0, [i], [0])


def _check_inner(node: Any, levels: int, path: list[int], leaf0: torch.Tensor) -> None:
    """Inside entry 0: uniform depth, non-empty lists, one rank and device."""
    if levels == 0:
        if not isinstance(node, torch.Tensor):
            raise DetectionError(f"{describe_path(path)} is a list, but {_first_path(path)} is a tensor")
        if node.dim() != leaf0.dim():
            where, first = describe_path(path), _first_path(path)
            raise DetectionError(f"{where}: rank {node.dim()} differs from {first} (rank {leaf0.dim()})")
        if node.device != leaf0.device:
            where, first = describe_path(path), _first_path(path)
            raise DetectionError(f"{where}: device {node.device} differs from {first} ({leaf0.device})")
        return
    if not isinstance(node, list):
        raise DetectionError(
            f"{describe_path(path)} is a tensor, but {_first_path(path)} is a list (mixed list depths)"
        )
    if not node:
        raise DetectionError(f"{describe_path(path)} is an empty list")
    for j, child in enumerate(node):
        _check_inner(child, levels - 1, [*path, j], leaf0)


def _first_path(path: Sequence[int]) -> str:
    return describe_path([0] * len(path))


def _check_same(node: Any, ref: Any, path: list[int], ref_path: list[int]) -> None:
    """``node`` has the structure, shapes, dtypes and device of ``ref``."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(node, torch.Tensor):
            where, other = describe_path(path), describe_path(ref_path)
            raise DetectionError(f"{where} is a list, but {other} is a tensor (mixed list depths)")
        if node.shape != ref.shape or node.dtype is not ref.dtype or node.device != ref.device:
            _explain(node, ref, path, ref_path)
        return
    if not isinstance(node, (list, tuple)):
        raise DetectionError(
            f"{describe_path(path)} is a tensor, but {describe_path(ref_path)} is a list (mixed list depths)"
        )
    if len(node) != len(ref):
        raise DetectionError(
            f"{describe_path(path)} has {len(node)} entries, but {describe_path(ref_path)} has {len(ref)}"
        )
    for j, (child, ref_child) in enumerate(zip(node, ref, strict=True)):
        _check_same(child, ref_child, [*path, j], [*ref_path, j])


def _explain(t: torch.Tensor, ref: torch.Tensor, path: list[int], ref_path: list[int]) -> None:
    where, other = describe_path(path), describe_path(ref_path)
    if t.device != ref.device:
        raise DetectionError(f"{where}: device {t.device} differs from {other} ({ref.device})")
    if t.dim() != ref.dim():
        raise DetectionError(f"{where}: rank {t.dim()} differs from {other} (rank {ref.dim()})")
    if t.dtype is not ref.dtype:
        raise DetectionError(f"{where}: dtype {t.dtype} differs from {other} ({ref.dtype})")
    raise DetectionError(
        f"{where}: shape {tuple(t.shape)} differs from {other} {tuple(ref.shape)}; one detection reads "
        "one structure (for layers that differ use normalize_and_discover_per_layer_formats)"
    )


# -- the formats, as the algebra sees them -------------------------------------------------


@dataclass(frozen=True, slots=True)
class FormatShape:
    """What a format's layout fixes about a registration's leaves."""

    fmt: EngineKVFormat
    layout: Layout
    fixed_axes: tuple[tuple[int, int], ...]  # (axis, size): literal axes and region widths
    bounded_axes: tuple[tuple[int, tuple[int, ...]], ...]  # (axis, sizes it may take)
    fixed_levels: tuple[tuple[int, int], ...]  # (level, length): literal list levels
    kv_level: int | None  # a list level holding a K/V pair
    byte_rows: bool  # region widths count bytes: a raw uint8 page (the blocked-scale page)
    kv_axis: int | None  # the leaf axis of the K/V pair, if any

    @property
    def rank(self) -> int:
        return self.layout.tensor_rank

    @property
    def specificity(self) -> int:
        return len(self.fixed_axes) + len(self.fixed_levels)

    def fact(self, name: str) -> object:
        """A fact detectors decide on: the layout's own, or ``kv_axis``."""
        return self.kv_axis if name == "kv_axis" else getattr(self.layout, name)


@functools.cache
def format_shape(fmt: EngineKVFormat) -> FormatShape:
    layout = LAYOUTS[fmt]
    st = algebra.structure(layout)
    fixed, axis = [], 0
    for mode in st.modes:
        for extent in mode.storage:
            if all(isinstance(f, int) for f in extent):
                fixed.append((axis, math.prod(int(f) for f in extent)))
            axis += 1
    levels = tuple(
        (i, math.prod(int(f) for f in level.extent))
        for i, level in enumerate(st.levels)
        if all(isinstance(f, int) for f in level.extent)
    )
    bounded = tuple(
        (axis, t.choices)
        for symbol, axis in algebra.tensor_size_axes(layout)
        for t in algebra.size_symbols(layout)
        if t.name == symbol and t.choices
    )
    return FormatShape(
        fmt,
        layout,
        tuple(fixed),
        bounded,
        levels,
        algebra.level_of(layout, Role.KV),
        st.region_mode is not None,
        layout.axis_of(Role.KV),
    )


@functools.cache
def engine_formats(engine: EngineType) -> tuple[EngineKVFormat, ...]:
    """The formats layouts.yaml says the engine's detector returns (never deprecated ones)."""
    return tuple(f for f in EngineKVFormat if engine.value in FORMAT_INFO[f].engines)


def _registrations(pool: Sequence[EngineKVFormat]) -> str:
    """What the formats look like as registrations: ``a list of rank-3 or rank-5 tensors``."""
    ranks: dict[int, set[int]] = {}
    for f in pool:
        ranks.setdefault(LAYOUTS[f].list_depth, set()).add(format_shape(f).rank)
    what = {0: "a tensor", 1: "a list of tensors", 2: "a list of lists (or tuples) of tensors"}
    return "; ".join(
        f"{what.get(depth, f'{depth} nested lists of tensors')} of rank {or_list(sorted(rs))}"
        for depth, rs in sorted(ranks.items())
    )


def _fit(
    shape: FormatShape, lengths: Sequence[int], leaves: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> str | None:
    """None when the leaves fit the format, else what is missing."""
    for level, n in shape.fixed_levels:
        if lengths[level] != n:
            return f"needs {n} entries at list level {level} (got {lengths[level]})"
    for leaf_shape, _ in leaves:
        for axis, n in shape.fixed_axes:
            if leaf_shape[axis] != n:
                return f"needs dim {axis} == {n} (got {leaf_shape[axis]})"
        for axis, choices in shape.bounded_axes:
            if leaf_shape[axis] not in choices:
                return f"needs dim {axis} in {or_list(choices)} (got {leaf_shape[axis]})"
    if shape.byte_rows and any(dtype != torch.uint8 for _, dtype in leaves):
        return f"is a page of raw bytes (regions counted in bytes), so needs torch.uint8 (got {leaves[0][1]})"
    if shape.kv_level is not None and shape.kv_level == len(lengths) - 1 and len(set(leaves)) > 1:
        return "needs K and V of equal shape and dtype (got " + ", ".join(f"{s} {d}" for s, d in leaves) + ")"
    return None


Decision = tuple[str, str, object]
"""(hint name, the ``FormatShape`` fact it decides, the wanted value or None). A name
with ``{}`` is a sentence the value goes in (a decision no hint made: the default)."""


def _decided(hint: str, fact: str, wanted: object) -> str:
    """A decision as messages show it: ``kv_layout=HND``, not the fact's value."""
    if fact == "is_hnd":
        value = "HND" if wanted else "NHD"
    elif fact == "is_head_outer":
        value = "LHBNC" if wanted else "heads inside blocks"
    else:
        value = str(wanted)
    return hint.format(value) if "{}" in hint else f"{hint}={value}"


def pick(
    engine: EngineType,
    p: Probe,
    *,
    decide: Sequence[Decision] = (),
    prefer: Sequence[str] = (),
    formats: Sequence[EngineKVFormat] | None = None,
    shape: tuple[int, ...] | None = None,
    only: Callable[[FormatShape], bool] | None = None,
) -> EngineKVFormat:
    """The one format of ``engine`` that fits the probe, asked of the layout algebra.

    The engine's formats with the probe's list depth and tensor rank form a family. A
    decision (a hint, or the engine's default) applies where the family has layouts on
    both sides of it (NHD and HND twins, K/V axis 0 or 1); a layout without a twin never
    consults it. Of the layouts that fit, the most specific wins (more literal axes and
    levels: the blocked-scale page over a plain MLA row), then the ``prefer`` facts
    break ties, in order.
    ``shape`` replaces the probe's leaf shape (to ask about a reshape before doing it);
    ``only`` narrows the family. Raises :class:`DetectionError` saying what each
    candidate needed when nothing fits.
    """
    fmt, problem = _choose(engine, p, decide, prefer, formats, shape, only)
    if fmt is None:
        raise DetectionError(problem)
    return fmt


def match(
    engine: EngineType,
    p: Probe,
    *,
    shape: tuple[int, ...] | None = None,
    only: Callable[[FormatShape], bool] | None = None,
) -> EngineKVFormat | None:
    """:func:`pick`, answering None instead of raising when nothing fits."""
    return _choose(engine, p, (), (), None, shape, only)[0]


def _choose(
    engine: EngineType,
    p: Probe,
    decide: Sequence[Decision],
    prefer: Sequence[str],
    formats: Sequence[EngineKVFormat] | None,
    shape: tuple[int, ...] | None,
    only: Callable[[FormatShape], bool] | None,
) -> tuple[EngineKVFormat | None, str]:
    name = ENGINE_LABELS[engine]
    rank = len(shape) if shape is not None else p.rank
    pool = engine_formats(engine) if formats is None else formats
    family = [s for s in map(format_shape, pool) if s.layout.list_depth == p.depth and s.rank == rank]
    if only is not None:
        family = [s for s in family if only(s)]
    if not family:
        return None, (
            f"{name}: no {name} format has list depth {p.depth} and tensor rank {rank} "
            f"({p.describe()}); {name} registers {_registrations(pool)}"
        )
    applied = []
    for hint, fact, wanted in decide:
        if hint == "kv_layout" and fact == "is_hnd" and wanted is True:
            # HND asked for: a layout that orders tokens before heads contradicts it, twin or
            # not (with no HND twin it would read the heads as tokens, silently)
            nhd = [s for s in family if s.layout.orders_heads_and_tokens and not s.layout.is_hnd]
            family = [s for s in family if s not in nhd]
            if not family:
                return None, (
                    f"{name}: layout hint kv_layout=HND, but no {name} format of list depth {p.depth} and "
                    f"tensor rank {rank} holds heads before tokens ({p.describe()}); {name} registers "
                    f"{_registrations(pool)}"
                )
            if nhd:  # named where nothing else fits: the hint is why
                names = ", ".join(s.fmt.name for s in nhd)
                applied.append(f"kv_layout=HND, which rules out {names} (tokens before heads)")
        if wanted is None or len({s.fact(fact) for s in family}) < 2:
            continue
        family = [s for s in family if s.fact(fact) == wanted]
        applied.append(_decided(hint, fact, wanted))
    leaves = [(shape if shape is not None else tuple(t.shape), t.dtype) for t in p.leaves]
    fits, reasons = [], []
    for s in family:
        reason = _fit(s, p.lengths, leaves)
        if reason is None:
            fits.append(s)
        else:
            reasons.append(f"{s.fmt.name} {reason}: {s.layout.describe_shape()}")
    if not fits:
        after = f" (with {', '.join(applied)})" if applied else ""
        return (
            None,
            f"{name}: the registration ({p.describe()}) fits no {name} format{after}: {'; '.join(reasons)}",
        )
    top = max(s.specificity for s in fits)
    fits = [s for s in fits if s.specificity == top]
    for fact in prefer:
        preferred = [s for s in fits if s.fact(fact)]
        if preferred:
            fits = preferred
    if len(fits) > 1:  # a detector bug: its decisions do not separate its formats
        several = ", ".join(s.fmt.name for s in fits)
        raise DetectionError(f"{name}: the registration ({p.describe()}) fits several formats ({several})")
    return fits[0].fmt, ""


# -- size hints -----------------------------------------------------------------------------


def check_size_hints(
    engine: EngineType, fmt: EngineKVFormat, shape: Sequence[int], hints: Any, where: Callable[[], str]
) -> None:
    """Raise :class:`LayoutHintError` for the first size hint that ``fmt``'s reading of
    a leaf ``shape`` contradicts; ``where()`` words the registration (only then)."""
    conflict = size_hint_conflict(fmt, shape, hints)
    if conflict is not None:
        hint, wanted, symbol, read = conflict
        raise LayoutHintError(
            f"{ENGINE_LABELS[engine]}: layout hint {hint}={wanted} contradicts {fmt.name}, whose {symbol} "
            f"is {read} ({where()})"
        )


def size_hint_conflict(
    fmt: EngineKVFormat, shape: Sequence[int], hints: Any
) -> tuple[str, int, str, int] | None:
    """The first size hint that ``fmt``'s reading of a leaf ``shape`` contradicts:
    ``(hint, wanted, token, read)``; None when every hint given agrees (a hint whose
    role has no axis of its own in the format is not read)."""
    layout = LAYOUTS[fmt]
    for hint, role in SIZE_HINTS:
        wanted = getattr(hints, hint)
        if wanted is None:
            continue
        axis = layout.axis_of(role)
        if axis is not None and shape[axis] != wanted:
            return hint, wanted, layout.symbol_of(role) or role.value, int(shape[axis])
    return None


# -- token rows read in blocks ---------------------------------------------------------------


def token_rows_in_blocks(
    engine: EngineType, fmt: EngineKVFormat, kv: Any, tokens_per_block: int | None, where: Callable[[], str]
) -> Any:
    """``kv`` with each leaf's one-token blocks re-viewed as blocks of ``tokens_per_block``:
    where ``fmt`` reads a leaf's token axis (BS) as 1 right inside its block axis, the
    leaf is token rows an engine pages by the hint's block size (ATOM's MLA cache
    ``[NB*BS, 1, 576]``, SGLang's Ascend FIA pool ``[NB*BS, 1, NH, HS]``): block ``b`` is
    rows ``b*BS .. b*BS + BS-1``. A view, never a copy; ``kv`` unchanged where the hint is
    absent, the format's blocks already hold more than one token, or the rows are rows of
    bytes, ``[N, 1, W]`` int8/uint8 (ATOM's MP connector registers each block as one row of
    its bytes, ``[NB, 1, block_bytes]``, which the hint's block size then contradicts, as it
    should; an fp8 pool stored as uint8 with a head axis, ``[N, 1, NH, HS]``, is token rows)."""
    layout = LAYOUTS[fmt]
    block, token = layout.axis_of(Role.BLOCK), layout.axis_of(Role.TOKEN)
    leaf = next((t for _, t in leaves(kv)), None)
    if (
        tokens_per_block is None
        or tokens_per_block == 1
        or leaf is None
        or block is None
        or token != block + 1
        or leaf.shape[token] != 1
        or (leaf.dim() == 3 and leaf.dtype in (torch.int8, torch.uint8))
    ):
        return kv
    for _, t in leaves(kv):
        rows = int(t.shape[block])
        if t.dim() != leaf.dim() or t.shape[token] != 1 or rows % tokens_per_block:
            raise LayoutHintError(
                f"{ENGINE_LABELS[engine]}: {tuple(t.shape)} is token rows (a one-token block axis in "
                f"{fmt.name}), and its {rows} token rows are not divisible by "
                f"tokens_per_block={tokens_per_block} ({where()})"
            )

    def blocks(t: torch.Tensor) -> torch.Tensor:
        shape = (
            *t.shape[:block],
            t.shape[block] // tokens_per_block,
            tokens_per_block,
            *t.shape[token + 1 :],
        )
        return t.view(shape)

    return map_leaves(kv, blocks)


# -- folded page buffers (NB*BS on one axis) -------------------------------------------------


def unfolded_twin(engine: EngineType, fmt: EngineKVFormat) -> EngineKVFormat:
    """The engine's format with the same lists and axes as ``fmt`` but NB and BS apart
    (``TWO_X_NL_X_NBBS_NH_HS`` -> ``TWO_X_NL_X_NB_BS_NH_HS``; a literal ``ONE`` drops)."""
    layout = LAYOUTS[fmt]

    def key(lay: Layout) -> tuple[object, ...]:
        return (lay.lists, tuple(p.name for p in lay.tensor_parts if p.literal is None))

    twins = [
        f for f in engine_formats(engine) if not LAYOUTS[f].is_pbs_fused and key(LAYOUTS[f]) == key(layout)
    ]
    if len(twins) != 1:
        raise DetectionError(f"{ENGINE_LABELS[engine]}: {fmt.name} has no unfolded twin among its formats")
    return twins[0]


def unfold_shape(
    folded: Layout, twin: Layout, shape: Sequence[int], tokens_per_block: int
) -> tuple[int, ...]:
    """The twin's leaf shape for a folded leaf, splitting its page axis (NB*BS) by
    ``tokens_per_block``."""
    sizes = {symbol: shape[axis] for symbol, axis in algebra.tensor_size_axes(folded)}
    try:
        return twin.tensor_shape(algebra.split_pages(folded, sizes, tokens_per_block, "tokens_per_block"))
    except SizeError as e:
        raise DetectionError(str(e)) from None
