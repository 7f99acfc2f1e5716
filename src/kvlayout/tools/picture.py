"""An SVG picture of where one block's rows sit in memory (``kvlayout explain --svg``).

One cell per (K/V, token, head) row of block 0 of layer 0, placed in memory order (the
offset the algebra gives its first element), one strip per pointer; cells are coloured
by head, K light and V dark, and labelled by token. Reading a strip left to right is
reading memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from xml.sax.saxutils import escape

from kvlayout.errors import SizeError
from kvlayout.layout import algebra
from kvlayout.layout.algebra import Coord
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role

__all__ = ["block_svg"]

_CELL_W, _CELL_H, _GAP, _PER_LINE, _MARGIN = 46, 30, 2, 16, 12
_MAX_CELLS = 4096  # a picture to look at: at most 256 lines of 16 cells


def _colour(head: int, heads: int, kv: int, kv_size: int) -> str:
    hue = int(360 * head / max(heads, 1))
    lightness = 78 if kv == 0 else 48
    return f"hsl({hue}, 65%, {lightness if kv_size == 2 else 64}%)"


def _slot(slot: int, y: int) -> tuple[int, int]:
    return _MARGIN + (slot % _PER_LINE) * (_CELL_W + _GAP), y + (slot // _PER_LINE) * (_CELL_H + _GAP)


def block_svg(layout: Layout, sizes: Mapping[str, int]) -> str:
    """The SVG document (a string) for block 0 of layer 0 under ``sizes``."""
    s = algebra.resolve_sizes(layout, sizes)
    heads, hs = layout.num_heads(s), layout.head_size(s)
    kv_size = algebra.kv_size(layout, s)
    tokens = layout.size_of(s, Role.TOKEN)
    if tokens is None:
        raise SizeError(f"{layout}: a picture of a block needs a size for {layout.symbol_of(Role.TOKEN)}")
    if kv_size * tokens * heads > _MAX_CELLS:
        raise SizeError(
            f"{layout}: a picture draws one cell per (K/V, token, head) row of a block, and these sizes make "
            f"{kv_size * tokens * heads} rows (at most {_MAX_CELLS}); give smaller ones"
        )
    cells: dict[int, list[tuple[int, int, int, int]]] = {}
    for kv in range(kv_size):
        for token in range(tokens):
            for head in range(heads):
                pointer, offset = layout.offset(Coord(0, kv, 0, token, head, 0), s)
                cells.setdefault(pointer, []).append((offset, kv, token, head))
    width = 2 * _MARGIN + _PER_LINE * (_CELL_W + _GAP)
    parts: list[str] = []
    y = _MARGIN + 52
    names = [lv.name for lv in layout.lists]
    paths = layout.pointer_order(s, limit=max(cells) + 1)  # the strips drawn, not the whole table
    for pointer in sorted(cells):
        path = ", ".join(f"{n}={i}" for n, i in zip(names, paths[pointer], strict=True)) or "one tensor"
        parts.append(
            f'<text x="{_MARGIN}" y="{y - 6}" class="strip">pointer {pointer} ({escape(path)})</text>'
        )
        slot, end = 0, None
        for offset, kv, token, head in sorted(cells[pointer]):
            if end is not None and offset != end:  # not adjacent: show the jump
                x, cy = _slot(slot, y)
                parts.append(
                    f"<g><title>gap of {offset - end} elements</title>"
                    f'<text x="{x + _CELL_W / 2}" y="{cy + _CELL_H / 2 + 4}" class="label">…</text></g>'
                )
                slot += 1
            end = offset + hs
            x, cy = _slot(slot, y)
            slot += 1
            which = "KV"[kv] if kv_size == 2 else ""
            title = f"{which} token {token} head {head} at element {offset}".strip()
            parts.append(
                f"<g><title>{escape(title)}</title>"
                f'<rect class="cell" x="{x}" y="{cy}" width="{_CELL_W}" height="{_CELL_H}" '
                f'fill="{_colour(head, heads, kv, kv_size)}" data-kv="{kv}" data-token="{token}" '
                f'data-head="{head}" data-offset="{offset}"/>'
                f'<text x="{x + _CELL_W / 2}" y="{cy + _CELL_H / 2 + 4}" class="label">'
                f"{which}t{token}</text></g>"
            )
        lines = -(-slot // _PER_LINE)
        y += lines * (_CELL_H + _GAP) + 30
    height = y + _MARGIN
    shown = layout.concrete_shape(s)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="monospace">',
            "<style>.label{font-size:11px;text-anchor:middle}.strip{font-size:12px}"
            ".title{font-size:14px;font-weight:bold}</style>",
            f'<text x="{_MARGIN}" y="{_MARGIN + 12}" class="title">'
            f"{escape(str(layout))}  {escape(shown)}</text>",
            f'<text x="{_MARGIN}" y="{_MARGIN + 28}" class="strip">block 0 of layer 0 in memory order; '
            "colour = head, K light, V dark; … = a jump</text>",
            *parts,
            "</svg>",
            "",
        ]
    )
