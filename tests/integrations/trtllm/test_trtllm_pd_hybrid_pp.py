"""TRT-LLM's hybrid models (Nemotron-H: Mamba2 layers beside attention layers) under
pipeline parallelism, written on kvlayout as a connector would and moved through real
NIXL (this process's agent and a peer's, TCP on loopback), byte-exact against TRT-LLM's
own pairing. The attention walks are ``test_trtllm_pd_windows_reuse.py``'s, the state
managers ``test_trtllm_mamba_states.py``'s; these reuse both.

What TRT-LLM does (NVIDIA/TensorRT-LLM):

- A PP stage holds its own layers of each kind: its attention layers in the KV pool
  (``mAttentionLayerNumPerPP``) and its Mamba layers in the state manager
  (``PythonMambaCacheManager``: ``local_num_mamba_layers``, ``[NL, slots, *state]``), each
  counted per stage on its own (``ParallelConfig::mRnnLayerNumPerPP``).
- ``executor/cache_transmission/rnnCacheSplitConcat.cu``: ``splitRnnConvState`` /
  ``splitRnnSsmState`` take the peer stages of the domain (``targetIRanks``, as for the KV)
  and their Mamba layer counts (``mPeerLayerNumInDomainPP``, summed into ``prefixLayerNum``);
  ``getLayerIdInDomainPPandRankInDomainPP`` sends the stage's Mamba layer ``k`` to the
  domain stage whose prefix range holds it, at ``k - prefix`` there (the concat kernels
  read it back alike). A stage's Mamba layers thus land, in order, on the peer's layers of
  the same place in the model's Mamba layers; the request's one slot each side
  (``slotIdx``). Between TP degrees each section of the conv state (Mamba2's ``x, B, C``)
  and the SSM state's heads split over the TP domain.

As a connector: each stage numbers its KV pool with its attention layers and each state
registration (``mamba_state_pools``) with its Mamba layers, each in its own layer space;
the generation rank describes its pools numbered alike, and each (stage, rank) maps what
the two share (``for_layers`` on both sides), the states slot to slot.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

import kvlayout
from kvlayout.integrations.trtllm import mamba_state_pools
from kvlayout.registration.registration import Registration
from kvlayout.testing.nixl_peer import AgentPair
from kvlayout.transfer import Shard
from kvlayout.transfer import nixl as nx
from tests.integrations.trtllm.test_trtllm_mamba_states import (
    D_CONV,
    D_STATE,
    HEAD_DIM,
    NHEADS,
    SLOTS,
    sections,
    v1_manager,
)
from tests.integrations.trtllm.test_trtllm_pd_nixl import (
    CTX_IDS,
    GEN_BLOCKS,
    GEN_IDS,
    HEADS,
    LAYERS,
    TPB,
    context_ranks,
    expected,
    gen_bytes,
    handshake,
    hints,
    pair,
    stage_layers,
    trt_senders,
    write,
)
from tests.integrations.trtllm.test_trtllm_pd_nixl import HEAD_DIM as KV_HEAD_DIM
from tests.integrations.trtllm.test_trtllm_pd_windows_reuse import domain, stage_maps

__all__ = ["pair"]  # the module's agent pair (a fixture of its own per module)

STATE_BUILDER = "tests.integrations.trtllm.test_trtllm_pd_hybrid_pp:state_pool"
MAMBA = LAYERS + 1  # the model's Mamba layers, in their own space: not split as its attention layers
CTX_SLOT, GEN_SLOT = 3, 1  # the request's slot (get_state_indices) on each side


def mamba_layers(pp_rank: int, pp: int) -> list[int]:
    """The model's Mamba layers PP stage ``pp_rank`` holds (``mRnnLayerNumPerPP``, counted
    on its own: the first stage of two holds one more here, as a hybrid's pattern may)."""
    cut = [0, MAMBA // 2 + 1, MAMBA] if pp == 2 else [0, MAMBA]
    return list(range(cut[pp_rank], cut[pp_rank + 1]))


def state_pool(name: str, tp: int, ids: list[int]) -> tuple[Registration, list[torch.Tensor]]:
    """The peer's builder: a generation rank's state ``name`` (``conv`` or ``ssm``) of the
    Mamba layers ``ids`` at TP ``tp``, zeroed, read and numbered as the connector does."""
    manager = v1_manager(tp, 0, layers=len(ids))
    cache = manager._impl.mamba_cache
    state = cache.conv if name == "conv" else cache.temporal
    for t in (cache.conv, cache.temporal):
        t.zero_()
    return mamba_state_pools(manager)[name].numbered(ids), [state]


def share(name: str, whole: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """A TP rank's part of the whole model's state (``[layers, slots, *state]``): each conv
    section's ``rank``-th slice, the SSM state's ``rank``-th heads."""
    if name == "ssm":
        return whole.chunk(tp, dim=2)[rank]
    parts = torch.split(whole, sections(1), dim=2)
    return torch.cat([p.chunk(tp, dim=2)[rank] for p in parts], dim=2)


def whole_states() -> dict[str, torch.Tensor]:
    """The model's every Mamba layer's state at TP 1, random."""
    g = torch.Generator().manual_seed(77)
    conv = torch.randn(MAMBA, SLOTS, sum(sections(1)), D_CONV - 1, generator=g).to(torch.bfloat16)
    return {"conv": conv, "ssm": torch.randn(MAMBA, SLOTS, NHEADS, HEAD_DIM, D_STATE, generator=g)}


def context_states(whole: dict[str, torch.Tensor], tp: int, pp: int) -> dict[str, dict[Any, Registration]]:
    """Each context (stage, rank)'s state registrations, numbered with its Mamba layers, its
    bytes its TP share of its layers."""
    out: dict[str, dict[Any, Registration]] = {"conv": {}, "ssm": {}}
    for p in range(pp):
        layers = mamba_layers(p, pp)
        for r in range(tp):
            manager = v1_manager(tp, 0, layers=len(layers))
            cache = manager._impl.mamba_cache
            cache.conv.copy_(share("conv", whole["conv"][layers], tp, r))
            cache.temporal.copy_(share("ssm", whole["ssm"][layers], tp, r))
            for name, reg in mamba_state_pools(manager).items():
                out[name][p, r] = reg.numbered(layers)
    return out


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [((1, 2), (1, 1)), ((1, 2), (1, 2)), ((2, 2), (1, 1)), ((1, 2), (2, 2))],
    ids=["pp2-pp1", "pp2-pp2", "tp2pp2-tp1pp1", "tp1pp2-tp2pp2"],
)
def test_hybrid_attention_and_mamba_states_under_pp(
    pair: AgentPair, ctx: tuple[int, int], gen: tuple[int, int]
) -> None:
    """Context PP 2 into generation PP 1 and PP 2 (with TP changes beside): each
    generation rank receives its attention layers' KV (the request's blocks) and its Mamba
    layers' conv and SSM states (the request's slot) from the context stages that ran
    them, each pool in a pass of its own (the peer holds one cache at a time). The states'
    oracle is TRT-LLM's split of the whole model's state: the generation rank's TP share
    of each of its Mamba layers, in its slot; every other byte stays zero."""
    (ctx_tp, ctx_pp), (gen_tp, gen_pp) = ctx, gen
    kv = context_ranks(ctx_tp, ctx_pp, HEADS, 2)
    kv_regs = {
        k: kvlayout.detect(pool, "trtllm", hints(HEADS // ctx_tp, 2)).numbered(stage_layers(k[0], ctx_pp))
        for k, pool in kv.items()
    }
    whole = whole_states()
    states = context_states(whole, ctx_tp, ctx_pp)
    every = [*kv_regs.values(), *states["conv"].values(), *states["ssm"].values()]
    held = [nx.register(pair.agent, reg) for reg in every]
    try:
        for g in range(gen_tp * gen_pp):
            stage, d = g // gen_tp, g % gen_tp
            layers, dst = stage_layers(stage, gen_pp), Shard(d, gen_tp, HEADS)
            senders = [
                (p, r) for p in domain(stage, gen_pp, ctx_pp) for r in trt_senders(d, ctx_tp, gen_tp, HEADS)
            ]
            # the attention layers' KV
            there = handshake(pair, dst, heads=HEADS // gen_tp, kv_factor=2, layers=len(layers), ids=layers)
            maps = stage_maps(kv_regs, there, layers, ctx_tp, dst, (CTX_IDS, GEN_IDS), 0)
            assert sorted(maps) == senders
            write(pair, maps, "direct")
            shape = (GEN_BLOCKS, len(layers), 2, HEADS // gen_tp * KV_HEAD_DIM * TPB)
            want = expected(kv, ctx_tp, ctx_pp, shape, d, gen_tp, layers, HEADS)
            assert torch.equal(gen_bytes(pair, shape), want), ("kv", g)
            # the Mamba layers' states, slot to slot
            layers = mamba_layers(stage, gen_pp)
            for name, dtype in (("conv", torch.bfloat16), ("ssm", torch.float32)):
                there = handshake(pair, dst, STATE_BUILDER, name=name, tp=gen_tp, ids=layers)
                maps = stage_maps(states[name], there, layers, ctx_tp, dst, ([CTX_SLOT], [GEN_SLOT]), None)
                assert sorted(maps) == senders, name
                assert {m.kind for m in maps.values()} == {
                    "resharded state" if ctx_tp != gen_tp else "same layout"
                }
                write(pair, maps, "direct")
                want = torch.zeros_like(share(name, whole[name][layers], gen_tp, d))
                want[:, GEN_SLOT] = share(name, whole[name][layers], gen_tp, d)[:, CTX_SLOT]
                assert torch.equal(gen_bytes(pair, want.shape, dtype), want), (name, g)
    finally:
        for h in held:
            h.deregister()
