"""What the NIXL layer reads of a map (its runs and two sides, one of them in this
process), the names it types loosely, and its errors."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from kvlayout.errors import as_int, is_bool
from kvlayout.registration.address_space import MAX_END, MAX_END_TEXT
from kvlayout.registration.backing import no_memory
from kvlayout.registration.kernel_groups import KernelGroup
from kvlayout.registration.memory import Placement, group_placement
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.registration.registration import Registration
from kvlayout.transfer import TransferError

Agent = Any
"""A ``nixl._api.nixl_agent`` (typed loosely: only :func:`make_agent` imports NIXL)."""

Op = Literal["READ", "WRITE"]
Strategy = Literal["auto", "direct", "staged", "peer-staged"]

_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
_U64 = np.uint64


# The errors name their public module in tracebacks (kvlayout.transfer.nixl re-exports them).
_PUBLIC = "kvlayout.transfer.nixl"


class NixlError(TransferError):
    """A NIXL transfer that cannot be posted, failed or did not finish."""

    __module__ = _PUBLIC


class RefusedDescriptorError(NixlError):
    """A descriptor refused before anything is posted: outside the regions registered on
    this agent, outside the tensors the peer described, or outside what the peer
    registered with NIXL (its description lies), or off a prepared list's units."""

    __module__ = _PUBLIC


class NixlTimeoutError(NixlError):
    """A posted transfer that did not finish in time."""

    __module__ = _PUBLIC


# -- what the NIXL layer reads of a map ----------------------------------------------------


class MapSide(Protocol):
    """One side of a map, as this module reads it.

    A live registration in this process (``is_local``) or a peer's description (format,
    sizes, addresses received at the handshake). ``tensor_spans`` is a ``(K, 2)`` uint64 array:
    each tensor's start address and byte span (first byte to past the last); runs must
    fall inside them. ``device_type`` is ``"cpu"`` or ``"cuda"`` (DRAM or VRAM for
    NIXL); ``device_index`` is the device id NIXL is given (0 for the CPU). ``moved()``
    says what of a local side's memory moved since its addresses were read (an engine
    that re-allocated its cache), None while nothing did and for a peer's side: a
    request is refused then, not sent through freed memory.

    A peer's side may also name ``descriptions``: the peer's whole
    :class:`~kvlayout.registration.peers.RegistrationDescription` (s) its tensors are of,
    every kernel group's tensors (a block map's side of ``description.group(i)`` names
    ``description``); a peer's staging buffer is refused on any of them. Without it, on
    ``tensor_spans``.
    """

    def moved(self) -> str | None: ...

    @property
    def is_local(self) -> bool: ...

    @property
    def device_type(self) -> str: ...

    @property
    def device_index(self) -> int: ...

    @property
    def tensor_spans(self) -> np.ndarray: ...


class NixlMap(Protocol):
    """A block map as this module reads it: ``runs`` is an ``(N, 3)`` uint64 array
    (source address, destination address, length in bytes), each run inside one tensor
    of each side; ``src`` and ``dst`` are its sides, exactly one of them local."""

    @property
    def runs(self) -> np.ndarray: ...

    @property
    def src(self) -> MapSide: ...

    @property
    def dst(self) -> MapSide: ...


@dataclass(frozen=True)
class LocalSide:
    """A :class:`MapSide` for tensors of this process (see :func:`local_side`)."""

    device_type: str
    device_index: int
    tensor_spans: np.ndarray
    is_local: bool = True
    placements: tuple[Placement, ...] = field(default=(), compare=False, repr=False)  # its tensors, watched

    def moved(self) -> str | None:
        return next((m for m in (p.moved() for p in self.placements) if m is not None), None)


Holder = Registration | KernelGroup | torch.Tensor | Sequence[torch.Tensor]


def _tensors(obj: Holder) -> list[torch.Tensor]:
    """Every tensor a registration, kernel group, tensor or list of tensors holds."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Registration):
        return [t for g in obj.kernel_groups for p in g.planes for t in p.leaves]
    if isinstance(obj, KernelGroup):
        return [t for p in obj.planes for t in p.leaves]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)
    raise TypeError(
        "expected a kvlayout Registration or KernelGroup (what detection returns), a tensor or a "
        f"list of tensors, not {type(obj).__name__}"
    )


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The one device of ``tensors``, each with memory behind it (a freed or fake tensor
    would be registered, or described, at address 0)."""
    for i, t in enumerate(tensors):
        problem = no_memory(t)
        if problem is not None:
            raise TransferError(f"tensor {i} {problem}: NIXL moves the memory a tensor has")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise TransferError(
            f"the tensors are on {len(devices)} devices ({', '.join(sorted(map(str, devices)))}); "
            "one side of a NIXL transfer is on one"
        )
    (device,) = devices
    if device.type not in _MEM_TYPES:
        raise TransferError(f"NIXL moves DRAM (cpu) or VRAM (cuda) memory, not {device.type} tensors")
    return device


def _span(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's first byte and its byte span (padding between its rows included)."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0) + 1
    return t.data_ptr(), extent * t.element_size() if t.numel() else 0


def local_side(obj: Holder) -> LocalSide:
    """The :class:`MapSide` of a registration (or kernel group, tensor, list of tensors)
    held in this process: its device and each tensor's byte span."""
    tensors = _tensors(obj)
    device = _device(tensors)
    placements = _check_detected(obj) or [Placement(tensors, [f"tensor {i}" for i in range(len(tensors))])]
    spans = np.array([_span(t) for t in tensors if t.numel()], dtype=_U64).reshape(-1, 2)
    return LocalSide(device.type, device.index or 0, spans, placements=tuple(placements))


def _described_side(description: RegistrationDescription) -> LocalSide:
    """The :class:`MapSide` of a peer's description (every kernel group's tensors, each
    its byte span from its shape and strides): what :func:`prep_lists` prepares at the
    handshake, before any request's map exists."""
    return LocalSide(
        description.device_type, description.device_index or 0, description.tensor_spans, is_local=False
    )


def _check_detected(obj: Holder) -> list[Placement]:
    """A registration's (or kernel group's) tensors, each checked to be where detection
    read it (its addresses are what maps and descriptions use); [] for other holders."""
    if not isinstance(obj, (Registration, KernelGroup)):
        return []
    groups = obj.kernel_groups if isinstance(obj, Registration) else [obj]
    placed = (group_placement(group, TransferError) for group in groups)
    return [p for p in placed if p is not None]  # a meta group has no memory: refused as a device


def _refuse_moved(side: MapSide | None, nothing: str) -> None:
    """Refuse a request whose local side's memory moved since its map read the addresses:
    NIXL, or the staged copy, would move bytes through freed memory."""
    if side is None:
        return
    if not callable(getattr(side, "moved", None)):  # a connector's own side, written to an older MapSide
        raise TypeError(
            f"{type(side).__name__} has no moved(): a MapSide says what of its memory moved since its "
            "addresses were read (None where nothing can), so that a re-allocated cache is refused"
        )
    moved = side.moved()
    if moved is not None:
        raise NixlError(
            f"the local side: {moved} since the map's addresses were read; the request would move bytes "
            f"through the old ones: detect the registration again and build a new map; {nothing}"
        )


def _peer_name(peer: str | bytes) -> str:
    """An agent name as ``add_remote_agent`` returns it (bytes) or as given (str)."""
    if isinstance(peer, bytes):
        try:
            return peer.decode()
        except UnicodeDecodeError:
            raise TypeError(
                f"peer must be an agent name: {peer!r} is not UTF-8, as NIXL's names are"
            ) from None
    if not isinstance(peer, str):
        raise TypeError(f"peer must be an agent name (str, or bytes from add_remote_agent), not {peer!r}")
    return peer


def _seconds(timeout: object) -> float:
    """A caller's timeout: a non-negative number of seconds (inf waits for good), NumPy's
    numbers too (a float32 read from a config array), never a bool."""
    if not is_bool(timeout) and isinstance(timeout, numbers.Real):
        try:
            seconds = float(timeout)
        except OverflowError:  # an int past any float: longer than anything waits, or negative
            seconds = -math.inf if isinstance(timeout, int) and timeout < 0 else math.inf
        if seconds >= 0:
            return seconds
    raise TypeError(f"timeout must be a non-negative number of seconds, got {timeout!r}")


def _byte_count(value: object, what: str) -> int:
    """A caller's count of bytes (a staging buffer's, a prepped list's unit): a positive
    int (NumPy and torch integers too, never a bool) below where any memory ends."""
    try:
        n = as_int(value, what)
    except TypeError:
        raise TypeError(f"{what} must be a positive int, got {value!r}") from None
    if not 0 < n < MAX_END:
        raise TypeError(
            f"{what} must be a positive int below {MAX_END_TEXT} (no memory reaches it), got {value!r}"
        )
    return n


def _message(value: object, what: str) -> bytes:
    """A NIXL notification message as bytes, what the peer receives (a str as UTF-8)."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes (or str), not {type(value).__name__} ({value!r})")


def _is_nixl_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0].startswith("nixl")
