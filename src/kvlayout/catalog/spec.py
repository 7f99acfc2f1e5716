"""The base of the generated spec classes: one format's geometry over one registration.

A spec borrows a normalized registration (as detection returns it) and answers size
questions by reading the list level or tensor axis the layout puts each size on. The
per-format accessors are generated (``kvlayout/_generated/specs.py``); this class holds
what is the same for every format.
"""

from __future__ import annotations

import operator
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvlayout.errors import KVLayoutError
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role

if TYPE_CHECKING:
    from kvlayout._generated.formats import EngineKVFormat

__all__ = ["KVFormatSpec", "UndefinedSizeError"]


class UndefinedSizeError(KVLayoutError):
    """A size the format does not have on its own axis (the block count or block size of
    a format that folds them into one page axis)."""


class KVFormatSpec(ABC):
    """Geometry of one registration in one format (one generated subclass per format)."""

    __slots__ = ("kv",)

    engine_kv_format: ClassVar[EngineKVFormat]
    layout: ClassVar[Layout]
    attention_backends: ClassVar[tuple[str, ...]]
    deprecated_by: ClassVar[EngineKVFormat | None] = None
    is_cross_layer: ClassVar[bool]
    is_kv_list: ClassVar[bool]
    is_layer_list: ClassVar[bool]
    is_mla: ClassVar[bool]
    is_hnd: ClassVar[bool]
    is_fused_packed: ClassVar[bool]
    is_two_major: ClassVar[bool]
    is_pbs_fused: ClassVar[bool]
    is_kv_second_tuple: ClassVar[bool]
    is_single_kv: ClassVar[bool]
    has_leading_block_axis: ClassVar[bool]
    is_indexer: ClassVar[bool]
    row_symbol: ClassVar[str | None]
    row_divisor: ClassVar[int]
    _warned: ClassVar[bool] = False

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        if self.deprecated_by is not None and not type(self)._warned:
            type(self)._warned = True
            warnings.warn(
                f"{self.engine_kv_format.name} is deprecated: use {self.deprecated_by.name}",
                DeprecationWarning,
                stacklevel=2,
            )

    # -- generated per format ---------------------------------------------------

    @abstractmethod
    def num_layers(self) -> int: ...
    @abstractmethod
    def num_blocks(self, layer_idx: int = 0) -> int: ...
    @abstractmethod
    def block_size(self, layer_idx: int = 0) -> int: ...
    @abstractmethod
    def page_buffer_size(self, layer_idx: int = 0) -> int: ...
    @abstractmethod
    def kv_size(self) -> int:
        """Planes per token row in a chunk (a K/V axis of its own size: read off it)."""

    @abstractmethod
    def num_heads(self, layer_idx: int = 0) -> int: ...
    @abstractmethod
    def head_size(self, layer_idx: int = 0) -> int: ...
    @abstractmethod
    def hidden_dim(self, layer_idx: int = 0) -> int:
        """Elements of one token row of one plane (``num_heads * head_size``)."""

    @abstractmethod
    def dtype(self, layer_idx: int = 0) -> object: ...
    @abstractmethod
    def sizes(self, layer_idx: int = 0) -> dict[str, int]:
        """The layout's sizes as read from the tensors (the algebra's input)."""

    @abstractmethod
    def data_ptrs(self, layer_indices: Sequence[int] | None = None) -> list[int]:
        """The pointer table in the order kernels index it."""

    # -- the same for every format ----------------------------------------------

    def tokens_per_layer(self, layer_idx: int = 0) -> int:
        return self.page_buffer_size(layer_idx)

    def elements_per_layer(self, layer_idx: int = 0) -> int:
        """Content elements of one layer (K and V both), padding excluded."""
        return self.kv_size() * self.tokens_per_layer(layer_idx) * self.hidden_dim(layer_idx)

    @classmethod
    def describe_shape(cls) -> str:
        return cls.layout.describe_shape()

    @classmethod
    def paged_layer_shape(
        cls, num_blocks: int, block_size: int, num_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The shape of one layer's paged tensor with these sizes (to rebuild a layer
        from its pointer); ``head_size`` is the accessor's (the packed width for fused
        and blocked formats). Every axis the layout has is kept: size-1 axes, and the
        packed K/V axis of 10 and 11 (LMCache folds those away).

        Raises :class:`KVLayoutError` (a ``ValueError``) for formats that do not have one
        paged tensor per layer, and for sizes the layout cannot have (several heads for
        a format without a head axis, a blocked-scale row of another width).
        """
        layout, name = cls.layout, cls.engine_kv_format.name
        if not layout.is_layer_list or layout.is_kv_second_tuple:
            holds = (
                "a tuple of tensors per layer"
                if layout.is_kv_second_tuple
                else "one tensor for every layer"
                if layout.is_cross_layer
                else "a list of K layers and a list of V layers"
            )
            raise KVLayoutError(f"{name} does not have one paged tensor per layer (it holds {holds})")
        given = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_heads": num_heads,
            "head_size": head_size,
        }
        for arg, value in given.items():
            if isinstance(value, bool):
                raise TypeError(f"{arg} must be an int, not bool")
            try:
                given[arg] = operator.index(value)
            except TypeError:
                raise TypeError(f"{arg} must be an int, not {type(value).__name__}") from None
            if given[arg] < (0 if arg == "num_blocks" else 1):
                raise KVLayoutError(f"{arg} must be >= {0 if arg == 'num_blocks' else 1}, got {given[arg]}")
        sizes = algebra.sizes_by_role(
            layout,
            {Role.BLOCK: given["num_blocks"], Role.TOKEN: given["block_size"], Role.HEAD: given["num_heads"]},
        )
        if cls.row_symbol is not None:  # a row whose width is a size (else the layout fixes it)
            if given["head_size"] % cls.row_divisor:
                raise KVLayoutError(
                    f"{name} packs {cls.row_divisor} rows into each head's row, so head_size must be a "
                    f"multiple of {cls.row_divisor}, got {given['head_size']}"
                )
            sizes[cls.row_symbol] = given["head_size"] // cls.row_divisor
        has = {"num_heads": algebra.num_heads(layout, sizes), "head_size": algebra.head_size(layout, sizes)}
        for arg, value in has.items():
            if value != given[arg]:
                raise KVLayoutError(f"{name} cannot have {arg}={given[arg]} (its layout has {arg}={value})")
        return layout.tensor_shape(sizes)

    def display_sizes(self) -> dict[str, int]:
        """The sizes :meth:`concrete_shape_str` renders: :meth:`sizes`, with the row token
        set to a head's row width (planes folded in, packed K/V factors divided out)."""
        sizes = self.sizes()
        if self.row_symbol is not None:
            sizes[self.row_symbol] = self.head_size() // self.row_divisor
        return sizes

    def concrete_shape_str(self) -> str:
        """The shape with this registration's numbers (:meth:`display_sizes`)."""
        return self.layout.concrete_shape(self.display_sizes())

    def undefined(self, accessor: str, why: str) -> UndefinedSizeError:
        return UndefinedSizeError(
            f"{accessor} is undefined for the fused format {self.engine_kv_format.name}: {why}"
        )

    @staticmethod
    def summed_plane_width(planes: Sequence[Any], axes: tuple[int, ...]) -> int:
        """A layer's row width over its planes, in elements of the first plane's dtype."""
        total = 0
        for plane in planes:
            width = 1
            for a in axes:
                width *= int(plane.shape[a])
            total += width * int(plane.element_size())
        itemsize = int(planes[0].element_size())
        if total % itemsize:
            raise KVLayoutError(
                f"plane rows total {total} bytes, which is not a multiple of the first "
                f"plane's element size {itemsize}"
            )
        return total // itemsize
