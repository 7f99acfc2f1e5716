"""vLLM 0.33's own NixlConnector descriptor math, run on the CPU: the oracle
``test_vllm_nixl_parity`` holds kvlayout's maps to.

``nixl/base_worker.py``, ``nixl/tp_mapping.py`` and ``kv_connector/utils.py`` import
vLLM's distributed runtime (psutil, zmq, the platform), which vLLM installed without its
dependencies cannot, so the connector's functions are taken from those files' source as
vLLM ships them (as ``vllm_planning`` takes the grouping's) and run on an object that
carries the attributes ``register_kv_caches`` and the handshake set: each layer one
region ``(data_ptr, page bytes, stride(0) bytes)`` of ``num_blocks`` blocks (a 0.33
attention view ``[B, H, N, C]``, K and V packed in ``C``).

``decode_read`` then does what a decode worker's ``start_load_kv`` does for one request
of a plain attention (or MLA) model (``pull_worker._read_blocks_for_req`` and
``_read_blocks``, without DCP): ``compute_tp_mapping``'s source ranks, each READ's local
and remote descriptor ids (``_map_block_ids_for_block_size_ratio``,
``_apply_prefix_caching``, ``_compute_desc_ids``) over the prepped lists
(``_build_fa_local``, ``_build_fa_remote``, ``_build_local_splits_from_plan`` where
prefill has more ranks), moves each descriptor's bytes as NIXL's READ would, and runs
``post_process_device_kv_on_receive`` (``kv_postprocess_blksize_on_receive`` and
``kv_postprocess_blksize_and_layout_on_receive``) as ``get_transfer_results`` does.
"""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import logging
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.integrations.vllm.vllm_source import definitions, run, vllm_source

kvi: Any = importlib.import_module("vllm.v1.kv_cache_interface")
KVCacheLayout: Any = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout

_WORKER_METHODS = (
    "_compute_desc_ids",
    "_logical_to_kernel_block_ids",
    "_build_mamba_local",
    "_build_mamba_remote",
    "_build_local_splits_from_plan",
    "_fa_desc_replicated",
    "_is_region_replicated",
    "_pack_strided_descs",
    "_block_strided_descs",
    "_strided_desc_starts",
    "_build_fa_local",
    "_build_fa_remote",
    "get_mapped_blocks",
    "_map_block_ids_for_block_size_ratio",
    "_apply_prefix_caching",
    "post_process_device_kv_on_receive",
)


@functools.cache
def connector() -> dict[str, Any]:
    """The connector's functions and a class of the worker's methods, ``ConnectorMath``."""
    namespace: dict[str, Any] = {
        "np": np,
        "torch": torch,
        "math": math,
        "re": re,
        "itertools": itertools,
        "dataclass": dataclass,
        "logger": logging.getLogger("vllm-nixl-oracle"),
        "AttentionSpec": kvi.AttentionSpec,
        "MambaSpec": kvi.MambaSpec,
        "CircularBufferSpec": getattr(kvi, "CircularBufferSpec", type("CircularBufferSpec", (), {})),
        "_SHARED_REGION_GROUP_ID": -1,
        "Iterator": Iterator,
        "async_tensor_h2d": lambda data, device, dtype: torch.tensor(data, device=device, dtype=dtype),
        "KVCacheLayout": KVCacheLayout,
    }
    path, tree = vllm_source("distributed/kv_transfer/kv_connector/utils.py")
    names: tuple[str, ...] = (
        "kv_postprocess_blksize_on_receive",
        "kv_postprocess_blksize_and_layout_on_receive",
    )
    run(path, definitions(path, tree, names, "NixlConnector"), namespace)
    path, tree = vllm_source("distributed/kv_transfer/kv_connector/v1/ssm_conv_transfer_utils.py")
    namespace |= {  # the "DS" conv order the connector asserts at start-up (VLLM_SSM_CONV_STATE_LAYOUT)
        "is_conv_state_dim_first": lambda: True,
        "MambaAttentionBackendEnum": importlib.import_module(
            "vllm.v1.attention.backends.registry"
        ).MambaAttentionBackendEnum,
    }
    names = ("MambaConvSplitInfo", "derive_mamba_conv_split")
    run(path, definitions(path, tree, names, "NixlConnector"), namespace)
    path, tree = vllm_source("distributed/kv_transfer/kv_connector/v1/nixl/utils.py")
    namespace["UniformTypeKVCacheSpecs"] = kvi.UniformTypeKVCacheSpecs
    run(path, definitions(path, tree, ("get_representative_spec_type",), "NixlConnector"), namespace)
    path, tree = vllm_source("distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py")
    names = ("_is_attention_spec", "_is_ssm_spec", "TPMapping", "compute_head_offset", "compute_tp_mapping")
    run(path, definitions(path, tree, names, "NixlConnector"), namespace)
    path, tree = vllm_source("distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py")
    sort_key, worker = definitions(
        path, tree, ("_region_sort_key", "NixlBaseConnectorWorker"), "NixlConnector"
    )
    run(path, [sort_key], namespace)
    assert isinstance(worker, ast.ClassDef)
    methods = {n.name: n for n in worker.body if isinstance(n, ast.FunctionDef)}
    missing = set(_WORKER_METHODS) - set(methods)
    assert not missing, f"{path}'s NixlBaseConnectorWorker has no {sorted(missing)}"
    cls = ast.ClassDef(
        name="ConnectorMath",
        bases=[],
        keywords=[],
        body=[methods[name] for name in _WORKER_METHODS],
        decorator_list=[],
    )
    run(path, [ast.fix_missing_locations(cls)], namespace)
    return namespace


# -- one rank's registration, as register_kv_caches records it ------------------------


@dataclass
class Rank:
    """One worker's 0.33 attention views (``{layer: [B, H, N, C]}``) over ``buf``."""

    tp: int
    rank: int
    block_size: int
    layout: Any
    buf: torch.Tensor
    views: dict[str, torch.Tensor]
    mla: bool = False
    names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = sorted(self.views, key=connector()["_region_sort_key"])  # the regions' order

    @property
    def num_blocks(self) -> int:
        return int(self.views[self.names[0]].shape[0])

    def regions(self) -> tuple[list[int], list[int], list[int]]:
        """``(base addresses, block_len_per_layer, block_stride_per_layer)``."""
        views = [self.views[n] for n in self.names]
        pages = [int(v[0].numel() * v.element_size()) for v in views]
        strides = [int(v.stride(0) * v.element_size()) for v in views]
        return [int(v.data_ptr()) for v in views], pages, strides


def _math(local: Rank, num_kv_heads: int, remote_tp: int) -> Any:
    """A ``ConnectorMath`` holding what the decode worker ``local`` set up."""
    ns = connector()
    spec_type = kvi.MLAAttentionSpec if local.mla else kvi.FullAttentionSpec
    bases, pages, strides = local.regions()
    w = ns["ConnectorMath"]()
    w.transfer_topo = SimpleNamespace(
        tp_rank=local.rank,
        tp_size=local.tp,
        is_mla=local.mla,
        total_num_kv_heads=num_kv_heads,
        dcp_consumer_count=lambda remote_tp_size, remote_dcp_size: max(1, local.tp // remote_tp_size),
    )
    w.kv_caches_base_addr = bases
    w.block_len_per_layer = pages
    w.block_stride_per_layer = strides
    w.region_num_blocks = [local.num_blocks] * len(bases)
    w.num_regions = len(bases)
    w.region_group_ids = [0] * len(bases)
    w._uses_region_group_mapping = False
    w._region_is_mla = [local.mla] * len(bases)
    w._transfer_layer_region_indices = []
    w._transfer_layer_group_ids = []
    w._head_sharded_draft_regions = set()
    w._group_spec_types = (spec_type,)
    w._has_mamba = False
    w._conv_decomp = None
    w._ple_group_index = None
    w._ple_region_index = None
    w._scratch_region_indices = []
    w.device_id = 0
    w.use_mla = local.mla
    w.block_size = local.block_size
    w.kv_cache_layout = local.layout.name
    w.device_kv_caches = dict(local.views)
    w.kv_cache_config = SimpleNamespace(transfer_groups=[SimpleNamespace(layer_names=list(local.names))])
    w.plan = ns["compute_tp_mapping"](w.transfer_topo, remote_tp, (spec_type,))
    return w


def _flat(strided: np.ndarray) -> list[tuple[int, int]]:
    """The prepped list's descriptors, ``(address, length)`` by descriptor id."""
    return [(int(a) + j * int(s), int(n)) for a, n, _, s, c in strided.tolist() for j in range(int(c))]


@dataclass
class Read:
    """One READ the decode worker posts: its remote rank and descriptors."""

    remote_rank: int
    descriptors: int
    groups: tuple[int, ...] = ()  # a hybrid's: the KV cache groups read from that rank


def _memory(ranks: Sequence[Rank]) -> Any:
    def at(address: int, length: int) -> torch.Tensor:
        for r in ranks:
            flat = r.buf.view(-1)
            base = int(flat.data_ptr())
            if base <= address and address + length <= base + flat.numel():
                return flat[address - base : address - base + length]
        raise AssertionError(f"descriptor {address:#x}+{length} is in no registered buffer")

    return at


def _move(
    at: Any,
    local: list[tuple[int, int]],
    local_ids: np.ndarray,
    remote: list[tuple[int, int]],
    remote_ids: np.ndarray,
) -> None:
    """A READ's bytes, descriptor pair by pair (``make_prepped_xfer``'s index arrays into
    both prepped lists), as NIXL moves them."""
    assert len(local_ids) == len(remote_ids)
    for lid, rid in zip(local_ids.tolist(), remote_ids.tolist(), strict=True):
        (la, ln), (ra, rn) = local[lid], remote[rid]
        assert ln == rn, f"descriptor lengths differ: local {ln}, remote {rn}"
        at(la, ln).copy_(at(ra, rn))


def decode_read(
    local: Rank,
    remotes: Sequence[Rank],
    local_ids: list[int],
    remote_ids: list[int],
    num_kv_heads: int,
    *,
    enable_permute_local_kv: bool = False,
) -> list[Read]:
    """What vLLM's decode worker ``local`` does for one request of one KV cache group whose
    prefill ranks are ``remotes`` (all of them, by rank): ``local_ids`` the unhashed blocks
    it allocated (``get_unhashed_block_ids``, its prefix hit's blocks left out), ``remote_ids``
    the prefill request's. Moves the bytes into ``local``'s views and post-processes them;
    returns the READs posted (none for a full prefix hit: a notification alone)."""
    remote_tp, remote_bs = remotes[0].tp, remotes[0].block_size
    w = _math(local, num_kv_heads, remote_tp)
    w.enable_permute_local_kv = enable_permute_local_kv
    plan = w.plan
    tp_ratio = local.tp // remote_tp if local.tp >= remote_tp else -(remote_tp // local.tp)
    ratio = local.block_size // remote_bs
    at = _memory([local, *remotes])
    local_data = w._build_fa_local(w.kv_caches_base_addr, ratio)
    if tp_ratio < 0 and not local.mla:  # src_xfer_handles_by_tp_ratio
        num_fa_descs = int(local_data[:, 4].sum())
        local_lists = list(w._build_local_splits_from_plan(plan, local_data, num_fa_descs, ratio))
    else:
        local_lists = [local_data] * len(plan.all_source_ranks)
    reads: list[Read] = []
    for i, rank in enumerate(plan.all_source_ranks):
        remote = remotes[rank]
        bases, _, strides = remote.regions()
        meta = SimpleNamespace(
            engine_id="prefill",
            kv_caches_base_addr=bases,
            region_num_blocks=None,
            num_blocks=remote.num_blocks,
            device_id=0,
            block_strides=strides,
        )
        remote_list = _flat(w._build_fa_remote(plan, meta, ratio))
        local_list = _flat(local_lists[i])
        mine, theirs = [list(local_ids)], [list(remote_ids)]
        if ratio > 1:
            mine, theirs = w._map_block_ids_for_block_size_ratio(mine, theirs, ratio)
        if not any(len(g) > 0 for g in mine):
            continue  # a full prefix hit: send_notif alone
        mine, theirs = w._apply_prefix_caching(mine, theirs, 1, 1)
        remote_descs = w._compute_desc_ids(theirs, remote.num_blocks, None, 1)
        local_descs = w._compute_desc_ids(mine, local.num_blocks, ratio, 1)
        _move(at, local_list, local_descs, remote_list, remote_descs)
        reads.append(Read(rank, len(local_descs)))
    if ratio > 1 or enable_permute_local_kv:  # get_transfer_results
        covered = min(len(local_ids) * ratio, len(remote_ids))
        if local_ids:
            w.post_process_device_kv_on_receive(ratio, [(0, list(local_ids), covered)])
    return reads


# -- a hybrid model's rank: Mamba state groups beside attention --------------------------


def _hybrid_regions(r: Any) -> tuple[list[int], list[int], list[int], list[int]]:
    """``register_kv_caches``' regions of hybrid rank ``r`` (an ``engine`` and the ``kv``
    dict vLLM 0.33 hands the connector): layers in ``_region_sort_key`` order, one region
    per base address (vLLM overlays one layer of every group there), its block length and
    stride those of the layer registered first (a Mamba layer: its page split into the
    attention's kernel pages; an attention layer: its kernel page); and the regions that
    hold Mamba state (``_ssm_region_indices``). ``(bases, block_lens, strides, ssm)``."""
    ns = connector()
    ratio = _physical_per_logical(r.engine)
    bases: list[int] = []
    lens: list[int] = []
    strides: list[int] = []
    ssm: list[int] = []
    for name in sorted(r.kv, key=ns["_region_sort_key"]):
        cache, spec = r.kv[name], r.engine.spec_of(name)
        mamba = isinstance(spec, kvi.MambaSpec)
        page = spec.page_size_bytes if mamba else spec.page_size_bytes // ratio
        block_len, stride = (
            (page // ratio, page // ratio) if mamba else (page, cache.stride(0) * cache.element_size())
        )
        if cache.data_ptr() not in bases:
            bases.append(cache.data_ptr())
            lens.append(block_len)
            strides.append(stride)
        region = bases.index(cache.data_ptr())
        if mamba and region not in ssm:
            ssm.append(region)
    return bases, lens, strides, ssm


def _physical_per_logical(engine: Any) -> int:
    """``_physical_blocks_per_logical_kv_block``: the attention's block over its kernel's
    (``_sync_block_size_with_kernel``; Mamba groups keep their block)."""
    attention = [
        (g.kv_cache_spec.block_size, kernel)
        for g, kernel in zip(engine.config.kv_cache_groups, engine.kernel_block_sizes, strict=True)
        if not isinstance(g.kv_cache_spec, kvi.MambaSpec)
    ]
    block, kernel = attention[0]
    return int(block // kernel)


def _kernel_block_size(engine: Any) -> int:
    return int(next(
        kernel for g, kernel in zip(engine.config.kv_cache_groups, engine.kernel_block_sizes, strict=True)
        if not isinstance(g.kv_cache_spec, kvi.MambaSpec)
    ))  # fmt: skip


def _hybrid_math(r: Any, num_kv_heads: int, remote_tp: int) -> Any:
    """A ``ConnectorMath`` holding what hybrid rank ``r`` set up in ``__init__`` and
    ``register_kv_caches`` (no PLE, no ring, no DCP, no pipeline stages)."""
    ns = connector()
    w = ns["ConnectorMath"]()
    config = r.engine.config
    bases, lens, strides, ssm = _hybrid_regions(r)
    ratio = _physical_per_logical(r.engine)
    w.tp_rank = r.rank
    w.transfer_topo = SimpleNamespace(
        tp_rank=r.rank, tp_size=r.tp, is_mla=False, total_num_kv_heads=num_kv_heads,
        dcp_consumer_count=lambda remote_tp_size, remote_dcp_size: max(1, r.tp // remote_tp_size),
    )  # fmt: skip
    w.kv_cache_config = config
    w._group_spec_types = tuple(
        ns["get_representative_spec_type"](g.kv_cache_spec) for g in config.transfer_groups
    )
    w._has_mamba = True
    mamba = next(
        g.kv_cache_spec for g in config.transfer_groups if isinstance(g.kv_cache_spec, kvi.MambaSpec)
    )
    w._conv_decomp = ns["derive_mamba_conv_split"](mamba, r.tp)
    w._mamba_ssm_size = w._conv_decomp.ssm_sizes
    w._physical_blocks_per_logical_kv_block = ratio
    w._logical_num_blocks = config.num_blocks
    w.num_blocks = config.num_blocks * ratio
    w.block_size = _kernel_block_size(r.engine)
    w.kv_caches_base_addr = bases
    w.block_len_per_layer = lens
    w.block_stride_per_layer = strides
    w.num_regions = len(bases)
    w.region_num_blocks = [w.num_blocks] * len(bases)  # every region's, under Mamba
    w.num_descs = sum(w.region_num_blocks)
    w.region_group_ids = [-1] * len(bases)  # each region is every group's (_SHARED_REGION_GROUP_ID)
    w._uses_region_group_mapping = len(bases) > 1
    w._ssm_region_indices = ssm
    w._scratch_region_indices = []
    w._ple_region_index = w._ple_group_index = None
    w._region_is_mla = [False] * len(bases)
    w._transfer_layer_region_indices = []
    w._transfer_layer_group_ids = []
    w._head_sharded_draft_regions = set()
    w.device_id = 0
    w.use_mla = False
    w.plan = ns["compute_tp_mapping"](w.transfer_topo, remote_tp, w._group_spec_types)
    return w


def hybrid_read(
    local: Any, remotes: Sequence[Any], local_ids: Sequence[list[int]], remote_ids: Sequence[list[int]],
    num_kv_heads: int,
) -> list[Read]:  # fmt: skip
    """What vLLM 0.33's decode worker does for one request of a Mamba hybrid (a GDN model
    beside its attention, conv state ``"DS"``): ``local`` and ``remotes`` hybrid ranks
    (an ``engine``, the ``kv`` dict handed to the connector, its ``buf``, ``tp`` and
    ``rank``; ``remotes`` every prefill rank, by rank), ``local_ids`` / ``remote_ids`` the
    request's logical block ids per KV cache group as the scheduler hands them (a Mamba
    group's the running state alone: ``clip_ssm_state_blocks``). The handshake's lists
    (``register_local_xfer_handler``: ``_build_fa_local`` and ``_build_mamba_local``; per
    prefill rank ``_build_fa_remote`` and ``_build_mamba_remote``; where prefill has more
    ranks ``_build_local_splits_from_plan``), then ``_read_blocks_for_req`` and
    ``_read_blocks``: each source rank's groups (``source_ranks_per_group``), kernel block
    ids (``_logical_to_kernel_block_ids``), ``_apply_prefix_caching``,
    ``_compute_desc_ids`` on both sides; each descriptor's bytes moved as NIXL's READ
    moves them. Returns the READs posted."""
    remote_tp = remotes[0].tp
    w = _hybrid_math(local, num_kv_heads, remote_tp)
    plan = w.plan
    tp_ratio = local.tp // remote_tp if local.tp >= remote_tp else -(remote_tp // local.tp)
    ratio = w.block_size // _kernel_block_size(remotes[0].engine)  # block_size_ratio, kernel blocks
    at = _memory([local, *remotes])
    local_data = np.concatenate(
        [w._build_fa_local(w.kv_caches_base_addr, ratio), w._build_mamba_local(w.kv_caches_base_addr)]
    )
    if tp_ratio < 0:  # _needs_split_local_xfer_handles (not MLA)
        local_lists = list(w._build_local_splits_from_plan(plan, local_data, w.num_descs * ratio, ratio))
    else:
        local_lists = [local_data] * len(plan.all_source_ranks)
    mine_all = w._logical_to_kernel_block_ids(
        [list(g) for g in local_ids], w._physical_blocks_per_logical_kv_block
    )
    reads: list[Read] = []
    for i, rank in enumerate(plan.all_source_ranks):
        remote = remotes[rank]
        rw = _hybrid_math(remote, num_kv_heads, local.tp)  # what its handshake metadata says
        meta = SimpleNamespace(
            engine_id="prefill", kv_caches_base_addr=rw.kv_caches_base_addr, region_num_blocks=rw.region_num_blocks,
            num_blocks=rw.num_blocks, device_id=0, block_strides=rw.block_stride_per_layer,
            ssm_sizes=rw._mamba_ssm_size,
        )  # fmt: skip
        info = SimpleNamespace(remote_physical_blocks_per_logical=rw._physical_blocks_per_logical_kv_block)
        remote_list = _flat(np.concatenate([
            w._build_fa_remote(plan, meta, ratio), w._build_mamba_remote(meta, tp_ratio, info)
        ]))  # fmt: skip
        local_list = _flat(local_lists[i])
        theirs_all = rw._logical_to_kernel_block_ids(
            [list(g) for g in remote_ids], rw._physical_blocks_per_logical_kv_block
        )
        groups = range(len(local_ids))
        mine = [list(mine_all[g]) if rank in plan.source_ranks_per_group[g] else [] for g in groups]
        theirs = [list(theirs_all[g]) if rank in plan.source_ranks_per_group[g] else [] for g in groups]
        if not any(mine):
            continue  # a full prefix hit: send_notif alone
        mine, theirs = w._apply_prefix_caching(
            mine, theirs, w._physical_blocks_per_logical_kv_block, rw._physical_blocks_per_logical_kv_block
        )
        remote_descs = w._compute_desc_ids(
            theirs, rw.num_blocks, None, rw._physical_blocks_per_logical_kv_block,
            region_num_blocks=rw.region_num_blocks, region_group_ids=rw.region_group_ids,
            uses_region_group_mapping=rw._uses_region_group_mapping,
        )  # fmt: skip
        local_descs = w._compute_desc_ids(
            mine, w.num_blocks, ratio, w._physical_blocks_per_logical_kv_block,
            region_num_blocks=w.region_num_blocks, region_group_ids=w.region_group_ids,
            uses_region_group_mapping=w._uses_region_group_mapping,
        )  # fmt: skip
        _move(at, local_list, local_descs, remote_list, remote_descs)
        reads.append(Read(rank, len(local_descs), tuple(g for g in groups if mine[g])))
    return reads
