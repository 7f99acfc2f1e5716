"""Whether a tensor has memory behind its view (the check every layer's tensors and every
chunk pass before their bytes are read or moved).

A tensor with elements must have memory behind its view: not a fake tensor
(``torch._subclasses.fake_tensor``, as torch.compile traces with), a data pointer other
than 0 and a storage that holds every byte the view reaches (a storage resized after the
view was made does not). Meta tensors have no memory by design: detection and the facade
read them (``kvlayout detect`` builds them), transfers refuse them. Apart from
:mod:`kvlayout.registration.memory` so that the zero-copy views of
:mod:`kvlayout.registration.contiguity` can say why a view failed without a cycle.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout.registration.nesting import describe_path, leaves

__all__ = ["first_without_memory", "is_fake", "memory_problem", "no_memory", "view_bytes"]

try:
    from torch._subclasses.fake_tensor import FakeTensor

    _FAKE: tuple[type, ...] = (FakeTensor,)
except ImportError:  # pragma: no cover - a torch without fake tensors has none to refuse
    _FAKE = ()

_DATA_PTR = torch.Tensor.data_ptr
_STORAGE = torch.Tensor.untyped_storage
_STORAGE_PTR = torch.UntypedStorage.data_ptr
_STORAGE_BYTES = torch.UntypedStorage.nbytes


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor: shapes only, as torch.compile traces with (``data_ptr()`` is 0)."""
    return type(t) is not torch.Tensor and isinstance(t, _FAKE)


def view_bytes(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to past its last (0 without elements)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def memory_problem(t: torch.Tensor, pointer: int, span: int) -> str | None:
    """Why the ``span`` bytes a tensor views from ``pointer`` (its data pointer) are not
    all memory of its storage; None when they are."""
    try:
        storage = _STORAGE(t)
        start, size = _STORAGE_PTR(storage), _STORAGE_BYTES(storage)
    except RuntimeError:  # a tensor subclass without a storage
        return "has no memory (no storage, data pointer 0)" if pointer == 0 else "has no storage"
    if size == 0:
        return "has no memory: its storage holds 0 bytes (freed, or resized to 0)"
    if pointer == 0:
        return "has no memory (its data pointer is 0)"
    if pointer < start or pointer + span > start + size:
        return (
            f"views {span} bytes from {pointer:#x}, but its storage holds {size} bytes at {start:#x} "
            "(resized after the view was made)"
        )
    return None


def no_memory(t: torch.Tensor) -> str | None:
    """Why a tensor has no memory behind its view (fake, data pointer 0, a storage that does
    not hold the view), or None (it has, it has no elements, or it is a meta tensor)."""
    if is_fake(t):
        return "is a FakeTensor (torch._subclasses.fake_tensor), which has no memory"
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        pointer = _DATA_PTR(t)
    except RuntimeError:  # a tensor subclass that refuses to say
        return "has no data pointer"
    return memory_problem(t, pointer, view_bytes(t))


def first_without_memory(kv: Any, root: str) -> str | None:
    """``path problem`` for the first tensor of a registration with no memory, or None.
    For a torch ``RuntimeError`` raised while re-viewing (view ops check the storage)."""
    for path, t in leaves(kv, root=root):
        problem = no_memory(t)
        if problem is not None:
            return f"{describe_path(path, root)} {problem}; a KV cache tensor needs its memory"
    return None
