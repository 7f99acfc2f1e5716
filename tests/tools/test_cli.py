"""The command line: what each command prints, and the errors users see."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat
from kvlayout.tools.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_formats_lists_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "formats")
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split() == ["value", "name", "shape", "structure", "kv", "facts", "engines"]
    assert len(lines) == len(EngineKVFormat)
    assert lines[1].split()[:3] == ["1", "NL_X_TWO_NB_BS_NH_HS", "NL"]
    assert "deprecated, use NL_X_NB_NH_BS_CS" in lines[10]
    assert "NL x [NB, BSxVALS, BSxSCALES]" in lines[14]


def test_explain_in_words_and_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "NL_X_TWO_NB_BS_NH_HS", "--sizes", "NB=512")
    assert code == 0
    assert "  with sizes     32 x [2, 512, 16, 8, 128]" in out
    assert "    pointer = layer" in out
    assert "    offset  = kv·NB·BS·NH·HS + block·BS·NH·HS + token·NH·HS + head·HS + elem" in out
    assert "  per block      65536 bytes per layer (2 x 16 tokens x 2048 B)" in out
    assert "  per layer      33554432 bytes over 512 blocks" in out
    assert "contiguous runs of 32768 B" in out


def test_explain_by_value_and_any_layout_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "explain", "6")[1].startswith("NL_X_TWO_NB_NH_BS_HS\n")
    code, out, _ = run(capsys, "explain", "NL_X_NB_NH_BS_HS", "--dtype", "fp8")
    assert code == 0 and "    - Heads are outer to tokens inside a block." in out


def test_explain_svg_has_a_cell_per_row(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    svg = tmp_path / "block.svg"
    code, out, _ = run(capsys, "explain", "NL_X_TWO_NB_NH_BS_HS", "--svg", str(svg), "--sizes", "BS=3,NH=2")
    assert code == 0 and str(svg) in out
    root = ET.parse(svg).getroot()
    cells = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.get("class") == "cell"]
    assert len(cells) == 2 * 3 * 2  # (kv, token, head)
    assert {(c.get("data-kv"), c.get("data-token"), c.get("data-head")) for c in cells} == {
        (str(k), str(t), str(h)) for k in range(2) for t in range(3) for h in range(2)
    }
    offsets = [int(c.get("data-offset", "-1")) for c in cells]
    assert offsets == sorted(offsets)  # drawn in memory order
    # HND: one head's tokens are adjacent, so head 0's K rows come first.
    assert [(c.get("data-head"), c.get("data-token")) for c in cells[:3]] == [
        ("0", "0"),
        ("0", "1"),
        ("0", "2"),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "NL_X_FOO"], "kvlayout: format name 'NL_X_FOO': unknown token 'FOO'"),
        (["explain", "99"], "kvlayout: unknown engine KV format value 99"),
        (
            ["explain", "1", "--sizes", "NB"],
            "kvlayout: --sizes item 'NB' is not NAME=INT (for example NB=2048)",
        ),
        (["explain", "1", "--dtype", "int4"], "kvlayout: --dtype 'int4' is not one of"),
    ],
)
def test_errors_are_one_clear_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith(message)


def test_codegen_outside_a_checkout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "codegen", "--check")
    assert code == 2 and "kvlayout codegen runs inside a kvlayout checkout" in err


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("formats", "explain", "codegen", "demo"):
        assert command in out


def test_detect_prints_format_geometry_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "32x[2,2048,16,8,128]")
    assert code == 0
    assert "32 tensor(s) [2, 2048, 16, 8, 128] bf16 (meta tensors, no memory)" in out
    assert "    format     1 NL_X_TWO_NB_BS_NH_HS   NL x [2, NB, BS, NH, HS]" in out
    assert "    shape      32 x [2, 2048, 16, 8, 128]" in out
    assert "    geometry   block_size 16, heads 8, head_size 128, kv_size 2, torch.bfloat16" in out


def test_detect_follows_hints_and_hybrids(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "sglang", "--shape", "64x[4096,8,128]",
                       "--hint", "tokens_per_block=16", "--hint", "kv_list_layout=k_v")  # fmt: skip
    assert code == 0 and "9 TWO_X_NL_X_NB_BS_NH_HS" in out and "2 x 32 x [256, 16, 8, 128]" in out
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "6x[2,64,544,2,256]+18x[64,544,2000]")
    assert code == 0
    assert "  kernel groups 2" in out
    assert "  group 0: layers 0-5" in out and "    shape      6 x [2, 64, 544, 2, 256]" in out
    assert "  group 1: layers 6-23" in out and "    shape      18 x [64, 544, 2000]" in out


def test_detect_shows_the_error_a_user_would_get(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "sglang", "--shape", "64x[4096,8,128]")
    assert code == 1
    assert "  detection failed, as a user would see it:\n    DetectionError: SGLang:" in out
    assert "pass layout hint kv_list_layout='k_v'" in out


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("32x[7,4", "kvlayout: --shape '32x[7,4': expected ']', found 'the end'"),
        ("32[7]", "kvlayout: --shape '32[7]': a count must be followed by 'x'"),
        ("[2,3]+[4]", "kvlayout: --shape '[2,3]+[4]': '+' joins lists (NxSHAPE), not bare tensors"),
        ("0x[1]", "kvlayout: --shape '0x[1]': a list of 0 entries"),
        ("2x[2,]", "kvlayout: --shape '2x[2,]': expected a number, found ']'"),
        ("[a]", "kvlayout: --shape '[a]': expected a number, found 'a'"),
    ],
)
def test_detect_shape_errors(capsys: pytest.CaptureFixture[str], shape: str, message: str) -> None:
    code, _, err = run(capsys, "detect", "--engine", "vllm", "--shape", shape)
    assert code == 2 and err.startswith(message)


def test_detect_bad_hint_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--hint", "kv_layout"
    )
    assert code == 2 and "--hint 'kv_layout' is not KEY=VALUE" in err
    code, _, err = run(capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--dtype", "int4")
    assert code == 2 and "--dtype 'int4' is not one of" in err
    code, _, err = run(
        capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--hint", "kv_layout=XYZ"
    )
    assert code == 2 and "layout hint kv_layout='XYZ' is not one of" in err  # the command line's mistake


# -- the usual conveniences -----------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import kvlayout

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kvlayout {kvlayout.__version__}\n"


def test_json_for_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "formats", "--json")
    table = json.loads(out)
    assert code == 0 and len(table) == len(EngineKVFormat)
    assert table[14]["name"] == "NL_X_NB_BSV_BSS" and table[14]["engines"] == ["vllm", "sglang"]
    code, out, _ = run(capsys, "explain", "NL_X_NB_BSV_BSS", "--json")
    explained = json.loads(out)
    assert explained["concrete"] == [32, [2048, 16, 132]] and explained["leaf_strides"] == [2112, 132, 1]
    code, out, _ = run(
        capsys, "detect", "--engine", "vllm", "--shape", "4x[2,7,3,2,4]", "--hint", "kv_layout=NHD", "--json"
    )
    detected = json.loads(out)
    assert code == 0 and detected["kernel_groups"][0]["format"] == "NL_X_TWO_NB_BS_NH_HS"
    assert detected["kernel_groups"][0]["layers"] == [0, 1, 2, 3]
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "4x[3,3]", "--json")
    assert code == 1 and json.loads(out)["error"]["type"] == "DetectionError"


def test_hnd_caches_are_described_in_their_memory_order(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM hands its HND cache over as an NHD-shaped view: say so with @order."""
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "32x[2,2048,16,8,128]@0,1,3,2,4",
                       "--hint", "kv_layout=HND")  # fmt: skip
    assert code == 0
    assert "format     6 NL_X_TWO_NB_NH_BS_HS" in out
    assert "geometry   block_size 16, heads 8, head_size 128, kv_size 2" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["detect", "--engine", "vllm", "--shape", "4x[2,7"], "--shape is NxSHAPE (a list), [d0,d1,...]"),
        (["detect", "--engine", "vllm", "--shape", "4x[2,7]@0,0"], "@0,0 is not an order of the 2 dims 0..1"),
        (["detect", "--engine", "vllm", "--shape", "4x[2,7]", "--device", "foo"], "--device 'foo' is not a torch device"),
        (["detect", "--engine", "vllm", "--shape", "4x[2,7]", "--device", "cuda:7"], "no CUDA device"),
        (["detect", "--engine", "nope", "--shape", "4x[2,7]"], "unknown serving engine 'nope'"),
        (["explain", "1", "--sizes", "FOO=3"], "'FOO' is not a size token"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_engine_and_hint_spellings_ignore_case(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "detect", "--engine", "TRT-LLM", "--shape", "[7,5,2,2,3,4]", "--hint", "kv_layout=hnd"
    )
    assert code == 0 and "8 NB_NL_TWO_NH_BS_HS" in out


def test_zero_sizes_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "NL_X_NB_BS_HS", "--sizes", "NB=0")
    assert code == 0 and "  empty          NB=0: a cache of these sizes holds no data" in out


def test_labels_name_the_engine_that_detected(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "atom", "--shape", "2x[7,3,16]")
    assert code == 0 and "backend    ATOM MLA" in out
    code, out, _ = run(
        capsys, "detect", "--engine", "sglang", "--shape", "2x[7,3,16]", "--hint", "kv_list_layout=unified"
    )
    assert code == 0 and "backend    SGLang MLA (MP)" in out


def test_describe_prints_the_layout_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "describe", "12", "--sizes", "NL=3,NB=6,BS=4,NH=2,CS=8", "--block-stride", "192"
    )
    assert code == 0
    desc = json.loads(out)
    assert desc["name"] == "NL_X_NB_NH_BS_CS" and desc["grouping"] == "per_layer"
    assert desc["dims"] == [["B"], ["H"], ["N"], ["KV", "C"]] and desc["kv_placement"] == "inside dim 3"
    assert desc["strides"] == [192, 32, 8, 1] and desc["dim_strides"] == {"0": 192}
    assert desc["facts"]["is_hnd"] and desc["facts"]["is_fused_packed"]
    code, out, _ = run(capsys, "describe", "NB_KV_NL_BS_NH_HS")
    assert code == 0 and json.loads(out)["strides"] is None  # no sizes, no strides


def test_max_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "max", "--shape", "[2048,2,32,16,8,128]")
    assert code == 0
    assert "    format     19 NB_KV_NL_BS_NH_HS   [NB, KV, NL, BS, NH, HS]" in out
    assert "    geometry   block_size 16, heads 8, head_size 128, kv_size 2, torch.bfloat16" in out
    code, out, _ = run(capsys, "formats")
    assert "kv=KV" in out.splitlines()[20]  # after the header row


def test_explain_svg_to_a_path_that_cannot_be_written_exits_2_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(capsys, "explain", "1", "--svg", str(tmp_path / "missing" / "block.svg"))
    assert code == 2 and out == ""
    assert (
        err
        == f"kvlayout: --svg {tmp_path / 'missing' / 'block.svg'}: cannot write it (No such file or directory)\n"
    )
    code, _, err = run(capsys, "explain", "1", "--svg", str(tmp_path))  # a directory
    assert code == 2 and "cannot write it (Is a directory)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["1", "--sizes", "NB=4,BS=2,NH=2,HS=4", "--block-stride", "200"],
         "NL_X_TWO_NB_BS_NH_HS: dim 0 is not the block axis, so a block stride cannot apply"),
        (["19", "--sizes", "KV=2,NL=2,NB=4,BS=2,NH=2,HS=4", "--block-stride", "5"],
         "NB_KV_NL_BS_NH_HS: block stride 5 is smaller than a block's 64 elements (blocks would overlap)"),
        (["19", "--block-stride", "500"],
         "a block stride of 500 is checked against a block's elements, so it needs the block's sizes"),
    ],
)  # fmt: skip
def test_describe_checks_the_block_stride_as_the_descriptor_does(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run(capsys, "describe", *args)
    assert code == 2 and message in err and err.count("\n") == 1
    kv = [torch.zeros(2, 4, 2, 2, 4)]
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    if args[0] == "1":  # the descriptor refuses the same stride with the same words
        with pytest.raises(kvlayout.KVLayoutError, match=re.escape(message)):
            kvlayout.make_page_buffer_shape_desc(normalized, fmt, 0, 1, 4, 2, 200)


def test_describe_takes_a_block_stride_no_smaller_than_a_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "describe", "19", "--sizes", "KV=2,NL=2,NB=4,BS=2,NH=2,HS=4", "--block-stride", "64"
    )
    assert code == 0 and json.loads(out)["dim_strides"] == {"0": 64}


def test_explain_help_lists_every_short_dtype_name(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlayout.tools.explain import DTYPE_BYTES

    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    listed = re.search(r"--dtype DTYPE\s+element type for byte counts: ([\w,\s]+)", capsys.readouterr().out)
    assert listed is not None
    names = listed[1].split()
    assert names == ["bf16,", "fp16,", "fp32,", "fp8,", "fp8_e5m2,", "uint8,", "int8"]  # then the default
    # every name that is not torch's spelled-out one works
    short = [n for n in DTYPE_BYTES if not n.startswith(("float", "bfloat"))]
    assert sorted(n.rstrip(",") for n in names) == sorted(short)
    assert run(capsys, "explain", "1", "--dtype", "int8")[0] == 0


def test_fp8_e5m2_is_a_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "1", "--dtype", "fp8_e5m2")
    assert code == 0 and "1024 elements per token (1024 bytes of fp8_e5m2)" in out
    code, out, _ = run(
        capsys, "detect", "--engine", "vllm", "--shape", "2x[2,7,16,8,128]", "--dtype", "fp8_e5m2"
    )
    assert code == 0 and "torch.float8_e5m2" in out


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ("NB=99999999999999999999999", "--sizes 'NB=99999999999999999999999': a size is at most 2**31 - 1 = 2147483647"),
        ("NB=2147483648", "a size is at most 2**31 - 1"),
        ("NB=2147483647,BS=2147483647,NH=2147483647,HS=128",
         "--sizes make a NL_X_TWO_NB_BS_NH_HS tensor of 2535301196914683942490439941888 elements, more than "
         "int64 offsets address (2**63 - 1)"),
    ],
)  # fmt: skip
def test_absurd_sizes_are_refused(capsys: pytest.CaptureFixture[str], sizes: str, message: str) -> None:
    for command in ("explain", "describe"):
        code, _, err = run(capsys, command, "1", "--sizes", sizes)
        assert code == 2 and message in err and "Traceback" not in err


def test_a_table_of_two_billion_pointers_is_explained_without_building_it() -> None:
    """NL=2147483647 used to build every pointer path (minutes, then the OOM killer). In a
    subprocess with 4 GiB of address space, so code that builds them fails fast."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    done = subprocess.run(
        [sys.executable, "-m", "kvlayout", "explain", "1", "--sizes", f"NL={2**31 - 1}"],
        capture_output=True, text=True, timeout=120, check=False, preexec_fn=limit_memory,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(NL=3), ... (2147483643 more)" in done.stdout
    assert kvlayout.layout_of(1).pointer_order({"NL": 10**9}, limit=2) == [(0,), (1,)]


def test_a_picture_of_too_many_rows_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "explain", "1", "--sizes", "BS=100000", "--svg", str(tmp_path / "b.svg"))
    assert code == 2 and "these sizes make 400000 rows (at most 4096)" in err
    assert not (tmp_path / "b.svg").exists()


def test_detect_refuses_an_empty_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """NB=0 used to detect (a cache with no blocks, which no engine registers)."""
    code, out, err = run(capsys, "detect", "--engine", "vllm", "--shape", "32x[2,0,16,8,128]")
    assert code == 2 and out == ""
    assert err == (
        "kvlayout: --shape 32x[2,0,16,8,128]: [2, 0, 16, 8, 128] has a dim of size 0 (dim 1); a KV cache "
        "tensor is never empty (an engine never registers a cache without blocks, tokens or heads)\n"
    )


# -- plan --------------------------------------------------------------------------------------

PLAN_NHD_TP2 = ["--src-engine", "vllm", "--src-shape", "2x[2,8,4,2,8]", "--src-tp", "2"]
PLAN_HND_TP4 = ["--dst-engine", "vllm", "--dst-shape", "2x[2,8,4,1,8]@0,1,3,2,4", "--dst-hint", "kv_layout=HND",
                "--dst-tp", "4"]  # fmt: skip


def test_plan_prints_every_rank_pair(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--blocks", "consecutive"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (
        "plan: 10 tokens, consecutive block ids; src NL_X_TWO_NB_BS_NH_HS TP 2 (blocks of 4), dst "
        "NL_X_TWO_NB_NH_BS_HS TP 4 (blocks of 4); 4 KV heads; posted by dst; cost model: defaults"
    )
    # src rank 0 holds heads 0-1, dst rank 1 head 1: one head's 16-byte row a token, per layer and K/V;
    # 40 runs of 16 B go direct (over a real pair, READs of them direct 1.09 ms against staged's 1.17 ms,
    # medians of 60 taking turns: a staged plan's own work outweighs 40 descriptors)
    assert lines[3] == "  src rank 0 -> dst rank 1: head slice, re-laid; 40 runs, 640 bytes, mean run 16 B"
    assert lines[4].startswith("    READ: direct 40 descriptors, ") and lines[4].endswith("choice: direct")
    assert (
        lines[5]
        == "  src rank 0 -> dst rank 2: nothing to send (src holds model heads 0-1 and dst 2: none in common)"
    )
    assert len(lines) == 1 + 4 * 2 + 4


def test_plan_posted_by_the_source_weighs_the_peer_staged_write(capsys: pytest.CaptureFixture[str]) -> None:
    """TP 2 -> 1 in NHD: every decode row is half written by each prefill rank, so only the
    peer-staged WRITE (the prefill's own stretches into decode's staging) cuts the
    descriptors: one per layer and K/V of the consecutive blocks, not one per token. At
    this size (64 runs of 16 B) that does not pay, and direct is chosen: over a real pair,
    64 WRITEs of 16 B direct took 1.34 ms against 1.63 ms staged (medians of 60 taking
    turns), and a peer-staged plan adds the peer's copy to a staged plan's own work."""
    dst_nhd = ["--dst-engine", "vllm", "--dst-shape", "2x[2,8,4,4,8]"]
    code, out, _ = run(capsys, "plan", *PLAN_NHD_TP2, *dst_nhd, "--tokens", "16", "--blocks", "consecutive",
                       "--poster", "src", "--json")  # fmt: skip
    assert code == 0
    pairs = json.loads(out)["pairs"]
    assert [p["descriptors"] for p in pairs] == [{"direct": 64, "staged": 64, "peer-staged": 4}] * 2
    assert [(p["op"], p["choice"]) for p in pairs] == [("WRITE", "direct")] * 2
    code, out, _ = run(capsys, "plan", *PLAN_NHD_TP2, *dst_nhd, "--tokens", "16", "--blocks", "consecutive",
                       "--poster", "src")  # fmt: skip
    assert "WRITE: direct 64 descriptors, " in out and "; peer-staged 4 descriptors, " in out


def test_plan_says_the_stages_a_chosen_gather_runs_in(capsys: pytest.CaptureFixture[str]) -> None:
    """README's pair, 32 MiB a rank pair: the gather (prefill's staged WRITE, or its
    peer-staged gather before decode's READ) runs in a stage per 4 MiB by default."""
    src = ["--src-engine", "vllm", "--src-shape", "32x[2,2048,16,4,128]", "--src-tp", "2"]
    dst = ["--dst-engine", "vllm", "--dst-shape", "32x[2,512,64,2,128]@0,1,3,2,4", "--dst-hint", "kv_layout=HND",
           "--dst-tp", "4"]  # fmt: skip
    for poster, op, choice in (("dst", "READ", "peer-staged"), ("src", "WRITE", "staged")):
        code, out, _ = run(capsys, "plan", *src, *dst, "--tokens", "1024", "--poster", poster)
        assert code == 0
        line = out.splitlines()[2]
        assert line.startswith(f"    {op}: direct 131072 descriptors, ") and line.endswith(
            f"choice: {choice}, in 8 stages"
        )
        code, out, _ = run(capsys, "plan", *src, *dst, "--tokens", "1024", "--poster", poster, "--json")
        pair = json.loads(out)["pairs"][0]
        assert pair["stages"] == {"direct": 1, "staged": 8 if op == "WRITE" else 1,
                                  "peer-staged": 8 if op == "READ" else 1}  # fmt: skip


def test_plan_json_matches_a_map_of_real_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from kvlayout.registration.registration import bind
    from kvlayout.transfer import Shard, block_map
    from kvlayout.transfer.nixl import DEFAULT_READ_COST, default_cost

    code, out, _ = run(capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--json")
    assert code == 0
    plan = json.loads(out)
    assert [(p["src_rank"], p["dst_rank"]) for p in plan["pairs"]] == [
        (r, d) for r in range(2) for d in range(4)
    ]
    src = bind([torch.zeros(2, 8, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)], EngineKVFormat(1))
    dst = bind([torch.zeros(2, 8, 1, 4, 8, dtype=torch.bfloat16) for _ in range(2)], EngineKVFormat(6))
    ids = [int(b) for b in __import__("numpy").random.default_rng(0).permutation(8)[:3]]
    for p in plan["pairs"]:
        m = block_map(src, dst, ids, ids, num_tokens=10, src_shard=Shard(p["src_rank"], 2, 4),
                      dst_shard=Shard(p["dst_rank"], 4, 4))  # fmt: skip
        assert (p["runs"], p["bytes"], p["kind"]) == (m.num_runs, m.num_bytes, m.kind)
        if m.num_runs:
            assert p["descriptors"]["direct"] == m.num_runs and p["op"] == "READ"
            assert default_cost(p["op"]) is DEFAULT_READ_COST  # a READ is priced by the READs' figures
            assert p["predicted_s"]["direct"] == pytest.approx(
                DEFAULT_READ_COST.direct_s(m.num_runs, m.num_bytes)
            )


SGLANG_MHA = ["--src-engine", "sglang", "--src-shape", "2x2x[144,8,16]", "--src-hint", "tokens_per_block=16"]


def test_plan_of_sglang_into_vllm_0_33_views_matches_maps_of_real_tensors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SGLang's K and V lists at TP 1 into vLLM 0.33's per-layer ``[NB, NH, BS, 2*HS]``
    views of NHD memory at TP 2 (pd-connectors.md): written with their memory order the
    plan is the maps of real tensors; written without it the shape is contiguous memory,
    which reads as 32 heads of 4-token blocks, and the error names the missing '@'."""
    from kvlayout.transfer import Shard, block_map

    view = ["--dst-engine", "vllm", "--dst-hint", "kv_layout=LBNHC", "--dst-tp", "2", "--tokens", "40"]
    code, _, err = run(capsys, "plan", *SGLANG_MHA, *view, "--dst-shape", "2x[6,4,32,32]")
    assert code == 2 and "with 4 tokens a block" in err and "'[NB,NH,BS,C]@0,2,1,3'" in err
    code, out, _ = run(
        capsys,
        "plan",
        *SGLANG_MHA,
        *view,
        "--dst-shape",
        "2x[6,4,32,32]@0,2,1,3",
        "--blocks",
        "consecutive",
        "--json",
    )
    assert code == 0
    pairs = json.loads(out)["pairs"]
    pools = [
        torch.randn(144, 8, 16).to(torch.bfloat16) for _ in range(4)
    ]  # MHATokenToKVPool: k_buffer + v_buffer
    src = kvlayout.detect(pools, "sglang", {"kv_list_layout": "k_v", "tokens_per_block": 16})
    for p in pairs:
        layers = [torch.zeros(6, 32, 4, 32, dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(2)]
        dst = kvlayout.detect(layers, "vllm", {"kv_layout": "LBNHC"})
        m = block_map(src, dst, [0, 1, 2], [0, 1], num_tokens=40, dst_shard=Shard(p["dst_rank"], 2, 8))
        assert (p["runs"], p["bytes"], p["kind"]) == (m.num_runs, m.num_bytes, m.kind)
        m.copy()
        key = layers[1].transpose(1, 2)[..., :16]  # FlashAttention's key_cache, [NB, BS, NH, HS]
        rank_heads = slice(4 * p["dst_rank"], 4 * p["dst_rank"] + 4)
        assert torch.equal(key[1, 7], pools[1][16 * 2 + 7, rank_heads])  # token 39: vLLM block 1, slot 7


def test_plan_moves_the_kv_of_layers_that_share_it_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Layers sharing one KV cache (--src-share / --dst-share, as detect's --share): a
    destination layer that shares is written once, as its target, so its bytes drop out."""
    base = ["plan", "--src-engine", "vllm", "--src-shape", "4x[2,8,4,2,8]", "--dst-engine", "vllm",
            "--dst-shape", "4x[2,8,4,2,8]", "--tokens", "8", "--json"]  # fmt: skip
    plain = json.loads(run(capsys, *base)[1])
    code, out, _ = run(capsys, *base, "--src-share", "3=1", "--dst-share", "3=1")
    shared = json.loads(out)
    assert code == 0 and shared["dst"]["shared_layers"] == [[1, 3]] == shared["src"]["shared_layers"]
    assert shared["pairs"][0]["bytes"] * 4 == plain["pairs"][0]["bytes"] * 3
    code, _, err = run(capsys, *base, "--dst-share", "3=3")
    assert (code, err) == (
        2,
        "kvlayout: --dst-share 3=3: a layer shares another layer's KV cache, not its own\n",
    )


def test_plan_says_why_a_pair_cannot_be_served(capsys: pytest.CaptureFixture[str]) -> None:
    """The plan is printed in full, and exits 1 (as detect does for a registration it
    refuses): a pair that cannot be served is a deployment that cannot run."""
    code, out, _ = run(capsys, "plan", "--src-engine", "vllm", "--src-shape", "2x[8,4,16]", "--dst-engine", "vllm",
                       "--dst-shape", "2x[2,8,4,1,16]", "--tokens", "4", "--kv-heads", "1")  # fmt: skip
    assert code == 1
    assert out.splitlines()[1] == (
        "  src rank 0 -> dst rank 0: cannot be served: src holds one latent row per token (MLA) and dst K and V "
        "rows per head (MHA): they do not hold the same data"
    )


PLAN_MLA = [
    "--src-engine",
    "vllm",
    "--src-shape",
    "2x[16,8,64]",
    "--dst-engine",
    "vllm",
    "--dst-shape",
    "2x[8,8,64]",
]


def test_plan_pairs_decode_context_parallel_ranks_by_the_tokens_they_hold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Prefill TP 4 at DCP 2 into decode TP 2 at DCP 2, 8-token blocks interleaved whole: a
    decode rank takes its CP rank's tokens from one prefill rank of that CP rank (ranks 0
    and 2 hold CP rank 0's: they take turns by decode rank), nothing from the other CP rank."""
    cp = ["--src-tp", "4", "--src-dcp", "2", "--src-cp-interleave", "8", "--dst-tp", "2", "--dst-dcp", "2",
          "--dst-cp-interleave", "8"]  # fmt: skip
    code, out, _ = run(capsys, "plan", *PLAN_MLA, *cp, "--tokens", "40", "--json")
    assert code == 0
    pairs = {(p["src_rank"], p["dst_rank"]): p for p in json.loads(out)["pairs"]}
    # 40 tokens in blocks of 8, CP rank 0 holding 0-7, 16-23, 32-39: 3 blocks of 2 layers
    assert {k: (p["kind"], p["runs"], p["bytes"]) for k, p in pairs.items() if p["runs"]} == {
        (0, 0): ("same layout", 6, 3 * 8 * 2 * 64 * 2),
        (3, 1): ("same layout", 4, 2 * 8 * 2 * 64 * 2),
    }
    assert pairs[(2, 0)]["kind"] == "replica" and pairs[(1, 0)]["kind"] == "empty"
    code, out, _ = run(capsys, "plan", *PLAN_MLA, "--dst-tp", "4", "--dst-dcp", "4", "--tokens", "40")
    lines = out.splitlines()
    assert lines[0].startswith("plan: 40 tokens, scattered block ids; src NL_X_NB_BS_HS TP 1 (blocks of 8), dst "
                               "NL_X_NB_BS_HS TP 4 DCP 4 (interleave 1) (blocks of 8)")  # fmt: skip
    assert lines[1] == "  src rank 0 -> dst rank 0: token slice; 20 runs, 2560 bytes, mean run 128 B"


def test_plan_refuses_a_dcp_size_that_does_not_divide_the_tp_degree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "plan", *PLAN_MLA, "--dst-tp", "2", "--dst-dcp", "4", "--tokens", "8")
    assert code == 2
    assert err == (
        "kvlayout: --dst-dcp 4: a DCP size divides the TP degree (--dst-tp 2): vLLM's DCP ranks are TP ranks, "
        "rank r holding CP rank r % DCP's tokens\n"
    )


@pytest.mark.parametrize("dcp", [[], ["--src-dcp", "1"]])
def test_plan_refuses_a_cp_interleave_without_dcp(capsys: pytest.CaptureFixture[str], dcp: list[str]) -> None:
    """vLLM ignores cp_kv_cache_interleave_size without DCP; on the command line an interleave
    without its DCP size is a forgotten flag, so plan names both instead of planning without it."""
    code, out, err = run(capsys, "plan", *PLAN_MLA, *dcp, "--src-cp-interleave", "8", "--tokens", "8")
    assert code == 2 and out == ""
    assert err == (
        "kvlayout: --src-cp-interleave 8 without --src-dcp (or at --src-dcp 1): the interleave spreads tokens "
        "over DCP ranks; give --src-dcp SIZE, or leave --src-cp-interleave out\n"
    )
    code, _, _ = run(capsys, "plan", *PLAN_MLA, "--dst-cp-interleave", "1", "--tokens", "8")
    assert code == 0  # an interleave of 1 is vLLM's default: nothing forgotten


@pytest.mark.parametrize("interleave", ["3", "16"])
def test_plan_refuses_a_cp_interleave_that_does_not_divide_the_block_size(
    capsys: pytest.CaptureFixture[str], interleave: str
) -> None:
    """vLLM asserts at start-up (``VllmConfig.validate_block_size``, under DCP) that
    ``cp_kv_cache_interleave_size <= block_size`` and ``block_size % cp_kv_cache_interleave_size
    == 0``: plan built both sides and reported every rank pair's refusal of such an interleave
    (exit 1, as for a pair that cannot be served), though vLLM does not start such a
    deployment. It is a usage error naming the flag, the block
    size and vLLM's rule (blocks of 8 a side; 16 is above them, 3 divides no block)."""
    dcp = ["--dst-tp", "2", "--dst-dcp", "2", "--dst-cp-interleave", interleave]
    code, out, err = run(capsys, "plan", *PLAN_MLA, *dcp, "--tokens", "40")
    assert code == 2 and out == ""
    assert err == (
        f"kvlayout: --dst-cp-interleave {interleave} does not divide --dst-shape's blocks of 8 tokens: vLLM "
        "requires a block size that is a multiple of cp_kv_cache_interleave_size "
        "(VllmConfig.validate_block_size); give an interleave that divides 8\n"
    )
    dcp = ["--src-tp", "2", "--src-dcp", "2"]
    for divisor in ("4", "8"):  # a divisor plans every pair
        code, out, _ = run(capsys, "plan", *PLAN_MLA, *dcp, "--src-cp-interleave", divisor, "--tokens", "40")
        assert code == 0 and "cannot be served" not in out
    code, _, err = run(capsys, "plan", *PLAN_MLA, *dcp, "--src-cp-interleave", "6", "--tokens", "40")
    assert code == 2 and err.startswith(
        "kvlayout: --src-cp-interleave 6 does not divide --src-shape's blocks of 8"
    )


def test_plan_refuses_a_request_larger_than_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "40")
    assert code == 2
    assert err == "kvlayout: --tokens needs 10 blocks of the src cache, which has 8\n"


# -- bounds: every bad value is one line and exit 2, never a traceback, a hang or runaway memory ------

DEEP = "2x" + "(" * 3000 + "[2,4,16,8,128]" + ")" * 3000


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("32x[2,9223372036854775807,16,8,128]",
         "--shape 32x[2,9223372036854775807,16,8,128]: dim 1 of [2, 9223372036854775807, 16, 8, 128] is "
         "9223372036854775807, more than 2**32 - 1 = 4294967295 (no KV cache axis comes near)"),
        ("32x[2,99999999999999999999,16,8,128]", "dim 1 of [2, 99999999999999999999, 16, 8, 128] is 999"),
        ("[" + ",".join(["2"] * 70) + "]", "a tensor of 70 dims; a KV cache tensor has at most 16"),
        ("[" + ",".join(["1"] * 30000) + "]", "--shape is 60001 characters, more than 10000"),
        (DEEP, "... (6016 characters): lists and tuples nest 3001 deep; a registration nests at most 8"),
        ("100000000x[2,2048,16,8,128]",
         "--shape 100000000x[2,2048,16,8,128]: its lists hold 100000000 entries in all; a registration has "
         "at most 65536 tensors"),
        ("1000x1000x1000x[2,4,16,8,128]",
         "--shape 1000x1000x1000x[2,4,16,8,128]: 1000000000 tensors; a registration has at most 65536"),
        ("[100000,100000,100000]",
         "[100000, 100000, 100000] bf16 is 2000000000000000 bytes, more than 2**48 (256 TiB"),
        ("[\u0663,4]", "--shape [\u0663,4]: '\u0663' (character 1) is not ASCII; the notation is the digits 0-9"),
        ("[2," + "9" * 5000 + "]", "--shape: a number of 5000 digits (999999999999...) is no dim"),
    ],
)  # fmt: skip
def test_detect_refuses_shapes_beyond_bounds(
    capsys: pytest.CaptureFixture[str], shape: str, message: str
) -> None:
    """Torch used to fail on these (int64 overflow, a 12-line C++ stack), or the parser
    recursed 3,000 deep, or a billion tensors were walked (minutes, then MemoryError)."""
    code, out, err = run(capsys, "detect", "--engine", "vllm", "--shape", shape)
    assert (code, out) == (2, "") and message in err and err.count("\n") == 1


def test_detect_takes_the_bounds_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "256x256x[2,4,16,8,128]", "--json")
    assert code == 1 and json.loads(out)["tensors"] == 2**16  # detection refuses the depth, not the CLI
    code, _, err = run(capsys, "detect", "--engine", "vllm", "--shape", "257x256x[2,4,16,8,128]")
    assert (code, err) == (
        2,
        "kvlayout: --shape 257x256x[2,4,16,8,128]: 65792 tensors; a registration has at most 65536\n",
    )
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", f"2x[2,{2**32 - 1},16,8,128]")
    assert code == 0 and f"shape      2 x [2, {2**32 - 1}, 16, 8, 128]" in out


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cpu:99", "kvlayout: --device cpu:99: there is one cpu device; write cpu\n"),
        ("meta:3", "kvlayout: --device meta:3: there is one meta device; write meta\n"),
    ],
)
def test_detect_devices_with_an_index_there_is_not(
    capsys: pytest.CaptureFixture[str], device: str, message: str
) -> None:
    code, _, err = run(capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--device", device)
    assert (code, err) == (2, message)
    code, out, _ = run(capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--device", "cpu:0")
    assert code == 0 and "allocated on cpu" in out


def test_detect_devices_torch_names_but_kvlayout_does_not_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--device"]
    code, _, err = run(capsys, *argv, "xla")
    assert (code, err) == (2, "kvlayout: --device xla: kvlayout serves meta, cpu and cuda tensors\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, *argv, "cuda")
    assert (code, err) == (
        2,
        "kvlayout: --device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)\n",
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = run(capsys, *argv, "cuda:2")
    assert (code, err) == (
        2,
        "kvlayout: --device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1\n",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["2x[2,4,4,1,8]", "--share", "1"], "kvlayout: --share '1' is not SHARER=TARGET (for example 4=2)\n"),
        (["2x[2,4,4,1,8]", "--share", "1=x"], "kvlayout: --share '1=x' is not SHARER=TARGET (for example 4=2)\n"),
        (["[2,4,4,1,8]", "--share", "1=0"],
         "kvlayout: --share needs a list of layers (--shape NxSHAPE), not one tensor\n"),
    ],
)  # fmt: skip
def test_detect_share_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run(capsys, "detect", "--engine", "vllm", "--shape", *args)
    assert (code, out, err) == (2, "", message)


def test_detect_says_when_the_device_cannot_hold_the_registration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 1024 bytes.\nframe #0: c10::..."
        )

    monkeypatch.setattr(torch, "empty", refuse)
    code, out, err = run(capsys, "detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--device", "cpu")
    assert (code, out) == (2, "")
    assert err == (
        "kvlayout: --device cpu: cannot allocate --shape 2x[2,4,4,1,8] (2 tensor(s), 1024 bytes in all): "
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 1024 bytes.\n"
    )


PLAN_BASE = ["plan", "--src-engine", "vllm", "--src-shape", "2x[2,8,4,4,8]", "--dst-engine", "vllm",
             "--dst-shape", "2x[2,8,4,4,8]"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "0"], "--tokens 0: a request holds 1 to 2**24 = 16777216 tokens"),
        (["--tokens", "16777217"], "--tokens 16777217: a request holds 1 to 2**24"),
        (["--tokens", "4", "--kv-heads", "99999999999999999999"],
         "--kv-heads 99999999999999999999: a model has 1 to 65536 KV heads"),
        (["--tokens", "4", "--kv-heads", "-4"], "--kv-heads -4: a model has 1 to 65536 KV heads"),
        (["--tokens", "4", "--src-tp", "1000000000000000000000000"],
         "--src-tp 1000000000000000000000000: a TP degree is 1 to 1024"),
        (["--tokens", "4", "--dst-tp", "0"], "--dst-tp 0: a TP degree is 1 to 1024"),
        (["--tokens", "4", "--src-tp", "1000", "--dst-tp", "1000"],
         "--src-tp 1000 and --dst-tp 1000 make 1000000 rank pairs, one block map each; plan at most 4096"),
        (["--tokens", "4", "--dst-tp", "3"],
         "--dst-tp 3 does not split the model's 4 KV heads (src 4 x --src-tp 1): TP splits the heads evenly"),
        (["--tokens", "4", "--src-tp", "2"],
         "--dst-tp 1 gives each dst rank 8 of the model's 8 KV heads (src 4 x --src-tp 2), but --dst-shape "
         "holds 4 a rank"),
        (["--tokens", "4", "--kv-heads", "6"],
         "--src-tp 1 gives each src rank 6 of --kv-heads 6, but --src-shape holds 4 a rank, read as "
         "NL_X_TWO_NB_BS_NH_HS with 4 tokens a block (where the engine reads one, --src-hint kv_layout=NHD or "
         "HND says which axis holds the heads; a shape is contiguous memory unless '@' gives its dims' memory "
         "order: a view [NB,NH,BS,C] of NHD memory, as vLLM 0.33 hands each layer, is '[NB,NH,BS,C]@0,2,1,3')\n"),
        (["--tokens", "3", "--src-shape", "3x[2,7,3,2,4]+2x[7,3,4]"],
         "--src-shape 3x[2,7,3,2,4]+2x[7,3,4]: 2 kernel groups; plan maps one kernel group a side"),
        (["--tokens", "4", "--dst-engine", "nope"], "--dst-engine: unknown serving engine 'nope'"),
        (["--tokens", "4", "--dst-shape", "4097x[2,8,4,4,8]"], "--dst-shape: 4097 layers; plan maps at most 4096"),
        (["--tokens", "4", "--src-shape", "512x[2,8,4,1,8]", "--dst-shape", "512x[2,8,4,1,8]", "--src-tp", "64",
          "--dst-tp", "64"],
         "--src-tp 64 and --dst-tp 64 over 512 layers make 2097152 layer maps (layers x rank pairs), more than "
         "2**20 = 1048576; plan fewer ranks"),
        (["--tokens", "1048576", "--src-shape", "32x[2,65536,16,1,8]", "--dst-shape", "32x[2,65536,16,1,8]",
          "--src-tp", "16", "--dst-tp", "16", "--kv-heads", "16"],
         "--tokens 1048576 of 32 layers over 16 rank pair(s) that exchange heads make 536870912 token rows to "
         "map, more than 2**28 = 268435456; plan fewer tokens or ranks"),
        (["--tokens", "4", "--dst-hint", "kv_layout=XYZ"], "--dst-hint: layout hint kv_layout='XYZ' is not one"),
        (["--tokens", "4", "--first-token", "5"], "--first-token 5: it is 0 to --tokens 4"),
        (["--tokens", "4", "--first-token", "-1"], "--first-token -1: it is 0 to --tokens 4"),
        (["--tokens", "4", "--src-shape", "2x[3,8,4,4,8]"],
         "--src-shape: detection refuses it: vLLM: the registration (kv_caches[0]: shape (3, 8, 4, 4, 8), dtype "
         "torch.bfloat16, in a list of 2) fits no vLLM format"),
        (["--tokens", "4", "--src-shape", "512x[2,536870912,16,4,2048]"],  # 512 tensors of 2**48 bytes
         "--src-shape: plan describes it as a peer would, and cannot: description.groups[0].planes[0]."
         "addresses[511]=0x1ff0100001ff000: its tensor ends at 0x2000100001ff000, past 2**57"),
    ],
)  # fmt: skip
def test_plan_numbers_out_of_range(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    """Huge heads or TP degrees used to overflow (OverflowError traceback), 1000 x 1000 ranks
    to build a million block maps, and TP degrees that cannot split the heads to print a
    plan of pairs that cannot be served, exit 0."""
    code, out, err = run(capsys, *PLAN_BASE, *args)
    assert (code, out) == (2, "") and err.startswith(f"kvlayout: {message}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("dst_shape", "message"),
    [
        ("2x[2,0,4,4,8]", "--dst-shape 2x[2,0,4,4,8]: [2, 0, 4, 4, 8] has a dim of size 0 (dim 1)"),
        ("2x[2,1000000000000,4,4,8]",
         "--dst-shape 2x[2,1000000000000,4,4,8]: dim 1 of [2, 1000000000000, 4, 4, 8] is 1000000000000, more "
         "than 2**32 - 1"),
        ("2x[2,8", "--dst-shape '2x[2,8': expected ']', found 'the end'"),
    ],
)  # fmt: skip
def test_plan_shape_errors_name_the_side(
    capsys: pytest.CaptureFixture[str], dst_shape: str, message: str
) -> None:
    """These used to come out in a peer description's words (``description.groups[0].planes[0]
    .sizes.NB=0 is outside [1, 4294967296)``)."""
    argv = [*PLAN_BASE[:-1], dst_shape, "--tokens", "4"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith(f"kvlayout: {message}")


def test_plan_asks_for_the_block_size_of_a_folded_page_axis(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's [tokens, heads, head size] cache has no block axis: plan used to leak
    "'>' not supported between instances of 'int' and 'NoneType'"."""
    argv = ["plan", "--src-engine", "sglang", "--src-shape", "2x2x[64,4,8]", "--dst-engine", "vllm",
            "--dst-shape", "2x[2,8,4,4,8]", "--tokens", "16"]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert (code, err) == (
        2,
        "kvlayout: --src-shape 2x2x[64,4,8]: the sglang cache folds blocks and tokens into one axis (NB*BS), "
        "so plan cannot tell its blocks: give --src-hint tokens_per_block=N (the engine's page size)\n",
    )
    code, out, _ = run(capsys, *argv, "--src-hint", "tokens_per_block=4", "--json")
    assert code == 0 and json.loads(out)["src"]["block_size"] == 4


def test_plan_scattered_block_ids_do_not_build_the_pool() -> None:
    """A pool of 2**31 - 1 blocks used to be permuted whole (16 GiB) to pick one block."""
    import numpy as np

    from kvlayout.tools.plan_command import _block_ids

    ids = _block_ids("scattered", 5000, 2**31 - 1, "src")
    assert len(set(ids.tolist())) == 5000 and ids.min() >= 0 and ids.max() < 2**31 - 1
    assert ids.tolist() == _block_ids("scattered", 5000, 2**31 - 1, "src").tolist()  # repeatable
    assert ids.tolist() != sorted(ids.tolist())  # scattered, not sorted
    small = _block_ids("scattered", 3, 8, "src")  # a large share of a small pool: a permutation of it
    assert small.tolist() == np.random.default_rng(0).permutation(8)[:3].tolist()
    assert _block_ids("consecutive", 3, 8, "src").tolist() == [0, 1, 2]


def test_plan_out_of_memory_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvlayout.transfer

    def no_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(kvlayout.transfer, "block_map", no_memory)
    code, out, err = run(capsys, *PLAN_BASE, "--tokens", "16")
    assert (code, out) == (2, "")
    assert err == (
        "kvlayout: --tokens 16: the block maps of this plan need more memory than this machine gives; plan "
        "fewer tokens\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "1", "--sizes", "NB=4,NB=8"], "kvlayout: --sizes gives NB twice ('NB=4' and 'NB=8')\n"),
        (["explain", "1", "--sizes", "NBBS=4,PBS=8"], "kvlayout: --sizes gives NBBS twice ('NBBS=4' and 'PBS=8')\n"),
        (["explain", "1", "--sizes", "NB=\u0663"],
         "kvlayout: --sizes item 'NB=\u0663' is not NAME=INT (for example NB=2048)\n"),
        (["explain", "1", "--sizes", "NB=" + "9" * 5000], "a size is at most 2**31 - 1 = 2147483647"),
        (["explain", "9" * 5000], "kvlayout: unknown engine KV format value 9999"),
        (["describe", "19", "--sizes", "KV=2,NL=2,NB=4,BS=2,NH=2,HS=4", "--block-stride", str(10**26)],
         f"kvlayout: --block-stride {10**26}: more elements than int64 offsets address (2**63 - 1)\n"),
        (["describe", "19", "--sizes", "KV=2,NL=2,NB=4,BS=2,NH=2,HS=4", "--block-stride", str(2**62)],
         f"kvlayout: --block-stride {2**62}: 4 blocks that far apart span {3 * 2**62 + 64} elements, more than "
         "int64 offsets address (2**63 - 1)\n"),
        (["detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--hint", "tokens_per_block=" + "9" * 5000],
         "kvlayout: --hint tokens_per_block: a value of 5000 digits is no layout hint\n"),
        (["detect", "--engine", "vllm", "--shape", "2x[2,4,4,1,8]", "--share", "9" * 5000 + "=1"],
         "the registration has 2 entries, not 9999"),
    ],
)  # fmt: skip
def test_numbers_beyond_any_size_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """5000 digits used to end in Python's ValueError (more than 4300 digits to convert);
    other scripts' digits were read as numbers; a size given twice, the last one won."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_bad_values_stay_bounded_in_a_small_address_space() -> None:
    """The values that used to hang or exhaust memory, in one subprocess of 8 GiB of
    address space: each answers at once. A 32 GiB registration on the CPU is refused by the
    allocator, in one line."""
    script = """if True:
        import json, sys
        from kvlayout.tools.cli import main
        cases = [
            ["detect", "--engine", "vllm", "--shape", "100000000x[2,2048,16,8,128]"],
            ["detect", "--engine", "vllm", "--shape", "1000x1000x1000x[2,4,16,8,128]"],
            ["detect", "--engine", "vllm", "--shape", "64x[2,8192,16,8,128]", "--device", "cpu"],
            ["plan", "--src-engine", "vllm", "--src-shape", "32x[2,2147483647,16,4,128]", "--dst-engine",
             "vllm", "--dst-shape", "32x[2,2147483647,16,4,128]", "--tokens", "16", "--json"],
        ]
        print(json.dumps([main(argv) for argv in cases]), file=sys.stderr)
    """

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=limit_memory,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert json.loads(lines[-1]) == [2, 2, 2, 0]
    assert "cannot allocate --shape 64x[2,8192,16,8,128] (64 tensor(s), 34359738368 bytes in all)" in lines[2]
    assert json.loads(done.stdout)["src"]["num_blocks"] == 2**31 - 1


def test_plan_holds_max_latents_whole_on_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """MAX registers MLA with one plane of one head (kv_dim=1): latents, which no TP
    degree splits, as vLLM's MLA on the other side."""
    code, out, err = run(capsys, "plan", "--src-engine", "max", "--src-shape", "[64,1,4,16,1,576]",
                         "--src-hint", "kv_dim=1", "--src-hint", "layout_format=NB_KV_NL_BS_NH_HS", "--src-tp", "3",
                         "--dst-engine", "vllm", "--dst-shape", "4x[64,16,576]", "--dst-tp", "2", "--tokens", "40",
                         "--blocks", "consecutive")  # fmt: skip
    assert (code, err) == (0, "")
    assert "src rank 1 -> dst rank 1: re-laid; 12 runs" in out
    # every src rank holds the latents: one sends them to each dst rank
    assert (
        "src rank 2 -> dst rank 1: nothing to send (src rank 1 holds the same latents and sends them" in out
    )
    assert out.count("re-laid; 12 runs") == 2


def test_plan_sends_latents_from_one_rank_whatever_kv_heads_says(capsys: pytest.CaptureFixture[str]) -> None:
    """With --kv-heads given, an MLA plan read the heads count, not the latents: every src
    rank sent the latents to every dst rank."""
    code, out, _ = run(capsys, "plan", "--src-engine", "vllm", "--src-shape", "4x[64,16,576]", "--src-tp", "2",
                       "--dst-engine", "vllm", "--dst-shape", "4x[64,16,576]", "--dst-tp", "2", "--tokens", "40",
                       "--kv-heads", "8", "--json")  # fmt: skip
    assert code == 0
    sending = [(p["src_rank"], p["dst_rank"]) for p in json.loads(out)["pairs"] if p["runs"]]
    assert sending == [(0, 0), (1, 1)]


def test_plan_sends_replicated_heads_from_one_replica(capsys: pytest.CaptureFixture[str]) -> None:
    """4 src ranks over 2 heads hold each head twice: both replicas were planned to send
    it, twice the traffic and two writers of the same bytes."""
    code, out, _ = run(capsys, "plan", "--src-engine", "vllm", "--src-shape", "2x[2,8,4,1,8]", "--src-tp", "4",
                       "--dst-engine", "vllm", "--dst-shape", "2x[2,8,4,1,8]", "--dst-tp", "2", "--kv-heads", "2",
                       "--tokens", "10", "--json")  # fmt: skip
    assert code == 0
    pairs = {(p["src_rank"], p["dst_rank"]): p for p in json.loads(out)["pairs"]}
    assert [k for k, p in pairs.items() if p["runs"]] == [(0, 0), (2, 1)]  # dst d reads src d * 4 // 2's
    assert (pairs[1, 0]["kind"], pairs[1, 0]["bytes"]) == ("replica", 0)
    assert pairs[1, 0]["reason"].startswith("src rank 0 holds the same heads and sends them")
    assert pairs[0, 1]["kind"] == "empty"  # no head in common says so, not that another replica sends


# A Qwen3-Next-like hybrid's attention group as vLLM 0.33 registers it: FlashInfer pages of
# 16 tokens, 3 to a 48-token scheduler block at TP 2; pages of 32, whole blocks, at TP 4
PAGED_TP2 = ["--src-engine", "vllm", "--src-shape", "2x[72,1,16,128]@0,2,1,3", "--src-hint", "kv_layout=LBNHC",
             "--src-tp", "2"]  # fmt: skip
BLOCKS_TP4 = ["--dst-engine", "vllm", "--dst-shape", "2x[24,1,32,128]@0,2,1,3", "--dst-hint", "kv_layout=LBNHC",
              "--dst-tp", "4", "--kv-heads", "2"]  # fmt: skip


def test_plan_notes_one_head_only_where_the_other_side_could_be_latents(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A GQA model of 8 KV heads at TP 2 (4 heads a rank) into TP 8 (one head a rank): the
    decode side's ``[NB, 1, BS, C]`` is a head, since the prefill side, the same model,
    holds 4; the note asking whether it is MLA latents was printed on it all the same.
    Where the other side could be latents (read as latents, or one head as well) it stays."""
    view = "4x[64,{},16,256]@0,2,1,3"
    gqa = ["--src-engine", "vllm", "--src-shape", view.format(4), "--src-tp", "2",
           "--dst-engine", "vllm", "--dst-shape", view.format(1), "--dst-tp", "8", "--tokens", "20"]  # fmt: skip
    code, out, _ = run(capsys, "plan", *gqa, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["kv_heads"] == 8
    assert plan["src"]["note"] is plan["dst"]["note"] is None
    code, out, _ = run(capsys, "plan", *gqa)
    assert code == 0 and "note:" not in out
    note = (
        "--dst-shape read as one KV head of K and V a rank (NL_X_NB_BS_NH_CS), planned by heads; an MLA "
        "model's latents have this shape too: give --dst-hint kv_dim=1 for them"
    )
    latents = ["--src-engine", "vllm", "--src-shape", view.format(1), "--src-hint", "kv_dim=1", "--src-tp", "2",
               "--dst-engine", "vllm", "--dst-shape", view.format(1), "--dst-tp", "2", "--tokens", "20"]  # fmt: skip
    code, out, _ = run(capsys, "plan", *latents, "--json")
    plan = json.loads(out)
    assert code == 1 and (plan["src"]["note"], plan["dst"]["note"]) == (None, note)  # refused, and says why
    one_head = [*gqa[:3], view.format(1), *gqa[4:]]  # both one head a rank: either could be latents
    code, out, _ = run(capsys, "plan", *one_head, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dst"]["note"] == note
    assert plan["src"]["note"] == note.replace("--dst-", "--src-")


def test_plan_row_budget_counts_every_pair_of_latents_whatever_kv_heads_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Latents are whole on every rank, so every rank pair maps every token row (one
    replica then sends them); with ``--kv-heads`` the budget counted only the pairs whose
    heads overlap (4 of these 8), admitting twice the rows it says it bounds."""
    mla = ["--src-engine", "vllm", "--src-shape", "8x[1048576,1,16,576]", "--src-hint", "kv_dim=1", "--src-tp",
           "2", "--dst-engine", "vllm", "--dst-shape", "8x[1048576,1,16,576]", "--dst-hint", "kv_dim=1",
           "--dst-tp", "4", "--tokens", "16777216"]  # fmt: skip
    message = (
        "kvlayout: --tokens 16777216 of 8 layers over 8 rank pair(s) that map every row make 1073741824 token "
        "rows to map, more than 2**28 = 268435456; plan fewer tokens or ranks\n"
    )
    for kv_heads in ([], ["--kv-heads", "4"], ["--kv-heads", "8"]):
        assert run(capsys, "plan", *mla, *kv_heads) == (2, "", message)
    # heads count only the pairs that share one (the rows of the others are not mapped)
    gqa = [a.replace("576", "256").replace("kv_dim=1", "kv_layout=NHD") for a in mla]
    code, _, err = run(capsys, "plan", *gqa, "--kv-heads", "2")
    assert code == 2 and "over 4 rank pair(s) that exchange heads make 536870912 token rows" in err


def test_plan_takes_the_scheduler_s_blocks_over_kernel_pages(capsys: pytest.CaptureFixture[str]) -> None:
    """``--src-block-size``: block ids in the scheduler's blocks of 48 over kernel pages of 16,
    as block_map's ``src_block_size`` reads them (each id three pages, in order)."""
    import numpy as np

    from kvlayout.transfer import Shard, block_map

    args = [*PAGED_TP2, *BLOCKS_TP4, "--tokens", "299", "--json"]
    code, out, _ = run(capsys, "plan", *args, "--src-block-size", "48")
    assert code == 0
    plan = json.loads(out)
    assert (plan["src"]["block_size"], plan["src"]["num_blocks"], plan["dst"]["block_size"]) == (48, 24, 32)
    pages = [torch.zeros(72, 16, 1, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(2)]
    blocks = [torch.zeros(24, 32, 1, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(2)]
    src = kvlayout.detect(pages, "vllm", {"kv_layout": "LBNHC"})
    dst = kvlayout.detect(blocks, "vllm", {"kv_layout": "LBNHC"})
    src_ids = np.random.default_rng(0).permutation(24)[:7]  # plan's scattered ids: 7 blocks of 48
    dst_ids = np.random.default_rng(0).permutation(24)[:10]
    moved = [p for p in plan["pairs"] if p["runs"]]
    assert [(p["src_rank"], p["dst_rank"]) for p in moved] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for p in moved:
        m = block_map(src, dst, src_ids, dst_ids, num_tokens=299, src_shard=Shard(p["src_rank"], 2, 2),
                      dst_shard=Shard(p["dst_rank"], 4, 2), src_block_size=48)  # fmt: skip
        assert (p["runs"], p["bytes"], p["kind"]) == (m.num_runs, m.num_bytes, m.kind)
    paged = json.loads(run(capsys, "plan", *args)[1])  # in the kernel's pages: other ids, more runs
    assert paged["src"]["block_size"] == 16 and paged["pairs"][0]["runs"] > plan["pairs"][0]["runs"]


@pytest.mark.parametrize("size", ["40", "0", "1168"])
def test_plan_refuses_a_block_size_that_is_not_the_cache_s_blocks(
    capsys: pytest.CaptureFixture[str], size: str
) -> None:
    code, _, err = run(capsys, "plan", *PAGED_TP2, *BLOCKS_TP4, "--tokens", "299", "--src-block-size", size)
    assert code == 2
    assert f"--src-block-size {size}: block ids in blocks of a multiple of the 16 tokens" in err
    assert "at most all 72 of them" in err


def test_plan_moves_only_the_tokens_from_first_token_on(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--first-token", "6")
    assert code == 0 and out.startswith("plan: 10 tokens (moving 6 on), ")
    code, out, _ = run(
        capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--json", "--first-token", "6"
    )
    whole = json.loads(run(capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--json")[1])
    tail = json.loads(out)
    assert tail["first_token"] == 6
    moved = [
        (p["bytes"], w["bytes"]) for p, w in zip(tail["pairs"], whole["pairs"], strict=True) if w["bytes"]
    ]
    assert moved and all(part * 10 == all_ * 4 for part, all_ in moved)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_one_line_not_a_traceback() -> None:
    """`> /dev/full` printed a traceback and exited 1, the code of a refused detection."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kvlayout", "formats"], stdout=full, stderr=subprocess.PIPE, text=True,
            timeout=120, check=False,
        )  # fmt: skip
    assert (done.returncode, done.stderr) == (
        2,
        "kvlayout: cannot write the output: No space left on device\n",
    )
    head = subprocess.run(  # a reader that leaves early is no error
        f"{sys.executable} -m kvlayout formats | head -1", shell=True, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert head.stderr == "" and head.stdout.startswith("value")


def test_plan_of_mla_latents_as_the_readme_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """README's MLA pair, as vLLM 0.33 registers the latents (``[NB, 1, BS, C]``): with
    ``kv_dim=1`` every decode rank reads the whole latents from one prefill rank; without it
    they were planned as 8 KV heads, each decode rank a head slice of a one-head cache."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "kvlayout plan" in x and "kv_dim=1" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    head, *pairs = out.splitlines()
    assert (
        "src NL_X_NB_BS_HS TP 8 (blocks of 64), dst NL_X_NB_BS_HS TP 16 (blocks of 64); latent KV heads"
        in head
    )
    sends = [p for p in pairs if p.startswith("  src rank") and "nothing to send" not in p]
    assert len(sends) == 16  # one prefill rank for each decode rank
    assert all(
        "same layout; 244 runs, 15616000 bytes" in p for p in sends
    )  # 4 blocks x 61 layers, 250 x 1 KiB x 61
    code, out, _ = run(capsys, *[a for a in argv if a not in ("--src-hint", "--dst-hint", "kv_dim=1")])
    assert code == 0 and "8 KV heads" in out.splitlines()[0]
    assert out.splitlines()[1:3] == [  # planned by heads, as a one-head model is; not silently
        f"  note: --{where}-shape read as one KV head of K and V a rank (NL_X_NB_BS_NH_CS), planned by "
        f"heads; an MLA model's latents have this shape too: give --{where}-hint kv_dim=1 for them"
        for where in ("src", "dst")
    ]


def test_plan_json_says_a_one_head_side_could_be_latents(capsys: pytest.CaptureFixture[str]) -> None:
    """A one-KV-head side (a GQA model at TP = KV heads, or vLLM's MLA latents without
    ``kv_dim=1``) is planned by heads, not refused, and ``--json`` says so in ``note``;
    a side of several heads, or one the hint reads as latents, has none."""
    one_head = ["--src-engine", "vllm", "--src-shape", "2x[8,1,16,256]", "--src-tp", "2",
                "--dst-engine", "vllm", "--dst-shape", "2x[8,1,16,256]", "--dst-tp", "2"]  # fmt: skip
    code, out, _ = run(capsys, "plan", *one_head, "--tokens", "20", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["kv_heads"] == 2
    assert plan["src"]["note"] == (
        "--src-shape read as one KV head of K and V a rank (NL_X_NB_BS_NH_CS), planned by heads; an MLA "
        "model's latents have this shape too: give --src-hint kv_dim=1 for them"
    )
    assert plan["dst"]["note"] == plan["src"]["note"].replace("--src-", "--dst-")
    hinted = [*one_head, "--src-hint", "kv_dim=1", "--dst-hint", "kv_dim=1"]
    code, out, _ = run(capsys, "plan", *hinted, "--tokens", "20", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["kv_heads"] is None and plan["src"]["note"] is plan["dst"]["note"] is None
    code, out, _ = run(capsys, "plan", *PLAN_NHD_TP2, *PLAN_HND_TP4, "--tokens", "10", "--json")
    assert code == 0 and json.loads(out)["src"]["note"] is json.loads(out)["dst"]["note"] is None


# -- plan: Mamba state ------------------------------------------------------------------------
# Qwen3-Next-80B's Gated DeltaNet: 16 key heads and 32 value heads of 128, conv kernel 4;
# vLLM 0.33 registers each of its 36 GDN layers as one int8 [NB, 1, 1, PAGE] view, the page
# padded up to the attention page (557056 bytes at TP 2, 278528 at TP 4)
GDN = {"num_k_heads": 16, "num_v_heads": 32, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel_size": 4}


def _vllm_gdn_shapes(tp: int, dim_first: bool) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """vLLM 0.33's ``MambaStateShapeCalculator.gated_delta_net_state_shape`` at ``tp``
    (``vllm/model_executor/layers/mamba/mamba_utils.py``; its module imports vLLM's
    distributed runtime, so transcribed): the conv state (Q | K | V dim / TP, kernel - 1)
    oriented by ``VLLM_SSM_CONV_STATE_LAYOUT`` ("DS": dim first), the temporal state
    (value heads / TP, head_v_dim, head_k_dim)."""
    dim = GDN["head_k_dim"] * GDN["num_k_heads"] * 2 + GDN["head_v_dim"] * GDN["num_v_heads"]
    rows = GDN["conv_kernel_size"] - 1
    conv = (dim // tp, rows) if dim_first else (rows, dim // tp)
    return conv, (GDN["num_v_heads"] // tp, GDN["head_v_dim"], GDN["head_k_dim"])


def _gdn_bytes(src: tuple[int, int], dst: tuple[int, int]) -> int:
    """A layer's bytes both ranks hold, by vLLM's GDN sharding (``gated_delta_net_state_shape``,
    ``mamba_mixer2``'s per-projection split): the conv dim is Q | K | V, each split over
    TP on its own, 3 rows of bf16; the SSM state (value heads, 128, 128) bf16, split by head."""
    key, value = 16 * 128, 32 * 128

    def columns(tp: int, rank: int) -> set[int]:
        out, start = set(), 0
        for size in (key, key, value):
            n = size // tp
            out |= set(range(start + rank * n, start + (rank + 1) * n))
            start += size
        return out

    def heads(tp: int, rank: int) -> set[int]:
        return set(range(rank * 32 // tp, (rank + 1) * 32 // tp))

    conv = len(columns(*src) & columns(*dst)) * 3 * 2
    return conv + len(heads(*src) & heads(*dst)) * 128 * 128 * 2


def _state_side(where: str, tp: int, dim_first: bool) -> list[str]:
    conv, ssm = _vllm_gdn_shapes(tp, dim_first)
    state = f"gdn_attn:{'x'.join(map(str, conv))}:bf16,{'x'.join(map(str, ssm))}:bf16"
    page = 557056 * 2 // tp
    return [f"--{where}-engine", "vllm", f"--{where}-shape", f"36x[64,1,1,{page}]", f"--{where}-state", state,
            f"--{where}-tp", str(tp)]  # fmt: skip


@pytest.mark.parametrize("dim_first", [True, False], ids=["DS", "SD"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2), (1, 2), (2, 2)])
def test_plan_maps_mamba_state_between_tp_degrees_by_vllm_s_split(
    capsys: pytest.CaptureFixture[str], dim_first: bool, src_tp: int, dst_tp: int
) -> None:
    """A Qwen3-Next-like state group given as vLLM registers it, with its MambaSpec's fields
    (``--*-state``): every rank pair moves the conv columns and SSM heads both ranks hold,
    one run a sub-projection (and conv row, in vLLM's default "SD" order) and one for the
    heads, from every src rank (no replica sends for another). Before, plan read the page
    as one head of K and V in 1-token blocks."""
    src = _state_side("src", src_tp, dim_first)
    dst = _state_side("dst", dst_tp, dim_first)
    code, out, err = run(capsys, "plan", *src, *dst, "--dtype", "int8", "--tokens", "700", "--json")
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["state"] and (plan["src"]["block_size"], plan["dst"]["block_size"]) == (1, 1)
    rows = 1 if dim_first else 3
    for p in plan["pairs"]:
        expected = 36 * _gdn_bytes((src_tp, p["src_rank"]), (dst_tp, p["dst_rank"]))
        if not expected:
            assert (p["kind"], p["runs"], p["bytes"]) == ("empty", 0, 0)
        elif src_tp == dst_tp:  # a page a layer, its padding too
            assert (p["kind"], p["runs"], p["bytes"]) == ("same layout", 36, 36 * 557056 * 2 // src_tp)
            assert expected == 36 * (557056 - 8192) * 2 // src_tp  # the state: all but the padding
        else:
            assert p["bytes"] == expected
            assert (p["kind"], p["runs"]) == ("resharded state", 36 * (3 * rows + 1))
            assert p["choice"] in p["descriptors"]
    assert sum(p["bytes"] > 0 for p in plan["pairs"]) == max(src_tp, dst_tp)


def test_plan_of_mamba_state_is_the_map_of_vllm_s_edited_pages(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's maps are those of vLLM 0.33's registered Mamba layers read through the group
    edits (from the MambaSpec itself), in 'none' mode and in align mode (--*-block-size:
    the spec's block_size, 544 tokens at TP 2 and 272 at TP 4)."""
    import kvlayout.testing.vllm as vx
    from kvlayout.transfer import Shard, block_map

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    for mode, sizes in (("none", []), ("align", ["--src-block-size", "544", "--dst-block-size", "272"])):
        groups, specs = {}, {}
        for tp in (2, 4):
            engine = vx.hybrid_engine(vx.QWEN3_NEXT_80B_A3B, vx.FLASHINFER, num_blocks=4, tp=tp,
                                      mamba_cache_mode=mode, max_model_len=40960, conv_layout="DS")  # fmt: skip
            raw = vx.allocate_v033(engine)[1]
            reg = vx.detect_registered(
                engine, raw, {"kv_layout": "NHD"}, edited=True, prefix_reuse=mode == "align"
            )
            groups[tp] = next(g for g in reg.kernel_groups if g.opaque_pages is not None)
            name = engine.config.kv_cache_groups[groups[tp].engine_group].layer_names[0]
            specs[tp] = (engine.spec_of(name), raw[name])
        argv = ["plan", "--dtype", "int8", "--tokens", "700", "--json", *sizes]
        for where, tp in (("src", 2), ("dst", 4)):
            spec, layer = specs[tp]
            assert layer.shape[:3] == (4, 1, 1) and layer.dtype == torch.int8  # as vLLM registers it
            state = ",".join(f"{'x'.join(map(str, s))}:bf16" for s in spec.shapes)
            shape = f"{len(groups[tp].layers)}x[4,1,1,{spec.page_size_bytes}]"  # a group's layers
            argv += [f"--{where}-engine", "vllm", f"--{where}-shape", shape,
                     f"--{where}-state", f"gdn_attn:{state}", f"--{where}-tp", str(tp)]  # fmt: skip
        code, out, err = run(capsys, *argv)
        assert (code, err) == (0, ""), mode
        plan = json.loads(out)
        assert plan["src"]["block_size"] == groups[2].geometry.block_size
        for p in plan["pairs"]:
            m = block_map(groups[2], groups[4], [0], [0], src_shard=Shard(p["src_rank"], 2, 2),
                          dst_shard=Shard(p["dst_rank"], 4, 2))  # fmt: skip
            assert (p["kind"], p["runs"], p["bytes"]) == (m.kind, m.num_runs, m.num_bytes), (mode, p)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("--dst-state", None),
            "--src-state is given and --dst-state is not: a state group maps into a state group",
        ),
        (
            ("--dst-state", "gdn_attn:2048x3:bf17,8x128x128:bf16"),
            "--dst-state 'gdn_attn:2048x3:bf17,8x128x128:bf16' is not TYPE:DIMS:DTYPE[,DIMS:DTYPE]",
        ),
        (
            ("--dst-state", "gdn:2048x3:bf16,8x128x128:bf16"),
            "a 'gdn' state of [2048, 3] bfloat16, [8, 128, 128] bfloat16 does not split over TP as vLLM's gdn",
        ),
        (
            ("--dst-shape", "36x[64,1,1,4096]"),
            "the states ([2048, 3] bfloat16, [8, 128, 128] bfloat16) take 274432 bytes, more than the 4096-byte "
            "page",
        ),
        (
            ("--dst-engine", "sglang"),
            "--dst-state reads vLLM's Mamba layers (a MambaSpec's page), not sglang's",
        ),
        (("--first-token", "3"), "--first-token 3: a Mamba state page holds no tokens"),
        # --kv-heads counted for nothing here: it was checked against the TP degrees and dropped
        (
            ("--kv-heads", "2"),
            "--kv-heads 2: it counts attention KV heads, and a Mamba state page holds none",
        ),
        (
            ("--dst-state-shape", "36x[64,1,1,278528]"),
            "--dst-state-shape is given and --src-state-shape is not: a state group maps into a state group",
        ),
        # the parser's own refusals, before any rule reads the states: a zero dim, a third state
        (
            ("--dst-state", "gdn_attn:0x3:bf16,8x128x128:bf16"),
            "--dst-state 'gdn_attn:0x3:bf16,8x128x128:bf16' is not TYPE:DIMS:DTYPE[,DIMS:DTYPE]",
        ),
        (
            ("--dst-state", "gdn_attn:2048x3:bf16,8x128x128:bf16,4x4:bf16"),
            "a 'gdn_attn' state of [2048, 3] bfloat16, [8, 128, 128] bfloat16, [4, 4] bfloat16 does not split",
        ),
        # the default dtype read PAGE as bf16 elements: a page twice vLLM's, moved whole between ranks alike
        (("--dtype", "bf16"), "--dtype bf16 with --src-state: vLLM 0.33 registers a Mamba layer as int8"),
    ],
)
def test_plan_of_mamba_state_refuses_what_it_cannot_plan(
    capsys: pytest.CaptureFixture[str], change: tuple[str, str | None], message: str
) -> None:
    argv = ["plan", "--src-engine", "vllm", "--src-shape", "36x[64,1,1,557056]", "--src-state",
            "gdn_attn:4096x3:bf16,16x128x128:bf16", "--src-tp", "2", "--dst-engine", "vllm", "--dst-shape",
            "36x[64,1,1,278528]", "--dst-state", "gdn_attn:2048x3:bf16,8x128x128:bf16", "--dst-tp", "4",
            "--dtype", "int8", "--tokens", "700"]  # fmt: skip
    flag, value = change
    if flag in argv:
        at = argv.index(flag)
        argv[at : at + 2] = [] if value is None else [flag, value]
    else:
        argv += [flag, value or ""]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "") and message in err, err


def test_plan_of_mamba_state_as_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pd-connectors.md's state pair: decode ranks 0-1 read prefill rank 0's slices,
    2-3 rank 1's, each a quarter of the model's state; without ``--*-state`` the same
    shapes are planned as one head in one-token blocks, and the plan says to give it."""
    docs = (Path(__file__).parents[2] / "docs" / "pd-connectors.md").read_text()
    line = next(x for x in docs.splitlines() if "kvlayout plan" in x and "--src-state" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(
        "plan: the running Mamba state, one block id a side (scattered); src state TP 2"
    )
    sends = [
        x for x in lines if x.startswith("  src rank") and "resharded state; 144 runs, 9879552 bytes" in x
    ]
    assert [x.split(":")[0] for x in sends] == [
        f"  src rank {r} -> dst rank {d}" for r, d in ((0, 0), (0, 1), (1, 2), (1, 3))
    ]
    bare = [a for a in argv if not a.startswith("gdn_attn") and a not in ("--src-state", "--dst-state")]
    code, out, _ = run(capsys, *bare[:-1], "64")  # --tokens: 64 blocks of one token
    assert "2 KV heads" in out.splitlines()[0]
    assert "give --src-state (the MambaSpec's mamba_type, shapes and dtypes) for them" in out.splitlines()[1]


def test_plan_of_mamba_state_between_tp_degrees_neither_divides(capsys: pytest.CaptureFixture[str]) -> None:
    """TP 2 -> TP 3 (a GDN of 6 key and 6 value heads of 128, conv kernel 4, DS): each pair
    moves the conv columns and SSM heads both ranks hold by vLLM's split
    (``gated_delta_net_state_shape``: Q | K | V each split over TP, value heads split), the
    row budget counts a state block's one row, not --tokens."""
    key = value = 6 * 128

    def side(where: str, tp: int) -> list[str]:
        conv, heads = ((2 * key + value) // tp, 3), 6 // tp
        page = conv[0] * 3 * 2 + heads * 128 * 128 * 2
        return [f"--{where}-engine", "vllm", f"--{where}-shape", f"4x[8,1,1,{page}]", f"--{where}-tp", str(tp),
                f"--{where}-state", f"gdn_attn:{conv[0]}x3:bf16,{heads}x128x128:bf16"]  # fmt: skip

    def held(tp: int, rank: int) -> tuple[set[int], set[int]]:
        columns, start = set(), 0
        for size in (key, key, value):
            columns |= set(range(start + rank * size // tp, start + (rank + 1) * size // tp))
            start += size
        return columns, set(range(rank * 6 // tp, (rank + 1) * 6 // tp))

    code, out, err = run(capsys, "plan", *side("src", 2), *side("dst", 3), "--dtype", "int8", "--tokens",
                         str(2**24), "--json")  # fmt: skip
    assert (code, err) == (0, "")
    pairs = json.loads(out)["pairs"]
    assert len(pairs) == 6
    for p in pairs:
        (sc, sh), (dc, dh) = held(2, p["src_rank"]), held(3, p["dst_rank"])
        assert p["bytes"] == 4 * (len(sc & dc) * 3 * 2 + len(sh & dh) * 128 * 128 * 2), p


def test_plan_says_to_give_state_only_of_a_vllm_side(capsys: pytest.CaptureFixture[str]) -> None:
    """The one-head int8 side in one-token blocks is a Mamba layer's shape in vLLM alone: an
    SGLang side of that shape gets no word of --*-state."""
    argv = ["plan", "--dtype", "int8", "--tokens", "10", "--json"]
    for where in ("src", "dst"):
        argv += [f"--{where}-engine", "sglang", f"--{where}-shape", "4x[64,1,1,1024]"]
    code, out, _ = run(capsys, *argv)
    plan = json.loads(out)
    assert code == 0 and plan["src"]["note"] is None and plan["dst"]["note"] is None
    argv = [a.replace("sglang", "vllm") for a in argv]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "give --src-state" in json.loads(out)["src"]["note"]


# -- plan: a hybrid's request whole ------------------------------------------------------------
def _hybrid_side(where: str, tp: int) -> list[str]:
    """Qwen3-Next-80B at ``tp`` as vLLM 0.33 registers it in 'none' mode, conv state "DS":
    12 full-attention layers of FlashInfer pages ``[8*17, 1, 544/17, 512]`` (its 2 KV heads,
    replicated at TP 4; K | V of 256), blocks of 544 tokens at TP 2, 272 at TP 4; 36 GDN
    layers of int8 ``[8, 1, 1, PAGE]``."""
    conv, ssm = _vllm_gdn_shapes(tp, True)
    state = f"gdn_attn:{'x'.join(map(str, conv))}:bf16,{'x'.join(map(str, ssm))}:bf16"
    block = 544 * 2 // tp
    return [f"--{where}-engine", "vllm", f"--{where}-shape", f"12x[136,1,{block // 17},512]",
            f"--{where}-hint", "kv_layout=NHD", f"--{where}-block-size", str(block), f"--{where}-tp", str(tp),
            f"--{where}-state-shape", f"36x[8,1,1,{557056 * 2 // tp}]", f"--{where}-state", state]  # fmt: skip


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_plan_of_a_hybrid_is_its_groups_maps_posted_as_one_transfer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, src_tp: int, dst_tp: int
) -> None:
    """A hybrid (attention and Mamba state groups, as vLLM registers Qwen3-Next) planned
    whole: each rank pair's attention map, sent by one replica of its heads, and its state
    map, from every rank holding slices of the pair's, joined as vLLM's NixlConnector
    posts a request (one transfer). The numbers are those of vLLM's own registrations
    (its engine's groups, read through the edits) mapped and joined as a decode posts
    them, and the bytes the model's: 700 tokens x 12 layers of the head both ranks hold
    (from one of the ranks holding it), and the conv columns and SSM heads both hold.
    Before, plan refused the second shape and planned each group on its own."""
    import kvlayout.testing.vllm as vx
    from kvlayout.transfer import Shard, block_map, join_maps
    from kvlayout.transfer.nixl import estimate

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    argv = ["plan", *_hybrid_side("src", src_tp), *_hybrid_side("dst", dst_tp), "--kv-heads", "2", "--tokens",
            "700", "--blocks", "consecutive"]  # fmt: skip
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["hybrid"] and plan["kv_heads"] == 2 and plan["src"]["state"]["layers"] == 36
    groups, ids = {}, {}
    for tp in (src_tp, dst_tp):
        engine = vx.hybrid_engine(vx.QWEN3_NEXT_80B_A3B, vx.FLASHINFER, num_blocks=8, tp=tp, mamba_cache_mode="none",
                                  max_model_len=40960, conv_layout="DS")  # fmt: skip
        raw = vx.allocate_v033(engine)[1]
        reg = vx.detect_registered(engine, raw, {"kv_layout": "NHD"}, edited=True, prefix_reuse=False)
        groups[tp] = (
            next(g for g in reg.kernel_groups if g.opaque_pages is None),
            [g for g in reg.kernel_groups if g.opaque_pages is not None],
        )
        ids[tp] = list(range(-(-700 // (544 * 2 // tp))))  # the request's blocks of 544 * 2 / TP tokens
    (s_attn, s_states), (d_attn, d_states) = groups[src_tp], groups[dst_tp]
    assert (s_attn.geometry.block_size, len(s_states)) == (544 * 2 // src_tp, 3)
    assert len(plan["pairs"]) == src_tp * dst_tp
    senders: dict[int, list[int]] = {d: [] for d in range(dst_tp)}
    for p in plan["pairs"]:
        r, d = p["src_rank"], p["dst_rank"]
        src, dst = Shard(r, src_tp, 2), Shard(d, dst_tp, 2)
        # a decode reads attention from the one rank sends_to names, each state group from every rank;
        # vLLM lays every group's layer i over one buffer, so each group has blocks of its own
        maps = [
            block_map(s_attn, d_attn, ids[src_tp], ids[dst_tp], num_tokens=700, src_shard=src, dst_shard=dst)
        ]
        maps = [m for m in maps if src.sends_to(dst) and m.kind != "empty"]
        states = [
            block_map(s, t, [3 + k], [3 + k], src_shard=src, dst_shard=dst)
            for k, (s, t) in enumerate(zip(s_states, d_states, strict=True))
        ]
        maps += [m for m in states if m.num_runs]
        attention = 700 * 12 * 512 * 2 if p["attention"]["bytes"] else 0
        if attention:  # model head r * 2 // TP: both ranks hold it
            assert r * 2 // src_tp == d * 2 // dst_tp
            senders[d].append(r)
        state = 36 * _gdn_bytes((src_tp, r), (dst_tp, d))
        assert (p["attention"]["bytes"], p["state"]["bytes"], p["bytes"]) == (
            attention,
            state,
            attention + state,
        )
        assert p["runs"] == sum(m.num_runs for m in maps) and p["bytes"] == sum(m.num_bytes for m in maps)
        assert p["state"]["kind"] == ("resharded state" if state else "empty")
        if maps:
            assert p["descriptors"]["direct"] == estimate(join_maps(maps)).descriptors["direct"]
        else:
            assert "descriptors" not in p
    assert all(len(s) == 1 for s in senders.values())  # each decode rank's head from one rank
    code, out, _ = run(capsys, *argv)
    lines = out.splitlines()
    assert lines[1].startswith("  and the running Mamba state, one block id a side: src 36 layers")
    if src_tp == 2:
        assert (
            "  src rank 1 -> dst rank 3: attention re-blocked, 12 runs, 8601600 bytes; state resharded state, 144 "
            "runs, 9879552 bytes; together 156 runs, 18481152 bytes, mean run 118469 B"
        ) in lines
    else:  # rank 1 holds rank 0's head: it sends its state alone
        assert (
            "  src rank 1 -> dst rank 0: attention none (src rank 0 holds the same heads and sends them: one "
            "replica sends each head, as Shard.sends_to says); state resharded state, 144 runs, 9879552 bytes; "
            "together 144 runs"
        ) in out


def test_plan_holds_mamba_state_whole_on_every_dcp_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM never shards Mamba state by CP rank (``MambaSpec.max_num_blocks_per_req``: "Mamba
    state is replicated across DCP/PCP ranks"): each DCP rank holds its TP rank's slices.
    A state plan under DCP is the plan without it; a hybrid's attention is cut by CP rank
    (decode CP rank r of 2 holds the request's tokens t with t % 2 == r: 350 of 700) and
    its state moves whole. Before, plan refused --*-dcp with --*-state."""
    dcp = ["--dst-dcp", "2"]
    state = ["plan", *_state_side("src", 2, True), *_state_side("dst", 4, True), "--dtype", "int8",
             "--tokens", "700", "--json"]  # fmt: skip
    code, out, err = run(capsys, *state, *dcp)
    assert (code, err) == (0, "")
    under, bare = json.loads(out), json.loads(run(capsys, *state)[1])
    assert under["dst"]["dcp"] == 2 and under["pairs"] == bare["pairs"]
    hybrid = ["plan", *_hybrid_side("src", 2), *_hybrid_side("dst", 4), "--kv-heads", "2", "--tokens", "700",
              "--json"]  # fmt: skip
    code, out, err = run(capsys, *hybrid, *dcp)
    assert (code, err) == (0, "")
    plan = json.loads(out)
    for p, alone in zip(plan["pairs"], bare["pairs"], strict=True):
        assert {k: p["state"][k] for k in ("kind", "runs", "bytes")} == {
            k: alone[k] for k in ("kind", "runs", "bytes")
        }
        same_head = p["src_rank"] == p["dst_rank"] // 2
        assert p["attention"]["bytes"] == (350 * 12 * 512 * 2 if same_head else 0)
        assert p["bytes"] == p["attention"]["bytes"] + p["state"]["bytes"]


def test_plan_of_a_hybrid_refuses_a_state_shape_without_its_spec(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *_hybrid_side("src", 2), *_hybrid_side("dst", 4), "--tokens", "700"]
    for flag in ("--src-state", "--dst-state"):
        at = argv.index(flag)
        del argv[at : at + 2]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert "--src-state-shape and --dst-state-shape without --src-state and --dst-state" in err
    argv = ["plan", *_hybrid_side("src", 2), *_hybrid_side("dst", 4), "--tokens", "700"]
    at = argv.index("--dst-state-shape")
    argv[at + 1] = "36x[8,1,1,4096]"  # a page the states do not fit: named by its flag
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "") and "--dst-state on --dst-state-shape 36x[8,1,1,4096]: the states" in err, (
        err
    )


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 2)])
def test_plan_of_a_tp_replicated_state_sends_it_whole_from_one_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, src_tp: int, dst_tp: int
) -> None:
    """A ``tp_replicated`` MambaSpec (Qwen4's PLE short convolution, ``ple_layer.py``:
    ``is_kv_cache_tp_replicated``, its shape ``short_conv_state_shape(tp_world_size=1,
    ...)`` at any TP) given as ``--*-state ...,tp_replicated``: every rank holds the whole
    state, so each dst rank gets it whole from one src rank. The numbers are the maps of
    vLLM's own registrations of such a spec (read through the edits). Before, the state
    read as TP-sharded: refused between degrees ("replicated rather than sharded"), and
    sent to a dst rank from no rank but its own index's at one degree."""
    import kvlayout.testing.vllm as vx
    from kvlayout.transfer import Shard, block_map

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    layers = tuple((f"model.layers.{i}.self_attn.attn" if i in (2, 5) else f"model.layers.{i}.ple", i in (2, 5))
                   for i in range(8))  # fmt: skip
    groups, pages, argv = {}, {}, ["plan", "--dtype", "int8", "--tokens", "10", "--json"]
    for where, tp in (("src", src_tp), ("dst", dst_tp)):
        attn = vx.kvi.FullAttentionSpec(
            block_size=1, num_kv_heads=8 // tp, head_size=64, dtype=torch.bfloat16
        )
        engine = vx.state_hybrid_engine(attn, (((1024, 2),), (torch.bfloat16,)), "SHORT_CONV", vx.FLASHINFER,
                                        layers, mamba_cache_mode="none", tp_replicated=True)  # fmt: skip
        raw = vx.allocate_v033(engine)[1]
        reg = vx.detect_registered(engine, raw, {"kv_layout": "NHD"}, edited=True, prefix_reuse=False)
        groups[where] = next(g for g in reg.kernel_groups if g.opaque_pages is not None)
        spec = engine.spec_of(engine.config.kv_cache_groups[groups[where].engine_group].layer_names[0])
        pages[where] = spec.page_size_bytes
        shape = f"{len(groups[where].layers)}x[4,1,1,{spec.page_size_bytes}]"
        argv += [f"--{where}-engine", "vllm", f"--{where}-shape", shape, f"--{where}-tp", str(tp),
                 f"--{where}-state", "short_conv:1024x2:bf16,tp_replicated"]  # fmt: skip
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    plan = json.loads(out)
    senders: dict[int, list[int]] = {d: [] for d in range(dst_tp)}
    for p in plan["pairs"]:
        m = block_map(groups["src"], groups["dst"], [0], [0], src_shard=Shard(p["src_rank"], src_tp, 8),
                      dst_shard=Shard(p["dst_rank"], dst_tp, 8))  # fmt: skip
        # each layer's whole state, any ranks; between ranks alike its whole page (padding too)
        page = 1024 * 2 * 2 if src_tp != dst_tp else pages["src"]
        assert m.num_bytes == len(m.src.layers) * page
        if p["bytes"]:
            senders[p["dst_rank"]].append(p["src_rank"])
            assert (p["kind"], p["runs"], p["bytes"]) == (m.kind, m.num_runs, m.num_bytes)
        else:
            assert p["kind"] == "replica" and "tp_replicated" in p["reason"]
    assert all(len(s) == 1 for s in senders.values()), senders  # each dst rank's state from one rank


def test_plan_of_a_hybrid_as_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pd-connectors.md's hybrid line is the plan the hybrid test checks against vLLM's
    registrations (prefill TP 2 into decode TP 4), its flags in another order and its
    block ids scattered, and it runs."""
    docs = (Path(__file__).parents[2] / "docs" / "pd-connectors.md").read_text()
    line = next(x for x in docs.splitlines() if "kvlayout plan" in x and "--src-state-shape" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    checked = [*_hybrid_side("src", 2), *_hybrid_side("dst", 4), "--kv-heads", "2", "--tokens", "700"]
    assert argv[0] == "plan" and sorted(zip(argv[1::2], argv[2::2], strict=True)) == sorted(
        zip(checked[::2], checked[1::2], strict=True)
    )
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "") and "together 180 runs, 18481152 bytes" in out


def _vllm_rings(capacity: int, num_layers: int) -> Any:
    """DeepSeek-V4.1's compressor rings as vLLM 0.33 registers them and a P/D connector
    detects them (``CompressorStateCache.get_kv_cache_spec``: ``CircularBufferSpec`` of one
    head, ``state_dim = 2 * head_dim`` = 1024 fp32 values a row, ``capacity`` rows; through
    the group edits with ``prefix_reuse=False``): the kernel group, and the registered view's
    shape."""
    import kvlayout.testing.vllm as vx

    spec = vx.kvi.CircularBufferSpec(
        block_size=capacity, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32
    )
    engine = vx.uniform_engine(
        spec, vx.Backend("CompressorBackend", multiple_of=1), num_layers=num_layers, num_blocks=6,
        layer_name="model.layers.{}.self_attn.compressor.state_cache",
    )  # fmt: skip
    raw = vx.allocate_v033(engine)[1]
    reg = vx.detect_registered(engine, raw, {"kv_layout": "NHD"}, edited=True, prefix_reuse=False)
    return reg.kernel_groups[0], tuple(next(iter(raw.values())).shape), spec.page_size_bytes


@pytest.mark.parametrize(("src_tp", "dst_tp", "capacity"), [(2, 4, 8), (4, 2, 8), (1, 2, 16), (2, 2, 8)])
def test_plan_of_vllm_s_rings_moves_each_request_s_ring_whole_from_one_rank(
    capsys: pytest.CaptureFixture[str], src_tp: int, dst_tp: int, capacity: int
) -> None:
    """``--src-ring`` / ``--dst-ring``: DeepSeek-V4.1's compressor rings (vLLM's
    ``CircularBufferSpec``) planned as the library maps them: one block a request whatever
    its tokens, every layer's page whole, and each decode rank's ring from one prefill rank
    (vLLM computes the ring whole on every rank). The numbers are the block maps of vLLM's
    own registrations. Before, the shape planned as one fp32 head of K | V tokens."""
    from kvlayout.transfer import Shard, block_map
    from kvlayout.transfer.nixl import estimate

    layers = 5
    group, shape, page = _vllm_rings(capacity, layers)
    assert shape == (6, 1, capacity, 1024)  # what the plan is given: vLLM's view, as registered
    argv = ["plan", "--dtype", "fp32", "--tokens", "700", "--json", "--src-ring", "--dst-ring"]
    for where, tp in (("src", src_tp), ("dst", dst_tp)):
        argv += [f"--{where}-engine", "vllm", f"--{where}-shape", f"{layers}x[6,1,{capacity},1024]",
                 f"--{where}-tp", str(tp)]  # fmt: skip
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["ring"] and plan["src"]["block_size"] == plan["dst"]["block_size"] == capacity
    senders: dict[int, list[int]] = {d: [] for d in range(dst_tp)}
    for p in plan["pairs"]:
        m = block_map(group, group, [0], [0], src_shard=Shard(p["src_rank"], src_tp, 8),
                      dst_shard=Shard(p["dst_rank"], dst_tp, 8))  # fmt: skip
        assert m.num_bytes == layers * page == layers * capacity * 1024 * 4  # each layer's ring whole
        if p["bytes"]:
            senders[p["dst_rank"]].append(p["src_rank"])
            assert (p["kind"], p["runs"], p["bytes"]) == (m.kind, m.num_runs, m.num_bytes)
            assert p["descriptors"] == estimate(m, poster="dst").descriptors
        else:
            assert p["kind"] == "replica" and "a ring, which vLLM computes on every rank" in p["reason"]
    assert all(len(s) == 1 for s in senders.values()), senders  # each dst rank's ring from one rank


def test_plan_says_a_one_head_fp32_vllm_side_may_be_a_ring(capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--*-ring``, vLLM's ring shape ``[NB,1,N,C]`` fp32 is one fp32 head of
    attention too, and is planned as one: the plan says so, naming the flag, on each side
    of that shape (not on an fp32 side of two heads a rank, nor on bf16)."""
    base = ["plan", "--src-engine", "vllm", "--dst-engine", "vllm", "--tokens", "40", "--src-tp", "2",
            "--dst-tp", "4"]  # fmt: skip
    code, out, err = run(capsys, *base, "--dtype", "fp32", "--src-shape", "3x[6,1,8,1024]",
                         "--dst-shape", "3x[6,1,8,1024]", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    plan = json.loads(out)
    for where in ("src", "dst"):
        assert "CircularBufferSpec rings" in plan[where]["note"] and f"--{where}-ring" in plan[where]["note"]
    assert not plan["ring"] and all(p["bytes"] % (40 * 3 * 1024 * 4) == 0 for p in plan["pairs"])
    for dtype, shape in (("fp32", "[6,8,2,1024]"), ("bf16", "[6,1,8,1024]")):  # NHD: 2 heads, blocks of 8
        code, out, err = run(capsys, *base[:-1], "2", "--dtype", dtype, "--src-shape", f"3x{shape}",
                             "--dst-shape", f"3x{shape}", "--json")  # fmt: skip
        notes = [json.loads(out)[w]["note"] or "" for w in ("src", "dst")]
        assert (code, err) == (0, "") and not any("-ring" in n for n in notes), (dtype, notes)


_RINGS = ["--src-ring", "--dst-ring"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--src-ring"], "--src-ring is given and --dst-ring is not: a ring maps only into a ring"),
        ([*_RINGS, "--dtype", "bf16"],
         "--dtype bf16 with --src-ring: DeepSeek-V4.1's compressor state is float32 (CompressorStateCache "
         "registers it so); give --dtype fp32, or another --ring-kind"),
        ([*_RINGS, "--first-token", "8"], "--first-token 8: a ring holds its request's latest"),
        ([*_RINGS, "--kv-heads", "2"], "--kv-heads 2: a ring holds"),
        ([*_RINGS, "--dst-block-size", "16"], "--dst-block-size with --src-ring and --dst-ring"),
        ([*_RINGS, "--src-state", "gdn_attn:4096x3:bf16", "--dst-state", "gdn_attn:4096x3:bf16"],
         "--src-state with --src-ring and --dst-ring: a ring is a group of its own"),
        ([*_RINGS, "--src-engine", "sglang"], "--src-ring reads vLLM's rings"),
        ([*_RINGS, "--src-shape", "3x[6,2,8,1024]"],
         "--src-ring on --src-shape 3x[6,2,8,1024]: DeepSeek-V4.1's compressor state (vLLM's "
         "CircularBufferSpec, CompressorStateCache) registers as [NB,1,N,C] float32"),
    ],
)  # fmt: skip
def test_plan_of_rings_refuses_what_it_cannot_plan(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    flags = {"--src-engine": "vllm", "--dst-engine": "vllm", "--tokens": "40", "--dtype": "fp32",
             "--src-shape": "3x[6,1,8,1024]", "--dst-shape": "3x[6,1,8,1024]"}  # fmt: skip
    rings = [a for a in extra if a in ("--src-ring", "--dst-ring")]
    given = {
        k: v for k, v in zip(extra, [*extra[1:], ""], strict=True) if k.startswith("--") and k not in rings
    }
    argv = ["plan", *rings, *(x for k, v in (flags | given).items() for x in (k, v))]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (out, err)
    assert message in err, err


def test_plan_of_rings_as_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pd-connectors.md's ring line runs: 16 layers' rings of 8 rows of 1024 fp32
    values, each decode rank's from one prefill rank, the rest replicas."""
    docs = (Path(__file__).parents[2] / "docs" / "pd-connectors.md").read_text()
    line = next(x for x in docs.splitlines() if "kvlayout plan" in x and "--src-ring" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    pairs = json.loads(out)["pairs"]
    sent = [p for p in pairs if p["bytes"]]
    assert sorted(p["dst_rank"] for p in sent) == [0, 1, 2, 3]
    assert all(p["bytes"] == 16 * 8 * 1024 * 4 for p in sent)
    assert all(p["kind"] == "replica" for p in pairs if not p["bytes"])


def test_plan_of_rings_is_block_map_of_deepseek_v41_s_packed_rings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DeepSeek-V4.1's rings as vLLM packs them (``planned_engine`` under BLHNC, the
    layouts its indexer requires: each ring one page a block at the packed block's
    stride, rings of three widths in kernel groups of their own): each group's plan,
    from the rings' shapes, moves what ``block_map`` moves of the packed registration,
    prefill TP 2 into decode TP 4."""
    import kvlayout.testing.vllm as vx
    from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
    from kvlayout.transfer import Shard, block_map
    from tests.integrations.vllm.test_vllm_dsv41_planned import MODELS

    specs, layout = MODELS["c4-c128"], vx.KVCacheLayout.BLHNC
    engine = vx.planned_engine(specs, vx.FLASHMLA, layout=layout, num_blocks=5)
    kv = vx.allocate_v033(engine)[1]
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, edited)
    names = [n for n in kv if n in edited]
    reg = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    rings = [
        g for g in reg.kernel_groups if g.opaque_pages and g.opaque_pages.layout.startswith("ring-buffer")
    ]
    assert len(rings) == 6
    for g in rings:
        shape = tuple(kv[names[g.layers[0]]].shape)
        assert shape[:3] == (5, 1, 8) and kv[names[g.layers[0]]].stride(0) * 4 > 8 * shape[3] * 4  # packed
        given = f"{len(g.layers)}x{list(shape)}".replace(" ", "")
        code, out, err = run(capsys, "plan", "--dtype", "fp32", "--tokens", "300", "--json", "--src-ring",
                             "--dst-ring", "--src-engine", "vllm", "--dst-engine", "vllm", "--src-tp", "2",
                             "--dst-tp", "4", "--src-shape", given, "--dst-shape", given)  # fmt: skip
        assert (code, err) == (0, "")
        for p in json.loads(out)["pairs"]:
            if p["bytes"]:
                m = block_map(g, g, [0], [0], src_shard=Shard(p["src_rank"], 2, 4),
                              dst_shard=Shard(p["dst_rank"], 4, 4))  # fmt: skip
                assert (p["kind"], p["runs"], p["bytes"]) == (m.kind, m.num_runs, m.num_bytes)
                assert m.num_bytes == len(g.layers) * 8 * shape[3] * 4


def _packed_dsv41(num_blocks: int = 5) -> tuple[Any, dict[str, Any]]:
    """DeepSeek-V4.1's C4 layers as vLLM packs them (``planned_engine`` under BLHNC, the
    layouts its indexer requires), allocated and detected as a P/D connector does: the
    registration and the registered views, by layer name."""
    import kvlayout.testing.vllm as vx
    from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
    from tests.integrations.vllm.test_vllm_dsv41_planned import MODELS

    layout = vx.KVCacheLayout.BLHNC
    engine = vx.planned_engine(MODELS["c4"], vx.FLASHMLA, layout=layout, num_blocks=num_blocks)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, 0)
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, edited)
    reg = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    return reg, {n: kv[n] for n in kv if n in edited}


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_plan_of_latents_beside_their_rings_is_the_joined_map_of_deepseek_v41_s_packed_groups(
    capsys: pytest.CaptureFixture[str], src_tp: int, dst_tp: int
) -> None:
    """``--src-ring-shape`` / ``--dst-ring-shape`` beside the latents: a DeepSeek-V4.1 rank's
    compressed latents and their compressor's rings (as vLLM packs them) planned as one
    request, each rank pair's two maps joined as a connector posts them. Each pair equals
    ``join_maps`` of the library's own block maps of the packed registration (kinds, runs,
    bytes, direct descriptors; staged ones no fewer: the plan's shapes cannot say that a
    packed block's layers lie side by side): each decode rank's latents and ring from the one prefill rank
    ``sends_to`` picks (vLLM's ``compute_tp_mapping``: ``tp_rank * remote_tp // tp``), the
    other pairs replicas. Before, a plan held the rings alone (``--src-ring``)."""
    from kvlayout.tools.plan_command import _block_ids
    from kvlayout.transfer import Shard, block_map, join_maps
    from kvlayout.transfer.nixl import estimate

    (reg, kv), (there, _) = _packed_dsv41(), _packed_dsv41()  # a prefill rank's, a decode rank's
    names = list(kv)
    at = {g: i for i, g in enumerate(reg.kernel_groups)}
    latents = next(g for g in reg.kernel_groups if names[g.layers[0]].endswith(".attn"))
    ring = next(
        g for g in reg.kernel_groups if names[g.layers[0]].endswith("self_attn.compressor.state_cache")
    )
    shapes = {
        g: f"{len(g.layers)}x{list(kv[names[g.layers[0]]].shape)}".replace(" ", "") for g in (latents, ring)
    }
    # a request of 400 tokens at C4's ratio: 100 latents in 2 blocks of 64, the plan's scattered
    # ids 2 and 4 on both sides (packed pages never abut, the plan's shapes do: ids 2, 3 would
    # join there in one run)
    slots = 100
    argv = ["plan", "--tokens", str(slots), "--json"]
    for where, tp in (("src", src_tp), ("dst", dst_tp)):
        argv += [f"--{where}-engine", "vllm", f"--{where}-shape", shapes[latents], f"--{where}-hint", "kv_dim=1",
                 f"--{where}-ring-shape", shapes[ring], f"--{where}-tp", str(tp)]  # fmt: skip
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["hybrid"] and plan["beside"] == "ring"
    assert plan["src"]["ring"] == {"format": "NL_X_NB_BS_HS", "block_size": 8, "num_blocks": 5, "layers": 3}
    ids = _block_ids("scattered", 2, 5, "src")
    assert list(ids) == [2, 4]
    ring_ids = [0]  # the plan's is 4, apart there; vLLM's groups share one pool: a request's differ
    senders: dict[int, list[int]] = {d: [] for d in range(dst_tp)}
    for p in plan["pairs"]:
        ps, ds = Shard(p["src_rank"], src_tp, 1), Shard(p["dst_rank"], dst_tp, 1)
        if not ps.sends_to(ds, latents=True):
            assert p["bytes"] == 0 and p["attention"]["kind"] == p["ring"]["kind"] == "replica"
            continue
        senders[p["dst_rank"]].append(p["src_rank"])
        maps = [
            block_map(
                latents,
                there.kernel_groups[at[latents]],
                ids,
                ids,
                num_tokens=slots,
                src_shard=ps,
                dst_shard=ds,
            ),
            block_map(ring, there.kernel_groups[at[ring]], ring_ids, ring_ids, src_shard=ps, dst_shard=ds),
        ]
        assert maps[0].latents and maps[1].latents  # every rank holds both whole
        for name, m in zip(("attention", "ring"), maps, strict=True):
            assert (p[name]["kind"], p[name]["runs"], p[name]["bytes"]) == (m.kind, m.num_runs, m.num_bytes)
        joined = join_maps(maps)
        assert (p["runs"], p["bytes"]) == (joined.num_runs, joined.num_bytes)
        # direct posts a descriptor a run; a staged gather's reads of packed rows (BLHNC: a block's
        # layers side by side) join where the plan's layer-by-layer shapes cannot say so
        library = estimate(joined, poster="dst").descriptors
        assert p["descriptors"]["direct"] == library["direct"]
        assert all(p["descriptors"][k] >= library[k] for k in library)
    assert senders == {d: [d * src_tp // dst_tp] for d in range(dst_tp)}
    code, text, err = run(capsys, *[a for a in argv if a != "--json"])
    assert (code, err) == (0, "")
    assert (
        "and the request's ring (vLLM's CircularBufferSpec: DeepSeek-V4.1's compressor state), one block id a "
        "side: src 3 layers" in text
    )
    assert "ring: src rank" in text and "a ring, which vLLM computes on every rank" in text


_LATENTS = ["--src-engine", "vllm", "--dst-engine", "vllm", "--tokens", "40", "--src-shape", "3x[5,1,64,512]",
            "--dst-shape", "3x[5,1,64,512]", "--src-hint", "kv_dim=1", "--dst-hint", "kv_dim=1"]  # fmt: skip
_RING_SHAPES = ["--src-ring-shape", "3x[5,1,8,1024]", "--dst-ring-shape", "3x[5,1,8,1024]"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (_RING_SHAPES[:2], "--src-ring-shape is given and --dst-ring-shape is not: a ring maps only into a ring"),
        (_RING_SHAPES[2:], "--dst-ring-shape is given and --src-ring-shape is not"),
        ([*_RING_SHAPES, "--src-state-shape", "3x[5,1,1,8192]", "--dst-state-shape", "3x[5,1,1,8192]"],
         "--src-state-shape with --src-ring-shape and --dst-ring-shape: a plan holds one group beside the "
         "attention group"),
        ([*_RING_SHAPES, "--src-ring", "--dst-ring"], "--src-ring-shape with --src-ring and --dst-ring"),
        (["--src-ring-shape", "3x[5,2,8,1024]", *_RING_SHAPES[2:]],
         "--src-ring-shape on --src-ring-shape 3x[5,2,8,1024]: DeepSeek-V4.1's compressor state (vLLM's "
         "CircularBufferSpec, CompressorStateCache) registers as [NB,1,N,C] float32"),
    ],
)  # fmt: skip
def test_plan_of_rings_beside_attention_refuses_what_it_cannot_plan(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out, err = run(capsys, "plan", *_LATENTS, *extra)
    assert (code, out) == (2, ""), (out, err)
    assert message in err, err


def test_plan_of_latents_beside_their_rings_as_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pd-connectors.md's line of latents with their rings runs: each decode rank's
    100 latents of 3 layers and their 3 rings from one prefill rank, in one transfer."""
    docs = (Path(__file__).parents[2] / "docs" / "pd-connectors.md").read_text()
    line = next(x for x in docs.splitlines() if "kvlayout plan" in x and "--src-ring-shape" in x)
    argv = [a.strip("'") for a in line.split("$ kvlayout ", 1)[1].split()]
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    sent = [p for p in json.loads(out)["pairs"] if p["bytes"]]
    assert sorted(p["dst_rank"] for p in sent) == [0, 1, 2, 3]
    assert all(p["bytes"] == 100 * 3 * 512 * 2 + 3 * 8 * 1024 * 4 for p in sent)
    assert all((p["attention"]["bytes"], p["ring"]["bytes"]) == (307200, 98304) for p in sent)
