"""Registrations given on the command line, as ``detect`` and ``plan`` take them
(``--shape``, ``--dtype``, ``--hint``, ``--share``, ``--device``), built within bounds,
and the ``detect`` command, which reports what kvlayout reads in one."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

from kvlayout.errors import KVLayoutError, abbreviated, index_ranges
from kvlayout.layout.dtypes import SHORT_NAMES


def _natural(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits (0-9 only: no sign, no other script's
    digits), else None. A number of more than 30 digits reads as 10**30, above every bound
    the command line has (Python refuses to convert more than 4300 digits)."""
    if not text.isascii() or not text.isdigit():
        return None
    return int(text) if len(text) <= 30 else 10**30


def _torch_dtype(name: str) -> Any:
    """``--dtype``'s torch dtype (one of :data:`SHORT_NAMES`), or the command line's error."""
    import torch

    if name not in SHORT_NAMES:
        raise KVLayoutError(f"--dtype {name!r} is not one of {', '.join(SHORT_NAMES)}")
    return getattr(torch, SHORT_NAMES[name])


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
    one-line error naming ``flag``. ``dtype``: a key of SHORT_NAMES."""
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
    itemsize = getattr(torch, SHORT_NAMES[dtype]).itemsize
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

    from kvlayout.types import LayoutHints, as_engine

    device = _device(args.device)
    engine = as_engine(args.engine)  # a wrong engine or hint is the command line's, not the registration's
    hints = _hints(args.hint)
    LayoutHints.coerce(hints)
    dtype = _torch_dtype(args.dtype)
    spec = _registration_spec("--shape", args.shape, args.dtype)
    kv = _registration(spec, dtype, device, args.share)  # its refusals are the command line's
    shapes = sorted({_shape_text(s) for s in spec.leaves()})
    report: dict[str, Any] = {
        "engine": args.engine, "registration": spec.text, "tensors": len(spec.leaves()), "shapes": shapes,
        "dtype": args.dtype, "device": str(device), "hints": hints,
    }  # fmt: skip
    try:
        registration = _detect_kv(kv, spec, engine, hints)
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


def _registration(
    spec: Any, dtype: Any, device: Any, shares: Sequence[str], share_flag: str = "--share"
) -> Any:
    """The registration ``spec`` describes (from _registration_spec), allocated on
    ``device``, with ``shares`` (``share_flag`` items) registering a layer with another's
    tensor."""
    kv = _allocated_kv(spec, dtype, device)
    for sharer, target in _shares(shares, kv, share_flag):
        kv[sharer] = kv[target]  # vLLM's cross-layer KV sharing: the target's tensor, registered again
    return kv


def _detect_kv(kv: Any, spec: Any, engine: Any, hints: dict[str, object]) -> Any:
    """Detection of ``kv`` as ``detect`` takes it (a hybrid ``spec``: a group per ``+``)."""
    import kvlayout
    from kvlayout.registration.registration import bound

    if len(spec.parts) > 1:
        bounds = [sum(spec.parts[:i]) for i in range(len(spec.parts) + 1)]
        groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
        return kvlayout.detect(kv, engine, hints, layer_groups=groups)
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, engine, hints)
    return bound(normalized, fmt)


def _shares(items: Sequence[str], kv: Any, flag: str = "--share") -> list[tuple[int, int]]:
    """``--share 4=2``: entry 4 of the registration is entry 2's tensor."""
    pairs = []
    for item in items:
        sharer, sep, target = (part.strip() for part in item.partition("="))
        a, b = _natural(sharer), _natural(target)
        if not sep or a is None or b is None:
            raise KVLayoutError(f"{flag} {item!r} is not SHARER=TARGET (for example 4=2)")
        if not isinstance(kv, list):
            raise KVLayoutError(f"{flag} needs a list of layers (--shape NxSHAPE), not one tensor")
        for i, text in ((a, sharer), (b, target)):
            if i >= len(kv):  # entry i needs i + 1 entries (said as written past 30 digits)
                needs = i + 1 if len(text) <= 30 else f"{text} + 1"
                raise KVLayoutError(f"{flag} {item}: the registration has {len(kv)} entries, not {needs}")
        if a == b:
            raise KVLayoutError(f"{flag} {item}: a layer shares another layer's KV cache, not its own")
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
