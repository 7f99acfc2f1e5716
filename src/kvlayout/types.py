"""The vocabulary of detection: what a KV registration is, which engine made it, and the
hints an engine sends with it.

``LayoutHints`` is a frozen dataclass; every public entry point also accepts a plain
``dict`` (as LMCache's adapters send) and validates it the same way, so a misspelt key,
a wrong type or a non-positive size is a clear error at the boundary instead of a wrong
layout later.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal, Union

from kvlayout.errors import KVLayoutError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DiscoverableKVCache",
    "EngineLike",
    "EngineType",
    "HintsLike",
    "KVLayoutName",
    "KVListLayout",
    "LayoutHintError",
    "LayoutHints",
    "as_engine",
]

DiscoverableKVCache = Union["torch.Tensor", Sequence["DiscoverableKVCache"]]
"""A KV registration: one tensor, or (nested) lists/tuples of tensors."""

KVLayoutName = Literal["NHD", "HND", "BLHNC", "BLNHC"]
KVListLayout = Literal["k_v", "unified"]

_KV_LAYOUTS: tuple[str, ...] = ("NHD", "HND", "BLHNC", "BLNHC")
_HND_LAYOUTS = frozenset({"HND", "BLHNC"})
_KV_LIST_LAYOUTS: tuple[str, ...] = ("k_v", "unified")


class EngineType(str, enum.Enum):
    """A serving engine; detection is the only layer that knows engines."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    ATOM = "atom"

    def __str__(self) -> str:
        return self.value

    @property
    def display_name(self) -> str:
        """How the engine spells itself (``TRT-LLM``), as backend labels and messages do."""
        return _DISPLAY_NAMES.get(self.value, self.value)


_DISPLAY_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TRT-LLM", "atom": "ATOM"}

EngineLike = EngineType | str


def as_engine(engine: object) -> EngineType:
    """The engine for an ``EngineType`` or a string (its value, any case, ``-``/``_`` ignored)."""
    if isinstance(engine, EngineType):
        return engine
    if not isinstance(engine, str):
        raise TypeError(f"a serving engine is an EngineType or a str, not {type(engine).__name__}")
    key = engine.strip().lower().replace("-", "").replace("_", "")  # "TRT-LLM", "trt_llm"
    for member in EngineType:
        if key == member.value:
            return member
    known = ", ".join(m.value for m in EngineType)
    raise KVLayoutError(f"unknown serving engine {engine!r}; known engines: {known}")


class LayoutHintError(KVLayoutError):
    """A layout hint that is unknown, has the wrong value, or contradicts the tensors."""


def _positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True must not pass for tokens_per_block=1.
    if isinstance(value, bool):
        raise TypeError(f"layout hint {name} must be an int, not bool ({value!r})")
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # numpy integers too
    except TypeError:
        raise TypeError(
            f"layout hint {name} must be an int, not {type(value).__name__} ({value!r})"
        ) from None
    if number <= 0:
        raise LayoutHintError(f"layout hint {name} must be a positive int, got {number}")
    return number


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """The choice spelled ``value`` in any case (as engine names are)."""
    if not isinstance(value, str):
        raise TypeError(f"layout hint {name} must be a str, not {type(value).__name__} ({value!r})")
    canonical = next((c for c in choices if c.lower() == value.strip().lower()), None)
    if canonical is None:
        raise LayoutHintError(f"layout hint {name}={value!r} is not one of {', '.join(choices)}")
    return canonical


@dataclass(frozen=True, slots=True)
class LayoutHints:
    """What an engine says about its registration; every field is optional.

    Choices are read in any case (``hnd`` is ``HND``), as engine names are.

    ``kv_layout``: physical order inside a block: ``NHD`` (tokens before heads), ``HND``
    (heads before tokens), or vLLM's blocks-first ``BLNHC``/``BLHNC`` (same per-layer
    order as NHD/HND; only the block stride differs). vLLM without it: HND on the CPU
    (vLLM's CPU backend allocates HND), NHD elsewhere.

    ``num_kv_heads``, ``tokens_per_block``, ``head_dim``: sizes an engine folds away
    (TRT-LLM's flat pool row; SGLang's NB*BS page buffer).

    ``kv_list_layout``: SGLang's list: ``k_v`` (K layers then V layers, flat or as two
    lists) or ``unified`` (one tensor per component, NB and BS on their own axes).

    ``kv_pair_axis``: kvlayout's own hint for vLLM's 5-D per-layer caches, where the K/V
    axis of size 2 is dim 0 (flash-attn ``[2, NB, ...]``) or dim 1 (flash-infer
    ``[NB, 2, ...]``). Shapes settle it unless NB == 2; then K/V-first is assumed and
    ``kv_pair_axis=1`` says otherwise. It is checked against the shape, never ignored.
    """

    kv_layout: KVLayoutName | None = None
    num_kv_heads: int | None = None
    tokens_per_block: int | None = None
    kv_list_layout: KVListLayout | None = None
    head_dim: int | None = None
    kv_pair_axis: int | None = None

    def __post_init__(self) -> None:
        if self.kv_layout is not None:
            object.__setattr__(self, "kv_layout", _choice("kv_layout", self.kv_layout, _KV_LAYOUTS))
        if self.kv_list_layout is not None:
            object.__setattr__(
                self, "kv_list_layout", _choice("kv_list_layout", self.kv_list_layout, _KV_LIST_LAYOUTS)
            )
        for name in ("num_kv_heads", "tokens_per_block", "head_dim"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _positive_int(name, value))
        if self.kv_pair_axis is not None:
            if isinstance(self.kv_pair_axis, bool) or not isinstance(self.kv_pair_axis, int):
                raise TypeError(
                    f"layout hint kv_pair_axis must be an int, not {type(self.kv_pair_axis).__name__}"
                )
            if self.kv_pair_axis not in (0, 1):
                raise LayoutHintError(
                    f"layout hint kv_pair_axis must be 0 (K/V first, [2, NB, ...]) or 1 "
                    f"(blocks first, [NB, 2, ...]), got {self.kv_pair_axis}"
                )

    @classmethod
    def coerce(cls, hints: HintsLike) -> LayoutHints:
        """Hints from ``None``, a ``LayoutHints`` or a mapping; unknown keys are errors."""
        if hints is None:
            return _NO_HINTS
        if isinstance(hints, LayoutHints):
            return hints
        if not isinstance(hints, Mapping):
            raise TypeError(f"layout_hints must be a LayoutHints or a dict, not {type(hints).__name__}")
        unknown = [k for k in hints if k not in _FIELDS]
        if unknown:
            raise LayoutHintError(
                f"unknown layout hint {unknown[0]!r}; known hints: {', '.join(sorted(_FIELDS))}"
            )
        return cls(**{k: v for k, v in hints.items() if v is not None})  # type: ignore[arg-type]

    @property
    def is_hnd(self) -> bool | None:
        """Heads before tokens per the ``kv_layout`` hint; None without one."""
        return None if self.kv_layout is None else self.kv_layout in _HND_LAYOUTS


HintsLike = LayoutHints | Mapping[str, object] | None

_FIELDS = frozenset(f.name for f in fields(LayoutHints))
_NO_HINTS = LayoutHints()
