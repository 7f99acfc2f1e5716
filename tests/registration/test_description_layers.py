"""``RegistrationDescription.for_layers``: a peer's description cut to some of its layers
(a pipeline stage against a peer holding every layer), made after the handshake.

Each accepted cut equals the description of a registration detected from that part of the
cache (the layers' list entries, or a view of a pool's layer axis, as the engine indexes
it: TRT-LLM's ``BlockManager::allocatePools`` pool ``[NB, NL, kv_factor, NH*BS*HS]``,
``get_primary_pool_data(layer)`` being ``pool[:, layer]``; vLLM's cross-layer
``[NB, NL, 2, BS, NH, HS]`` allocation), numbered with the same layer ids; it reads back
from JSON as itself and names only bytes of tensors the peer described. The refusals are
pinned.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.registration.peers import PeerDescriptionError
from kvlayout.registration.registration import RegistrationError
from kvlayout.transfer import BlockMapError, RegistrationDescription, block_map

TRT_HINTS = {"num_kv_heads": 2, "tokens_per_block": 4, "head_dim": 8}


def trt_pool(layers: int = 4, kv_factor: int = 2, blocks: int = 5, row: int = 2 * 4 * 8) -> torch.Tensor:
    """TRT-LLM's primary pool, ``[NB, NL, kv_factor, NH*BS*HS]``, contiguous."""
    return torch.zeros(blocks, layers, kv_factor, row, dtype=torch.bfloat16)


def inside(cut: RegistrationDescription, whole: RegistrationDescription) -> bool:
    """Every byte the cut names lies in one tensor the whole description names."""
    spans = [(int(a), int(a) + int(n)) for a, n in whole.tensor_spans]
    return all(any(lo <= int(a) and int(a) + int(n) <= hi for lo, hi in spans) for a, n in cut.tensor_spans)


def check_cut(whole: RegistrationDescription, ids: list[int], view: Any) -> RegistrationDescription:
    """The cut of ``whole`` to ``ids`` is ``view``'s description (a registration detected from
    that part of the cache, numbered ``ids``), reads back from JSON and lies in ``whole``."""
    cut = whole.for_layers(ids)
    assert cut == view.describe()
    assert RegistrationDescription.from_json(cut.to_json()) == cut
    assert cut.whole is whole and cut.group(0).whole is whole
    assert inside(cut, whole)
    return cut


@pytest.mark.parametrize(("a", "b"), [(0, 2), (2, 4), (1, 3), (3, 4), (0, 1)])
def test_a_trtllm_pool_is_cut_as_a_view_of_its_layer_axis(a: int, b: int) -> None:
    pool = trt_pool()
    whole = kvlayout.detect(pool, "trtllm", TRT_HINTS).describe()
    view = kvlayout.detect(pool[:, a:b], "trtllm", TRT_HINTS).numbered(range(a, b))
    cut = check_cut(whole, list(range(a, b)), view)
    plane = cut.groups[0].planes[0]
    # allocatePools' layer stride: kv_factor * NH*BS*HS elements of bf16
    assert plane.addresses == (pool.data_ptr() + a * 2 * 64 * 2,)
    assert plane.shape == (5, b - a, 2, 2, 4, 8) and plane.block_stride == 4 * 2 * 64


def test_numbered_layers_are_cut_by_their_numbers() -> None:
    pool = trt_pool()
    whole = kvlayout.detect(pool, "trtllm", TRT_HINTS).numbered([3, 5, 8, 9]).describe()
    view = kvlayout.detect(pool[:, 1:3], "trtllm", TRT_HINTS).numbered([5, 8])
    assert check_cut(whole, [8, 5], view).groups[0].layers == (5, 8)  # in the description's order


def test_a_trtllm_mla_pool() -> None:
    pool = trt_pool(kv_factor=1, row=4 * 48)  # K-only: kv factor 1
    hints = {"tokens_per_block": 4, "head_dim": 48}
    whole = kvlayout.detect(pool, "trtllm", hints).describe()
    assert whole.groups[0].format.name == "NB_NL_ONE_BS_HS"
    check_cut(whole, [1, 2], kvlayout.detect(pool[:, 1:3], "trtllm", hints).numbered([1, 2]))


def test_a_vllm_layer_list_keeps_the_layers_tensors() -> None:
    kv = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]  # vLLM 0.33 FlashAttention
    whole = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}).describe()
    view = kvlayout.detect([kv[0], kv[2], kv[3]], "vllm", {"kv_layout": "NHD"}).numbered([0, 2, 3])
    cut = check_cut(whole, [0, 2, 3], view)  # a list's layers need not be consecutive
    assert cut.groups[0].planes[0].addresses == tuple(kv[i].data_ptr() for i in (0, 2, 3))


def test_a_vllm_mla_list() -> None:
    kv = [torch.zeros(5, 4, 576, dtype=torch.bfloat16) for _ in range(3)]
    whole = kvlayout.detect(kv, "vllm", {"kv_dim": 1}).describe()
    assert whole.groups[0].format.name == "NL_X_NB_BS_HS"
    check_cut(whole, [1], kvlayout.detect([kv[1]], "vllm", {"kv_dim": 1}).numbered([1]))


def test_an_sglang_k_then_v_list_keeps_both_halves() -> None:
    """SGLang's MHA pool lists every layer's K, then every layer's V (``[K layers, V layers]``):
    the cut keeps the layers' K and V buffers, in that order."""
    k = [torch.zeros(4 * 6, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    v = [torch.zeros(4 * 6, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    hints = {"tokens_per_block": 4}
    whole = kvlayout.detect([k, v], "sglang", hints).describe()
    assert whole.groups[0].format.name == "TWO_X_NL_X_NB_BS_NH_HS"
    cut = check_cut(
        whole, [0, 2], kvlayout.detect([[k[0], k[2]], [v[0], v[2]]], "sglang", hints).numbered([0, 2])
    )
    assert cut.groups[0].planes[0].addresses == tuple(t.data_ptr() for t in (k[0], k[2], v[0], v[2]))


def test_a_vllm_cross_layer_allocation() -> None:
    physical = torch.zeros(5, 4, 2, 2, 4, 8, dtype=torch.bfloat16)  # HND cross-layer, read as NHD
    tensor = physical.transpose(3, 4)
    whole = kvlayout.detect(tensor, "vllm", {"kv_layout": "HND"}).describe()
    assert whole.groups[0].format.name == "NB_NL_TWO_NH_BS_HS"
    check_cut(whole, [1, 2], kvlayout.detect(tensor[:, 1:3], "vllm", {"kv_layout": "HND"}).numbered([1, 2]))


def test_layers_sharing_a_kv_cache() -> None:
    """vLLM's cross-layer KV sharing registers the target's tensor for the sharer (layer 3
    shares layer 1's): a cut keeps the repeat where it keeps both, and the sharer's own
    address (the target's memory) where it keeps the sharer alone."""
    own = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    kv = [own[0], own[1], own[2], own[1]]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    assert reg.shared_layers == ((1, 3),)
    whole = reg.describe()
    both = check_cut(
        whole, [1, 2, 3], kvlayout.detect(kv[1:], "vllm", {"kv_layout": "NHD"}).numbered([1, 2, 3])
    )
    assert both.groups[0].planes[0].repeats == (2,)
    alone = check_cut(whole, [2, 3], kvlayout.detect(kv[2:], "vllm", {"kv_layout": "NHD"}).numbered([2, 3]))
    assert alone.groups[0].planes[0].addresses == (own[2].data_ptr(), own[1].data_ptr())


def test_opaque_state_rows_are_cut_with_their_page_arrays() -> None:
    """SGLang's Mamba state under pipeline parallelism: newer SGLang pairs a stage's state
    entries with the decode's by model layer id (``build_transfer_entry_pairs`` of
    ``get_state_layer_ids``), so a decode pool of every Mamba layer is cut to a stage's.
    Its rows are opaque pages declaring their TP split: the cut keeps them, both ways (a
    peer's description, a local registration), as a pool of the stage's layers alone
    describes itself."""
    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import LinearModel, device_pool

    model = LinearModel("gdn_attn", num_layers=6, num_heads=8, head_dim=4, state_size=4, n_groups=4)
    pool = device_pool(model, 2, 3)
    ids = [0, 1, 2, 4, 5, 6]  # the model's Mamba layers (full attention at 3 and 7)
    for name, reg in mamba_state_pools(pool, "gdn_attn").items():
        whole = reg.numbered(ids)
        stage = SimpleNamespace(
            mamba_cache=SimpleNamespace(
                conv=[c[3:] for c in pool.mamba_cache.conv], temporal=pool.mamba_cache.temporal[3:]
            ),
            num_mamba_layers=3,
        )
        view = mamba_state_pools(stage, "gdn_attn")[name].numbered([4, 5, 6])
        assert view.kernel_groups[0].opaque_pages is not None
        cut = check_cut(whole.describe(), [4, 5, 6], view)
        assert cut.groups[0].opaque_pages == whole.describe().groups[0].opaque_pages
        part = whole.for_layers([4, 5, 6])
        assert part.kernel_groups[0].opaque_pages == whole.kernel_groups[0].opaque_pages
        assert part.describe() == cut


def test_a_cut_of_opaque_state_rows_watches_the_engines_state_tensor() -> None:
    """A stage's cut of SGLang's Mamba state reads the engine's state tensor through
    kvlayout's view of its rows: where the engine re-allocates that tensor, the cut (as
    the whole registration) is refused, never described with the freed addresses."""
    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import LinearModel, device_pool

    model = LinearModel("gdn_attn", num_layers=6, num_heads=8, head_dim=4, state_size=4, n_groups=4)
    pool = device_pool(model, 2, 3)
    part = mamba_state_pools(pool, "gdn_attn")["temporal"].for_layers([3, 4, 5])
    part.describe()
    pool.mamba_cache.temporal.data = torch.zeros_like(pool.mamba_cache.temporal)
    with pytest.raises(
        PeerDescriptionError, match=r"tensor before the group edits was re-allocated after detection"
    ):
        part.describe()


def test_kernel_groups_without_the_layers_are_left_out() -> None:
    kv = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 1], [2, 3]])
    whole = reg.describe()
    cut = whole.for_layers([1, 2])
    assert [g.layers for g in cut.groups] == [(1,), (2,)]
    assert [g.engine_group for g in cut.groups] == [0, 1]
    only = whole.for_layers([3])
    assert len(only.groups) == 1 and only.groups[0].engine_group == 1
    assert only.group(0).whole is whole
    assert whole.for_layers(range(4)) is whole


def test_a_stage_maps_into_the_cut() -> None:
    """Context stage 1 of 2 (layers 2-3, its own pool) into a generation rank's whole
    description cut to them; byte-exact against TRT-LLM's indexing (``BlockInfo``: a
    block's layer ``l`` K at ``(2l) * H*T*D``, V at ``(2l + 1) * H*T*D``)."""
    stage = torch.randn(5, 2, 2, 64).to(torch.bfloat16)
    gen = trt_pool(blocks=6)
    src = kvlayout.detect(stage, "trtllm", TRT_HINTS).numbered([2, 3])
    there = kvlayout.detect(gen, "trtllm", TRT_HINTS).describe()
    with pytest.raises(BlockMapError, match=re.escape("description.for_layers(layer_ids) (2-3)")):
        block_map(src, there, [4, 1], [0, 5], num_tokens=6)
    m = block_map(src, there.for_layers([2, 3]), [4, 1], [0, 5], num_tokens=6)
    local = block_map(
        src, kvlayout.detect(gen[:, 2:4], "trtllm", TRT_HINTS).numbered([2, 3]), [4, 1], [0, 5], num_tokens=6
    )
    assert m.num_bytes == local.num_bytes == 6 * 2 * 2 * 2 * 8 * 2
    local.copy()
    flat_src, flat_gen = stage.reshape(-1), gen.reshape(-1)
    want = torch.zeros_like(flat_gen)
    for t in range(6):
        sb, db, slot = [4, 1][t // 4], [0, 5][t // 4], t % 4
        for layer in range(2):
            for kv in range(2):
                for h in range(2):
                    s = ((sb * 2 + layer) * 2 + kv) * 64 + h * 32 + slot * 8
                    d = ((db * 4 + 2 + layer) * 2 + kv) * 64 + h * 32 + slot * 8
                    want[d : d + 8] = flat_src[s : s + 8]
    assert torch.equal(flat_gen, want)
    assert m.runs.tolist() == local.runs.tolist()  # the same memory: the same runs


# -- refusals ---------------------------------------------------------------------------------


def test_layers_not_in_the_description() -> None:
    whole = kvlayout.detect(trt_pool(), "trtllm", TRT_HINTS).numbered([4, 5, 6, 7]).describe()
    with pytest.raises(PeerDescriptionError) as err:
        whole.for_layers([2, 3, 4])
    assert str(err.value) == (
        "for_layers: layer(s) 2-3 are not in the description, which holds layers 4-7 (a cut keeps the "
        "description's layer numbers)"
    )
    with pytest.raises(PeerDescriptionError, match=r"^for_layers: layer_ids names no layer$"):
        whole.for_layers([])
    with pytest.raises(PeerDescriptionError, match=r"^for_layers: layer_ids names layer\(s\) 5 twice$"):
        whole.for_layers([5, 6, 5])
    with pytest.raises(TypeError, match=re.escape("layer_ids[1] must be an int, not str ('5')")):
        whole.for_layers([4, "5"])  # type: ignore[list-item]
    with pytest.raises(PeerDescriptionError, match="more than 65536 layer ids"):
        whole.for_layers(range(10**9))


def test_a_pool_is_cut_as_one_range() -> None:
    whole = kvlayout.detect(trt_pool(), "trtllm", TRT_HINTS).describe()
    with pytest.raises(PeerDescriptionError) as err:
        whole.for_layers([0, 2])
    assert str(err.value) == (
        "for_layers: kernel group 0 (NB_NL_TWO_NH_BS_HS [5, 4, 2, 2, 4, 8] bfloat16, layers 0-3): layers 0,2 "
        "are not consecutive in its tensors' layer axis (NL); a tensor's layers are cut as one range, as a "
        "view pool[:, a:b] holds them"
    )


def test_layers_inside_another_axis_are_refused_naming_it() -> None:
    """SGLang's layer_first host pool ``[2, NL, NB*BS, NH, HS]`` keeps its layers inside the
    K/V axis, vLLM's BHLNC allocation ``[NB, NH, NL, BS, 2*HS]`` inside the heads, and
    MAX's buffer ``[NB, KV, NL, BS, NH, HS]`` inside K/V: a range of their layers is pieces
    apart, which no description holds (nor detection of such a view)."""
    host = torch.zeros(2, 3, 32, 2, 8, dtype=torch.bfloat16)
    whole = kvlayout.detect(host, "sglang", {"hicache_layout": "layer_first"}).describe()
    with pytest.raises(PeerDescriptionError) as err:
        whole.for_layers([1])
    assert str(err.value) == (
        "for_layers: kernel group 0 (TWO_NL_NBBS_NH_HS [2, 3, 32, 2, 8] bfloat16, layers 0-2): layer 1 is 2 "
        "strided pieces of its tensors, not one tensor a description holds: TWO_NL_NBBS_NH_HS keeps its layer "
        "axis (NL) inside TWO (size 2), and a description's tensors are contiguous but for padding between "
        "blocks; map every layer of it, or have the peer register those layers apart"
    )
    bhlnc = torch.zeros(5, 2, 4, 4, 16, dtype=torch.bfloat16)
    whole = kvlayout.detect(bhlnc, "vllm", {"kv_layout": "BHLNC"}).describe()
    with pytest.raises(
        PeerDescriptionError, match=re.escape("layers 2-3 are 2 strided pieces a block of its tensors")
    ):
        whole.for_layers([2, 3])
    buf = torch.zeros(5, 2, 4, 4, 2, 8, dtype=torch.bfloat16)
    whole = kvlayout.detect(buf, "max").describe()
    with pytest.raises(PeerDescriptionError, match=re.escape("keeps its layer axis (NL) inside KV (size 2)")):
        whole.for_layers([0, 1])
    # one head (BHLNC) or one latent plane (MAX MLA): nothing outside the layers but blocks
    one_head = torch.zeros(5, 1, 4, 4, 16, dtype=torch.bfloat16)
    whole = kvlayout.detect(one_head, "vllm", {"kv_layout": "BHLNC"}).describe()
    check_cut(
        whole, [1, 2], kvlayout.detect(one_head[:, :, 1:3], "vllm", {"kv_layout": "BHLNC"}).numbered([1, 2])
    )
    mla = torch.zeros(5, 1, 4, 4, 1, 576, dtype=torch.bfloat16)
    hints = {"layout_format": "NB_KV_NL_BS_NH_HS", "num_layers": 4, "kv_dim": 1, "tokens_per_block": 4}
    whole = kvlayout.detect(mla, "max", hints).describe()
    cut = whole.for_layers([3])
    assert inside(cut, whole) and RegistrationDescription.from_json(cut.to_json()) == cut
    assert cut.groups[0].planes[0].addresses == (mla.data_ptr() + 3 * 4 * 576 * 2,)


# -- a local registration's cut --------------------------------------------------------------


def registrations() -> dict[str, tuple[Any, list[int]]]:
    """Each structure a registration holds layers in, with a part of its layers."""
    own = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    k = [torch.zeros(4 * 6, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    v = [torch.zeros(4 * 6, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    mla = [torch.zeros(5, 4, 576, dtype=torch.bfloat16) for _ in range(3)]
    cross = torch.zeros(5, 4, 2, 2, 4, 8, dtype=torch.bfloat16).transpose(3, 4)
    trt_mla = {"tokens_per_block": 4, "head_dim": 48}
    return {
        "vllm list": (kvlayout.detect(own, "vllm", {"kv_layout": "NHD"}).numbered([0, 4, 7]), [0, 7]),
        "kv shared": (kvlayout.detect([*own, own[1]], "vllm", {"kv_layout": "NHD"}), [2, 3]),
        "sglang k, v": (kvlayout.detect([k, v], "sglang", {"tokens_per_block": 4}), [0, 2]),
        "vllm mla": (kvlayout.detect(mla, "vllm", {"kv_dim": 1}), [1]),
        "trtllm pool": (kvlayout.detect(trt_pool(), "trtllm", TRT_HINTS).numbered([4, 5, 6, 7]), [5, 6]),
        "trtllm mla": (kvlayout.detect(trt_pool(kv_factor=1, row=4 * 48), "trtllm", trt_mla), [3]),
        "vllm cross-layer": (kvlayout.detect(cross, "vllm", {"kv_layout": "HND"}), [0, 1]),
        "hybrid": (
            kvlayout.detect(own + own[:1], "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 1], [2, 3]]),
            [1, 2, 3],
        ),
    }


@pytest.mark.parametrize("case", list(registrations()))
def test_a_registration_cut_describes_as_the_description_cut(case: str) -> None:
    """``registration.for_layers(ids)`` binds the same memory again, its layers ``ids``:
    its description is the whole description's cut, and it maps as that part does."""
    reg, ids = registrations()[case]
    part = reg.for_layers(ids)
    assert part.layer_ids == tuple(ids) and part.engine is reg.engine
    assert part.describe() == reg.describe().for_layers(ids)
    assert reg.for_layers(reg.layer_ids) is reg


def test_a_registration_cut_maps_a_stage() -> None:
    """Context PP 1 into a generation stage of layers 2-3 (its own pool): the context pool
    cut to them maps as a detected view of it, byte-exact against ``BlockInfo``'s offsets."""
    ctx = torch.randn(5, 4, 2, 64).to(torch.bfloat16)
    gen = trt_pool(layers=2, blocks=6)
    whole = kvlayout.detect(ctx, "trtllm", TRT_HINTS)
    stage = kvlayout.detect(gen, "trtllm", TRT_HINTS).numbered([2, 3])
    block_map(whole.for_layers([2, 3]), stage, [4, 1], [0, 5], num_tokens=6).copy()
    flat_src, flat_gen = ctx.reshape(-1), gen.reshape(-1)
    want = torch.zeros_like(flat_gen)
    for t in range(6):
        sb, db, slot = [4, 1][t // 4], [0, 5][t // 4], t % 4
        for layer in range(2):
            for kv in range(2):
                for h in range(2):
                    s = ((sb * 4 + 2 + layer) * 2 + kv) * 64 + h * 32 + slot * 8
                    d = ((db * 2 + layer) * 2 + kv) * 64 + h * 32 + slot * 8
                    want[d : d + 8] = flat_src[s : s + 8]
    assert torch.equal(flat_gen, want)


def test_a_registration_cut_refuses() -> None:
    pool = kvlayout.detect(trt_pool(), "trtllm", TRT_HINTS).numbered([4, 5, 6, 7])
    with pytest.raises(RegistrationError) as err:
        pool.for_layers([4, 6])
    assert str(err.value) == (
        "layers 4,6 are not consecutive in kv_caches's layer axis (NL, layers 4-7): a tensor's layers are cut "
        "as one range, as a view pool[:, a:b] holds them"
    )
    with pytest.raises(
        RegistrationError, match=re.escape("layer 1 is not one of this registration's layers (4-7)")
    ):
        pool.for_layers([1, 4])
    with pytest.raises(RegistrationError, match=re.escape("layer_ids [5, 5] must name distinct layers")):
        pool.for_layers([5, 5])
    with pytest.raises(RegistrationError, match=re.escape("layer_ids [] must name distinct layers")):
        pool.for_layers([])
    host = kvlayout.detect(torch.zeros(2, 3, 32, 2, 8), "sglang", {"hicache_layout": "layer_first"})
    with pytest.raises(RegistrationError) as err:
        host.for_layers([1])
    assert str(err.value).startswith(
        "layer 1 of kv_caches is not a view TWO_NL_NBBS_NH_HS reads (kv_caches has dim-0 padding"
    )
    assert str(err.value).endswith("a range of its layers lies inside another axis; map every layer of it")
