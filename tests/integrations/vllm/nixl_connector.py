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


def _memory(ranks: Sequence[Rank]) -> Any:
    def at(address: int, length: int) -> torch.Tensor:
        for r in ranks:
            flat = r.buf.view(-1)
            base = int(flat.data_ptr())
            if base <= address and address + length <= base + flat.numel():
                return flat[address - base : address - base + length]
        raise AssertionError(f"descriptor {address:#x}+{length} is in no registered buffer")

    return at


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
        assert len(local_descs) == len(remote_descs)
        for lid, rid in zip(local_descs.tolist(), remote_descs.tolist(), strict=True):
            (la, ln), (ra, rn) = local_list[lid], remote_list[rid]
            assert ln == rn, f"descriptor lengths differ: local {ln}, remote {rn}"
            at(la, ln).copy_(at(ra, rn))
        reads.append(Read(rank, len(local_descs)))
    if ratio > 1 or enable_permute_local_kv:  # get_transfer_results
        covered = min(len(local_ids) * ratio, len(remote_ids))
        if local_ids:
            w.post_process_device_kv_on_receive(ratio, [(0, list(local_ids), covered)])
    return reads
