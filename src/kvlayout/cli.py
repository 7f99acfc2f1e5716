"""The kvlayout command line: ``kvlayout formats``, ``explain``, ``describe``, ``detect``,
``codegen``, ``demo``."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlayout.errors import KVLayoutError, index_ranges

if TYPE_CHECKING:
    from kvlayout._generated.formats import EngineKVFormat

__all__ = ["main", "parse_sizes"]


def parse_sizes(text: str) -> dict[str, int]:
    """``NL=32,NB=2048`` -> ``{"NL": 32, "NB": 2048}``, with a clear error for bad items
    and for names that are not sized tokens of the vocabulary."""
    from kvlayout._generated.vocabulary import VOCABULARY

    known = {
        n
        for t in VOCABULARY.values()
        if t.literal is None and t.region is None
        for n in (t.name, t.label)
        if n
    }
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise KVLayoutError(f"--sizes item {item!r} is not NAME=INT (for example NB=2048)")
        if key.strip() not in known:
            raise KVLayoutError(
                f"--sizes {key.strip()!r} is not a size token; sizes are {', '.join(sorted(known))}"
            )
        sizes[key.strip()] = int(value)
    return sizes


def _format_arg(text: str) -> object:
    """A format value, a catalog name or any layout name."""
    import kvlayout

    if text.isdigit():
        return kvlayout.layout_of(int(text))
    return kvlayout.parse(text)


def cmd_formats(args: argparse.Namespace) -> int:
    from kvlayout import EngineKVFormat
    from kvlayout.layout import FACTS, STRUCTURE_FACTS
    from kvlayout.registry import format_info, layout_of
    from kvlayout.vocabulary import Role

    shown = [f for f in FACTS if f not in STRUCTURE_FACTS and f != "has_leading_block_axis"]
    rows = []
    for fmt in EngineKVFormat:
        layout, info = layout_of(fmt), format_info(fmt)
        structure = (
            "cross-layer" if layout.is_cross_layer else "K/V lists" if layout.is_kv_list else "per layer"
        )
        flags = [f.removeprefix("is_") for f in shown if getattr(layout, f)]
        note = f"deprecated, use {info.replaced_by.name}" if info.replaced_by else ", ".join(info.engines)
        kv_size = layout.kv_size if layout.kv_size is not None else layout.symbol_of(Role.KV)
        rows.append((str(int(fmt)), fmt.name, layout.describe_shape(), structure, f"kv={kv_size}",
                     " ".join(flags) or "-", note))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kvlayout.explain import DTYPE_BYTES, LLAMA_3_8B, example_sizes, explain
    from kvlayout.picture import block_svg

    layout = _format_arg(args.format)
    if args.dtype not in DTYPE_BYTES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    sizes = {**LLAMA_3_8B, **parse_sizes(args.sizes)} if args.sizes else LLAMA_3_8B
    print(explain(layout, sizes, args.dtype))  # type: ignore[arg-type]
    if args.svg:
        small = {**example_sizes(small=True), **parse_sizes(args.sizes)}  # one block, cell by cell
        with open(args.svg, "w") as f:
            f.write(block_svg(layout, small))  # type: ignore[arg-type]
        print(f"  picture        {args.svg} (one block, sizes {small})")
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    """A layout as JSON, for tools (kvlayout.describe)."""
    import json

    from kvlayout.description import describe

    layout = _format_arg(args.format)
    sizes = parse_sizes(args.sizes) if args.sizes else None
    desc = describe(layout, sizes, block_stride=args.block_stride)  # type: ignore[arg-type]
    print(json.dumps(desc.to_dict(), indent=2))
    return 0


def cmd_codegen(args: argparse.Namespace) -> int:
    """Run the generator of the kvlayout checkout around the current directory."""
    import os
    import subprocess
    from pathlib import Path

    here = Path.cwd().resolve()
    root = next(
        (p for p in (here, *here.parents) if (p / "layouts.yaml").is_file() and (p / "codegen").is_dir()),
        None,
    )
    if root is None:
        raise KVLayoutError(
            f"kvlayout codegen runs inside a kvlayout checkout; no layouts.yaml and codegen/ above {here}"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "codegen", *(["--check"] if args.check else [])]
    return subprocess.run(command, cwd=root, env=env, check=False).returncode


_DTYPES = {
    "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn",
    "uint8": "uint8", "int8": "int8",
}  # fmt: skip


def _hints(items: Sequence[str]) -> dict[str, object]:
    hints: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KVLayoutError(f"--hint {item!r} is not KEY=VALUE (for example kv_layout=HND)")
        hints[key] = int(value) if value.lstrip("-").isdigit() else value
    return hints


def cmd_detect(args: argparse.Namespace) -> int:
    import torch

    import kvlayout
    from kvlayout.shapespec import parse_shape_spec

    spec = parse_shape_spec(args.shape)
    if args.dtype not in _DTYPES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
    dtype = getattr(torch, _DTYPES[args.dtype])
    hints = _hints(args.hint)

    def build(node: object) -> object:
        if isinstance(node, tuple) and all(isinstance(x, int) for x in node):
            return torch.empty(node, dtype=dtype, device=args.device)
        children = [build(c) for c in node]  # type: ignore[attr-defined]
        return tuple(children) if isinstance(node, tuple) else children

    kv: Any = build(spec.root)
    shapes = ", ".join(sorted({str(list(s)) for s in spec.leaves()}))
    memory = "meta tensors, no memory" if args.device == "meta" else f"allocated on {args.device}"
    count = len(spec.leaves())
    print(f"{args.engine} registration {spec.text}: {count} tensor(s) {shapes} {args.dtype} ({memory})")
    if hints:
        print(f"  hints        {hints}")
    try:
        if len(spec.parts) > 1:  # a hybrid: one detection group per `+` item
            bounds = [sum(spec.parts[:i]) for i in range(len(spec.parts) + 1)]
            groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
            normalized, formats = kvlayout.normalize_and_discover_per_layer_formats(
                kv, groups, args.engine, hints
            )
        else:
            fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, args.engine, hints)
            formats = [fmt] * kvlayout.get_num_layers(normalized, fmt)
        grouped = kvlayout.group_layers_by_identity(normalized, formats)
    except (KVLayoutError, TypeError) as e:
        print(f"  detection failed, as a user would see it:\n    {type(e).__name__}: {e}")
        return 1
    print(f"  kernel groups {len(grouped)}")
    for n, (identity, layers) in enumerate(grouped):
        fmt = identity.engine_kv_format
        stride = identity.block_stride_elems
        block_size = identity.block_size or "n/a (NB*BS folded; hint tokens_per_block to split it)"
        print(f"  group {n}: layers {index_ranges(layers)}")
        print(f"    format     {int(fmt)} {fmt.name}   {kvlayout.describe_shape(fmt)}")
        print(f"    backend    {kvlayout.get_attention_backend(fmt)}")
        print(f"    shape      {_group_shape(normalized, fmt, layers)}")
        print(
            f"    geometry   block_size {block_size}, heads {identity.num_heads}, "
            f"head_size {identity.head_size}, kv_size {identity.kv_size}, {identity.dtype}"
            + (f", block stride {stride} elements" if stride is not None else "")
        )
    return 0


def _group_shape(kv: Any, fmt: EngineKVFormat, layers: Sequence[int]) -> str:
    """The group's concrete shape, from its kernel descriptor where the format has NB and BS."""
    import kvlayout

    first = layers[0]
    try:
        nb, bs = kvlayout.get_num_blocks(kv, fmt, first), kvlayout.get_block_size(kv, fmt, first)
    except KVLayoutError:  # NB*BS folded: the registration's own shape says all there is
        return kvlayout.get_concrete_engine_kv_shape(kv, fmt)
    stride = kvlayout.resolve_block_stride_and_log_layout(kv, fmt, first, 0)
    desc = kvlayout.make_page_buffer_shape_desc(kv, fmt, first, len(layers), nb, bs, stride)
    return kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlayout.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    from kvlayout.types import EngineType

    ap = argparse.ArgumentParser(
        prog="kvlayout",
        description="Describe, detect and address the paged KV caches of LLM serving engines.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("formats", help="the table of every engine KV format")
    p.set_defaults(run=cmd_formats)
    p = sub.add_parser("explain", help="a layout in words and numbers")
    p.add_argument("format", help="a format value (1), name (NL_X_TWO_NB_BS_NH_HS) or any layout name")
    p.add_argument("--sizes", default="", help="sizes to use, e.g. NL=32,NB=2048,BS=16,NH=8,HS=128")
    p.add_argument(
        "--dtype", default="bf16", help="element type for byte counts: bf16, fp16, fp32, fp8, uint8"
    )
    p.add_argument(
        "--svg", metavar="FILE", help="also write a picture of one block's memory order (small sizes)"
    )
    p.set_defaults(run=cmd_explain)
    p = sub.add_parser(
        "describe", help="a layout as JSON for tools: axes, list levels, K/V placement, strides"
    )
    p.add_argument("format", help="a format value (19), name (NB_KV_NL_BS_NH_HS) or any layout name")
    p.add_argument("--sizes", default="", help="sizes for the extents and strides, e.g. NB=2048,BS=16")
    p.add_argument(
        "--block-stride", type=int, default=None, help="elements between blocks when they are padded apart"
    )
    p.set_defaults(run=cmd_describe)
    p = sub.add_parser(
        "detect",
        help="detect a registration described by its shapes (meta tensors, no memory)",
        description="Build the registration as meta tensors and run detection: the format and geometry, "
        "or the error a user would get.",
    )
    p.add_argument("--engine", required=True, choices=[e.value for e in EngineType])
    p.add_argument(
        "--shape",
        required=True,
        help="e.g. '32x[2,2048,16,8,128]', '2x32x[8192,8,128]', '[2048,32,2,16,8,128]', "
        "'61x([64,64,1,512],[64,64,1,64])', '3x[...]+2x[...]'",
    )
    p.add_argument("--dtype", default="bf16", help=f"one of {', '.join(_DTYPES)}")
    p.add_argument(
        "--hint",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a layout hint, repeatable: kv_layout=HND, tokens_per_block=16, kv_list_layout=k_v, ...",
    )
    p.add_argument(
        "--device", default="meta", help="meta (default, no memory) or cpu (vLLM's CPU defaults apply)"
    )
    p.set_defaults(run=cmd_detect)
    p = sub.add_parser("codegen", help="regenerate the files made from layouts.yaml (in a checkout)")
    p.add_argument("--check", action="store_true", help="fail with a diff if a generated file is stale")
    p.set_defaults(run=cmd_codegen)
    p = sub.add_parser("demo", help="detection, geometry and a verified round trip on engine-shaped examples")
    p.set_defaults(run=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KVLayoutError as e:
        print(f"kvlayout: {e}", file=sys.stderr)
        return 2
