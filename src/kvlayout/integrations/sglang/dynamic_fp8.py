"""SGLang's dynamic-FP8 MHA pool's HiCache host scales (``MHATokenToKVPoolDynamicFP8Host``),
as a registration.

``MHATokenToKVPoolDynamicFP8`` keeps one float32 scale a token slot and KV head beside
its FP8 K and V (``k_scale_buffer`` / ``v_scale_buffer``, per layer ``[size + page_size,
head_num]``: read as K/V page buffers of one-element heads, ``t.unsqueeze(-1)``). Its
HiCache host pool (``page_first`` or ``page_first_direct`` payload) keeps them apart from
``kv_buffer``, in one tensor a host page at a time: ``scale_host``, float32 ``[page_num,
2, layer_num, page_size, head_num]``, ``scale_host[page, 0, layer, j, h]`` the K scale of
the page's token ``j`` (``backup_from_device_all_layer``: a page of device slots, reshaped
``[pages, page_size, head_num]``, lands at ``k_scale_host[host_pages, layer]``). That is a
block-outermost cache of K/V planes of every layer, one-element heads: the format
``NB_KV_NL_BS_NH_HS`` (MAX's cross-layer layout) of ``scale_host[..., None]``, block ids
host page ids (a host index over ``page_size``), blocks of ``page_size`` tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import DetectionError
from kvlayout.registration.backing import no_memory
from kvlayout.registration.registration import Registration, RegistrationError, bind

__all__ = ["DynamicFp8ScaleError", "dynamic_fp8_host_scales"]

_SHAPE = "float32 [page_num, 2, layer_num, page_size, head_num] (MHATokenToKVPoolDynamicFP8Host.scale_host)"


class DynamicFp8ScaleError(DetectionError):
    """A tensor that is not the host scale pool of SGLang's dynamic-FP8 MHA pool."""


def dynamic_fp8_host_scales(scale_host: Any) -> Registration:
    """``scale_host`` (SGLang's ``MHATokenToKVPoolDynamicFP8Host.scale_host``) as a
    registration of K and V scales, every layer's, a host page a block of ``page_size``
    tokens: a block map moves a request's scales between it and the device pool's
    ``k_scale_buffer`` / ``v_scale_buffer`` (detected as ``[[t.unsqueeze(-1) for t in
    k_scale_buffer], [t.unsqueeze(-1) for t in v_scale_buffer]]`` with ``tokens_per_block``
    the page size), K to K and V to V, host block ids the host page ids. Raises
    :class:`DynamicFp8ScaleError` for anything else."""
    if not isinstance(scale_host, torch.Tensor):
        raise DynamicFp8ScaleError(f"scale_host is {type(scale_host).__name__}, not a tensor {_SHAPE}")
    shape = list(scale_host.shape)
    if scale_host.dtype != torch.float32 or scale_host.dim() != 5 or shape[1] != 2 or not scale_host.numel():
        raise DynamicFp8ScaleError(f"scale_host is {shape} {scale_host.dtype}, not {_SHAPE}")
    problem = no_memory(scale_host)
    if problem is not None:
        raise DynamicFp8ScaleError(f"scale_host {shape} {problem}")
    try:
        return bind(
            scale_host.unsqueeze(-1),
            EngineKVFormat.NB_KV_NL_BS_NH_HS,
            engine=EngineType.SGLANG,
            root="scale_host",
            sources=scale_host,
        )
    except RegistrationError as exc:  # a view whose strides are not SGLang's allocation
        raise DynamicFp8ScaleError(f"{exc} (SGLang allocates scale_host as one contiguous tensor)") from None
