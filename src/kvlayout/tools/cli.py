"""The kvlayout command line: ``formats``, ``explain``, ``describe``, ``detect``, ``plan``,
``codegen``, ``demo``.

Exit codes: 0 done; 1 ``detect`` ran and the registration is one kvlayout refuses (the
error is printed as a user would see it), or ``plan`` ran and a rank pair cannot be served
(the plan says why); 2 the command line or its values are wrong, in one line (values are
bounded where they are read: the MAX_* constants here, in ``registrations`` and in
``plan_command``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlayout.errors import KVLayoutError
from kvlayout.layout.dtypes import SHORT_NAMES
from kvlayout.tools.plan_command import MAX_TP, STATE_EXAMPLE, cmd_plan
from kvlayout.tools.registrations import _natural, cmd_detect

if TYPE_CHECKING:
    from kvlayout.layout.ast import Layout

__all__ = ["MAX_SIZE", "main", "parse_sizes"]

MAX_SIZE = 2**31 - 1
"""The largest size ``--sizes`` takes: far above any engine's axis (a pool holds at most
tens of millions of blocks or token slots, a model a few hundred layers, a head row a few
thousand elements), so anything larger is a mistake, not a cache. The tensor the sizes
make must also have at most 2**63 - 1 elements: the generated indexers compute int64
element offsets."""


def parse_sizes(text: str) -> dict[str, int]:
    """``NL=32,NB=2048`` -> ``{"NL": 32, "NB": 2048}``, with a clear error for bad items,
    for names that are not sized tokens of the vocabulary and for a size given twice."""
    from kvlayout._generated.formats import SIZE_SYMBOLS
    from kvlayout._generated.vocabulary import VOCABULARY

    canonical = {n: name for name in SIZE_SYMBOLS for n in (name, VOCABULARY[name].label) if n}
    sizes: dict[str, int] = {}
    given: dict[str, str] = {}  # canonical name -> the item that gave it
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        number = _natural(value)
        if not sep or not key or number is None:
            raise KVLayoutError(f"--sizes item {item!r} is not NAME=INT (for example NB=2048)")
        if key not in canonical:
            raise KVLayoutError(
                f"--sizes {key!r} is not a size token; sizes are {', '.join(sorted(canonical))}"
            )
        if number > MAX_SIZE:
            raise KVLayoutError(
                f"--sizes {item!r}: a size is at most 2**31 - 1 = {MAX_SIZE} (no KV cache axis comes near)"
            )
        if canonical[key] in given:
            raise KVLayoutError(
                f"--sizes gives {canonical[key]} twice ({given[canonical[key]]!r} and {item!r})"
            )
        given[canonical[key]] = item
        sizes[key] = number
    return sizes


def _addressable(layout: Layout, sizes: dict[str, int]) -> dict[str, int]:
    """``sizes``, unless the tensor they make has more elements than int64 offsets reach."""
    import math

    from kvlayout.errors import SizeError
    from kvlayout.layout import algebra

    try:
        elements = math.prod(algebra.tensor_shape(layout, sizes))
    except SizeError:  # sizes left out: nothing to count yet
        return sizes
    if elements > 2**63 - 1:
        raise KVLayoutError(
            f"--sizes make a {layout} tensor of {elements} elements, more than int64 offsets address "
            "(2**63 - 1)"
        )
    return sizes


def _format_arg(text: str) -> Layout:
    """A format value, a catalog name or any layout name."""
    import kvlayout

    value = _natural(text)
    if value is not None:
        if value > 2**31:  # said as written, not as the int it reads as
            raise KVLayoutError(f"unknown engine KV format value {text}")
        return kvlayout.layout_of(value)
    return kvlayout.parse(text)


def cmd_formats(args: argparse.Namespace) -> int:
    from kvlayout import EngineKVFormat
    from kvlayout.catalog.registry import format_info, layout_of
    from kvlayout.layout.ast import FACTS, STRUCTURE_FACTS
    from kvlayout.layout.vocabulary import Role

    shown = [f for f in FACTS if f not in STRUCTURE_FACTS and f != "has_leading_block_axis"]
    records: list[dict[str, Any]] = []
    for fmt in EngineKVFormat:
        layout, info = layout_of(fmt), format_info(fmt)
        structure = (
            "cross-layer" if layout.is_cross_layer else "K/V lists" if layout.is_kv_list else "per layer"
        )
        kv_size = layout.kv_size if layout.kv_size is not None else layout.symbol_of(Role.KV)
        records.append({
            "value": int(fmt), "name": fmt.name, "shape": layout.describe_shape(), "structure": structure,
            "kv_size": kv_size, "facts": [f.removeprefix("is_") for f in shown if getattr(layout, f)],
            "engines": list(info.engines), "backends": list(info.backends),
            "deprecated_by": info.replaced_by.name if info.replaced_by else None,
        })  # fmt: skip
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    rows = [("value", "name", "shape", "structure", "kv", "facts", "engines")]
    for r in records:
        note = f"deprecated, use {r['deprecated_by']}" if r["deprecated_by"] else ", ".join(r["engines"])
        rows.append((str(r["value"]), str(r["name"]), str(r["shape"]), str(r["structure"]),
                     f"kv={r['kv_size']}", " ".join(r["facts"]) or "-", note))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kvlayout.tools.explain import DTYPE_BYTES, LLAMA_3_8B, Explanation, example_sizes, explain
    from kvlayout.tools.picture import block_svg

    layout = _format_arg(args.format)
    if args.dtype not in DTYPE_BYTES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    sizes = _addressable(layout, {**LLAMA_3_8B, **parse_sizes(args.sizes)})
    if args.json:
        print(json.dumps(Explanation(layout, sizes, args.dtype).data(), indent=2))
        return 0
    picture = None
    if args.svg:  # drawn and written first: a path that cannot be written prints nothing else
        small = {**example_sizes(small=True), **parse_sizes(args.sizes)}  # one block, cell by cell
        picture = block_svg(layout, small)
        try:
            with open(args.svg, "w") as f:
                f.write(picture)
        except OSError as e:
            raise KVLayoutError(f"--svg {args.svg}: cannot write it ({e.strerror or e})") from None
    print(explain(layout, sizes, args.dtype))
    if picture is not None:
        print(f"  picture        {args.svg} (one block, sizes {small})")
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    """A layout as JSON, for tools (kvlayout.describe)."""
    import json

    from kvlayout.layout.description import describe

    layout = _format_arg(args.format)
    sizes = _addressable(layout, parse_sizes(args.sizes)) if args.sizes else None
    desc = describe(layout, sizes, block_stride=args.block_stride)
    if args.block_stride:  # checked against the block by describe; here against int64 offsets
        _padded_addressable(layout, sizes or {}, args.block_stride)
    print(json.dumps(desc.to_dict(), indent=2))
    return 0


def _padded_addressable(layout: Layout, sizes: dict[str, int], block_stride: int) -> None:
    """A tensor whose blocks lie ``block_stride`` elements apart must still have its last
    element within int64 offsets (the generated indexers compute them)."""
    from kvlayout.errors import SizeError
    from kvlayout.layout import algebra

    if block_stride > 2**63 - 1:
        raise KVLayoutError(
            f"--block-stride {block_stride}: more elements than int64 offsets address (2**63 - 1)"
        )
    try:
        shape = algebra.tensor_shape(layout, sizes)
        strides = algebra.tensor_strides(layout, sizes, block_stride)
    except SizeError:  # NB left out: one block, checked by describe
        return
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if span > 2**63 - 1:
        raise KVLayoutError(
            f"--block-stride {block_stride}: {shape[0]} blocks that far apart span {span} elements, more "
            "than int64 offsets address (2**63 - 1)"
        )


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
    from kvlayout.tools.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    from kvlayout import __version__
    from kvlayout.types import EngineType

    ap = argparse.ArgumentParser(
        prog="kvlayout",
        description="Describe, detect and address the paged KV caches of LLM serving engines.",
        epilog="exit codes: 0 done; 1 detect ran and kvlayout refuses the registration (the error is "
        "printed as a user would see it), or plan ran and a rank pair cannot be served (the plan says why); "
        "2 a wrong command line or value",
    )
    ap.add_argument("--version", action="version", version=f"kvlayout {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("formats", help="the table of every engine KV format")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(run=cmd_formats)
    p = sub.add_parser("explain", help="a layout in words and numbers")
    p.add_argument("format", help="a format value (1), name (NL_X_TWO_NB_BS_NH_HS) or any layout name")
    p.add_argument("--sizes", default="", help="sizes to use, e.g. NL=32,NB=2048,BS=16,NH=8,HS=128")
    p.add_argument(
        "--dtype",
        default="bf16",
        help=f"element type for byte counts: {', '.join(SHORT_NAMES)} (default: bf16)",
    )
    p.add_argument(
        "--svg", metavar="FILE", help="also write a picture of one block's memory order (small sizes)"
    )
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
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
        "plan",
        help="plan a prefill/decode transfer between two registrations (shapes only, no memory)",
        description="Every rank pair of a transfer between two registrations given as detect takes them: "
        "the block map's runs, bytes and mean run, the NIXL descriptors of each strategy, the predicted time "
        "by the cost model's defaults and the choice, or why the pair cannot be served (then it exits 1).",
    )
    for where in ("src", "dst"):
        p.add_argument(f"--{where}-engine", required=True, help=f"the {where} engine, as detect's --engine")
        p.add_argument(
            f"--{where}-shape", required=True, help=f"the {where} registration, as detect's --shape"
        )
        p.add_argument(f"--{where}-hint", action="append", default=[], metavar="KEY=VALUE",
                       help=f"a layout hint of the {where} side, repeatable: kv_layout=HND (a vLLM shape "
                            "reads as NHD without it: plan's tensors are meta, not on the CPU), "
                            "tokens_per_block=16, ...")  # fmt: skip
        p.add_argument(
            f"--{where}-tp", type=int, default=1, help=f"the {where} side's TP degree (1 to {MAX_TP})"
        )
        p.add_argument(f"--{where}-share", action="append", default=[], metavar="SHARER=TARGET",
                       help=f"a {where} layer sharing another's KV cache, as detect's --share")  # fmt: skip
        p.add_argument(f"--{where}-dcp", type=int, default=1, metavar="SIZE",
                       help=f"the {where} side's decode context parallel size (vLLM's DCP: rank r "
                            "holds CP rank r %% SIZE's tokens; default 1, none)")  # fmt: skip
        p.add_argument(f"--{where}-cp-interleave", type=int, default=1,
                       help=f"the {where} side's cp_kv_cache_interleave_size: tokens a CP rank holds "
                            f"at a time (default 1; above 1 it needs --{where}-dcp)")  # fmt: skip
        p.add_argument(f"--{where}-block-size", type=int, default=None, metavar="TOKENS",
                       help=f"the {where} side's block ids' tokens, a multiple of the blocks "
                            f"--{where}-shape reads in (vLLM's scheduler blocks over a group its "
                            "attention kernel pages finer: FlashInfer's pages of a hybrid's 544-token "
                            "blocks); default: those")  # fmt: skip
        p.add_argument(f"--{where}-state", default=None,
                       metavar="TYPE:DIMS:DTYPE[,DIMS:DTYPE][,tp_replicated]",
                       help=f"--{where}-shape is vLLM's Mamba layers (NLx[NB,1,1,PAGE] int8, as vLLM 0.33 "
                            "registers them) of a MambaSpec of this mamba_type, shapes and dtypes, e.g. "
                            f"{STATE_EXAMPLE}; plans the running state, one block id a side ('none' "
                            f"mode; align mode: --{where}-block-size, the spec's block_size); a last "
                            "item tp_replicated where the spec's is True (every rank holds the whole "
                            "state)")  # fmt: skip
        p.add_argument(f"--{where}-ring", action="store_true",
                       help=f"--{where}-shape is vLLM's CircularBufferSpec rings (NLx[NB,H,N,C], as vLLM "
                            "0.33 registers the ring --ring-kind names: N the ring's capacity, C its row); "
                            "plans the request's ring, one block id a side, which every rank holds "
                            "whole")  # fmt: skip
        p.add_argument(f"--{where}-state-shape", default=None, metavar="NLx[NB,1,1,PAGE]",
                       help=f"a hybrid's Mamba layers beside the attention group --{where}-shape (int8, as "
                            f"vLLM 0.33 registers them; --{where}-state gives their MambaSpec): one plan "
                            "of the request, each rank pair's attention and state maps posted as one "
                            "transfer")  # fmt: skip
        p.add_argument(f"--{where}-ring-shape", default=None, metavar="NLx[NB,H,N,C]",
                       help=f"vLLM's CircularBufferSpec rings beside the attention group --{where}-shape "
                            "(in the dtype of the ring --ring-kind names, as vLLM 0.33 registers it): one "
                            "plan of the request, each rank pair's attention map and ring posted as one "
                            "transfer")  # fmt: skip
    p.add_argument(
        "--dtype", default="bf16", help=f"both sides' dtype, one of {', '.join(SHORT_NAMES)} (default: bf16)"
    )
    p.add_argument("--ring-kind", default=None, metavar="KIND",
                   help="which of vLLM 0.33's CircularBufferSpec rings --*-ring and --*-ring-shape give, "
                        "each as its producer registers it (its head slots and dtype, from the library): "
                        "deepseek-v4.1 (the default: the compressor state), glm5-next-tail (the indexer's "
                        "tail ring), qwen4-qsa (the QSA raw keys) or step5-csa-tail (the CSA tail ring, the "
                        "rank's attention page); beside attention the ring's dtype is its kind's, alone "
                        "--dtype gives it")  # fmt: skip
    p.add_argument("--tokens", type=int, required=True, help="the request's tokens (1 to 2**24)")
    p.add_argument("--first-token", type=int, default=0,
                   help="the first token to move (default: 0): those before it are on dst already (a "
                   "prefix-cache hit), as block_map's first_token")  # fmt: skip
    p.add_argument("--blocks", choices=("consecutive", "scattered"), default="scattered",
                   help="the request's block ids on both sides (default: scattered)")  # fmt: skip
    p.add_argument("--kv-heads", type=int, default=None,
                   help="the model's KV heads (default: src heads x src TP; "
                   "needed where ranks replicate heads)")  # fmt: skip
    p.add_argument("--poster", choices=("src", "dst"), default="dst",
                   help="which side posts: dst READs (vLLM's decode side; the default), "
                   "src WRITEs")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser(
        "detect",
        help="detect a registration described by its shapes (meta tensors, no memory)",
        description="Build the registration as meta tensors and run detection: the format and geometry, "
        "or the error a user would get.",
    )
    engines = ", ".join(e.value for e in EngineType)
    p.add_argument("--engine", required=True, help=f"{engines} (any case; TRT-LLM too)")
    p.add_argument(
        "--shape",
        required=True,
        help="e.g. '32x[2,2048,16,8,128]', '2x32x[8192,8,128]', '[2048,32,2,16,8,128]', "
        "'61x([64,64,1,512],[64,64,1,64])', '3x[...]+2x[...]', and '32x[2,2048,16,8,128]@0,1,3,2,4' for a "
        "tensor whose dims lie in memory in that order (vLLM's HND cache)",
    )
    p.add_argument("--dtype", default="bf16", help=f"one of {', '.join(SHORT_NAMES)} (default: bf16)")
    p.add_argument(
        "--hint",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a layout hint, repeatable: kv_layout=HND, tokens_per_block=16, kv_list_layout=k_v, "
            "hicache_layout=page_first, attn_backend=CPU_ATTN, ..."
        ),
    )
    p.add_argument(
        "--share",
        action="append",
        default=[],
        metavar="SHARER=TARGET",
        help="register entry TARGET's tensor for entry SHARER too, repeatable (vLLM's cross-layer KV "
        "sharing: kv_caches[sharer] = kv_caches[target]), e.g. --share 4=2",
    )
    p.add_argument(
        "--device", default="meta", help="meta (default, no memory), cpu (vLLM's CPU defaults apply) or cuda"
    )
    p.add_argument("--json", action="store_true", help="print the result (or the error) as JSON")
    p.set_defaults(run=cmd_detect)
    p = sub.add_parser("codegen", help="regenerate the files made from layouts.yaml (in a checkout)")
    p.add_argument("--check", action="store_true", help="fail with a diff if a generated file is stale")
    p.set_defaults(run=cmd_codegen)
    demo = (
        "detection, geometry and a verified round trip on engine-shaped examples, then a prefill/decode "
        "transfer"
    )
    p = sub.add_parser("demo", help=demo, description=f"kvlayout demo: {demo} (make demo runs it)")
    p.set_defaults(run=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a write that fails (a full disk) fails here, not at exit
        return code
    except (KVLayoutError, TypeError) as e:  # a value on the command line kvlayout cannot take
        print(f"kvlayout: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvlayout formats | head`: the reader left, nothing is wrong
        _drop_stdout()
        sys.stderr.close()
        return 0
    except OSError as e:
        if e.errno not in _FULL or e.filename is not None:  # a named file's, not stdout's
            raise
        _drop_stdout()  # the output could not be written (`> /dev/full`): one line, not a traceback
        print(f"kvlayout: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}  # where a write fails for want of room


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit has nothing to fail on."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
