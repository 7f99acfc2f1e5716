"""The kvlayout error family.

Every error derives from :class:`KVLayoutError`, itself a ``ValueError``, so callers that
catch ``ValueError`` (as LMCache's do) keep working.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence

__all__ = [
    "CatalogError",
    "DescriptionError",
    "KVLayoutError",
    "LayoutSemanticError",
    "LayoutSyntaxError",
    "SizeError",
    "TransferError",
    "abbreviated",
    "as_int",
    "at_least",
    "index_ranges",
    "is_bool",
    "or_list",
    "positive",
]


class KVLayoutError(ValueError):
    """Base of every error kvlayout raises about a layout, a format or a KV cache."""


def as_int(value: object, what: str) -> int:
    """``value`` as an int: anything ``operator.index`` takes (NumPy and torch integers
    too), never a bool; a ``TypeError`` naming ``what`` otherwise: how kvlayout takes
    an int from a caller (a few parsers that report their own error class call
    ``operator.index`` themselves)."""
    if type(value) is int:
        return value
    if not is_bool(value):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int, not {type(value).__name__} ({value!r})")


def is_bool(value: object) -> bool:
    """A bool: Python's, or anything of a NumPy or torch bool dtype (a scalar, a 0-d array
    or tensor), which ``operator.index`` or NumPy read as 0 or 1. (NumPy and torch are
    looked up, not imported: their values exist only once they are.)"""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    numpy_bool = np is not None and isinstance(dtype, np.dtype) and dtype == np.bool_
    return numpy_bool or (torch is not None and dtype is torch.bool)


def at_least(value: object, what: str, least: int) -> int:
    """``value`` as an int (:func:`as_int`) of at least ``least``; a ``TypeError``
    saying so otherwise."""
    try:
        n = as_int(value, what)
    except TypeError:
        n = least - 1
    if n < least:
        raise TypeError(f"{what} must be an int of at least {least}, got {value!r}")
    return n


def positive(value: object, what: str, meaning: str, error: type[Exception]) -> int:
    """``value`` as a positive int (:func:`as_int`: NumPy and torch integers too, never a
    bool); ``error`` saying ``what`` must be one (``meaning``: what it is) otherwise, as
    the integrations' readers report a bad size of an engine's pool."""
    try:
        n = as_int(value, what)
    except TypeError:
        n = 0
    if n < 1:
        raise error(f"{what} must be a positive int ({meaning}), not {value!r}")
    return n


def abbreviated(text: str, limit: int = 100, keep: int = 100) -> str:
    """``text`` as a message quotes it: whole up to ``limit`` characters, else its first
    ``keep`` and its length (a caller's or a peer's text may be megabytes)."""
    return text if len(text) <= limit else f"{text[:keep]}... ({len(text)} characters)"


def or_list(values: Sequence[object]) -> str:
    """``[1, 2, 4]`` -> ``1, 2 or 4`` (for messages listing what would fit)."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def index_ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8`` (for messages naming layers)."""
    out: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def caret_under(text: str, start: int, end: int | None = None) -> str:
    """Render ``text`` with a caret line under ``text[start:end]`` (one caret if no end)."""
    width = max(1, (end if end is not None else start + 1) - start)
    return f"  {text}\n  {' ' * start}{'^' * width}"


class LayoutSyntaxError(KVLayoutError):
    """A format name that does not follow the grammar (tokens joined by ``_``).

    Example::

        kvlayout.parse("NL_X_nb")
        LayoutSyntaxError: invalid format name 'NL_X_nb': unexpected character 'n' at column 6
          NL_X_nb
               ^
        a name is upper-case tokens joined by '_', with X between list levels
    """

    def __init__(self, name: str, position: int, problem: str) -> None:
        self.name = name
        self.position = position
        self.problem = problem
        where = f" at column {position + 1}" if name else ""
        super().__init__(
            f"invalid format name {name!r}: {problem}{where}\n"
            f"{caret_under(name, position)}\n"
            "a name is upper-case tokens joined by '_', with X between list levels"
        )


class LayoutSemanticError(KVLayoutError):
    """A well-formed name whose tokens do not describe a layout.

    Example::

        kvlayout.parse("NL_X_NB_NBBS_HS")
        LayoutSemanticError: format name 'NL_X_NB_NBBS_HS': NBBS fuses NB, which the name
        already has
          NL_X_NB_NBBS_HS
                  ^^^^
    """

    def __init__(self, name: str, start: int, end: int, problem: str) -> None:
        self.name = name
        self.start = start
        self.end = end
        self.problem = problem
        super().__init__(f"format name {name!r}: {problem}\n{caret_under(name, start, end)}")


class CatalogError(KVLayoutError):
    """A problem in ``layouts.yaml`` (or a YAML given to the generator), with its line.

    Example::

        CatalogError: layouts.yaml line 97: format NL_X_NB_BS_HS has value 3, which
        NL_X_NB_BS_HS at line 80 already has
    """

    def __init__(self, path: str, line: int, problem: str) -> None:
        self.path = path
        self.line = line
        self.problem = problem
        super().__init__(f"{path} line {line}: {problem}")


class SizeError(KVLayoutError):
    """Sizes or a coordinate that do not fit a layout (a missing size, an index out of range).

    Example::

        SizeError: NL_X_TWO_NB_BS_NH_HS: token 5 is out of range for BS=3
    """


class DescriptionError(KVLayoutError):
    """A description that is not a layout, or a layout spelling that is not an order of axes."""


class TransferError(KVLayoutError):
    """Input a transfer cannot serve (raised before any byte is written)."""
