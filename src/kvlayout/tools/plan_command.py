"""The ``plan`` command: every rank pair of two registrations (each given as ``detect``
takes it, with its TP degree), mapped for one request, with each pair's descriptors per
NIXL strategy, the predicted times and the choice, or why the pair cannot be served."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Literal

from kvlayout.errors import KVLayoutError, abbreviated
from kvlayout.layout.dtypes import SHORT_NAMES
from kvlayout.tools.registrations import (
    MAX_DIM,
    _detect_kv,
    _hints,
    _natural,
    _registration,
    _registration_spec,
    _shown,
    _torch_dtype,
)


def _side_heads(registration: Any) -> int | None:
    """A side's KV heads per rank; None for latents (MLA), which every rank holds whole."""
    from kvlayout.layout import algebra

    group = registration.kernel_groups[0]
    latent = algebra.is_latent(group.layout, group.planes[0].sizes)
    return None if latent else int(group.geometry.num_heads)


def _one_head_note(
    where: str, kv: Any, spec: Any, engine: Any, hints: dict[str, object], registration: Any
) -> str | None:
    """What ``plan`` says of a side read as one KV head of fused K and V where the hint
    ``kv_dim=1`` reads the same tensors as MLA latents (vLLM 0.26+ registers an MLA layer
    as ``[NB, 1, BS, C]``, the shape of a one-head cache: only the hint tells them apart,
    and a real one-head model is not refused); None for any other side. Of this side
    alone: :func:`_latent_notes` drops it where the other side cannot be latents."""
    if "kv_dim" in hints or "layout_format" in hints or _side_heads(registration) != 1:
        return None
    try:
        as_latents = _detect_kv(kv, spec, engine, {**hints, "kv_dim": 1})
    except (KVLayoutError, TypeError):
        return None  # no latents of this shape: the one head is all it can be
    if _side_heads(as_latents) is not None:
        return None
    fmt = registration.kernel_groups[0].format.name
    return (
        f"--{where}-shape read as one KV head of K and V a rank ({fmt}), planned by heads; an MLA model's "
        f"latents have this shape too: give --{where}-hint kv_dim=1 for them"
    )


def _state_note(where: str, engine: str, group: Any, state: bool) -> str | None:
    """What ``plan`` says of a vLLM side read as one head of K and V in blocks of one token
    of int8: the shape vLLM 0.33 registers a Mamba layer as (``[NB, 1, 1, page]``, int8:
    a ``MambaSpec`` has no one dtype), which only ``--*-state`` reads as state."""
    from kvlayout.integrations.vllm.rules import reads_as_state_rows

    if state or engine != "vllm" or not reads_as_state_rows(group.geometry):
        return None
    return (
        f"--{where}-shape read as one KV head of K and V a rank in blocks of one token, int8 "
        f"({group.format.name}), planned by heads and tokens; vLLM's Mamba layers have this shape "
        "([NB,1,1,PAGE] int8): give "
        f"--{where}-state (the MambaSpec's mamba_type, shapes and dtypes) for them"
    )


def _ring_note(where: str, engine: str, group: Any, ring: bool) -> str | None:
    """What ``plan`` says of a vLLM side read as one float32 head of K and V in blocks of
    a power of two of 8 or more: the shape vLLM 0.33 registers a ``CircularBufferSpec``
    ring as (DeepSeek-V4.1's compressor state, ``[NB, 1, N, C]``), which only
    ``--*-ring`` reads as a ring."""
    from kvlayout.integrations.vllm.rules import reads_as_ring

    if ring or engine != "vllm" or not reads_as_ring(group.geometry):
        return None
    return (
        f"--{where}-shape read as one KV head of K and V a rank, float32 ({group.format.name}), planned by "
        "heads and tokens; vLLM's CircularBufferSpec rings (DeepSeek-V4.1's compressor state) have this "
        f"shape ([NB,1,N,C] float32, N the ring's capacity): give --{where}-ring for them"
    )


def _latent_notes(notes: dict[str, str | None], heads: dict[str, int | None]) -> dict[str, str | None]:
    """Each side's :func:`_one_head_note`, kept only where the other side could hold MLA
    latents too (read as latents, or one head that ``kv_dim=1`` reads as latents): both
    sides hold one model's cache, so a side of several heads a rank (a GQA model below
    its TP degree), or one no hint reads as latents, says the one head beside it is a
    head (a GQA model at TP >= its KV heads), not latents."""
    could = {w: heads[w] is None or notes[w] is not None for w in notes}
    return {w: note if could["dst" if w == "src" else "src"] else None for w, note in notes.items()}


STATE_EXAMPLE = "gdn_attn:4096x3:bf16,16x128x128:bf16"
"""``--src-state`` as written for Qwen3-Next's Gated DeltaNet page at TP 2 (vLLM's
``MambaSpec``: ``mamba_type``, then each of ``shapes`` with its ``dtypes`` entry)."""


def _state_fields(flag: str, text: str) -> tuple[str, list[tuple[int, ...]], list[Any], bool]:
    """``--*-state TYPE:DIMS:DTYPE[,DIMS:DTYPE][,tp_replicated]``: a ``MambaSpec``'s
    ``mamba_type``, ``shapes``, ``dtypes`` (torch dtypes) and ``tp_replicated``, or the
    command line's error."""
    kind, _, rest = text.partition(":")
    items = rest.split(",") if rest else []
    replicated = items[-1:] == ["tp_replicated"]
    fields: tuple[list[tuple[int, ...]], list[Any]] = ([], [])
    for item in items[:-1] if replicated else items:
        dims, _, dtype = item.rpartition(":")
        sizes = [_natural(d) for d in dims.split("x")]
        if dtype not in SHORT_NAMES or not dims or any(n is None or not 0 < n <= MAX_DIM for n in sizes):
            fields = ([], [])
            break
        fields[0].append(tuple(int(n or 0) for n in sizes))
        fields[1].append(_torch_dtype(dtype))
    if not kind or not fields[0]:  # a count of states no rule splits is declared_state_rows' to refuse
        raise KVLayoutError(
            f"{flag} {abbreviated(text, limit=120)!r} is not TYPE:DIMS:DTYPE[,DIMS:DTYPE][,tp_replicated]: "
            "vLLM's MambaSpec mamba_type, then each state shape (dims 1 to 2**32 - 1, joined by x) and its "
            f"dtype (one of {', '.join(SHORT_NAMES)}), conv state then SSM state, and tp_replicated where "
            f"the spec's is True (every rank holds the whole state): {STATE_EXAMPLE} for Qwen3-Next at TP 2"
        )
    return kind.lower(), *fields, replicated


def _state_side(
    where: str, a: dict[str, Any], kv: Any, spec: Any, engine: Any, hints: dict[str, object], shape_flag: str
) -> tuple[Any, Any]:
    """A side given with ``--{where}-state``: vLLM 0.33's Mamba layers as it registers them
    (``shape_flag NLx[NB,1,1,PAGE]``: ``--{where}-shape``, or ``--{where}-state-shape``
    beside the attention group; the page padded as vLLM pads it), read as the group
    edits read them for a ``MambaSpec`` of the state's fields, in blocks of
    ``--{where}-block-size`` rows (align mode; state alone) or one ('none' mode, or beside
    attention, whose block size that flag then is)."""

    from kvlayout.integrations.vllm.rules import STATE_ROWS_DTYPE, declared_state_rows

    flag = f"--{where}-state"
    _check_vllm_layers(
        kv, spec, engine, (flag, shape_flag), "Mamba layers (a MambaSpec's page)", "a Mamba layer",
        "NLx[NB,1,1,PAGE] (PAGE the spec's page_size_bytes, with --dtype int8)",
    )  # fmt: skip
    if kv[0].dtype != STATE_ROWS_DTYPE:  # PAGE counts bytes: in another dtype, a multiple of the page
        raise KVLayoutError(
            f"--dtype {a['dtype']} with {flag}: vLLM 0.33 registers a Mamba layer as int8 [NB,1,1,PAGE], "
            "PAGE the spec's page_size_bytes; give --dtype int8"
        )
    kind, shapes, dtypes, replicated = _state_fields(flag, a[f"{where}_state"])
    # beside attention, --*-block-size is the attention's: the running state is one page whatever
    # its rows (align mode's block_size rows move the same bytes), so it is read as one row
    rows = 1 if shape_flag.endswith("-state-shape") else a[f"{where}_block_size"] or 1
    return _declared(
        lambda t: declared_state_rows(t, kind, shapes, dtypes, rows, tp_replicated=replicated),
        kv, (flag, shape_flag, spec), "state", engine, hints,
    )  # fmt: skip


def _ring_kind(args: argparse.Namespace) -> tuple[str, Any]:
    """The ring ``--ring-kind`` names (``DEFAULT_RING_KIND`` unless given) and how vLLM
    0.33 registers it (``RING_KINDS``), or the command line's error listing them."""
    from kvlayout.integrations.vllm.rules import DEFAULT_RING_KIND, RING_KINDS

    name = args.ring_kind or DEFAULT_RING_KIND
    if name not in RING_KINDS:
        kinds = "; ".join(f"{k} ({r.what}, {r.registered})" for k, r in RING_KINDS.items())
        raise KVLayoutError(f"--ring-kind {abbreviated(name, limit=60)!r}: vLLM 0.33's rings are {kinds}")
    return name, RING_KINDS[name]


def ring_dtype_name(kind: Any) -> str:
    """The command line's name (a key of SHORT_NAMES) of a ring kind's dtype."""
    return next(k for k, v in SHORT_NAMES.items() if f"torch.{v}" == str(kind.dtype))


def _ring_side(
    where: str, a: dict[str, Any], kv: Any, spec: Any, engine: Any, hints: dict[str, object], shape_flag: str,
    kind: tuple[str, Any],
) -> tuple[Any, Any]:  # fmt: skip
    """A side given with ``--{where}-ring``: vLLM 0.33's ``CircularBufferSpec`` rings of
    ``kind`` (``--ring-kind``: its name and ``RingKind``) as it registers them
    (``shape_flag NLx[NB,H,N,C]``: ``--{where}-shape``, or ``--{where}-ring-shape`` beside
    the attention group; ``N`` the ring's capacity, ``C`` its row), read as the group edits
    read them: one block a request, moved whole, held whole on every rank."""
    from kvlayout.integrations.vllm.rules import declared_ring_pages

    name, ring = kind
    flag = shape_flag if shape_flag.endswith("-ring-shape") else f"--{where}-ring"  # what says: rings
    _check_vllm_layers(
        kv, spec, engine, (flag, shape_flag), "rings (a CircularBufferSpec's pages)", "a ring",
        f"NLx{ring.registered} for --ring-kind {name} (N the ring's capacity, C its row)",
    )  # fmt: skip
    if kv[0].dtype != ring.dtype:  # beside attention, the ring's shape is read in the ring's dtype
        raise KVLayoutError(
            f"--dtype {a['dtype']} with {flag}: {ring.what} is {str(ring.dtype).removeprefix('torch.')} "
            f"({ring.producer} registers it so); give --dtype {ring_dtype_name(ring)}, or another --ring-kind"
        )
    return _declared(
        lambda t: declared_ring_pages(t, hints, name), kv, (flag, shape_flag, spec), "ring", engine, hints
    )


def _check_vllm_layers(
    kv: Any, spec: Any, engine: Any, flags: tuple[str, str], reads: str, one: str, registered: str
) -> None:
    """Refuse a side declared with ``flags[0]`` (``--*-state``, ``--*-ring``) that is not
    vLLM's, or whose ``flags[1]`` shape is not a list of one tensor a layer as vLLM 0.33
    registers them (``registered``); ``reads`` and ``one`` name what the flag reads."""
    import torch

    flag, shape_flag = flags
    if engine.value != "vllm":
        raise KVLayoutError(f"{flag} reads vLLM's {reads}, not {engine.value}'s")
    if not isinstance(kv, list) or len(spec.parts) > 1 or not all(isinstance(t, torch.Tensor) for t in kv):
        raise KVLayoutError(
            f"{shape_flag} {_shown(spec.text)}: with {flag}, a list of one tensor {one}, as vLLM 0.33 "
            f"registers them: {registered}"
        )


def _declared(
    read: Any, kv: list[Any], flags: tuple[str, str, Any], what: str, engine: Any, hints: dict[str, object]
) -> tuple[Any, Any]:
    """A side's tensors read as a vLLM edit reads them (``read``: each tensor's view, as
    the spec ``--*-state`` / ``--*-ring`` declares), detected: the registration and its
    one kernel group. ``flags``: the declaring flag, the shape flag and its spec, for the
    messages."""
    import kvlayout
    from kvlayout.integrations.vllm.errors import KVCacheGroupEditError

    flag, shape_flag, spec = flags
    try:
        views = [read(t) for t in kv]
    except KVCacheGroupEditError as e:
        raise KVLayoutError(f"{flag} on {shape_flag} {_shown(spec.text)}: {e}") from None
    try:
        reg = kvlayout.detect(views, engine, hints)
    except (KVLayoutError, TypeError) as e:
        raise KVLayoutError(f"{shape_flag}: detection refuses its {what} pages: {e}") from None
    return reg, reg.kernel_groups[0]


Plan = Literal["attention", "state", "hybrid", "ring", "ringed"]
"""What a plan moves (:func:`_state_plan`)."""


def _state_plan(args: argparse.Namespace) -> Plan:
    """What the plan moves: attention alone; Mamba state alone (``--*-state`` on both
    sides, ``--*-shape`` the state's layers); a hybrid's request whole, an attention
    group (``--*-shape``) and its state group (``--*-state-shape`` with ``--*-state``) on
    both sides; vLLM's rings (``--*-ring`` on both sides); or an attention group with its
    rings beside it (``--*-ring-shape`` on both sides: DeepSeek-V4.1's latents and
    compressor rings, ``ringed``). Given on one side only, or state or rings alone with
    ``--first-token`` or ``--kv-heads``, is the command line's error."""
    a = vars(args)
    if a["src_ring"] or a["dst_ring"]:
        return _ring_plan(args)
    if a["src_ring_shape"] is not None or a["dst_ring_shape"] is not None:
        return _ringed_plan(args)
    if a["ring_kind"] is not None:
        raise KVLayoutError(
            f"--ring-kind {abbreviated(a['ring_kind'], limit=60)} without rings: it says which ring "
            "--src-ring and --dst-ring (or --src-ring-shape and --dst-ring-shape) give; give them"
        )
    for flag in ("state-shape", "state"):
        key = flag.replace("-", "_")
        given = {w: a[f"{w}_{key}"] is not None for w in ("src", "dst")}
        if given["src"] != given["dst"]:
            w, o = ("src", "dst") if given["src"] else ("dst", "src")
            raise KVLayoutError(
                f"--{w}-{flag} is given and --{o}-{flag} is not: a state group maps into a state group (give "
                f"--{o}-{flag}), and an attention group into an attention group"
            )
    if a["src_state_shape"] is not None:
        if a["src_state"] is None:
            raise KVLayoutError(
                "--src-state-shape and --dst-state-shape without --src-state and --dst-state: a Mamba page's "
                f"shape does not say its states; give each side's MambaSpec fields ({STATE_EXAMPLE})"
            )
        return "hybrid"
    if a["src_state"] is None:
        return "attention"
    if args.first_token:
        raise KVLayoutError(
            f"--first-token {args.first_token}: a Mamba state page holds no tokens (the request's running "
            "state moves whole); plan it without --first-token, or with the attention group beside it "
            "(--src-shape, the state as --src-state-shape), which --first-token then cuts"
        )
    if args.kv_heads is not None:  # a state page's slices follow the rank and the degree alone
        raise KVLayoutError(
            f"--kv-heads {args.kv_heads}: it counts attention KV heads, and a Mamba state page holds none "
            "(each rank's slices follow its TP rank and degree alone); plan the state without it, or with "
            "the attention group beside it (--src-shape, the state as --src-state-shape)"
        )
    return "state"


def _ringed_plan(args: argparse.Namespace) -> Literal["ringed"]:
    """A plan of an attention group with vLLM's rings beside it (``--src-ring-shape`` and
    ``--dst-ring-shape``), or the command line's error: a ring maps only into a ring, and
    the plan holds one group beside the attention (no Mamba state with it)."""
    a = vars(args)
    if (a["src_ring_shape"] is None) != (a["dst_ring_shape"] is None):
        w, o = ("src", "dst") if a["src_ring_shape"] is not None else ("dst", "src")
        raise KVLayoutError(
            f"--{w}-ring-shape is given and --{o}-ring-shape is not: a ring maps only into a ring (vLLM's "
            f"CircularBufferSpec, DeepSeek-V4.1's compressor state); give --{o}-ring-shape"
        )
    given = [f"--{w}-{f}" for f in ("state", "state-shape") for w in ("src", "dst")
             if a[f"{w}_{f.replace('-', '_')}"] is not None]  # fmt: skip
    if given:
        raise KVLayoutError(
            f"{given[0]} with --src-ring-shape and --dst-ring-shape: a plan holds one group beside the "
            "attention group, its rings or its Mamba state; plan the other apart"
        )
    return "ringed"


def _ring_plan(args: argparse.Namespace) -> Literal["ring"]:
    """A plan of vLLM's rings (``--src-ring`` and ``--dst-ring``), or the command line's
    error: a ring maps only into a ring, holds no tokens and no KV heads, and is its own
    group (no Mamba state with it)."""
    a = vars(args)
    if a["src_ring"] != a["dst_ring"]:
        w, o = ("src", "dst") if a["src_ring"] else ("dst", "src")
        raise KVLayoutError(
            f"--{w}-ring is given and --{o}-ring is not: a ring maps only into a ring (vLLM's "
            f"CircularBufferSpec, DeepSeek-V4.1's compressor state); give --{o}-ring"
        )
    flags = ("state", "state-shape", "ring-shape", "block-size")
    given = [
        f"--{w}-{f}" for f in flags for w in ("src", "dst") if a[f"{w}_{f.replace('-', '_')}"] is not None
    ]
    if given:
        raise KVLayoutError(
            f"{given[0]} with --src-ring and --dst-ring: a ring is a group of its own, one block a request "
            "whose rows are its capacity (the shape's N), no Mamba state and no scheduler's blocks; plan "
            "the other groups apart"
        )
    for flag, value in (("--first-token", args.first_token), ("--kv-heads", args.kv_heads)):
        if value:
            raise KVLayoutError(
                f"{flag} {value}: a ring holds its request's latest positions, one block moved whole, and no "
                "KV heads (every rank holds it whole); plan the ring without it"
            )
    return "ring"


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
    if not 0 <= args.first_token <= args.tokens:
        raise KVLayoutError(f"--first-token {args.first_token}: it is 0 to --tokens {args.tokens}")
    for where in ("src", "dst"):
        tp, dcp = vars(args)[f"{where}_tp"], vars(args)[f"{where}_dcp"]
        if not 0 < tp <= MAX_TP:
            raise KVLayoutError(f"--{where}-tp {tp}: a TP degree is 1 to {MAX_TP}")
        if dcp < 1 or tp % dcp:
            raise KVLayoutError(
                f"--{where}-dcp {dcp}: a DCP size divides the TP degree (--{where}-tp {tp}): vLLM's DCP "
                "ranks are TP ranks, rank r holding CP rank r % DCP's tokens"
            )
        interleave = vars(args)[f"{where}_cp_interleave"]
        if interleave < 1:
            raise KVLayoutError(
                f"--{where}-cp-interleave {interleave}: a CP rank holds 1 or more tokens at a time"
            )
        if interleave > 1 and dcp == 1:  # vLLM ignores it without DCP; here it hides a forgotten flag
            raise KVLayoutError(
                f"--{where}-cp-interleave {interleave} without --{where}-dcp (or at --{where}-dcp 1): "
                f"the interleave spreads tokens over DCP ranks; give --{where}-dcp SIZE, or leave "
                f"--{where}-cp-interleave out"
            )
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

    from kvlayout.integrations.vllm.rules import STATE_ROWS_DTYPE
    from kvlayout.registration.shards import Shard, ShardError
    from kvlayout.transfer.nixl import DEFAULT_COST
    from kvlayout.types import LayoutHints, as_engine

    dtype = _torch_dtype(args.dtype)
    _plan_bounds(args)
    what = _state_plan(args)
    ring = what == "ring"
    kind = _ring_kind(args) if what in ("ring", "ringed") else None
    state = what in ("state", "ring")  # one block a side, whatever the request's tokens
    meta = torch.device("meta")
    sides: dict[str, tuple[Any, Any]] = {}
    beside: dict[str, tuple[Any, Any]] = {}  # a hybrid's state group or the rings, beside the attention
    notes: dict[str, str | None] = {}
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
        kv = _registration(spec, dtype, meta, a[f"{where}_share"], f"--{where}-share")  # refused as given
        if kind and ring:
            sides[where] = _ring_side(where, a, kv, spec, engine, hints, f"--{where}-shape", kind)
            notes[where] = None
            continue
        if state:
            sides[where] = _state_side(where, a, kv, spec, engine, hints, f"--{where}-shape")
            notes[where] = None
            continue
        if what == "hybrid":  # vLLM registers a Mamba layer as int8 whatever --dtype (the attention's)
            flag = f"--{where}-state-shape"
            state_spec = _registration_spec(flag, a[f"{where}_state_shape"], "int8")
            state_kv = _registration(state_spec, STATE_ROWS_DTYPE, meta, [], f"--{where}-share")
            beside[where] = _state_side(where, a, state_kv, state_spec, engine, hints, flag)
        if kind and what == "ringed":  # the ring's dtype is its kind's whatever --dtype (the attention's)
            flag = f"--{where}-ring-shape"
            ring_spec = _registration_spec(flag, a[f"{where}_ring_shape"], ring_dtype_name(kind[1]))
            ring_kv = _registration(ring_spec, kind[1].dtype, meta, [], f"--{where}-share")
            beside[where] = _ring_side(where, a, ring_kv, ring_spec, engine, hints, flag, kind)
        try:
            reg = _detect_kv(kv, spec, engine, hints)
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
        interleave, bs = a[f"{where}_cp_interleave"], group.geometry.block_size
        if bs % interleave:  # every pair's map would refuse it: vLLM does, at start-up
            raise KVLayoutError(
                f"--{where}-cp-interleave {interleave} does not divide --{where}-shape's blocks of {bs} "
                "tokens: vLLM requires a block size that is a multiple of cp_kv_cache_interleave_size "
                f"(VllmConfig.validate_block_size); give an interleave that divides {bs}"
            )
        scheduler = a[f"{where}_block_size"]
        if scheduler is not None and (
            scheduler < 1 or scheduler % bs or scheduler // bs > group.geometry.num_blocks
        ):
            raise KVLayoutError(
                f"--{where}-block-size {scheduler}: block ids in blocks of a multiple of the {bs} tokens "
                f"a block --{where}-shape reads in (each id is that many of its blocks, in order), at most "
                f"all {group.geometry.num_blocks} of them"
            )
        sides[where] = (reg, group)
        notes[where] = _one_head_note(where, kv, spec, engine, hints, reg)
    heads = {w: None if state else _side_heads(r) for w, (r, _) in sides.items()}
    notes = _latent_notes(notes, heads)
    for where, (_, group) in sides.items():
        engine_name = a[f"{where}_engine"]
        said = (_ring_note(where, engine_name, group, state), notes[where])  # fp32 latents are one head too
        notes[where] = _state_note(where, engine_name, group, state) or "; ".join(filter(None, said)) or None
    model_heads = args.kv_heads
    if state and model_heads is None:  # a state page reads only its rank and TP degree
        model_heads = math.lcm(args.src_tp, args.dst_tp)
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
                    "which axis holds the heads; a shape is contiguous memory unless '@' gives its dims' "
                    "memory order: a view [NB,NH,BS,C] of NHD memory, as vLLM 0.33 hands each layer, is "
                    "'[NB,NH,BS,C]@0,2,1,3')"
                )
    # a state map moves one block a side, its rows whatever the request's tokens
    rows = max(g.geometry.block_size for _, g in sides.values()) if state else args.tokens
    _plan_work(
        args,
        None if heads["src"] is None else model_heads,  # latents, state: every pair maps every row
        {where: len(group.layers) for where, (_, group) in sides.items()},
        rows,
        f"state blocks of {rows} rows" if state else f"--tokens {args.tokens}",
    )
    record: dict[str, Any] = {
        "tokens": args.tokens, "first_token": args.first_token, "blocks": args.blocks, "poster": args.poster,
        "cost_model": DEFAULT_COST.source, "kv_heads": args.kv_heads if state else model_heads,
        "state": state, "ring": ring, "ring_kind": kind and kind[0], "pairs": [],
    }  # fmt: skip
    for where, (_, group) in sides.items():
        g = group.geometry
        per = g.block_size if state else a[f"{where}_block_size"] or g.block_size  # a block id's tokens
        record[where] = {"format": group.format.name, "tp": a[f"{where}_tp"], "dcp": a[f"{where}_dcp"],
                         "cp_interleave": a[f"{where}_cp_interleave"],
                         "block_size": per, "num_blocks": g.num_blocks // (per // g.block_size),
                         "shared_layers": [list(layers) for layers in group.shared_layers],
                         "note": notes[where]}  # fmt: skip
    descs, ids = {}, {}
    for where, (reg, group) in sides.items():
        bs = group.geometry.block_size
        try:
            descs[where] = reg.describe(block_size=bs, at=1 << 40 if where == "src" else 1 << 44)
        except KVLayoutError as e:
            raise KVLayoutError(
                f"--{where}-shape: plan describes it as a peer would, and cannot: {e}"
            ) from None
        if state:  # the request's running state: one block a side
            ids[where] = _block_ids(args.blocks, 1, group.geometry.num_blocks, where)
            continue
        # under DCP a block id stands for dcp blocks of the request's tokens; a scheduler's block
        # (--*-block-size) for several of the cache's
        per = a[f"{where}_block_size"] or bs
        ids[where] = _block_ids(
            args.blocks,
            -(-args.tokens // (per * a[f"{where}_dcp"])),
            group.geometry.num_blocks // (per // bs),
            where,
        )
    record["hybrid"] = what in ("hybrid", "ringed")
    record["beside"] = {"hybrid": "state", "ringed": "ring"}.get(what)
    try:
        if record["beside"]:  # both groups' maps of each pair, posted as one transfer
            state_heads = model_heads if heads["src"] is not None else None
            _hybrid_pairs(args, record, (descs, ids, model_heads, heads["src"] is None), beside, state_heads)
        else:
            _plan_pairs(args, record, descs, ids, model_heads, latent=heads["src"] is None, state=state)
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


def _hybrid_pairs(
    args: argparse.Namespace, record: dict[str, Any], attention: tuple[Any, Any, int | None, bool],
    beside: dict[str, tuple[Any, Any]], model_heads: int | None,
) -> None:  # fmt: skip
    """A request whole into ``record``: each rank pair's attention map (sent by one
    replica, as :func:`_plan_pairs` plans it) and the map of the group beside it
    (``record["beside"]``: a hybrid's Mamba state, from every rank holding slices of the
    pair's; or the rings, which every rank holds whole, from one), joined as vLLM's
    NixlConnector posts them (one transfer), its descriptors and predicted times those
    of the joined map. ``attention``: its descriptions, block ids, model heads and
    whether it is latents; ``model_heads``: the beside group's shards' heads (the
    model's attention KV heads, None for latents: a state shard reads only the rank and
    the degree, a ring none of it)."""
    from kvlayout.transfer import join_maps

    name = record["beside"]
    heads = model_heads or math.lcm(args.src_tp, args.dst_tp)
    rows = max(g.geometry.block_size for _, g in beside.values()) if name == "ring" else 1
    _plan_work(
        args,
        None,
        {w: len(g.layers) for w, (_, g) in beside.items()},
        rows,
        f"{name} blocks of {rows} row(s)",
    )
    descs, ids = {}, {}
    for where, (reg, group) in beside.items():
        g = group.geometry
        try:  # apart from the attention's memory (vLLM lays both over one buffer, other block ids)
            descs[where] = reg.describe(block_size=g.block_size, at=1 << 47 if where == "src" else 1 << 48)
        except KVLayoutError as e:
            raise KVLayoutError(
                f"--{where}-{name}-shape: plan describes it as a peer would, and cannot: {e}"
            ) from None
        ids[where] = _block_ids(args.blocks, 1, g.num_blocks, f"{where} {name}")
        record[where][name] = {"format": group.format.name, "block_size": g.block_size,
                               "num_blocks": g.num_blocks, "layers": len(group.layers)}  # fmt: skip
    groups = ("attention", name)
    parts: dict[str, dict[str, Any]] = {k: {"pairs": []} for k in groups}
    maps: dict[str, dict[tuple[int, int], Any]] = {k: {} for k in groups}
    a_descs, a_ids, a_heads, latent = attention
    _plan_pairs(args, parts["attention"], a_descs, a_ids, a_heads, latent=latent, maps=maps["attention"])
    _plan_pairs(args, parts[name], descs, ids, heads, latent=False, state=True, maps=maps[name])
    for at, other in zip(parts["attention"]["pairs"], parts[name]["pairs"], strict=True):
        key = (at["src_rank"], at["dst_rank"])
        pair: dict[str, Any] = {"src_rank": key[0], "dst_rank": key[1]}
        for group_name, part in zip(groups, (at, other), strict=True):
            pair[group_name] = {
                k: part[k] for k in ("refused", "kind", "reason", "runs", "bytes") if k in part
            }
        refused = [f"{k}: {pair[k]['refused']}" for k in groups if "refused" in pair[k]]
        if refused:
            pair["refused"] = "; ".join(refused)
        else:
            sent = [maps[k][key] for k in groups if key in maps[k]]
            pair |= {"runs": sum(m.num_runs for m in sent), "bytes": sum(m.num_bytes for m in sent)}
            if sent:
                _estimated(pair, join_maps(sent), args.poster)
        record["pairs"].append(pair)


def _plan_work(
    args: argparse.Namespace, model_heads: int | None, side_layers: dict[str, int], tokens: int, said: str
) -> None:
    """Refuse a plan of more than MAX_PLAN_LAYERS layers a side, MAX_PLAN_MAPS layer maps
    or MAX_PLAN_ROWS token rows (the pairs with no head in common move no rows: they
    count for their maps, not their rows). ``model_heads`` is None where every pair maps
    every row: latents (MLA), which every rank holds whole whatever ``--kv-heads`` says,
    and Mamba state. ``tokens``: the rows a pair maps a layer (a state map's, its block's),
    which the message calls ``said``."""
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
    rows = tokens * layers * pairs
    if rows > MAX_PLAN_ROWS:
        raise KVLayoutError(
            f"{said} of {layers} layers over {pairs} rank pair(s) "
            f"{'that exchange heads' if model_heads is not None else 'that map every row'} make "
            f"{rows} token rows to map, more than 2**28 = {MAX_PLAN_ROWS}; plan fewer tokens or ranks"
        )


def _plan_pairs(
    args: argparse.Namespace, record: dict[str, Any], descs: dict[str, Any], ids: dict[str, Any],
    model_heads: int | None, *, latent: bool, state: bool = False,
    maps: dict[tuple[int, int], Any] | None = None,
) -> None:  # fmt: skip
    """Each rank pair's block map and cost, or why it cannot be served, into ``record``
    (``latent``: the src holds MLA latents, which every rank holds whole; ``state``: Mamba
    state pages, each rank's slices its own, so every pair sends what both hold, as vLLM's
    NixlConnector reads a Mamba group from every prefill rank, and held whatever the DCP
    size: vLLM never shards Mamba state by CP rank). ``maps``: where given, each pair
    that sends runs gets its map there, by ``(src rank, dst rank)``, and no estimate."""
    from kvlayout.registration.shards import Shard
    from kvlayout.transfer import block_map

    def shard(where: str, rank: int) -> Shard | None:
        tp, dcp, interleave = (vars(args)[f"{where}_{k}"] for k in ("tp", "dcp", "cp_interleave"))
        if state:  # each DCP rank holds its TP rank's slices whole (MambaSpec.max_num_blocks_per_req)
            return Shard(rank, tp, model_heads or 1)
        if model_heads is None and dcp == 1:
            return None
        return Shard(rank, tp, model_heads or 1, rank % dcp, dcp, interleave if dcp > 1 else 1)

    for r in range(args.src_tp):
        for d in range(args.dst_tp):
            pair: dict[str, Any] = {"src_rank": r, "dst_rank": d}
            try:
                src_shard, dst_shard = shard("src", r), shard("dst", d)
                if state:  # one block a side, no tokens: the block ids are the cache's own
                    m = block_map(descs["src"], descs["dst"], ids["src"], ids["dst"], src_shard=src_shard,
                                  dst_shard=dst_shard)  # fmt: skip
                else:
                    m = block_map(
                        descs["src"], descs["dst"], ids["src"], ids["dst"], num_tokens=args.tokens,
                        first_token=args.first_token, src_shard=src_shard, dst_shard=dst_shard,
                        src_block_size=args.src_block_size, dst_block_size=args.dst_block_size,
                    )  # fmt: skip
            except KVLayoutError as exc:
                pair["refused"] = str(exc)
                record["pairs"].append(pair)
                continue
            pair |= {"kind": m.kind, "reason": m.reason, "runs": m.num_runs, "bytes": m.num_bytes}
            if state:
                # a state every rank holds whole (tp_replicated) is sent by one rank, as latents are
                if (
                    m.num_runs
                    and m.latents
                    and _sender(Shard(r, args.src_tp, 1), Shard(d, args.dst_tp, 1)) != r
                ):
                    sender = _sender(Shard(r, args.src_tp, 1), Shard(d, args.dst_tp, 1))
                    rings = args.src_ring or args.src_ring_shape is not None
                    whole = "a ring, which vLLM computes on every rank" if rings else "tp_replicated"
                    pair |= {"kind": "replica", "runs": 0, "bytes": 0, "reason": (
                        f"src rank {sender} holds the same state (every rank holds it whole: {whole}) "
                        "and sends it: one replica sends it, as Shard.sends_to says"
                    )}  # fmt: skip
                if pair["runs"]:
                    _keep(pair, m, args.poster, maps)
                record["pairs"].append(pair)
                continue
            # several src ranks hold these heads (or, for latents, all of them): one sends
            held = ("latents", 1) if latent or model_heads is None else ("heads", model_heads)
            if args.src_dcp > 1:  # replicas: the ranks of this CP rank that hold these heads
                sender = _cp_sender(args.src_tp, args.src_dcp, held[1], r, d)
                what, how = (
                    f"{held[0]} and tokens",
                    f"of CP rank {r % args.src_dcp}: they take turns by dst rank",
                )
            else:
                sender = _sender(Shard(r, args.src_tp, held[1]), Shard(d, args.dst_tp, held[1]))
                what, how = held[0], "as Shard.sends_to says"
            if m.num_runs and sender != r:
                pair |= {"kind": "replica", "runs": 0, "bytes": 0, "reason": (
                    f"src rank {sender} holds the same {what} and sends them: one replica sends each head, "
                    f"{how}"
                )}  # fmt: skip
            if pair["runs"]:
                _keep(pair, m, args.poster, maps)
            record["pairs"].append(pair)


def _keep(
    pair: dict[str, Any], m: Any, poster: Literal["src", "dst"], maps: dict[tuple[int, int], Any] | None
) -> None:
    """A pair that sends ``m``: estimated, or its map kept in ``maps`` (a hybrid's group)."""
    if maps is None:
        _estimated(pair, m, poster)
    else:
        maps[pair["src_rank"], pair["dst_rank"]] = m


def _estimated(pair: dict[str, Any], m: Any, poster: Literal["src", "dst"]) -> None:
    """``pair`` with the NIXL strategies' descriptors and predicted times of map ``m``."""
    from kvlayout.transfer.nixl import estimate

    est = estimate(m, poster=poster)
    pair |= {"mean_run": m.num_bytes / m.num_runs, "op": est.op, "descriptors": est.descriptors,
             "predicted_s": est.predicted_s, "choice": est.choice, "stages": est.stages}  # fmt: skip


def _sender(src: Any, dst: Any) -> int:
    """The src rank that holds ``src``'s heads and sends them to ``dst``."""
    from kvlayout.registration.shards import Shard

    first = src.tp_rank - src.tp_rank % src.replicas
    return next(
        k for k in range(first, first + src.replicas) if Shard(k, src.tp_size, src.num_kv_heads).sends_to(dst)
    )


def _cp_sender(tp: int, dcp: int, heads: int, r: int, d: int) -> int:
    """Under DCP, the src rank that sends dst rank ``d`` what src rank ``r`` holds: of the
    ranks that hold ``r``'s heads and CP rank (vLLM's: ``rank % dcp``), the ``d``-th in
    turn."""
    from kvlayout.registration.shards import Shard

    mine = Shard(r, tp, heads).heads
    replicas = [k for k in range(tp) if k % dcp == r % dcp and Shard(k, tp, heads).heads == mine]
    return replicas[d % len(replicas)]


def _print_plan(r: dict[str, Any]) -> None:
    from kvlayout.integrations.vllm.rules import RING_KINDS

    s, d = r["src"], r["dst"]
    rings = (
        f"the request's ring (vLLM's CircularBufferSpec: {RING_KINDS[r['ring_kind']].what})"
        if r["ring_kind"]
        else ""
    )
    moved = f" (moving {r['first_token']} on)" if r["first_token"] else ""
    if r["ring"]:  # vLLM's rings: one block a request, held whole on every rank
        print(
            f"plan: {rings}, one block id a side ({r['blocks']}); "
            f"src TP {s['tp']} (rings of {s['block_size']} rows), dst TP {d['tp']} (rings of "
            f"{d['block_size']} rows), every rank's ring whole; posted by {r['poster']}; "
            f"cost model: {r['cost_model']}"
        )
    elif r["state"]:  # Mamba state: one block a side, its rows no tokens
        print(
            f"plan: the running Mamba state, one block id a side ({r['blocks']}); "
            f"src state TP {s['tp']} ({s['block_size']} row(s) a block), "
            f"dst state TP {d['tp']} ({d['block_size']} row(s) a block); "
            f"posted by {r['poster']}; cost model: {r['cost_model']}"
        )
    else:
        print(
            f"plan: {r['tokens']} tokens{moved}, {r['blocks']} block ids; "
            f"src {s['format']} TP {s['tp']}{_dcp(s)} (blocks of {s['block_size']}), "
            f"dst {d['format']} TP {d['tp']}{_dcp(d)} (blocks of {d['block_size']}); "
            f"{r['kv_heads'] or 'latent'} KV heads; posted by {r['poster']}; cost model: {r['cost_model']}"
        )
    beside = r["beside"]
    if beside:
        what = "the running Mamba state" if beside == "state" else rings
        print(
            f"  and {what}, one block id a side: src {s[beside]['layers']} layers ({s[beside]['format']}), "
            f"dst {d[beside]['layers']} layers ({d[beside]['format']}); each pair's maps posted as one "
            "transfer"
        )
    for side in (s, d):
        if side["note"]:
            print(f"  note: {side['note']}")
    for p in r["pairs"]:
        head = f"  src rank {p['src_rank']} -> dst rank {p['dst_rank']}:"
        if "refused" in p:
            print(f"{head} cannot be served: {p['refused']}")
        elif not p["runs"]:
            why = (
                "; ".join(f"{k}: {p[k]['reason']}" for k in ("attention", beside)) if beside else p["reason"]
            )
            print(f"{head} nothing to send ({why})")
        else:
            n, t = p["descriptors"], p["predicted_s"]
            if beside:
                each_group = "; ".join(
                    f"{k} {g['kind']}, {g['runs']} runs, {g['bytes']} bytes"
                    if g["runs"]
                    else f"{k} none ({g['reason']})"
                    for k, g in ((k, p[k]) for k in ("attention", beside))
                )
                print(f"{head} {each_group}; together {p['runs']} runs, {p['bytes']} bytes, "
                      f"mean run {p['mean_run']:.0f} B")  # fmt: skip
            else:
                mean = f"mean run {p['mean_run']:.0f} B"
                print(f"{head} {p['kind']}; {p['runs']} runs, {p['bytes']} bytes, {mean}")
            each = "; ".join(f"{k} {n[k]} descriptors, {t[k] * 1e3:.2f} ms" for k in n)
            stages = p["stages"][p["choice"]]
            print(
                f"    {p['op']}: {each}; choice: {p['choice']}"
                + (f", in {stages} stages" if stages > 1 else "")
            )


def _dcp(side: dict[str, Any]) -> str:
    return f" DCP {side['dcp']} (interleave {side['cp_interleave']})" if side["dcp"] > 1 else ""
