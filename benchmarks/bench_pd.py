"""Prefill -> decode over NIXL: one request's real block map moved between two processes,
as kvlayout sends it beside the descriptor lists vLLM and SGLang post for the same bytes.

Llama-3-8B-like caches (32 layers, 8 KV heads of 128, bf16; MLA: 61 layers, a 576-wide
latent, blocks of 64), one 1024-token request, each scenario of ``make bench-maps``, each
posted by either side in turn: the prefill side WRITEs (this process holds the prefill
cache, a peer process the decode cache) and the decode side READs (this process holds
the decode cache, the peer the prefill cache: vLLM's NixlConnector's way). The peer's
cache is built there from a spec (:mod:`kvlayout.testing.nixl_peer`) and described to
this process by its ``RegistrationDescription`` (the handshake); the map is
``block_map(...)`` between the live registration and that description. It moves over UCX
on loopback (TCP by default, with cuda_copy on a GPU machine; ``--tls ''`` lets UCX
pick). In the same run, for the same bytes, each row posted by this process:
  - kvlayout direct: the map's runs, one descriptor each, in the list form and in the
    prepped form (both sides prepared at the handshake in units every run is whole
    multiples of; NIXL merges the request's consecutive indices back into runs);
  - kvlayout staged: the runs gathered here (the block-map engine) into a registered
    staging buffer laid out as the peer's runs, one descriptor per stretch of
    peer-consecutive runs, then posted (a READ: received into staging, then scattered),
    in one stage and as a pipeline of 8 (each stage's copy overlapping another's wire);
  - kvlayout peer-staged: the runs as they lie here to or from the peer's staging
    buffer, one descriptor per local stretch, the peer doing the copy (a WRITE: its
    scatter after; a READ: its gather before; asked for over the pipe, in the row's
    time). The peer is told of the request before the row's time and plans its half then
    (``prepare_unstage``, ``prepare_stage``), as a connector's peer does when the
    request's blocks are allocated; in one stage, and in 8, paced by NIXL notifications,
    its scatter (gather) of one stage overlapping another's wire;
  - kvlayout chosen: what the cost model picks, calibrated on this pair first, in the
    stages ``plan`` runs by default (a gather, here for a staged WRITE or there for a
    peer-staged READ: a stage per 4 MiB, up to 8, paced as above); and the
    same prepared ahead (``prepare_transfer`` before the row's time: the plan, the checks
    and the NIXL requests made, as a poster that knows both sides' blocks before the KV is
    written can), the row's time then ``start()`` and the wait;
  - vLLM-style: one descriptor per layer, K/V and block (the map's runs cut at both
    sides' block boundaries: per head slice under TP resharding); n/a where vLLM refuses
    the pair (TP resharding outside HND, a layout change, decode blocks not a multiple of
    prefill's, another engine);
  - SGLang-style: one per token, layer and K/V under TP resharding (the runs cut at every
    token); else one per layer, K/V and run of consecutive pages (the runs); NHD pools of
    one block size only;
  - the limit: one contiguous descriptor of the same bytes (plain buffers on both sides).
``--device cuda`` puts both caches and every staging buffer on the GPU (the gathers and
scatters then run there; the limit is one descriptor between the two staging buffers),
for a machine that has one (with ``--tls ''``, so UCX takes its GPU transports).
Each row is the best of ``--repeats`` (and the spread), from ``transfer()`` to done (the
gather or scatter included); ratios are the baseline's time over ours (>1: ours is
faster). Sampled runs of the chosen transfer are checked byte-exactly. Last, the issue's
targets read off those rows: the chosen plan against the SGLang-style list under TP
resharding in NHD (5x), against the limit with consecutive blocks (0.9x), and the rows
where a baseline was faster, with both descriptor counts and spreads; where the chosen
plan posts the baseline's own list (direct, the same rows), it is a tie, not a miss: the
difference is the loopback's noise.
``make bench-pd``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.testing.nixl_peer import BufferSide, CacheSpec, NixlPeer, Paced, build_cache, tcp_tls
from kvlayout.transfer import BlockMap, RegistrationDescription, block_map
from kvlayout.transfer import nixl as nx
from kvlayout.transfer.block_maps import Side, fingerprint

NL, NH, HS = 32, 8, 128
MLA_NL, MLA_HS = 61, 576
U64 = np.uint64
NHD, HND, SGLANG, MLA = (
    F.NL_X_TWO_NB_BS_NH_HS,
    F.NL_X_TWO_NB_NH_BS_HS,
    F.TWO_X_NL_X_NBBS_NH_HS,
    F.NL_X_NB_BS_HS,
)


@dataclass(frozen=True)
class End:
    """One side of a scenario: format, block size, TP rank and size."""

    fmt: F
    block_size: int = 16
    tp: tuple[int, int] = (0, 1)

    def spec(self, tokens: int, spare: int, seed: int) -> CacheSpec:
        mla = self.fmt is MLA
        heads = 1 if mla else NH * 1 // self.tp[1]
        blocks = -(-tokens // self.block_size) + spare
        layers, row = (MLA_NL, MLA_HS) if mla else (NL, HS)
        shard = (self.tp[0], self.tp[1], 1 if mla else NH)
        return CacheSpec(self.fmt.name, layers, blocks, self.block_size, heads, row, shard=shard, seed=seed)


SCENARIOS: list[tuple[str, End, End]] = [
    ("same layout NHD", End(NHD), End(NHD)),
    ("TP 1->2 NHD", End(NHD), End(NHD, tp=(1, 2))),
    ("TP 2->1 NHD", End(NHD, tp=(1, 2)), End(NHD)),
    ("TP 1->2 HND", End(HND), End(HND, tp=(1, 2))),
    ("TP 2->1 HND", End(HND, tp=(1, 2)), End(HND)),
    ("NHD -> HND", End(NHD), End(HND)),
    ("block 16 -> 64", End(NHD), End(NHD, 64)),
    ("block 64 -> 16", End(NHD, 64), End(NHD)),
    ("vLLM -> SGLang", End(NHD), End(SGLANG)),
    ("MLA TP 1->4", End(MLA, 64), End(MLA, 64, (2, 4))),
]


# -- the baselines, cut from the map's runs -----------------------------------------------------


def cut(runs: np.ndarray, col: int, side: Side, period: np.ndarray) -> np.ndarray:
    """``runs`` cut wherever column ``col``'s bytes cross a multiple of ``period`` bytes
    from the start of their tensor (``period`` per tensor of ``side``)."""
    order = np.argsort(side.addresses)
    starts = side.addresses[order]
    k = np.searchsorted(starts, runs[:, col], side="right") - 1
    t0, p = starts[k], period[order][k]
    a = runs[:, col] - t0
    first, last = a // p, (a + runs[:, 2] - 1) // p
    n = (last - first + 1).astype(np.int64)
    idx = np.repeat(np.arange(len(runs)), n)
    j = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)).astype(U64)
    lo = np.maximum(a[idx], (first[idx] + j) * p[idx])
    hi = np.minimum(a[idx] + runs[idx, 2], (first[idx] + j + U64(1)) * p[idx])
    out = np.empty((len(idx), 3), dtype=U64)
    shift = lo - a[idx]
    out[:, 0], out[:, 1], out[:, 2] = runs[idx, 0] + shift, runs[idx, 1] + shift, hi - lo
    return out


def strides(side: Side, which: int) -> np.ndarray:
    """Bytes per block (0) or per slot (1) of each tensor of a side (one piece a row)."""
    return np.full(len(side.addresses), int(side.strides[0, which]), dtype=U64)


def vllm_style(m: BlockMap, src: End, dst: End) -> tuple[np.ndarray | None, str]:
    if F.TWO_X_NL_X_NBBS_NH_HS in (src.fmt, dst.fmt):
        return None, "another engine's cache"
    if src.fmt != dst.fmt:
        return None, "vLLM moves one layout (fixing HND into NHD after receipt only)"
    if src.tp[1] != dst.tp[1] and src.fmt is NHD:
        return None, "vLLM serves TP resharding in HND only"
    if dst.block_size % src.block_size:
        return None, "vLLM needs decode's block size a multiple of prefill's"
    runs = cut(m.runs, 0, m.src, strides(m.src, 0))
    return cut(runs, 1, m.dst, strides(m.dst, 0)), ""


def sglang_style(m: BlockMap, src: End, dst: End) -> tuple[np.ndarray | None, str]:
    if {src.fmt, dst.fmt} - {NHD, SGLANG} or src.block_size != dst.block_size:
        return None, "SGLang pools are NHD, one page size"
    if src.tp[1] != dst.tp[1]:
        return cut(m.runs, 1, m.dst, strides(m.dst, 1)), ""
    return m.runs, ""


# -- measuring -----------------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    run: Callable[[], nx.TransferResult]
    before: Callable[[], None] | None = None  # untimed, before each run: the peer told of the request
    descriptors: int = 0
    times: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.times)

    def go(self) -> nx.TransferResult:
        """One run, untimed, with what comes before it."""
        if self.before is not None:
            self.before()
        return self.run()


def measure(rows: list[Row], repeats: int) -> None:
    """Each row once untimed (first-use costs), then ``repeats`` rounds of every row in
    turn, so the machine's load changes land on all rows alike; each round starts one row
    further on, so no row always follows the same one (the row after another that wrote
    the same cache measured faster: the vLLM-style list, after the chosen plan, beat
    kvlayout's direct list of the same 4,096 descriptors, after the limit's, in 5 of 6
    runs of TP 2 -> 1 HND's scattered READ, by up to 1.3x)."""
    for row in rows:
        row.descriptors = row.go().descriptors
    for r in range(repeats):
        for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
            if row.before is not None:
                row.before()
            start = time.perf_counter()
            row.run()
            row.times.append(time.perf_counter() - start)


@dataclass
class Context:
    agent: nx.Agent
    peer: NixlPeer
    name: str
    staging: nx.Staging
    peer_staging: nx.PeerStaging  # the peer's staging buffer, for peer-staged requests
    cost: dict[str, nx.CostModel]  # calibrated per op
    args: argparse.Namespace
    poster: str  # this agent's name in the peer (which sends it notifications)
    requests: int = 0  # paced requests so far (each tagged apart)


@dataclass(frozen=True)
class Map:
    runs: np.ndarray
    src: nx.MapSide
    dst: nx.MapSide


def unit_of(m: BlockMap) -> int:
    """The prepped lists' unit: every run whole units, at unit offsets in its tensor."""
    values = [m.runs[:, 2]]
    for side, col in ((m.src, 0), (m.dst, 1)):
        starts = np.sort(side.addresses)
        k = np.searchsorted(starts, m.runs[:, col], side="right") - 1
        values.append(m.runs[:, col] - starts[k])
    return int(np.gcd.reduce(np.concatenate(values).astype(np.int64)))


@dataclass
class Outcome:
    """One scenario's figures the targets are read from (best seconds)."""

    name: str  # scenario, block pattern, poster
    consecutive: bool
    resharded_nhd: bool  # TP resharding in NHD: the SGLang-style list's worst case
    chosen: Row
    prepared: Row
    limit: Row
    baselines: list[Row]  # the vLLM- and SGLang-style lists that apply
    same_list: set[str] = field(default_factory=set)  # labels of the baselines the chosen plan posts as it is


def scenario(label: str, src: End, dst: End, scattered: bool, op: str, c: Context) -> Outcome:
    """One scenario posted by one side: ``"WRITE"`` from the prefill side (this process
    holds the prefill cache, the peer the decode cache) or ``"READ"`` from the decode
    side (this process holds the decode cache, the peer the prefill cache)."""
    args = c.args
    s_spec, d_spec = src.spec(args.tokens, args.spare_blocks, 3), dst.spec(args.tokens, args.spare_blocks, 4)
    local_spec, remote_spec = (s_spec, d_spec) if op == "WRITE" else (d_spec, s_spec)
    device = c.args.device
    text = c.peer.cache(remote_spec, device)  # the handshake: the peer's description (and its NIXL metadata)
    c.peer_staging = c.peer.staging(c.staging.nbytes, device)
    c.agent.remove_remote_agent(c.name)
    c.agent.add_remote_agent(c.peer.metadata)
    desc = RegistrationDescription.from_json(text)
    local, leaves = build_cache(local_spec, device)
    rng = np.random.default_rng(7)

    def ids(s: CacheSpec) -> list[int]:
        n = -(-args.tokens // s.block_size)
        return [int(b) for b in (rng.permutation(s.blocks)[:n] if scattered else np.arange(2, 2 + n))]

    src_ids, dst_ids = ids(s_spec), ids(d_spec)
    map_kw: dict[str, Any] = {"num_tokens": args.tokens, "src_block_size": src.block_size,
                          "dst_block_size": dst.block_size}  # fmt: skip
    if op == "WRITE":
        m = block_map(local, desc, src_ids, dst_ids, src_shard=s_spec.the_shard, **map_kw)
    else:
        m = block_map(desc, local, src_ids, dst_ids, dst_shard=d_spec.the_shard, **map_kw)
    pattern = "scattered" if scattered else "consecutive"
    mean = m.num_bytes / m.num_runs / 1024
    poster = "prefill posts WRITEs" if op == "WRITE" else "decode posts READs"
    print(
        f"\n{label}, {pattern} blocks, {poster}: {m.kind}; {m.num_bytes / 2**20:.0f} MiB, {m.num_runs} runs "
        f"(mean {mean:.1f} KiB)"
    )
    cost = c.cost[op]

    here_text = local.describe(shard=local_spec.the_shard, block_size=local_spec.block_size).to_json()

    def send(
        mp: Any, *, ahead: bool = False, **kw: Any
    ) -> tuple[Callable[[], nx.TransferResult], Callable[[], None] | None]:
        """A row's run: the transfer, and the peer's copy where it is peer-staged, in the
        time (its gather before a READ, its scatter after a WRITE; in stages, paced by
        NIXL notifications, overlapping the wire); and what comes before it, untimed: the
        peer told of the request, which it plans (as a connector's peer does when the
        request's blocks are allocated, before its bytes exist), and with ``ahead`` this
        side's request prepared (``prepare_transfer``: plan, checks, NIXL requests), as a
        poster that knows both sides' blocks before the KV is written can; ``start()``
        and the wait are then the row's time."""
        planned = nx.plan(mp, **{k: v for k, v in kw.items() if k not in ("prepped", "notif")})
        mp_fingerprint = fingerprint(mp.runs)  # the peer checks its half against it, as a connector's does
        peer_staged = planned.strategy == "peer-staged"
        stages = len(planned.stages) if peer_staged else 1
        half = "stage" if op == "READ" else "unstage"
        state: dict[str, Any] = {}

        def signal() -> dict[str, bytes]:  # a paced peer-staged request's tag
            if "tag" not in state:
                return {}
            return {"peer_ready" if op == "READ" else "notif": state["tag"].encode()}

        def before() -> None:
            if peer_staged:
                c.peer.prepare(
                    half, here_text, src_ids, dst_ids, stages=stages, expect=mp_fingerprint, **map_kw
                )
                if stages > 1:
                    c.requests += 1
                    state["tag"] = f"request {c.requests}"
            if ahead:
                state["xfer"] = nx.prepare_transfer(c.agent, c.name, mp, **kw, **signal())

        def post() -> nx.Transfer:
            if not ahead:
                return nx.transfer(c.agent, c.name, mp, **kw, **signal())
            xfer: nx.Transfer = state.pop("xfer")
            xfer.start()
            return xfer

        def run() -> nx.TransferResult:
            if not peer_staged:
                return post().wait(timeout=600)
            if stages == 1:
                if op == "READ":
                    c.peer.run_prepared()  # the gather, then the READ
                result = post().wait(timeout=600)
                if op == "WRITE":
                    c.peer.run_prepared()  # the scatter, once the WRITE landed
                return result
            c.peer.run_prepared(paced=Paced(stages, c.poster, state["tag"], wait=False))
            result = post().wait(timeout=600)
            c.peer.answer("run_prepared")
            return result

        return run, (before if ahead or peer_staged else None)

    here, there = (m.src, m.dst) if op == "WRITE" else (m.dst, m.src)
    with nx.register(c.agent, local):
        prepped = nx.prep_lists(c.agent, c.name, here, there, unit_of(m))
        chosen = nx.plan(m, staging=c.staging, cost=cost, peer_staging=c.peer_staging)
        stages = f", {len(chosen.stages)} stages" if len(chosen.stages) > 1 else ""
        ours = [
            Row("kvlayout direct (list)", *send(m, strategy="direct")),
            Row("kvlayout direct (prepped)", *send(m, strategy="direct", prepped=prepped)),
            Row("kvlayout staged, 1 stage", *send(m, strategy="staged", staging=c.staging, stages=1)),
            Row("kvlayout staged, 8 stages", *send(m, strategy="staged", staging=c.staging, stages=8)),
            Row("kvlayout peer-staged, 1 stage",
                *send(m, strategy="peer-staged", peer_staging=c.peer_staging, stages=1)),
            Row("kvlayout peer-staged, 8 stages",
                *send(m, strategy="peer-staged", peer_staging=c.peer_staging, stages=8)),
            Row(f"kvlayout chosen: {chosen.strategy}{stages}",
                *send(m, staging=c.staging, cost=cost, peer_staging=c.peer_staging)),
            Row("kvlayout chosen, prepared ahead",
                *send(m, ahead=True, staging=c.staging, cost=cost, peer_staging=c.peer_staging)),
        ]  # fmt: skip
        baselines: dict[str, Row | None] = {}
        why: dict[str, str] = {}
        same_list: set[str] = set()
        for name, (rows_of, reason) in (
            ("vLLM", vllm_style(m, src, dst)),
            ("SGLang", sglang_style(m, src, dst)),
        ):
            assert rows_of is None or int(rows_of[:, 2].sum()) == m.num_bytes
            why[name] = reason
            if rows_of is not None and chosen.strategy == "direct" and same_runs(rows_of, m.runs):
                same_list.add(f"{name}-style list")
            baselines[name] = (
                None if rows_of is None
                else Row(f"{name}-style list", *send(Map(rows_of, m.src, m.dst), strategy="direct"))
            )  # fmt: skip
        at, theirs = plain_buffer(c)
        mine = nx.local_side(c.staging.tensor)
        one = np.array([[c.staging.address, at, m.num_bytes]], U64)
        limit = Map(one, mine, theirs) if op == "WRITE" else Map(one[:, [1, 0, 2]], theirs, mine)
        baselines["limit"] = Row("one descriptor (limit)", *send(limit, strategy="direct"))
        rows = [*ours, *(b for b in baselines.values() if b is not None)]
        measure(rows, args.repeats)
        ours[-1].go()
        check(c.peer, m, op, leaves)
    width = max(len(row.label) for row in rows)
    print(
        f"  {'':{width}} {'descriptors':>11} {'best s':>8} {'spread':>13}"
        + "".join(f" {'vs ' + k:>10}" for k in baselines)
    )
    for row in rows:
        spread = f"{min(row.times):.3f}-{max(row.times):.3f}"
        ratios = "".join(f" {b.best / row.best:9.2f}x" if b else f" {'n/a':>10}" for b in baselines.values())
        print(f"  {row.label:{width}} {row.descriptors:11d} {row.best:8.3f} {spread:>13}{ratios}")
    for name, b in baselines.items():
        if b is None:
            print(f"  {name}-style list: n/a ({why[name]})")
    lists = [b for k, b in baselines.items() if k != "limit" and b is not None]
    resharded_nhd = src.tp[1] != dst.tp[1] and NHD in (src.fmt, dst.fmt)
    name = f"{label}, {pattern}, {op}"
    return Outcome(
        name, not scattered, resharded_nhd, ours[-2], ours[-1], baselines["limit"], lists, same_list
    )


def same_runs(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two descriptor lists are the same (source, destination, length) rows, in
    any order: a direct plan posting a baseline's own list."""
    if a.shape != b.shape:
        return False
    key = [np.lexsort((x[:, 1], x[:, 0])) for x in (a, b)]
    return bool(np.array_equal(a[key[0]], b[key[1]]))


def summary(outcomes: list[Outcome]) -> None:
    """The issue's targets, read off the rows above: the chosen plan (and, in brackets,
    the same prepared ahead)."""
    print("\ntargets (the chosen plan; prepared ahead in brackets; best times of the rows above):")
    sglang = [
        (b.best / o.chosen.best, o)
        for o in outcomes
        if o.resharded_nhd
        for b in o.baselines
        if b.label.startswith("SGLang")
    ]
    if sglang:
        worst, o = min(sglang, key=lambda t: t[0])
        print(f"  >= 5x the SGLang-style list under TP resharding in NHD: at least {worst:.1f}x ({o.name})")
    consecutive = [o for o in outcomes if o.consecutive]
    short = [o for o in consecutive if o.limit.best / o.chosen.best < 0.9]
    met = len(consecutive) - len(short)
    print(f"  >= 0.9x the limit with consecutive blocks: {met} of {len(consecutive)} rows")
    for o in short:
        ratio, prepared = o.limit.best / o.chosen.best, o.limit.best / o.prepared.best
        print(f"    short: {o.name}: {ratio:.2f}x ({prepared:.2f}x)")
    # The chosen plan posting a baseline's own list cannot be slower than it but by the
    # loopback's noise: said apart, as a tie, not counted as a miss.
    slower = [(o, b) for o in outcomes for b in o.baselines if b.best < o.chosen.best]
    missed = [(o, b) for o, b in slower if b.label not in o.same_list]
    ties = [(o, b) for o, b in slower if b.label in o.same_list]
    rows = len({id(o) for o, _ in missed})
    tied = f"; {len(ties)} more behind a baseline whose own list it posts (noise)" if ties else ""
    print(f"  never slower than a baseline: slower in {rows} of {len(outcomes)} rows{tied}")
    for o, b in missed:
        same = ", the same descriptor count" if b.descriptors == o.chosen.descriptors else ""
        print(
            f"    slower: {o.name}: {b.best / o.chosen.best:.3f}x the {b.label} "
            f"({o.chosen.descriptors} descriptors against {b.descriptors}{same}; spreads "
            f"{spread(o.chosen)} against {spread(b)})"
        )
    for o, b in ties:
        print(
            f"    tie: {o.name}: {b.best / o.chosen.best:.3f}x the {b.label}, its own {b.descriptors} "
            f"descriptors (spreads {spread(o.chosen)} against {spread(b)})"
        )


def spread(row: Row) -> str:
    return f"{min(row.times):.3f}-{max(row.times):.3f} s"


def plain_buffer(c: Context) -> tuple[int, Any]:
    """The peer's memory the limit row moves one descriptor to or from, and its side: its
    first plain buffer (host memory), or on a GPU its staging buffer there."""
    if c.args.device == "cpu":
        return c.peer.address(0), c.peer.side()
    ps = c.peer_staging
    return ps.address, BufferSide(np.array([[ps.address, ps.nbytes]], U64), ps.device_type, ps.device_index)


def bytes_at(leaves: list[torch.Tensor], address: int, n: int) -> bytes:
    """``n`` bytes of this process's cache at ``address`` (a host copy where it is on a GPU)."""
    for t in leaves:
        raw = t.view(-1).view(torch.uint8)
        if t.data_ptr() <= address and address + n <= t.data_ptr() + raw.numel():
            off = address - t.data_ptr()
            return bytes(raw[off : off + n].cpu().numpy())
    sys.exit(f"{address:#x} (+{n}) is outside this process's cache")


def check(peer: NixlPeer, m: BlockMap, op: str, leaves: list[torch.Tensor]) -> None:
    """Sampled runs of the last kvlayout transfer landed byte-exactly (on the peer for a
    WRITE, here for a READ)."""
    rng = np.random.default_rng(0)
    for i in rng.choice(m.num_runs, size=min(16, m.num_runs), replace=False):
        s, d, n = (int(x) for x in m.runs[i])
        there, here = (d, s) if op == "WRITE" else (s, d)
        if peer.cache_read_at(there, n).tobytes() != bytes_at(leaves, here, n):
            sys.exit(f"run {i} did not arrive byte-exactly")


def calibrated(agent: nx.Agent, name: str, peer: NixlPeer, op: nx.Op, device: str) -> nx.CostModel:
    """The cost model of ``op`` on this pair, measured against the peer's plain buffers, or
    on a GPU against a staging buffer it makes there (the copy measured where it runs)."""
    if device == "cpu":
        return nx.calibrate(agent, name, peer.side(), op=op, nbytes=16 << 20)
    ps = peer.staging(16 << 20, device)
    agent.remove_remote_agent(name)
    agent.add_remote_agent(peer.metadata)
    side = BufferSide(np.array([[ps.address, ps.nbytes]], U64), ps.device_type, ps.device_index)
    return nx.calibrate(agent, name, side, op=op, nbytes=16 << 20, copy_device=device)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--spare-blocks", type=int, default=8, help="blocks beyond the request in each cache")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run the scenarios whose label contains this")
    parser.add_argument("--blocks", choices=("scattered", "consecutive", "both"), default="both")
    who = "who posts: the prefill side (WRITE), the decode side (READ), or each in turn"
    parser.add_argument("--op", choices=("WRITE", "READ", "both"), default="both", help=who)
    tls = "UCX_TLS for both processes ('' lets UCX choose; by default TCP, with cuda_copy on a GPU machine)"
    parser.add_argument("--tls", default=tcp_tls(), help=tls)
    where = "where the caches and staging buffers live: cpu, or cuda (with --tls '' for UCX's GPU transports)"
    parser.add_argument("--device", default="cpu", help=where)
    args = parser.parse_args()
    import nixl._api  # configures NIXL's logger, which says INFO on stdout otherwise

    logging.getLogger("nixl").setLevel(logging.WARNING)
    env = {"UCX_TLS": args.tls} if args.tls else {}
    most = max(MLA_NL * MLA_HS, NL * 2 * NH * HS) * 2 * args.tokens  # the largest request's bytes
    print(f"Llama-3-8B-like: {NL} layers, {NH} KV heads of {HS}, bf16 (MLA: {MLA_NL} layers of {MLA_HS}); "
          f"{args.tokens}-token request; UCX_TLS={args.tls or '(UCX chooses)'}; "
          f"best of {args.repeats}")  # fmt: skip
    with NixlPeer("bench-decode", [most], env=env, timeout=600) as peer:
        with environment(env):  # UCX reads it when the agent's context starts
            agent = nx.make_agent("bench-prefill", progress_thread=False)
        name = agent.add_remote_agent(peer.metadata).decode()
        with nx.Staging(agent, most, device=args.device) as staging:
            costs = {}
            for op in ("WRITE", "READ"):
                cost = costs[op] = calibrated(agent, name, peer, op, args.device)
                sizes = ", ".join(f"{n >> 10} KiB {c * 1e6:.1f} us" for n, c in cost.per_descriptor_by_size)
                nixl = f"a descriptor of {sizes}; {cost.bandwidth / 1e9:.2f} GB/s"
                gather = f"{cost.copy_per_run_s * 1e6:.3f} us a run, {cost.copy_bandwidth / 1e9:.1f} GB/s"
                scatter = f"{cost.copy_s(1, 0, scatters=True) * 1e6:.3f} us a run, " + (
                    f"{(1 << 30) / cost.copy_s(0, 1 << 30, scatters=True) / 1e9:.1f} GB/s"
                )
                permuted = (cost.transposed_factor or 1.0, cost.transposed_scatter_factor or 1.0)
                scatter += (
                    f"; a permuted map's copy x{permuted[0]:.2f} gathering, x{permuted[1]:.2f} scattering"
                    f"; a plan's own work: staged {cost.staged_plan_s * 1e6:.0f} us, a sort "
                    f"{cost.sort_per_run_s * 1e6:.3f} us a run, a scatter's check out of order "
                    f"{cost.unordered_check_per_run_s * 1e6:.3f} us a run; a READ's copy "
                    f"x{cost.read_copy_factor or 1.0:.2f}"
                )
                print(
                    f"calibrated {op}: {nixl}, {cost.per_transfer_s * 1e3:.2f} ms a transfer; "
                    f"gather {gather}, scatter {scatter}"
                )
            poster = peer.add_remote(agent.get_agent_metadata())
            c = Context(agent, peer, name, staging, nx.PeerStaging(0, 0), costs, args, poster)
            patterns = {"scattered": [True], "consecutive": [False], "both": [True, False]}[args.blocks]
            ops = ["WRITE", "READ"] if args.op == "both" else [args.op]
            outcomes = [
                scenario(label, src, dst, scattered, op, c)
                for label, src, dst in SCENARIOS
                if args.only in label
                for scattered in patterns
                for op in ops
            ]
            summary(outcomes)


if __name__ == "__main__":
    main()
