"""``kvlayout demo``: detection, geometry, kernel groups and a verified block round trip on
registrations shaped like real engines', on the CPU.

Each example is allocated the way its engine allocates it (real memory, random bytes),
detected, grouped, then 64 scattered blocks (fewer in a small pool) go to 256-token chunks
(one block per chunk when blocks are larger) and back, for each kernel group:
  - the chunks are checked against the cache at sampled coordinates through the algebra's
    offset oracle (independent of the copy engine);
  - the group's tensors are zeroed, the chunks loaded back, and storing again must give the
    same chunks byte for byte, while every byte of the group outside the chosen blocks
    stays zero.

The vLLM hybrid example (Qwen3.5-0.8B through the group edits) needs vLLM; without it the
demo says so and goes on.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import kvlayout
from kvlayout.algebra import Coord
from kvlayout.explain import index_ranges
from kvlayout.integrations.vllm import (
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
    validate_kv_cache_groups,
)
from kvlayout.transfer import chunk_shape, load_blocks, store_blocks

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
    from kvlayout.integrations.vllm import examples as vx

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
    for name, value in registered.items():
        edit = find_kv_cache_group_edit(engine.spec_of(name), value)
        if edit is not None and edited[name] is not value:
            fired[edit.name] += 1
    shapes = Counter(f"{list(registered[name].shape)}" for name in names)
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
            f"on one {buf.numel() / 2**20:.0f} MiB buffer; registered int8 [B, H, N, C] views "
            + ", ".join(f"{n} x {shape}" for shape, n in shapes.items()),
            "group edits    " + ", ".join(f"{rule} x{n}" for rule, n in fired.items()),
            f"               every layer re-viewed as opaque pages [blocks, {block}, page bytes / {block}] "
            "int8: the block dim is vLLM's block id, rows are byte runs (the 'tokens' and 'head' below)",
        ),
        blocks=num_blocks - 3,  # 3 blocks of each group must stay zero through the round trip
    )


# Examples that need an optional dependency: built when the demo runs, skipped with one
# line saying why when their import fails.
OPTIONAL_EXAMPLES: list[tuple[str, Callable[[], Example]]] = [(HYBRID_TITLE, qwen3_5_hybrid)]


def _leaves(kv: Any) -> Iterator[torch.Tensor]:
    if isinstance(kv, torch.Tensor):
        yield kv
    else:
        for item in kv:
            yield from _leaves(item)


def _sample_check(
    kv: Any, fmt: kvlayout.EngineKVFormat, ids: list[int], chunks: list[torch.Tensor], per_chunk: int
) -> int:
    """Chunk elements against the cache at random coordinates, through the offset oracle."""
    spec = kvlayout.get_spec(kv, fmt)
    layout, sizes = spec.layout, spec.sizes()
    leaves = [_path(kv, path) for path in layout.pointer_order(sizes)]  # the pointer table
    rng = random.Random(1)
    checks = 0
    for _ in range(200):
        i = rng.randrange(len(ids))
        c = Coord(
            layer=rng.randrange(spec.num_layers()),
            kv=rng.randrange(spec.kv_size()),
            block=ids[i],
            token=rng.randrange(sizes["BS"]),
            head=rng.randrange(spec.num_heads()),
            elem=rng.randrange(spec.head_size()),
        )
        pointer, offset = layout.offset(
            c, sizes, int(leaves[0].stride(0)) if layout.has_leading_block_axis else None
        )
        leaf = leaves[pointer]
        cache_bytes = leaf.as_strided((1,), (1,), leaf.storage_offset() + offset).view(torch.uint8)
        t = (i % per_chunk) * sizes["BS"] + c.token
        at = c.head * spec.head_size() + c.elem
        chunk_bytes = chunks[i // per_chunk][c.kv, c.layer, t, at : at + 1].view(torch.uint8)
        if not torch.equal(cache_bytes, chunk_bytes):
            raise AssertionError(f"chunk and cache differ at {c}")
        checks += 1
    return checks


def _path(kv: Any, path: tuple[int, ...]) -> torch.Tensor:
    node = kv
    for i in path:
        node = node[i]
    assert isinstance(node, torch.Tensor)
    return node


def _gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def run_example(ex: Example, say: Callable[[str], None]) -> None:
    raw = ex.build()
    shapes = sorted({str(list(t.shape)) for t in _leaves(raw)})
    count = sum(1 for _ in _leaves(raw))
    say(f"== {ex.title} ==")
    if ex.note:
        say(f"   {ex.note}")
    for line in ex.details:
        say(f"   {line}")
    dtypes = sorted({str(t.dtype) for t in _leaves(raw)})
    say(f"   registration   {count} tensor(s) {', '.join(shapes)} {', '.join(dtypes)}, hints {ex.hints}")
    detect = _detect(ex)
    detect(raw)  # the first call imports the detectors
    t0 = time.perf_counter()
    kv, formats = detect(raw)
    detect_us = (time.perf_counter() - t0) * 1e6
    grouped = kvlayout.group_layers_by_identity(kv, formats, _engine_groups(ex, len(formats)))
    say(f"   detected in    {detect_us:.0f} us: {len(grouped)} kernel group(s)")
    moved: set[int] = set()  # storages an earlier group's round trip zeroed
    for identity, layers in grouped:
        fmt = identity.engine_kv_format
        part = _part(kv, fmt, layers)
        if _storages(part) & moved:
            # The groups share bytes (vLLM 0.33 overlays them), which an earlier round trip
            # left zero outside its blocks: this group moves a fresh build's random bytes.
            kv, _ = detect(ex.build())
            part, moved = _part(kv, fmt, layers), set()
        moved |= _storages(part)
        spec = kvlayout.get_spec(part, fmt)
        say(f"   group          layers {index_ranges(layers)}: {int(fmt)} {fmt.name}")
        say(f"     shape        {kvlayout.describe_shape(fmt)}")
        say(f"     backend      {kvlayout.get_attention_backend(fmt)}")
        say(f"     concrete     {kvlayout.get_concrete_engine_kv_shape(part, fmt)}")
        say(
            f"     geometry     {spec.num_layers()} layers, {spec.num_blocks()} blocks of "
            f"{spec.block_size()} tokens, {spec.num_heads()} head(s) x {spec.head_size()}, "
            f"kv_size {spec.kv_size()}, {spec.dtype()}"
        )
        _round_trip(part, fmt, ex, say)
    say("")


def _engine_groups(ex: Example, num_layers: int) -> list[int] | None:
    """Each layer's engine group (index into ``ex.groups``; excluded when in none)."""
    if ex.groups is None:
        return None
    owner = {i: g for g, layers in enumerate(ex.groups) for i in layers}
    return [owner.get(i, kvlayout.EXCLUDED_ENGINE_GROUP) for i in range(num_layers)]


def _part(kv: Any, fmt: kvlayout.EngineKVFormat, layers: list[int]) -> Any:
    return [kv[i] for i in layers] if kvlayout.get_spec_class(fmt).is_layer_list else kv


def _storages(kv: Any) -> set[int]:
    return {int(leaf.untyped_storage().data_ptr()) for leaf in _leaves(kv)}


def _detect(ex: Example) -> Callable[[Any], tuple[Any, list[Any]]]:
    def whole(raw: Any) -> tuple[Any, list[Any]]:
        fmt, kv = kvlayout.normalize_kv_and_discover_format(raw, ex.engine, ex.hints)
        return kv, [fmt] * kvlayout.get_num_layers(kv, fmt)

    def per_layer(raw: Any) -> tuple[Any, list[Any]]:
        kv, formats = kvlayout.normalize_and_discover_per_layer_formats(raw, ex.groups, ex.engine, ex.hints)
        return kv, list(formats)

    return whole if ex.groups is None else per_layer


def _round_trip(kv: Any, fmt: kvlayout.EngineKVFormat, ex: Example, say: Callable[[str], None]) -> None:
    spec = kvlayout.get_spec(kv, fmt)
    block_size = spec.block_size()
    per_chunk = max(1, CHUNK_TOKENS // block_size)
    tokens = per_chunk * block_size
    ids = random.Random(0).sample(range(spec.num_blocks()), min(ex.blocks, spec.num_blocks()))
    shape, dtype = chunk_shape(kv, fmt, tokens)
    # zeros, not empty: the pages are touched before the clock starts
    chunks = [torch.zeros(shape, dtype=dtype) for _ in range(-(-len(ids) // per_chunk))]
    nbytes = len(ids) * block_size * shape[0] * shape[1] * shape[3] * dtype.itemsize
    t0 = time.perf_counter()
    store_blocks(kv, fmt, ids, chunks, num_threads=THREADS)
    store_s = time.perf_counter() - t0
    checks = _sample_check(kv, fmt, ids, chunks, per_chunk)
    for leaf in _leaves(kv):
        leaf.zero_()
    t0 = time.perf_counter()
    load_blocks(kv, fmt, ids, chunks, num_threads=THREADS)
    load_s = time.perf_counter() - t0
    again = [torch.zeros_like(c) for c in chunks]
    store_blocks(kv, fmt, ids, again, num_threads=THREADS)
    restored = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(chunks, again, strict=True)
    )
    # Every value back in the group's tensors came from a chunk: outside the chosen blocks
    # all is zero. Only this group's tensors are counted, as only they were zeroed.
    in_cache = sum(int(torch.count_nonzero(leaf)) for leaf in _leaves(kv))
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
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
