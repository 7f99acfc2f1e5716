"""``kvlayout plan --ring-kind``: each of vLLM 0.33's ``CircularBufferSpec`` rings planned
beside its model's attention (``--*-ring-shape``) as a connector posts them, checked
against the library's own maps of the same registrations as vLLM plans and allocates
them (tests/integrations/vllm/test_vllm_ring_producers.py's models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tools.test_cli import run

pytest.importorskip("vllm.v1.kv_cache_interface")
from tests.integrations.vllm.test_vllm_ring_producers import MODELS, worker

# each ring kind: its model in MODELS, the attention's hints, the request's tokens (two of
# the attention's blocks)
KINDS = {
    "glm5-next-tail": ("glm5-next-tail", ["kv_dim=1"], 200),  # MLA latents, blocks of 128
    "qwen4-qsa": ("qwen4-qsa", ["kv_layout=HND"], 100),  # 4 KV heads, blocks of 64
    "step5-csa-tail": ("step5-csa-tail-1-kv-head", ["kv_layout=HND"], 100),  # its page the same at any TP
}
CASES = [(k, 2, 4) for k in KINDS] + [(k, 4, 2) for k in KINDS] + [(k, 1, 2) for k in KINDS]


def _groups(w: Any) -> dict[str, tuple[Any, str]]:
    """A worker's attention and ring kernel groups, each with its ``--*-shape``."""
    names = list(w.kv)  # every layer is registered (prefix_reuse=False): the groups' numbering
    assert sum(len(g.layers) for g in w.registration.kernel_groups) == len(names)
    attention = next(g for g in w.registration.kernel_groups if names[g.layers[0]].endswith(".attn"))
    return {
        name: (g, f"{len(g.layers)}x{list(w.kv[names[g.layers[0]]].shape)}".replace(" ", ""))
        for name, g in (("attention", attention), ("ring", w.ring))
    }


def _plan(
    capsys: pytest.CaptureFixture[str], kind: str, sides: dict[str, Any], model: str | None = None
) -> tuple[int, dict[str, Any]]:
    """``kvlayout plan --json`` of the attention and the ring of each side's worker (of
    ``model``, the kind's unless given): its exit code and its plan."""
    model, hints, tokens = model or KINDS[kind][0], KINDS[kind][1], KINDS[kind][2]
    argv = ["plan", "--ring-kind", kind, "--tokens", str(tokens), "--json"]
    if "kv_dim=1" not in hints:  # the model's KV heads; MLA latents are every rank's
        argv += ["--kv-heads", str(MODELS[model][3])]
    for where, w in sides.items():
        groups = _groups(w)
        argv += [f"--{where}-engine", "vllm", f"--{where}-shape", groups["attention"][1],
                 f"--{where}-ring-shape", groups["ring"][1], f"--{where}-tp", str(w.tp)]  # fmt: skip
        argv += [x for h in hints for x in (f"--{where}-hint", h)]
    code, out, err = run(capsys, *argv)
    assert err == "", err
    return code, dict(json.loads(out))


def _worker(model: str, tp: int) -> Any:
    make, layouts, _, _ = MODELS[model]
    return worker(make(tp), layouts[-1], tp, 0, 1)


@pytest.mark.parametrize(("kind", "src_tp", "dst_tp"), CASES)
def test_plan_of_attention_beside_each_ring_is_the_joined_map_of_its_registrations(
    capsys: pytest.CaptureFixture[str], kind: str, src_tp: int, dst_tp: int
) -> None:
    """Each ring kind beside its model's attention, as vLLM plans and allocates them
    (the groups packed in one buffer), planned from their shapes: each rank pair's
    kinds, runs, bytes and direct descriptors are ``join_maps`` of the library's own
    block maps of the two registrations (staged descriptors no fewer: the plan's shapes
    cannot say that a packed block's groups lie side by side). Attention goes from the
    ranks holding the decode rank's heads (``Shard.sends_to``), the ring, which every rank
    holds whole, from the one prefill rank vLLM reads it from, and ``--json`` says which
    ring the plan read."""
    from kvlayout.integrations.vllm.rules import RING_KINDS
    from kvlayout.tools.plan_command import _block_ids
    from kvlayout.transfer import Shard, block_map, join_maps
    from kvlayout.transfer.nixl import estimate

    src, dst = _worker(KINDS[kind][0], src_tp), _worker(KINDS[kind][0], dst_tp)
    code, plan = _plan(capsys, kind, {"src": src, "dst": dst})
    assert code == 0
    mine, theirs = _groups(src), _groups(dst)
    ring = mine["ring"][0]
    assert plan["ring_kind"] == kind and plan["beside"] == "ring"
    assert plan["src"]["ring"] == {"format": ring.format.name, "block_size": ring.geometry.block_size,
                                   "num_blocks": ring.geometry.num_blocks, "layers": 2}  # fmt: skip
    assert ring.opaque_pages.arrays[0].dtype == str(RING_KINDS[kind].dtype).removeprefix("torch.")
    heads, tokens = MODELS[KINDS[kind][0]][3], KINDS[kind][2]
    ids = _block_ids("scattered", 2, mine["attention"][0].geometry.num_blocks, "src")
    ring_ids = _block_ids("scattered", 1, ring.geometry.num_blocks, "src")
    senders: dict[int, list[int]] = {d: [] for d in range(dst_tp)}
    for p in plan["pairs"]:
        ps, ds = Shard(p["src_rank"], src_tp, heads), Shard(p["dst_rank"], dst_tp, heads)
        att = block_map(mine["attention"][0], theirs["attention"][0], ids, ids, num_tokens=tokens,
                        src_shard=ps, dst_shard=ds)  # fmt: skip
        maps = {"attention": att, "ring": block_map(ring, theirs["ring"][0], ring_ids, ring_ids,
                                                    src_shard=ps, dst_shard=ds)}  # fmt: skip
        sent = {
            "attention": ps.sends_to(ds, latents=att.latents),
            "ring": Shard(p["src_rank"], src_tp, 1).sends_to(Shard(p["dst_rank"], dst_tp, 1), latents=True),
        }
        assert maps["ring"].latents  # every rank holds the ring whole
        for name, m in maps.items():
            want = (m.kind, m.num_runs, m.num_bytes) if sent[name] or not m.num_runs else ("replica", 0, 0)
            assert (p[name]["kind"], p[name]["runs"], p[name]["bytes"]) == want, name
        if sent["ring"]:
            senders[p["dst_rank"]].append(p["src_rank"])
        joined = [m for name, m in maps.items() if sent[name] and m.num_runs]
        if not joined:
            assert p["bytes"] == 0
            continue
        whole = join_maps(joined)
        assert (p["runs"], p["bytes"]) == (whole.num_runs, whole.num_bytes)
        library = estimate(whole, poster="dst").descriptors
        assert p["descriptors"]["direct"] == library["direct"]
        assert all(p["descriptors"][k] >= library[k] for k in library)
    assert senders == {d: [d * src_tp // dst_tp] for d in range(dst_tp)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_plan_of_each_ring_alone_is_the_library_s_map(capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """``--src-ring`` / ``--dst-ring`` with ``--ring-kind`` and the kind's ``--dtype``: each
    decode rank's ring whole from the one prefill rank vLLM reads it from, as the
    library maps the registered rings, prefill TP 2 into decode TP 4."""
    from kvlayout.integrations.vllm.rules import RING_KINDS
    from kvlayout.tools.plan_command import ring_dtype_name
    from kvlayout.transfer import Shard, block_map

    src, dst = _worker(KINDS[kind][0], 2), _worker(KINDS[kind][0], 4)
    shapes = [_groups(w)["ring"][1] for w in (src, dst)]
    code, out, err = run(capsys, "plan", "--ring-kind", kind, "--dtype", ring_dtype_name(RING_KINDS[kind]),
                         "--tokens", "100", "--json", "--src-engine", "vllm", "--dst-engine", "vllm",
                         "--src-ring", "--dst-ring", "--src-shape", shapes[0], "--dst-shape", shapes[1],
                         "--src-tp", "2", "--dst-tp", "4")  # fmt: skip
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["ring"] and plan["ring_kind"] == kind
    for p in plan["pairs"]:
        ps, ds = Shard(p["src_rank"], 2, 1), Shard(p["dst_rank"], 4, 1)
        m = block_map(src.ring, dst.ring, [0], [0], src_shard=ps, dst_shard=ds)
        want = (m.kind, m.num_runs, m.num_bytes) if ps.sends_to(ds, latents=True) else ("replica", 0, 0)
        assert (p["kind"], p["runs"], p["bytes"]) == want
        assert not p["runs"] or p["descriptors"]["direct"] == m.num_runs


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_plan_refuses_step5_rings_of_other_pages_as_the_library_does(
    capsys: pytest.CaptureFixture[str], src_tp: int, dst_tp: int
) -> None:
    """Step5's CSA tail ring is its rank's attention page: 4 KV heads at TP 2 and 4 give
    rings of other capacities, which the library refuses to map, naming the ring; the
    plan refuses every pair's ring (exit 1) with the library's reason."""
    from kvlayout.transfer import BlockMapError, Shard, block_map

    src, dst = _worker("step5-csa-tail", src_tp), _worker("step5-csa-tail", dst_tp)
    code, plan = _plan(capsys, "step5-csa-tail", {"src": src, "dst": dst}, "step5-csa-tail")
    assert code == 1
    with pytest.raises(BlockMapError) as library:
        block_map(src.ring, dst.ring, [0], [0], src_shard=Shard(0, src_tp, 4), dst_shard=Shard(0, dst_tp, 4))
    reason = str(library.value).split(": ", 1)[-1]
    assert reason.startswith("state array 0 is bfloat16") and "Step5's CSA tail ring" in reason
    pairs = plan["pairs"]
    assert len(pairs) == src_tp * dst_tp
    assert all("refused" in p["ring"] and reason in p["ring"]["refused"] for p in pairs), (reason, pairs[0])


@pytest.mark.parametrize(
    ("kind", "shape", "message"),
    [
        ("glm5-next-tail", "2x[6,1,8,128]", "GLM5-Next's indexer tail ring (vLLM's CircularBufferSpec, "
         "Glm5NextTailCache) registers as [NB,2,N,C] bfloat16 (H its head slots, [K, gate score]; N its "
         "capacity; C its row), not bfloat16 [6, 1, 8, 128]: axis 1 (H) is 1, not 2"),
        ("qwen4-qsa", "2x[6,2,4,128]", "QSAKeyStateCache) registers as [NB,1,N,C] bfloat16 (H its head "
         "slots, raw keys; N its capacity; C its row), not bfloat16 [6, 2, 4, 128]: axis 1 (H) is 2, not 1"),
        ("step5-csa-tail", "2x[6,1,64,100]", "not bfloat16 [6, 1, 64, 100]: axis 3 (C) is 100: N x C is "
         "12800 bytes, not 7 or more rows of 1024 bytes (the page is its rank's attention page)"),
        ("deepseek-v4.1", "2x[6,1,6,1024]", "not float32 [6, 1, 6, 1024]: axis 2 (N) is 6, not a power of "
         "two of 8 or more"),
    ],
)  # fmt: skip
def test_a_ring_shape_of_another_kind_is_refused_naming_the_axis(
    capsys: pytest.CaptureFixture[str], kind: str, shape: str, message: str
) -> None:
    """A ring shape its kind's producer does not register is refused, naming the axis
    (beside attention and alone)."""
    base = ["plan", "--ring-kind", kind, "--tokens", "100", "--src-engine", "vllm", "--dst-engine", "vllm"]
    beside = [*base, "--src-shape", "2x[6,1,64,512]", "--dst-shape", "2x[6,1,64,512]", "--src-hint", "kv_dim=1",
              "--dst-hint", "kv_dim=1", "--src-ring-shape", shape, "--dst-ring-shape", shape]  # fmt: skip
    from kvlayout.integrations.vllm.rules import RING_KINDS
    from kvlayout.tools.plan_command import ring_dtype_name

    alone = [*base, "--src-shape", shape, "--dst-shape", shape, "--src-ring", "--dst-ring", "--dtype",
             ring_dtype_name(RING_KINDS[kind])]  # fmt: skip
    for argv, flag in ((beside, "--src-ring-shape"), (alone, "--src-ring")):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), err
        assert f"{flag} on --src-" in err and message in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ring-kind", "glm5"], "--ring-kind 'glm5': vLLM 0.33's rings are deepseek-v4.1 (DeepSeek-V4.1's "
         "compressor state, [NB,1,N,C] float32); glm5-next-tail (GLM5-Next's indexer tail ring, [NB,2,N,C] "
         "bfloat16)"),
        (["--ring-kind", "qwen4-qsa", "--src-ring", "--dst-ring", "--dtype", "fp32"],
         "--dtype fp32 with --src-ring: Qwen4's QSA raw-key ring is bfloat16 (QSAKeyStateCache registers it "
         "so); give --dtype bf16, or another --ring-kind"),
    ],
)  # fmt: skip
def test_plan_refuses_a_ring_kind_it_cannot_read(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    shape = "2x[6,1,4,128]"
    argv = ["plan", "--tokens", "8", "--src-engine", "vllm", "--dst-engine", "vllm", "--src-shape", shape,
            "--dst-shape", shape, *extra]  # fmt: skip
    if "--src-ring" not in extra:
        argv += ["--src-ring", "--dst-ring", "--dtype", "bf16"]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, ""), err
    assert message in err, err


def test_ring_kind_without_rings_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--ring-kind", "qwen4-qsa", "--tokens", "8", "--src-engine", "vllm",
                         "--dst-engine", "vllm", "--src-shape", "2x[6,2,64,256]", "--dst-shape",
                         "2x[6,2,64,256]")  # fmt: skip
    assert (code, out) == (2, "")
    assert "--ring-kind qwen4-qsa without rings: it says which ring --src-ring and --dst-ring" in err


def test_help_names_every_ring_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --help`` names each ring ``--ring-kind`` reads (the library's RING_KINDS)."""
    from kvlayout.integrations.vllm.rules import RING_KINDS

    with pytest.raises(SystemExit):
        run(capsys, "plan", "--help")
    text = " ".join(capsys.readouterr().out.split())
    said = text.rsplit("--ring-kind KIND", 1)[1].split("--tokens", 1)[0]
    assert all(k in said for k in RING_KINDS), said


def test_plan_of_a_qwen4_ring_beside_its_attention_as_the_docs_show(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/pd-connectors.md's ``--ring-kind`` line runs: each decode rank's KV head of 2
    layers (100 tokens) and their QSA rings from one prefill rank, in one transfer."""
    docs = (Path(__file__).parents[2] / "docs" / "pd-connectors.md").read_text()
    line = next(x for x in docs.splitlines() if "kvlayout plan" in x and "--ring-kind" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["ring_kind"] == "qwen4-qsa"
    sent = [p for p in plan["pairs"] if p["bytes"]]
    assert sorted((p["src_rank"], p["dst_rank"]) for p in sent) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert all(
        (p["attention"]["bytes"], p["ring"]["bytes"]) == (100 * 2 * 256 * 2, 2 * 4 * 128 * 2) for p in sent
    )
    assert all((p["runs"], p["bytes"]) == (6, 104448) for p in sent)
