"""``kvlayout demo``: detection, geometry, kernel groups and a verified block round trip,
on the CPU, for registrations shaped as real engines make them.

Each example is allocated the way its engine allocates it (real memory, random bytes),
detected, grouped, then 64 scattered blocks (fewer in a small pool) go to 256-token chunks
(one block per chunk when blocks are larger) and back, for each kernel group:
  - the chunks are checked against the cache at sampled coordinates through the algebra's
    offset oracle (independent of the copy engine);
  - the group's tensors are zeroed, the chunks loaded back, and storing again must give the
    same chunks byte for byte, while every byte of the group outside the chosen blocks
    stays zero.

The vLLM hybrid example (Qwen3.5-0.8B through the group edits) needs vLLM; without it the
demo says so and goes on. Then SGLang's Mamba state moves between TP degrees and into
its host pool (:mod:`kvlayout.tools.demo_states`), and the last section
(:mod:`kvlayout.tools.demo_pd`) moves one request from a prefill cache here to a decode
cache in another process through NIXL.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import kvlayout
from kvlayout.errors import index_ranges
from kvlayout.integrations.vllm import (
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
    validate_kv_cache_groups,
)
from kvlayout.integrations.vllm.specs import SpecKind, spec_kind
from kvlayout.layout.algebra import Coord
from kvlayout.registration.kernel_groups import KernelGroup
from kvlayout.registration.nesting import leaves
from kvlayout.registration.opaque import opaque_pages_of
from kvlayout.transfer import TransferPlan, prepare

__all__ = [
    "EXAMPLES",
    "HYBRID_TITLE",
    "OPTIONAL_EXAMPLES",
    "Example",
    "qwen3_5_hybrid",
    "run_demo",
    "run_example",
    "run_optional_example",
]

BLOCKS, CHUNK_TOKENS, THREADS = 64, 256, 2


@dataclass
class Example:
    title: str
    engine: str
    build: Callable[[], Any]
    hints: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # The engine's KV cache groups (layer indices) for a hybrid registration: detected per
    # layer, and each its own kernel group, since each has its own block table.
    groups: list[list[int]] | None = None
    details: tuple[str, ...] = ()  # printed under the note
    labels: dict[int, str] = field(default_factory=dict)  # what a layer is, where its format's label is not
    blocks: int = BLOCKS  # blocks per round trip; fewer than the pool leaves blocks that must stay zero


def _random(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(-128, 127, (n * dtype.itemsize,), dtype=torch.int8).view(torch.uint8)
    return raw.view(dtype).view(shape)


def _llama_nhd() -> Any:
    return [_random(2, 256, 16, 8, 128) for _ in range(32)]


def _llama_hnd() -> Any:
    # vLLM allocates HND physically and hands over an NHD-shaped permuted view.
    return [_random(2, 256, 8, 16, 128).permute(0, 1, 3, 2, 4) for _ in range(32)]


def _deepseek_mla() -> Any:
    return [_random(64, 64, 576) for _ in range(61)]


def _sglang_mp() -> Any:
    k = [_random(256 * 16, 8, 128) for _ in range(32)]
    v = [_random(256 * 16, 8, 128) for _ in range(32)]
    return [*k, *v]  # the MP adapter flattens [K pools..., V pools...]


def _sglang_host_pool() -> Any:
    return _random(2, 256 * 16, 32, 8, 128)  # mem_pool_host.kv_buffer, page_first: [2, size, NL, NH, HS]


def _trtllm_pool() -> Any:
    return _random(256, 32, 2, 8 * 16 * 128)  # [blocks, layers, K/V, heads * tokens * head]


EXAMPLES = [
    Example("Llama-3-8B on vLLM, flash-attention, NHD", "vllm", _llama_nhd, {"kv_layout": "NHD"}),
    Example(
        "Llama-3-8B on vLLM, flash-attention, HND",
        "vllm",
        _llama_hnd,
        {"kv_layout": "HND"},
        "registered as NHD-shaped permuted views; detection recovers the physical order",
    ),
    Example(
        "DeepSeek-V3 (MLA, 61 layers) on vLLM", "vllm", _deepseek_mla, {}, "one 576-wide latent row per token"
    ),
    Example(
        "Llama-3-8B on SGLang, multi-process registration",
        "sglang",
        _sglang_mp,
        {"tokens_per_block": 16, "kv_list_layout": "k_v"},
        "a flat [K pools..., V pools...] list of [NB*BS, NH, HS] pools, un-folded by tokens_per_block",
    ),
    Example(
        "Llama-3-8B on SGLang, HiCache host pool (page_first)",
        "sglang",
        _sglang_host_pool,
        {"hicache_layout": "page_first", "tokens_per_block": 16},
        "mem_pool_host.kv_buffer [2, size, NL, NH, HS]: a token's row holds every layer's; read in "
        "16-token pages",
    ),
    Example(
        "Llama-3-8B on TRT-LLM, one KV pool",
        "trtllm",
        _trtllm_pool,
        {"num_kv_heads": 8, "tokens_per_block": 16, "head_dim": 128},
        "a 4-D pool [NB, NL, 2, NH*BS*HS], un-flattened by the hints",
    ),
]

HYBRID_TITLE = (
    "Qwen3.5-0.8B hybrid (Gated DeltaNet + attention) on vLLM 0.33, FlashInfer kernel pages, "
    "through the group edits"
)


def qwen3_5_hybrid() -> Example:
    """Qwen3.5-0.8B as vLLM 0.33 allocates it, validated and edited the way a connector
    does before detection. Raises ImportError, saying what to install, without vLLM."""
    from kvlayout.testing import vllm as vx

    num_blocks = 8  # 6.4 MiB per block: 6 layers' pages of 1.06 MiB
    engine = vx.hybrid_engine(
        vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=num_blocks, layout=vx.KVCacheLayout.LBNHC
    )
    hints = vx.hints(hnd=False)  # LBNHC is vLLM's NHD
    validate_kv_cache_groups(engine.config)
    names = list(engine.layer_specs)  # model layer order
    groups = engine.config.kv_cache_groups

    def build() -> list[torch.Tensor]:
        buf, registered = vx.allocate_v033(engine)
        buf.copy_(_random(buf.numel(), dtype=torch.int8))
        edited = apply_kv_cache_group_edits(engine.config, registered, hints)
        return [edited[name] for name in names]

    # What vLLM registers and which rules re-view it, read from one (zeroed) allocation.
    buf, registered = vx.allocate_v033(engine)
    edited = apply_kv_cache_group_edits(engine.config, registered, hints)
    fired: Counter[str] = Counter()
    labels: dict[int, str] = {}
    for name, value in registered.items():
        spec = engine.spec_of(name)
        edit = find_kv_cache_group_edit(spec, value)
        if edit is not None and edited[name] is not value:
            fired[edit.name] += 1
            if opaque_pages_of(edited[name]) is None:  # kernel pages in token order: the block itself
                labels[names.index(name)] = (
                    f"FlashInfer attention, kernel pages viewed as blocks (vLLM group edit {edit.name})"
                )
            else:
                what = "Gated DeltaNet state" if spec_kind(spec) is SpecKind.MAMBA else "FlashInfer attention"
                labels[names.index(name)] = f"{what} pages, opaque (vLLM group edit {edit.name})"
    # Each view with its own dtype: the state rows are int8, the attention pages bf16.
    shapes = Counter(
        f"{str(registered[name].dtype).removeprefix('torch.')} {list(registered[name].shape)}"
        for name in names
    )
    block, kernel = groups[0].kv_cache_spec.block_size, min(engine.kernel_block_sizes)
    return Example(
        HYBRID_TITLE,
        "vllm",
        build,
        hints,
        f"{block}-token blocks: a Gated DeltaNet state row, or {block // kernel} FlashInfer pages of "
        f"{kernel} tokens",
        groups=[[names.index(name) for name in group.layer_names] for group in groups],
        details=(
            f"vLLM 0.33      {len(groups)} KV cache groups of {len(groups[0].layer_names)} layers overlaid "
            f"on one {buf.numel() / 2**20:.0f} MiB buffer; registered [B, H, N, C] views "
            + ", ".join(f"{n} x {shape}" for shape, n in shapes.items()),
            "group edits    " + ", ".join(f"{rule} x{n}" for rule, n in fired.items()),
            f"               state re-viewed as opaque pages [blocks, {block}, page bytes / {block}] int8 "
            f"(rows are byte runs: the 'tokens' and 'head' below); NHD attention's {block // kernel} kernel "
            f"pages a block are its {block} tokens in order, viewed as that block",
        ),
        blocks=num_blocks - 3,  # 3 blocks of each group must stay zero through the round trip
        labels=labels,
    )


# Examples that need an optional dependency: built when the demo runs, skipped with one
# line saying why when their import fails.
OPTIONAL_EXAMPLES: list[tuple[str, Callable[[], Example]]] = [(HYBRID_TITLE, qwen3_5_hybrid)]


def _sample_check(group: KernelGroup, ids: list[int], chunks: list[torch.Tensor], per_chunk: int) -> int:
    """Chunk elements against the cache at random coordinates, through the offset oracle."""
    plane = group.planes[0]
    layout, sizes, g = group.layout, plane.sizes, group.geometry
    block_size = group.block_size
    rng = random.Random(1)
    checks = 0
    for _ in range(200):
        i = rng.randrange(len(ids))
        c = Coord(
            layer=rng.randrange(len(group.layers)),
            kv=rng.randrange(g.kv_size),
            block=ids[i],
            token=rng.randrange(block_size),
            head=rng.randrange(g.num_heads),
            elem=rng.randrange(g.head_size),
        )
        pointer, offset = layout.offset(c, sizes, plane.block_stride)
        leaf = plane.leaves[pointer]  # the plane's pointer table
        cache_bytes = leaf.as_strided((1,), (1,), leaf.storage_offset() + offset).view(torch.uint8)
        t = (i % per_chunk) * block_size + c.token
        at = c.head * g.head_size + c.elem
        chunk_bytes = chunks[i // per_chunk][c.kv, c.layer, t, at : at + 1].view(torch.uint8)
        if not torch.equal(cache_bytes, chunk_bytes):
            raise AssertionError(f"chunk and cache differ at {c}")
        checks += 1
    return checks


def _gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def run_example(ex: Example, say: Callable[[str], None]) -> None:
    raw = ex.build()
    tensors = [t for _, t in leaves(raw)]
    shapes = sorted({str(list(t.shape)) for t in tensors})
    dtypes = sorted({str(t.dtype) for t in tensors})
    say(f"== {ex.title} ==")
    if ex.note:
        say(f"   {ex.note}")
    for line in ex.details:
        say(f"   {line}")
    listed = f"{len(tensors)} tensor(s) {', '.join(shapes)} {', '.join(dtypes)}"
    say(f"   registration   {listed}, hints {ex.hints}")
    kvlayout.detect(raw, ex.engine, ex.hints, layer_groups=ex.groups)  # the first imports the detectors
    t0 = time.perf_counter()
    registration = kvlayout.detect(raw, ex.engine, ex.hints, layer_groups=ex.groups)
    detect_us = (time.perf_counter() - t0) * 1e6
    say(f"   detected in    {detect_us:.0f} us: {len(registration.kernel_groups)} kernel group(s)")
    moved: set[int] = set()  # storages an earlier group's round trip zeroed
    for n, detected in enumerate(registration.kernel_groups):
        group = detected
        if _storages(group) & moved:
            # The groups share bytes (vLLM 0.33 overlays them), which an earlier round trip
            # left zero outside its blocks: this group moves a fresh build's random bytes.
            fresh = kvlayout.detect(ex.build(), ex.engine, ex.hints, layer_groups=ex.groups)
            group, moved = fresh.kernel_groups[n], set()
        moved |= _storages(group)
        fmt, g = group.format, group.geometry
        say(f"   group          layers {index_ranges(group.layers)}: {int(fmt)} {fmt.name}")
        say(f"     shape        {kvlayout.describe_shape(fmt)}")
        say(f"     backend      {ex.labels.get(group.layers[0], group.backend)}")
        say(f"     concrete     {group.concrete_shape()}")
        say(
            f"     geometry     {len(group.layers)} layers, {group.num_blocks} blocks of {group.block_size} "
            f"tokens, {g.num_heads} head(s) x {g.head_size}, kv_size {g.kv_size}, {g.dtype}"
        )
        _round_trip(group, ex, say)
    say("")


def _storages(group: KernelGroup) -> set[int]:
    return {int(leaf.untyped_storage().data_ptr()) for plane in group.planes for leaf in plane.leaves}


def _load(plan: TransferPlan, ids: list[int], chunks: list[torch.Tensor]) -> None:
    plan.load_blocks(ids, chunks, num_threads=THREADS)


def _round_trip(group: KernelGroup, ex: Example, say: Callable[[str], None]) -> None:
    plan = prepare(group, group.format)
    per_chunk = max(1, CHUNK_TOKENS // plan.block_size)
    tokens = per_chunk * plan.block_size
    ids = random.Random(0).sample(range(plan.num_blocks), min(ex.blocks, plan.num_blocks))
    shape, dtype = plan.chunk_shape(tokens)
    # zeros, not empty: the pages are touched before the clock starts
    chunks = [torch.zeros(shape, dtype=dtype) for _ in range(-(-len(ids) // per_chunk))]
    nbytes = len(ids) * plan.block_size * shape[0] * shape[1] * shape[3] * dtype.itemsize
    t0 = time.perf_counter()
    plan.store_blocks(ids, chunks, num_threads=THREADS)
    store_s = time.perf_counter() - t0
    checks = _sample_check(group, ids, chunks, per_chunk)
    cache = [leaf for p in group.planes for leaf in p.leaves]
    for leaf in cache:
        leaf.zero_()
    t0 = time.perf_counter()
    _load(plan, ids, chunks)
    load_s = time.perf_counter() - t0
    again = [torch.zeros_like(c) for c in chunks]
    plan.store_blocks(ids, again, num_threads=THREADS)
    restored = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(chunks, again, strict=True)
    )
    # Every value back in the group's tensors came from a chunk: outside the chosen blocks
    # all is zero. Only this group's tensors are counted, as only they were zeroed.
    in_cache = sum(int(torch.count_nonzero(leaf)) for leaf in cache)
    in_chunks = sum(int(torch.count_nonzero(c)) for c in chunks)
    verdict = "bytes verified" if restored and in_cache == in_chunks else "MISMATCH"
    say(
        f"     round trip   {len(ids)} blocks ({nbytes / 2**20:.0f} MiB) in {len(chunks)} chunk(s) of "
        f"{tokens} tokens: store {_gbs(nbytes, store_s)}, load {_gbs(nbytes, load_s)} "
        f"({THREADS} threads); {checks} sampled elements match the oracle; {verdict}"
    )
    if verdict != "bytes verified":
        raise AssertionError(f"{ex.title}: the round trip did not restore the blocks")


def run_optional_example(title: str, make: Callable[[], Example], say: Callable[[str], None]) -> None:
    try:
        ex = make()
    except ImportError as e:
        say(f"== {title} == skipped: {e}")
        say("")
        return
    run_example(ex, say)


def run_demo(say: Callable[[str], None] = print) -> int:
    say(__doc__.split("\n\n")[0].replace("\n", " ") + "\n")
    t0 = time.perf_counter()
    for ex in EXAMPLES:
        run_example(ex, say)
    for title, make in OPTIONAL_EXAMPLES:
        run_optional_example(title, make, say)
    from kvlayout.tools.demo_pd import run_pd_demo
    from kvlayout.tools.demo_states import run_states_demo

    run_states_demo(say)
    run_pd_demo(say)
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
