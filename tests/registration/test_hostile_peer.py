"""A peer that lies: real descriptions (vLLM NHD and HND, MLA, SGLang, TRT-LLM, a vLLM
hybrid with Mamba state pages), their JSON mutated at random (field types, huge,
negative, NaN and boolean numbers, keys added and dropped, deep nesting, long lists,
addresses that overlap or wrap 2**64, layers repeated or reordered, shards that disagree
with the heads, engine groups pointing nowhere).

The property, for every mutant: ``from_json`` refuses it with a PeerDescriptionError
that names the description's field (never another exception from deep inside), or
returns a description every run of whose block maps (against a local registration, in
both directions) lies inside the tensors it describes, their spans worked out here from
the described shapes and strides. Where the description is accepted, NIXL's side is
checked too, through an agent standing in for NIXL (``StandIn``: it holds the memory
the peer really registered, and refuses a descriptor outside it as NIXL's
``check_remote_metadata`` and ``initialize_xfer`` do): a request, in the list form or
the prepped one, whose descriptors leave what the peer registered is refused before
anything is posted; one that stays inside is prepared, its index arrays covering the
runs' bytes. So for the staged strategy (its stretches posted from a staging buffer
here, as lists and as prepped indices) and the peer-staged one (the runs as they lie
here, posted into a staging buffer the peer registered, which a description that puts
a tensor on it makes a lie): refused before anything is posted, or every descriptor
inside what the peer registered (and, staged, what it described).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import KVLayoutError
from kvlayout.layout.algebra import size_of
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.registration import Registration
from kvlayout.transfer import PeerDescriptionError, RegistrationDescription, Shard, TransferError, block_map
from kvlayout.transfer import nixl as nx

U64 = np.uint64
PEER = "kvl-hostile-peer"


class NixlRefusalError(Exception):
    """What NIXL raises for a descriptor outside a peer's registered memory (its module
    named as NIXL's, which is how the library tells NIXL's errors from others)."""

    __module__ = "nixl._bindings"


class StandIn:
    """A NIXL agent standing in for the real one: it registers nothing, holds the memory
    peer ``PEER`` registered (``registered``, (start, end) pairs) and refuses, as NIXL
    does, metadata checks and requests that leave it. ``posted`` records every post."""

    name = "kvl-hostile-local"

    def __init__(self, registered: list[tuple[int, int]]) -> None:
        self.registered = registered
        self.posted: list[Any] = []
        self.lists: dict[int, np.ndarray] = {}
        self.made = 0  # lists prepared so far: each one's handle

    def inside(self, rows: np.ndarray) -> bool:
        return all(
            any(a <= int(r[0]) and int(r[0]) + int(r[1]) <= b for a, b in self.registered) for r in rows
        )

    def register_memory(self, descs: Any, mem: str) -> object:
        return object()

    def deregister_memory(self, handle: object) -> None:
        pass

    def check_remote_metadata(self, peer: str, descs: np.ndarray | None = None) -> bool:
        return peer == PEER and (descs is None or self.inside(descs))

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> np.ndarray:
        return np.array(rows, dtype=U64).reshape(-1, 3)

    def initialize_xfer(self, op: str, local: Any, remote: np.ndarray, peer: str, notif: bytes) -> object:
        if peer != PEER or not self.inside(remote):
            raise NixlRefusalError("remote descriptor outside the peer's registered memory")
        return object()

    def prep_xfer_dlist(self, name: str, rows: np.ndarray, mem: str) -> int:
        if name == PEER:
            dense = [(int(a), int(n) * int(c), 0) for a, n, _, _, c in rows.tolist()]
            if not self.inside(np.array(dense, dtype=U64).reshape(-1, 3)):
                raise NixlRefusalError("prepared list outside the peer's registered memory")
        self.lists[self.made] = rows
        self.made += 1
        return self.made - 1

    def release_dlist_handle(self, handle: int) -> None:
        del self.lists[handle]  # as NIXL frees it: a second release, or a request from it after, fails

    def make_prepped_xfer(
        self, op: str, local: int, local_idx: np.ndarray, remote: int, remote_idx: np.ndarray, notif: bytes
    ) -> object:
        """The request, its remote indices read back as (address, length) units of the
        list they index (refused past its end, as NIXL does)."""
        rows = self.lists[remote].astype(np.int64)
        first = np.r_[0, np.cumsum(rows[:, 4])]
        idx = np.asarray(remote_idx, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= first[-1]):
            raise NixlRefusalError("an index outside the prepared list")
        k = np.searchsorted(first, idx, side="right") - 1
        units = np.c_[rows[k, 0] + (idx - first[k]) * rows[k, 1], rows[k, 1]].astype(U64)
        return ("prepped", units)

    def transfer(self, handle: object) -> str:
        self.posted.append(handle)
        return "DONE"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"

    def get_xfer_telemetry(self, handle: object) -> object:
        raise NixlRefusalError("telemetry is not captured")  # as NIXL without NIXL_TELEMETRY_ENABLE

    def update_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def release_xfer_handle(self, handle: object) -> None:
        pass


@dataclass
class Seed:
    """Two registrations of one cache geometry in this process: ``here`` posts, ``there``
    is the peer, described (``text``) at ``shard``; ``blocks`` are a map's block lists."""

    name: str
    here: Registration
    there: Registration
    shard: Shard | None
    text: str
    blocks: tuple[list[int], list[int]]
    agent: StandIn
    held: Any  # the stand-in's registration of ``here``
    staging: nx.Staging  # here's, on the stand-in, for the staged strategy
    landing: torch.Tensor  # the peer's staging buffer, registered (``agent.registered``), undescribed

    @property
    def peer_staging(self) -> nx.PeerStaging:
        return nx.PeerStaging(self.landing.data_ptr(), self.landing.nbytes)

    @functools.cached_property
    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.text)
        return out


def _seed(name: str, make: Callable[[], Any], engine: str, hints: dict[str, Any], heads: int) -> Seed:
    here, there = (kvlayout.detect(make(), engine, hints) for _ in range(2))
    shard = Shard(0, 1, heads)
    desc = there.describe(shard=shard)
    registered = [
        (a, a + p.span) for g in desc.groups for p in g.planes for a in p.addresses
    ]  # the peer registers exactly the tensors it describes, and its staging buffer
    return _seeded(name, here, there, shard, desc.to_json(), registered)


STAGING = 8 << 20  # bytes of each staging buffer, here's and the peer's (the hybrid's maps: 6.4 MiB)


def _seeded(
    name: str, here: Registration, there: Registration, shard: Shard, text: str, registered: list[Any]
) -> Seed:
    landing = torch.zeros(STAGING, dtype=torch.uint8)
    agent = StandIn([*registered, (landing.data_ptr(), landing.data_ptr() + STAGING)])
    held = nx.register(agent, here)
    return Seed(
        name, here, there, shard, text, ([1, 3], [2, 0]), agent, held, nx.Staging(agent, STAGING), landing
    )


def _hybrid() -> Seed:
    """A Qwen3.5 GDN hybrid in vLLM 0.33 at TP 2: attention and Mamba state pages."""
    import kvlayout.testing.vllm as vx

    model = vx.QWEN3_5_0_8B

    def rank() -> Registration:
        engine = vx.hybrid_engine(
            model, vx.FLASHINFER, num_blocks=4, tp=2, conv_layout="DS", mamba_cache_mode="none",
            max_model_len=40960,
        )  # fmt: skip
        _, raw = vx.allocate_v033(engine)
        reg: Registration = vx.detect_registered(
            engine, raw, {"kv_layout": "NHD"}, edited=True, prefix_reuse=False
        )
        return reg

    here, there = rank(), rank()
    shard = Shard(1, 2, model.num_key_value_heads)
    desc = there.describe(shard=shard)
    registered = [(a, a + p.span) for g in desc.groups for p in g.planes for a in p.addresses]
    return _seeded("hybrid", here, there, shard, desc.to_json(), registered)


BF16 = torch.bfloat16


@functools.cache
def seeds() -> dict[str, Seed]:
    return {
        "vllm NHD": _seed("vllm NHD", lambda: [torch.zeros(2, 4, 4, 2, 8, dtype=BF16) for _ in range(2)],
                          "vllm", {"kv_layout": "NHD"}, 2),
        "vllm HND": _seed("vllm HND",
                          lambda: [torch.zeros(2, 4, 2, 4, 8, dtype=BF16).transpose(2, 3) for _ in range(2)],
                          "vllm", {"kv_layout": "HND"}, 2),
        "vllm MLA": _seed("vllm MLA", lambda: [torch.zeros(4, 4, 48, dtype=BF16) for _ in range(2)],
                          "vllm", {}, 1),
        "sglang": _seed("sglang",
                        lambda: [[torch.zeros(4, 4, 2, 8, dtype=BF16) for _ in range(2)] for _ in range(2)],
                        "sglang", {"tokens_per_block": 4}, 2),
        "trtllm": _seed("trtllm", lambda: torch.zeros(4, 2, 2, 2, 4, 8, dtype=BF16), "trtllm", {}, 2),
        "hybrid": _hybrid(),
    }  # fmt: skip


# -- mutations ---------------------------------------------------------------------------------------

Path = tuple[str | int, ...]

HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 2, 2**31, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
    2**100, 1.5, -0.0, 1e308, float("nan"), float("inf"), "", "0", "bfloat16", "NL_X_TWO_NB_BS_NH_HS",
    "x" * 300, [], {}, [0], [[0]], {"a": 1},
]  # fmt: skip


def _paths(node: Any, path: Path = ()) -> list[Path]:
    """Every node's path, the root's included."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _get(node: Any, path: Path) -> Any:
    for k in path:
        node = node[k]
    return node


def _set(root: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


def _addresses(data: Any) -> list[int]:
    return [
        a
        for p in _paths(data)
        if len(p) >= 2 and p[-2] == "addresses" and isinstance(a := _get(data, p), int)
    ]


def _coherent(plane: dict[str, Any], fmt: str, key: str, factor: int) -> None:
    """``plane`` with size ``key`` multiplied by ``factor`` and its shape and strides what
    the format's layout gives for the new sizes (a description that parses, claiming
    other tensors than the peer has); left as it is where the layout refuses them."""
    from kvlayout.layout.algebra import resolve_sizes

    sizes = {**plane["sizes"], key: plane["sizes"][key] * factor}
    try:
        layout = kvlayout.layout_of(kvlayout.EngineKVFormat[fmt])
        resolved = resolve_sizes(layout, sizes)
        shape, strides = layout.tensor_shape(resolved), layout.tensor_strides(resolved, None)
    except (KVLayoutError, KeyError, TypeError):
        return
    plane.update(sizes=sizes, shape=list(shape), strides=list(strides), block_stride=None)


# Each kind weighted by how often it is drawn: the ones that keep a description well
# formed (and so reach the map and NIXL's side) most.
KINDS = {
    "scalar": ["hostile"] * 2 + ["shift"] * 4 + ["scale"] * 2 + ["wrap"] * 2 + ["alias"] * 3 + ["nest"],
    "bool": ["hostile", "flip"],
    "text": ["hostile"] * 3 + ["nest"],
    "list": ["hostile", "dup", "dup", "drop", "drop", "reverse", "swap", "swap", "long", "empty", "nest"],
    "object": ["hostile", "drop_key", "drop_key", "add_key"],
    "plane": ["move"] * 4 + ["grow"] * 4 + ["drop_key", "add_key"],
    "group": ["regroup"] * 3 + ["drop_key", "add_key"],
}


def _kind_of(path: Path, node: Any) -> str:
    if isinstance(node, bool):
        return "bool"
    if isinstance(node, int):
        return "scalar"
    if isinstance(node, list):
        return "list"
    if isinstance(node, dict):
        return "plane" if "addresses" in node else "group" if "planes" in node else "object"
    return "text"


@st.composite
def mutant(draw: st.DrawFn, data: dict[str, Any]) -> tuple[Any, str | None]:
    """``data`` with 1 to 3 mutations; a text to splice in for a value marked ``"@@"``
    (deep nesting, which json.dumps cannot write) or None."""
    root: Any = json.loads(json.dumps(data))
    splice = None
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(root)
        path = draw(st.sampled_from(paths[1:] or paths)) if draw(st.integers(0, 49)) else ()
        node = _get(root, path)
        kind = draw(st.sampled_from(KINDS[_kind_of(path, node)]))
        if kind == "hostile":  # a copy: a later mutation may change it in place
            root = _set(root, path, copy.deepcopy(draw(st.sampled_from(HOSTILE))))
        elif kind == "nest":
            depth = draw(st.sampled_from([2, 50, 5000, 200_000]))
            splice = "[" * depth + "1" + "]" * depth
            root = _set(root, path, "@@")
        elif kind == "flip":
            root = _set(root, path, not node)
        elif kind == "shift":
            delta = draw(st.sampled_from([-1, 1, 2, -4096, 4096, 1 << 20, -(1 << 40)]))
            root = _set(root, path, node + delta)
        elif kind == "scale":
            root = _set(root, path, node * draw(st.sampled_from([0, 2, 3, 1 << 20, -1])))
        elif kind == "wrap":
            root = _set(
                root, path, draw(st.sampled_from([2**64 - 1, 2**64 - 64, 2**64 - 4096, 2**63, 2**57]))
            )
        elif kind == "alias":  # another tensor's address, perhaps a little in
            others = _addresses(root) or [0]
            root = _set(root, path, draw(st.sampled_from(others)) + draw(st.sampled_from([0, 2, 64, 512])))
        elif kind == "move":  # every tensor of the plane elsewhere: well formed, perhaps unregistered
            delta = draw(st.sampled_from([2, 64, 4096, -4096, 1 << 20, 1 << 40, 2**63, -(1 << 30)]))
            if isinstance(node.get("addresses"), list):
                node["addresses"] = [a + delta if isinstance(a, int) else a for a in node["addresses"]]
        elif kind == "grow":  # a size changed, the shape and strides with it
            group = _get(root, path[:-2]) if len(path) >= 2 else {}
            sizes = node.get("sizes")
            if (
                isinstance(sizes, dict)
                and sizes
                and isinstance(group, dict)
                and isinstance(group.get("format"), str)
            ):
                key = draw(st.sampled_from(sorted(sizes)))
                if isinstance(sizes[key], int) and not isinstance(sizes[key], bool):
                    _coherent(node, group["format"], key, draw(st.sampled_from([2, 3, 1 << 10])))
        elif kind == "regroup":
            node["engine_group"] = draw(st.sampled_from([-1, 0, 1, 7, 65535, 65536, -2]))
        elif kind in ("dup", "drop", "swap") and not node:
            continue
        elif kind == "dup":
            i = draw(st.integers(0, len(node) - 1))
            node.insert(i, json.loads(json.dumps(node[i])))
        elif kind == "drop":
            del node[draw(st.integers(0, len(node) - 1))]
        elif kind == "reverse":
            node.reverse()
        elif kind == "swap":
            i, j = draw(st.integers(0, len(node) - 1)), draw(st.integers(0, len(node) - 1))
            node[i], node[j] = node[j], node[i]
        elif kind == "long":
            fill = node[-1] if node else 0
            node.extend([json.loads(json.dumps(fill))] * draw(st.sampled_from([1, 100, 5000])))
        elif kind == "empty":
            node.clear()
        elif kind == "drop_key" and node:
            del node[draw(st.sampled_from(sorted(node)))]
        elif kind == "add_key":
            key = draw(st.sampled_from(["extra", "layers", "", "x" * 200]))
            node[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
    return root, splice


# -- the property ------------------------------------------------------------------------------------


def _text(root: Any, splice: str | None) -> str:
    text = json.dumps(root)
    return text if splice is None else text.replace('"@@"', splice)


def _spans(d: RegistrationDescription, group: int) -> list[tuple[int, int]]:
    """Each described tensor of ``group`` as (first byte, past the last), from its shape and
    strides: the last element's offset, plus one element."""
    out = []
    for p in d.groups[group].planes:
        size = DTYPE_SIZES[p.dtype]
        last = sum((n - 1) * s for n, s in zip(p.shape, p.strides, strict=True))
        out += [(a, a + (last + 1) * size) for a in p.addresses]
    return out


def _inside(rows: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    """Whether each (address, length) row lies inside one of ``spans``."""
    return all(any(s <= a and a + n <= e for s, e in spans) for a, n in rows.tolist())


def _refused(error: PeerDescriptionError) -> None:
    message = str(error)
    assert type(error) is PeerDescriptionError
    assert "description" in message, f"the refusal names no field: {message}"
    assert len(message) < 4000, "a refusal quotes a peer's value whole"


def _maps(seed: Seed, d: RegistrationDescription) -> list[tuple[Any, int, int]]:
    """Each block map a local kernel group makes with the description's group of the same
    index, in both directions (refusals skipped): (map, group, the description's column
    of its runs)."""
    out: list[tuple[Any, int, int]] = []
    shard = seed.shard if d.shard is not None else None
    for gi, local in enumerate(seed.here.kernel_groups):
        if gi >= len(d.groups):
            break
        there = d.group(gi)
        for column, (a, b, sa, sb) in enumerate([(local, there, shard, None), (there, local, None, shard)]):
            try:
                m = block_map(a, b, *seed.blocks, src_shard=sa, dst_shard=sb)
            except KVLayoutError:
                continue
            out.append((m, gi, 1 - column))
    return out


def _check_nixl(seed: Seed, d: RegistrationDescription, m: Any, column: int) -> nx.Prepped | None:
    """A map to (or from) the description, posted through the stand-in: refused before
    anything is posted where a descriptor leaves what the peer registered. The lists
    prepared (here's with its staging buffer), or None where they were refused."""
    agent = seed.agent
    remote = np.asarray(m.runs[:, [column, 2]])
    lies = not agent.inside(np.c_[remote, np.zeros(len(remote), U64)])
    posted = len(agent.posted)
    try:
        xfer = nx.transfer(agent, PEER, m, strategy="direct")
    except nx.RefusedDescriptorError as exc:
        assert lies, f"an honest request was refused: {exc}"
        assert "refused before posting" in str(exc)
    else:
        assert not lies, "a request outside the peer's registered memory was posted"
        xfer.release()
    assert not lies or len(agent.posted) == posted, "posted before the refusal"
    # the prepped form: the described tensors are checked at the handshake
    spans = _described_spans(d)
    described_lies = not agent.inside(np.c_[spans, np.zeros(len(spans), U64)])
    try:
        prepped = nx.prep_lists(agent, PEER, seed.here, d, 1, staging=seed.staging)
    except nx.RefusedDescriptorError as exc:
        assert described_lies, f"an honest description was refused: {exc}"
        assert "described tensor" in str(exc)
        return None
    except TransferError as exc:  # more units than NIXL's int32 indices reach
        assert "int32" in str(exc)
        return None
    assert not described_lies, "lists over memory the peer never registered were prepared"
    rows = np.c_[remote, np.zeros(len(remote), U64)]
    if remote[:, 1].sum() > 1 << 20:
        return prepped
    idx = prepped.remote.indices(rows, "remote descriptor")
    first = np.searchsorted(prepped.remote.first, idx, side="right") - 1
    got = prepped.remote.starts[first] + (idx - prepped.remote.first[first]).astype(U64)
    want = np.concatenate([np.arange(a, a + n, dtype=U64) for a, n in remote.tolist()])
    np.testing.assert_array_equal(got, want)
    return prepped


def _side_of(m: Any, column: int) -> Any:
    return m.src if column == 0 else m.dst


def _check_staged(seed: Seed, m: Any, column: int, prepped: nx.Prepped | None) -> None:
    """The map staged through here's staging buffer (its remote stretches posted as
    lists, and as indices into ``prepped`` where given): refused before anything is
    posted where a stretch leaves what the peer registered; else every posted stretch
    inside what it registered and described, every local one inside the staging buffer,
    and the request done (a READ's scatter included)."""
    agent, staging = seed.agent, seed.staging
    if int(m.runs[:, 2].sum(dtype=U64)) > staging.nbytes:
        return
    p = nx.plan(m, strategy="staged", staging=staging, stages=1)  # what the request would post
    lies = not agent.inside(p.remote)
    posted = len(agent.posted)
    try:
        xfer = nx.transfer(agent, PEER, m, strategy="staged", staging=staging, prepped=prepped, stages=1)
    except nx.RefusedDescriptorError as exc:
        assert lies, f"an honest staged request was refused: {exc}"
        assert "refused before posting" in str(exc), str(exc)
        assert len(agent.posted) == posted, "posted before the refusal"
        assert not staging.busy, "a refused request kept the staging buffer"
        return
    assert not lies, "a staged request outside the peer's registered memory was posted"
    np.testing.assert_array_equal(xfer.plan.remote, p.remote)
    assert _inside(xfer.plan.remote[:, :2], _spans_of(_side_of(m, column)))
    assert _inside(xfer.plan.local[:, :2], [(staging.address, staging.address + staging.nbytes)])
    handle = agent.posted[-1]
    if prepped is not None:  # the indices NIXL is handed read back as memory the peer registered
        units = handle[1]
        assert agent.inside(units), "prepped indices reach memory the peer never registered"
        assert int(units[:, 1].sum(dtype=U64)) == int(p.remote[:, 1].sum(dtype=U64))
    xfer.wait(timeout=10)
    assert not staging.busy


def _spans_of(side: Any) -> list[tuple[int, int]]:
    return [(a, a + n) for a, n in np.asarray(side.tensor_spans).tolist() if n]


def _check_peer_staged(seed: Seed, m: Any, column: int, d: RegistrationDescription) -> None:
    """The map posted into the peer's staging buffer: refused before anything is posted
    where a described tensor overlaps that buffer, of any group of ``d`` (the peer's
    cache and its staging buffer are apart, and NIXL holds every group registered);
    else every remote descriptor inside the buffer, every local one inside the
    registration here."""
    agent, there = seed.agent, seed.peer_staging
    num_bytes = int(m.runs[:, 2].sum(dtype=U64))
    if num_bytes > there.nbytes:
        return
    end = there.address + there.nbytes
    on_cache = any(a < end and there.address < a + n for a, n in _described_spans(d).tolist() if n)
    posted = len(agent.posted)
    try:
        xfer = nx.transfer(agent, PEER, m, strategy="peer-staged", peer_staging=there)
    except nx.RefusedDescriptorError as exc:
        assert on_cache, f"an honest peer-staged request was refused: {exc}"
        assert "PeerStaging" in str(exc) and "refused before posting" in str(exc), str(exc)
        assert len(agent.posted) == posted, "posted before the refusal"
        return
    assert not on_cache, "a peer-staged request into a staging buffer on the peer's cache was posted"
    assert agent.inside(xfer.plan.remote)
    assert _inside(xfer.plan.remote[:, :2], [(there.address, there.address + num_bytes)])
    assert _inside(xfer.plan.local[:, :2], _spans_of(_side_of(m, 1 - column)))
    xfer.wait(timeout=10)


def _described_spans(d: RegistrationDescription) -> np.ndarray:
    return np.array([(a, e - a) for gi in range(len(d.groups)) for a, e in _spans(d, gi)], dtype=U64).reshape(
        -1, 2
    )


def check(seed: Seed, root: Any, splice: str | None) -> None:
    try:
        d = RegistrationDescription.from_json(_text(root, splice))
    except PeerDescriptionError as exc:
        _refused(exc)
        return
    assert RegistrationDescription.from_json(d.to_json()) == d
    for m, gi, column in _maps(seed, d):
        spans = _spans(d, gi)
        assert _inside(np.asarray(m.runs[:, [column, 2]]), spans), "a run leaves the described tensors"
        prepped = _check_nixl(seed, d, m, column)
        _check_staged(seed, m, column, None)
        if prepped is not None and int(m.runs[:, 2].sum(dtype=U64)) <= 1 << 20:  # indices a byte each
            _check_staged(seed, m, column, prepped)
        _check_peer_staged(seed, m, column, d)


@pytest.mark.parametrize("name", ["vllm NHD", "vllm HND", "vllm MLA", "sglang", "trtllm", "hybrid"])
def test_a_lying_description_is_refused_or_every_run_stays_inside_it(name: str) -> None:
    seed = seeds()[name]

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(mutant(seed.data))
    def run(case: tuple[Any, str | None]) -> None:
        check(seed, *case)

    run()


@st.composite
def landed(draw: st.DrawFn, seed: Seed) -> Any:
    """The seed's description with one tensor moved onto, or to end inside, the staging
    buffer the peer names (``PeerStaging``), in any group: a hybrid's map of one group
    then meets a buffer on the other's KV, which NIXL holds registered."""
    root: Any = json.loads(seed.text)
    where = [p for p in _paths(root) if len(p) >= 2 and p[-2] == "addresses"]
    path = draw(st.sampled_from(where))
    d = RegistrationDescription.from_json(seed.text)
    g = int(path[1])  # ("groups", g, "planes", ...)
    span = _spans(d, g)[[p for p in where if p[1] == g].index(path)]
    at = seed.landing.data_ptr()
    root = _set(
        root, path, draw(st.sampled_from([at, at + 64, at + STAGING - 64, at + 64 - (span[1] - span[0])]))
    )
    return root


@pytest.mark.parametrize("name", ["hybrid", "vllm NHD"])
def test_a_tensor_described_on_the_peer_s_staging_buffer_refuses_every_group_s_peer_staged_request(
    name: str,
) -> None:
    """A description that puts one tensor, of any group, on the staging buffer the peer
    names is a lie to every request peer-staged into that buffer, whichever group its map
    moves: ``check`` posts none of them, and the rest of each map as ever."""
    seed = seeds()[name]

    @settings(
        max_examples=12 if name == "hybrid" else 6,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(landed(seed))
    def run(root: Any) -> None:
        check(seed, root, None)

    run()


def test_the_seeds_are_accepted_and_mapped() -> None:
    """Unmutated, every seed is read back, mapped both ways in each group, prepared, and
    each map posted four ways: direct, staged (as lists and as prepped indices) and
    peer-staged."""
    for seed in seeds().values():
        d = RegistrationDescription.from_json(seed.text)
        maps = _maps(seed, d)
        assert len(maps) == 2 * len(seed.here.kernel_groups), seed.name
        assert all(int(m.runs[:, 2].sum(dtype=U64)) <= STAGING for m, _, _ in maps), seed.name
        posted = len(seed.agent.posted)
        check(seed, seed.data, None)
        small = sum(int(m.runs[:, 2].sum(dtype=U64)) <= 1 << 20 for m, _, _ in maps)
        assert len(seed.agent.posted) == posted + 3 * len(maps) + small, seed.name


def _named(d: RegistrationDescription, lie: nx.PeerStaging) -> str:
    """What the refusal of ``lie`` names: the first described tensor it overlaps, in the
    description's order (group by group; a vLLM hybrid's groups share their tensors, so
    that may be another group's than the one the lie was put on), and its group."""
    end = lie.address + lie.nbytes
    firsts = [(g, a, e) for g in range(len(d.groups)) for a, e in _spans(d, g)]
    k, (g, a, e) = next((k, t) for k, t in enumerate(firsts) if t[1] < end and lie.address < t[2])
    return rf"overlaps tensor {k} \({a:#x}, {e - a} bytes, kernel group {g} \(engine group "


@pytest.mark.parametrize("name", ["vllm NHD", "vllm HND", "vllm MLA", "sglang", "trtllm", "hybrid"])
def test_a_peer_staging_buffer_that_lies_is_refused_before_anything_is_posted(name: str) -> None:
    """The staging buffer a peer names at the handshake (``PeerStaging``), where a
    peer-staged request lands or is read: on a tensor it described, of the map's group or
    (a hybrid) another's, named (a WRITE would land on its KV, a READ take its KV for
    staged bytes), past what it registered, nowhere
    a process can own, or too small, it is refused, naming the buffer, before anything
    is posted; the honest one then takes the same request."""
    seed = seeds()[name]
    d = RegistrationDescription.from_json(seed.text)
    honest = seed.peer_staging
    for m, gi, column in _maps(seed, d):
        num_bytes = int(m.runs[:, 2].sum(dtype=U64))
        described = _spans_of(_side_of(m, column))
        every = _described_spans(d).tolist()  # every group's tensors
        a, e = described[-1]
        end = honest.address + honest.nbytes
        lies: list[tuple[nx.PeerStaging, type[Exception], str]] = [
            (honest._replace(address=a), nx.RefusedDescriptorError, r"overlaps tensor \d+ \(0x"),
            (honest._replace(address=e - 64), nx.RefusedDescriptorError, r"overlaps tensor \d+ \(0x"),
            (  # its bytes half past the end of what the peer registered (or on a tensor there)
                past := nx.PeerStaging(end - num_bytes // 2 // 64 * 64, num_bytes),
                nx.RefusedDescriptorError,
                r"overlaps tensor"
                if any(x < past.address + past.nbytes and past.address < x + n for x, n in every if n)
                else r"inside the staging buffer peer 'kvl-hostile-peer' named \(PeerStaging\) but not "
                "inside memory it registered with NIXL",
            ),
            (
                honest._replace(address=1 << 50),
                nx.RefusedDescriptorError,
                r"\(PeerStaging\) but not inside memory it registered with NIXL",
            ),
            (honest._replace(address=2**64 - 4096), TransferError, "is not memory a process can own"),
            (honest._replace(nbytes=num_bytes - 1), TransferError, "needs a peer staging buffer"),
        ]
        for other in range(len(d.groups)):  # a hybrid's other group's KV: NIXL holds it registered
            for a, e in _spans(d, other)[:2] if other != gi else ():
                for lie in (honest._replace(address=a + 64, nbytes=64), honest._replace(address=e - 64)):
                    lies.append((lie, nx.RefusedDescriptorError, _named(d, lie)))
        for lie, kind, why in lies:
            posted = len(seed.agent.posted)
            with pytest.raises(kind, match=why) as refused:
                nx.transfer(seed.agent, PEER, m, strategy="peer-staged", peer_staging=lie)
            assert "refused before posting" in str(refused.value) or kind is TransferError
            assert len(seed.agent.posted) == posted, f"posted before refusing {lie}"
        xfer = nx.transfer(seed.agent, PEER, m, strategy="peer-staged", peer_staging=honest)
        assert _inside(xfer.plan.remote[:, :2], [(honest.address, honest.address + num_bytes)])
        xfer.wait(timeout=10)


@pytest.mark.parametrize("name", ["vllm NHD", "sglang", "hybrid"])
@pytest.mark.parametrize("strategy", ["direct", "staged", "peer-staged"])
def test_blocks_beyond_the_peer_s_pool_are_refused_before_anything_is_posted(
    name: str, strategy: nx.Strategy
) -> None:
    """A request naming a block the peer's description does not hold is refused where
    its map is made, naming the block, whichever strategy would post it."""
    seed = seeds()[name]
    d = RegistrationDescription.from_json(seed.text)
    there, here = d.group(0), seed.here.kernel_groups[0]
    g = d.groups[0]
    blocks = size_of(g.layout, g.planes[0].sizes_dict(), Role.BLOCK)
    assert blocks is not None
    posted = len(seed.agent.posted)
    for past in (blocks, 1 << 20):  # the first block past the pool, and one far past it
        with pytest.raises(KVLayoutError, match=rf"\b{past}\b") as refused:
            m = block_map(here, there, [1, 3], [2, past], src_shard=seed.shard)
            nx.transfer(
                seed.agent, PEER, m, strategy=strategy, staging=seed.staging, peer_staging=seed.peer_staging
            )
        assert not isinstance(refused.value, nx.NixlError), "refused by the posting, not by the map"
    assert len(seed.agent.posted) == posted
