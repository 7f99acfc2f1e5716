"""A Mamba state page as the TP-sharded arrays it holds, read from vLLM's ``MambaSpec``.

vLLM lays a Mamba page out as conv state | SSM state | padding (``MambaBase.bind_kv_cache``
slices the page so). TP shards both: the conv state's dim concatenates the model's
sub-projections, each split over the ranks on its own (Mamba1 ``x``; Mamba2 ``x, B, C``;
Gated DeltaNet ``Q, K, V``), and the SSM state's first axis (heads, or Mamba1's
intermediate size) is split. The spec gives this rank's shapes and the model type; the
sub-projection sizes follow from them by the rules of vLLM's own hetero-TP transfer
(``ssm_conv_transfer_utils.derive_mamba_conv_split``). Unlike vLLM, which moves only
the ``"DS"`` conv order (``VLLM_SSM_CONV_STATE_LAYOUT=DS``, dim outermost), either order
reads here: the dim axis is the one the model's split fits.

Two kinds hold one state, which vLLM's calculator splits as plainly: linear attention
(``linear_attention_state_shape``: ``(heads / TP, head_dim, head_dim)``) by heads, and a
short convolution (``short_conv_state_shape``: the conv dim / TP) by its dim. A short
convolution's shape alone does not say which axis is the dim, so the order is the one
vLLM reads from ``VLLM_SSM_CONV_STATE_LAYOUT`` in this process, which laid the page out.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvlayout.integrations.mamba_splits import conv_parts
from kvlayout.integrations.vllm.specs import SpecKind, spec_field, spec_kind
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.opaque import PageArray

__all__ = ["conv_dim_first", "declared_state_arrays", "mamba_type", "replicated_state_arrays", "state_arrays"]


def mamba_type(spec: Any) -> str | None:
    """The spec's ``mamba_type`` as a lower-case name (``"mamba2"``, ``"gdn_attn"``), an
    enum member's name or a string alike; None where the spec has none."""
    value = spec_field(spec, "mamba_type", None)
    if value is None:
        return None
    name = getattr(value, "name", value)
    return name.lower() if isinstance(name, str) else None


def conv_dim_first() -> bool | None:
    """Whether vLLM lays conv states out dim first (``"DS"``), as
    ``mamba_utils.get_conv_state_layout`` reads ``VLLM_SSM_CONV_STATE_LAYOUT`` (unset:
    ``"SD"``); None for a value vLLM refuses."""
    layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    return {None: False, "SD": False, "DS": True}.get(layout)


def state_arrays(spec: Any) -> tuple[PageArray, ...]:
    """The TP-sharded arrays of a Mamba1, Mamba2, GDN, linear-attention or short-conv
    spec's page, or a ``tp_replicated`` spec's arrays every rank holds whole
    (:func:`replicated_state_arrays`); empty for any other spec, or where the shapes do
    not split as the model type says (a block map then moves the page only between ranks
    alike)."""
    if spec_kind(spec) is not SpecKind.MAMBA:
        return ()
    shapes, dtypes = spec_field(spec, "shapes", ()), spec_field(spec, "dtypes", ())
    if not all(isinstance(d, torch.dtype) for d in dtypes):
        return ()
    names = [str(d).removeprefix("torch.") for d in dtypes]
    states = [tuple(int(n) for n in shape) for shape in shapes]
    if spec_field(spec, "tp_replicated", False) is True:
        return replicated_state_arrays(states, names)
    if not 0 < len(shapes) == len(dtypes) <= 2:
        return ()  # a replay ring or other extra state: no rule says how TP splits it
    return declared_state_arrays(mamba_type(spec), states, names)


def replicated_state_arrays(states: list[tuple[int, ...]], names: list[str]) -> tuple[PageArray, ...]:
    """The arrays of a ``tp_replicated`` ``MambaSpec``'s page (vLLM 0.33: "every TP rank
    holds the full state", Qwen4's PLE short convolution, whose shape its layer computes at
    ``tp_world_size=1``): each state laid after the last (``MambaBase.bind_kv_cache``),
    held whole, so it moves whole between ranks of any TP degrees (as vLLM's NixlConnector
    copies the PLE pages whole); empty where a state or dtype is none."""
    if not 0 < len(states) == len(names) or any(name not in DTYPE_SIZES for name in names):
        return ()
    if any(not state or min(state) <= 0 for state in states):
        return ()
    arrays, offset = [], 0
    for state, name in zip(states, names, strict=True):
        array = PageArray(offset, state, name, 0, (state[0],), replicated=True)
        arrays.append(array)
        offset += array.nbytes
    return tuple(arrays)


def declared_state_arrays(
    kind: str | None, states: list[tuple[int, ...]], names: list[str]
) -> tuple[PageArray, ...]:
    """:func:`state_arrays` of a ``MambaSpec`` given by its fields: ``kind`` its
    ``mamba_type`` (:func:`mamba_type`'s name), ``states`` its ``shapes`` and ``names``
    its ``dtypes`` (``"bfloat16"``); empty where they do not split as the type says."""
    if not 0 < len(states) == len(names) <= 2:
        return ()
    if (
        any(name not in DTYPE_SIZES for name in names)
        or min((n for state in states for n in state), default=0) <= 0
    ):
        return ()
    if len(states) == 1:
        return _one_state(kind, states[0], names[0])
    conv, ssm = states
    if len(conv) != 2:
        return ()
    fits = [(axis, parts) for axis in (0, 1) if (parts := conv_parts(kind, conv[axis], ssm)) is not None]
    if len(fits) != 1:
        return ()  # no axis, or both, is the model's dim: which one TP splits is unknown
    axis, parts = fits[0]
    conv_array = PageArray(0, conv, names[0], axis, parts)
    return conv_array, PageArray(conv_array.nbytes, ssm, names[1], 0, (ssm[0],))


def _one_state(kind: str | None, state: tuple[int, ...], dtype: str) -> tuple[PageArray, ...]:
    """The array of a page of one state: linear attention's heads, a short convolution's
    dim (on the axis vLLM's conv layout puts it)."""
    if kind == "linear" and len(state) == 3:
        return (PageArray(0, state, dtype, 0, (state[0],)),)
    dim_first = conv_dim_first()
    if kind == "short_conv" and len(state) == 2 and dim_first is not None:
        axis = 0 if dim_first else 1
        parts = conv_parts(kind, state[axis], ())
        return (PageArray(0, state, dtype, axis, parts),) if parts is not None else ()
    return ()
