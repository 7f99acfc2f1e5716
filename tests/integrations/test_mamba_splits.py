"""The conv state's sub-projection order, stated once for every engine's reader."""

from __future__ import annotations

import pytest

from kvlayout.integrations.mamba_splits import conv_parts, ordered_parts


def test_the_order_is_each_models_and_conv_parts_reads_it() -> None:
    """TRT-LLM's ``RnnModelConfig::getConvSectionDims``: ``kXBC`` (Nemotron-H, Mamba2)
    ``[d_inner, ng_ds, ng_ds]``, ``kQKV`` (Qwen3-Next, GDN) ``[ng_ds, ng_ds, d_inner]``; a
    rank's state shapes give vLLM's and SGLang's the same way (x of 16, B and C of 8)."""
    assert ordered_parts("mamba2", 16, 8) == (16, 8, 8)
    assert ordered_parts("gdn_attn", 16, 8) == (8, 8, 16)
    assert conv_parts("mamba2", 32, (4, 4, 4)) == (16, 8, 8)
    assert conv_parts("gdn_attn", 32, (4, 4, 4)) == (8, 8, 16)
    with pytest.raises(ValueError, match=r"no conv sub-projection order for Mamba type 'mamba1' \(known: "):
        ordered_parts("mamba1", 16, 8)


def test_a_short_convolution_is_one_projection_beside_no_ssm_state() -> None:
    """LFM2's ``ShortConv``: the conv dim is one part; with an SSM state beside it the
    page is no short convolution's."""
    assert conv_parts("short_conv", 1024, ()) == (1024,)
    assert conv_parts("short_conv", 1024, (8, 4, 4)) is None
