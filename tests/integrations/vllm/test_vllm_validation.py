"""Start-up validation on vLLM 0.33's real spec classes: one error for every unservable group."""

from __future__ import annotations

import ast
import dataclasses
import logging
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.errors import KVLayoutError
from kvlayout.integrations.vllm import (
    SpecKind,
    UnsupportedKVCacheGroupsError,
    apply_kv_cache_group_edits,
    check_block_granularity,
    declares_slot_compression,
    find_kv_cache_groups_out_of_offloading,
    find_unsupported_kv_cache_groups,
    spec_kind,
    transfer_layers,
    validate_kv_cache_groups,
)
from kvlayout.integrations.vllm.specs import slots_per_block, tokens_per_slot
from kvlayout.testing.vllm import make_engine
from tests.integrations.vllm.models import (
    FLASHINFER,
    QWEN3_5_0_8B,
    allocate_v033,
    attention_spec,
    dsv4_indexer_spec,
    hybrid_engine,
    kvi,
)


def _config(*group_specs: Any) -> Any:
    groups = [
        kvi.KVCacheGroupSpec(layer_names=[f"layers.{i}.{j}" for j in range(2)], kv_cache_spec=spec)
        for i, spec in enumerate(group_specs)
    ]
    return kvi.KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba(mode: str, block_size: int = 16) -> Any:
    return kvi.MambaSpec(
        block_size=block_size,
        shapes=((3, 64), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
    )


def _cross(block_size: int = 16) -> Any:
    return kvi.CrossAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def test_servable_hybrid_passes() -> None:
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)
    validate_kv_cache_groups(engine.config)
    assert find_unsupported_kv_cache_groups(engine.config) == []


def test_none_config_passes() -> None:
    validate_kv_cache_groups(None)
    assert apply_kv_cache_group_edits(None, {}) == {}


@pytest.mark.parametrize("config", [object(), 5, "abc"])
def test_what_is_not_a_kv_cache_config_is_refused_not_taken_as_no_groups(config: object) -> None:
    """A vllm_config (or anything without kv_cache_groups) passed validation and made the
    edits edit nothing."""
    with pytest.raises(
        TypeError, match=r"^kv_cache_config must be vLLM's KVCacheConfig \(its kv_cache_groups\)"
    ):
        validate_kv_cache_groups(config)
    with pytest.raises(TypeError, match=r"^kv_cache_config must be vLLM's KVCacheConfig"):
        apply_kv_cache_group_edits(config, {})


def test_every_unservable_group_in_one_error() -> None:
    attn = attention_spec(QWEN3_5_0_8B, 1, 16)
    config = _config(attn, _cross(), _mamba("none"), _mamba("all"), _mamba("align"))
    with pytest.raises(UnsupportedKVCacheGroupsError) as info:
        validate_kv_cache_groups(config)
    message = str(info.value)
    assert "group 1: CrossAttentionSpec" in message
    assert "group 2: MambaSpec with mamba_cache_mode='none'" in message
    assert "group 3: MambaSpec with mamba_cache_mode='all'" in message
    assert "a P/D connector, which moves each request's blocks once, passes prefix_reuse=False" in message
    assert "group 0" not in message and "group 4" not in message
    assert "layers.1.0, layers.1.1" in message  # the layers are named
    assert [(p.group, p.layers) for p in info.value.problems] == [
        (1, ("layers.1.0", "layers.1.1")),
        (2, ("layers.2.0", "layers.2.1")),
        (3, ("layers.3.0", "layers.3.1")),
    ]
    assert isinstance(info.value, KVLayoutError) and isinstance(info.value, ValueError)


def test_a_p_d_connector_is_served_mamba_in_any_mode_but_not_cross_attention() -> None:
    """prefix_reuse=False (blocks moved once, never found again by a prefix) lifts the
    Mamba mode refusal; cross-attention stays refused (the edits and their block checks
    leave it as registered, so its block ids could address kernel pages)."""
    attn = attention_spec(QWEN3_5_0_8B, 1, 16)
    config = _config(attn, _cross(), _mamba("none"), _mamba("all"), _mamba("align"))
    problems = find_unsupported_kv_cache_groups(config, prefix_reuse=False)
    assert [(p.group, p.what.split(":")[0]) for p in problems] == [(1, "CrossAttentionSpec")]
    assert [p.group for p in find_unsupported_kv_cache_groups(config)] == [1, 2, 3]


def test_uniform_type_wrapper_is_unwrapped_per_layer() -> None:
    # One group whose UniformTypeKVCacheSpecs holds two Mamba layers in different modes:
    # only the leaf in 'none' mode is reported, under its own layer name.
    specs = {"lin.0": _mamba("align"), "lin.1": _mamba("none")}
    wrapper = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
    attn = attention_spec(QWEN3_5_0_8B, 1, 16)
    config = kvi.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            kvi.KVCacheGroupSpec(layer_names=["attn.0"], kv_cache_spec=attn),
            kvi.KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=wrapper),
        ],
    )
    problems = find_unsupported_kv_cache_groups(config)
    assert [(p.group, p.layers) for p in problems] == [(1, ("lin.1",))]
    assert "mamba_cache_mode='none'" in problems[0].what


def test_edits_validate_before_touching_tensors() -> None:
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER, mamba_cache_mode="none")
    _, kv_caches = allocate_v033(engine)
    with pytest.raises(
        UnsupportedKVCacheGroupsError, match="group 0: MambaSpec with mamba_cache_mode='none'"
    ):
        apply_kv_cache_group_edits(engine.config, kv_caches)


def test_declared_compression_is_not_rejected() -> None:
    dsv4 = kvi.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=4,
        state_content_bytes=584,
        alignment=576,
    )
    assert declares_slot_compression(dsv4)
    validate_kv_cache_groups(_config(dsv4, _mamba("align")))


@dataclass(frozen=True, kw_only=True)
class LegacyMLASpec(kvi.MLAAttentionSpec):  # type: ignore[misc]
    """Pre-0.26 field: MLAAttentionSpec.compress_ratio, and the page it sized
    (``storage_block_size = block_size // compress_ratio`` slots)."""

    compress_ratio: int = 1

    @property
    def page_size_bytes(self) -> int:
        slots = self.block_size // self.compress_ratio
        return int(slots * self.num_kv_heads * self.head_size * self.dtype.itemsize)


@dataclass(frozen=True, kw_only=True)
class TQFullAttentionSpec(kvi.FullAttentionSpec):  # type: ignore[misc]
    """Pre-0.26 class: TurboQuant slots."""

    tq_slot_size: int = 0


@pytest.mark.parametrize(
    ("spec", "declared"),
    [
        (kvi.MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,)), False),  # tokens_per_state=-1
        (attention_spec(QWEN3_5_0_8B, 1, 16), False),
        (
            LegacyMLASpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8, compress_ratio=4),
            True,
        ),
        (LegacyMLASpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8), False),
        (
            TQFullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8, tq_slot_size=80
            ),
            True,
        ),
        (TQFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8), False),
    ],
)
def test_declares_slot_compression(spec: Any, declared: bool) -> None:
    assert declares_slot_compression(spec) is declared


class _Undeclared:
    """KVCacheSpec's base declares ``tokens_per_state`` a property that raises
    NotImplementedError: a spec that leaves it so declares no compression."""

    block_size = num_states = 16

    @property
    def tokens_per_state(self) -> int:
        raise NotImplementedError


_Undeclared.__name__ = "FullAttentionSpec"


def test_specs_without_a_positive_int_block_size_are_reported() -> None:
    for block_size in (True, 0, None, 16.0):
        spec = dataclasses.replace(_full(), block_size=16)
        object.__setattr__(spec, "block_size", block_size)
        problems = find_unsupported_kv_cache_groups(_config(spec))
        assert [p.what for p in problems] == [
            f"FullAttentionSpec with block_size={block_size!r}: block ids need a positive int block_size"
        ]
    no_spec = kvi.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[SimpleNamespace(layer_names=["x"], kv_cache_spec=None)],
    )
    assert [str(p) for p in find_unsupported_kv_cache_groups(no_spec)] == [
        "group 0: the group has no kv_cache_spec"
    ]
    groups = SimpleNamespace(kv_cache_groups="ab")  # a string is no list of groups
    with pytest.raises(TypeError, match=r"^kv_cache_config.kv_cache_groups is a str, not a list of groups$"):
        validate_kv_cache_groups(groups)


def _full(block_size: int = 256, **kw: Any) -> Any:
    return kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, **kw
    )


@pytest.mark.parametrize(
    ("spec", "ratio", "slots"),
    [
        (_mamba("align", block_size=544), 1, 544),  # tokens_per_state=-1: one page, block_size rows
        (_mamba("none", block_size=40960), 40960, 1),  # prefix caching off: one running state per block
        (type("MambaSpec", (), {"block_size": 8192})(), 8192, 1),  # before vLLM named modes: as 'none'
        (attention_spec(QWEN3_5_0_8B, 1, 16), 1, 16),
        (dsv4_indexer_spec(512), 4, 128),
        (dsv4_indexer_spec(256, compress_ratio=128), 128, 2),
        (_full(tokens_per_state=Fraction(4, 1)), 4, 64),
        (_full(tokens_per_state=Fraction(1, 4)), None, None),  # Whisper's pooling: left alone
        (_full(block_size=2, tokens_per_state=4), 4, None),  # vLLM's num_states would be 0
        (LegacyMLASpec(block_size=256, num_kv_heads=1, head_size=132, dtype=torch.uint8, compress_ratio=4), 4, 64),
        (TQFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8, tq_slot_size=80), None, None),
        (type("MambaSpec", (), {"block_size": 544, "mamba_cache_mode": "all"})(), 1, 544),  # before 0.33: snapshots
        (_full(tokens_per_state=Fraction(3, 2)), None, None),  # no whole number, not its floor
        (_full(tokens_per_state=-1), None, None),
        (LegacyMLASpec(block_size=256, num_kv_heads=1, head_size=132, dtype=torch.uint8, compress_ratio=4, tokens_per_state=2), None, None),
        (_Undeclared(), 1, 16),
    ],
    ids=["mamba", "mamba-none", "mamba-no-mode", "attention", "dsv4-indexer-c4", "c128", "fraction-4", "pooling", "too-small", "legacy-ratio", "tq", "mamba-all", "fraction-3/2", "negative", "two-ratios", "base-property"],
)  # fmt: skip
def test_slots_per_block_golden(spec: Any, ratio: int | None, slots: int | None) -> None:
    """A block id's slots: what the edits group kernel pages into and the check reads."""
    assert tokens_per_slot(spec) == ratio
    assert slots_per_block(spec) == slots
    if slots is not None and spec_kind(spec) is not SpecKind.MAMBA and not hasattr(spec, "compress_ratio"):
        assert slots == spec.num_states  # vLLM 0.33's own count, where it has one


def test_spec_kind_agrees_with_vllm() -> None:
    specs = [
        attention_spec(QWEN3_5_0_8B, 1, 16),
        _cross(),
        _mamba("align"),
        kvi.SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=8
        ),
        kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        kvi.ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=32
        ),
        kvi.SinkFullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink_len=4
        ),
        kvi.EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16),
        TQFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8),
    ]
    for spec in specs:
        assert spec_kind(spec).value == kvi.get_kv_cache_spec_kind(spec).value, spec
    assert spec_kind(object()) is SpecKind.UNKNOWN


def test_groups_vllm_keeps_out_of_transfer_are_skipped_and_left_out_of_detection() -> None:
    """vLLM 0.33 registers HiSparse's device replicas (``enable_kv_transfer=False``) as
    raw byte buffers beside the groups it transfers: detection refused the whole
    registration. They are skipped by the validation and the edits, and
    ``transfer_layers`` leaves them out as an empty group, so the others keep their ids."""
    attention = kvi.FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    replica = kvi.HiSparseHotSpec(block_size=4, page_size=4096, blocks_per_request=2)
    groups = [
        kvi.KVCacheGroupSpec(layer_names=["a.0", "a.1"], kv_cache_spec=attention),
        kvi.KVCacheGroupSpec(layer_names=["hot.0"], kv_cache_spec=replica, enable_kv_transfer=False),
        kvi.KVCacheGroupSpec(layer_names=["b.0"], kv_cache_spec=attention),
    ]
    config = kvi.KVCacheConfig(num_blocks=6, kv_cache_tensors=[], kv_cache_groups=groups)
    raw = torch.zeros(4096, dtype=torch.int8)  # a replica's buffer, as vLLM registers it
    kv = {name: torch.zeros(2, 6, 4, 2, 8, dtype=torch.bfloat16) for name in ("a.0", "a.1", "b.0")}
    kv = {"a.0": kv["a.0"], "hot.0": raw, "a.1": kv["a.1"], "b.0": kv["b.0"]}
    validate_kv_cache_groups(config)  # a group out of transfer is not one to refuse
    edited = apply_kv_cache_group_edits(config, kv, {"kv_layout": "NHD"})
    assert edited["hot.0"] is raw
    layers, layer_groups = transfer_layers(config, edited)
    assert [t is kv[n] for t, n in zip(layers, ("a.0", "a.1", "b.0"), strict=True)] == [True] * 3
    assert layer_groups == [[0, 1], [], [2]]
    reg = kvlayout.detect(layers, "vllm", {"kv_layout": "NHD"}, layer_groups=layer_groups)
    assert [(g.engine_group, g.layers) for g in reg.kernel_groups] == [(0, (0, 1)), (2, (2,))]
    assert transfer_layers(None, kv) == (list(kv.values()), None)
    with pytest.raises(
        TypeError, match=r"^kv_caches must be the dict register_kv_caches gets, by layer name, not a list"
    ):
        transfer_layers(config, list(kv.values()))  # type: ignore[arg-type]
    # the edits and their check find layers by name too: a list would find none, unchecked
    for call in (apply_kv_cache_group_edits, check_block_granularity):
        with pytest.raises(
            TypeError, match=r"^kv_caches must be the dict register_kv_caches gets, .* not a list$"
        ):
            call(config, list(kv.values()))  # type: ignore[arg-type]
    # one group alone, under its id; a group out of transfer has no layers
    layers, layer_groups = transfer_layers(config, edited, group=2)
    assert layers == [kv["b.0"]] and layer_groups == [[], [], [0]]
    assert (
        kvlayout.detect(layers, "vllm", {"kv_layout": "NHD"}, layer_groups=layer_groups)
        .only_group()
        .engine_group
        == 2
    )
    assert transfer_layers(config, edited, group=1) == ([], [[], []])
    with pytest.raises(
        ValueError, match=r"^group=3 is not a KV cache group id: the config has 3 KV cache groups$"
    ):
        transfer_layers(config, edited, group=3)
    with pytest.raises(TypeError, match=r"^group must be an int \(a KV cache group id\), not str$"):
        transfer_layers(config, edited, group="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^group=0 names a part of the config, but there is none$"):
        transfer_layers(None, kv, group=0)
    # ids as kvlayout takes any int: NumPy and torch integers too, never a bool
    assert transfer_layers(config, edited, group=np.int64(2)) == transfer_layers(config, edited, group=2)  # type: ignore[arg-type]
    assert transfer_layers(config, edited, group=torch.tensor(1)) == ([], [[], []])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^group must be an int \(a KV cache group id\), not bool$"):
        transfer_layers(config, edited, group=True)
    with pytest.raises(
        ValueError, match=r"^group=3 is not a KV cache group id: the config has 3 KV cache groups$"
    ):
        transfer_layers(config, edited, group=np.int32(3))  # type: ignore[arg-type]


def _vllm_get_offloading_group_ids() -> Any:
    """vLLM 0.33's own ``get_offloading_group_ids``
    (distributed/kv_transfer/kv_connector/v1/offloading/config.py), run as written: its
    module imports what this CPU install lacks (psutil, through vllm.distributed), so the
    one function is compiled from vLLM's source, its one name bound to vLLM's enum."""
    import vllm

    path = f"{vllm.__path__[0]}/distributed/kv_transfer/kv_connector/v1/offloading/config.py"
    with open(path) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_offloading_group_ids")
    namespace: dict[str, Any] = {"KVCacheGroupRole": kvi.KVCacheGroupRole}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["get_offloading_group_ids"]


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "plain"])
def test_an_offload_tier_stores_the_groups_vllm_s_offloading_connector_stores(
    hisparse: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.33's OffloadingConnector stores ``get_offloading_group_ids``: the
    prefix-cacheable groups, but under HiSparse (``hisparse_host_num_blocks`` set) only the
    ``HISPARSE_INDEXER`` groups. An offload tier (``prefix_reuse=True``) followed
    ``prefix_cacheable_group_ids`` alone, so under HiSparse it also stored the host-resident
    sparse-MLA source group and the model's other groups, which vLLM's offloading leaves
    out. The groups laid out as ``_lay_out_hisparse_groups`` (v1/hisparse/layout.py) lays
    them out: source, indexer, a device replica (out of transfer), the regular groups; the
    oracle is vLLM's own function on the same config."""
    sparse = kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = kvi.MLAAttentionSpec(  # deepseek_v2.py's Indexer cache: one fp8 row of 128 + 4 scale bytes
        block_size=16, num_kv_heads=1, head_size=132, dtype=torch.uint8,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )  # fmt: skip
    source, index, regular = (
        [f"model.layers.{i}.{kind}" for i in range(2)] for kind in ("attn", "indexer.k_cache", "mtp.attn")
    )
    specs = {**dict.fromkeys(source + regular, sparse), **dict.fromkeys(index, indexer)}
    engine = make_engine(specs, [source, index, regular], lambda spec: spec.block_size, num_blocks=6)
    _, kv = allocate_v033(engine)
    config = engine.config
    if hisparse:
        g = config.kv_cache_groups
        hot = kvi.HiSparseHotSpec(block_size=16, page_size=4096, blocks_per_request=2)
        groups = [
            dataclasses.replace(g[0], role=kvi.KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
            dataclasses.replace(g[1], role=kvi.KVCacheGroupRole.HISPARSE_INDEXER),
            kvi.KVCacheGroupSpec(["model.layers.0.attn.hot"], hot, enable_kv_transfer=False),
            g[2],
        ]
        config = dataclasses.replace(config, kv_cache_groups=groups, hisparse_host_num_blocks=64)
        kv["model.layers.0.attn.hot"] = torch.zeros(4096, dtype=torch.int8)  # a replica's raw buffer
        assert config.prefix_cacheable_group_ids == (0, 1, 3)  # what the tier followed
    stored = _vllm_get_offloading_group_ids()(config)  # vLLM's own answer
    assert stored == ((1,) if hisparse else (0, 1, 2))
    transferred = [i for i, group in enumerate(config.kv_cache_groups) if group.enable_kv_transfer]
    left_out = find_kv_cache_groups_out_of_offloading(config)
    assert [p.group for p in left_out] == [i for i in transferred if i not in stored]
    with caplog.at_level(logging.INFO, logger="kvlayout.integrations.vllm.edits"):
        edited = apply_kv_cache_group_edits(config, kv)
    layers, layer_groups = transfer_layers(config, edited)
    assert layer_groups is not None
    assert [i for i, members in enumerate(layer_groups) if members] == list(stored)
    reg = kvlayout.detect(layers, "vllm", layer_groups=layer_groups)
    assert [group.engine_group for group in reg.kernel_groups] == list(stored)
    if hisparse:
        assert sorted(edited) == sorted([*index, "model.layers.0.attn.hot"])  # the replica: as registered
        assert (
            "KV cache group left out: group 0: HiSparse is on (hisparse_host_num_blocks set) and the group's "
            "role is 'hisparse_source': vLLM's OffloadingConnector stores only the HiSparse indexer groups "
            "(get_offloading_group_ids; the source group lives in HiSparse's host pool): left out of a "
            "prefix-reusing tier; a P/D connector passes prefix_reuse=False to move it "
            f"(layers: {source[0]}, {source[1]})"
        ) in caplog.messages
        assert any(m.startswith("KV cache group left out: group 3: HiSparse is on") for m in caplog.messages)
        # a P/D connector moves every group vLLM transfers
        _, layer_groups = transfer_layers(config, apply_kv_cache_group_edits(config, kv, prefix_reuse=False))
        assert layer_groups is not None and [bool(m) for m in layer_groups] == [True, True, False, True]
    else:
        assert not left_out and not any(m.startswith("KV cache group left out") for m in caplog.messages)
