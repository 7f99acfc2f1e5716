"""Registrations as engines hand them over, for every (engine, format) detection returns.

``registrations()`` draws a :class:`RegistrationCase`: real CPU tensors shaped, strided
and nested the way the engine registers them, its hints, and the format and geometry
detection must find. The cases are read from layouts.yaml: every engine a format lists, deprecated formats
left out. Each known case is built from explicit per-engine shapes (not from the
detectors) with random sizes, dtypes and allocations: separate tensors, layers sliced
from one shared buffer, vLLM blocks-first views (``buf[:, layer]``, dim-0 padded),
padded block rows, and HND allocations exposed through an NHD permuted view, as vLLM
exposes them. A format added later gets a case built from its layout, with the hints its
engine sends for such a layout (:data:`ENGINE_HINTS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from kvlayout import EngineKVFormat as F
from kvlayout import Layout, layout_of
from kvlayout.catalog.registry import format_info
from kvlayout.detection import atom
from kvlayout.detection.base import engine_formats, unfolded_twin
from kvlayout.detection.kvbm import BLOCK_ORDERS, kvbm_layout
from kvlayout.detection.sglang import DSV4_HEAD_DIM, hicache_layout
from kvlayout.layout.algebra import kv_size, size_of, sizes_by_role
from kvlayout.layout.vocabulary import Role
from kvlayout.registration import nesting
from kvlayout.types import EngineType

__all__ = ["CASES", "ENGINE_HINTS", "FLOATS", "RegistrationCase", "flatten", "registrations"]

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)

# (engine, format value) for every answer detection can give: each engine a format lists
# in layouts.yaml, deprecated formats left out.
CASES: tuple[tuple[str, int], ...] = tuple(
    (engine, int(f)) for f in F if format_info(f).replaced_by is None for engine in format_info(f).engines
)


def _order(layout: Layout) -> dict[str, Any]:
    return {"kv_layout": "HND" if layout.is_hnd else "NHD"}


# The hints each engine sends with a registration of a layout (for cases built from it).
ENGINE_HINTS: dict[str, Any] = {
    "vllm": _order,
    "sglang": lambda lay: {
        **_order(lay),
        **({"kv_list_layout": "unified"} if lay.is_layer_list and not lay.is_pbs_fused else {}),
        **({"hicache_layout": hicache_layout(lay)} if not lay.list_depth else {}),
    },
    "trtllm": _order,
    "atom": _order,
    "max": lambda lay: {},
    # a latent pool is every KVBM block layout: its builder draws one
    "kvbm": lambda lay: {"kvbm_layout": kvbm_layout(lay) or "operational_nhd"},
}


@dataclass
class RegistrationCase:
    """One registration and what detection must say about it (``nb``/``bs`` None where
    the format folds NB*BS; ``hs`` as the head-size accessor reports it; ``leaves`` the
    tensors in pointer-table order; ``kv_size`` the chunk planes)."""

    engine: str
    fmt: F
    kv: Any
    hints: dict[str, Any]
    nl: int
    nb: int | None  # None: NB*BS folded, undefined
    bs: int | None
    pbs: int
    nh: int
    hs: int  # head_size as the accessor reports it
    dtype: torch.dtype
    leaves: list[torch.Tensor] = field(default_factory=list)  # input tensors, pointer-table order
    how: str = ""
    kv_size: int | None = None  # chunk planes (default: the layout's)

    def __post_init__(self) -> None:
        if self.kv_size is None:
            static = layout_of(self.fmt).kv_size
            assert static is not None, "a K/V axis of its own size: the builder says kv_size"
            self.kv_size = static

    def __repr__(self) -> str:
        shapes = sorted({tuple(t.shape) for t in self.leaves})
        return (
            f"{type(self).__name__}({self.engine}, {self.fmt.name}, {self.how}, "
            f"hints={self.hints}, leaf shapes={shapes})"
        )


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, n: int, mode: str) -> list[torch.Tensor]:
    """``n`` tensors of ``shape``: separate, one shared buffer, blocks-first or padded."""
    if mode == "shared":
        return list(torch.zeros((n, *shape), dtype=dtype).unbind(0))
    if mode == "blocks_first":  # vLLM blocks-first pool: [NB, NL, ...], a layer is buf[:, l]
        buf = torch.zeros((shape[0], n, *shape[1:]), dtype=dtype)
        return [buf[:, i] for i in range(n)]
    if mode.startswith("padded"):  # block rows wider than their content
        pad = int(mode[len("padded") :])
        row = math.prod(shape[1:])
        return [torch.zeros(shape[0], row + pad, dtype=dtype)[:, :row].view(shape) for _ in range(n)]
    return [torch.zeros(shape, dtype=dtype) for _ in range(n)]


def _expose(t: torch.Tensor, a: int | None, b: int | None, flip: bool) -> torch.Tensor:
    """An HND allocation as vLLM exposes it: the head and token axes swapped (a view)."""
    return t.transpose(a, b) if flip and a is not None and b is not None else t


@st.composite
def sizes(draw: st.DrawFn) -> dict[str, int]:
    return {
        "NL": draw(st.integers(1, 4)),
        "NB": draw(st.sampled_from([1, 2, 2, 3, 5])),
        "BS": draw(st.sampled_from([1, 2, 3, 4])),
        "NH": draw(st.sampled_from([1, 1, 2, 3])),
        "HS": draw(st.sampled_from([1, 2, 4, 8])),
    }


@st.composite
def registrations(draw: st.DrawFn, engine: str | None = None, value: int | None = None) -> RegistrationCase:
    """A registration of any (engine, format) in :data:`CASES`, or of the one given."""
    if engine is None or value is None:
        engine, value = draw(st.sampled_from(CASES))
    s = draw(sizes())
    nl, nb, bs, nh, hs = s["NL"], s["NB"], s["BS"], s["NH"], s["HS"]
    # ATOM's KV is never its scales' dtype, which its detector refuses as scales
    dtype = draw(st.sampled_from([d for d in FLOATS if engine != "atom" or d != atom.SCALE_DTYPE]))
    fmt = F(value)
    builder = _BUILDERS.get((engine, fmt), _from_layout)
    case: RegistrationCase = builder(draw, engine, fmt, nl, nb, bs, nh, hs, dtype)
    return case


Builder = Any


def _modes(draw: st.DrawFn, leading_block: bool) -> str:
    options = ["separate", "shared"]
    if leading_block:
        options += ["blocks_first", "padded1", "padded5"]
    return str(draw(st.sampled_from(options)))


def _vllm_per_layer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                    dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    phys = {
        F.NL_X_TWO_NB_BS_NH_HS: (2, nb, bs, nh, hs),
        F.NL_X_NB_TWO_BS_NH_HS: (nb, 2, bs, nh, hs),
        F.NL_X_TWO_NB_NH_BS_HS: (2, nb, nh, bs, hs),
        F.NL_X_NB_TWO_NH_BS_HS: (nb, 2, nh, bs, hs),
        F.NL_X_TWO_NB_NH_ONE_BS_HS: (2, nb, nh, 1, bs, hs),
    }[fmt]
    hnd_axes = {
        F.NL_X_TWO_NB_NH_BS_HS: (2, 3),
        F.NL_X_NB_TWO_NH_BS_HS: (2, 3),
        F.NL_X_TWO_NB_NH_ONE_BS_HS: (2, 4),
    }
    mode = _modes(draw, layout_of(fmt).has_leading_block_axis)
    leaves = _alloc(phys, dtype, nl, mode)
    a, b = hnd_axes.get(fmt, (None, None))
    flip = draw(st.booleans())
    kv = [_expose(t, a, b, flip) for t in leaves]
    hnd = fmt in hnd_axes
    # On the CPU, vLLM without a kv_layout hint is HND.
    hints: dict[str, Any] = (
        dict(draw(st.sampled_from([{}, {"kv_layout": "HND"}]))) if hnd else {"kv_layout": "NHD"}
    )
    if nb == 2 and fmt in (F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS):
        hints["kv_pair_axis"] = 1  # [2, 2, ...] is K/V-first unless told
    return RegistrationCase(
        engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, hs, dtype, leaves, f"{mode} flip={flip}"
    )


def _vllm_cross_layer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                      dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    hnd = fmt == F.NB_NL_TWO_NH_BS_HS
    phys = (nb, nl, 2, nh, bs, hs) if hnd else (nb, nl, 2, bs, nh, hs)
    mode = draw(st.sampled_from(["separate", "padded3"]))
    (t,) = _alloc(phys, dtype, 1, mode)
    flip = hnd and draw(st.booleans())
    kv = _expose(t, 3, 4, flip)
    hints: dict[str, Any] = draw(st.sampled_from([{}, {"kv_layout": "HND"}])) if hnd else {"kv_layout": "NHD"}
    return RegistrationCase(
        engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, hs, dtype, [t], f"{mode} flip={flip}"
    )


def _vllm_mla(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
              dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    width = hs * draw(st.sampled_from([1, 3, 16]))
    leaves = _alloc((nb, bs, width), dtype, nl, _modes(draw, True))
    hints = draw(st.sampled_from([{}, {"kv_layout": "NHD"}, {"kv_layout": "HND"}]))
    return RegistrationCase(engine, fmt, leaves, hints, nl, nb, bs, nb * bs, 1, width, dtype, leaves, "mla")


def _vllm_indexer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                  dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """vLLM's DSA indexer pages, uint8 rows of the layout's record width (132: fp8 values
    and a float32 scale; 68: packed MXFP4 values and ue8m0 scales), registered rank 3 or
    as one head of vLLM's rank-4 views."""
    layout = layout_of(fmt)
    width = layout.tensor_shape(sizes_by_role(layout, {Role.LAYER: 1, Role.BLOCK: 1, Role.TOKEN: 1}))[-1]
    form = draw(st.sampled_from(["rank3", "NHD", "HND", "BLNHC", "BLHNC"]))
    mode = _modes(draw, True)
    if form == "rank3":
        leaves = _alloc((nb, bs, width), torch.uint8, nl, mode)
        hints: dict[str, Any] = draw(st.sampled_from([{}, {"kv_layout": "NHD"}]))
    else:
        shape = (nb, 1, bs, width) if form in ("HND", "BLHNC") else (nb, bs, 1, width)
        leaves = _alloc(shape, torch.uint8, nl, mode)
        hints = {"kv_layout": form}
    return RegistrationCase(
        engine, fmt, leaves, hints, nl, nb, bs, nb * bs, 1, width, torch.uint8, leaves, f"{form} {mode}"
    )


def _vllm_fused(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    cs = draw(st.sampled_from([2 * hs, 2 * hs + 1, 6]))  # packed K/V, or an opaque state row
    if bs == 1 and nh != 1:
        bs = 2  # vLLM's attention blocks are never one token: a size-1 dim beside the tokens is one head
    hnd = fmt == F.NL_X_NB_NH_BS_CS
    mode = _modes(draw, True)
    leaves = _alloc((nb, nh, bs, cs) if hnd else (nb, bs, nh, cs), dtype, nl, mode)
    flip = hnd and draw(st.booleans())
    kv = [_expose(t, 1, 2, flip) for t in leaves]
    if hnd:
        # without kv_layout, heads on the CPU are vLLM's CPU_ATTN pages, one head too
        hints = draw(st.sampled_from([{"kv_layout": "HND"}, {"kv_layout": "BLHNC"}]))
    else:
        hints = draw(st.sampled_from([{"kv_layout": "NHD"}, {"kv_layout": "BLNHC"}]))
    return RegistrationCase(
        engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, cs, dtype, leaves, f"{mode} flip={flip}"
    )


def _vllm_head_outer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                     dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """vLLM 0.33 under ``LHBNC``: ``[NB, H, N, C]`` views of ``[H, NB, N, C]`` memory."""
    cs = draw(st.sampled_from([2 * hs, 2 * hs + 1, 6]))
    nh, nb, bs = max(nh, 2), max(nb, 2), max(bs, 2)  # one head or block is LBHNC's memory too
    leaves = _alloc((nh, nb, bs, cs), dtype, nl, _modes(draw, False))
    kv = [t.permute(1, 0, 2, 3) for t in leaves]
    hints: dict[str, Any] = draw(
        st.sampled_from([{"kv_layout": "LHBNC"}, {"kv_layout": "lhbnc", "num_kv_heads": nh}])
    )
    return RegistrationCase(engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, cs, dtype, leaves, "LHBNC view")


def _vllm_layer_inner(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                      dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """vLLM 0.33 under ``BHLNC``: per-layer ``[NB, H, N, C]`` views of one ``[NB, H, NL,
    N, C]`` allocation (block rows padded as a group packed beside a larger one pads
    them), or that tensor itself under the hint."""
    cs = draw(st.sampled_from([2 * hs, 2 * hs + 1, 6]))
    nl, nh = max(nl, 2), max(nh, 2)  # one layer or head is BLHNC's memory too
    row = nh * nl * bs * cs
    pad = draw(st.sampled_from([0, 0, 5]))
    buf = torch.zeros(nb, row + pad, dtype=dtype)
    pool = buf.as_strided((nb, nh, nl, bs, cs), (row + pad, nl * bs * cs, bs * cs, cs, 1))
    if draw(st.booleans()):
        kv: Any = [pool[:, :, layer] for layer in range(nl)]
        hints: dict[str, Any] = draw(
            st.sampled_from([{}, {"kv_layout": "BHLNC"}, {"kv_layout": "bhlnc", "num_kv_heads": nh}])
        )
    else:
        kv, hints = pool, {"kv_layout": "BHLNC"}
    how = f"BHLNC {'views' if isinstance(kv, list) else 'pool'} pad={pad}"
    return RegistrationCase(engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, cs, dtype, [pool], how)


def _vllm_kv_tuples(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                    dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    mode = _modes(draw, True)
    pairs = [_alloc((nb, bs, nh, hs), dtype, 2, mode) for _ in range(nl)]
    kv = [tuple(p) if draw(st.booleans()) else list(p) for p in pairs]
    leaves = [t for p in pairs for t in p]
    return RegistrationCase(engine, fmt, kv, {}, nl, nb, bs, nb * bs, nh, hs, dtype, leaves, mode)


def _vllm_planes(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                 dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    n_planes = draw(st.integers(1, 3))
    if n_planes == 2:  # two planes of one width would be a (K, V) pair
        widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=2, unique=True))
    else:
        widths = draw(st.lists(st.integers(1, 9), min_size=n_planes, max_size=n_planes))
    mode = _modes(draw, True)
    layers = [[_alloc((nb, bs, 1, w), dtype, 1, mode)[0] for w in widths] for _ in range(nl)]
    kv = [tuple(layer) for layer in layers]
    leaves = [t for layer in layers for t in layer]
    return RegistrationCase(
        engine, fmt, kv, {}, nl, nb, bs, nb * bs, 1, sum(widths), dtype, leaves, f"{widths} {mode}"
    )


def _sglang(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
            dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    pbs = nb * bs
    mode = draw(st.sampled_from(["separate", "shared"]))
    if fmt == F.NL_X_NB_BS_HS:
        if draw(st.booleans()):
            leaves = _alloc((nb, bs, hs), dtype, nl, mode)
            hints: dict[str, Any] = {"kv_list_layout": "unified"}
            if draw(st.booleans()):
                hints["tokens_per_block"] = bs
            return RegistrationCase(
                engine, fmt, leaves, hints, nl, nb, bs, pbs, 1, hs, dtype, leaves, "unified"
            )
        leaves = _alloc((pbs, 1, hs), dtype, nl, mode)
        return RegistrationCase(
            engine, fmt, leaves, {"tokens_per_block": bs}, nl, nb, bs, pbs, 1, hs, dtype, leaves, "mla+tpb"
        )
    if fmt == F.NL_X_NBBS_ONE_HS:
        leaves = _alloc((pbs, 1, hs), dtype, nl, mode)
        return RegistrationCase(engine, fmt, leaves, {}, nl, None, None, pbs, 1, hs, dtype, leaves, "mla")
    if fmt == F.NL_X_NB_BS_NH_HS:
        leaves = _alloc((nb, bs, nh, hs), dtype, nl, mode)
        return RegistrationCase(
            engine,
            fmt,
            leaves,
            {"kv_list_layout": "unified"},
            nl,
            nb,
            bs,
            pbs,
            nh,
            hs,
            dtype,
            leaves,
            "unified",
        )
    folded = fmt == F.TWO_X_NL_X_NBBS_NH_HS
    flat = draw(st.booleans())
    if folded or flat:
        k, v = _alloc((pbs, nh, hs), dtype, nl, mode), _alloc((pbs, nh, hs), dtype, nl, mode)
    else:
        k, v = _alloc((nb, bs, nh, hs), dtype, nl, mode), _alloc((nb, bs, nh, hs), dtype, nl, mode)
    hints = {"kv_list_layout": "k_v"} if flat or draw(st.booleans()) else {}
    if not folded and (flat or draw(st.booleans())):
        hints["tokens_per_block"] = bs
    kv = [*k, *v] if flat else [k, v]
    nbv, bsv = (None, None) if folded else (nb, bs)
    return RegistrationCase(
        engine, fmt, kv, hints, nl, nbv, bsv, pbs, nh, hs, dtype, [*k, *v], f"flat={flat}"
    )


def _trtllm(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
            dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """TRT-LLM's pool: HND as its own attention backend writes it (the default), NHD as
    its FlashInfer and Vanilla backends do (``get_buffers(layer, "NHD")``: the hint says so)."""
    form = draw(st.sampled_from(["6d", "4d", "[4d]"]))
    mode = draw(st.sampled_from(["separate", "padded2"]))
    sizes_hints = {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hs}
    hnd = layout_of(fmt).is_hnd
    layout_hints = [{}, {"kv_layout": "HND"}] if hnd else [{"kv_layout": "NHD"}]
    if form == "6d":
        (t,) = _alloc((nb, nl, 2, nh, bs, hs) if hnd else (nb, nl, 2, bs, nh, hs), dtype, 1, mode)
        hints: dict[str, Any] = {
            **draw(st.sampled_from([{}, sizes_hints])),
            **draw(st.sampled_from(layout_hints)),
        }
        kv: Any = t
    else:
        (t,) = _alloc((nb, nl, 2, nh * bs * hs), dtype, 1, mode)
        hints = {**sizes_hints, **draw(st.sampled_from(layout_hints))}
        kv = t if form == "4d" else [t]
    return RegistrationCase(engine, fmt, kv, hints, nl, nb, bs, nb * bs, nh, hs, dtype, [t], f"{form} {mode}")


def _trtllm_mla(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """TRT-LLM's K-only (MLA) pool: kv factor 1, one latent head, ``[NB, NL, 1, BS*HS]``."""
    form = draw(st.sampled_from(["6d", "6d tokens first", "4d", "[4d]"]))
    mode = draw(st.sampled_from(["separate", "padded2"]))
    rows = {"tokens_per_block": bs, "head_dim": hs}
    if form.startswith("6d"):  # Dynamo KVBM exports [NB, NL, 1, BS, 1, HS]
        (t,) = _alloc((nb, nl, 1, bs, 1, hs) if form != "6d" else (nb, nl, 1, 1, bs, hs), dtype, 1, mode)
        hints: dict[str, Any] = draw(st.sampled_from([{}, rows, {"num_kv_heads": 1, **rows}]))
        kv: Any = t
    else:
        (t,) = _alloc((nb, nl, 1, bs * hs), dtype, 1, mode)
        hints = {**rows, **draw(st.sampled_from([{}, {"num_kv_heads": 1}, {"kv_layout": "HND"}]))}
        kv = t if form == "4d" else [t]
    label = f"mla {form} {mode}"
    return RegistrationCase(engine, fmt, kv, hints, nl, nb, bs, nb * bs, 1, hs, dtype, [t], label)


def _kvbm_mla(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
              dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """Dynamo KVBM's MLA pool (outer dim 1, one latent head) in any of its block layouts:
    ``[NB, 1, NL, 1, BS, HS]`` (universal_tp), ``[NB, NL, 1, BS, 1, HS]`` (operational_nhd), ..."""
    name = draw(st.sampled_from(sorted(BLOCK_ORDERS)))
    dims = {Role.LAYER: nl, Role.KV: 1, Role.TOKEN: bs, Role.HEAD: 1}
    (t,) = _alloc((nb, *(dims[r] for r in BLOCK_ORDERS[name]), hs), dtype, 1, "separate")
    hints = {"kvbm_layout": name}
    return RegistrationCase(engine, fmt, t, hints, nl, nb, bs, nb * bs, 1, hs, dtype, [t], f"kvbm mla {name}")


def _atom(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
          dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    leaves = _alloc((nb, bs, hs), dtype, nl, _modes(draw, True))
    return RegistrationCase(engine, fmt, leaves, {}, nl, nb, bs, nb * bs, 1, hs, dtype, leaves, "mla")


def _sglang_indexer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                    dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """SGLang's DSA indexer pages: 2-D uint8 ``[pages, page_size * 132]`` (fp8 keys and
    their scales), or 2-D bf16 ``[pages, page_size * 128]`` (``index_cache_dtype``
    bfloat16: keys without scales), read as their bytes."""
    layout = layout_of(fmt)
    width = layout.tensor_shape(sizes_by_role(layout, {Role.LAYER: 1, Role.BLOCK: 1, Role.TOKEN: 1}))[-1]
    held = {t.region.dtype for t in layout.tensor if t.region is not None}
    one = next(iter(held)) if len(held) == 1 else None
    stored = getattr(torch, one) if one is not None else torch.uint8  # mixed regions: bytes
    item = torch.empty((), dtype=stored).element_size()
    leaves = _alloc((nb, bs * width // item), stored, nl, draw(st.sampled_from(["separate", "shared"])))
    hints: dict[str, Any] = draw(st.sampled_from([{}, {"tokens_per_block": bs}]))
    if stored == torch.bfloat16 and bs * width // item == DSV4_HEAD_DIM:
        hints = {"tokens_per_block": bs}  # else it is DeepSeek-V4's unified KV row, and refused
    return RegistrationCase(
        engine, fmt, leaves, hints, nl, nb, bs, nb * bs, 1, width, torch.uint8, leaves, "indexer pages"
    )


def _sglang_indexer_host(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                         dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """SGLang's DSA indexer host pool (``DSAIndexerPoolHost``): uint8 pages of ``bs``
    132-byte records, ``[NL, pages, bs * 132]`` (layer_first) or ``[pages, NL, 1, bs * 132]``
    (page_first and page_first_direct), read with the page size."""
    layer_first = layout_of(fmt).axis_of(Role.LAYER) == 0
    pool = torch.zeros((nl, nb, bs * 132) if layer_first else (nb, nl, 1, bs * 132), dtype=torch.uint8)
    name = "layer_first" if layer_first else draw(st.sampled_from(["page_first", "page_first_direct"]))
    hints = {"hicache_layout": name, "tokens_per_block": bs}
    return RegistrationCase(engine, fmt, pool, hints, nl, nb, bs, nb * bs, 1, 132, torch.uint8, [pool], name)


def _trtllm_indexer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                    dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """TRT-LLM's DSA indexer K pool (``get_indexer_k_cache_pool()``): uint8, kv factor 1,
    ``[NB, NL, 1, bs * width]``, each block its tokens' values, then their scales (width
    132: fp8 values and a float32 scale; 68: ``indexer_k_dtype="fp4"``, packed e2m1 values
    and four ue8m0 exponents)."""
    layout = layout_of(fmt)
    width = layout.tensor_shape(sizes_by_role(layout, {Role.LAYER: 1, Role.BLOCK: 1, Role.TOKEN: 1}))[-1]
    pool = torch.zeros((nb, nl, 1, bs * width), dtype=torch.uint8)
    hints = {"tokens_per_block": bs, **draw(st.sampled_from([{}, {"head_dim": width}, {"head_dim": 128}]))}
    return RegistrationCase(
        engine, fmt, pool, hints, nl, nb, bs, nb * bs, 1, width, torch.uint8, [pool], "indexer"
    )


def _max(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
         dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """MAX's one buffer ``[NB, KV, NL, BS, NH, HS]``, KV 2 (or 1 and one head: MLA)."""
    kvd = draw(st.sampled_from([1, 2]))
    heads = nh if kvd == 2 else 1
    (t,) = _alloc((nb, kvd, nl, bs, heads, hs), dtype, 1, draw(st.sampled_from(["separate", "padded3"])))
    kv: Any = [t] if draw(st.booleans()) else t
    sent = {"layout_format": fmt.name, "num_layers": nl, "kv_dim": kvd, "tokens_per_block": bs,
            "page_size": bs, "num_kv_heads": heads, "head_dim": hs, "total_num_blocks": nb}  # fmt: skip
    hints = draw(st.sampled_from([{}, sent]))
    return RegistrationCase(
        engine, fmt, kv, hints, nl, nb, bs, nb * bs, heads, hs, dtype, [t], f"kv_dim={kvd}", kv_size=kvd
    )


def _max_per_layer(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                   dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """MAX under ``per_layer_buffers``: one ``[NB, KV, 1, BS, NH, HS]`` buffer per layer,
    KV 2 (or 1 and one head: MLA); two layers at least (one is the cross-layer buffer)."""
    nl, kvd = max(nl, 2), draw(st.sampled_from([1, 2]))
    heads = nh if kvd == 2 else 1
    leaves = _alloc((nb, kvd, 1, bs, heads, hs), dtype, nl, draw(st.sampled_from(["separate", "padded3"])))
    sent = {"num_layers": nl, "kv_dim": kvd, "tokens_per_block": bs, "page_size": bs,
            "num_kv_heads": heads, "head_dim": hs, "total_num_blocks": nb}  # fmt: skip
    hints = draw(st.sampled_from([{}, sent]))
    return RegistrationCase(
        engine,
        fmt,
        leaves,
        hints,
        nl,
        nb,
        bs,
        nb * bs,
        heads,
        hs,
        dtype,
        leaves,
        f"per-layer kv_dim={kvd}",
        kv_size=kvd,
    )


def _sglang_host_pages(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                       dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """An SGLang HiCache host pool read in pages: the pool as SGLang allocates it (NB*BS
    folded), with the hints that read it in pages."""
    folded = next(f for f in _SGLANG_FOLDED_POOLS if unfolded_twin(EngineType.SGLANG, f) is fmt)
    case = _from_layout(draw, engine, folded, nl, nb, bs, nh, hs, dtype)
    return dataclasses.replace(
        case, fmt=fmt, hints={**case.hints, "tokens_per_block": bs}, nb=nb, bs=bs, how="host pool in pages"
    )


_SGLANG_FOLDED_POOLS = tuple(
    f for f in engine_formats(EngineType.SGLANG) if not layout_of(f).list_depth and layout_of(f).is_pbs_fused
)


def _from_layout(draw: st.DrawFn, engine: str, fmt: F, nl: int, nb: int, bs: int, nh: int, hs: int,
                 dtype: torch.dtype) -> RegistrationCase:  # fmt: skip
    """A format with no builder of its own: tensors of the layout's shape, nested as its
    list levels say, with the hints the engine sends for such a layout."""
    layout = layout_of(fmt)
    roles = {Role.LAYER: nl, Role.BLOCK: nb, Role.TOKEN: bs, Role.HEAD: nh, Role.ELEMENT: hs, Role.KV: 2}
    sizes = sizes_by_role(layout, roles)
    if layout.is_indexer:
        dtype = torch.uint8
    shape = layout.tensor_shape(sizes)
    lengths = layout.list_shape(sizes)
    mode = _modes(draw, layout.has_leading_block_axis and bool(lengths))
    leaves = _alloc(shape, dtype, max(1, len(layout.pointer_order(sizes))), mode)

    def nest(level: int, items: list[torch.Tensor]) -> Any:
        if level == len(lengths):
            return items[0]
        step = len(items) // lengths[level]
        return [nest(level + 1, items[i * step : (i + 1) * step]) for i in range(lengths[level])]

    kv = nest(0, leaves)
    heads = layout.num_heads(sizes)
    page = size_of(layout, sizes, Role.PAGE)
    assert page is not None
    unfolded = layout.axis_of(Role.BLOCK) is not None
    return RegistrationCase(
        engine, fmt, kv, ENGINE_HINTS[engine](layout), size_of(layout, sizes, Role.LAYER) or 1,
        nb if unfolded else None, bs if unfolded else None, page, heads, layout.head_size(sizes), dtype,
        leaves, f"from the layout, {mode}", kv_size=kv_size(layout, sizes),
    )  # fmt: skip


_BUILDERS: dict[tuple[str, F], Builder] = {
    **{("sglang", unfolded_twin(EngineType.SGLANG, f)): _sglang_host_pages for f in _SGLANG_FOLDED_POOLS},
    **{
        ("vllm", f): _vllm_per_layer
        for f in (
            F.NL_X_TWO_NB_BS_NH_HS,
            F.NL_X_NB_TWO_BS_NH_HS,
            F.NL_X_TWO_NB_NH_BS_HS,
            F.NL_X_NB_TWO_NH_BS_HS,
            F.NL_X_TWO_NB_NH_ONE_BS_HS,
        )
    },
    ("vllm", F.NB_NL_TWO_BS_NH_HS): _vllm_cross_layer,
    ("vllm", F.NB_NL_TWO_NH_BS_HS): _vllm_cross_layer,
    ("vllm", F.NL_X_NB_BS_HS): _vllm_mla,
    ("vllm", F.NL_X_NB_BSV_BSS): _vllm_indexer,
    ("vllm", F.NL_X_NB_BSV4_BSS4): _vllm_indexer,
    ("vllm", F.NL_X_NB_NH_BS_CS): _vllm_fused,
    ("vllm", F.NL_X_NH_NB_BS_CS): _vllm_head_outer,
    ("vllm", F.NB_NH_NL_BS_CS): _vllm_layer_inner,
    ("vllm", F.NL_X_NB_BS_NH_CS): _vllm_fused,
    ("vllm", F.NL_X_TWO_X_NB_BS_NH_HS): _vllm_kv_tuples,
    ("vllm", F.NL_X_NP_X_NB_BS_ONE_HS): _vllm_planes,
    **{
        ("sglang", f): _sglang
        for f in (
            F.NL_X_NB_BS_HS,
            F.TWO_X_NL_X_NBBS_NH_HS,
            F.NL_X_NBBS_ONE_HS,
            F.TWO_X_NL_X_NB_BS_NH_HS,
            F.NL_X_NB_BS_NH_HS,
        )
    },
    ("sglang", F.NL_X_NB_BSV_BSS): _sglang_indexer,
    ("sglang", F.NL_X_NB_BSK): _sglang_indexer,
    ("sglang", F.NL_NB_BSV_BSS): _sglang_indexer_host,
    ("sglang", F.NB_NL_BSV_BSS): _sglang_indexer_host,
    ("trtllm", F.NB_NL_TWO_BS_NH_HS): _trtllm,
    ("trtllm", F.NB_NL_TWO_NH_BS_HS): _trtllm,
    ("trtllm", F.NB_NL_ONE_BS_HS): _trtllm_mla,
    ("trtllm", F.NB_NL_BSV_BSS): _trtllm_indexer,
    ("trtllm", F.NB_NL_BSV4_BSS4): _trtllm_indexer,
    ("atom", F.NL_X_NB_BS_HS): _atom,
    ("max", F.NB_KV_NL_BS_NH_HS): _max,
    ("kvbm", F.NB_NL_ONE_BS_HS): _kvbm_mla,
    ("max", F.NL_X_NB_KV_ONE_BS_NH_HS): _max_per_layer,
}


def flatten(kv: Any) -> list[torch.Tensor]:
    """Leaves depth-first (the order of the pointer table for every format)."""
    return [t for _, t in nesting.leaves(kv)]
