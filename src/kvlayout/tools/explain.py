"""A layout explained in words and numbers (what ``kvlayout explain`` prints).

Everything here is read off the algebra: the symbolic offset formula is the one the
generated indexers compute, the numbers are the algebra's for the given sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlayout.layout import algebra
from kvlayout.layout.algebra import Mode, Product, Term
from kvlayout.layout.ast import FACTS, Layout, fact_doc
from kvlayout.layout.dtypes import DTYPE_SIZES, SHORT_NAMES
from kvlayout.layout.vocabulary import Role, Vocabulary

__all__ = ["DTYPE_BYTES", "LLAMA_3_8B", "Explanation", "example_sizes", "explain", "symbolic_offset"]


def example_sizes(vocabulary: Vocabulary | None = None, *, small: bool = False) -> dict[str, int]:
    """The vocabulary's example sizes (each token's ``example`` in layouts.yaml: Llama-3-8B
    on one GPU, 32 layers, 8 KV heads of 128, 16-token blocks, a 2048-block pool), or the
    ``small`` ones pictures use."""
    if vocabulary is None:
        from kvlayout._generated.vocabulary import VOCABULARY

        vocabulary = VOCABULARY
    out: dict[str, int] = {}
    for t in vocabulary.tokens:
        n = t.small if small else t.example
        if n is not None:
            out[t.name] = n
    return out


LLAMA_3_8B: dict[str, int] = example_sizes()

# The command line's dtype names, short and long, with their sizes.
DTYPE_BYTES: dict[str, int] = {
    name: DTYPE_SIZES[full] for short, full in SHORT_NAMES.items() for name in dict.fromkeys((short, full))
}


def _product(p: Product) -> str:
    factors = [str(f) for f in p if f != 1]
    return "·".join(factors) if factors else "1"


def _term(term: Term, outermost: bool) -> str:
    expr = term.coord
    if term.div:
        expr = f"({expr} / {_product(term.div)})"
    if term.mod is not None and not outermost:
        expr = f"({expr} mod {_product(term.mod)})"
    weight = _product(term.weight)
    return expr if weight == "1" else f"{expr}·{weight}"


def _mode_index(mode: Mode, outer_div: Product | None) -> str:
    if mode.regions:
        spans = "; ".join(
            f"{r.token.name}: {mode.rows}·{r.start} + token·{r.width} + elem - {r.start}"
            for r in mode.regions
        )
        return f"[by region of elem: {spans}]"
    return " + ".join(_term(t, t.coord == "elem" and t.div == outer_div) for t in mode.terms)


def symbolic_offset(layout: Layout) -> tuple[str, str]:
    """The pointer index and element offset as formulas over sizes and coordinates."""
    st = algebra.structure(layout)
    outer_div = st.elements[0].div if st.elements else None
    pointer = "0"
    for level in st.levels:
        digit = _term(level.term, level.term.coord == "elem" and level.term.div == outer_div)
        pointer = digit if pointer == "0" else f"{pointer}·{_product(level.extent)} + {digit}"
    addends = []
    for i, mode in enumerate(st.modes):
        index = _mode_index(mode, outer_div)
        if not index:
            continue  # a singleton axis addresses nothing
        stride = _product(tuple(f for m in st.modes[i + 1 :] for f in m.extent))
        if i == 0 and layout.has_leading_block_axis:
            stride = f"block_stride (default {stride})"
        if " + " in index and stride != "1":
            index = f"({index})"
        addends.append(index if stride == "1" else f"{index}·{stride}")
    return pointer, " + ".join(addends)


@dataclass(frozen=True)
class Explanation:
    layout: Layout
    sizes: Mapping[str, int]
    dtype: str

    def data(self) -> dict[str, Any]:
        """Everything ``kvlayout explain`` says, as plain data (``--json``)."""
        layout = self.layout
        elsize = DTYPE_BYTES[self.dtype]
        s = algebra.resolve_sizes(layout, self.sizes)
        shape = layout.tensor_shape(s)
        first = layout.pointer_order(s, limit=4)  # a table of millions costs nothing to explain
        heads, head = layout.num_heads(s), layout.head_size(s)
        row = heads * head
        kv_size = algebra.kv_size(layout, s)
        block_tokens, blocks = layout.size_of(s, Role.TOKEN), layout.size_of(s, Role.BLOCK)
        pointer, off = symbolic_offset(layout)
        out: dict[str, Any] = {
            "name": str(layout),
            "shape": layout.describe_shape(),
            "sizes": dict(s),
            # The numbers of each list level and of the leaf tensor as stored (a run of
            # regions shows its rows and its row width).
            "concrete": [*layout.list_shape(s), list(shape)],
            "leaf_shape": list(shape),
            "leaf_strides": list(layout.tensor_strides(s)),
            "pointers": math.prod(layout.list_shape(s)),
            "pointer_order": [list(p) for p in first],
            "kv_size": kv_size,
            "num_heads": heads,
            "head_size": head,
            "facts": {name: bool(getattr(layout, name)) for name in FACTS},
            "pointer_formula": pointer,
            "offset_formula": off,
            "dtype": self.dtype,
            "row_elements": row,
            "row_bytes": row * elsize,
            "empty": [f"{k}={v}" for k, v in s.items() if v == 0],
        }
        if block_tokens is not None and blocks is not None:
            plan = layout.copy_plan(s)
            out["block_tokens"], out["blocks"] = block_tokens, blocks
            out["block_bytes"] = kv_size * block_tokens * row * elsize
            out["layer_bytes"] = out["block_bytes"] * blocks
            out["copy_runs_bytes"] = [p.run * elsize for p in plan.pieces]
            out["strided_loops"] = max(len(p.loops) for p in plan.pieces)
        return out

    def lines(self) -> list[str]:
        d = self.data()
        layout = self.layout
        concrete = " x ".join(str(part) for part in d["concrete"])
        words = _pointer_words(layout, d["pointer_order"], d["pointers"])
        sizes = ", ".join(f"{k}={v}" for k, v in d["sizes"].items())
        out = [
            f"{layout}",
            f"  shape          {d['shape']}",
            f"  with sizes     {concrete}   ({sizes})",
        ]
        if d["empty"]:
            out.append(f"  empty          {', '.join(d['empty'])}: a cache of these sizes holds no data")
        out += [
            f"  leaf tensor    shape {d['leaf_shape']}, strides {d['leaf_strides']} (elements)",
            f"  pointer table  {d['pointers']} pointer(s): {words}",
            f"  kv_size        {d['kv_size']}   heads per row {d['num_heads']}   head_size {d['head_size']}",
            "  facts",
            *(f"    - {fact_doc(name)}" for name, on in d["facts"].items() if on),
            "  addressing (layer, kv, block, token, head, elem)",
            f"    pointer = {d['pointer_formula']}",
            f"    offset  = {d['offset_formula']}",
            f"  chunk row      {d['row_elements']} elements per token ({d['row_bytes']} bytes of "
            f"{self.dtype})",
        ]
        if "block_bytes" in d:
            runs = ", ".join(f"{n} B" for n in d["copy_runs_bytes"])
            out += [
                f"  per block      {d['block_bytes']} bytes per layer "
                f"({d['kv_size']} x {d['block_tokens']} tokens x {d['row_bytes']} B)",
                f"  per layer      {d['layer_bytes']} bytes over {d['blocks']} blocks",
                f"  block copy     contiguous runs of {runs}; {d['strided_loops']} strided loop(s) per piece",
            ]
        return out


def _pointer_words(layout: Layout, first: list[list[int]], count: int) -> str:
    if not layout.lists:
        return "one base pointer (layers are walked inside the tensor)"
    names = [lv.name for lv in layout.lists]
    shown = ", ".join("(" + ", ".join(f"{n}={i}" for n, i in zip(names, p, strict=True)) + ")" for p in first)
    more = f", ... ({count - len(first)} more)" if count > len(first) else ""
    return shown + more


def explain(layout: Layout, sizes: Mapping[str, int] | None = None, dtype: str = "bf16") -> str:
    return "\n".join(Explanation(layout, sizes or LLAMA_3_8B, dtype).lines())
