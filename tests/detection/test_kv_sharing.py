"""Layers that share one KV cache (vLLM's cross-layer KV sharing): exact aliases are
accepted and listed, pointer tables list every layer, a store fills every layer's slot
and a load writes each memory once, from its first layer's slot, on the CPU engine and
in the CUDA plan's decomposition alike; anything else that shares bytes is refused,
saying how the views differ. The vLLM 0.33 registrations themselves are in
tests/integrations/vllm/test_vllm_kv_sharing.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import RegistrationError, _native
from kvlayout.tools.cli import main
from kvlayout.transfer import TransferError, prepare
from kvlayout.transfer.cuda import segment_table

NHD = {"kv_layout": "NHD"}


def t(*shape: int) -> torch.Tensor:
    return torch.randn(shape).to(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- what is accepted -------------------------------------------------------------------------


def test_one_tensor_registered_for_two_layers_is_a_shared_kv_cache() -> None:
    a, b, c = t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4)
    reg = kvlayout.detect([a, b, a, c, b], "vllm", NHD)
    assert reg.shared_layers == ((0, 2), (1, 4))
    assert repr(reg) == (
        "Registration(vllm, 5 layers: layers 0-4: NL_X_TWO_NB_BS_NH_HS [2, 7, 3, 2, 4] torch.bfloat16, "
        "KV shared by layers (0, 2), (1, 4))"
    )
    fmt, kv = kvlayout.normalize_kv_and_discover_format([a, b, a, c, b], "vllm", NHD)
    assert kvlayout.get_group_data_ptrs(kv, fmt, range(5)) == [x.data_ptr() for x in (a, b, a, c, b)]
    assert kvlayout.bind([a, b, a], fmt).shared_layers == ((0, 2),)
    assert kvlayout.detect([a, b, c], "vllm", NHD).shared_layers == ()


def test_a_permuted_view_of_exactly_the_same_bytes_is_the_same_kv_cache() -> None:
    physical = t(2, 7, 2, 3, 4)  # [2, NB, NH, BS, HS]: vLLM's HND cache ...
    exposed = physical.transpose(2, 3)  # ... handed over as an NHD-shaped view
    other = t(2, 7, 2, 3, 4).transpose(2, 3)
    sharer = physical.view(2, 7, 2, 3, 4).transpose(2, 3)  # another view object, the same bytes
    reg = kvlayout.detect([exposed, other, sharer], "vllm", {"kv_layout": "HND"})
    assert reg.format == F.NL_X_TWO_NB_NH_BS_HS and reg.shared_layers == ((0, 2),)
    # a plain view of the physical tensor reads the same bytes the same way
    assert kvlayout.detect(
        [physical, other.transpose(2, 3), physical[...]], "vllm", {"kv_layout": "HND"}
    ).shared_layers == ((0, 2),)


def test_layers_sharing_a_kv_cache_through_tuples_and_pools() -> None:
    k, v, k2, v2 = (t(7, 3, 2, 4) for _ in range(4))
    reg = kvlayout.bind([(k, v), (k2, v2), (k, v)], F.NL_X_TWO_X_NB_BS_NH_HS)
    assert reg.shared_layers == ((0, 2),)
    pool = t(7, 4, 3, 16)  # [NB, NL, BS, HS]: layer l is pool[:, l], dim-0 padded
    layers = [pool[:, i] for i in range(4)]
    reg = kvlayout.detect([*layers, layers[1]], "vllm")
    assert reg.shared_layers == ((1, 4),) and reg.kernel_groups[0].block_stride_elems == 4 * 3 * 16
    keys, values = [t(21, 2, 4) for _ in range(4)], [t(21, 2, 4) for _ in range(4)]
    keys[3], values[3] = keys[1], values[1]  # SGLang's K and V lists: layer 3 is layer 1's
    sglang = {"tokens_per_block": 3, "kv_list_layout": "k_v"}
    assert kvlayout.detect([keys, values], "sglang", sglang).shared_layers == ((1, 3),)
    values[3] = values[2]
    with pytest.raises(RegistrationError, match=re.escape("but layer 3 shares other tensors with layer 1")):
        kvlayout.detect([keys, values], "sglang", sglang)


def test_meta_registrations_show_their_sharing() -> None:
    meta = [torch.empty(2, 7, 3, 2, 4, device="meta") for _ in range(3)]
    assert kvlayout.detect([*meta, meta[1]], "vllm", NHD).shared_layers == ((1, 3),)
    pool = torch.empty(7, 3, 3, 16, device="meta")
    layers = [pool[:, i] for i in range(3)]
    assert kvlayout.detect(layers, "vllm").shared_layers == ()  # views of one base, apart
    assert kvlayout.detect([*layers, pool[:, 2]], "vllm").shared_layers == ((2, 3),)


# -- what is refused ---------------------------------------------------------------------------


def test_partial_overlaps_are_refused_saying_the_views_differ() -> None:
    buf = torch.zeros(3 * 2 * 7 * 3 * 2 * 4, dtype=torch.bfloat16)
    n = 2 * 7 * 3 * 2 * 4
    a = buf[:n].view(2, 7, 3, 2, 4)
    shifted = buf[8 : 8 + n].view(2, 7, 3, 2, 4)
    with pytest.raises(
        RegistrationError,
        match=re.escape("kv_caches[1] and kv_caches[0] overlap in memory (bytes 0x"),
    ) as refused:
        kvlayout.detect([a, shifted], "vllm", NHD)
    assert "they share bytes but their views differ (kv_caches[1] starts 16 bytes after kv_caches[0]" in str(
        refused.value
    )
    assert "layers may share a KV cache only as exact aliases" in str(refused.value)
    # the same first byte, another view of it: fewer blocks
    fewer = buf[: 2 * 5 * 24].view(2, 5, 3, 2, 4)
    with pytest.raises(
        RegistrationError, match=re.escape("they start at the same byte; kv_caches[1]: shape [2, 5,")
    ):
        kvlayout.detect([a, fewer], "vllm", NHD)


def test_sharing_within_a_layer_or_part_of_a_layer_is_refused() -> None:
    k, v, v2 = t(7, 3, 2, 4), t(7, 3, 2, 4), t(7, 3, 2, 4)
    with pytest.raises(
        RegistrationError,
        match=re.escape(
            "kv[0][1] and kv[0][0] overlap in memory: they are one tensor twice within one layer"
        ),
    ):
        kvlayout.bind([(k, k)], F.NL_X_TWO_X_NB_BS_NH_HS)
    with pytest.raises(
        RegistrationError,
        match=re.escape("layer 1 shares only part of its KV cache with layer 0: kv[1][1] is not kv[0][1]"),
    ):
        kvlayout.bind([(k, v), (k, v2)], F.NL_X_TWO_X_NB_BS_NH_HS)
    with pytest.raises(
        RegistrationError, match=re.escape("kv[1][0] is the memory of kv[0][1], which holds another part")
    ):
        kvlayout.bind([(k, v), (v, k)], F.NL_X_TWO_X_NB_BS_NH_HS)


# -- transfers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 3])
def test_a_store_fills_every_layer_and_a_load_writes_each_memory_once(threads: int) -> None:
    a, b = t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4)
    kv = [a, b, a, a]
    plan = prepare(kvlayout.detect(kv, "vllm", NHD).only_group(), F.NL_X_TWO_NB_BS_NH_HS)
    ids = [6, 1, 3, 0]
    chunks = plan.chunks_for(len(ids), 2 * 3)
    plan.store_blocks(ids, chunks, num_threads=threads)
    for c in chunks:
        assert _same(c[:, 2], c[:, 0]) and _same(c[:, 3], c[:, 0])  # chunk bytes stay LMCache's
    for c in chunks:
        c[:, 0].fill_(1)
        c[:, 2].fill_(2)  # slots of sharers differ: the first layer's wins, whatever the threads
        c[:, 3].fill_(3)
    untouched = a[:, [2, 4, 5]].clone()  # blocks outside the request keep their (random) bytes
    plan.load_blocks(ids, chunks, num_threads=threads)
    assert bool((a[:, ids] == 1).all()) and torch.equal(a[:, [2, 4, 5]], untouched)


def test_the_cuda_plan_loads_each_shared_memory_once() -> None:
    """The kernels' own mapping on the host: a load's grid leaves out the sharers' pointers."""
    a, b = t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4)
    plan = prepare(kvlayout.detect([a, b, a, b], "vllm", NHD).only_group(), F.NL_X_TWO_NB_BS_NH_HS)
    (job,) = plan.jobs
    assert job.plane.repeats == (2, 3)
    ids, tokens = np.array([4, 0], dtype=np.int64), np.array([6], dtype=np.int64)
    store = _native.device_units(plan._native_job(job), ids, tokens, 2, 0, 2, 0)
    load = _native.device_units(plan._native_job(job), ids, tokens, 2, 0, 2, 1)
    assert set(store[:, 0].tolist()) == {0, 1, 2, 3} and set(load[:, 0].tolist()) == {0, 1}
    assert len(load) * 2 == len(store)
    slabs = {int(row[3]) // (6 * plan.row_bytes) for row in load}  # chunk slab = kv * NL + layer
    assert slabs == {0, 1, 4, 5}
    assert len(segment_table(plan, job, 1).rows) * 2 == len(segment_table(plan, job, 0).rows)
    with pytest.raises(ValueError, match="direction is 0"):
        _native.plan_segments(plan._native_job(job), 2)


def test_a_chunk_over_a_shared_layer_is_still_refused() -> None:
    a = t(2, 7, 3, 2, 4)
    plan = prepare([a, a], F.NL_X_TWO_NB_BS_NH_HS)
    shape, _ = plan.chunk_shape(3)
    over = a.view(-1)[: int(np.prod(shape))].view(shape)
    with pytest.raises(TransferError, match="overlaps the cache's memory"):
        plan.load_blocks([0], [over])


# -- the command line --------------------------------------------------------------------------


def test_detect_on_the_command_line_shows_shared_layers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["detect", "--engine", "vllm", "--shape", "6x[2,64,16,8,128]@0,1,3,2,4", "--hint", "kv_layout=HND"]
    assert main([*argv, "--share", "4=2", "--share", "5=3"]) == 0
    assert (
        "    shared     layers (2, 4), (3, 5) share one KV cache (the first holds it)"
        in capsys.readouterr().out
    )
    assert main([*argv, "--share", "4=2", "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["kernel_groups"][0]["shared_layers"] == [[2, 4]]
    assert main([*argv, "--share", "9=2"]) == 2
    assert "--share 9=2: the registration has 6 entries, not 10" in capsys.readouterr().err
