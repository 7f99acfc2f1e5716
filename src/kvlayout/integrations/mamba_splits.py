"""How tensor parallelism splits a Mamba model's conv state: the model's rule, which
vLLM, SGLang and TRT-LLM all follow (TRT-LLM's ``conv_section_dims`` and its C++
``RnnModelConfig::getConvSectionDims``: ``kXBC`` Mamba2's order, ``kQKV`` GDN's).

A conv state's dim concatenates the model's sub-projections, each split over the ranks
on its own: Mamba1 ``x``; a short convolution (LFM2's ``ShortConv``) its one projection,
beside no SSM state; Mamba2 ``x, B, C`` (``B`` and ``C`` are ``n_groups * d_state``
each); Gated DeltaNet ``Q, K, V`` (``Q`` and ``K`` are key heads times the key head
size); Kimi Delta Attention its value projection, then two key projections. The SSM
state's shape (heads, head size, last axis) gives the sizes, so a rank's state shapes
alone fix its parts.
"""

from __future__ import annotations

__all__ = ["conv_parts", "ordered_parts"]

# Whether a type's conv state starts with its heads' projection (Mamba2's x, KDA's V) or
# ends with it (GDN's V, after Q and K): the one statement of the sub-projections' order.
_HEADS_FIRST = {"mamba2": True, "kda": True, "gdn_attn": False}


def ordered_parts(kind: str, heads: int, grouped: int) -> tuple[int, int, int]:
    """The conv state's three sub-projection lengths in memory order for the Mamba type
    ``kind`` (``"mamba2"``, ``"gdn_attn"``, ``"kda"``), given its heads' projection
    (``heads * head_dim``: Mamba2's ``x``, GDN's and KDA's ``V``) and each of the other
    two (Mamba2's ``B`` and ``C``, GDN's ``Q`` and ``K``)."""
    if kind not in _HEADS_FIRST:
        raise ValueError(
            f"no conv sub-projection order for Mamba type {kind!r} (known: {sorted(_HEADS_FIRST)})"
        )
    return (heads, grouped, grouped) if _HEADS_FIRST[kind] else (grouped, grouped, heads)


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
        return ordered_parts(kind, heads * head_dim, rest // 2)
    if (rest // 2) % last:
        return None  # Mamba2: B and C are n_groups * d_state each; GDN: Q and K are key heads * dk
    if kind in ("mamba2", "gdn_attn"):
        return ordered_parts(kind, heads * head_dim, rest // 2)
    return None
