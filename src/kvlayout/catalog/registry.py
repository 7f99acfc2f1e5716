"""Format -> spec class, layout and shape strings (the generated tables, looked up).

``as_format`` and ``layout_of`` live with the layouts (:mod:`kvlayout.layout.formats`,
so descriptions can name a format without the catalog); they are re-exported here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvlayout._generated.formats import FORMAT_INFO, EngineKVFormat, FormatInfo
from kvlayout._generated.specs import SPEC_CLASSES
from kvlayout.catalog.spec import KVFormatSpec
from kvlayout.layout.formats import FormatLike, as_format, is_one_format, layout_of
from kvlayout.types import ENGINE_LABELS, EngineType

__all__ = [
    "FormatLike",
    "as_format",
    "backend_label",
    "concrete_shape",
    "describe_shape",
    "get_spec",
    "get_spec_class",
    "is_one_format",
    "layout_of",
]


def get_spec_class(fmt: FormatLike) -> type[KVFormatSpec]:
    """The generated spec class of a format (static facts, describe_shape)."""
    cls = SPEC_CLASSES[as_format(fmt)]
    assert cls is not None  # every enum member has a class
    return cls


def get_spec(kv: Any, fmt: FormatLike) -> KVFormatSpec:
    """A spec over a normalized registration (as detection returns it); cheap, never cache it."""
    cls = SPEC_CLASSES[fmt if type(fmt) is EngineKVFormat else as_format(fmt)]
    assert cls is not None
    return cls(kv)


def describe_shape(fmt: FormatLike) -> str:
    """``TWO_X_NL_X_NBBS_NH_HS`` -> ``2 x NL x [PBS, NH, HS]``."""
    return layout_of(fmt).describe_shape()


def concrete_shape(fmt: FormatLike, sizes: Mapping[str, int] | Callable[[str], int]) -> str:
    """The shape with numbers for the given sizes: keys are token names (``NB``) or
    labels (``PBS``); or LMCache's ``size(label)`` callable, asked for each label
    ``describe_shape`` shows that is not a literal (``BSxVALS`` and ``BSxSCALES`` are a
    blocked-scale page's rows, so their answer is its block size)."""
    layout = layout_of(fmt)
    if not isinstance(sizes, Mapping):
        if not callable(sizes):
            raise TypeError(f"sizes must be a mapping or a callable of a label, not {type(sizes).__name__}")
        asked: dict[str, int] = {}
        for token in (*layout.lists, *layout.tensor):
            if token.keep_label or token.literal is not None:
                continue
            key = token.region.rows.name if token.region is not None else token.shape_label
            asked[key] = sizes(token.shape_label)
        sizes = asked
    return layout.concrete_shape(sizes)


def backend_label(fmt: FormatLike, engine: EngineType | None = None) -> str:
    """The attention backend to name in a log line: the first of the format's backends
    that is ``engine``'s (labels start with the engine's name), else the first one."""
    backends = FORMAT_INFO[as_format(fmt)].backends
    if engine is not None:
        name = ENGINE_LABELS[engine]
        mine = next(
            (b for b in backends if b == name or b.startswith((f"{name} ", f"{name}-", f"{name}:"))), None
        )
        if mine is not None:
            return mine
    return backends[0] if backends else f"Unknown ({as_format(fmt).name})"


def format_info(fmt: FormatLike) -> FormatInfo:
    """What a name cannot say about a format: backends, engines, deprecation."""
    return FORMAT_INFO[as_format(fmt)]
