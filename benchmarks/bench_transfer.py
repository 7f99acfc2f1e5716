"""Block transfer bandwidth: kvlayout's native path against a C gather, a plain copy and torch.

A Llama-3-8B-like cache (32 layers, 8 KV heads of 128, 16-token blocks, bf16, a pool of
2048 blocks per layer, so the source is cold) moves 256 scattered blocks into 256-token
chunks of 16 blocks, and back. In the same run, for the same bytes:
  - C gather: plain C that copies exactly the runs our plan copies, one ``memcpy`` per
    contiguous run, on the row's thread count (compiled here with the system C compiler;
    its block-major and layer-major orders both run, the faster counts; its output is
    checked equal to ours first);
  - flat stream: one contiguous buffer of that many bytes copied with 32-byte loads and
    non-temporal stores (``kvlayout._native.flat_stream``, C++ in the extension), on the
    row's thread count, timed alternately with ours: the machine's streaming limit;
  - plain copy: ``dst.copy_(src)`` of one contiguous buffer of that many bytes;
  - best torch: ``index_select``/``index_copy_`` into preallocated buffers (a strided view
    per K/V half where torch can take one, a gather plus transposing copy where it cannot),
    on the row's thread count or fewer, whichever was faster.
Each figure is the median of several runs, in GB/s; ratios are ours over each baseline.
Ours is a prepared plan (``kvlayout.transfer.prepare`` once, then one call per move),
timed after the calls over which it measures whether prefetching ahead of its copies is
faster on this machine (``csrc/prefetch_choice.h``).
SGLang MP is registered as SGLang does it (32 K pools then 32 V pools ``[NB*BS, NH, HS]``,
``tokens_per_block=16``, ``kv_list_layout='k_v'``) and detected.

Then the fixed cost of one prepared call (16 block ids, one chunk, every block skipped:
the per-call checks and the native call, no bytes) beside one detection of the same
registration, for a 32-layer Llama-3-8B and a 61-layer DeepSeek-V3 MLA cache; the target
is at most 0.5x a detection. The unprepared row is ``store_blocks`` on a plain list (not
detection's registration), which checks the whole registration on every call.
Run with ``make bench-transfer``.
"""

from __future__ import annotations

import os
import sys

# torch's OpenMP workers spin for a while after each parallel op; on a 2-core machine they
# would steal the cores from whatever runs next (our threads, or torch's next baseline).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# --huge-pages: torch backs every allocation of 2 MiB or more (the caches, chunks and flat
# buffers alike) with 2 MiB pages; it reads THP_MEM_ALLOC_ENABLE at its first allocation.
if "--huge-pages" in sys.argv:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

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
from kvlayout import EngineKVFormat as F
from kvlayout import _native
from kvlayout.transfer import prepare, store_blocks

NL, NB, BS, NH, HS, MLA_HS = 32, 2048, 16, 8, 128, 576
BLOCKS, CHUNK_TOKENS = 256, 256
PER_CHUNK = CHUNK_TOKENS // BS
DTYPE = torch.bfloat16
# A plan measures, over its first calls, whether its copies are faster prefetching ahead
# or not (csrc/prefetch_choice.h); the figures are of the calls after those.
MEASURE_CALLS = 2 * _native.PrefetchChoice.warm + 2


# The reference: for each block (or each chunk slab), for each (kv, layer) slab, an
# outer x inner loop of contiguous runs, one memcpy each. Blocks are split over threads
# in contiguous parts, as ours does.
C_GATHER = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  int store, layer_major;
  int64_t lo, hi, per_chunk, block_tokens, tokens, row, slabs, block_stride;
  const int64_t* ids;
  char* const* chunks;
  char* const* slab_base;
  int64_t n_outer, cache_outer, chunk_outer, n_inner, cache_inner, chunk_inner, run;
} Gather;

static void move(const Gather* g, int64_t i, int64_t s) {
  char* chunk = g->chunks[i / g->per_chunk] + (s * g->tokens + i % g->per_chunk * g->block_tokens) * g->row;
  char* cache = g->slab_base[s] + g->ids[i] * g->block_stride;
  for (int64_t o = 0; o < g->n_outer; ++o)
    for (int64_t n = 0; n < g->n_inner; ++n) {
      char* c = chunk + o * g->chunk_outer + n * g->chunk_inner;
      char* k = cache + o * g->cache_outer + n * g->cache_inner;
      if (g->store) memcpy(c, k, g->run); else memcpy(k, c, g->run);
    }
}

static void* part(void* arg) {
  const Gather* g = arg;
  if (!g->layer_major) {
    for (int64_t i = g->lo; i < g->hi; ++i)
      for (int64_t s = 0; s < g->slabs; ++s) move(g, i, s);
    return 0;
  }
  for (int64_t c0 = g->lo - g->lo % g->per_chunk; c0 < g->hi; c0 += g->per_chunk) {
    int64_t i0 = c0 > g->lo ? c0 : g->lo, i1 = c0 + g->per_chunk < g->hi ? c0 + g->per_chunk : g->hi;
    for (int64_t s = 0; s < g->slabs; ++s)
      for (int64_t i = i0; i < i1; ++i) move(g, i, s);
  }
  return 0;
}

void gather(const Gather* g, int64_t n_blocks, int threads) {
  Gather parts[64];
  pthread_t tids[64];
  if (threads > 64) threads = 64;
  int64_t per = (n_blocks + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    parts[t] = *g;
    parts[t].lo = t * per;
    parts[t].hi = (t + 1) * per < n_blocks ? (t + 1) * per : n_blocks;
  }
  for (int t = 1; t < threads; ++t) pthread_create(&tids[t], 0, part, &parts[t]);
  part(&parts[0]);
  for (int t = 1; t < threads; ++t) pthread_join(tids[t], 0);
}
"""


class Gather(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("store", "layer_major")),
        *((name, ctypes.c_int64) for name in ("lo", "hi", "per_chunk", "block_tokens", "tokens", "row",
                                              "slabs", "block_stride")),
        ("ids", ctypes.c_void_p),
        ("chunks", ctypes.c_void_p),
        ("slab_base", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("n_outer", "cache_outer", "chunk_outer",
                                              "n_inner", "cache_inner", "chunk_inner", "run")),
    ]  # fmt: skip


def c_gather_library(workdir: Path) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if cc is None:
        raise SystemExit("bench_transfer needs a C compiler (cc, gcc or g++) for its C gather baseline")
    src, lib = workdir / "gather.c", workdir / "gather.so"
    src.write_text(C_GATHER)
    language = ["-x", "c"] if not cc.endswith("++") else ["-x", "c++", "-fpermissive", "-w"]
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", *language, str(src), "-o", str(lib), "-lpthread"], check=True
    )
    library = ctypes.CDLL(str(lib))
    library.gather.argtypes = [ctypes.POINTER(Gather), ctypes.c_int64, ctypes.c_int]
    library.gather.restype = None
    return library


@dataclass(frozen=True)
class Runs:
    """A format's contiguous runs: per (layer, K/V) slab a [NB, ...] view of the cache, and
    within a block ``outer x inner`` runs of ``run`` bytes (strides in bytes)."""

    view: Callable[[int, int], torch.Tensor]
    outer: tuple[int, int, int] = (1, 0, 0)  # count, cache stride, chunk stride
    inner: tuple[int, int, int] = (1, 0, 0)
    run: int = 0  # 0: the whole block


@dataclass
class Case:
    fmt: F
    label: str
    kv: Any
    kv_size: int
    runs: Runs
    gather: Callable[[list[torch.Tensor], list[torch.Tensor]], None]  # torch store
    scatter: Callable[[list[torch.Tensor], list[torch.Tensor]], None]  # torch load


def _per_half(
    views: Callable[[int, int], torch.Tensor], kv_size: int, block_shape: tuple[int, ...]
) -> tuple[Any, Any]:
    """torch store/load through a strided view of each (layer, K/V half): no temporaries."""

    def gather(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(kv_size):
                    torch.index_select(
                        views(layer, k), 0, ids[c], out=chunk[k, layer].view(PER_CHUNK, *block_shape)
                    )

    def scatter(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(kv_size):
                    views(layer, k).index_copy_(0, ids[c], chunk[k, layer].view(PER_CHUNK, *block_shape))

    return gather, scatter


def _hnd_halves(kv: list[torch.Tensor]) -> tuple[Any, Any]:
    """HND must transpose heads and tokens: gather into a buffer, then a transposing copy."""
    tmp = torch.empty(PER_CHUNK, NH, BS, HS, dtype=DTYPE)

    def gather(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(2):
                    torch.index_select(kv[layer][k], 0, ids[c], out=tmp)
                    chunk[k, layer].view(PER_CHUNK, BS, NH, HS).copy_(tmp.transpose(1, 2))

    def scatter(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(2):
                    tmp.copy_(chunk[k, layer].view(PER_CHUNK, BS, NH, HS).transpose(1, 2))
                    kv[layer][k].index_copy_(0, ids[c], tmp)

    return gather, scatter


def make_case(fmt: F) -> Case:
    def zeros(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=DTYPE)  # touched, so pages are resident

    def per_half(label: str, kv: Any, views: Callable[[int, int], torch.Tensor], kv_size: int,
                 block_shape: tuple[int, ...]) -> Case:  # fmt: skip
        return Case(fmt, label, kv, kv_size, Runs(views), *_per_half(views, kv_size, block_shape))

    if fmt == F.NL_X_TWO_NB_BS_NH_HS:
        kv = [zeros(2, NB, BS, NH, HS) for _ in range(NL)]
        return per_half("1 flash-attn NHD", kv, lambda layer, k: kv[layer][k], 2, (BS, NH, HS))
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:
        kv = [zeros(NB, 2, BS, NH, HS) for _ in range(NL)]
        return per_half("2 flash-infer NHD", kv, lambda layer, k: kv[layer][:, k], 2, (BS, NH, HS))
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        kv = [zeros(2, NB, NH, BS, HS) for _ in range(NL)]
        e = DTYPE.itemsize
        st = kv[0][0].stride()
        runs = Runs(
            lambda layer, k: kv[layer][k], (NH, st[1] * e, HS * e), (BS, st[2] * e, NH * HS * e), HS * e
        )
        return Case(fmt, "6 flash-attn HND", kv, 2, runs, *_hnd_halves(kv))
    if fmt == F.NB_NL_TWO_BS_NH_HS:
        t = zeros(NB, NL, 2, BS, NH, HS)
        return per_half("0 cross-layer", t, lambda layer, k: t[:, layer, k], 2, (BS, NH, HS))
    if fmt == F.NL_X_NB_BS_HS:
        kv = [zeros(NB, BS, MLA_HS) for _ in range(NL)]
        return per_half(f"3 MLA (HS={MLA_HS})", kv, lambda layer, k: kv[layer], 1, (BS, MLA_HS))
    if fmt == F.TWO_X_NL_X_NB_BS_NH_HS:
        pools = [zeros(NB * BS, NH, HS) for _ in range(2 * NL)]  # 32 K pools, then 32 V pools
        hints = {"tokens_per_block": BS, "kv_list_layout": "k_v"}
        found, kv = kvlayout.normalize_kv_and_discover_format(pools, "sglang", hints)
        assert found == fmt, found
        blocks = [p.view(NB, BS, NH, HS) for p in pools]
        return per_half("9 SGLang MP", kv, lambda layer, k: blocks[k * NL + layer], 2, (BS, NH, HS))
    if fmt == F.NL_X_NB_BS_NH_CS:
        kv = [zeros(NB, BS, NH, 2 * HS) for _ in range(NL)]
        return per_half("13 fused K/V NHD", kv, lambda layer, k: kv[layer], 1, (BS, NH, 2 * HS))
    raise ValueError(fmt)


class CGather:
    """The C gather of one case's runs into (or out of) a list of chunks."""

    def __init__(
        self, library: ctypes.CDLL, case: Case, block_ids: list[int], chunks: list[torch.Tensor]
    ) -> None:
        self.library = library
        e = DTYPE.itemsize
        first = case.runs.view(0, 0)
        run = case.runs.run or first[0].numel() * e
        slabs = [case.runs.view(layer, k) for k in range(case.kv_size) for layer in range(NL)]
        self.keep = [
            np.array(block_ids, dtype=np.int64),
            np.array([c.data_ptr() for c in chunks], dtype=np.uint64),
            np.array([v.data_ptr() for v in slabs], dtype=np.uint64),
        ]
        ids, chunk_ptrs, bases = (a.ctypes.data for a in self.keep)
        row = chunks[0].shape[-1] * e
        self.args = Gather(
            0, 0, 0, 0, PER_CHUNK, BS, CHUNK_TOKENS, row, case.kv_size * NL, first.stride(0) * e,
            ids, chunk_ptrs, bases, *case.runs.outer, *case.runs.inner, run,
        )  # fmt: skip
        self.blocks = len(block_ids)

    def __call__(self, store: bool, layer_major: bool, threads: int) -> None:
        self.args.store, self.args.layer_major = int(store), int(layer_major)
        self.library.gather(ctypes.byref(self.args), self.blocks, threads)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (page faults, thread pools)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def timed_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` run alternately, so both see the same machine load."""
    a(), b()
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, runs[0]), (b, runs[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(runs[0]), statistics.median(runs[1])


def run_format(
    case: Case,
    library: ctypes.CDLL,
    block_ids: list[int],
    ids: list[torch.Tensor],
    thread_counts: list[int],
    repeats: int,
) -> list[str]:
    """One format's table rows: store and load, for each thread count."""
    plan = prepare(case.kv, case.fmt)
    shape, dtype = plan.chunk_shape(CHUNK_TOKENS)
    chunks = [torch.ones(shape, dtype=dtype) for _ in ids]
    gather = CGather(library, case, block_ids, chunks)
    check_same_runs(plan, gather, block_ids, chunks)
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    src = torch.ones(nbytes // 2, dtype=DTYPE)
    dst = torch.empty_like(src)
    rows = []
    torch_best: dict[str, float] = {}  # torch may do better on fewer threads: keep its best
    for threads in thread_counts:
        torch.set_num_threads(threads)
        plain = timed(lambda: dst.copy_(src), repeats)
        moves = (("store", plan.store_blocks, case.gather), ("load", plan.load_blocks, case.scatter))
        for direction, ours_move, torch_move in moves:

            def ours_run(move: Callable[..., None] = ours_move, n: int = threads) -> None:
                move(block_ids, chunks, num_threads=n)

            def torch_run(move: Callable[..., None] = torch_move) -> None:
                move(ids, chunks)

            def c_run(layer_major: bool, store: bool = direction == "store", n: int = threads) -> None:
                gather(store, layer_major, n)

            def flat_run(n: int = threads) -> None:
                _native.flat_stream(dst.data_ptr(), src.data_ptr(), nbytes, n)

            for _ in range(MEASURE_CALLS):  # the plan measures whether to prefetch: past that
                ours_run()
            ours, flat = timed_pair(ours_run, flat_run, repeats)
            c_best = min(timed(lambda: c_run(False), repeats), timed(lambda: c_run(True), repeats))
            best_torch = min(timed(torch_run, repeats), torch_best.get(direction, float("inf")))
            torch_best[direction] = best_torch
            gbs = [nbytes / t / 1e9 for t in (ours, c_best, flat, plain, best_torch)]
            rows.append(
                f"{case.label:<20}{direction:<6}{threads:>4}{gbs[0]:>10.2f}{gbs[1]:>8.2f}{gbs[2]:>10.2f}"
                f"{gbs[3]:>10.2f}{gbs[4]:>11.2f}{c_best / ours:>8.2f}x{flat / ours:>8.2f}x"
                f"{plain / ours:>8.2f}x{best_torch / ours:>9.2f}x"
            )
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        rows.append(f"  (the process's memory on 2 MiB pages while it ran: {huge_pages_in_use()})")
    return rows


def check_same_runs(plan: Any, gather: CGather, block_ids: list[int], chunks: list[torch.Tensor]) -> None:
    """The C gather and ours write the same bytes (so they copy the same runs)."""
    for c in chunks:
        c.zero_()
    gather(True, False, 1)
    theirs = [c.clone() for c in chunks]
    for c in chunks:
        c.zero_()
    plan.store_blocks(block_ids, chunks)
    if not all(torch.equal(a, b) for a, b in zip(theirs, chunks, strict=True)):
        raise SystemExit(f"{plan}: the C gather and ours disagree; the benchmark's runs are wrong")


def fixed_cost(repeats: int) -> list[str]:
    """Rows: one prepared call with no bytes to move, against one detection."""

    def llama() -> list[torch.Tensor]:
        return [torch.zeros(2, 256, BS, NH, HS, dtype=DTYPE) for _ in range(NL)]

    def deepseek() -> list[torch.Tensor]:
        return [torch.zeros(64, 64, MLA_HS, dtype=DTYPE) for _ in range(61)]

    cases = (
        ("Llama-3-8B, 32 layers", llama, {"kv_layout": "NHD"}),
        ("DeepSeek-V3 MLA, 61 layers", deepseek, {}),
    )
    rows = []
    for label, build, hints in cases:
        raw = build()
        fmt, kv = kvlayout.normalize_kv_and_discover_format(raw, "vllm", hints)
        plan = prepare(kv, fmt)
        ids = list(range(CHUNK_TOKENS // plan.block_size))
        chunk = torch.empty(plan.chunk_shape(CHUNK_TOKENS)[0], dtype=DTYPE)
        plain = list(kv)

        def detect(raw: Any = raw, hints: dict[str, str] = hints) -> None:
            kvlayout.normalize_kv_and_discover_format(raw, "vllm", hints)

        def prepared(plan: Any = plan, ids: list[int] = ids, chunk: torch.Tensor = chunk) -> None:
            plan.store_blocks(ids, [chunk], skip_prefix_n_blocks=len(ids))

        def unprepared(
            plain: list[Any] = plain, fmt: F = fmt, ids: list[int] = ids, chunk: Any = chunk
        ) -> None:
            store_blocks(plain, fmt, ids, [chunk], skip_prefix_n_blocks=len(ids))

        us = [best_us(fn, 200, repeats) for fn in (detect, prepared, unprepared)]
        ratios = f"{us[1] / us[0]:>12.2f}x{us[2] / us[0]:>14.2f}x"
        rows.append(f"{label:<28}{us[0]:>10.1f}{us[1]:>12.1f}{us[2]:>13.1f}{ratios}")
    return rows


def best_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def pages(huge: bool) -> str:
    """What the tensors were allocated on, as a line for the table's head."""
    if not huge:
        return "pages: the allocator's (4 KiB unless transparent huge pages are 'always'; --huge-pages)"
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    setting = mode.read_text().strip() if mode.exists() else "unknown"
    return f"pages: 2 MiB where the kernel gives them (transparent huge pages: {setting})"


def huge_pages_in_use() -> str:
    """The process's anonymous memory on 2 MiB pages, from /proc/self/smaps_rollup."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return f"{int(line.split()[1]) >> 10} MiB"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument(
        "--huge-pages", action="store_true", help="allocate every tensor on 2 MiB (transparent huge) pages"
    )
    args = ap.parse_args()
    rng = random.Random(0)
    block_ids = rng.sample(range(NB), BLOCKS)
    ids = [torch.tensor(block_ids[i : i + PER_CHUNK]) for i in range(0, BLOCKS, PER_CHUNK)]
    print(__doc__.split("\n\n")[1].replace("\n", " "))
    print(pages(args.huge_pages))
    print()
    header = (
        f"{'format':<20}{'dir':<6}{'thr':>4}{'ours GB/s':>10}{'C GB/s':>8}{'flat GB/s':>10}{'copy GB/s':>10}"
        f"{'torch GB/s':>11}{'vs C':>9}{'vs flat':>9}{'vs copy':>9}{'vs torch':>10}"
    )
    print(header)
    print("-" * len(header))
    threads = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        library = c_gather_library(Path(workdir))
        for fmt in (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS,
                    F.NB_NL_TWO_BS_NH_HS, F.NL_X_NB_BS_HS, F.TWO_X_NL_X_NB_BS_NH_HS,
                    F.NL_X_NB_BS_NH_CS):  # fmt: skip
            for line in run_format(make_case(fmt), library, block_ids, ids, threads, args.repeats):
                print(line, flush=True)
    print(
        "\nvs C / vs flat / vs copy / vs torch = ours over the C gather / flat stream / plain copy / "
        "best torch bandwidth (higher is better; targets: one thread, vs flat >= 0.9x NHD-like, >= 0.8x HND)"
    )
    print("\nfixed cost of one call, microseconds (best of several runs; target: prepared <= 0.5x detection)")
    header = (
        f"{'registration':<28}{'detection':>10}{'prepared':>12}{'unprepared':>13}"
        f"{'prepared/det':>13}{'unprepared/det':>15}"
    )
    print(header)
    print("-" * len(header))
    for line in fixed_cost(max(args.repeats, 5)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
