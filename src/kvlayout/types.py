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

from kvlayout._generated.engines import ENGINE_LABELS, EngineType
from kvlayout.errors import DescriptionError, KVLayoutError, as_int
from kvlayout.layout.vocabulary import (
    HEAD_OUTER_KV_LAYOUTS,
    HND_KV_LAYOUTS,
    KV_LAYOUT_NAMES,
    LAYER_INNER_KV_LAYOUTS,
    Role,
    kv_layout_axes,
    untransferable,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENGINE_LABELS",
    "HICACHE_LAYOUT_NAMES",
    "KVBM_LAYOUT_NAMES",
    "KV_LAYOUT_NAMES",
    "KV_LIST_LAYOUT_NAMES",
    "DiscoverableKVCache",
    "EngineLike",
    "EngineType",
    "HiCacheLayout",
    "HintsLike",
    "KVBMLayout",
    "KVLayoutName",
    "KVListLayout",
    "LayoutHintError",
    "LayoutHints",
    "as_engine",
]

DiscoverableKVCache = Union["torch.Tensor", Sequence["DiscoverableKVCache"]]
"""A KV registration: one tensor, or (nested) lists/tuples of tensors."""

KVLayoutName = Literal["NHD", "HND", "BHLNC", "BLHNC", "BLNHC", "LBHNC", "LBNHC", "LHBNC"]
"""The ``kv_layout`` spellings (:data:`KV_LAYOUT_NAMES`, derived from the axis orders)."""
KVListLayout = Literal["k_v", "unified"]

KV_LIST_LAYOUT_NAMES: tuple[str, ...] = ("k_v", "unified")
"""Every ``kv_list_layout`` hint SGLang sends."""
HiCacheLayout = Literal["layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split"]

HICACHE_LAYOUT_NAMES: tuple[str, ...] = (
    "layer_first",
    "page_first",
    "page_first_direct",
    "page_head",
    "page_first_kv_split",
)
"""The layouts of SGLang's HiCache host pools (``--hicache-mem-layout``) kvlayout reads."""
KVBMLayout = Literal["universal_tp", "universal_pp", "operational_nhd", "operational_hnd"]

KVBM_LAYOUT_NAMES: tuple[str, ...] = ("universal_tp", "universal_pp", "operational_nhd", "operational_hnd")
"""Dynamo KVBM's block layouts (``KvBlockLayout::name()``) of a fully contiguous pool kvlayout reads."""

EngineLike = EngineType | str | enum.Enum
"""An engine: kvlayout's EngineType, its value or label, or another enum's member naming one (LMCache's)."""


_ENGINE_VALUES: dict[str, EngineType] = {m.value: m for m in EngineType}


def as_engine(engine: object) -> EngineType:
    """The engine for an ``EngineType`` or a string (its value or label, any case,
    ``-``/``_``/spaces ignored), or another package's enum member whose value is such a
    string (LMCache's ``EngineType.VLLM``, ``"vllm"``)."""
    if isinstance(engine, EngineType):
        return engine
    if isinstance(engine, enum.Enum) and isinstance(engine.value, str):
        engine = engine.value
    exact = _ENGINE_VALUES.get(engine) if isinstance(engine, str) else None
    if exact is not None:  # the common spelling, without normalizing
        return exact
    if not isinstance(engine, str):
        raise TypeError(
            "a serving engine is an EngineType, a str or an enum member whose value is a str, "
            f"not {type(engine).__name__}"
        )

    def key(text: str) -> str:  # "TRT-LLM", "trt_llm"
        return text.strip().lower().replace("-", "").replace("_", "").replace(" ", "")

    for member in EngineType:
        if key(engine) in (member.value, key(ENGINE_LABELS[member])):
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

    ``kv_layout``: physical order, in vLLM's spellings (a name, or an enum member of one,
    as vLLM's ``KVCacheLayout``; one letter per axis, outermost first: L layers, B blocks,
    N tokens, H heads, C content): ``LBNHC`` (alias ``NHD``, tokens before heads), ``LBHNC``
    (alias ``HND``, heads before tokens), or vLLM's
    blocks-first ``BLNHC``/``BLHNC`` (same per-layer order; only the block stride
    differs), or ``LHBNC`` (heads, or a backend's head slots, outside blocks: ROCm
    attention's first choice; a block is one token run per head), or ``BHLNC`` (layers
    inside heads inside blocks: vLLM's per-layer views of one allocation, read as one
    cross-layer tensor; vLLM's views show it, so it needs no hint). Detectors choose
    NHD/HND twins by it; vLLM without it: HND on the CPU (vLLM's CPU backend allocates
    HND), NHD elsewhere.

    ``num_kv_heads``, ``tokens_per_block`` (alias ``page_size``), ``head_dim``,
    ``num_layers``, ``total_num_blocks``, ``kv_dim`` (K/V planes: 2, or 1 for MLA): sizes
    an engine states or folds away (TRT-LLM's flat pool row, SGLang's NB*BS page buffer,
    MAX's registration); every detector checks the ones its format has an axis for.
    ``kv_dim=1`` also tells vLLM 0.26+'s MLA ``[NB, 1, BS, C]`` layers (latents) from a
    one-head fused K | V cache of the same shape.

    ``layout_format``: the format the engine says it registers (MAX sends
    ``NB_KV_NL_BS_NH_HS``); detection must agree with it.

    ``kv_list_layout``: SGLang's list: ``k_v`` (K layers then V layers, flat or as two
    lists) or ``unified`` (one tensor per component, NB and BS on their own axes).

    ``hicache_layout``: the layout of an SGLang HiCache host pool (``mem_pool_host.layout``,
    SGLang's ``--hicache-mem-layout``) whose ``kv_buffer`` is registered as one tensor:
    ``layer_first`` (``[2, NL, size, NH, HS]``), ``page_first`` (``[2, size, NL, NH, HS]``),
    ``page_first_direct`` (``[2, pages, NL, page_size, NH, HS]``) or ``page_head``
    (``[2, pages, NH, page_size, NL, HS]``); an MLA pool has no K/V axis and one head.
    ``page_first_kv_split`` is Ascend's MLA host pool (SGLang's default there with HiCache):
    two tensors, ``k_buffer`` (its ``kv_buffer``, the latents) and ``v_buffer`` (the RoPE
    part), each ``[pages, NL, page_size, 1, C]`` and read as ``page_first_direct``, one apart
    from the other; an MHA pool has no such layout.

    ``kvbm_layout``: the block layout of a Dynamo KVBM fully contiguous pool registered as
    one tensor ``[num_blocks, ...]``, as KVBM names it (``KvBlockLayout::name()``):
    ``universal_tp`` (a block ``[nh, nl, no, nt, hd]``, heads outermost: TP-agnostic),
    ``universal_pp`` (``[nl, nh, no, nt, hd]``), ``operational_nhd`` (``[nl, no, nt, nh, hd]``)
    or ``operational_hnd`` (``[nl, no, nh, nt, hd]``); ``no`` is 2 (K and V) or 1 (MLA).

    ``attn_backend``: vLLM's attention backend, as vLLM names it (``attn_backend.get_name()``:
    ``CPU_ATTN``, ``FLASH_ATTN``, ...); only vLLM's detector reads it. Every name is taken;
    ``CPU_ATTN`` (vLLM's CPU platform) packs each block's K and V per ISA, so its layers are
    read as whole opaque pages a block, which move only to caches paged alike. vLLM tensors
    on the CPU with neither this nor ``kv_layout`` are read so too. A ROCm backend's name
    (``ROCM_ATTN``, ``ROCM_AITER_MLA_SPARSE``, ...), like a ROCm torch build's GPU tensors,
    reads the DSA indexer as written on ROCm (whole opaque pages: SHUFFLE tiles, aiter's
    MXFP4 order). Head-slot attention pages carry the name, since ROCM_ATTN,
    ROCM_SEGMENTED_ATTN and AITER FA lay the same slots out differently.

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
    num_layers: int | None = None
    total_num_blocks: int | None = None
    kv_dim: int | None = None
    page_size: int | None = None
    layout_format: str | None = None
    hicache_layout: HiCacheLayout | None = None
    attn_backend: str | None = None
    kvbm_layout: KVBMLayout | None = None  # last: the fields before keep their positions

    def __post_init__(self) -> None:
        if self.kv_layout is not None:
            object.__setattr__(self, "kv_layout", _kv_layout(self.kv_layout))
        if self.kv_list_layout is not None:
            object.__setattr__(
                self, "kv_list_layout", _choice("kv_list_layout", self.kv_list_layout, KV_LIST_LAYOUT_NAMES)
            )
        if self.hicache_layout is not None:
            object.__setattr__(
                self, "hicache_layout", _choice("hicache_layout", self.hicache_layout, HICACHE_LAYOUT_NAMES)
            )
        if self.kvbm_layout is not None:
            object.__setattr__(
                self, "kvbm_layout", _choice("kvbm_layout", self.kvbm_layout, KVBM_LAYOUT_NAMES)
            )
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _positive_int(name, value))
        if self.page_size is not None:  # MAX sends both; they are one size
            if self.tokens_per_block is not None and self.tokens_per_block != self.page_size:
                raise LayoutHintError(
                    f"layout hints tokens_per_block={self.tokens_per_block} and page_size={self.page_size} "
                    "disagree (page_size is another name for tokens_per_block)"
                )
            object.__setattr__(self, "tokens_per_block", self.page_size)
        if self.layout_format is not None:
            _layout_format(self.layout_format)
        if self.attn_backend is not None:
            object.__setattr__(self, "attn_backend", _backend_name(self.attn_backend))
        if self.kv_pair_axis is not None:
            object.__setattr__(self, "kv_pair_axis", as_int(self.kv_pair_axis, "layout hint kv_pair_axis"))
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
        return None if self.kv_layout is None else self.kv_layout in HND_KV_LAYOUTS

    @property
    def is_head_outer(self) -> bool | None:
        """Heads outside blocks (``LHBNC``) per the ``kv_layout`` hint; None without one."""
        return None if self.kv_layout is None else self.kv_layout in HEAD_OUTER_KV_LAYOUTS

    @property
    def is_layer_inner(self) -> bool | None:
        """Layers inside heads (``BHLNC``) per the ``kv_layout`` hint; None without one."""
        return None if self.kv_layout is None else self.kv_layout in LAYER_INNER_KV_LAYOUTS


def _kv_layout(value: object) -> str:
    """The ``kv_layout`` spelling, in any case; an order no format describes refused."""
    if isinstance(value, enum.Enum) and value.name in KV_LAYOUT_NAMES:
        return value.name  # vLLM's KVCacheLayout (get_resolved_kv_cache_layout()): named as the hint
    if not isinstance(value, str):
        raise TypeError(f"layout hint kv_layout must be a str, not {type(value).__name__} ({value!r})")
    if value.strip().upper() in KV_LAYOUT_NAMES:
        return value.strip().upper()
    try:
        axes = kv_layout_axes(value.strip().upper())
    except DescriptionError:
        raise LayoutHintError(
            f"layout hint kv_layout={value!r} is not one of {', '.join(KV_LAYOUT_NAMES)}"
        ) from None
    why = untransferable(axes)
    assert why is not None
    raise LayoutHintError(
        f"layout hint kv_layout={value!r}: {why}, which no format describes; use one of "
        f"{', '.join(KV_LAYOUT_NAMES)}"
    )


def _backend_name(value: object) -> str:
    """vLLM's attention backend name as vLLM spells it (``CPU_ATTN``: its enum names are upper
    case, so ``cpu_attn`` names it too), checked: a non-empty str."""
    if not isinstance(value, str):
        raise LayoutHintError(
            f"layout hint attn_backend must be a str (vLLM's attn_backend.get_name(), e.g. 'CPU_ATTN'), "
            f"not {type(value).__name__} ({value!r})"
        )
    name = value.strip()
    if not name:
        raise LayoutHintError(
            "layout hint attn_backend is empty: pass vLLM's attn_backend.get_name() (e.g. 'CPU_ATTN')"
        )
    return name.upper()


def _layout_format(value: object) -> None:
    from kvlayout._generated.formats import EngineKVFormat

    if not isinstance(value, str):
        raise TypeError(f"layout hint layout_format must be a str, not {type(value).__name__} ({value!r})")
    if value not in EngineKVFormat.__members__:
        raise LayoutHintError(f"layout hint layout_format={value!r} is not an engine KV format name")


HintsLike = LayoutHints | Mapping[str, object] | None

SIZE_HINTS: tuple[tuple[str, Role], ...] = (
    ("num_kv_heads", Role.HEAD),
    ("tokens_per_block", Role.TOKEN),
    ("head_dim", Role.ELEMENT),
    ("num_layers", Role.LAYER),
    ("total_num_blocks", Role.BLOCK),
    ("kv_dim", Role.KV),
)
"""Hints that give a size, and the role whose axis holds it (``page_size`` is folded into
``tokens_per_block`` when hints are read)."""

_SIZE_FIELDS = (*(hint for hint, _ in SIZE_HINTS), "page_size")

_FIELDS = frozenset(f.name for f in fields(LayoutHints))
_NO_HINTS = LayoutHints()
