"""The one walker of a registration's nesting: lists and tuples around tensors.

Every module that walks a registration of unknown shape (contiguity recovery, the
detectors' re-views, per-layer bucketing, binding a registration to its format, the
demo) goes through these functions, so they agree at the edges (detection's ``validate``
then compares the entries of a structure these functions already bounded): a structure deeper than
:data:`MAX_NESTING` (or one that contains itself) is an error, not a ``RecursionError``
or a hang; anything that is not a tensor, list or tuple is a ``TypeError`` naming where
it stands; paths are written ``kv_caches[i][j]`` everywhere.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MappingView, Sequence
from typing import Any

import torch

from kvlayout.errors import KVLayoutError

__all__ = [
    "MAX_NESTING",
    "CallerRoot",
    "LocatedError",
    "Path",
    "at",
    "describe_path",
    "entry_keys",
    "first_leaf",
    "leaves",
    "map_leaves",
    "not_a_kv_cache",
    "not_strided",
    "refuse_nested",
]

MAX_NESTING = 8
"""List levels deeper than any format; a deeper (or self-referencing) structure is an error."""

Path = tuple[int, ...]


class LocatedError(Exception):
    """A problem found inside a structure; raised as ``kind`` with the path prepended.

    Callees raise it with the problem alone; :func:`map_leaves` and :func:`leaves` add
    the list indices on the way out, so messages name the tensor wherever it sits.
    """

    def __init__(self, kind: type[Exception], problem: str) -> None:
        super().__init__(problem)
        self.kind = kind
        self.problem = problem


class CallerRoot(str):
    """A registration's root name (``"kv_caches"``) that also knows where the leaves of
    the structure detection built sit in the caller's: where detection re-structures a
    registration (SGLang's K and V lists of different head sizes become one flat list of
    components, K layers then V), messages still name the tensor the caller passed,
    ``kv_caches[1][1]`` rather than the flat list's ``kv_caches[4]``. A ``str``, so it
    goes wherever a root name goes; :func:`describe_path` reads the map."""

    caller_paths: dict[Path, Path]

    def __new__(cls, name: str, caller_paths: Mapping[Path, Path]) -> CallerRoot:
        root = super().__new__(cls, name)
        root.caller_paths = dict(caller_paths)
        return root

    def __getnewargs__(self) -> tuple[str, dict[Path, Path]]:  # type: ignore[override]
        return str(self), self.caller_paths

    def caller_path(self, path: Sequence[int]) -> Path:
        """``path`` in the caller's structure: its longest mapped prefix replaced."""
        path = tuple(path)
        for k in range(len(path), 0, -1):
            head = self.caller_paths.get(path[:k])
            if head is not None:
                return head + path[k:]
        return path


def describe_path(path: Sequence[int], root: str = "kv_caches") -> str:
    if isinstance(root, CallerRoot):
        path = root.caller_path(path)
    return root + "".join(f"[{i}]" for i in path)


def not_a_kv_cache(node: object) -> str:
    """Why ``node`` cannot be part of a registration."""
    if node is None:
        return "is None; a KV cache is a tensor or a list/tuple of tensors"
    if isinstance(node, (Mapping, MappingView)):  # a dict or its .values(), .keys(), .items()
        return (
            f"is a {type(node).__name__}; pass the tensors as a list "
            "(for example list(kv_caches.values()) in registration order)"
        )
    return f"is a {type(node).__name__}, not a tensor or a list/tuple of tensors"


def not_strided(t: torch.Tensor) -> str | None:
    """Why a tensor cannot be a KV cache's memory (None when it can): kvlayout addresses
    strided tensors only."""
    if t.is_nested:
        return "is a nested tensor; a KV cache is a strided tensor"
    if t.layout is not torch.strided:
        return f"is a tensor of layout {t.layout}; a KV cache is a strided (dense) tensor"
    if t.is_neg() or t.is_conj():  # torch's lazy views: bytes moved as they are would lose the sign
        bit = "negative" if t.is_neg() else "conjugate"
        return f"is a view with its {bit} bit set, whose bytes are not its values; pass the tensor it views"
    return None


def refuse_nested(kv: object, *, root: str = "kv_caches") -> None:
    """Raise ``TypeError`` naming the first nested tensor in a registration's lists and
    tuples, before an engine's detector reads any shape: a nested tensor has none (torch
    answers ``.shape`` with "Internal error: NestedTensorImpl doesn't support sizes"). Only
    tensors are looked at (the walks after this one name what else is wrong) and each list
    once, at most ``MAX_NESTING`` levels down (a list that contains itself ends)."""
    seen: set[int] = set()

    def walk(node: object, path: Path) -> None:
        if isinstance(node, torch.Tensor):
            if node.is_nested:
                raise TypeError(f"{describe_path(path, root)}: {not_strided(node)}")
        elif isinstance(node, (list, tuple)) and len(path) <= MAX_NESTING and id(node) not in seen:
            seen.add(id(node))
            for i, child in enumerate(node):
                walk(child, (*path, i))

    walk(kv, ())


def _too_deep() -> LocatedError:
    return LocatedError(
        KVLayoutError, f"is nested more than {MAX_NESTING} list levels deep (or contains itself)"
    )


def map_leaves(
    kv: Any,
    fn: Callable[[torch.Tensor], Any],
    *,
    root: str = "kv_caches",
    start: Path = (),
    container: Callable[[list[Any]], Any] = list,
    at_path: Callable[[Path, torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """The structure rebuilt with ``fn`` applied to every tensor (a bare tensor: ``fn(kv)``).

    Lists and tuples become new lists (or whatever ``container`` builds). ``fn`` may
    raise :class:`LocatedError`; it surfaces as its ``kind`` with the tensor's path.
    ``start`` is the path of ``kv`` itself inside a larger registration (for messages).
    ``at_path``, if given, is called instead of ``fn`` with the tensor's path too.
    """
    path = list(start)

    def visit(node: object) -> Any:
        if isinstance(node, torch.Tensor):
            return fn(node) if at_path is None else at_path(tuple(path), node)
        if isinstance(node, (list, tuple)):
            if len(path) - len(start) >= MAX_NESTING:
                raise _too_deep()
            out = []
            path.append(0)
            for i, child in enumerate(node):
                path[-1] = i
                out.append(visit(child))
            path.pop()
            return container(out)
        raise LocatedError(TypeError, not_a_kv_cache(node))

    try:
        return visit(kv)
    except LocatedError as located:
        raise located.kind(f"{describe_path(path, root)}: {located.problem}") from None


def leaves(kv: Any, *, root: str = "kv_caches") -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor with its path, depth first, in list order."""
    stack: list[tuple[Path, object]] = [((), kv)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, torch.Tensor):
            yield path, node
        elif isinstance(node, (list, tuple)):
            if len(path) >= MAX_NESTING:
                raise KVLayoutError(f"{describe_path(path, root)}: {_too_deep().problem}")
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(node))))
        else:
            raise TypeError(f"{describe_path(path, root)}: {not_a_kv_cache(node)}")


def at(kv: Any, path: Path, *, root: str = "kv_caches") -> object:
    """The entry at ``path``; a :class:`KVLayoutError` names the level that cannot hold it."""
    node: object = kv
    for depth, index in enumerate(path):
        if not isinstance(node, (list, tuple)):
            kind = type(node).__name__
            raise KVLayoutError(f"{describe_path(path[:depth], root)} is a {kind}, not a list of entries")
        if index >= len(node):
            raise KVLayoutError(
                f"{describe_path(path[:depth], root)} has {len(node)} entries, so it has no entry {index}"
            )
        node = node[index]
    return node


def entry_keys(
    kv: Any,
    leaf_key: Callable[[torch.Tensor], Hashable],
    indices: Iterable[int] | None = None,
    *,
    root: str = "kv_caches",
) -> list[Hashable]:
    """For each top-level entry of a list registration (every entry, or those at
    ``indices``), its nesting as tuples with ``leaf_key`` applied to each tensor: a key
    that is hashable when the leaf keys are. A bare tensor has no entries (an error)."""
    if isinstance(kv, torch.Tensor):
        raise TypeError(
            f"{root} is one tensor (every layer in one registration), not a list of per-layer entries"
        )
    if not isinstance(kv, (list, tuple)):
        raise TypeError(f"{root} {not_a_kv_cache(kv)}")
    wanted = range(len(kv)) if indices is None else indices
    keys: list[Hashable] = []
    for raw in wanted:
        if isinstance(raw, bool):
            raise TypeError(f"a layer index is an int, not bool ({raw!r})")
        try:
            i = operator.index(raw)
        except TypeError:
            raise TypeError(f"a layer index is an int, not {type(raw).__name__} ({raw!r})") from None
        if not 0 <= i < len(kv):
            raise KVLayoutError(f"layer index {i} is out of range for {root} of {len(kv)} entries")
        keys.append(map_leaves(kv[i], leaf_key, root=root, start=(i,), container=tuple))
    return keys


def entries_at(kv: Any, depth: int, positions: Sequence[int]) -> Any:
    """``kv`` with only the entries ``positions`` of each list ``depth`` levels down (a
    registration's layer list level: :meth:`Registration.for_layers`); the levels above
    are rebuilt as they were (a tuple stays a tuple), the tensors are the same objects.
    ``kv`` is a bound registration's, so its depth is already checked."""

    def rebuild(node: Any, entries: Iterable[Any]) -> Any:
        return type(node)(entries) if isinstance(node, tuple) else list(entries)

    def visit(node: Any, level: int) -> Any:
        if level == depth:
            return rebuild(node, (node[p] for p in positions))
        return rebuild(node, (visit(e, level + 1) for e in node))

    return visit(kv, 0)


def first_leaf(kv: Any, *, root: str = "kv_caches") -> torch.Tensor:
    """The first tensor of a registration (entry 0 at every level)."""
    node, depth = kv, 0
    while isinstance(node, (list, tuple)):
        if not node:
            where = describe_path([0] * depth, root)
            raise KVLayoutError(f"{where} is an empty list" if depth else f"{root} is an empty list")
        if depth >= MAX_NESTING:
            raise KVLayoutError(f"{describe_path([0] * depth, root)}: {_too_deep().problem}")
        node, depth = node[0], depth + 1
    if not isinstance(node, torch.Tensor):
        raise TypeError(f"{describe_path([0] * depth, root)}: {not_a_kv_cache(node)}")
    return node
