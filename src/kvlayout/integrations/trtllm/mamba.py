"""TRT-LLM's Mamba state pools as registrations of opaque pages, one per state.

TRT-LLM's PyTorch backend keeps a hybrid model's recurrent states apart from its KV pool
(``PythonMambaCacheManager.__init__``, reached as ``MambaCacheManager._impl`` and
``MixedMambaHybridCacheManager._impl``): ``mamba_cache.conv`` ``[NL, slots, conv_dim,
d_conv - 1]`` and ``mamba_cache.temporal`` (the SSM state) ``[NL, slots, nheads,
head_dim, d_state]``, this rank's shares, layer-first. ``KVCacheManagerV2``'s
``V2MambaHybridCacheManager`` keeps them in its pool instead, one view a layer
(``all_conv_states[i]``, ``all_ssm_states[i]``: ``[slots, *state]``), its slots a
coalesced V2 slot apart (``_get_state_buffer``). Either way a slot's state of one layer
is one contiguous item, and TRT-LLM's own P/D transceiver moves exactly that
(``disaggregation/resource/kv_extractor.py``: ``slot_bytes`` one layer's item;
``native/mixers/ssm/peer.py``: a layer's item at ``base + layer * slots * slot_bytes +
slot * slot_bytes`` in the first, ``layer_slot0_address + slot * stride`` in the other).
Between TP degrees it splits the conv state's sections (``conv_section_dims``: Mamba2's
``x, B, C``, Qwen3-Next's ``Q, K, V``) each on its own, and the SSM state by heads.

``CppMambaHybridCacheManager`` keeps them in the C++ KV cache manager's recurrent-state
pool, layer-first ``[NL, blocks, 1, ssm_bytes + conv_bytes]`` (``WindowBlockManager::
allocatePools``), and hands out views of it (``_setup_states``): ``all_ssm_states`` ``[NL,
blocks, nheads, head_dim, d_state]`` (each block's first ``ssm_bytes``) and
``all_conv_states`` ``[NL, blocks, conv_dim, d_conv - 1]`` (the bytes after), slots a block
apart. Its C++ transceiver (``rnnCacheFormatter.cpp``, unified pool) addresses the same
bytes, ``base + layer * blocks * block_bytes + block * block_bytes`` (+ ``ssm_bytes`` for
the conv state), blocks by their pool index, and splits the conv sections its
``linear_attention_metadata`` names (``rnn_conv_section_layout``: 1 Mamba2's ``x, B, C``,
2 Qwen3-Next's ``Q, K, V``; 0 none, which that transceiver refuses between TP degrees).

:func:`mamba_state_pools` reads each state as a list of its layers' item rows, marked
as opaque pages whose arrays declare those splits; block ids are TRT-LLM's slot ids
(``get_state_indices``). TRT-LLM is not imported: managers are read structurally.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.integrations.mamba_splits import ordered_parts
from kvlayout.integrations.page_lists import dtype_name, listed_pages
from kvlayout.registration.backing import no_memory
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.registration import Registration

__all__ = ["MambaStateError", "mamba_state_pools"]


class MambaStateError(DetectionError):
    """A TRT-LLM Mamba cache manager whose states are not what its allocators make."""


def _states(manager: Any) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], Any]:
    """Each state's per-layer ``[slots, *state]`` tensors, the tensors the manager
    allocated beside each (what a re-allocation replaces), and ``conv_section_dims``
    (None where the manager holds none)."""
    if getattr(manager, "local_num_mamba_layers", None) == 0:
        # CppMambaHybridCacheManager then makes no views at all (a PP rank of attention layers)
        raise MambaStateError(
            f"the {type(manager).__name__}'s rank holds no Mamba layers (local_num_mamba_layers 0): no "
            "state to read"
        )
    if hasattr(manager, "all_conv_states") and hasattr(manager, "all_ssm_states"):
        if manager.all_conv_states is None or manager.all_ssm_states is None:
            raise MambaStateError(
                "the manager's all_conv_states / all_ssm_states are None: shut down, or a rank without "
                "Mamba layers (local_num_mamba_layers 0), which holds no state to read"
            )
        if isinstance(manager.all_conv_states, torch.Tensor) or isinstance(
            manager.all_ssm_states, torch.Tensor
        ):
            return _pool_states(manager)
        named = {"conv": manager.all_conv_states, "ssm": manager.all_ssm_states}
        for name, layers in named.items():
            attribute = "all_conv_states" if name == "conv" else "all_ssm_states"
            if isinstance(layers, torch.Tensor) or not isinstance(layers, list | tuple) or not layers:
                raise MambaStateError(
                    f"the manager's {attribute} is {type(layers).__name__}, not a non-empty list of "
                    "per-layer tensors (V2MambaHybridCacheManager's; a rank without Mamba layers has none)"
                )
            for i, t in enumerate(layers):
                if not isinstance(t, torch.Tensor) or t.dim() < 2:
                    what = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise MambaStateError(
                        f"the manager's {attribute}[{i}] is {what}, not a [slots, *state] tensor"
                    )
                _memory(t, f"{attribute}[{i}]")
        states = {name: list(layers) for name, layers in named.items()}
        return states, states, getattr(manager, "conv_section_dims", None)
    holder = manager if hasattr(manager, "mamba_cache") else getattr(manager, "_impl", None)
    cache = getattr(holder, "mamba_cache", None)
    if cache is None:
        raise MambaStateError(
            f"{type(manager).__name__} is not a TRT-LLM Mamba cache manager: a PythonMambaCacheManager "
            "(mamba_cache.conv, mamba_cache.temporal), a manager holding one (_impl: MambaCacheManager, "
            "MixedMambaHybridCacheManager), a CppMambaHybridCacheManager (all_conv_states, all_ssm_states: "
            "[NL, blocks, *state] views of its recurrent-state pool) or a V2MambaHybridCacheManager "
            "(all_conv_states, all_ssm_states: lists of per-layer views)"
        )
    states, over, _ = _layer_first(
        {"conv": getattr(cache, "conv", None), "ssm": getattr(cache, "temporal", None)},
        {"conv": "mamba_cache.conv", "ssm": "mamba_cache.temporal"},
        "[NL, slots, *state] tensor",
    )
    return states, over, getattr(holder, "conv_section_dims", None)


def _memory(t: torch.Tensor, attribute: str) -> None:
    """A view of freed memory (a shut-down manager's) is no state to read."""
    problem = no_memory(t)
    if problem is not None:
        raise MambaStateError(f"the manager's {attribute} {list(t.shape)} {problem}")


def _pool(t: torch.Tensor, attribute: str) -> torch.Tensor:
    """A layer-first pool ``t`` (the manager's ``attribute``) with layers and memory."""
    if not t.shape[0]:
        raise MambaStateError(f"the manager's {attribute} {list(t.shape)} holds no layers: no state to read")
    _memory(t, attribute)
    return t


def _pool_states(manager: Any) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], Any]:
    """``CppMambaHybridCacheManager``'s states: ``[NL, blocks, *state]`` views of its
    recurrent-state pool, read a layer at a time; its sections from the metadata its C++
    transceiver reads."""
    states, over, (conv, ssm) = _layer_first(
        {"conv": manager.all_conv_states, "ssm": manager.all_ssm_states},
        {"conv": "all_conv_states", "ssm": "all_ssm_states"},
        "[NL, blocks, *state] view of its recurrent-state pool (CppMambaHybridCacheManager's)",
    )
    return states, over, _pool_sections(manager, tuple(conv.shape[2:]), tuple(ssm.shape[2:]))


def _layer_first(
    given: dict[str, Any], names: dict[str, str], what: str
) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """Layer-first states (``[NL, slots, *state]``, V1's pools and the C++ pool's views):
    each state's per-layer tensors, the tensor each was viewed from (what a re-allocation
    replaces), and the conv and SSM tensors."""
    for name, t in given.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            shown = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise MambaStateError(f"the manager's {names[name]} is {shown}, not a {what}")
    given = {name: _pool(t, names[name]) for name, t in given.items()}
    conv, ssm = given["conv"], given["ssm"]
    if conv.shape[:2] != ssm.shape[:2] or conv.device != ssm.device:
        raise MambaStateError(
            f"the manager's conv state {list(conv.shape)} on {conv.device} and SSM state {list(ssm.shape)} "
            f"on {ssm.device}: the same layers and slots on one device expected ([NL, slots, *state])"
        )
    states = {name: list(t.unbind(0)) for name, t in given.items()}
    over = {name: [t] * t.shape[0] for name, t in given.items()}
    return states, over, (conv, ssm)


# rnn_conv_section_layout (mamba_cache_manager's conv_section_map; the C++ RnnModelConfig's
# ConvSectionLayout kXBC / kQKV): the model type whose sections the conv state holds.
_SECTION_LAYOUTS = {1: ("mamba2", "x, B, C (nemotron_hybrid)"), 2: ("gdn_attn", "Q, K, V (qwen3_next)")}


def _pool_sections(manager: Any, conv: tuple[int, ...], ssm: tuple[int, ...]) -> list[int] | None:
    """This rank's conv sections as the C++ transceiver computes them from the manager's
    ``linear_attention_metadata`` (``RnnModelConfig::getConvSectionDims``: global dims,
    each over this rank's TP degree): the heads' projection ``heads * head_dim`` and two of
    ``groups * d_state``, in the order of the model type the layout names. None where the
    layout names no sections (0: another model type)."""
    meta = getattr(manager, "linear_attention_metadata", None)
    layout = getattr(meta, "rnn_conv_section_layout", None)
    if layout == 0:
        return None
    fields = ("rnn_num_heads", "rnn_head_dim", "rnn_n_groups", "rnn_d_state")
    values = [getattr(meta, f, None) for f in fields]
    ints = [v for v in values if type(v) is int and v > 0]
    if layout not in _SECTION_LAYOUTS or len(ints) != len(fields):
        raise MambaStateError(
            f"the manager's linear_attention_metadata (rnn_conv_section_layout {layout!r}, "
            f"{', '.join(f'{f} {v!r}' for f, v in zip(fields, values, strict=True))}) is not what "
            "CppMambaHybridCacheManager sets: a layout of 0, 1 or 2 and positive ints"
        )
    heads, head_dim, groups, d_state = ints
    kind, named = _SECTION_LAYOUTS[layout]
    dims = list(ordered_parts(kind, heads * head_dim, groups * d_state))
    tp = heads // ssm[0] if len(ssm) == 3 and ssm[0] else 0
    if (
        not tp
        or heads != tp * ssm[0]
        or any(d % tp for d in dims)
        or len(conv) != 2
        or sum(dims) != tp * conv[0]
    ):
        raise MambaStateError(
            f"the manager's states (conv {list(conv)}, SSM {list(ssm)} a block) are no TP share of the "
            f"model its linear_attention_metadata describes ({heads} heads, conv sections {dims}, "
            f"{named})"
        )
    return [d // tp for d in dims]


def _check_layers(states: dict[str, list[torch.Tensor]]) -> None:
    """Every layer of a state alike, the states of as many layers and slots, on one device."""
    first = states["conv"][0]
    for name, layers in states.items():
        if len(layers) != len(states["conv"]):
            raise MambaStateError(
                f"the manager holds {len(states['conv'])} layers of conv state and {len(layers)} of "
                f"{name} state"
            )
        for i, t in enumerate(layers):
            if (t.shape, t.dtype, t.device) != (layers[0].shape, layers[0].dtype, layers[0].device):
                raise MambaStateError(
                    f"the {name} state of layer {i} is {list(t.shape)} {t.dtype} on {t.device}, of layer "
                    f"0 {list(layers[0].shape)} {layers[0].dtype} on {layers[0].device}: every layer alike "
                    "expected"
                )
            if t.shape[0] != first.shape[0] or t.device != first.device:
                raise MambaStateError(
                    f"the {name} state {list(t.shape)} on {t.device} a layer and the conv state "
                    f"{list(first.shape)} on {first.device}: the same slots on one device expected"
                )


def _arrays(
    conv: tuple[int, ...], ssm: tuple[int, ...], sections: Any, dtypes: dict[str, str]
) -> dict[str, tuple[PageArray, ...]]:
    """How TP splits each state, as TRT-LLM's transceiver splits it: the conv state's
    sections on axis 0 each on its own, the SSM state by heads; none (whole items,
    rank to rank) where the manager names no sections."""
    if len(ssm) != 3:
        raise MambaStateError(
            f"the SSM state {list(ssm)} a slot is not (nheads, head_dim, d_state), as TRT-LLM allocates it"
        )
    if len(conv) != 2:
        raise MambaStateError(
            f"the conv state {list(conv)} a slot is not (conv_dim, d_conv - 1), as TRT-LLM allocates it"
        )
    if sections is None:
        return {"conv": (), "ssm": ()}
    parts = tuple(sections) if isinstance(sections, list | tuple) else None
    if parts is None or not all(type(n) is int and n > 0 for n in parts) or sum(parts) != conv[0]:
        raise MambaStateError(
            f"the manager's conv_section_dims {sections!r} are not positive ints summing to the conv state's "
            f"{conv[0]} channels (conv state {list(conv)} a slot)"
        )
    return {
        "conv": (PageArray(0, conv, dtypes["conv"], 0, parts),),
        "ssm": (PageArray(0, ssm, dtypes["ssm"], 0, (ssm[0],)),),
    }


def _rows(name: str, layer: int, t: torch.Tensor) -> torch.Tensor:
    """One layer's state ``[slots, *state]`` as int8 rows ``[slots, 1, bytes]``, a view:
    each slot's item contiguous; slots may lie any distance apart."""
    try:
        return t.view(t.shape[0], 1, -1).view(torch.int8)
    except RuntimeError:
        raise MambaStateError(
            f"the {name} state of layer {layer} {list(t.shape)} (strides {list(t.stride())}) is not one "
            "contiguous item a slot, as TRT-LLM allocates it"
        ) from None


def mamba_state_pools(manager: Any) -> dict[str, Registration]:
    """TRT-LLM's Mamba states (a ``PythonMambaCacheManager``, a ``MambaCacheManager`` or
    ``MixedMambaHybridCacheManager`` holding one, a ``CppMambaHybridCacheManager`` or a
    ``V2MambaHybridCacheManager``) as one registration each: ``"conv"`` and ``"ssm"``.

    Block ids are TRT-LLM's slot ids (``get_state_indices``), one slot a block; for
    ``CppMambaHybridCacheManager`` its recurrent-state pool's block indices (what
    ``get_state_indices`` returns; a request's snapshot blocks too, never placeholders). A state
    maps to the same state of another pool, whole items slot to slot, one run a layer;
    given both shards (``Shard(rank, tp, ...)``) a map between ranks of two TP degrees
    moves the slices both hold, as TRT-LLM's transceiver slices them. Raises
    :class:`MambaStateError` for anything else."""
    states, over, sections = _states(manager)
    _check_layers(states)
    shapes = {name: tuple(int(n) for n in layers[0].shape[1:]) for name, layers in states.items()}
    if not states["conv"][0].shape[0] or not all(math.prod(s) for s in shapes.values()):
        raise MambaStateError(
            f"the manager's states hold no bytes (conv {list(states['conv'][0].shape)}, ssm "
            f"{list(states['ssm'][0].shape)} a layer): no slot to read"
        )
    dtypes = {
        name: dtype_name(layers[0], f"the manager's {name} state", MambaStateError)
        for name, layers in states.items()
    }
    arrays = _arrays(shapes["conv"], shapes["ssm"], sections, dtypes)
    pools = {}
    for name, layers in states.items():
        rows = [_rows(name, i, t) for i, t in enumerate(layers)]
        page = OpaquePages(f"TRT-LLM Mamba {name}: {dtypes[name]} {list(shapes[name])}", False, arrays[name])
        pools[name] = listed_pages(rows, page, over[name], 1, EngineType.TRTLLM)
    return pools
