"""The kvlayout command line: ``formats``, ``explain``, ``describe``, ``detect``, ``plan``,
``codegen``, ``demo``.

Exit codes: 0 done; 1 ``detect`` ran and the registration is one kvlayout refuses (the
error is printed as a user would see it), or ``plan`` ran and a rank pair cannot be served
(the plan says why); 2 the command line or its values are wrong, in one line (values are
bounded where they are read: the MAX_* constants here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlayout.errors import KVLayoutError, abbreviated, index_ranges

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


def _natural(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits (0-9 only: no sign, no other script's
    digits), else None. A number of more than 30 digits reads as 10**30, above every bound
    the command line has (Python refuses to convert more than 4300 digits)."""
    if not text.isascii() or not text.isdigit():
        return None
    return int(text) if len(text) <= 30 else 10**30


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


_DTYPES = {
    "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "uint8": "uint8", "int8": "int8",
}  # fmt: skip


def _hints(items: Sequence[str], flag: str = "--hint") -> dict[str, object]:
    hints: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KVLayoutError(f"{flag} {item!r} is not KEY=VALUE (for example kv_layout=HND)")
        digits = value.removeprefix("-")
        if _natural(digits) is None:
            hints[key] = value
        elif len(digits) > 30:
            raise KVLayoutError(f"{flag} {key}: a value of {len(digits)} digits is no layout hint")
        else:
            hints[key] = int(value)
    return hints


def _device(text: str) -> Any:
    """The torch device ``--device`` names, or a one-line error."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise KVLayoutError(
            f"--device {text!r} is not a torch device (meta, cpu, cuda, cuda:1, ...)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KVLayoutError(
            f"--device {text}: this machine has no CUDA device (torch.cuda.is_available() is False)"
        )
    if device.type not in ("meta", "cpu", "cuda"):
        raise KVLayoutError(f"--device {text}: kvlayout serves meta, cpu and cuda tensors")
    if device.type != "cuda" and device.index not in (None, 0):
        raise KVLayoutError(f"--device {text}: there is one {device.type} device; write {device.type}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise KVLayoutError(
            f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return device


# -- the registrations --shape builds, within bounds -----------------------------------------

MAX_SHAPE_TEXT = 10_000
"""Characters of a ``--shape`` (an engine's registration is written in a few dozen)."""
MAX_TENSORS = 2**16
"""Tensors of a ``--shape`` registration (a model has at most a few hundred layers)."""
MAX_DIMS = 16
"""Dims of one ``--shape`` tensor (a KV cache tensor has at most 7; a peer description 16)."""
MAX_DIM = 2**32 - 1
"""One dim of a ``--shape`` tensor (a peer description's sizes are below 2**32)."""
MAX_TENSOR_BYTES = 2**48
"""Bytes of one ``--shape`` tensor: 256 TiB, more than any machine holds (and the most a
peer description's tensor spans)."""


def _shown(text: str) -> str:
    """A ``--shape`` as messages quote it (a long one abbreviated)."""
    return abbreviated(text, limit=120)


def _scan_shape(flag: str, text: str) -> None:
    """Refuse, before the parser reads it, a ``--shape`` it would take without end: one
    longer than MAX_SHAPE_TEXT, with digits other than 0-9 or numbers of more than 30,
    with lists of more than MAX_TENSORS entries in all (the parser builds each) or
    nesting deeper than a registration may (MAX_NESTING; the parser recurses once a level)."""
    from kvlayout.registration.nesting import MAX_NESTING

    if len(text) > MAX_SHAPE_TEXT:
        raise KVLayoutError(
            f"{flag} is {len(text)} characters, more than {MAX_SHAPE_TEXT} (a registration is written in a "
            "few dozen)"
        )
    if not text.isascii():
        at = next(i for i, c in enumerate(text) if not c.isascii())
        raise KVLayoutError(
            f"{flag} {_shown(text)}: {text[at]!r} (character {at}) is not ASCII; the notation is the "
            "digits 0-9, x, [], (), ',', + and @"
        )
    entries = 0
    for number in re.finditer("[0-9]+", text):
        digits = number.group()
        if len(digits) > 30:
            raise KVLayoutError(
                f"{flag}: a number of {len(digits)} digits ({digits[:12]}...) is no dim (at most 2**32 - 1 "
                f"= {MAX_DIM}) and no count (at most {MAX_TENSORS})"
            )
        if text.startswith("x", number.end()):
            entries += int(digits)
    if entries > MAX_TENSORS:
        raise KVLayoutError(
            f"{flag} {_shown(text)}: its lists hold {entries} entries in all; a registration has at most "
            f"{MAX_TENSORS} tensors"
        )
    depth, deepest, opened, in_dims = 0, 0, [], False
    for c in text:  # the levels the parser would recurse into: one per count, one per '('
        if c in "[]":
            in_dims = c == "["
        elif in_dims:
            continue
        elif c == "x":
            depth += 1
        elif c == "(":
            opened.append(depth)
            depth += 1
        elif c == ",":  # the next item of the tuple open here (or of none)
            depth = opened[-1] + 1 if opened else 0
        elif c == ")":
            depth = opened.pop() if opened else 0
        elif c == "+":
            depth = 0
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise KVLayoutError(
            f"{flag} {_shown(text)}: lists and tuples nest {deepest} deep; a registration nests at most "
            f"{MAX_NESTING} (engines nest 2: '2x32x[...]', '61x([...],[...])')"
        )


def _registration_spec(flag: str, text: str, dtype: str) -> Any:
    """``--shape`` text parsed, every tensor checked against the bounds above, or a
    one-line error naming ``flag``. ``dtype``: a key of _DTYPES."""
    import math

    import torch

    from kvlayout.tools.shapes import Shape, ShapeSpecError, parse_shape_spec

    _scan_shape(flag, text.replace(" ", ""))
    try:
        spec = parse_shape_spec(text)
    except ShapeSpecError as e:
        if flag == "--shape":
            raise
        raise KVLayoutError(flag + str(e).removeprefix("--shape")) from None
    itemsize = getattr(torch, _DTYPES[dtype]).itemsize
    shown = _shown(spec.text)

    def check(leaf: Shape) -> None:
        if len(leaf) > MAX_DIMS:
            raise KVLayoutError(
                f"{flag} {shown}: a tensor of {len(leaf)} dims; a KV cache tensor has at most {MAX_DIMS}"
            )
        if 0 in leaf:
            raise KVLayoutError(
                f"{flag} {shown}: {_shape_text(leaf)} has a dim of size 0 (dim {list(leaf).index(0)}); "
                "a KV cache tensor is never empty (an engine never registers a cache without blocks, "
                "tokens or heads)"
            )
        for i, n in enumerate(leaf):
            if n > MAX_DIM:
                raise KVLayoutError(
                    f"{flag} {shown}: dim {i} of {_shape_text(leaf)} is {n}, more than 2**32 - 1 = "
                    f"{MAX_DIM} (no KV cache axis comes near)"
                )
        nbytes = math.prod(leaf) * itemsize
        if nbytes > MAX_TENSOR_BYTES:
            raise KVLayoutError(
                f"{flag} {shown}: {_shape_text(leaf)} {dtype} is {nbytes} bytes, more than 2**48 (256 TiB, "
                "more memory than any machine holds)"
            )

    counted: dict[int, int] = {}  # id of a node -> its tensors: a list repeats one node

    def tensors(node: Any) -> int:
        if id(node) not in counted:
            if isinstance(node, Shape):
                check(node)
                counted[id(node)] = 1
            else:
                counted[id(node)] = sum(tensors(child) for child in node)
        return counted[id(node)]

    total = tensors(spec.root)
    if total > MAX_TENSORS:
        raise KVLayoutError(f"{flag} {shown}: {total} tensors; a registration has at most {MAX_TENSORS}")
    return spec


def cmd_detect(args: argparse.Namespace) -> int:
    import torch

    import kvlayout
    from kvlayout.registration.registration import bound
    from kvlayout.types import LayoutHints, as_engine

    device = _device(args.device)
    engine = as_engine(args.engine)  # a wrong engine or hint is the command line's, not the registration's
    hints = _hints(args.hint)
    LayoutHints.coerce(hints)
    if args.dtype not in _DTYPES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
    dtype = getattr(torch, _DTYPES[args.dtype])
    spec = _registration_spec("--shape", args.shape, args.dtype)
    kv: Any = _allocated_kv(spec, dtype, device)
    for sharer, target in _shares(args.share, kv):
        kv[sharer] = kv[target]  # vLLM's cross-layer KV sharing: the target's tensor, registered again
    shapes = sorted({_shape_text(s) for s in spec.leaves()})
    report: dict[str, Any] = {
        "engine": args.engine, "registration": spec.text, "tensors": len(spec.leaves()), "shapes": shapes,
        "dtype": args.dtype, "device": str(device), "hints": hints,
    }  # fmt: skip
    try:
        if len(spec.parts) > 1:  # a hybrid: one detection group per `+` item
            bounds = [sum(spec.parts[:i]) for i in range(len(spec.parts) + 1)]
            groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
            registration = kvlayout.detect(kv, engine, hints, layer_groups=groups)
        else:
            fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, engine, hints)
            registration = bound(normalized, fmt)
    except (KVLayoutError, TypeError) as e:
        report["error"] = {"type": type(e).__name__, "message": str(e)}
        _print_detection(report, args.json)
        return 1
    report["kernel_groups"] = [_group_record(g) for g in registration.kernel_groups]
    _print_detection(report, args.json)
    return 0


def _allocated_kv(spec: Any, dtype: Any, device: Any) -> Any:
    """The registration ``spec`` describes, as empty tensors on ``device``; on a real
    device, the allocator's refusal as a one-line error."""
    import math

    if device.type == "meta":
        return _build_kv(spec.root, dtype, device)
    try:
        return _build_kv(spec.root, dtype, device)
    except (RuntimeError, MemoryError) as e:  # torch's allocators (torch.OutOfMemoryError is a RuntimeError)
        leaves = spec.leaves()
        nbytes = sum(math.prod(leaf) for leaf in leaves) * dtype.itemsize
        reason = next(iter(str(e).strip().splitlines()), "") or type(e).__name__
        raise KVLayoutError(
            f"--device {device}: cannot allocate --shape {_shown(spec.text)} ({len(leaves)} tensor(s), "
            f"{nbytes} bytes in all): {reason}"
        ) from None


def _build_kv(node: object, dtype: Any, device: Any) -> Any:
    """The registration a parsed ``--shape`` describes, as empty tensors on ``device``."""
    import torch

    from kvlayout.tools.shapes import Shape

    if isinstance(node, Shape):
        if node.order is None:
            return torch.empty(node, dtype=dtype, device=device)
        inverse = sorted(range(len(node)), key=node.order.index)
        return torch.empty([node[i] for i in node.order], dtype=dtype, device=device).permute(inverse)
    children = [_build_kv(c, dtype, device) for c in node]  # type: ignore[attr-defined]
    return tuple(children) if isinstance(node, tuple) else children


def _detect(
    engine: Any,
    spec: Any,
    hints: dict[str, object],
    dtype: Any,
    device: Any,
    shares: Sequence[str] = (),
    share_flag: str = "--share",
) -> Any:
    """Detection of a registration given as ``detect`` takes it (``spec`` from
    _registration_spec; a hybrid: a group per ``+``; ``shares``: ``share_flag`` items,
    layers registered with another's tensor)."""
    import kvlayout
    from kvlayout.registration.registration import bound

    kv = _allocated_kv(spec, dtype, device)
    for sharer, target in _shares(shares, kv, share_flag):
        kv[sharer] = kv[target]
    if len(spec.parts) > 1:
        bounds = [sum(spec.parts[:i]) for i in range(len(spec.parts) + 1)]
        groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
        return kvlayout.detect(kv, engine, hints, layer_groups=groups)
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, engine, hints)
    return bound(normalized, fmt)


class _ShareError(KVLayoutError):
    """A ``--share`` value that cannot be taken (said as it is, not as detection's refusal)."""


def _shares(items: Sequence[str], kv: Any, flag: str = "--share") -> list[tuple[int, int]]:
    """``--share 4=2``: entry 4 of the registration is entry 2's tensor."""
    pairs = []
    for item in items:
        sharer, sep, target = (part.strip() for part in item.partition("="))
        a, b = _natural(sharer), _natural(target)
        if not sep or a is None or b is None:
            raise _ShareError(f"{flag} {item!r} is not SHARER=TARGET (for example 4=2)")
        if not isinstance(kv, list):
            raise _ShareError(f"{flag} needs a list of layers (--shape NxSHAPE), not one tensor")
        for i, text in ((a, sharer), (b, target)):
            if i >= len(kv):  # entry i needs i + 1 entries (said as written past 30 digits)
                needs = i + 1 if len(text) <= 30 else f"{text} + 1"
                raise _ShareError(f"{flag} {item}: the registration has {len(kv)} entries, not {needs}")
        if a == b:
            raise _ShareError(f"{flag} {item}: a layer shares another layer's KV cache, not its own")
        pairs.append((a, b))
    return pairs


def _shape_text(shape: Any) -> str:
    order = f"@{','.join(map(str, shape.order))}" if shape.order else ""
    return f"{list(shape)}{order}"


def _group_record(group: Any) -> dict[str, Any]:
    from kvlayout.facade import get_concrete_engine_kv_shape_from_shape_desc

    g = group.geometry
    try:
        desc = group.descriptor()
        shape = get_concrete_engine_kv_shape_from_shape_desc(desc, group.format)
    except KVLayoutError:  # NB*BS folded: the registration's own shape says all there is
        shape = group.concrete_shape()
    return {
        "layers": list(group.layers), "engine_group": group.engine_group, "value": int(group.format),
        "format": group.format.name, "shape": group.layout.describe_shape(), "backend": group.backend,
        "concrete": shape, "num_blocks": g.num_blocks, "block_size": g.block_size, "num_heads": g.num_heads,
        "head_size": g.head_size, "kv_size": g.kv_size, "dtype": str(g.dtype),
        "block_stride_elems": group.block_stride_elems,
        "shared_layers": [list(layers) for layers in group.shared_layers],
    }  # fmt: skip


def _print_detection(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    memory = "meta tensors, no memory" if report["device"] == "meta" else f"allocated on {report['device']}"
    print(
        f"{report['engine']} registration {report['registration']}: {report['tensors']} tensor(s) "
        f"{', '.join(report['shapes'])} {report['dtype']} ({memory})"
    )
    if report["hints"]:
        print(f"  hints        {report['hints']}")
    if "error" in report:
        error = report["error"]
        print(f"  detection failed, as a user would see it:\n    {error['type']}: {error['message']}")
        return
    print(f"  kernel groups {len(report['kernel_groups'])}")
    for n, g in enumerate(report["kernel_groups"]):
        block_size = g["block_size"] or "n/a (NB*BS folded; hint tokens_per_block to split it)"
        stride = g["block_stride_elems"]
        print(f"  group {n}: layers {index_ranges(g['layers'])}")
        print(f"    format     {g['value']} {g['format']}   {g['shape']}")
        print(f"    backend    {g['backend']}")
        print(f"    shape      {g['concrete']}")
        print(
            f"    geometry   block_size {block_size}, heads {g['num_heads']}, head_size {g['head_size']}, "
            f"kv_size {g['kv_size']}, {g['dtype']}"
            + (f", block stride {stride} elements" if stride is not None else "")
        )
        if g["shared_layers"]:
            shared = ", ".join(f"({', '.join(map(str, layers))})" for layers in g["shared_layers"])
            print(f"    shared     layers {shared} share one KV cache (the first holds it)")


def _side_heads(registration: Any) -> int | None:
    """A side's KV heads per rank; None for latents (MLA), which every rank holds whole."""
    from kvlayout.layout import algebra

    group = registration.kernel_groups[0]
    latent = algebra.is_latent(group.layout, group.planes[0].sizes)
    return None if latent else int(group.geometry.num_heads)


MAX_TP = 1024
"""A side's TP degree in ``plan`` (deployments use up to a few dozen ranks)."""
MAX_RANK_PAIRS = 4096
"""Rank pairs ``plan`` maps, one block map each (64 x 64 ranks)."""
MAX_TOKENS = 2**24
"""A request's tokens in ``plan`` (the longest contexts hold about 10 million)."""
MAX_KV_HEADS = 2**16
"""``plan --kv-heads`` (models have at most a few hundred KV heads)."""
MAX_PLAN_LAYERS = 4096
"""Layers of a side in ``plan`` (a model has at most a few hundred)."""
MAX_PLAN_MAPS = 2**20
"""Layer maps ``plan`` makes: layers x rank pairs, each pair mapping every layer (a few
microseconds each up to a thousand layers, tens beyond: 1024 x 1024 take seconds)."""
MAX_PLAN_ROWS = 2**28
"""Token rows ``plan`` maps: tokens x layers x the rank pairs that exchange heads (a 1M
token request of 32 layers over 8 pairs). A block map makes ten to fifty million a
second, so this is under a minute."""


def _block_ids(pattern: str, needed: int, num_blocks: int, where: str) -> Any:
    """``needed`` distinct block ids of ``num_blocks``: the first ones, or scattered ones
    (seeded: a plan is repeatable), in memory that grows with ``needed``, not the pool."""
    import numpy as np

    if needed > num_blocks:
        raise KVLayoutError(f"--tokens needs {needed} blocks of the {where} cache, which has {num_blocks}")
    if pattern == "consecutive":
        return np.arange(needed, dtype=np.int64)
    rng = np.random.default_rng(0)
    if 4 * needed >= num_blocks:  # a large share of the pool: permute all of it
        return rng.permutation(num_blocks)[:needed]
    picked = np.empty(0, dtype=np.int64)
    while len(picked) < needed:  # draws from a pool at least 4x larger: few repeats to draw again
        drawn = np.concatenate([picked, rng.integers(0, num_blocks, size=2 * (needed - len(picked)))])
        _, first = np.unique(drawn, return_index=True)
        picked = drawn[np.sort(first)][:needed]  # each id once, in the order drawn
    return picked


def _plan_bounds(args: argparse.Namespace) -> None:
    """plan's numbers, in range before anything is built."""
    if not 0 < args.tokens <= MAX_TOKENS:
        raise KVLayoutError(
            f"--tokens {args.tokens}: a request holds 1 to 2**24 = {MAX_TOKENS} tokens (the longest contexts "
            "hold about 10 million)"
        )
    for where in ("src", "dst"):
        tp = vars(args)[f"{where}_tp"]
        if not 0 < tp <= MAX_TP:
            raise KVLayoutError(f"--{where}-tp {tp}: a TP degree is 1 to {MAX_TP}")
    if args.src_tp * args.dst_tp > MAX_RANK_PAIRS:
        raise KVLayoutError(
            f"--src-tp {args.src_tp} and --dst-tp {args.dst_tp} make {args.src_tp * args.dst_tp} rank pairs, "
            f"one block map each; plan at most {MAX_RANK_PAIRS} (64 x 64)"
        )
    if args.kv_heads is not None and not 0 < args.kv_heads <= MAX_KV_HEADS:
        raise KVLayoutError(f"--kv-heads {args.kv_heads}: a model has 1 to {MAX_KV_HEADS} KV heads")


def cmd_plan(args: argparse.Namespace) -> int:
    """Every rank pair of a P/D transfer planned from shapes alone (meta tensors, tensors
    described at made-up addresses): runs, bytes, descriptors and predicted time. Exits 1
    when a pair cannot be served (the plan says why)."""
    import torch

    from kvlayout.registration.shards import Shard, ShardError
    from kvlayout.transfer.nixl import DEFAULT_COST
    from kvlayout.types import LayoutHints, as_engine

    if args.dtype not in _DTYPES:
        raise KVLayoutError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
    _plan_bounds(args)
    dtype, meta = getattr(torch, _DTYPES[args.dtype]), torch.device("meta")
    sides = {}
    a = vars(args)
    for where in ("src", "dst"):
        hints = _hints(a[f"{where}_hint"], f"--{where}-hint")
        try:
            engine = as_engine(a[f"{where}_engine"])
        except KVLayoutError as e:
            raise KVLayoutError(f"--{where}-engine: {e}") from None
        try:
            LayoutHints.coerce(hints)
        except (KVLayoutError, TypeError) as e:
            raise KVLayoutError(f"--{where}-hint: {e}") from None
        spec = _registration_spec(f"--{where}-shape", a[f"{where}_shape"], args.dtype)
        try:
            reg = _detect(engine, spec, hints, dtype, meta, a[f"{where}_share"], f"--{where}-share")
        except _ShareError:
            raise
        except (KVLayoutError, TypeError) as e:
            raise KVLayoutError(f"--{where}-shape: detection refuses it: {e}") from None
        if len(reg.kernel_groups) > 1:  # the block map moves one group (a hybrid's would be refused)
            raise KVLayoutError(
                f"--{where}-shape {_shown(spec.text)}: {len(reg.kernel_groups)} kernel groups; plan maps one "
                "kernel group a side: give each group's shape (one '+' item) to a plan of its own"
            )
        group = reg.kernel_groups[0]
        if group.geometry.block_size is None:
            raise KVLayoutError(
                f"--{where}-shape {_shown(spec.text)}: the {engine.value} cache folds blocks and tokens into "
                f"one axis (NB*BS), so plan cannot tell its blocks: give --{where}-hint tokens_per_block=N "
                "(the engine's page size)"
            )
        sides[where] = (reg, group)
    heads = {w: _side_heads(r) for w, (r, _) in sides.items()}
    model_heads = args.kv_heads
    if model_heads is None and heads["src"] is not None:
        model_heads = heads["src"] * args.src_tp  # no replication unless --kv-heads says so
    if model_heads is not None:
        origin = (
            f"--kv-heads {model_heads}" if args.kv_heads is not None
            else f"the model's {model_heads} KV heads (src {heads['src']} x --src-tp {args.src_tp})"
        )  # fmt: skip
        for where in ("src", "dst"):  # the command line's numbers agree, or no pair could be served
            tp = a[f"{where}_tp"]
            try:
                held = len(Shard(0, tp, model_heads).heads)
            except ShardError:
                raise KVLayoutError(
                    f"--{where}-tp {tp} does not split {origin}: TP splits the heads evenly over the ranks "
                    "or holds each head on as many ranks (the larger must be a multiple of the smaller)"
                ) from None
            if heads[where] is not None and heads[where] != held:
                g = sides[where][1]
                raise KVLayoutError(
                    f"--{where}-tp {tp} gives each {where} rank {held} of {origin}, but --{where}-shape "
                    f"holds {heads[where]} a rank, read as {g.format.name} with {g.geometry.block_size} "
                    f"tokens a block (where the engine reads one, --{where}-hint kv_layout=NHD or HND says "
                    "which axis holds the heads)"
                )
    _plan_work(args, model_heads, {where: len(group.layers) for where, (_, group) in sides.items()})
    record: dict[str, Any] = {
        "tokens": args.tokens, "blocks": args.blocks, "poster": args.poster,
        "cost_model": DEFAULT_COST.source, "kv_heads": model_heads, "pairs": [],
    }  # fmt: skip
    for where, (_, group) in sides.items():
        g = group.geometry
        record[where] = {"format": group.format.name, "tp": a[f"{where}_tp"],
                         "block_size": g.block_size, "num_blocks": g.num_blocks,
                         "shared_layers": [list(layers) for layers in group.shared_layers]}  # fmt: skip
    descs, ids = {}, {}
    for where, (reg, group) in sides.items():
        bs = group.geometry.block_size
        try:
            descs[where] = reg.describe(block_size=bs, at=1 << 40 if where == "src" else 1 << 44)
        except KVLayoutError as e:
            raise KVLayoutError(
                f"--{where}-shape: plan describes it as a peer would, and cannot: {e}"
            ) from None
        ids[where] = _block_ids(args.blocks, -(-args.tokens // bs), group.geometry.num_blocks, where)
    try:
        _plan_pairs(args, record, descs, ids, model_heads)
    except MemoryError:  # numpy's and the native maps' allocations: bounded above, not by the machine
        raise KVLayoutError(
            f"--tokens {args.tokens}: the block maps of this plan need more memory than this machine gives; "
            "plan fewer tokens"
        ) from None
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        _print_plan(record)
    return 1 if any("refused" in p for p in record["pairs"]) else 0


def _plan_work(args: argparse.Namespace, model_heads: int | None, side_layers: dict[str, int]) -> None:
    """Refuse a plan of more than MAX_PLAN_LAYERS layers a side, MAX_PLAN_MAPS layer maps
    or MAX_PLAN_ROWS token rows (the pairs with no head in common move no rows: they
    count for their maps, not their rows)."""
    from kvlayout.registration.shards import Shard

    for where, n in side_layers.items():
        if n > MAX_PLAN_LAYERS:
            raise KVLayoutError(f"--{where}-shape: {n} layers; plan maps at most {MAX_PLAN_LAYERS}")
    layers = max(side_layers.values())
    pairs = args.src_tp * args.dst_tp
    if layers * pairs > MAX_PLAN_MAPS:
        raise KVLayoutError(
            f"--src-tp {args.src_tp} and --dst-tp {args.dst_tp} over {layers} layers make {layers * pairs} "
            f"layer maps (layers x rank pairs), more than 2**20 = {MAX_PLAN_MAPS}; plan fewer ranks"
        )
    if model_heads is not None:
        src = [Shard(r, args.src_tp, model_heads).heads for r in range(args.src_tp)]
        dst = [Shard(d, args.dst_tp, model_heads).heads for d in range(args.dst_tp)]
        pairs = sum(a.start < b.stop and b.start < a.stop for a in src for b in dst)
    rows = args.tokens * layers * pairs
    if rows > MAX_PLAN_ROWS:
        raise KVLayoutError(
            f"--tokens {args.tokens} of {layers} layers over {pairs} rank pair(s) that exchange heads make "
            f"{rows} token rows to map, more than 2**28 = {MAX_PLAN_ROWS}; plan fewer tokens or ranks"
        )


def _plan_pairs(
    args: argparse.Namespace, record: dict[str, Any], descs: dict[str, Any], ids: dict[str, Any],
    model_heads: int | None,
) -> None:  # fmt: skip
    """Each rank pair's block map and cost, or why it cannot be served, into ``record``."""
    from kvlayout.registration.shards import Shard
    from kvlayout.transfer import block_map
    from kvlayout.transfer.nixl import estimate

    for r in range(args.src_tp):
        for d in range(args.dst_tp):
            pair: dict[str, Any] = {"src_rank": r, "dst_rank": d}
            try:
                src_shard = None if model_heads is None else Shard(r, args.src_tp, model_heads)
                dst_shard = None if model_heads is None else Shard(d, args.dst_tp, model_heads)
                m = block_map(
                    descs["src"], descs["dst"], ids["src"], ids["dst"], num_tokens=args.tokens,
                    src_shard=src_shard, dst_shard=dst_shard,
                )  # fmt: skip
            except KVLayoutError as exc:
                pair["refused"] = str(exc)
                record["pairs"].append(pair)
                continue
            pair |= {"kind": m.kind, "reason": m.reason, "runs": m.num_runs, "bytes": m.num_bytes}
            if m.num_runs:
                est = estimate(m, poster=args.poster)
                pair |= {"mean_run": m.num_bytes / m.num_runs, "op": est.op, "descriptors": est.descriptors,
                         "predicted_s": est.predicted_s, "choice": est.choice,
                         "stages": est.stages}  # fmt: skip
            record["pairs"].append(pair)


def _print_plan(r: dict[str, Any]) -> None:
    s, d = r["src"], r["dst"]
    print(
        f"plan: {r['tokens']} tokens, {r['blocks']} block ids; src {s['format']} TP {s['tp']} "
        f"(blocks of {s['block_size']}), dst {d['format']} TP {d['tp']} (blocks of {d['block_size']}); "
        f"{r['kv_heads'] or 'latent'} KV heads; posted by {r['poster']}; cost model: {r['cost_model']}"
    )
    for p in r["pairs"]:
        head = f"  src rank {p['src_rank']} -> dst rank {p['dst_rank']}:"
        if "refused" in p:
            print(f"{head} cannot be served: {p['refused']}")
        elif not p["runs"]:
            print(f"{head} nothing to send ({p['reason']})")
        else:
            n, t = p["descriptors"], p["predicted_s"]
            print(f"{head} {p['kind']}; {p['runs']} runs, {p['bytes']} bytes, mean run {p['mean_run']:.0f} B")
            each = "; ".join(f"{k} {n[k]} descriptors, {t[k] * 1e3:.2f} ms" for k in n)
            stages = p["stages"][p["choice"]]
            print(
                f"    {p['op']}: {each}; choice: {p['choice']}"
                + (f", in {stages} stages" if stages > 1 else "")
            )


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
        help="element type for byte counts: bf16, fp16, fp32, fp8, fp8_e5m2, uint8, int8 (default: bf16)",
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
    p.add_argument(
        "--dtype", default="bf16", help=f"both sides' dtype, one of {', '.join(_DTYPES)} (default: bf16)"
    )
    p.add_argument("--tokens", type=int, required=True, help="the request's tokens (1 to 2**24)")
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
    p.add_argument("--dtype", default="bf16", help=f"one of {', '.join(_DTYPES)} (default: bf16)")
    p.add_argument(
        "--hint",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a layout hint, repeatable: kv_layout=HND, tokens_per_block=16, kv_list_layout=k_v, ...",
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
        return int(args.run(args))
    except (KVLayoutError, TypeError) as e:  # a value on the command line kvlayout cannot take
        print(f"kvlayout: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvlayout formats | head`: the reader left, nothing is wrong
        sys.stderr.close()
        return 0
