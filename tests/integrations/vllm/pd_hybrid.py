"""Hybrid vLLM 0.33 ranks for P/D tests, and their oracle from vLLM's own indexing.

Two small models, each rank's cache allocated as vLLM 0.33 allocates it
(``kvlayout.testing.vllm``: its spec classes, ``get_kv_cache_groups``' grouping, hybrid
block sizing, ``create_kv_cache_views``) and read by a connector as the docs say
(``validate_kv_cache_groups``, ``apply_kv_cache_group_edits`` and ``transfer_layers`` with
``prefix_reuse=False``, ``detect`` with the groups):

- ``"swa"``: gpt-oss-like, sliding-window (128) and full attention layers alternating,
  8 KV heads of 64, FlashAttention blocks of 16: two KV cache groups.
- ``"gdn"``: Qwen3-Next-like, Gated DeltaNet (conv ``[Q | K | V]`` in the ``"DS"`` order
  vLLM's NixlConnector requires, SSM heads) beside full attention (2 KV heads, so TP 4
  replicates them), FlashInfer kernel pages, Mamba ``'none'`` mode (prefix caching off);
  ``"gdn-align"`` the same in ``'align'`` mode (prefix caching on), a state page a block;
  ``"qwen3-next-align"`` Qwen3-Next-80B-A3B's own sizes (8 of its layers) in ``'align'``
  mode, whose blocks are 544 tokens at TP 2 and 272 at TP 4; ``"gdn-hnd"`` in the
  ``LBHNC`` layout vLLM's NixlConnector asks of a model without MLA (FlashInfer's HND kernel
  pages of 16, three a block of 48 at TP 1 and 2), ``"gdn-fa-hnd"`` the same on
  FlashAttention (blocks whole), ``"small-gdn-hnd"`` a model whose state pages are small
  beside its attention's (blocks of 16 at TP 1, 2 and 4: vLLM pairs TP 2 and 4 alike).

The oracle (:func:`expected`) never asks kvlayout: it reads both sides through vLLM's
views (FlashAttention/FlashInfer's ``kv_cache.transpose(1, 2).split(head_size, -1)``, the
slot mapping in kernel blocks, ``MambaBase.bind_kv_cache``'s state slices, the request's
first Mamba block id), splits heads as ``QKVParallelLinear`` does (``tp > heads``
replicates a head over ``tp // heads`` ranks) and the GDN conv dim per sub-projection as
its ``MergedColumnParallelLinear`` (``ssm_conv_transfer_utils.py``'s ``Q, K, V``).

:func:`peer_cache` is the builder a :class:`~kvlayout.testing.nixl_peer.NixlPeer` calls
(``built_cache``) to hold one rank in another process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers, validate_kv_cache_groups
from kvlayout.testing import vllm as vx

SWA_HEADS, SWA_HEAD_SIZE, WINDOW, SWA_BLOCK, SWA_LAYERS = 8, 64, 128, 16, 4
GDN = vx.HybridModel("Qwen3-Next-like", 8, 4, 2, 64, 4, 8, 32, 32, 4, torch.bfloat16, torch.bfloat16)
QWEN3_NEXT_8 = dataclasses.replace(vx.QWEN3_NEXT_80B_A3B, num_hidden_layers=8)  # its sizes, 8 layers
# state pages small beside the attention's: blocks of 16 at TP 1, 2 and 4 alike
SMALL_GDN = vx.HybridModel("small-GDN", 8, 4, 2, 64, 4, 4, 16, 16, 4, torch.bfloat16, torch.bfloat16)
MODELS = {"gdn": GDN, "gdn-align": GDN, "qwen3-next-align": QWEN3_NEXT_8, "gdn-hnd": GDN, "gdn-fa-hnd": GDN,
          "small-gdn-hnd": SMALL_GDN}  # fmt: skip
NUM_BLOCKS = {"swa": 48, "gdn": 24, "gdn-align": 24, "qwen3-next-align": 6, "gdn-hnd": 24, "gdn-fa-hnd": 24,
              "small-gdn-hnd": 24}  # fmt: skip
HEADS = {"swa": SWA_HEADS, **{k: m.num_key_value_heads for k, m in MODELS.items()}}


def swa_specs(tp: int) -> dict[str, Any]:
    kw = {"block_size": SWA_BLOCK, "num_kv_heads": SWA_HEADS // tp, "head_size": SWA_HEAD_SIZE,
          "dtype": torch.bfloat16}  # fmt: skip
    full, local = vx.kvi.FullAttentionSpec(**kw), vx.kvi.SlidingWindowSpec(**kw, sliding_window=WINDOW)
    return {f"model.layers.{i}.self_attn.attn": local if i % 2 == 0 else full for i in range(SWA_LAYERS)}


def engine_of(kind: str, tp: int) -> vx.Engine:
    if kind == "swa":
        return vx.planned_engine(swa_specs(tp), vx.FLASH_ATTN, num_blocks=NUM_BLOCKS[kind])
    mode = "align" if kind.endswith("align") else "none"
    backend = vx.FLASH_ATTN if kind == "gdn-fa-hnd" else vx.FLASHINFER
    layout = (
        vx.KVCacheLayout.LBHNC if kind.endswith("-hnd") else None
    )  # NixlConnector's (LBNHC: vLLM's default)
    return vx.hybrid_engine(
        MODELS[kind], backend, tp=tp, num_blocks=NUM_BLOCKS[kind], mamba_cache_mode=mode, max_model_len=4096,
        conv_layout="DS", layout=layout,
    )  # fmt: skip


@dataclass
class Rank:
    kind: str
    tp: int
    rank: int
    engine: vx.Engine
    buf: torch.Tensor  # allocate_v033's buffer: every byte of the rank's KV
    kv: dict[str, torch.Tensor]  # what register_kv_caches is handed
    registration: Any


def rank_of(kind: str, tp: int, rank: int, seed: int) -> Rank:
    """One TP rank's cache, filled with random bytes of ``seed``, detected as a P/D
    connector detects it."""
    engine = engine_of(kind, tp)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, seed)
    hints = {"kv_layout": engine.layout.name}
    validate_kv_cache_groups(engine.config, prefix_reuse=False)
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, edited)
    return Rank(kind, tp, rank, engine, buf, kv, kvlayout.detect(layers, "vllm", hints, layer_groups=groups))


def peer_cache(kind: str, tp: int, rank: int, seed: int) -> tuple[Any, list[torch.Tensor]]:
    """``NixlPeer.built_cache``'s builder: the rank's registration and its whole buffer."""
    r = rank_of(kind, tp, rank, seed)
    return r.registration, [r.buf]


def is_state(spec: Any) -> bool:
    return isinstance(spec, vx.kvi.MambaSpec)


def skipped_blocks(spec: Any, num_tokens: int) -> int:
    """``SlidingWindowManager.get_num_skipped_tokens(num_tokens)`` in whole blocks
    (``remove_skipped_blocks``): the blocks vLLM replaced by its null block 0."""
    if isinstance(spec, vx.kvi.SlidingWindowSpec):
        return max(0, num_tokens - int(spec.sliding_window) + 1) // int(spec.block_size)
    return 0


def state_skipped_blocks(spec: Any, num_tokens: int) -> int:
    """``MambaManager.get_num_skipped_tokens(num_tokens)`` (``num_tokens - 1``: only the
    last token's state is kept) in whole blocks: in 'align' mode the blocks before the
    running state's are vLLM's null block 0."""
    return (num_tokens - 1) // int(spec.block_size)


def running_state(table: list[int], spec: Any) -> list[int]:
    """The block id of the request's running state in a Mamba group's block table, as
    vLLM's NixlConnector takes it (``kv_connector/utils.py``, ``clip_ssm_state_blocks``):
    the last before the speculative scratch blocks ('none' mode: the first of its
    ``1 + num_speculative_blocks``)."""
    scratch = min(spec.num_speculative_blocks, len(table) - 1)
    return (table[:-scratch] if scratch else table)[-1:]


def block_tables(engine: vx.Engine, num_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """A request's block ids per KV cache group, scattered over the one pool the groups
    share: a Mamba group's one running state ('none' mode: a block of ``max_model_len``
    tokens) or its blocks with those before the running state's as vLLM's null block 0
    ('align'), an attention group's blocks with the sliding window's dropped ones as the
    null block."""
    free = [int(b) for b in rng.permutation(np.arange(1, engine.config.num_blocks))]
    tables = []
    for g in engine.config.kv_cache_groups:
        spec = g.kv_cache_spec
        n = -(-num_tokens // spec.block_size)
        k = state_skipped_blocks(spec, num_tokens) if is_state(spec) else skipped_blocks(spec, num_tokens)
        tables.append([0] * k + [free.pop() for _ in range(n - k)])
    return tables


def pair_maps(
    src: Any, dst: Any, src_rank: Rank, dst_rank: Rank, tables: tuple[list[list[int]], list[list[int]]],
    num_tokens: int,
) -> list[tuple[int, tuple[list[int], list[int]], dict[str, Any], Any]]:  # fmt: skip
    """One rank pair's maps of a request of ``num_tokens``, group by group, as
    docs/pd-connectors.md says (``src`` and ``dst`` a registration or a description,
    either side; ``src_rank`` / ``dst_rank`` the engines the connector knows): each
    kernel group with its KV cache group's block ids (a sliding window from its first
    kept block with ``first_token``, a state by its one block id), an attention group only
    where ``sends_to`` picks the pair, a state group from every pair. Each map that is not
    empty: its kernel group's index, block ids, keywords and the map."""
    from kvlayout.transfer import RegistrationDescription, Shard, block_map

    heads = HEADS[src_rank.kind]
    ps, ds = Shard(src_rank.rank, src_rank.tp, heads), Shard(dst_rank.rank, dst_rank.tp, heads)
    groups = dst_rank.engine.config.kv_cache_groups
    out = []
    for i, g in enumerate(dst_rank.registration.kernel_groups):
        eg = g.engine_group
        spec = groups[eg].kv_cache_spec
        s = src.group(i) if isinstance(src, RegistrationDescription) else src.kernel_groups[i]
        d = dst.group(i) if isinstance(dst, RegistrationDescription) else dst.kernel_groups[i]
        if is_state(spec):  # the request's running state, one block id a side, from every rank
            src_spec = src_rank.engine.config.kv_cache_groups[eg].kv_cache_spec
            ids = running_state(tables[0][eg], src_spec), running_state(tables[1][eg], spec)
            kw: dict[str, Any] = {}
        elif ps.sends_to(ds):
            ids = tables[0][eg], tables[1][eg]
            kw = {"num_tokens": num_tokens, "first_token": skipped_blocks(spec, num_tokens) * spec.block_size}
        else:
            continue
        m = block_map(s, d, *ids, src_shard=ps, dst_shard=ds, **kw)
        if m.kind != "empty":
            out.append((i, ids, kw, m))
    return out


def heads_of(rank: int, tp: int, heads: int) -> list[int]:
    """The model's KV heads a rank holds (``QKVParallelLinear``)."""
    if tp >= heads:
        return [rank // (tp // heads)]
    n = heads // tp
    return list(range(rank * n, rank * n + n))


def conv_columns(model: vx.HybridModel, rank: int, tp: int) -> list[int]:
    """The GDN conv dim's columns a rank holds: each of ``Q, K, V`` sharded on its own."""
    kd = model.linear_key_head_dim * model.linear_num_key_heads
    vd = model.linear_value_head_dim * model.linear_num_value_heads
    cols: list[int] = []
    for base, size in ((0, kd), (kd, kd), (2 * kd, vd)):
        n = size // tp
        cols += range(base + rank * n, base + rank * n + n)
    return cols


def ssm_heads(model: vx.HybridModel, rank: int, tp: int) -> list[int]:
    n = model.linear_num_value_heads // tp
    return list(range(rank * n, rank * n + n))


def token_rows(r: Rank, kv: dict[str, torch.Tensor], name: str, gid: int, table: list[int], p: int) -> Any:
    """Token ``p``'s K and V, ``[heads, head_size]`` each, as the attention kernel reads
    them: ``kv_cache.transpose(1, 2).split(head_size, -1)`` over kernel pages, the slot
    in kernel page ``b * (block_size // kbs) + (p % block_size) // kbs``."""
    spec = r.engine.config.kv_cache_groups[gid].kv_cache_spec
    kbs = r.engine.kernel_block_sizes[gid]
    k, v = torch.split(kv[name].transpose(1, 2), int(spec.head_size), dim=-1)
    page = table[p // spec.block_size] * (spec.block_size // kbs) + (p % spec.block_size) // kbs
    return k[page, p % kbs], v[page, p % kbs]


def states(r: Rank, kv: dict[str, torch.Tensor], name: str, block: int) -> list[torch.Tensor]:
    """``MambaBase.bind_kv_cache``: a block's states sliced from its int8 page in order."""
    spec = r.engine.spec_of(name)
    pages = kv[name].squeeze(1).squeeze(1)
    out, off = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        out.append(pages[block, off : off + n].view(dtype).view(shape))
        off += n
    return out


def expected(
    dst: Rank, before: torch.Tensor, sources: list[Rank], tables: tuple[list[list[int]], list[list[int]]],
    num_tokens: int,
) -> torch.Tensor:  # fmt: skip
    """The decode rank's whole buffer once the request has landed: ``before`` with every
    token's heads it holds (from the prefill rank holding each head) from the window's
    first kept block on, and every conv column and SSM head of the request's state."""
    src_tables, dst_tables = tables
    out, ekv = vx.allocate_v033(dst.engine)
    out.copy_(before)
    heads = HEADS[dst.kind]
    for gid, g in enumerate(dst.engine.config.kv_cache_groups):
        spec = g.kv_cache_spec
        for name in g.layer_names:
            if is_state(spec):
                conv, ssm = states(dst, ekv, name, running_state(dst_tables[gid], spec)[0])
                model = MODELS[dst.kind]
                cols, hs = conv_columns(model, dst.rank, dst.tp), ssm_heads(model, dst.rank, dst.tp)
                for s in sources:
                    s_spec = s.engine.config.kv_cache_groups[gid].kv_cache_spec
                    s_conv, s_ssm = states(s, s.kv, name, running_state(src_tables[gid], s_spec)[0])
                    s_cols, s_hs = conv_columns(model, s.rank, s.tp), ssm_heads(model, s.rank, s.tp)
                    for j, c in enumerate(cols):
                        if c in s_cols:
                            conv[j] = s_conv[s_cols.index(c)]
                    for j, h in enumerate(hs):
                        if h in s_hs:
                            ssm[j] = s_ssm[s_hs.index(h)]
                continue
            first = skipped_blocks(spec, num_tokens) * spec.block_size
            for j, h in enumerate(heads_of(dst.rank, dst.tp, heads)):
                s = next(s for s in sources if h in heads_of(s.rank, s.tp, heads))
                sh = heads_of(s.rank, s.tp, heads).index(h)
                for p in range(first, num_tokens):
                    d_k, d_v = token_rows(dst, ekv, name, gid, dst_tables[gid], p)
                    s_k, s_v = token_rows(s, s.kv, name, gid, src_tables[gid], p)
                    d_k[j], d_v[j] = s_k[sh], s_v[sh]
    return out
