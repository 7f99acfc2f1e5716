"""Both sides' memory of a block map, watched as one on every ``copy()``: the placements'
readings compared again in one native pass (:class:`kvlayout._native.TensorWatch`), which
the map's native copy runs in the same call (``GroupCopy.copy_watched``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvlayout._native import TensorWatch
from kvlayout.registration.backing import _DATA_PTR, _STORAGE, _STORAGE_BYTES, _STORAGE_PTR
from kvlayout.registration.memory import Placement

__all__ = ["MemoryWatch"]


# Whether a TorchFunctionMode is on (``with mode:``, ``torch.set_default_device``): its
# hook runs in every torch call on a plain tensor too, so MemoryWatch answers False then.
_FUNCTION_MODE_ON = torch._C._is_torch_function_mode_enabled


class MemoryWatch:
    """Several placements checked as one: each tensor (with the data pointer its placement
    read) and each storage (with its address and size, read through the first tensor
    of it) once, where both placements watch one (a map within one cache): what a block
    map's ``copy()`` asks of both its sides on every call.

    :meth:`unmoved` answers in one pass of C loops, with no Python call per tensor: about
    a third of the two placements' own ``moved()`` on a small map from cold caches. It
    compares with the placements' own readings (from when the map's addresses were read),
    never reads new ones. It holds the placements' tensors, nothing more (no storage: that
    would keep an old cache's memory after ``t.data = new``).
    """

    __slots__ = ("_compare", "_expected", "_owners", "_tensors")

    def __init__(self, placements: Iterable[Placement]) -> None:
        tensors: dict[tuple[int, int], torch.Tensor] = {}
        owners: dict[tuple[int, int, int], torch.Tensor] = {}
        for p in placements:
            read, storages = p.readings()
            for t, ptr in read:
                tensors.setdefault((id(t), ptr), t)
            for t, start, size in storages:
                owners.setdefault((id(t), start, size), t)
        self._tensors = tuple(tensors.values())
        self._owners = tuple(owners.values())
        # what unmoved() reads, in its order: data pointers, storage addresses, storage sizes
        self._expected = [
            *(ptr for _, ptr in tensors),
            *(start for _, start, _ in owners),
            *(size for _, _, size in owners),
        ]
        # the comparison itself, native: also what a block map's copy() runs in its one call
        self._compare = TensorWatch(
            self._tensors, self._owners, self._expected, torch.Tensor, _FUNCTION_MODE_ON,
            _DATA_PTR, _STORAGE, _STORAGE_PTR, _STORAGE_BYTES,
        )  # fmt: skip

    def unmoved(self) -> bool:
        """True while every tensor is a plain ``torch.Tensor`` at the data pointer its
        placement read and every storage at the address and of the size it had; False
        otherwise (what moved is then the placements' ``moved()`` to say). A tensor
        subclass (or a tensor whose class was reassigned since) answers False before any
        of its methods is called, and so does every call while a ``TorchFunctionMode`` is
        on (``with mode:``, ``torch.set_default_device``): a subclass's
        ``__torch_function__`` or the mode's hook could run caller code, so the caller
        checks the slow way, with their hooks disabled. Compared in one native pass
        (``kvlayout._native.TensorWatch``): from cold caches each Python step costs microseconds."""
        return self._compare.unmoved()  # type: ignore[no-any-return]
