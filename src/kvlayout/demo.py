"""``kvlayout demo``: detection, geometry, kernel groups and a verified block round trip on
registrations shaped like real engines', on the CPU.

Each example is allocated the way its engine allocates it (real memory, random bytes),
detected, grouped, then 64 scattered blocks go to 256-token chunks and back:
  - the chunks are checked against the cache at sampled coordinates through the algebra's
    offset oracle (independent of the copy engine);
  - the cache is zeroed, the chunks loaded back, and storing again must give the same
    chunks byte for byte, while every byte outside the chosen blocks stays zero.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import kvlayout
from kvlayout.algebra import Coord
from kvlayout.transfer import chunk_shape, load_blocks, store_blocks

__all__ = ["EXAMPLES", "Example", "run_demo"]

BLOCKS, CHUNK_TOKENS, THREADS = 64, 256, 2


@dataclass
class Example:
    title: str
    engine: str
    build: Callable[[], Any]
    hints: dict[str, Any] = field(default_factory=dict)
    note: str = ""


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


def _leaves(kv: Any) -> Iterator[torch.Tensor]:
    if isinstance(kv, torch.Tensor):
        yield kv
    else:
        for item in kv:
            yield from _leaves(item)


def _sample_check(kv: Any, fmt: kvlayout.EngineKVFormat, ids: list[int], chunks: list[torch.Tensor]) -> int:
    """Chunk elements against the cache at random coordinates, through the offset oracle."""
    spec = kvlayout.get_spec(kv, fmt)
    layout, sizes = spec.layout, spec.sizes()
    leaves = [_path(kv, path) for path in layout.pointer_order(sizes)]  # the pointer table
    rng = random.Random(1)
    per_chunk = CHUNK_TOKENS // sizes["BS"]
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
    dtype0 = next(_leaves(raw)).dtype
    say(f"   registration   {count} tensor(s) {', '.join(shapes)} {dtype0}, hints {ex.hints}")
    kvlayout.normalize_kv_and_discover_format(raw, ex.engine, ex.hints)  # first call imports detectors
    t0 = time.perf_counter()
    fmt, kv = kvlayout.normalize_kv_and_discover_format(raw, ex.engine, ex.hints)
    detect_us = (time.perf_counter() - t0) * 1e6
    spec = kvlayout.get_spec(kv, fmt)
    say(f"   detected       {int(fmt)} {fmt.name}   {kvlayout.describe_shape(fmt)}   in {detect_us:.0f} us")
    say(f"   backend        {kvlayout.get_attention_backend(fmt)}")
    say(f"   concrete       {kvlayout.get_concrete_engine_kv_shape(kv, fmt)}")
    say(
        f"   geometry       {spec.num_layers()} layers, {spec.num_blocks()} blocks of {spec.block_size()} "
        f"tokens, {spec.num_heads()} head(s) x {spec.head_size()}, kv_size {spec.kv_size()}, {spec.dtype()}"
    )
    groups = kvlayout.group_layers_by_identity(kv, [fmt] * spec.num_layers())
    say(f"   kernel groups  {len(groups)}: " + "; ".join(f"{len(layers)} layers" for _, layers in groups))
    ids = random.Random(0).sample(range(spec.num_blocks()), BLOCKS)
    shape, dtype = chunk_shape(kv, fmt, CHUNK_TOKENS)
    # zeros, not empty: the pages are touched before the clock starts
    chunks = [torch.zeros(shape, dtype=dtype) for _ in range(BLOCKS * spec.block_size() // CHUNK_TOKENS)]
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    t0 = time.perf_counter()
    store_blocks(kv, fmt, ids, chunks, num_threads=THREADS)
    store_s = time.perf_counter() - t0
    checks = _sample_check(kv, fmt, ids, chunks)
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
    # Every value back in the cache came from a chunk: outside the chosen blocks all is zero.
    in_cache = sum(int(torch.count_nonzero(leaf)) for leaf in _leaves(kv))
    in_chunks = sum(int(torch.count_nonzero(c)) for c in chunks)
    verdict = "bytes verified" if restored and in_cache == in_chunks else "MISMATCH"
    say(
        f"   round trip     {BLOCKS} blocks ({nbytes / 2**20:.0f} MiB) in {len(chunks)} chunks of "
        f"{CHUNK_TOKENS} tokens: store {_gbs(nbytes, store_s)}, load {_gbs(nbytes, load_s)} "
        f"({THREADS} threads); {checks} sampled elements match the oracle; {verdict}"
    )
    if verdict != "bytes verified":
        raise AssertionError(f"{ex.title}: the round trip did not restore the blocks")
    say("")


def run_demo(say: Callable[[str], None] = print) -> int:
    say(__doc__.split("\n\n")[0].replace("\n", " ") + "\n")
    t0 = time.perf_counter()
    for ex in EXAMPLES:
        run_example(ex, say)
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
