"""The token vocabulary of format names: what each token means.

The vocabulary is data (the ``tokens`` section of ``layouts.yaml``); this module only
defines its shape. The grammar knows identifiers, ``_`` and ``X``; everything a token
means (the logical coordinate it addresses, a literal size, a fusion of other tokens, a
region of a blocked page) comes from here.

vLLM's layout spellings are vocabulary too: the ``kv_layout`` hint spells a physical
order with one letter per :class:`Axis` (``LBNHC``, LMCache's ``NHD``), so the hints and
the descriptions read the same names from here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvlayout.errors import DescriptionError

__all__ = [
    "BLOCKS_FIRST_KV_LAYOUTS",
    "HEAD_OUTER_KV_LAYOUTS",
    "HND_KV_LAYOUTS",
    "KV_LAYOUT_ALIASES",
    "KV_LAYOUT_NAMES",
    "LAYER_INNER_KV_LAYOUTS",
    "Axis",
    "Region",
    "Role",
    "Token",
    "Vocabulary",
    "kv_layout_axes",
    "transferable",
    "untransferable",
]


class Role(enum.Enum):
    """The logical coordinate an axis addresses.

    Tokens declare the first six in ``layouts.yaml``. ``PAGE`` and ``REGION`` are never
    declared: the algebra derives them (a token fusing the block and token roles is the
    page axis, ``NB*BS``; a run of region tokens is a blocked page's region axis), so code
    can ask for them by role like the others.
    """

    LAYER = "layer"
    KV = "kv"
    BLOCK = "block"
    TOKEN = "token"
    HEAD = "head"
    ELEMENT = "element"
    PAGE = "page"
    REGION = "region"

    @property
    def declared(self) -> bool:
        """Whether a token may declare this role (PAGE and REGION are derived)."""
        return self not in (Role.PAGE, Role.REGION)


@dataclass(frozen=True, slots=True)
class Region:
    """One region of a blocked page: ``rows`` rows (a token axis) of ``width`` elements.

    Consecutive region tokens are stored one after the other inside a block (all rows of
    the first region, then all rows of the next); a token's row is the concatenation of
    its row in each region, in name order.
    """

    rows: Token
    width: int
    dtype: str | None = None  # what the region's bytes hold (a torch dtype name), if it says


@dataclass(frozen=True, slots=True)
class Token:
    """One token of the vocabulary.

    Exactly one of ``role``, ``literal``-only, ``fuses`` or ``region`` describes what the
    token is; the catalog loader enforces it. ``choices`` are the only sizes a sized token
    may take (a K/V axis of 1 or 2 planes); ``example`` and ``small`` are the sizes
    ``kvlayout explain`` and its pictures use when none are given.
    """

    name: str
    meaning: str
    role: Role | None = None
    literal: int | None = None
    fuses: tuple[Token, ...] = ()
    region: Region | None = None
    label: str | None = None
    keep_label: bool = False
    choices: tuple[int, ...] = ()
    example: int | None = None
    small: int | None = None

    @property
    def parts(self) -> tuple[Token, ...]:
        """The token with its fusions expanded (``NBBS`` -> ``NB, BS``)."""
        if not self.fuses:
            return (self,)
        return tuple(p for f in self.fuses for p in f.parts)

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles the token addresses once fusions are expanded; a region addresses
        its rows' role and the element."""
        if self.region is not None:
            return (*self.region.rows.roles, Role.ELEMENT)
        return tuple(p.role for p in self.parts if p.role is not None)

    def __str__(self) -> str:
        return self.name

    @property
    def shape_label(self) -> str:
        """How ``describe_shape`` renders the token."""
        if self.label is not None:
            return self.label
        if self.literal is not None:
            return str(self.literal)
        return self.name


@dataclass(frozen=True)
class Vocabulary(Mapping[str, Token]):
    """The tokens by name, in declaration order."""

    tokens: tuple[Token, ...]
    _by_name: dict[str, Token] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tokens})

    def __getitem__(self, name: str) -> Token:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __hash__(self) -> int:
        return hash(self.tokens)


class Axis(enum.Enum):
    """A logical axis (the value is its letter in vLLM's layout spellings)."""

    KV = "KV"  # the K/V pair
    L = "L"  # layers
    B = "B"  # blocks
    N = "N"  # token slots of a block
    H = "H"  # KV heads
    C = "C"  # a head's row content (HS, or 2*HS with K and V packed in it)


# -- vLLM's layout spellings -------------------------------------------------------------

KV_LAYOUT_ALIASES: Mapping[str, str] = MappingProxyType({"NHD": "LBNHC", "HND": "LBHNC"})
"""LMCache's short names for vLLM's per-layer spellings."""

_ORDER_AXES = (Axis.L, Axis.B, Axis.N, Axis.H, Axis.C)


def kv_layout_axes(name: str) -> tuple[Axis, ...]:
    """vLLM's layout spelling (``LBNHC``, ``BLHNC``, or LMCache's ``NHD``/``HND``) as
    axes, outermost first; :class:`DescriptionError` unless it orders L, B, N, H, C."""
    if not isinstance(name, str):
        raise TypeError(f"a kv_layout is a str, not {type(name).__name__}")
    letters = KV_LAYOUT_ALIASES.get(name, name)
    by_letter = {a.value: a for a in _ORDER_AXES}
    axes = tuple(by_letter[ch] for ch in letters if ch in by_letter)
    if len(axes) != len(letters) or len(axes) != len(_ORDER_AXES) or len(set(axes)) != len(axes):
        raise DescriptionError(f"kv_layout {name!r} is not an ordering of L, B, H, N, C")
    return axes


def untransferable(axes: tuple[Axis, ...]) -> str | None:
    """Why no format describes an axis order (None when one does). A layer's block is a
    token run per head or for all heads: the content innermost, the tokens inner to the
    layers and blocks, the heads inner to the layers (inside the blocks, or outside them
    as in ``LHBNC``: one run per head a block), or outer to the layers inside the blocks
    (``BHLNC``: each block holds every layer's rows per head, read as one cross-layer
    allocation)."""
    pos = {a: i for i, a in enumerate(axes)}
    if pos[Axis.C] != len(axes) - 1:
        return "a head's row content is not innermost"
    if pos[Axis.N] < max(pos[Axis.L], pos[Axis.B]):
        return "tokens outside the blocks or layers split every block's token run"
    if pos[Axis.H] < min(pos[Axis.L], pos[Axis.B]):
        return "heads outside both the layers and the blocks split every layer's blocks per head"
    return None


def transferable(axes: tuple[Axis, ...]) -> bool:
    """Whether a format describes an axis order (:func:`untransferable` has no reason)."""
    return untransferable(axes) is None


def _spelling(axes: tuple[Axis, ...]) -> str:
    return "".join(a.value for a in axes)


KV_LAYOUT_NAMES: tuple[str, ...] = (
    *KV_LAYOUT_ALIASES,
    *sorted(_spelling(p) for p in itertools.permutations(_ORDER_AXES) if transferable(p)),
)
"""Every ``kv_layout`` hint kvlayout accepts: the aliases, then vLLM's transferable spellings."""

HND_KV_LAYOUTS: frozenset[str] = frozenset(
    n for n in KV_LAYOUT_NAMES if kv_layout_axes(n).index(Axis.H) < kv_layout_axes(n).index(Axis.N)
)
"""The spellings with heads before tokens (inside a block, or outside it)."""

HEAD_OUTER_KV_LAYOUTS: frozenset[str] = frozenset(
    n for n in KV_LAYOUT_NAMES if kv_layout_axes(n).index(Axis.H) < kv_layout_axes(n).index(Axis.B)
)
"""The spellings with heads outside blocks (``LHBNC``): a block is one token run per head."""

LAYER_INNER_KV_LAYOUTS: frozenset[str] = frozenset(
    n for n in KV_LAYOUT_NAMES if kv_layout_axes(n).index(Axis.H) < kv_layout_axes(n).index(Axis.L)
)
"""The spellings with layers inner to heads (``BHLNC``): one allocation whose blocks hold
each head's rows of every layer, read as a cross-layer tensor."""

BLOCKS_FIRST_KV_LAYOUTS: frozenset[str] = frozenset(
    n for n in KV_LAYOUT_NAMES if kv_layout_axes(n).index(Axis.B) < kv_layout_axes(n).index(Axis.L)
)
"""The spellings whose blocks are outer to layers (a layer's block step spans every layer)."""
