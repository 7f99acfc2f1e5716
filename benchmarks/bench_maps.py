"""Block maps: runs, build time and copy bandwidth of one request between two caches.

A Llama-3-8B-like model (32 layers, 8 KV heads of 128, bf16), one 1024-token request,
its block ids scattered over a pool twice its size or consecutive, between two CPU
caches for each scenario below (SGL->HiCache: SGLang's device pool into its HiCache host
pool, layer_first, page_first or page_first_direct, 64-token pages); an MLA model (61
layers, a 576-wide latent) for MLA, also into a decode rank that holds DCP rank 2 of 4's
tokens (vLLM's decode context parallelism), a token or a block at a time; the Llama
model's DCP rank 1 of 4 (a token at a time) into an HND cache without CP and back; and
Qwen3-Next's Gated DeltaNet state (one page per layer and request) for the last three:
vLLM's pages, then SGLang's Mamba pool, its conv state and its SSM state.
Each row prints the map's runs (and the groups it holds them in), bytes and mean run,
the time to build the map (the request's part: the sides and the pair are prepared once,
like a transfer plan) beside one detection of the destination registration, and
``copy()`` bandwidth beside, on the same run list and thread count:
  - C copy: plain C that copies the same runs, one ``memcpy`` each, split over threads by
    bytes as ours is (compiled here with the system C compiler);
  - flat stream: ``kvlayout._native.flat_stream`` of the same number of bytes from one
    flat buffer into another (streaming stores where the CPU has them): the machine's bound.
Then the memory's own cost of each side's pattern, without a copy: the map's source runs
read with plain loads (src rd) and its destination runs written with plain stores
(dst wr), in list order, one thread, each over as many bytes read (written) flat the
same way: below 1.0x where the hardware loses on the pattern itself.
Figures are medians of several runs, ours and its baselines taking turns, each run from
cold caches, ours after the copies over which the pair measures whether prefetching is
faster; ratios are ours over each baseline (higher is better).
Targets: build <= 200 us; copy >= 1.0x the C copy everywhere; >= 0.85x the flat stream
where the mean run is 4 KiB or more.
Run with ``make bench-maps``.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvlayout
from kvlayout import _native
from kvlayout.transfer import Shard, block_map

NL, NH, HS, MLA_NL, MLA_HS = 32, 8, 128, 61, 576
TOKENS = 1024
DTYPE = torch.bfloat16
# A pair of sides measures, over its first copies of a kind, whether they are faster
# prefetching ahead or not (csrc/prefetch_choice.h); the figures are of the copies after.
MEASURE_CALLS = 2 * _native.PrefetchChoice.warm + 2

C_COPY = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct { const uint64_t* runs; int64_t n; uint64_t lo, hi; const uint64_t* ends; } Part;

static void* part(void* arg) {
  const Part* p = arg;
  for (int64_t i = 0; i < p->n; ++i) {
    uint64_t end = p->ends[i], start = end - p->runs[3 * i + 2];
    if (end <= p->lo || start >= p->hi) continue;
    uint64_t from = start > p->lo ? start : p->lo, to = end < p->hi ? end : p->hi;
    uint64_t skip = from - start;
    memcpy((char*)p->runs[3 * i + 1] + skip, (const char*)p->runs[3 * i] + skip, to - from);
  }
  return 0;
}

void copy_runs(const uint64_t* runs, int64_t n, const uint64_t* ends, int threads) {
  Part parts[64];
  pthread_t tids[64];
  uint64_t total = n ? ends[n - 1] : 0;
  if (threads > 64) threads = 64;
  for (int t = 0; t < threads; ++t) {
    uint64_t hi = t == threads - 1 ? total : total / threads * (t + 1);
    parts[t] = (Part){runs, n, total / threads * t, hi, ends};
  }
  for (int t = 1; t < threads; ++t) pthread_create(&tids[t], 0, part, &parts[t]);
  part(&parts[0]);
  for (int t = 1; t < threads; ++t) pthread_join(tids[t], 0);
}

/* The memory's own cost of a run list's pattern, without a copy: one side's runs (column
   col) read with plain loads, or written with plain stores, in list order. */
uint64_t read_runs(const uint64_t* runs, int64_t n, int col) {
  uint64_t acc[8] = {0};  /* a line a step, eight accumulators: the loads never wait on each other */
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t* p = (const uint64_t*)runs[3 * i + col];
    uint64_t words = runs[3 * i + 2] / 8, k = 0;
    for (; k + 8 <= words; k += 8)
      for (int j = 0; j < 8; ++j) acc[j] |= p[k + j];
    for (; k < words; ++k) acc[0] |= p[k];
  }
  return acc[0] | acc[1] | acc[2] | acc[3] | acc[4] | acc[5] | acc[6] | acc[7];
}

void write_runs(const uint64_t* runs, int64_t n, int col, uint64_t value) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t* p = (uint64_t*)runs[3 * i + col];
    for (uint64_t k = 0, words = runs[3 * i + 2] / 8; k < words; ++k) p[k] = value;
  }
}
"""


def c_library(workdir: Path) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_maps needs a C compiler (cc or gcc) for its C copy baseline")
    src, lib = workdir / "copy.c", workdir / "copy.so"
    src.write_text(C_COPY)
    # -O3 for this CPU: the read and write loops vectorised, at the memory's pace, not the core's
    subprocess.run(
        [cc, "-O3", "-march=native", "-shared", "-fPIC", str(src), "-o", str(lib), "-lpthread"], check=True
    )
    library = ctypes.CDLL(str(lib))
    library.copy_runs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    library.copy_runs.restype = None
    library.read_runs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    library.read_runs.restype = ctypes.c_uint64
    library.write_runs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64]
    library.write_runs.restype = None
    return library


@dataclass
class Cache:
    kv: Any  # what detection returned
    raw: Any  # the tensors as the engine hands them over
    engine: str
    hints: dict[str, Any]
    block_size: int
    num_blocks: int
    shard: Shard | None = None
    page_block_size: int | None = None  # for NB*BS formats
    detect: Callable[[], Any] | None = None  # how the registration is detected, where not plain


def gdn_state(tp: int, rank: int) -> Cache:
    """Qwen3-Next-80B's first group of 12 Gated DeltaNet layers at TP ``tp`` in vLLM 0.33,
    prefix caching off (one state page per request), conv state "DS": what a P/D
    connector moves of a hybrid besides attention."""
    from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
    from kvlayout.testing import vllm as vx

    engine = vx.hybrid_engine(
        vx.QWEN3_NEXT_80B_A3B, vx.FLASHINFER, tp=tp, num_blocks=8, mamba_cache_mode="none",
        max_model_len=TOKENS, conv_layout="DS",
    )  # fmt: skip
    hints = {"kv_layout": "NHD"}
    kv = apply_kv_cache_group_edits(engine.config, vx.allocate_v033(engine)[1], hints, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, kv)

    def detect() -> Any:
        return kvlayout.detect(layers, "vllm", hints, layer_groups=groups)

    group = detect().kernel_groups[0]
    return Cache(group, layers, "vllm", hints, TOKENS, 8, Shard(rank, tp, 2), detect=detect)


def sglang_state(tp: int, rank: int, name: str) -> Cache:
    """State ``name`` (``conv0`` or ``temporal``) of 12 of Qwen3-Next-80B's Gated DeltaNet
    layers in SGLang's device Mamba pool at TP ``tp``, 8 request slots: what SGLang's P/D
    moves of a hybrid besides its KV pool, one slot a request."""
    from dataclasses import replace

    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import QWEN3_NEXT, device_pool

    pool = device_pool(replace(QWEN3_NEXT, num_layers=12), tp, 8)
    pool.mamba_cache.conv[0].fill_(1)
    pool.mamba_cache.temporal.fill_(1)

    def detect() -> Any:
        return mamba_state_pools(pool, "gdn_attn")[name]

    return Cache(detect(), pool, "sglang", {}, TOKENS, 8, Shard(rank, tp, 2), detect=detect)


def vllm(hnd: bool, block_size: int, heads: int = NH, shard: Shard | None = None) -> Cache:
    blocks = 2 * TOKENS // block_size  # a pool twice the request, so scattered ids are scattered
    shape = (2, blocks, heads, block_size, HS) if hnd else (2, blocks, block_size, heads, HS)
    raw = [torch.ones(shape, dtype=DTYPE) for _ in range(NL)]
    if hnd:  # vLLM exposes its HND cache as an NHD-shaped view
        raw = [t.transpose(2, 3) for t in raw]
    hints = {"kv_layout": "HND" if hnd else "NHD"}
    return Cache(kvlayout.detect(raw, "vllm", hints), raw, "vllm", hints, block_size, blocks, shard)


def sglang(block_size: int) -> Cache:
    slots = 2 * TOKENS
    raw = [[torch.ones(slots, NH, HS, dtype=DTYPE) for _ in range(NL)] for _ in range(2)]
    hints: dict[str, Any] = {}
    kv = kvlayout.detect(raw, "sglang", hints)
    return Cache(kv, raw, "sglang", hints, block_size, slots // block_size, page_block_size=block_size)


def hicache(layout: str, page: int) -> Cache:
    """SGLang's HiCache host pool (``kv_buffer``) in ``layout``, ``page``-token pages: a
    backup from the device pool lands here."""
    slots = 2 * TOKENS
    shape = {
        "layer_first": (2, NL, slots, NH, HS),
        "page_first": (2, slots, NL, NH, HS),
        "page_first_direct": (2, slots // page, NL, page, NH, HS),
    }[layout]
    raw = torch.ones(shape, dtype=DTYPE)
    hints: dict[str, Any] = {"hicache_layout": layout}
    kv = kvlayout.detect(raw, "sglang", hints)
    folded = layout != "page_first_direct"
    return Cache(kv, raw, "sglang", hints, page, slots // page, page_block_size=page if folded else None)


def mla(shard: Shard | None = None) -> Cache:
    blocks = 2 * TOKENS // 64
    raw = [torch.ones(blocks, 64, MLA_HS, dtype=DTYPE) for _ in range(MLA_NL)]
    return Cache(kvlayout.detect(raw, "vllm", {}), raw, "vllm", {}, 64, blocks, shard)


SCENARIOS: list[tuple[str, Callable[[], tuple[Cache, Cache]]]] = [
    ("same layout NHD", lambda: (vllm(False, 16), vllm(False, 16))),
    ("TP 1->2 NHD", lambda: (vllm(False, 16), vllm(False, 16, NH // 2, Shard(1, 2, NH)))),
    ("TP 2->1 NHD", lambda: (vllm(False, 16, NH // 2, Shard(1, 2, NH)), vllm(False, 16))),
    ("TP 1->2 HND", lambda: (vllm(True, 16), vllm(True, 16, NH // 2, Shard(1, 2, NH)))),
    ("TP 2->1 HND", lambda: (vllm(True, 16, NH // 2, Shard(1, 2, NH)), vllm(True, 16))),
    ("NHD -> HND", lambda: (vllm(False, 16), vllm(True, 16))),
    ("block 16 -> 64", lambda: (vllm(False, 16), vllm(False, 64))),
    ("block 64 -> 16", lambda: (vllm(False, 64), vllm(False, 16))),
    ("NHD 16 -> HND 64", lambda: (vllm(False, 16), vllm(True, 64))),  # an offload pool's blocks
    ("vLLM -> SGLang", lambda: (vllm(False, 16), sglang(16))),
    ("SGL->HiCache lf", lambda: (sglang(64), hicache("layer_first", 64))),
    ("SGL->HiCache pf", lambda: (sglang(64), hicache("page_first", 64))),
    ("SGL->HiCache pfd", lambda: (sglang(64), hicache("page_first_direct", 64))),
    ("MLA TP 1->4", lambda: (mla(), mla(Shard(2, 4, 1)))),
    # decode context parallelism: decode TP 4 rank 2 holds DCP rank 2's tokens, 1 at a time
    # (vLLM's default interleave) or a block at a time
    ("MLA -> DCP 4", lambda: (mla(), mla(Shard(2, 4, 1, cp_rank=2, cp_size=4)))),
    ("MLA -> DCP 4 blk", lambda: (mla(), mla(Shard(2, 4, 1, cp_rank=2, cp_size=4, cp_interleave=64)))),
    # a Llama DCP rank's tokens into an HND cache without CP (its granules several to a
    # destination block) and back
    ("DCP 4 -> HND", lambda: (vllm(False, 16, shard=Shard(0, 1, NH, cp_rank=1, cp_size=4)), vllm(True, 16))),
    ("HND -> DCP 4", lambda: (vllm(True, 16), vllm(True, 16, shard=Shard(0, 1, NH, cp_rank=1, cp_size=4)))),
    ("GDN TP 1->2", lambda: (gdn_state(1, 0), gdn_state(2, 1))),
    ("SGL conv TP 1->2", lambda: (sglang_state(1, 0, "conv0"), sglang_state(2, 1, "conv0"))),
    ("SGL ssm TP 1->2", lambda: (sglang_state(1, 0, "temporal"), sglang_state(2, 1, "temporal"))),
]


# Bigger than the last-level cache of the machines this runs on (32 MiB here): copied
# before each timed call, so every contender starts with the caches cold.
EVICT_BYTES = 128 << 20
_evict: list[torch.Tensor] = []


def evict_caches() -> None:
    """Read EVICT_BYTES of other memory, so the caches hold none of what the last timed
    call touched (a copy of the same runs would find the source the one before left in
    the last-level cache: with 64 MiB maps the contender after ours gained up to 0.2x)."""
    if not _evict:
        _evict.extend(torch.ones(EVICT_BYTES, dtype=torch.uint8) for _ in range(2))
    _native.flat_stream(_evict[1].data_ptr(), _evict[0].data_ptr(), EVICT_BYTES, 1)


def race(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each function's median time, the functions taking turns (so a busy spell on a
    shared machine slows them alike), each call from cold caches, each round starting
    one function later (a copy right after another of the same runs measured up to
    0.05x faster than before it, caches evicted or not)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            evict_caches()
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def best_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def request_ids(cache: Cache, scattered: bool, rng: random.Random) -> list[int]:
    cp = cache.shard.cp_size if cache.shard is not None else 1  # a DCP block id: cp blocks of the request
    n = -(-TOKENS // (cache.block_size * cp))
    return rng.sample(range(cache.num_blocks), n) if scattered else list(range(n))


def run_scenario(
    label: str,
    src: Cache,
    dst: Cache,
    library: ctypes.CDLL,
    threads: list[int],
    repeats: int,
    rng: random.Random,
) -> list[str]:
    rows = []
    for scattered in (True, False):
        src_ids, dst_ids = request_ids(src, scattered, rng), request_ids(dst, scattered, rng)
        ids = "scattered" if scattered else "consecutive"
        rows.append(f"{label:<17}{ids:<12}" + measure(src, dst, src_ids, dst_ids, library, threads, repeats))
    return rows


def measure(
    src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int], library: ctypes.CDLL, threads: list[int],
    repeats: int,
) -> str:  # fmt: skip
    """One row's figures: the map, its build time beside a detection, copy bandwidths."""

    def build() -> Any:
        return block_map(
            src.kv, dst.kv, src_ids, dst_ids, src_shard=src.shard, dst_shard=dst.shard,
            src_block_size=src.page_block_size, dst_block_size=dst.page_block_size,
        )  # fmt: skip

    m = build()
    build_us = best_us(build, 20, repeats)
    detect_dst = dst.detect or (lambda: kvlayout.detect(dst.raw, dst.engine, dst.hints))
    detect_us = best_us(detect_dst, 20, repeats)
    runs = np.ascontiguousarray(m.runs)
    ends = np.cumsum(runs[:, 2]).astype(np.uint64)
    flat_src = torch.ones(m.num_bytes, dtype=torch.uint8)
    flat_dst = torch.empty_like(flat_src)
    cells = []
    for n in threads:
        for _ in range(MEASURE_CALLS):  # the pair measures whether to prefetch: past that
            m.copy(num_threads=n)
        ours, c, flat = race(
            [
                lambda n=n: m.copy(num_threads=n),
                lambda n=n: library.copy_runs(runs.ctypes.data, len(runs), ends.ctypes.data, n),
                lambda n=n: _native.flat_stream(flat_dst.data_ptr(), flat_src.data_ptr(), m.num_bytes, n),
            ],
            repeats,
        )
        cells.append(f"{m.num_bytes / ours / 1e9:>11.2f}{c / ours:>7.2f}x{flat / ours:>8.2f}x")
    flat_rows = np.array([[flat_src.data_ptr(), flat_dst.data_ptr(), m.num_bytes]], dtype=np.uint64)
    read, read_flat, write, write_flat = race(
        [
            lambda: library.read_runs(runs.ctypes.data, len(runs), 0),
            lambda: library.read_runs(flat_rows.ctypes.data, 1, 0),
            lambda: library.write_runs(runs.ctypes.data, len(runs), 1, 0),
            lambda: library.write_runs(flat_rows.ctypes.data, 1, 1, 0),
        ],
        repeats,
    )
    cells.append(f"{read_flat / read:>8.2f}x{write_flat / write:>8.2f}x")
    mean_kib = m.num_bytes / max(m.num_runs, 1) / 1024
    return (
        f"{m.num_runs:>8}{m.num_groups:>8}{m.num_bytes / 2**20:>8.1f}{mean_kib:>9.2f}"
        f"{build_us:>9.1f}{detect_us:>9.1f}{build_us / detect_us:>7.2f}x" + "".join(cells)
    )


# -- one mechanism: store/load as maps between a cache and a chunk (issue item 4) -------------

MECH_NB, MECH_BLOCKS, MECH_CHUNK = 1024, 256, 256  # bench-transfer's move on a smaller pool


def mechanism_cases() -> list[tuple[str, Any, Callable[[], Any]]]:
    """(label, format, a function that allocates the cache): one cache at a time fits."""
    from kvlayout import EngineKVFormat as F

    b, bs = MECH_NB, 16

    def t(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=DTYPE)

    return [
        ("1 flash-attn NHD", F.NL_X_TWO_NB_BS_NH_HS, lambda: [t(2, b, bs, NH, HS) for _ in range(NL)]),
        ("2 flash-infer NHD", F.NL_X_NB_TWO_BS_NH_HS, lambda: [t(b, 2, bs, NH, HS) for _ in range(NL)]),
        ("6 flash-attn HND", F.NL_X_TWO_NB_NH_BS_HS, lambda: [t(2, b, NH, bs, HS) for _ in range(NL)]),
        ("0 cross-layer", F.NB_NL_TWO_BS_NH_HS, lambda: t(b, NL, 2, bs, NH, HS)),
        ("3 MLA (HS=576)", F.NL_X_NB_BS_HS, lambda: [t(b, bs, MLA_HS) for _ in range(NL)]),
        (
            "9 SGLang MP",
            F.TWO_X_NL_X_NB_BS_NH_HS,
            lambda: [[t(b, bs, NH, HS) for _ in range(NL)] for _ in range(2)],
        ),
        ("13 fused K/V NHD", F.NL_X_NB_BS_NH_CS, lambda: [t(b, bs, NH, 2 * HS) for _ in range(NL)]),
    ]


def one_mechanism(repeats: int, rng: random.Random) -> list[str]:
    """Rows: the prepared plan's store and load beside the same moves as block maps (built
    per call, one map per chunk, then copied), one thread, in GB/s."""
    return [
        row
        for label, fmt, make in mechanism_cases()
        for row in mechanism_rows(label, fmt, make(), repeats, rng)
    ]


def mechanism_rows(label: str, fmt: Any, kv: Any, repeats: int, rng: random.Random) -> list[str]:
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import prepare
    from kvlayout.transfer.block_maps import chunk_side

    group = bind(kv, fmt).only_group()
    plan = prepare(group, fmt)
    ids = rng.sample(range(MECH_NB), MECH_BLOCKS)
    chunks = plan.chunks_for(len(ids), MECH_CHUNK)
    per = MECH_CHUNK // plan.block_size
    sides = [chunk_side(group, c) for c in chunks]
    parts = [ids[c * per : (c + 1) * per] for c in range(len(chunks))]
    nbytes = sum(c.numel() * c.element_size() for c in chunks)

    def maps(store: bool) -> list[Any]:
        return [
            block_map(group, side, part, [0]) if store else block_map(side, group, [0], part)
            for side, part in zip(sides, parts, strict=True)
        ]

    def map_store() -> None:
        for m in maps(True):
            m.copy()

    def map_load() -> None:
        for m in maps(False):
            m.copy()

    runs = sum(m.num_runs for m in maps(True))
    groups = sum(m.num_groups for m in maps(True))
    build = best_us(lambda: maps(True), 3, repeats)
    rows = []
    for direction, plan_move, map_move in (
        ("store", lambda: plan.store_blocks(ids, chunks), map_store),
        ("load", lambda: plan.load_blocks(ids, chunks), map_load),
    ):
        for _ in range(MEASURE_CALLS):
            plan_move(), map_move()
        ours, mapped = race([plan_move, map_move], repeats)
        rows.append(
            f"{label:<20}{direction:<7}{runs:>9}{groups:>8}{build:>11.0f}{nbytes / ours / 1e9:>11.2f}"
            f"{nbytes / mapped / 1e9:>11.2f}{ours / mapped:>9.2f}x"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--only", default="", help="run the scenarios whose label contains this")
    ap.add_argument("--no-mechanism", action="store_true", help="skip the store/load comparison")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(__doc__.split("\n\n")[1])
    print()
    head = "".join(f"{f'{n}thr GB/s':>11}{'vs C':>8}{'vs flat':>9}" for n in threads)
    header = (
        f"{'scenario':<17}{'block ids':<12}{'runs':>8}{'groups':>8}{'MiB':>8}{'mean KiB':>9}{'build us':>9}"
        f"{'detect':>9}{'b/det':>8}{head}{'src rd':>9}{'dst wr':>9}"
    )
    print(header)
    print("-" * len(header))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as workdir:
        library = c_library(Path(workdir))
        for label, make in SCENARIOS:
            if args.only not in label:
                continue
            for line in run_scenario(label, *make(), library, threads, args.repeats, rng):
                print(line, flush=True)
    print(
        "\nbuild us: one block_map call (the request's part); detect: one detection of the destination; "
        "vs C / vs flat: ours over the C copy of the same runs / a flat streaming copy of the same bytes; "
        "src rd / dst wr: the source runs read (destination runs written) with plain loads (stores), in list "
        "order, over as many bytes read (written) flat"
    )
    if args.no_mechanism:
        return
    print(
        f"\none mechanism: {MECH_BLOCKS} scattered blocks of 16 into chunks of {MECH_CHUNK} tokens and back, "
        "1 thread: the prepared plan (store_blocks/load_blocks) beside block maps to and from each chunk "
        "(built per call, then copied)"
    )
    columns = (
        ("runs", 9),
        ("groups", 8),
        ("build us", 11),
        ("plan GB/s", 11),
        ("maps GB/s", 11),
        ("maps/plan", 10),
    )
    header = f"{'format':<20}{'dir':<7}" + "".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    for line in one_mechanism(args.repeats, rng):
        print(line, flush=True)


if __name__ == "__main__":
    main()
