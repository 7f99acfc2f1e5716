"""How tensor parallelism splits a Mamba model's conv state: the model's rule, which
vLLM and SGLang both follow.

A conv state's dim concatenates the model's sub-projections, each split over the ranks
on its own: Mamba1 ``x``; a short convolution (LFM2's ``ShortConv``) its one projection,
beside no SSM state; Mamba2 ``x, B, C`` (``B`` and ``C`` are ``n_groups * d_state``
each); Gated DeltaNet ``Q, K, V`` (``Q`` and ``K`` are key heads times the key head
size); Kimi Delta Attention its value projection, then two key projections. The SSM
state's shape (heads, head size, last axis) gives the sizes, so a rank's state shapes
alone fix its parts.
"""

from __future__ import annotations

__all__ = ["conv_parts"]


def conv_parts(kind: str | None, dim: int, ssm: tuple[int, ...]) -> tuple[int, ...] | None:
    """This rank's sub-projection lengths of a conv state ``dim`` long, for the Mamba type
    ``kind`` (vLLM's names: ``"mamba1"``, ``"mamba2"``, ``"gdn_attn"``, ``"short_conv"``,
    whose page holds no SSM state: ``ssm`` is then ``()``; ``"kda"``: Kimi
    Delta Attention's three projections in one conv state, as newer SGLang keeps them) and
    this rank's SSM state shape ``ssm``; None where the type's split does not fit them."""
    if kind == "short_conv":  # one ColumnParallelLinear output, no SSM state
        return (dim,) if not ssm else None
    if kind == "mamba1":
        return (dim,) if len(ssm) == 2 and ssm[0] == dim else None
    if len(ssm) != 3:
        return None
    heads, head_dim, last = ssm
    rest = dim - heads * head_dim
    if rest <= 0 or rest % 2:
        return None
    if kind == "kda":  # V's heads, then K's two projections of any key head size (SSM (heads, hd, hd))
        return heads * head_dim, rest // 2, rest // 2
    if (rest // 2) % last:
        return None  # Mamba2: B and C are n_groups * d_state each; GDN: Q and K are key heads * dk
    if kind == "mamba2":
        return heads * head_dim, rest // 2, rest // 2
    if kind == "gdn_attn":
        return rest // 2, rest // 2, heads * head_dim
    return None
