"""Start-up validation: the KV cache groups kvlayout cannot serve, reported together.

Two group kinds cannot be stored and found again by a prefix's block ids (an offload
tier's use, the default; a P/D transfer, ``prefix_reuse=False``, moves each request's
blocks once, so it serves Mamba in any mode):

- cross-attention: its KV is computed from the encoder input, not from the prompt
  tokens a block id stands for, so a prefix match says nothing about its content;
- Mamba without ``mamba_cache_mode='align'``: only align mode keeps one state snapshot
  per block boundary ('none' keeps just the running state; 'all', removed in vLLM 0.33,
  snapshots differently), so there is no per-block state to reuse.

Declared slot compression is not rejected: those groups are served in their declared
slots (the group edits only group their kernel pages, as for any group).

A group vLLM keeps out of prefix caching (its spec's ``prefix_cacheable`` False, vLLM 0.33:
``CircularBufferSpec``, DeepSeek-V4.1's compressor ring, and its sliding-window MLA cache
under ``--swa-bounded-replay``, on by default) is not refused but left out of an
offload tier, as vLLM's own hash-addressed stores leave it out
(:func:`find_kv_cache_groups_out_of_prefix_reuse`); a P/D connector moves it.
"""

from __future__ import annotations

from typing import Any

from kvlayout.integrations.vllm.errors import GroupProblem, UnsupportedKVCacheGroupsError
from kvlayout.integrations.vllm.specs import (
    SpecKind,
    iter_group_layer_specs,
    iter_groups,
    spec_field,
    spec_kind,
    spec_size,
)

__all__ = [
    "find_kv_cache_groups_out_of_offloading",
    "find_kv_cache_groups_out_of_prefix_reuse",
    "find_unsupported_kv_cache_groups",
    "validate_kv_cache_groups",
]

SUPPORTED_MAMBA_CACHE_MODE = "align"
# vLLM 0.33's KVCacheGroupRole.HISPARSE_INDEXER (a str enum: its value compares equal)
HISPARSE_INDEXER_ROLE = "hisparse_indexer"


def _problem(spec: Any, prefix_reuse: bool) -> str | None:
    if spec_size(spec, "block_size") is None:
        return (
            f"{type(spec).__name__} with block_size={spec_field(spec, 'block_size', None)!r}: block ids "
            "need a positive int block_size"
        )
    kind = spec_kind(spec)
    if kind is SpecKind.CROSS_ATTENTION:  # also for P/D: the edits and their checks leave it as registered
        return "CrossAttentionSpec: cross-attention KV depends on the encoder input, not on the prompt blocks"
    if kind is SpecKind.MAMBA and prefix_reuse:
        mode = spec_field(spec, "mamba_cache_mode", None)
        if mode != SUPPORTED_MAMBA_CACHE_MODE:
            return (
                f"MambaSpec with mamba_cache_mode={mode!r}: only 'align' keeps one reusable "
                "state snapshot per block (a prefix-reusing tier's refusal: a P/D connector, which "
                "moves each request's blocks once, passes prefix_reuse=False)"
            )
    return None


def find_unsupported_kv_cache_groups(
    kv_cache_config: Any, *, prefix_reuse: bool = True
) -> list[GroupProblem]:
    """Every (group, reason) kvlayout cannot serve, groups indexed by position
    (``prefix_reuse``: as the module says).

    Leaf specs are checked one by one (``UniformTypeKVCacheSpecs`` unwrapped), and the
    layers sharing a reason within a group are reported as one problem.
    """
    if kv_cache_config is None:
        return []
    problems: list[GroupProblem] = []
    for group_idx, group in iter_groups(kv_cache_config):
        layers_by_reason: dict[str, list[str]] = {}
        if getattr(group, "kv_cache_spec", None) is None:
            layers_by_reason["the group has no kv_cache_spec"] = []
        for layer_name, spec in iter_group_layer_specs(group):
            reason = _problem(spec, prefix_reuse)
            if reason is not None:
                layers_by_reason.setdefault(reason, []).append(layer_name or "(the group names none)")
        problems.extend(GroupProblem(group_idx, r, tuple(ls)) for r, ls in layers_by_reason.items())
    return problems


def validate_kv_cache_groups(kv_cache_config: Any, *, prefix_reuse: bool = True) -> None:
    """Raise one :class:`UnsupportedKVCacheGroupsError` listing every unservable group.

    ``None`` (no config yet) passes. Call it at connector start-up; the group edits call
    it again before touching any tensor. ``prefix_reuse=False`` for a connector that
    moves each request's blocks once (P/D), never found again by a prefix: Mamba outside
    align mode is then served.
    """
    problems = find_unsupported_kv_cache_groups(kv_cache_config, prefix_reuse=prefix_reuse)
    if problems:
        raise UnsupportedKVCacheGroupsError(problems)


def find_kv_cache_groups_out_of_prefix_reuse(kv_cache_config: Any) -> list[GroupProblem]:
    """Every group vLLM keeps out of prefix caching, with why and its layers: a spec
    whose ``prefix_cacheable`` is False (vLLM 0.33: ``CircularBufferSpec``, one ring a
    request holding its latest positions, not a prefix's; ``SlidingWindowMLASpec`` with
    ``bounded_replay``, DeepSeek-V4.1's window under ``--swa-bounded-replay``, on by
    default, which vLLM recomputes after a prefix hit; ``UniformTypeKVCacheSpecs`` when
    any of its specs is so). vLLM's hash-addressed stores keep only the others
    (``KVCacheConfig.prefix_cacheable_group_ids``, which the OffloadingConnector offloads
    and the Mooncake store stores), so an offload tier (``prefix_reuse=True``) leaves these
    out: :func:`~kvlayout.integrations.vllm.apply_kv_cache_group_edits` drops their layers
    and logs them. A release without the property has none."""
    if kv_cache_config is None:
        return []
    left_out: list[GroupProblem] = []
    for group_idx, group in iter_groups(kv_cache_config):
        spec = getattr(group, "kv_cache_spec", None)
        if spec is None or spec_field(spec, "prefix_cacheable", True) is not False:
            continue
        kinds = sorted({type(leaf).__name__ for _, leaf in iter_group_layer_specs(group)})
        layers = tuple(name for name, _ in iter_group_layer_specs(group) if name is not None)
        left_out.append(
            GroupProblem(
                group_idx,
                f"{'/'.join(kinds)} is not prefix-cacheable (vLLM stores only prefix_cacheable_group_ids "
                "by prefix hash): left out of a prefix-reusing tier; a P/D connector passes "
                "prefix_reuse=False to move it",
                layers,
            )
        )
    return left_out


def find_kv_cache_groups_out_of_offloading(kv_cache_config: Any) -> list[GroupProblem]:
    """Every group vLLM's OffloadingConnector does not store, with why and its layers:
    the complement of its ``get_offloading_group_ids`` (vLLM 0.33,
    distributed/kv_transfer/kv_connector/v1/offloading/config.py). Without HiSparse that
    is ``prefix_cacheable_group_ids``, so these are
    :func:`find_kv_cache_groups_out_of_prefix_reuse`'s groups. Under HiSparse (the config's
    ``hisparse_host_num_blocks`` set) it stores only the ``HISPARSE_INDEXER`` groups: the
    sparse-MLA source group already lives in HiSparse's host pool, and the model's other
    groups are left out too, prefix-cacheable or not, so every transferred group of
    another role is left out here (an indexer group is kept even where its spec is not
    prefix-cacheable, as vLLM keeps it). Other hash-addressed stores (the Mooncake store)
    keep ``prefix_cacheable_group_ids`` under HiSparse as well: this is the
    OffloadingConnector's own choice, what :func:`~kvlayout.integrations.vllm.apply_kv_cache_group_edits`
    follows under ``prefix_reuse``."""
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is None:
        return find_kv_cache_groups_out_of_prefix_reuse(kv_cache_config)
    left_out: list[GroupProblem] = []
    for group_idx, group in iter_groups(kv_cache_config):
        role = getattr(group, "role", None)
        if role == HISPARSE_INDEXER_ROLE:
            continue
        shown = getattr(role, "value", role)
        left_out.append(
            GroupProblem(
                group_idx,
                f"HiSparse is on (hisparse_host_num_blocks set) and the group's role is {shown!r}: vLLM's "
                "OffloadingConnector stores only the HiSparse indexer groups (get_offloading_group_ids; the "
                "source group lives in HiSparse's host pool): left out of a prefix-reusing tier; a P/D "
                "connector passes prefix_reuse=False to move it",
                tuple(name for name, _ in iter_group_layer_specs(group) if name is not None),
            )
        )
    return left_out
