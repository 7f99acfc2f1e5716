"""The kvlayout command line: ``kvlayout formats``, ``kvlayout explain``, ``kvlayout demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvlayout.errors import KVLayoutError

__all__ = ["main", "parse_sizes"]

# Small enough to draw one block cell by cell.
SVG_SIZES = {"NL": 2, "NB": 4, "BS": 4, "NH": 2, "HS": 8, "NP": 2}


def parse_sizes(text: str) -> dict[str, int]:
    """``NL=32,NB=2048`` -> ``{"NL": 32, "NB": 2048}``, with a clear error for bad items."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise KVLayoutError(f"--sizes item {item!r} is not NAME=INT (for example NB=2048)")
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
    from kvlayout.registry import format_info, layout_of

    facts = (
        "is_mla",
        "is_hnd",
        "is_fused_packed",
        "is_two_major",
        "is_pbs_fused",
        "is_kv_second_tuple",
        "is_single_kv",
    )
    rows = []
    for fmt in EngineKVFormat:
        layout, info = layout_of(fmt), format_info(fmt)
        structure = (
            "cross-layer" if layout.is_cross_layer else "K/V lists" if layout.is_kv_list else "per layer"
        )
        flags = [f.removeprefix("is_") for f in facts if getattr(layout, f)]
        note = f"deprecated, use {info.replaced_by.name}" if info.replaced_by else ", ".join(info.engines)
        rows.append((str(int(fmt)), fmt.name, layout.describe_shape(), structure, f"kv={layout.kv_size}",
                     " ".join(flags) or "-", note))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kvlayout.explain import DTYPE_BYTES, LLAMA_3_8B, explain
    from kvlayout.picture import block_svg

    layout = _format_arg(args.format)
    if args.dtype not in DTYPE_BYTES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    sizes = {**LLAMA_3_8B, **parse_sizes(args.sizes)} if args.sizes else LLAMA_3_8B
    print(explain(layout, sizes, args.dtype))  # type: ignore[arg-type]
    if args.svg:
        small = {**SVG_SIZES, **parse_sizes(args.sizes)} if args.sizes else SVG_SIZES
        with open(args.svg, "w") as f:
            f.write(block_svg(layout, small))  # type: ignore[arg-type]
        print(f"  picture        {args.svg} (one block, sizes {small})")
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


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlayout.explain import LLAMA_3_8B, explain

    print("kvlayout: the engine KV formats (every fact derived from the name)\n")
    cmd_formats(args)
    print("\nOne layout explained, for a Llama-3-8B cache (32 layers, 8 KV heads of 128, 16-token blocks):\n")
    import kvlayout

    print(explain(kvlayout.parse("NL_X_TWO_NB_BS_NH_HS"), LLAMA_3_8B, "bf16"))
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    p = sub.add_parser("codegen", help="regenerate the files made from layouts.yaml (in a checkout)")
    p.add_argument("--check", action="store_true", help="fail with a diff if a generated file is stale")
    p.set_defaults(run=cmd_codegen)
    p = sub.add_parser("demo", help="the format table and one layout explained")
    p.set_defaults(run=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KVLayoutError as e:
        print(f"kvlayout: {e}", file=sys.stderr)
        return 2
