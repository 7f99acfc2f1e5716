"""The formats of layouts.yaml as layouts: the enum member for an enum, an integer value
or a name, and its parsed :class:`~kvlayout.layout.ast.Layout`.

The enum and the layouts are generated (``kvlayout._generated.formats``); this is the one
place a format given as a value or a name is read, for the layout layer (descriptions)
and the catalog alike.
"""

from __future__ import annotations

import numbers
import operator

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.errors import KVLayoutError
from kvlayout.layout.ast import Layout

__all__ = ["FormatLike", "as_format", "is_one_format", "layout_of"]

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
        swapped = (
            "; a KV cache went where the format goes (normalize_kv_and_discover_format returns "
            "(fmt, kv), normalize_and_discover_per_layer_formats (kv, formats))"
            if isinstance(fmt, (list, tuple)) or hasattr(fmt, "data_ptr")
            else ""
        )
        raise KVLayoutError(
            f"an engine KV format is an EngineKVFormat, int or str, not {type(fmt).__name__}{swapped}"
        ) from None
    try:
        return EngineKVFormat(value)
    except ValueError:
        values = ", ".join(str(int(f)) for f in EngineKVFormat)
        raise KVLayoutError(f"unknown engine KV format value {value} (known values: {values})") from None


def layout_of(fmt: FormatLike) -> Layout:
    """The parsed layout of a format."""
    return LAYOUTS[as_format(fmt)]
