"""Registration shapes written as text, for ``kvlayout detect --shape``.

``32x[2,2048,16,8,128]`` is a list of 32 tensors of that shape; ``2x32x[8192,8,128]``
nests lists (outermost first); ``[2048,32,2,16,8,128]`` is one bare tensor;
``61x([1024,64,1,512],[1024,64,1,64])`` is a list of 61 tuples of two tensors; ``+``
joins top-level lists (``3x[2,7,3,2,4]+2x[7,3,4]``, a hybrid registration).
``[2,2048,16,8,128]@0,1,3,2,4`` is a tensor of that shape whose dims lie in memory in
the order given, outermost first (vLLM's HND cache is such an NHD-shaped view).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvlayout.errors import KVLayoutError, caret_under

__all__ = ["USAGE", "Shape", "ShapeSpec", "ShapeSpecError", "parse_shape_spec"]

USAGE = (
    "--shape is NxSHAPE (a list), [d0,d1,...] (a tensor), [dims]@order (its dims' memory order), "
    "(SHAPE,SHAPE) (a tuple), A+B (lists joined); e.g. '32x[2,2048,16,8,128]'"
)


class Shape(tuple[int, ...]):
    """A tensor's shape; ``order`` lists its dims in memory order, outermost first, when
    that is not the shape's own order (a permuted view)."""

    order: tuple[int, ...] | None

    def __new__(cls, dims: tuple[int, ...], order: tuple[int, ...] | None = None) -> Shape:
        shape = super().__new__(cls, dims)
        shape.order = order
        return shape


Node = Shape | list["Node"] | tuple["Node", ...]


class ShapeSpecError(KVLayoutError):
    """A ``--shape`` text that does not follow the notation."""

    def __init__(self, text: str, position: int, problem: str) -> None:
        super().__init__(f"--shape {text!r}: {problem}\n{caret_under(text, position)}\n{USAGE}")


@dataclass(frozen=True)
class ShapeSpec:
    """A parsed registration: nested lists/tuples whose leaves are tensor shapes."""

    text: str
    root: Node  # a Shape is a tensor; a list or tuple of nodes is a level
    parts: tuple[int, ...]  # top-level entries contributed by each `+` item

    def leaves(self) -> list[Shape]:
        out: list[Shape] = []

        def walk(node: Node) -> None:
            if isinstance(node, Shape):
                out.append(node)
            else:
                for child in node:
                    walk(child)

        walk(self.root)
        return out


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, problem: str) -> ShapeSpecError:
        return ShapeSpecError(self.text, min(self.pos, max(len(self.text) - 1, 0)), problem)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise self.fail(f"expected {char!r}, found {self.peek() or 'the end'!r}")
        self.pos += 1

    def number(self) -> int:
        match = re.compile(r"\d+").match(self.text, self.pos)
        if not match:
            raise self.fail(f"expected a number, found {self.peek() or 'the end'!r}")
        self.pos = match.end()
        return int(match.group())

    def numbers(self) -> list[int]:
        out = [self.number()]
        while self.peek() == ",":
            self.pos += 1
            out.append(self.number())
        return out

    def tensor(self) -> Shape:
        self.expect("[")
        dims = tuple(self.numbers())
        self.expect("]")
        if self.peek() != "@":
            return Shape(dims)
        self.pos += 1
        start = self.pos
        order = tuple(self.numbers())
        if sorted(order) != list(range(len(dims))):
            self.pos = start
            raise self.fail(
                f"@{','.join(map(str, order))} is not an order of the {len(dims)} dims 0..{len(dims) - 1}"
            )
        return Shape(dims, order)

    def entry(self) -> Node:
        """``[dims]`` or ``(entry, entry, ...)``."""
        if self.peek() == "(":
            self.pos += 1
            items = [self.item()]
            while self.peek() == ",":
                self.pos += 1
                items.append(self.item())
            self.expect(")")
            return tuple(items)
        return self.tensor()

    def item(self) -> Node:
        """``NxMx...entry``: a count repeats what follows it as a list level."""
        if self.peek().isdigit():
            count = self.number()
            if self.peek() != "x":
                raise self.fail("a count must be followed by 'x'")
            self.pos += 1
            if count == 0:
                raise self.fail("a list of 0 entries")
            inner = self.item()
            return [inner for _ in range(count)]
        return self.entry()


def parse_shape_spec(text: str) -> ShapeSpec:
    r = _Reader(text.replace(" ", ""))
    items = [r.item()]
    while r.peek() == "+":
        r.pos += 1
        items.append(r.item())
    if r.pos != len(r.text):
        raise r.fail(f"unexpected {r.peek()!r}")
    if len(items) == 1:
        root = items[0]
        return ShapeSpec(r.text, root, (len(root) if isinstance(root, list) else 1,))
    if not all(isinstance(i, list) for i in items):
        raise ShapeSpecError(r.text, 0, "'+' joins lists (NxSHAPE), not bare tensors")
    lists = [i for i in items if isinstance(i, list)]
    joined: list[Node] = [entry for i in lists for entry in i]
    return ShapeSpec(r.text, joined, tuple(len(i) for i in lists))
