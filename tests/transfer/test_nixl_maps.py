"""Real block maps through real NIXL between two processes, byte-exact by the offset oracle.

This process and a peer (``kvlayout.testing.nixl_peer``) each hold a real kvlayout cache;
the peer's is built there from a small :class:`CacheSpec` sent over the pipe and comes
back as its ``describe(shard=...).to_json()`` (the handshake). Each case plans the map
with ``block_map(live registration, RegistrationDescription)``, moves it with both
strategies (staged also as a pipeline of stages) in both descriptor forms (the peer's
cache refilled between), and checks the
destination against the offset oracle of ``test_block_maps`` (every request byte where
the layouts put it, every other byte unchanged), computed on twins of both caches built
here from the same seeds. A description that lies is refused before anything is posted.

Bounded: caches of tens of KiB, one peer for the module, every answer and wait with a
deadline, and a hard limit on the module (faulthandler).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.shards import Shard
from kvlayout.testing.nixl_peer import (
    AgentPair,
    CacheSpec,
    Paced,
    agent_pair,
    build_cache,
    cache_sizes,
    refill,
)
from kvlayout.transfer import (
    BlockMap,
    PeerDescriptionError,
    RegistrationDescription,
    TransferError,
    block_map,
)
from kvlayout.transfer import nixl as nx
from tests.transfer.registrations import Registration
from tests.transfer.test_block_maps import Side, canonical, cp_holds, first_alias

MODULE_LIMIT_S = 240
HEADS = 4  # the model's KV heads
ROW = 8  # elements of a head's row (bf16: 16 bytes)
TOKENS = 40
NHD, HND = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS  # vLLM flash-attn and its HND twin
SGLANG = F.TWO_X_NL_X_NBBS_NH_HS  # SGLang's MHA pool: per-layer K and V, token-major pages
MLA = F.NL_X_NB_BS_HS  # vLLM's MLA latents
LHBNC = F.NL_X_NH_NB_BS_CS  # vLLM 0.33's heads outside blocks (ROCm attention's first choice)


Pair = AgentPair


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        with agent_pair("kvl-maps", [4096], 1 << 20) as p:
            yield p
    finally:
        faulthandler.cancel_dump_traceback_later()


def handshake(pair: Pair, s: CacheSpec) -> str:
    """The peer builds and describes ``s``; its new NIXL metadata is loaded here."""
    text = pair.peer.cache(s)
    pair.agent.remove_remote_agent(pair.name)
    assert pair.agent.add_remote_agent(pair.peer.metadata) == pair.name.encode()
    return text


def spec(
    fmt: F, tp: tuple[int, ...], block_size: int, seed: int, shares: tuple[tuple[int, int], ...] = ()
) -> CacheSpec:
    """``tp``: (TP rank, TP size), and (CP rank, CP size, interleave) after them under
    context parallelism."""
    rank, size, *cp = tp
    heads = 1 if fmt is MLA else len(Shard(rank, size, HEADS).heads)
    return CacheSpec(fmt.name, 3 if shares else 2, 8, block_size, heads, 4 * ROW if fmt is MLA else ROW,
                     shard=(rank, size, HEADS, *cp), seed=seed, shares=shares)  # fmt: skip


def twin(s: CacheSpec) -> Side:
    """The oracle's view of a spec's cache, built in this process."""
    reg, leaves = build_cache(s)
    fmt = F[s.format]
    sizes = cache_sizes(s)
    bases = [t.view(-1).view(torch.uint8) for t in leaves]
    shard = Shard(*s.shard) if s.shard else Shard(0, 1, 1)
    return Side(fmt, sizes, Registration(reg, leaves, bases), reg, shard, s.block_size, 0)


End = tuple[F, tuple[int, int], int]  # a side: format, (TP rank, TP size), block size


@dataclass
class DeviceRequest:
    """A request between two caches built from seeds on one device, and what the offset
    oracle needs: the device tests' common start."""

    specs: tuple[CacheSpec, CacheSpec]
    src: Any  # the registrations
    dst: Any
    src_leaves: list[torch.Tensor]
    dst_leaves: list[torch.Tensor]
    src_ids: list[int]
    dst_ids: list[int]
    kw: dict[str, Any]  # block_map's num_tokens, shards and block sizes

    def want(self) -> list[np.ndarray]:
        """The destination's tensors after the request moved, by the offset oracle."""
        return expected(twin(self.specs[0]), twin(self.specs[1]), self.src_ids, self.dst_ids)

    def got(self) -> list[np.ndarray]:
        return [t.contiguous().view(-1).view(torch.uint8).cpu().numpy() for t in self.dst_leaves]


def device_request(ends: tuple[End, End], device: str, seed: int) -> DeviceRequest:
    (sf, s_tp, s_bs), (df, d_tp, d_bs) = ends
    s_spec, d_spec = spec(sf, s_tp, s_bs, seed=3), spec(df, d_tp, d_bs, seed=4)
    (src, src_leaves), (dst, dst_leaves) = build_cache(s_spec, device), build_cache(d_spec, device)
    rng = np.random.default_rng(seed)
    src_ids = [int(b) for b in rng.permutation(s_spec.blocks)[: -(-TOKENS // s_bs)]]
    dst_ids = [int(b) for b in rng.permutation(d_spec.blocks)[: -(-TOKENS // d_bs)]]
    kw = {"num_tokens": TOKENS, "src_shard": s_spec.the_shard, "dst_shard": d_spec.the_shard,
          "src_block_size": s_bs, "dst_block_size": d_bs}  # fmt: skip
    return DeviceRequest((s_spec, d_spec), src, dst, src_leaves, dst_leaves, src_ids, dst_ids, kw)


def expected(src: Side, dst: Side, src_ids: list[int], dst_ids: list[int]) -> list[np.ndarray]:
    """The destination's tensors after the request moved, by the offset oracle."""
    if src.layout.symbol_of(Role.HEAD):
        a, b = src.shard.heads, dst.shard.heads
        heads = range(max(a.start, b.start), max(a.start, b.start, min(a.stop, b.stop)))
    else:
        heads = range(1)
    p = np.arange(TOKENS)
    held = p[cp_holds(src.shard, p) & cp_holds(dst.shard, p)]  # context parallelism: the tokens both hold
    s_ptr, s_byte = canonical(src, TOKENS, src_ids, heads, held=held)
    d_ptr, d_byte = canonical(dst, TOKENS, dst_ids, heads, held=held)
    d_first = first_alias(dst.reg.bases)  # a shared layer's bytes are its target's, written once
    once = d_first[d_ptr] == d_ptr
    s_ptr, s_byte, d_ptr, d_byte = s_ptr[once], s_byte[once], d_ptr[once], d_byte[once]
    out = [b.numpy().copy() for b in dst.reg.bases]
    src_bytes = [b.numpy() for b in src.reg.bases]
    values = np.empty(len(s_byte), dtype=np.uint8)
    for t in np.unique(s_ptr):
        values[s_ptr == t] = src_bytes[t][s_byte[s_ptr == t]]
    for t in np.unique(d_ptr):
        out[t][d_byte[d_ptr == t]] = values[d_ptr == t]
    return [out[t] for t in d_first]


def unit_of(m: BlockMap, p: nx.Plan) -> int:
    """The largest unit every descriptor of both strategies is whole units of, at
    unit-aligned offsets in its tensor (or the staging buffer): the prepped lists' unit."""
    values = [m.runs[:, 2]]
    for side, col in ((m.src, 0), (m.dst, 1)):
        spans = side.tensor_spans
        k = np.searchsorted(spans[:, 0], m.runs[:, col], side="right") - 1
        values.append(m.runs[:, col] - spans[k, 0])
    values += [p.local[:, 1], p.local[:, 0] - np.uint64(p.local[0, 0])]  # staged stretches
    return int(np.gcd.reduce(np.concatenate(values).astype(np.int64)))


def ids(rng: np.random.Generator, s: CacheSpec) -> list[int]:
    """A request's block ids: under context parallelism each is ``cp_size`` blocks of the request."""
    cp = s.shard[4] if s.shard is not None and len(s.shard) > 3 else 1
    return [int(b) for b in rng.permutation(s.blocks)[: -(-TOKENS // (s.block_size * cp))]]


def leaf_bytes(leaves: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.view(-1).view(torch.uint8).numpy() for t in leaves]


# (name, source format, TP rank/size, block size, destination format, rank/size, block size)
CASES = [
    ("same layout", NHD, (0, 1), 16, NHD, (0, 1), 16),
    ("TP 1->2 NHD", NHD, (0, 1), 16, NHD, (1, 2), 16),
    ("TP 2->1 NHD", NHD, (1, 2), 16, NHD, (0, 1), 16),
    ("TP 2->4 NHD", NHD, (0, 2), 16, NHD, (1, 4), 16),
    ("TP 1->2 HND", HND, (0, 1), 16, HND, (1, 2), 16),
    ("TP 2->1 HND", HND, (1, 2), 16, HND, (0, 1), 16),
    ("TP 2->4 HND", HND, (1, 2), 16, HND, (2, 4), 16),
    ("NHD->HND", NHD, (0, 1), 16, HND, (0, 1), 16),
    ("block 16->32", NHD, (0, 1), 16, NHD, (0, 1), 32),
    ("block 64->16", HND, (0, 1), 64, NHD, (0, 1), 16),
    ("MLA TP 1->2", MLA, (0, 1), 16, MLA, (1, 2), 16),
    ("vLLM->SGLang TP 2->4", NHD, (1, 2), 16, SGLANG, (3, 4), 16),
    ("KV sharing, NHD->HND TP 2->1", NHD, (1, 2), 16, HND, (0, 1), 16),
    ("LHBNC->NHD TP 1->2", LHBNC, (0, 1), 16, NHD, (1, 2), 16),
    # decode context parallelism (vLLM's DCP): a rank holds every cp_size-th run of interleave tokens
    ("MLA into DCP 2", MLA, (0, 1), 16, MLA, (1, 2, 1, 2, 1), 8),
    ("MLA DCP 2->4 block-interleaved", MLA, (1, 2, 1, 2, 8), 8, MLA, (3, 4, 3, 4, 4), 4),
    ("NHD DCP 2 into HND", NHD, (0, 2, 0, 2, 4), 16, HND, (0, 1), 16),
    ("NHD into HND DCP 2", NHD, (0, 1), 16, HND, (1, 2, 1, 2, 2), 8),  # the rank's whole blocks
]
# Cases whose caches have a layer registered with an earlier layer's tensor (both sides).
SHARES = {"KV sharing, NHD->HND TP 2->1": ((2, 0),)}


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize(("name", "sf", "stp", "sbs", "df", "dtp", "dbs"), CASES, ids=[c[0] for c in CASES])
def test_real_block_maps_move_byte_exactly_through_nixl(
    pair: Pair,
    op: str,
    name: str,
    sf: F,
    stp: tuple[int, int],
    sbs: int,
    df: F,
    dtp: tuple[int, int],
    dbs: int,
) -> None:
    """Both strategies in both forms; ``op`` says which side is here (WRITE: the source)."""
    shares = SHARES.get(name, ())
    s_spec, d_spec = spec(sf, stp, sbs, seed=11, shares=shares), spec(df, dtp, dbs, seed=12, shares=shares)
    local_spec, remote_spec = (s_spec, d_spec) if op == "WRITE" else (d_spec, s_spec)
    desc = RegistrationDescription.from_json(handshake(pair, remote_spec))
    local, local_leaves = build_cache(local_spec)
    src_side, dst_side = twin(s_spec), twin(d_spec)
    rng = np.random.default_rng(len(name))
    src_ids, dst_ids = ids(rng, s_spec), ids(rng, d_spec)
    kw: dict[str, Any] = {"num_tokens": TOKENS, "src_block_size": sbs, "dst_block_size": dbs}
    if op == "WRITE":
        m = block_map(local, desc, src_ids, dst_ids, src_shard=s_spec.the_shard, **kw)
    else:
        m = block_map(desc, local, src_ids, dst_ids, dst_shard=d_spec.the_shard, **kw)
    want = expected(src_side, dst_side, src_ids, dst_ids)
    assert m.num_bytes > 0
    here, there = (m.src, m.dst) if op == "WRITE" else (m.dst, m.src)
    staged = nx.plan(m, strategy="staged", staging=pair.staging)
    unit = unit_of(m, staged)
    with nx.register(pair.agent, local):
        prepped = nx.prep_lists(pair.agent, pair.name, here, there, unit, staging=pair.staging)
        runs: list[tuple[nx.Strategy, int]] = [("direct", 1), ("staged", 1), ("staged", 3)]
        for strategy, stages in runs:  # 3: a pipeline
            for form in ("list", "prepped"):
                xfer = nx.transfer(
                    pair.agent, pair.name, m, strategy=strategy, staging=pair.staging,
                    prepped=prepped if form == "prepped" else None, notif=name.encode(), stages=stages,
                )  # fmt: skip
                assert len(xfer.handles) == min(stages, staged.num_descriptors if strategy == "staged" else 1)
                result = xfer.wait(timeout=30)
                assert (result.strategy, result.num_bytes) == (strategy, m.num_bytes)
                got = pair.peer.cache_bytes() if op == "WRITE" else leaf_bytes(local_leaves)
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert np.array_equal(g, w), f"{name} {op} {strategy}/{stages} {form}: tensor {i} differs"
                if op == "WRITE":
                    pair.peer.refill_cache()
                else:
                    refill(local_spec, local_leaves)
    assert pair.peer.notifs(expect=6) == [name.encode()] * 6  # one per request, pipelines too


def lying(text: str, edit: Any) -> str:
    data = json.loads(text)
    edit(data["groups"][0]["planes"][0])
    return json.dumps(data)


def shift_addresses(plane: dict[str, Any]) -> None:
    plane["addresses"] = [a + (1 << 40) for a in plane["addresses"]]  # memory it never registered


def more_blocks(plane: dict[str, Any]) -> None:
    plane["sizes"]["NB"] *= 2  # the shape and strides still say 8 blocks


@pytest.mark.parametrize("form", ["list", "prepped"])
def test_a_description_that_lies_is_refused_before_anything_is_posted(pair: Pair, form: str) -> None:
    s_spec, d_spec = spec(NHD, (0, 1), 16, seed=21), spec(HND, (1, 2), 16, seed=22)
    truth = handshake(pair, d_spec)
    with pytest.raises(
        PeerDescriptionError, match=r"planes\[0\]\.shape is \[2, 8, 2, 16, 8\]; .* is \[2, 16, 2, 16, 8\]"
    ):
        RegistrationDescription.from_json(lying(truth, more_blocks))
    desc = RegistrationDescription.from_json(lying(truth, shift_addresses))  # self-consistent, but false
    local, _ = build_cache(s_spec)
    m = block_map(local, desc, [3, 1, 5], [0, 6, 2], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    before = pair.peer.cache_bytes()
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    refused = pytest.raises(nx.RefusedDescriptorError, match="not inside memory it registered with NIXL")
    with nx.register(pair.agent, local), refused:
        if form == "prepped":
            nx.prep_lists(pair.agent, pair.name, m.src, m.dst, 16)
        else:
            nx.transfer(pair.agent, pair.name, m, strategy="direct", notif=b"lie")
    assert all(np.array_equal(a, b) for a, b in zip(pair.peer.cache_bytes(), before, strict=True))
    assert pair.peer.notifs(expect=0, wait=0.2) == []


def test_a_twin_is_the_peer_cache_byte_for_byte(pair: Pair) -> None:
    """The oracle's premise: a spec builds the same bytes in both processes."""
    s = replace(spec(SGLANG, (0, 2), 16, seed=5), blocks=2)
    handshake(pair, s)
    side = twin(s)
    assert all(
        np.array_equal(a, b.numpy()) for a, b in zip(pair.peer.cache_bytes(), side.reg.bases, strict=True)
    )


def staged_peer(pair: Pair, s: CacheSpec) -> tuple[str, nx.PeerStaging]:
    """The peer builds and describes ``s`` and registers a staging buffer; its new NIXL
    metadata is loaded here."""
    text = pair.peer.cache(s)
    staging = pair.peer.staging(1 << 16)
    pair.agent.remove_remote_agent(pair.name)
    pair.agent.add_remote_agent(pair.peer.metadata)
    return text, staging


@dataclass
class PeerStaged:
    """One request of a case between a cache here and the peer's (which has a staging
    buffer): the poster here holds the source (WRITE) or the destination (READ)."""

    name: str
    here: Any  # the bound registration here
    leaves: list[torch.Tensor]
    staging: nx.PeerStaging  # the peer's
    src_ids: list[int]
    dst_ids: list[int]
    kw: dict[str, Any]  # block_map's keywords but the shards
    m: BlockMap
    want: list[np.ndarray]  # the destination's tensors after the request, by the oracle
    description: str  # this cache's, as the peer builds its own map from it


def peer_staged(pair: Pair, case: tuple[Any, ...], seed: int, op: str) -> PeerStaged:
    name, sf, stp, sbs, df, dtp, dbs = case
    s_spec, d_spec = spec(sf, stp, sbs, seed=seed), spec(df, dtp, dbs, seed=seed + 1)
    here_spec, there_spec = (s_spec, d_spec) if op == "WRITE" else (d_spec, s_spec)
    text, staging = staged_peer(pair, there_spec)
    there = RegistrationDescription.from_json(text)
    here, leaves = build_cache(here_spec)
    rng = np.random.default_rng(len(name))
    src_ids, dst_ids = ids(rng, s_spec), ids(rng, d_spec)
    kw: dict[str, Any] = {"num_tokens": TOKENS, "src_block_size": sbs, "dst_block_size": dbs}
    if op == "WRITE":
        m = block_map(here, there, src_ids, dst_ids, src_shard=s_spec.the_shard, **kw)
    else:
        m = block_map(there, here, src_ids, dst_ids, dst_shard=d_spec.the_shard, **kw)
    want = expected(twin(s_spec), twin(d_spec), src_ids, dst_ids)
    description = here.describe(shard=here_spec.the_shard, block_size=here_spec.block_size).to_json()
    return PeerStaged(name, here, leaves, staging, src_ids, dst_ids, kw, m, want, description)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_peer_staged_read_finds_what_the_peer_staged(pair: Pair, case: tuple[Any, ...]) -> None:
    """The peer gathers the request into its staging buffer laid out as the runs lie
    here; one descriptor per local stretch reads it, and the cache here then holds what
    the offset oracle says."""
    r = peer_staged(pair, case, 41, "READ")
    pair.peer.stage(r.description, r.src_ids, r.dst_ids, expect=r.m.fingerprint, **r.kw)  # its map is ours
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging)
        result = xfer.wait(timeout=30)
    assert (result.strategy, xfer.plan.op) == ("peer-staged", "READ")
    assert xfer.plan.num_descriptors <= r.m.num_runs
    for i, (g, w) in enumerate(zip(leaf_bytes(r.leaves), r.want, strict=True)):
        assert np.array_equal(g, w), f"{r.name} peer-staged READ: tensor {i} differs"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_peer_staged_write_lands_byte_exactly_once_the_peer_unstages(
    pair: Pair, case: tuple[Any, ...]
) -> None:
    """The WRITE lands in the peer's staging buffer as the runs lie here (one descriptor
    per local stretch), the peer's cache is untouched until the peer unstages, and then
    it holds what the offset oracle says."""
    r = peer_staged(pair, case, 31, "WRITE")
    before = pair.peer.cache_bytes()
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging, notif=b"in"
        )
        result = xfer.wait(timeout=30)
    assert result.strategy == "peer-staged" and xfer.plan.num_descriptors <= r.m.num_runs
    assert pair.peer.notifs(expect=1) == [b"in"]
    assert all(np.array_equal(a, b) for a, b in zip(pair.peer.cache_bytes(), before, strict=True))
    pair.peer.unstage(r.description, r.src_ids, r.dst_ids, expect=r.m.fingerprint, **r.kw)  # the other half
    for i, (g, w) in enumerate(zip(pair.peer.cache_bytes(), r.want, strict=True)):
        assert np.array_equal(g, w), f"{r.name} peer-staged: tensor {i} differs"


def test_a_peer_staging_buffer_on_the_peer_s_other_group_is_refused_naming_it(pair: Pair) -> None:
    """A hybrid peer (full and sliding-window attention: two engine groups, a kernel group
    each) names a staging buffer on the KV of the group a request's map does not move.
    NIXL holds that memory registered, so only the peer's whole description tells: the
    request is refused before anything is posted, naming the group and the tensor, in
    either direction, and the peer's KV and notifications are as they were; the honest
    buffer then plans peer-staged."""
    layers = 4
    groups = (0, 0, 1, 1)  # layers 0-1 in engine group 0, 2-3 in engine group 1
    there_spec = replace(spec(NHD, (0, 1), 16, seed=81), layers=layers, engine_groups=groups)
    here_spec = replace(there_spec, seed=82)
    text, honest = staged_peer(pair, there_spec)
    data = json.loads(text)  # the oracle reads the JSON: each group's planes' addresses, shape, strides
    assert [g["engine_group"] for g in data["groups"]] == [0, 1]
    tensors = [  # (group, its tensor, first byte, span) in the description's order
        (gi, k, a, (sum((n - 1) * st for n, st in zip(p["shape"], p["strides"], strict=True)) + 1) * 2)
        for gi, g in enumerate(data["groups"])
        for p in g["planes"]
        for k, a in enumerate(p["addresses"])
    ]
    assert len(tensors) == layers  # NHD: a tensor a layer
    there = RegistrationDescription.from_json(text)
    here, _ = build_cache(here_spec)
    assert len(here.kernel_groups) == 2
    before = pair.peer.cache_bytes()
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    with nx.register(pair.agent, here):
        for gi in (0, 1):
            write = block_map(here.kernel_groups[gi], there.group(gi), [1, 3], [2, 0])
            read = block_map(there.group(gi), here.kernel_groups[gi], [2, 0], [1, 3])
            for m in (write, read):
                others = [t for t in tensors if t[0] != gi]
                assert len(others) == 2  # the other group's two tensors, each lied on twice
                for _, _, a, span in others:
                    for lie in (nx.PeerStaging(a + 64, 64), nx.PeerStaging(a + span - 64, m.num_bytes)):
                        # the refusal names the first described tensor the lie overlaps: the one it
                        # starts in, or an earlier one the peer's allocator put right after it
                        end = lie.address + lie.nbytes
                        where = next(
                            i for i, t in enumerate(tensors) if t[2] < end and t[2] + t[3] > lie.address
                        )
                        g, k, at, n = tensors[where]
                        why = (
                            rf"^PeerStaging\({lie.address:#x}, {lie.nbytes} bytes\) overlaps tensor {where} "
                            rf"\({at:#x}, {n} bytes, kernel group {g} \(engine group {g}, layers "
                            rf"{2 * g}-{2 * g + 1}: NL_X_TWO_NB_BS_NH_HS .*\), its tensor {k}\) of the "
                            rf"{layers} tensors the peer described: .*refused before posting$"
                        )
                        for strategy in ("peer-staged", "auto"):
                            with pytest.raises(nx.RefusedDescriptorError, match=why):
                                nx.transfer(pair.agent, pair.name, m, strategy=strategy, peer_staging=lie,
                                            notif=b"lie")  # fmt: skip
                p = nx.plan(m, strategy="peer-staged", peer_staging=honest)
                assert int(p.remote[:, 0].min()) >= honest.address
    assert pair.peer.notifs(expect=0, wait=0.2) == []
    assert all(np.array_equal(a, b) for a, b in zip(pair.peer.cache_bytes(), before, strict=True))
    assert all(  # and those are the bytes the peer was built with, none written since
        np.array_equal(a, b.numpy()) for a, b in zip(before, twin(there_spec).reg.bases, strict=True)
    )


PACED = [c for c in CASES if c[0] in ("TP 1->2 NHD", "TP 2->1 NHD", "NHD->HND", "TP 2->4 HND")]


@pytest.fixture(scope="module")
def poster_name(pair: Pair) -> str:
    """This agent's name in the peer, which sends it stage notifications."""
    return pair.peer.add_remote(pair.agent.get_agent_metadata())


def test_a_poster_restarted_under_its_name_is_refused_by_name_until_the_peer_drops_the_old(
    pair: Pair, poster_name: str
) -> None:
    """NIXL takes an agent's metadata again, but refuses another agent of a loaded name
    (one restarted under it) with its raw ``nixlNotAllowedError``, naming no agent."""
    assert pair.peer.add_remote(pair.agent.get_agent_metadata()) == poster_name  # the same agent: taken
    restarted = nx.make_agent(poster_name, progress_thread=False)
    with pytest.raises(nx.NixlError, match=re.escape(
        f"agent {pair.peer.name!r} could not load the metadata (nixlNotAllowedError: "
    )) as refused:  # fmt: skip
        pair.peer.add_remote(restarted.get_agent_metadata())
    assert str(refused.value).endswith("(one restarted under its name), or it is its own; remove_remote_agent(that "
                                       "name) first")  # fmt: skip
    with pytest.raises(nx.NixlError) as garbled:  # not metadata at all: no restart to blame
        pair.peer.add_remote(b"not an agent's metadata")
    assert str(garbled.value).endswith("could not load the metadata (nixlMismatchError: NIXL_ERR_MISMATCH)")
    pair.peer.remove_remote(poster_name)
    assert pair.peer.add_remote(restarted.get_agent_metadata()) == poster_name
    pair.peer.remove_remote(poster_name)  # the module's poster again, for the paced tests
    assert pair.peer.add_remote(pair.agent.get_agent_metadata()) == poster_name


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("case", PACED, ids=[c[0] for c in PACED])
def test_a_paced_peer_staged_read_posts_each_stage_once_the_peer_announces_it(
    pair: Pair, poster_name: str, case: tuple[Any, ...], stages: int
) -> None:
    """The peer gathers stage by stage, announcing each (``stage_notif``); the READ,
    posted before the peer starts, posts stage ``i`` only once announced, and the cache
    here ends as the offset oracle says."""
    r = peer_staged(pair, case, 51, "READ")
    tag = f"read {r.name} {stages}"
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging, stages=stages,
            peer_ready=tag.encode(),
        )  # fmt: skip
        assert len(xfer.handles) == min(stages, xfer.plan.num_descriptors)
        time.sleep(0.05)
        assert not xfer.done() and xfer.posted == 0  # nothing announced, nothing posted
        pacing = Paced(stages, poster_name, tag)
        pair.peer.stage(r.description, r.src_ids, r.dst_ids, paced=pacing, expect=r.m.fingerprint, **r.kw)
        result = xfer.wait(timeout=30)
    assert result.strategy == "peer-staged"
    for i, (g, w) in enumerate(zip(leaf_bytes(r.leaves), r.want, strict=True)):
        assert np.array_equal(g, w), f"{r.name} paced peer-staged READ: tensor {i} differs"


def test_a_paced_peer_staged_read_named_by_neither_side_runs_in_the_default_pipeline(
    pair: Pair, poster_name: str
) -> None:
    """Neither the READ (``peer_ready``) nor the peer's ``stage`` names ``stages``: a
    request of 16 MiB (TP 1 -> 2 in NHD, 2,048 tokens) runs in the default pipeline, a
    stage per 4 MiB, both sides cutting it alike, and lands as a local copy of the same
    map between twins of both caches leaves it."""
    s_spec = CacheSpec(NHD.name, 4, 136, 16, HEADS, 256, shard=(0, 1, HEADS), seed=71)
    d_spec = CacheSpec(NHD.name, 4, 136, 16, HEADS // 2, 256, shard=(1, 2, HEADS), seed=72)
    kw: dict[str, Any] = {"num_tokens": 2048}
    rng = np.random.default_rng(7)
    src_ids, dst_ids = (rng.permutation(136)[:128].tolist() for _ in range(2))
    text = pair.peer.cache(s_spec)
    staging = pair.peer.staging(16 << 20)
    pair.agent.remove_remote_agent(pair.name)
    pair.agent.add_remote_agent(pair.peer.metadata)
    here, leaves = build_cache(d_spec)
    m = block_map(
        RegistrationDescription.from_json(text), here, src_ids, dst_ids, dst_shard=d_spec.the_shard, **kw
    )
    assert m.num_bytes == 16 << 20
    (src_twin, _), (dst_twin, want_leaves) = build_cache(s_spec), build_cache(d_spec)
    block_map(
        src_twin, dst_twin, src_ids, dst_ids, src_shard=s_spec.the_shard, dst_shard=d_spec.the_shard, **kw
    ).copy()
    description = here.describe(shard=d_spec.the_shard, block_size=16).to_json()
    tag = "read named by neither side"
    with nx.register(pair.agent, here):
        xfer = nx.transfer(
            pair.agent, pair.name, m, strategy="peer-staged", peer_staging=staging, peer_ready=tag.encode()
        )
        assert len(xfer.handles) == 4 == nx.auto_stages("WRITE", m.num_bytes)
        pair.peer.stage(description, src_ids, dst_ids, paced=Paced(None, poster_name, tag), **kw)
        assert xfer.wait(timeout=30).strategy == "peer-staged"
    for i, (g, w) in enumerate(zip(leaf_bytes(leaves), leaf_bytes(want_leaves), strict=True)):
        assert np.array_equal(g, w), f"tensor {i} differs"


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("case", PACED, ids=[c[0] for c in PACED])
def test_a_paced_peer_staged_write_is_scattered_stage_by_stage_as_it_lands(
    pair: Pair, poster_name: str, case: tuple[Any, ...], stages: int
) -> None:
    """The peer waits for the WRITE's stages (told before it is posted) and scatters each
    as its ``stage_notif`` lands; its cache then holds what the offset oracle says, and
    no notification is left over."""
    r = peer_staged(pair, case, 61, "WRITE")
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    tag = f"write {r.name} {stages}"
    pacing = Paced(stages, poster_name, tag, wait=False)
    pair.peer.unstage(r.description, r.src_ids, r.dst_ids, paced=pacing, expect=r.m.fingerprint, **r.kw)
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging, stages=stages,
            notif=tag.encode(),
        )  # fmt: skip
        assert len(xfer.handles) == min(stages, xfer.plan.num_descriptors)
        xfer.wait(timeout=30)
    pair.peer.answer("unstage")
    for i, (g, w) in enumerate(zip(pair.peer.cache_bytes(), r.want, strict=True)):
        assert np.array_equal(g, w), f"{r.name} paced peer-staged WRITE: tensor {i} differs"
    assert pair.peer.notifs(expect=0, wait=0.05) == []  # each stage's notification was taken


class _Notifs:
    """What take_notif reads of an agent: NIXL's notifications by sender."""

    def __init__(self, notifs: dict[str, list[bytes]]) -> None:
        self.notifs = notifs

    def update_notifs(self) -> dict[str, list[bytes]]:
        return self.notifs


def test_a_request_takes_only_its_own_notification_not_one_its_tag_begins() -> None:
    """Request ids share prefixes (``cmpl-1``, ``cmpl-12``): NIXL's check_remote_xfer_done
    matches a prefix, so a paced request would take another's notification (scattering a
    staging buffer nothing had landed in, or posting a READ of one never gathered)."""
    agent = _Notifs({"prefill": [b"req-10", b"req-1#0/2x", b"req-1#0/2"]})
    assert not nx.take_notif(cast(nx.Agent, agent), "prefill", b"req-1")
    assert not nx.take_notif(cast(nx.Agent, agent), "decode", b"req-10")  # another sender's
    assert nx.take_notif(cast(nx.Agent, agent), "prefill", b"req-1#0/2")
    assert agent.notifs == {"prefill": [b"req-10", b"req-1#0/2x"]}  # the others stay
    assert nx.take_notif(cast(nx.Agent, agent), "prefill", b"req-10")
    assert agent.notifs == {"prefill": [b"req-1#0/2x"]}


def test_a_peer_named_as_add_remote_agent_returns_it_finds_its_notifications() -> None:
    """add_remote_agent returns the peer's name as bytes, while NIXL keys its
    notifications by str: a connector that passes the name it was given must still find
    them (else a paced unstage waits out its timeout and keeps its buffer for good)."""
    agent = _Notifs({"prefill": [b"req-1#0/2", b"req-1#1/2"]})
    assert nx.take_notif(cast(nx.Agent, agent), b"prefill", b"req-1#0/2")
    assert nx.take_notif(cast(nx.Agent, agent), b"prefill", "req-1#1/2")  # a str message as its UTF-8
    assert agent.notifs == {"prefill": []}
    checked = nx.StageNotifs(cast(nx.Agent, agent), b"prefill", b"req-1")._checked()
    assert (checked.peer, checked.tag) == ("prefill", b"req-1")
    with pytest.raises(TypeError, match="peer must be an agent name"):
        nx.take_notif(cast(nx.Agent, agent), 7, b"req-1")  # type: ignore[arg-type]


def test_the_stage_count_a_peer_announced_is_read_from_its_notifications() -> None:
    """A paced request's notifications say into how many stages the peer cut it (the tag
    alone: one); another request's, or a malformed one, say nothing of it."""
    from kvlayout.transfer.nixl.peer_staging import _stages_announced

    def announced(*messages: bytes) -> int | None:
        return _stages_announced(cast(nx.Agent, _Notifs({"prefill": list(messages)})), "prefill", b"req-1")

    assert announced(b"req-1") == 1
    assert announced(b"req-10", b"req-1#3/8") == 8
    assert announced(b"req-10", b"req-1#0/2x", b"req-1#", b"req-12#0/2") is None
    assert _stages_announced(cast(nx.Agent, _Notifs({"decode": [b"req-1"]})), "prefill", b"req-1") is None


def test_a_paced_read_cut_otherwise_than_the_peer_cut_its_gather_is_refused_not_left_waiting(
    pair: Pair, poster_name: str
) -> None:
    """The READ names 3 stages, the peer gathers in 1: stage 0 of 3 would never be
    announced, so the READ fails as soon as the peer's announcement arrives, saying both
    counts, instead of waiting out its timeout."""
    r = peer_staged(pair, next(c for c in PACED if c[0] == "TP 1->2 NHD"), 111, "READ")
    tag = "read cut otherwise"
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging, stages=3,
            peer_ready=tag.encode(),
        )  # fmt: skip
        pair.peer.stage(r.description, r.src_ids, r.dst_ids, paced=Paced(1, poster_name, tag), **r.kw)
        t0 = time.perf_counter()
        with pytest.raises(
            TransferError,
            match=r"the peer-staged READ b'read cut otherwise' is cut into 3 stage\(s\) here, but its peer cut "
            r"it into 1: nothing was posted; pass the same stages on both sides, or neither",
        ):
            xfer.wait(timeout=30)
        assert time.perf_counter() - t0 < 5


def test_a_paced_unstage_cut_otherwise_than_the_write_is_refused_not_left_waiting(
    pair: Pair, poster_name: str
) -> None:
    """The peer waits for 3 stages, the WRITE goes in 1: the peer's unstage fails once the
    WRITE's notification arrives, saying both counts, and keeps its staging buffer (bytes
    of a WRITE cut otherwise may still be landing in it)."""
    r = peer_staged(pair, next(c for c in PACED if c[0] == "TP 2->1 NHD"), 121, "WRITE")
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    tag = "write cut otherwise"
    pair.peer.unstage(
        r.description, r.src_ids, r.dst_ids, paced=Paced(3, poster_name, tag, wait=False), **r.kw
    )
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging, stages=1,
            notif=tag.encode(),
        )  # fmt: skip
        xfer.wait(timeout=30)
    t0 = time.perf_counter()
    with pytest.raises(
        RuntimeError,
        match=r"failed unstage: TransferError: the peer-staged WRITE b'write cut otherwise' is cut into 3 "
        r"stage\(s\) here, but its peer cut it into 1: its stages may land yet, so Staging\(.*\) is kept for "
        r"good \(a later request needs a new Staging\); pass the same stages on both sides, or neither",
    ):
        pair.peer.answer("unstage")
    assert time.perf_counter() - t0 < 5
    pair.peer.notifs(expect=0, wait=0)  # the WRITE's notification, which the unstage left


def test_one_request_at_a_time_goes_through_a_peer_s_staging_buffer(pair: Pair) -> None:
    """Two peer-staged requests in flight through one PeerStaging would land on (or read)
    each other's bytes before the peer copied them: the second is refused, "auto" goes
    another way, and the buffer is free again once the first is done or released."""
    r = peer_staged(pair, next(c for c in CASES if c[0] == "TP 2->1 NHD"), 101, "WRITE")
    with nx.register(pair.agent, r.here):
        first = nx.prepare_transfer(pair.agent, pair.name, r.m, peer_staging=r.staging)
        assert first.plan.strategy == "peer-staged"  # what "auto" picks for this pair
        with pytest.raises(TransferError, match=r"staging buffer PeerStaging\(.*\) is in use by another"):
            nx.prepare_transfer(pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging)
        other = nx.prepare_transfer(pair.agent, pair.name, r.m, peer_staging=r.staging)
        assert other.plan.strategy != "peer-staged"
        other.release()
        first.release()
        again = nx.prepare_transfer(
            pair.agent, pair.name, r.m, strategy="peer-staged", peer_staging=r.staging
        )
        again.release()


def test_auto_holds_the_peer_s_staging_buffer_only_once_it_chose_peer_staged(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "auto" planned while holding the peer's buffer, so a peer-staged request of another
    thread was refused meanwhile even when "auto" then went direct."""
    from kvlayout.transfer.nixl import holds, posting

    r = peer_staged(pair, next(c for c in CASES if c[0] == "TP 2->1 NHD"), 103, "WRITE")
    held: list[int] = []
    planned = posting.plan  # type: ignore[attr-defined]

    def plan(*args: Any, **kw: Any) -> Any:
        held.append(len(holds._PEER_STAGINGS))  # what a concurrent peer-staged request finds
        return planned(*args, **kw)

    monkeypatch.setattr(posting, "plan", plan)
    with nx.register(pair.agent, r.here):
        direct = nx.prepare_transfer(
            pair.agent,
            pair.name,
            r.m,
            peer_staging=r.staging,
            cost=nx.CostModel(copy_bandwidth=1.0, scatter_bandwidth=1.0),  # any copy: direct
        )
        assert direct.plan.strategy != "peer-staged"
        assert held == [0]
        direct.release()


def test_a_paced_read_whose_peer_staging_is_taken_says_so(pair: Pair) -> None:
    """A READ paced by the peer (``peer_ready``) goes peer-staged or not at all: with the
    buffer in use, "auto" says that, not that the request is direct."""
    r = peer_staged(pair, next(c for c in CASES if c[0] == "TP 1->2 NHD"), 121, "READ")
    with nx.register(pair.agent, r.here):
        first = nx.prepare_transfer(pair.agent, pair.name, r.m, peer_staging=r.staging, peer_ready=b"a")
        assert first.plan.strategy == "peer-staged"
        with pytest.raises(
            TransferError, match=r"PeerStaging\(.*\) is in use by another peer-staged request"
        ):
            nx.prepare_transfer(pair.agent, pair.name, r.m, peer_staging=r.staging, peer_ready=b"b")
        with pytest.raises(TransferError, match=r"is in use by another peer-staged request"):  # b"" paces too
            nx.prepare_transfer(pair.agent, pair.name, r.m, peer_staging=r.staging, peer_ready=b"")
        first.release()


def test_the_peer_s_copy_holds_its_staging_buffer_from_prepared_until_run(pair: Pair) -> None:
    """A peer-staged request's bytes sit in the peer's staging buffer until it copies them:
    meanwhile no other request (a staged transfer, another PeerCopy) may use the buffer."""
    s_spec, d_spec = spec(NHD, (1, 2), 16, seed=111), spec(NHD, (0, 1), 16, seed=112)
    source = RegistrationDescription.from_json(handshake(pair, s_spec))
    local, _ = build_cache(d_spec)
    m = block_map(source, local, [0, 1, 2], [3, 4, 5], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    with nx.register(pair.agent, local), nx.Staging(pair.agent, 1 << 16) as staging:
        copy = nx.prepare_unstage(m, staging)
        assert staging.busy
        with pytest.raises(TransferError, match="is in use by another request"):
            nx.prepare_unstage(m, staging)
        copy.run()  # what landed, scattered: the buffer is free again
        assert not staging.busy
        dropped = nx.prepare_unstage(m, staging)
        del dropped
        gc.collect()
        assert not staging.busy  # a copy dropped unrun lets go of it (collected on the caller's thread)
        waiting = nx.prepare_unstage(m, staging, stages=2)  # the next one takes it
        failed: list[BaseException] = []

        def scatter() -> None:  # waits for stages that never land
            try:
                waiting.run(notifs=nx.StageNotifs(pair.agent, pair.name, b"never"), timeout=1.0)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=scatter)
        thread.start()
        time.sleep(0.2)
        with pytest.raises(TransferError, match=r"is running already .* a PeerCopy runs once at a time"):
            waiting.run()  # the running scatter still holds the buffer
        thread.join()
        assert isinstance(failed[0], nx.NixlTimeoutError) and staging.busy and staging.kept


def test_a_peer_s_copy_runs_once_its_buffer_holding_another_request_s_bytes_after(pair: Pair) -> None:
    """A PeerCopy is one request's half, as a prepared request posts once: its run lets go
    of the staging buffer, which the next request's bytes may fill; a second run would
    scatter those into this request's blocks (or gather over them), so it is refused."""
    s_spec, d_spec = spec(NHD, (1, 2), 16, seed=113), spec(NHD, (0, 1), 16, seed=114)
    source = RegistrationDescription.from_json(handshake(pair, s_spec))
    local, leaves = build_cache(d_spec)
    scatter = block_map(source, local, [0, 1, 2], [3, 4, 5], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    gather = block_map(local, source, [3, 4, 5], [0, 1, 2], num_tokens=TOKENS, dst_shard=s_spec.the_shard)
    with nx.register(pair.agent, local), nx.Staging(pair.agent, 1 << 16) as staging:
        for prepare, m in ((nx.prepare_unstage, scatter), (nx.prepare_stage, gather)):
            copy = prepare(m, staging)
            copy.run()
            staging.tensor.fill_(0xA5)  # the next request's bytes
            before = [t.clone() for t in leaves]
            with pytest.raises(TransferError, match=re.escape(
                f"this peer's copy through {staging!r} ran already: a PeerCopy copies one request, and its "
                "staging buffer, let go when that run returned, may hold another request's bytes now; "
                "prepare the request again"
            )):  # fmt: skip
                copy.run()
            assert all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(leaves, before, strict=True)
            )
            assert bool((staging.tensor == 0xA5).all()) and not staging.busy  # none gathered, nothing held
        copy = nx.prepare_stage(gather, staging)  # a run refused before it copied may run again
        with pytest.raises(nx.NixlError, match="holds no metadata of peer 'nobody', the poster"):
            copy.run(notifs=nx.StageNotifs(pair.agent, "nobody", b"t"))
        copy.run()
        assert not bool((staging.tensor == 0xA5).all())  # gathered


def test_stage_notifications_name_the_tag_the_stage_and_the_count() -> None:
    assert nx.stage_notif(b"req-7", 0, 1) == b"req-7"  # one stage: the request's own notification
    assert [nx.stage_notif(b"req-7", i, 3) for i in range(3)] == [b"req-7#0/3", b"req-7#1/3", b"req-7#2/3"]
    assert nx.stage_notif("req-7", 1, 3) == b"req-7#1/3"  # a str tag as its UTF-8, as notif takes one
    assert nx.stage_notif(b"req-7", np.int64(1), np.int32(3)) == b"req-7#1/3"  # type: ignore[arg-type]
    for stage, stages, message in (
        (-5, 0, "stages must be an int of at least 1, got 0"),
        (-1, 2, "stage must be an int of at least 0, got -1"),
        (2, 2, "stage 2 is not one of 2 stages (they count from 0)"),
        (True, 2, "stage must be an int of at least 0, got True"),
    ):
        with pytest.raises(TypeError) as err:
            nx.stage_notif(b"req-7", stage, stages)
        assert str(err.value) == message


def test_pacing_a_request_that_is_not_a_peer_staged_read_is_refused(pair: Pair) -> None:
    s_spec, d_spec = spec(NHD, (0, 1), 16, seed=71), spec(NHD, (1, 2), 16, seed=72)
    text, staging = staged_peer(pair, d_spec)
    local, _ = build_cache(s_spec)
    m = block_map(local, RegistrationDescription.from_json(text), [0, 1, 2], [3, 4, 5], num_tokens=TOKENS)
    with nx.register(pair.agent, local):
        for strategy in ("direct", "peer-staged"):  # a WRITE either way: this side is the source
            with pytest.raises(
                TransferError, match=f"peer_ready paces a peer-staged READ .* a {strategy} WRITE"
            ):
                nx.transfer(
                    pair.agent, pair.name, m, strategy=strategy, peer_staging=staging, peer_ready=b"r"
                )


def test_a_paced_unstage_whose_stages_never_land_times_out_and_scatters_nothing(pair: Pair) -> None:
    s_spec, d_spec = spec(NHD, (1, 2), 16, seed=81), spec(NHD, (0, 1), 16, seed=82)
    source = RegistrationDescription.from_json(handshake(pair, s_spec))
    local, leaves = build_cache(d_spec)
    before = [b.copy() for b in leaf_bytes(leaves)]
    m = block_map(source, local, [0, 1, 2], [3, 4, 5], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    staging = nx.Staging(pair.agent, pair.staging.nbytes)  # its own: a timed-out scatter keeps it
    staging.tensor.fill_(7)  # what would be scattered, were a stage taken as landed
    notifs = nx.StageNotifs(pair.agent, pair.name, b"never sent")
    with pytest.raises(
        nx.NixlTimeoutError,
        match=r"stages \[0, 1\] of 2 of the peer-staged WRITE b'never sent' .* they may land yet, so "
        r"Staging\(.*\) is kept for good",
    ):
        nx.unstage(m, staging, stages=2, notifs=notifs, timeout=0.2)
    assert all(np.array_equal(a, b) for a, b in zip(leaf_bytes(leaves), before, strict=True))
    assert staging.busy and staging.kept  # the WRITE may land yet: no later request copies through it
    with pytest.raises(
        TransferError,
        match=r"is kept for good: the peer-staged WRITE b'never sent' \(its stages may land yet\) may still "
        r"move bytes through it; a peer's copy needs a new Staging",
    ):
        nx.prepare_unstage(m, staging, stages=2)


class _NotifsFail:
    """An agent whose notification fetch fails (a dropped connection, an interrupt)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def update_notifs(self) -> dict[str, list[bytes]]:
        raise RuntimeError("the fetch failed")


def test_a_paced_unstage_whose_wait_fails_keeps_its_buffer(pair: Pair) -> None:
    """Not only a timeout: however the wait for the stages ends, the WRITE may land yet,
    so the buffer is never another request's (it was let go on any error but a timeout)."""
    s_spec, d_spec = spec(NHD, (1, 2), 16, seed=83), spec(NHD, (0, 1), 16, seed=84)
    source = RegistrationDescription.from_json(handshake(pair, s_spec))
    local, _ = build_cache(d_spec)
    m = block_map(source, local, [0, 1, 2], [3, 4, 5], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    staging = nx.Staging(pair.agent, pair.staging.nbytes)
    notifs = nx.StageNotifs(cast(nx.Agent, _NotifsFail(pair.agent)), pair.name, b"fails")
    with pytest.raises(RuntimeError, match="the fetch failed"):
        nx.unstage(m, staging, stages=2, notifs=notifs, timeout=5.0)
    assert staging.busy and staging.kept
    with pytest.raises(TransferError, match=r"is kept for good: the peer-staged WRITE b'fails'"):
        nx.prepare_unstage(m, staging, stages=2)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("stages", [1, 3])
def test_a_peer_told_of_the_request_ahead_copies_its_half_when_the_bytes_move(
    pair: Pair, poster_name: str, op: str, stages: int
) -> None:
    """The peer plans its half when told of the request (``prepare_stage`` or
    ``prepare_unstage``), before anything is posted; run later (paced in stages, or after
    the WRITE landed, or before the READ), the request lands as the offset oracle says."""
    case = next(c for c in PACED if c[0] == ("TP 2->1 NHD" if op == "WRITE" else "TP 1->2 NHD"))
    r = peer_staged(pair, case, 91, op)
    tag = f"prepared {op} {stages}"
    pair.peer.prepare(
        "unstage" if op == "WRITE" else "stage", r.description, r.src_ids, r.dst_ids, stages=stages, **r.kw
    )
    paced = Paced(stages, poster_name, tag, wait=False) if stages > 1 else None
    if op == "READ":
        pair.peer.run_prepared(paced=paced)  # gathers (paced: announcing each stage while the READ waits)
    elif paced is not None:
        pair.peer.run_prepared(paced=paced)  # waits for each stage of the WRITE
    signal: dict[str, Any] = {"peer_ready" if op == "READ" and paced else "notif": tag.encode()}
    with nx.register(pair.agent, r.here):
        xfer = nx.transfer(
            pair.agent,
            pair.name,
            r.m,
            strategy="peer-staged",
            peer_staging=r.staging,
            stages=stages,
            **signal,
        )
        assert xfer.wait(timeout=30).strategy == "peer-staged"
    if paced is not None:
        pair.peer.answer("run_prepared")
    elif op == "WRITE":
        pair.peer.run_prepared()  # scatters what landed
    got = pair.peer.cache_bytes() if op == "WRITE" else leaf_bytes(r.leaves)
    for i, (g, w) in enumerate(zip(got, r.want, strict=True)):
        assert np.array_equal(g, w), f"prepared {op} in {stages}: tensor {i} differs"
    pair.peer.notifs(expect=0, wait=0)  # the one-stage WRITE's notification, unpaced


def test_running_a_request_the_peer_was_not_told_of_is_refused(pair: Pair) -> None:
    with pytest.raises(RuntimeError, match="failed run_prepared: ValueError: no request was prepared"):
        pair.peer.run_prepared()


def test_an_empty_map_posts_nothing_and_still_sends_its_notif(pair: Pair) -> None:
    """A TP rank pair with no heads in common gets an empty map ("nothing to post"): in
    every strategy and form it is a transfer of no bytes, done at once, whose notif still
    reaches the peer. It raised ZeroDivisionError (auto, staged, plan), IndexError
    (direct, peer-staged) or NIXL_ERR_INVALID_PARAM (prepped) from inside."""
    s_spec, d_spec = spec(NHD, (0, 2), 16, seed=61), spec(NHD, (1, 2), 16, seed=62)
    text, at_peer = staged_peer(pair, d_spec)
    local, _ = build_cache(s_spec)
    m = block_map(local, RegistrationDescription.from_json(text), [0, 1, 2], [3, 4, 5], num_tokens=TOKENS,
                  src_shard=s_spec.the_shard)  # fmt: skip
    assert (m.kind, m.num_runs) == ("empty", 0)
    assert (nx.plan(m, staging=pair.staging).num_descriptors, nx.estimate(m).num_bytes) == (0, 0)
    before = pair.peer.cache_bytes()
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    with nx.register(pair.agent, local):
        lists = nx.prep_lists(pair.agent, pair.name, m.src, m.dst, 16)
        for strategy, prepped in [("auto", None), ("direct", None), ("staged", None), ("peer-staged", None),
                                  ("direct", lists)]:  # fmt: skip
            xfer = nx.transfer(
                pair.agent, pair.name, m, strategy=strategy, staging=pair.staging, peer_staging=at_peer,  # type: ignore[arg-type]
                prepped=prepped, notif=strategy.encode(),
            )  # fmt: skip
            assert (xfer.handles, pair.staging.busy) == ([], False)
            result = xfer.wait(timeout=5)
            assert (result.num_bytes, result.descriptors) == (0, 0)
            assert result.strategy == ("direct" if strategy == "auto" else strategy)
        with pytest.raises(nx.NixlError, match="holds no metadata of peer 'kvl-nobody'"):
            nx.transfer(pair.agent, "kvl-nobody", m, notif=b"lost")
    assert all(np.array_equal(a, b) for a, b in zip(pair.peer.cache_bytes(), before, strict=True))
    # This agent has no progress thread: its notifs go out as it is next driven, by a transfer here.
    ours, _ = build_cache(spec(NHD, (1, 2), 16, seed=65))
    with nx.register(pair.agent, ours):
        whole = block_map(ours, RegistrationDescription.from_json(text), [0], [6], num_tokens=16,
                          src_shard=Shard(1, 2, HEADS))  # fmt: skip
        nx.transfer(pair.agent, pair.name, whole, strategy="direct", notif=b"after").wait(timeout=30)
    got = pair.peer.notifs(expect=6)
    assert sorted(got) == sorted([b"auto", b"direct", b"staged", b"peer-staged", b"direct", b"after"])


def test_prep_lists_takes_the_peer_description_the_handshake_brings(pair: Pair) -> None:
    """At the handshake a connector holds its registration and the peer's
    RegistrationDescription, not yet a request's map: prep_lists takes them (it raised
    AttributeError: 'is_local') and prepares what it prepares from a map's sides. Lists
    made before the peer's metadata was loaded again are refused, saying to make them
    again (NIXL's not-found error alone said nothing of it)."""
    s_spec, d_spec = spec(NHD, (0, 1), 16, seed=63), spec(HND, (1, 2), 16, seed=64)
    desc = RegistrationDescription.from_json(handshake(pair, d_spec))
    local, _ = build_cache(s_spec)
    m = block_map(local, desc, [3, 1, 5], [0, 6, 2], num_tokens=TOKENS, src_shard=s_spec.the_shard)
    unit = unit_of(m, nx.plan(m, strategy="staged", staging=pair.staging))
    with nx.register(pair.agent, local):
        by_map = nx.prep_lists(pair.agent, pair.name, m.src, m.dst, unit)
        at_handshake = nx.prep_lists(pair.agent, pair.name, local, desc, unit)
        for a, b in ((by_map.local, at_handshake.local), (by_map.remote, at_handshake.remote)):
            assert np.array_equal(a.starts, b.starts) and np.array_equal(a.counts, b.counts)
        done = nx.transfer(pair.agent, pair.name, m, prepped=at_handshake, strategy="direct").wait(timeout=30)
        assert done.num_bytes == m.num_bytes
        pair.agent.remove_remote_agent(pair.name)
        pair.agent.add_remote_agent(pair.peer.metadata)
        with pytest.raises(
            nx.NixlError, match=r"after remove_remote_agent and add_remote_agent, make them again"
        ):
            nx.transfer(pair.agent, pair.name, m, prepped=at_handshake, strategy="direct")


class _AnnounceFails:
    """A stand-in agent for a peer's paced gather: it registers nothing with NIXL, and
    its ``send_notif`` fails (as NIXL's error) from announcement ``fail_at`` on."""

    name = "kvl-gatherer"

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.sent: list[bytes] = []

    def register_memory(self, descs: Any, mem: str) -> object:
        return object()

    def deregister_memory(self, handle: object) -> None:
        pass

    def check_remote_metadata(self, peer: str, descs: Any = None) -> bool:
        return True

    def update_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def send_notif(self, peer: str, msg: bytes) -> None:
        if len(self.sent) >= self.fail_at:
            raise _NixlSendError("the poster's connection dropped")
        self.sent.append(msg)


class _NixlSendError(Exception):
    __module__ = "nixl._bindings"


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_a_paced_gather_that_fails_after_announcing_a_stage_keeps_its_buffer(fail_at: int) -> None:
    """The poster's READ of an announced stage may be under way when the gather fails:
    the staging buffer is kept for good from the first announcement on (never handed to
    another request the READ would then read), and free again when none was made."""
    cache, there = torch.arange(512, dtype=torch.int64).to(torch.uint8), torch.zeros(1024, dtype=torch.uint8)
    runs = np.array(
        [(cache.data_ptr() + 64 * k, there.data_ptr() + 128 * k, 64) for k in range(4)], np.uint64
    )
    m = _HandMap(
        runs, nx.local_side(cache), nx.LocalSide("cpu", 0, nx.local_side(there).tensor_spans, is_local=False)
    )
    agent = _AnnounceFails(fail_at)
    staging = nx.Staging(agent, 256)
    gather = nx.prepare_stage(m, staging, stages=3)
    with pytest.raises(
        nx.NixlError, match=rf"^NIXL could not announce stage {fail_at} of 3 to peer 'poster'"
    ):
        gather.run(notifs=nx.StageNotifs(agent, "poster", b"req-7"))
    assert agent.sent == [nx.stage_notif(b"req-7", i, 3) for i in range(fail_at)]
    assert staging.kept == (fail_at > 0) and staging.busy == (fail_at > 0)


@dataclass(frozen=True)
class _HandMap:
    runs: np.ndarray
    src: nx.MapSide
    dst: nx.MapSide
