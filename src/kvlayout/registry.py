"""Format -> spec class, layout and shape strings (the generated tables, looked up)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping
from typing import Any

from kvlayout._generated.formats import FORMAT_INFO, LAYOUTS, EngineKVFormat, FormatInfo
from kvlayout._generated.specs import SPEC_CLASSES
from kvlayout.errors import KVLayoutError
from kvlayout.layout import Layout
from kvlayout.spec import KVFormatSpec
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

FormatLike = EngineKVFormat | int | str
"""A format as the enum, its integer value (a NumPy integer too), or its name."""


def is_one_format(value: object) -> bool:
    """A single format (not a per-layer sequence of them): the enum, a name or an integer
    (NumPy's and torch's 0-d ones too)."""
    if isinstance(value, (EngineKVFormat, str, numbers.Integral)):
        return True
    return hasattr(type(value), "__index__") and getattr(value, "ndim", 0) == 0


def as_format(fmt: FormatLike) -> EngineKVFormat:
    """The enum member for an enum, an integer value or a name; a clear error otherwise."""
    if type(fmt) is EngineKVFormat:
        return fmt
    if isinstance(fmt, bool):
        raise KVLayoutError(f"{fmt!r} is not an engine KV format")
    if isinstance(fmt, str):
        member = EngineKVFormat.__members__.get(fmt)
        if member is None:
            raise KVLayoutError(
                f"unknown engine KV format {fmt!r}; kvlayout.parse() reads any layout name, "
                "but only the formats of layouts.yaml have a value"
            )
        return member
    try:
        value = operator.index(fmt)  # NumPy and torch integers too
    except TypeError:
        raise KVLayoutError(
            f"an engine KV format is an EngineKVFormat, int or str, not {type(fmt).__name__}"
        ) from None
    try:
        return EngineKVFormat(value)
    except ValueError:
        values = ", ".join(str(int(f)) for f in EngineKVFormat)
        raise KVLayoutError(f"unknown engine KV format value {value} (known values: {values})") from None


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


def layout_of(fmt: FormatLike) -> Layout:
    """The parsed layout of a format."""
    return LAYOUTS[as_format(fmt)]


def describe_shape(fmt: FormatLike) -> str:
    """``TWO_X_NL_X_NBBS_NH_HS`` -> ``2 x NL x [PBS, NH, HS]``."""
    return layout_of(fmt).describe_shape()


def concrete_shape(fmt: FormatLike, sizes: Mapping[str, int]) -> str:
    """The shape with numbers for the given sizes (keys are token names, e.g. ``NB``)."""
    return layout_of(fmt).concrete_shape(sizes)


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
