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
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout.integrations.mamba_splits import conv_parts
from kvlayout.integrations.vllm.specs import SpecKind, spec_field, spec_kind
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.opaque import PageArray

__all__ = ["mamba_type", "state_arrays"]


def mamba_type(spec: Any) -> str | None:
    """The spec's ``mamba_type`` as a lower-case name (``"mamba2"``, ``"gdn_attn"``), an
    enum member's name or a string alike; None where the spec has none."""
    value = spec_field(spec, "mamba_type", None)
    if value is None:
        return None
    name = getattr(value, "name", value)
    return name.lower() if isinstance(name, str) else None


def state_arrays(spec: Any) -> tuple[PageArray, ...]:
    """The conv and SSM arrays of a Mamba1, Mamba2 or GDN spec's page; empty for any
    other spec, or where the shapes do not split as the model type says (a block map
    then moves the page only between ranks alike)."""
    if spec_kind(spec) is not SpecKind.MAMBA or spec_field(spec, "tp_replicated", False):
        return ()
    shapes, dtypes = spec_field(spec, "shapes", ()), spec_field(spec, "dtypes", ())
    if len(shapes) != 2 or len(dtypes) != 2 or not all(isinstance(d, torch.dtype) for d in dtypes):
        return ()  # a replay ring or other extra state: no rule says how TP splits it
    conv, ssm = (tuple(int(n) for n in shape) for shape in shapes)
    if len(conv) != 2 or min(conv + ssm, default=0) <= 0:
        return ()
    kind = mamba_type(spec)
    fits = [(axis, parts) for axis in (0, 1) if (parts := conv_parts(kind, conv[axis], ssm)) is not None]
    if len(fits) != 1:
        return ()  # no axis, or both, is the model's dim: which one TP splits is unknown
    axis, parts = fits[0]
    conv_dtype, ssm_dtype = (str(d).removeprefix("torch.") for d in dtypes)
    if conv_dtype not in DTYPE_SIZES or ssm_dtype not in DTYPE_SIZES:
        return ()
    conv_array = PageArray(0, conv, conv_dtype, axis, parts)
    return conv_array, PageArray(conv_array.nbytes, ssm, ssm_dtype, 0, (ssm[0],))
