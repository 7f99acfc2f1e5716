"""A peer's description is untrusted input: every field typed and bounded, refused with a
PeerDescriptionError naming the field, in bounded memory and time whatever it claims.

The checks that would exhaust memory or CPU before their fix run in a subprocess whose
address space is capped a little above what it holds after importing kvlayout, each
under an alarm (the ``capped`` fixture)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import KVLayoutError, layout_of
from kvlayout.registration.memory import Run, _Extent, _meet, check_disjoint
from kvlayout.testing.registrations import CASES, registrations
from kvlayout.transfer import PeerDescriptionError, RegistrationDescription, block_map
from tests.transfer.registrations import make_registration

A = 1 << 40  # where the payloads below put their tensors


def _header(groups: list[dict[str, Any]], engine: str | None = "vllm") -> dict[str, Any]:
    return {
        "kvlayout": "registration-description",
        "version": 1,
        "device": {"type": "cpu", "index": None},
        "engine": engine,
        "shard": None,
        "groups": groups,
    }


def _group(fmt: str, layers: list[int], block_size: int | None, **plane: Any) -> dict[str, Any]:
    return {
        "format": fmt,
        "layers": layers,
        "engine_group": 0,
        "block_size": block_size,
        "opaque_pages": None,
        "planes": [{"block_stride": None, **plane}],
    }


def _pool(nl: int, nb: int = 2, at: int = A) -> dict[str, Any]:
    """A vLLM blocks-first pool: ``nl`` layers ``[NB, 1, 1]`` uint8, their blocks interleaved."""
    return _header(
        [
            _group(
                "NL_X_NB_BS_HS",
                list(range(nl)),
                1,
                dtype="uint8",
                sizes={"NL": nl, "NB": nb, "BS": 1, "HS": 1},
                shape=[nb, 1, 1],
                strides=[nl, 1, 1],
                block_stride=nl,
                addresses=[at + layer for layer in range(nl)],
            )
        ]
    )


def _strided(layer: int, nb: int, stride: int, at: int) -> dict[str, Any]:
    """One layer ``[NB, 1, 1]`` uint8 whose blocks are ``stride`` bytes apart."""
    return _group(
        "NL_X_NB_BS_HS",
        [layer],
        1,
        dtype="uint8",
        sizes={"NL": 1, "NB": nb, "BS": 1, "HS": 1},
        shape=[nb, 1, 1],
        strides=[stride, 1, 1],
        block_stride=stride,
        addresses=[at],
    )


def _nhd(nl: int = 2) -> dict[str, Any]:
    """A real vLLM NHD registration's description."""
    kv = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(nl)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    data: dict[str, Any] = json.loads(reg.describe(at=A).to_json())
    return data


def _sglang_split(addresses: list[int]) -> dict[str, Any]:
    """SGLang's [K layers, V layers] (TWO_X_NL_X_NB_BS_NH_HS) over 2 layers at ``addresses``."""
    return _header(
        [
            _group(
                "TWO_X_NL_X_NB_BS_NH_HS",
                [0, 1],
                4,
                dtype="bfloat16",
                sizes={"NL": 2, "NB": 4, "BS": 4, "NH": 2, "HS": 16},
                shape=[4, 4, 2, 16],
                strides=[128, 32, 16, 1],
                addresses=addresses,
            )
        ],
        engine="sglang",
    )


def _parse(data: object) -> RegistrationDescription:
    return RegistrationDescription.from_json(json.dumps(data))


# -- memory and time: the capped subprocess ------------------------------------------------------------

_CAPPED = textwrap.dedent(
    """
    import json, resource, signal, sys, time
    from kvlayout.transfer import RegistrationDescription

    def vm() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmSize")

    cap = vm() + (768 << 20)  # what it holds now, and 768 MiB more
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def alarm(*_):
        raise TimeoutError("over the alarm")

    signal.signal(signal.SIGALRM, alarm)
    out = {}
    for name, text in json.loads(sys.stdin.read()).items():
        t = time.monotonic()
        signal.alarm(30)
        try:
            RegistrationDescription.from_json(text)
            result = ["accepted", ""]
        except BaseException as exc:  # MemoryError and TimeoutError too
            result = [type(exc).__name__, str(exc)[:400]]
        signal.alarm(0)
        out[name] = [*result, time.monotonic() - t]
    print(json.dumps(out))
    """
)


def _interleaved(nl: int) -> dict[str, Any]:
    """Two blocks-first pools of ``nl`` layers and of two geometries in one engine group,
    every layer of one within the span of every layer of the other, no byte shared."""
    a, b = _pool(nl)["groups"][0], _pool(nl, nb=3)["groups"][0]
    b["layers"] = list(range(nl, 2 * nl))
    for group, first in ((a, A), (b, A + 1)):  # a's blocks at even bytes, b's at odd ones
        plane = group["planes"][0]
        plane["block_stride"], plane["strides"] = 2 * nl, [2 * nl, 1, 1]
        plane["addresses"] = [first + 2 * layer for layer in range(nl)]
    return _header([a, b])


def _huge_nl() -> dict[str, Any]:
    """4 billion layers claimed, one listed."""
    data = _nhd(1)
    data["groups"][0]["planes"][0]["sizes"]["NL"] = 2**32 - 1
    return data


CAPPED_PAYLOADS = {
    "huge_nl": _huge_nl(),  # the pointer table was built before counting (4 billion entries)
    "pool": _pool(65535),  # a 65535 x 65535 array per step of the pool check
    "meet": _header([_strided(0, 2 * (2**31 - 1), 2, A), _strided(1, 2**31 - 1, 4, A + 1)]),  # 2**31 blocks
    "interleaved": _interleaved(16384),  # 268 million pairs of tensors of two shapes
}


@pytest.fixture(scope="module")
def capped() -> dict[str, tuple[str, str, float]]:
    payloads = json.dumps({name: json.dumps(data) for name, data in CAPPED_PAYLOADS.items()})
    done = subprocess.run(
        [sys.executable, "-c", _CAPPED],
        input=payloads,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results: dict[str, tuple[str, str, float]] = json.loads(done.stdout)
    return results


def test_a_layer_count_no_address_list_holds_is_refused_before_any_table_is_built(
    capped: dict[str, tuple[str, str, float]],
) -> None:
    kind, message, seconds = capped["huge_nl"]
    assert kind == "PeerDescriptionError" and seconds < 5
    assert message.startswith(
        "description.groups[0].planes[0].addresses has 1 entries; NL_X_TWO_NB_BS_NH_HS has 4294967295 tensors here"
    )


def test_a_pool_of_65535_interleaved_layers_is_checked_in_bounded_memory(
    capped: dict[str, tuple[str, str, float]],
) -> None:
    kind, message, seconds = capped["pool"]
    assert (kind, message) == ("accepted", "") and seconds < 20


def test_blocks_that_interleave_without_touching_are_checked_without_walking_them(
    capped: dict[str, tuple[str, str, float]],
) -> None:
    kind, message, seconds = capped["meet"]
    assert (kind, message) == ("accepted", "") and seconds < 5


def test_too_many_interleaved_tensors_of_different_shapes_are_refused_in_bounded_time(
    capped: dict[str, tuple[str, str, float]],
) -> None:
    kind, message, seconds = capped["interleaved"]
    assert kind == "PeerDescriptionError" and seconds < 25
    assert message.startswith(
        "more than 1048576 pairs of tensors of different shapes lie within each other's spans, too many to "
        "check that they share no byte; the tensors a peer describes must be disjoint"
    )


def test_fewer_interleaved_tensors_of_different_shapes_are_checked() -> None:
    _parse(_interleaved(64))
    data = _interleaved(64)
    data["groups"][1]["planes"][0]["addresses"][5] -= 1  # onto a block of the other pool
    with pytest.raises(
        PeerDescriptionError, match=r"description\.groups\[1\]\.planes\[0\]\.addresses\[5\] and "
    ):
        _parse(data)


# -- the overlap checks: exact, whatever the addresses -----------------------------------------------------


def _bytes(start: int, period: int, block: int, count: int) -> set[int]:
    return {start + k * period + i for k in range(count) for i in range(block)}


@st.composite
def extents(draw: st.DrawFn) -> _Extent:
    count = draw(st.integers(1, 12))
    block = draw(st.integers(1, 9))
    period = block if count == 1 else block + draw(st.integers(1, 12))
    return _Extent(draw(st.integers(0, 80)), period, block, count, 0)


@settings(max_examples=300)
@given(extents(), extents())
def test_meet_is_the_byte_rule(a: _Extent, b: _Extent) -> None:
    a, b = sorted((a, b))
    if a.end > b.start:  # _meet's spans overlap
        assert _meet(a, b) == bool(_bytes(*a[:4]) & _bytes(*b[:4]))


@settings(max_examples=150)
@given(
    st.integers(1, 6),
    st.integers(0, 8),
    st.integers(1, 5),
    st.lists(st.integers(0, 120), min_size=2, max_size=12),
    st.sampled_from([0, 2**63 - 64, 2**64 - 2**12]),
)
def test_the_pool_check_names_the_pair_a_scan_in_address_order_meets_first(
    block: int, pad: int, count: int, starts: list[int], base: int
) -> None:
    """Same answers as testing every two tensors, the same pair named, addresses up to
    2**64 exact (they were int64: OverflowError from 2**63)."""
    period = block + pad if count > 1 else block
    starts = [base + s for s in starts]
    ordered = sorted(range(len(starts)), key=lambda i: (starts[i], i))
    pairs = [
        (i, j)
        for x, i in enumerate(ordered)
        for j in ordered[x + 1 :]
        if _bytes(starts[i], period, block, count) & _bytes(starts[j], period, block, count)
    ]
    run = Run(period, block, count, starts, [(i,) for i in range(len(starts))], "kv")
    if not pairs:
        check_disjoint([run], KVLayoutError, "")
        return
    i, j = pairs[0]
    with pytest.raises(KVLayoutError, match=rf"^kv\[{j}\] and kv\[{i}\] overlap in memory"):
        check_disjoint([run], KVLayoutError, "")


def test_a_pool_above_2_63_is_checked_exactly() -> None:
    starts = [2**63 + 8 * k for k in range(4)]
    check_disjoint([Run(32, 8, 3, starts, [(k,) for k in range(4)], "kv")], KVLayoutError, "")
    with pytest.raises(KVLayoutError, match=r"^kv\[1\] and kv\[0\] overlap in memory"):
        check_disjoint([Run(32, 8, 3, [*starts[:1], starts[0] + 31], [(0,), (1,)], "kv")], KVLayoutError, "")


def test_addresses_no_host_or_device_reaches_are_refused() -> None:
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes\[0\]\.addresses\[0\]=0x8000000000000000: its tensor ends at "
        r"0x8000000000000003, past 2\*\*57",
    ):
        _parse(_pool(2, at=2**63))
    _parse(_pool(2, at=2**57 - 4))
    with pytest.raises(PeerDescriptionError, match=r"addresses\[1\]=0x1fffffffffffffe: its tensor ends at"):
        _parse(_pool(2, at=2**57 - 3))
    _parse(_pool(2, at=4096))
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes\[0\]\.addresses\[0\]=4095 is outside \[4096, ",
    ):  # the null page: a staging buffer a peer names there was refused, its tensors were not
        _parse(_pool(2, at=4095))


# -- fields: typed, bounded, named ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "sizes", "symbol"),
    [
        (F.NL_X_TWO_NB_BS_NH_HS, {"NL": 2, "NB": 3, "BS": 2, "NH": 2, "HS": 4}, "NL"),
        (F.NL_X_NP_X_NB_BS_ONE_HS, {"NL": 2, "NP": 2, "NB": 3, "BS": 2, "HS": 4}, "NP"),
    ],
)
def test_a_missing_list_size_names_the_sizes_field(fmt: F, sizes: dict[str, int], symbol: str) -> None:
    """It raised SizeError ("this needs a size for NL"), no field named."""
    kv = make_registration(layout_of(fmt), sizes, torch.float32).kv
    data = json.loads(kvlayout.bind(kv, fmt).describe(at=A).to_json())
    del data["groups"][0]["planes"][0]["sizes"][symbol]
    with pytest.raises(
        PeerDescriptionError,
        match=rf"^description\.groups\[0\]\.planes\[0\]\.sizes: {fmt.name}: this needs a size for {symbol}$",
    ):
        _parse(data)


@pytest.mark.parametrize(("engine", "value"), CASES, ids=[f"{e}-{F(v).name}" for e, v in CASES])
def test_every_size_a_description_leaves_out_is_a_peer_description_error(engine: str, value: int) -> None:
    @settings(max_examples=1, database=None)
    @given(registrations(engine, value))
    def check(case: Any) -> None:
        reg = kvlayout.detect(case.kv, case.engine, case.hints)
        data = json.loads(reg.describe(at=A).to_json())
        for gi, group in enumerate(data["groups"]):
            for pi, plane in enumerate(group["planes"]):
                for key in list(plane["sizes"]):
                    value = plane["sizes"].pop(key)
                    try:
                        _parse(data)
                    except PeerDescriptionError as exc:
                        assert str(exc).startswith(f"description.groups[{gi}].planes[{pi}]"), (key, exc)
                    plane["sizes"][key] = value

    check()


@pytest.mark.parametrize(
    ("tokens", "literal", "kind"),
    [(1, "true", "a boolean"), (1, "1.0", "float"), (1, "1E0", "float"), (4, "4.0", "float")],
)
def test_block_size_is_a_json_integer(tokens: int, literal: str, kind: str) -> None:
    """They compared equal to the blocks' tokens, were kept and sent back as given."""
    good = json.dumps(_pool(2) if tokens == 1 else _nhd())
    assert good.count(f'"block_size": {tokens}') == 1
    with pytest.raises(
        PeerDescriptionError, match=rf"^description\.groups\[0\]\.block_size must be an integer, not {kind}$"
    ):
        RegistrationDescription.from_json(good.replace(f'"block_size": {tokens}', f'"block_size": {literal}'))


@pytest.mark.parametrize(
    ("once", "twice", "key"),
    [
        ('"version": 1', '"version": 2, "version": 1', "version"),
        ('"addresses": [', '"addresses": [4096], "addresses": [', "addresses"),
        ('"NB": 8', '"NB": 8, "NB": 8', "NB"),
    ],
)
def test_a_key_twice_in_one_object_is_refused(once: str, twice: str, key: str) -> None:
    """The last one won: a proxy reading the first saw another description."""
    good = json.dumps(_nhd())
    assert good.count(once) == 1
    with pytest.raises(
        PeerDescriptionError, match=rf"^the description has the key '{key}' twice in one object$"
    ):
        RegistrationDescription.from_json(good.replace(once, twice))


@pytest.mark.parametrize("digits", [65, 4300, 4301, 100_000])
def test_an_integer_longer_than_any_field_is_refused_by_its_length(digits: int) -> None:
    """Past 4300 digits Python refused the literal itself, and the message advised
    ``sys.set_int_max_str_digits()``; below that, the field's message quoted it whole."""
    good = json.dumps(_nhd())
    assert good.count('"NB": 8') == 1
    with pytest.raises(
        PeerDescriptionError,
        match=rf"^the description holds an integer of {digits} digits \(999999999999\.\.\.\), more than any field",
    ):
        RegistrationDescription.from_json(good.replace('"NB": 8', f'"NB": {"9" * digits}'))
    with pytest.raises(PeerDescriptionError, match=r"sizes\.NB=9{64} is outside \[1, 4294967296\)$"):
        RegistrationDescription.from_json(good.replace('"NB": 8', f'"NB": {"9" * 64}'))  # the field says it


@pytest.mark.parametrize("engine", ["", "\ud800", "vllm\x00", "v" * 65, " vllm", "vllm\n"])
def test_engine_is_a_name(engine: str) -> None:
    data = _nhd()
    data["engine"] = engine
    with pytest.raises(PeerDescriptionError, match=r"^description\.engine must be null or an engine name"):
        _parse(data)
    data["engine"] = "some-engine_2.0"
    assert _parse(data).engine == "some-engine_2.0"


def test_a_cpu_device_has_no_index() -> None:
    data = _nhd()
    data["device"]["index"] = 0
    with pytest.raises(
        PeerDescriptionError, match=r"^description\.device\.index is 0; a cpu device has none"
    ):
        _parse(data)
    data["device"]["type"] = "cuda"
    assert _parse(data).device_index == 0


# -- sharing: whole layers only, as detection accepts it ------------------------------------------------

B, C = A + (1 << 20), A + (2 << 20)


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        (
            [A, B, A, C],  # V0 is K0
            r"description\.groups\[0\]\.planes\[0\]\.addresses\[2\] \(0x10000000000\) and description\.groups"
            r"\[0\]\.planes\[0\]\.addresses\[0\] overlap in memory: they are one tensor twice within one layer",
        ),
        (
            [A, A, B, C],  # K1 is K0, V1 is its own
            r"description\.groups\[0\]: layer 1 shares only part of its KV cache with layer 0: "
            r"description\.groups\[0\]\.planes\[0\]\.addresses\[3\] is its own tensor",
        ),
        (
            [A, B, B, C],  # V0 is K1
            r"description\.groups\[0\]\.planes\[0\]\.addresses\[2\] \(0x10000100000\) is the memory of "
            r"description\.groups\[0\]\.planes\[0\]\.addresses\[1\], which holds another part of its layer",
        ),
    ],
)
def test_layers_share_a_kv_cache_only_whole(addresses: list[int], message: str) -> None:
    with pytest.raises(PeerDescriptionError, match=rf"^{message}"):
        _parse(_sglang_split(addresses))


def test_a_layer_sharing_another_s_whole_kv_cache_is_accepted_and_mapped() -> None:
    peer = _parse(_sglang_split([A, A, B, B]))  # layer 1 is layer 0: K and V
    assert peer.groups[0].planes[0].repeats == (1, 3)
    local = kvlayout.detect(
        [[torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)], "sglang", {}
    )
    assert block_map(local, peer, [0], [1]).num_runs == 2  # K and V once: layer 1's are layer 0's bytes


def test_a_layer_sharing_with_two_layers_is_refused() -> None:
    """NL_X_TWO_X_...: [[K0, V0], [K1, V1], [K2, V2]]; K2 is K0's, V2 is V1's."""
    kv = [(torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)) for _ in range(3)]
    data = json.loads(kvlayout.bind(kv, F.NL_X_TWO_X_NB_BS_NH_HS).describe(at=A).to_json())
    addresses = data["groups"][0]["planes"][0]["addresses"]
    addresses[4], addresses[5] = addresses[0], addresses[3]
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes\[0\]\.addresses\[5\] \(0x[0-9a-f]+\) is the memory of description"
        r"\.groups\[0\]\.planes\[0\]\.addresses\[3\], but layer 2 shares other tensors with layer 0",
    ):
        _parse(data)


# -- a size-1 dim's stride --------------------------------------------------------------------------------


def test_a_blocks_first_pool_of_one_block_is_described_and_mapped() -> None:
    buf = torch.zeros(1, 2, 2, 4, dtype=torch.bfloat16)  # vLLM blocks-first [NB=1, NL, BS, HS]
    kv = [buf[:, i] for i in range(2)]
    assert kv[0].stride() == (16, 4, 1)  # dim 0's stride addresses nothing
    reg = kvlayout.detect(kv, "vllm", {})
    desc = reg.describe()
    assert desc.groups[0].planes[0].strides == (8, 4, 1)
    assert RegistrationDescription.from_json(desc.to_json()) == desc
    wire = json.loads(desc.to_json())
    wire["groups"][0]["planes"][0]["strides"] = [16, 4, 1]  # as torch gives them
    assert _parse(wire) == desc
    wire["groups"][0]["planes"][0]["strides"] = [8, 8, 1]  # a stride that addresses something
    with pytest.raises(PeerDescriptionError, match=r"strides are \[8, 8, 1\]; NL_X_NB_BS_HS stores"):
        _parse(wire)
    dst = kvlayout.detect([torch.zeros(1, 2, 4, dtype=torch.bfloat16) for _ in range(2)], "vllm", {})
    assert block_map(reg, dst, [0], [0]).num_runs == 2


def test_a_layer_in_two_kernel_groups_is_refused() -> None:
    data = _pool(2)
    twin = json.loads(json.dumps(data["groups"][0]))
    twin["engine_group"], twin["planes"][0]["addresses"] = 1, [A + (1 << 30), A + (1 << 30) + 1]
    data["groups"].append(twin)
    with pytest.raises(
        PeerDescriptionError, match=r"^description\.groups: a layer index appears in two kernel groups$"
    ):
        _parse(data)
    twin["layers"] = [2, 3]
    assert _parse(data).groups[1].layers == (2, 3)


def test_a_group_s_planes_share_their_layers_and_blocks() -> None:
    kv = [(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 6)) for _ in range(2)]
    data = json.loads(kvlayout.bind(kv, F.NL_X_NP_X_NB_BS_ONE_HS).describe(at=A).to_json())
    plane = data["groups"][0]["planes"][1]
    plane["sizes"]["NB"] = plane["shape"][0] = 4
    with pytest.raises(
        PeerDescriptionError,
        match=re.escape(
            "description.groups[0].planes[1] has NB=4; planes[0] has 3 (planes share their layers and blocks)"
        ),
    ):
        _parse(data)


def test_planes_are_refused_for_a_format_of_one_plane() -> None:
    """Only a format with a list level of row planes binds more than one plane; a peer's
    second plane of K/V heads was parsed, and refused only by a block map, as planes of
    several heads."""
    kv = [torch.zeros(3, 2, 4, 2, 8) for _ in range(2)]
    data = json.loads(kvlayout.detect(kv, "vllm", {"tokens_per_block": 4}).describe(at=A).to_json())
    planes = data["groups"][0]["planes"]
    planes.append({**planes[0], "addresses": [a + (1 << 30) for a in planes[0]["addresses"]]})
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes holds 2 planes, but NL_X_NB_TWO_BS_NH_HS has no list "
        r"level of row planes: its tensors are one plane$",
    ):
        _parse(data)
    planes.pop()
    assert len(_parse(data).groups[0].planes) == 1


def test_a_description_of_more_than_2_20_tensors_is_refused_at_the_plane_past_the_bound() -> None:
    """Each plane's address list is bounded; so is their sum, counted before it is read."""
    nl = 1 << 16
    plane = {"dtype": "uint8", "sizes": {"NL": nl, "NB": 1, "BS": 1, "NH": 1, "HS": 1}, "shape": [1, 1, 1, 1],
             "strides": [1, 1, 1, 1], "block_stride": None, "addresses": list(range(A, A + 2 * nl))}  # fmt: skip
    data = _sglang_split([])
    data["groups"][0].update(layers=list(range(nl)), block_size=1, planes=[plane] * 9)
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes\[8\]: the description names more than 1048576 tensors$",
    ):
        _parse(data)


def test_a_tensor_spanning_more_than_2_48_bytes_is_refused() -> None:
    """2**31 one-byte blocks 256 KiB apart: every size in bounds, the span not."""
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.planes\[0\]: each tensor spans 562949953159169 bytes, more than "
        r"281474976710656$",
    ):
        _parse(_header([_strided(0, 2**31, 2**18, A)]))


def test_the_tensor_bound_counts_every_group_s_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound on a description's tensors is on all its groups together, exactly: as
    many as it allows pass, one more is refused at the group past it."""
    monkeypatch.setattr("kvlayout.registration.peers.MAX_TENSORS", 2)
    data = _header([_strided(layer, 2, 1, A + (layer << 20)) for layer in range(2)])
    assert len(_parse(data).groups) == 2
    data["groups"].append(_strided(2, 2, 1, A + (2 << 20)))
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[2\]\.planes\[0\]: the description names more than 2 tensors$",
    ):
        _parse(data)


def _pages(**pages: Any) -> dict[str, Any]:
    """A real description whose group declares opaque pages ``pages`` (version 2)."""
    data = _nhd(1)
    data["version"] = 2
    data["groups"][0]["opaque_pages"] = {"layout": "pages", "rows_are_tokens": False, **pages}
    return data


def _array(**fields: Any) -> dict[str, Any]:
    return {"offset": 0, "shape": [4], "dtype": "uint8", "axis": 0, "parts": [4], **fields}


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ({"rows_are_tokens": 1}, r"\.opaque_pages\.rows_are_tokens must be a boolean, not int$"),
        ({"arrays": [_array(kv_heads=1)]}, r"\.opaque_pages\.arrays\[0\]\.kv_heads 1 is not a boolean$"),
        (
            {"arrays": [_array(shape=[2**24, 2**24], parts=[2**24])]},
            r"\.opaque_pages\.arrays\[0\]: shape \[16777216, 16777216\] of uint8 spans 2\*\*48 bytes or more$",
        ),
    ],
)
def test_opaque_pages_fields_are_typed_and_bounded(pages: dict[str, Any], message: str) -> None:
    """Each is a PeerDescriptionError naming the field (OpaquePages and PageArray raise
    TypeError of their own, which from_json must not let out)."""
    with pytest.raises(PeerDescriptionError, match=r"^description\.groups\[0\]" + message):
        _parse(_pages(**pages))


def test_a_page_arrays_flags_are_bools() -> None:
    """``replicated`` and ``kv_heads`` decide which ranks hold an array: 1 is no flag."""
    from kvlayout.registration.opaque import PageArray

    for flag in ("kv_heads", "replicated"):
        with pytest.raises(TypeError, match=f"a page array's {flag} must be a bool, not int"):
            PageArray(0, (4, 8), "uint8", 0, (4,), **{flag: 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either of KV heads or replicated, not both"):
        PageArray(0, (1, 8), "uint8", 0, (1,), kv_heads=True, replicated=True)


# -- bounds: each exact ---------------------------------------------------------------------------------


def _at(data: dict[str, Any], path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "field", "bounds"),
    [
        (("version",), 2, "description.version", "[1, 3)"),
        (("device", "index"), 65535, "description.device.index", "[0, 65536)"),
        (("groups", 0, "engine_group"), 65535, r"description.groups[0].engine_group", "[-1, 65536)"),
        (("groups", 0, "planes", 0, "sizes", "HS"), 2**32 - 1, "description.groups[0].planes[0].sizes.HS",
         "[1, 4294967296)"),
    ],
)  # fmt: skip
def test_a_bound_takes_the_last_value_below_it_and_refuses_the_bound(
    path: tuple[str | int, ...], value: int, field: str, bounds: str
) -> None:
    """Every integer field is bounded in [lo, hi): hi itself is refused, naming the field."""
    data = _nhd()
    data["device"] = {"type": "cuda", "index": 0}
    refused = _at(json.loads(json.dumps(data)), path, value + 1)
    with pytest.raises(
        PeerDescriptionError, match=rf"^{re.escape(f'{field}={value + 1} is outside {bounds}')}$"
    ):
        _parse(refused)
    if path[-1] != "HS":  # a head of 2**32 - 1 elements spans more than a tensor may
        _parse(_at(data, path, value))


def test_a_list_bound_takes_as_many_entries_as_it_says_and_refuses_one_more() -> None:
    data = _nhd()
    plane = data["groups"][0]["planes"][0]
    data["groups"][0]["planes"] = [plane] * 17
    with pytest.raises(
        PeerDescriptionError, match=r"^description\.groups\[0\]\.planes has 17 entries, more than 16$"
    ):
        _parse(data)
    data["groups"][0]["planes"] = [plane] * 16  # within the bound: refused for what the planes are
    with pytest.raises(PeerDescriptionError, match=r"^description\.groups\[0\]\.planes holds 16 planes, but"):
        _parse(data)


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ((), "description"),
        (("device",), "description.device"),
        (("groups", 0), "description.groups[0]"),
        (("groups", 0, "planes", 0), "description.groups[0].planes[0]"),
    ],
)
def test_a_field_no_description_has_is_refused_by_name(path: tuple[str | int, ...], where: str) -> None:
    """A reader that skipped fields it did not know would read another description than a
    newer writer meant (an address list under a new name, say)."""
    data = _nhd()
    node: Any = data
    for key in path:
        node = node[key]
    node["address_list"] = [A]
    with pytest.raises(
        PeerDescriptionError, match=rf"^{re.escape(where)} has unknown field\(s\) 'address_list'$"
    ):
        _parse(data)
    node.update({f"x{k}": 0 for k in range(10)})
    with pytest.raises(
        PeerDescriptionError, match=r" has unknown field\(s\) 'address_list', 'x0', .*, 'x6' and 3 more$"
    ):
        _parse(data)


@pytest.mark.parametrize("key", ["tp_rank", "tp_size", "num_kv_heads"])
def test_a_negative_shard_field_is_refused_by_its_name(key: str) -> None:
    data = _nhd()
    data["shard"] = {"tp_rank": 0, "tp_size": 1, "num_kv_heads": 2, key: -1}
    with pytest.raises(
        PeerDescriptionError, match=rf"^description\.shard\.{key}=-1 is outside \[0, 65536\)$"
    ):
        _parse(data)


def test_a_shard_holding_fewer_heads_than_the_tensors_is_refused() -> None:
    """Rank 0 of 2 holds 1 of 2 KV heads; tensors of 2 heads are not its."""
    data = _nhd()
    data["shard"] = {"tp_rank": 0, "tp_size": 2, "num_kv_heads": 2}
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.shard Shard\(tp_rank=0, tp_size=2, num_kv_heads=2\) holds 1 KV heads, but "
        r"description\.groups\[0\] has 2$",
    ):
        _parse(data)
    data["shard"] = {"tp_rank": 0, "tp_size": 1, "num_kv_heads": 2}
    assert _parse(data).shard is not None


def test_a_group_of_no_layers_is_refused_as_such() -> None:
    data = _nhd()
    data["groups"][0]["layers"] = []
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]\.layers must be distinct layer indices, at least one$",
    ):
        _parse(data)


@pytest.mark.parametrize("layers", [[0], [0, 1, 2]])
def test_a_group_names_as_many_layers_as_its_tensors_hold(layers: list[int]) -> None:
    data = _nhd()
    data["groups"][0]["layers"] = layers
    with pytest.raises(
        PeerDescriptionError,
        match=rf"^description\.groups\[0\]\.layers has {len(layers)} entries; the tensors hold 2 layers$",
    ):
        _parse(data)


def test_a_group_index_past_the_last_is_refused_by_name() -> None:
    d = _parse(_nhd())
    assert d.group(0).groups == d.groups
    for index in (1, -1):
        with pytest.raises(
            PeerDescriptionError, match=rf"^group {index} is out of range for 1 kernel groups$"
        ):  # not an IndexError, nor the last group for -1
            d.group(index)
