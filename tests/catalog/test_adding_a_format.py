"""docs/adding-a-format.md, done as it says: its example entry appended to layouts.yaml
with the next free value, then `make codegen` (and the extension rebuilt) in a scratch
copy of the repository; nothing else is edited. The new format is an enum member,
`kvlayout explain` shows it, SGLang's unified detection returns it under kv_layout=HND
(and its NHD twin under NHD), and a store/load round trip restores the blocks."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests import ROOT
from tests.catalog.scratch import YAML, build_native, checkout, regenerate

DOC = ROOT / "docs" / "adding-a-format.md"


def doc_entry() -> tuple[str, str]:
    """The doc's example entry (its YAML block) and the format's name."""
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None, "the doc shows its example entry as a yaml block"
    lines = block.group(1).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    entry = "\n".join(line[indent:] for line in lines) + "\n"
    (parsed,) = yaml.safe_load(entry)
    return entry, str(parsed["name"])


def with_doc_entry(text: str) -> tuple[str, str, int]:
    """layouts.yaml with the doc's entry appended under ``formats`` at the next free value
    (unchanged if the catalog has the format already), the name and its value."""
    entry, name = doc_entry()
    formats = yaml.safe_load(text)["formats"]
    known = {f["name"]: f["value"] for f in formats}
    if name in known:
        return text, name, known[name]
    value = max(known.values()) + 1
    entry = re.sub(r"value: \d+", f"value: {value}", entry, count=1)
    indented = "".join(f"  {line}\n" for line in entry.splitlines())
    head, sep, tail = text.partition("\n# The kernel-facing geometry")
    assert sep, "layouts.yaml keeps its formats before the descriptor section"
    return head.rstrip("\n") + "\n" + indented + sep + tail, name, value


def test_the_doc_example_is_an_hnd_single_component_sglang_cache() -> None:
    entry, name = doc_entry()
    assert name == "NL_X_NB_NH_BS_HS"
    (parsed,) = yaml.safe_load(entry)
    assert parsed["engines"] == ["sglang"] and set(parsed) == {"value", "name", "backends", "engines"}


def test_a_format_added_as_the_doc_says_just_works(tmp_path: Path) -> None:
    text, name, value = with_doc_entry(YAML.read_text())
    scratch = checkout(tmp_path, text)
    assert regenerate(scratch) == 0
    build_native(scratch)
    done = scratch.python(f"""
        import contextlib, io
        import torch
        import kvlayout
        from kvlayout.tools.cli import main
        from kvlayout.transfer import prepare

        fmt = kvlayout.EngineKVFormat.{name}
        assert int(fmt) == {value}, int(fmt)
        assert kvlayout.describe_shape(fmt) == "NL x [NB, NH, BS, HS]"
        assert kvlayout.is_hnd(fmt) and kvlayout.is_single_kv(fmt) and not kvlayout.is_mla(fmt)

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["explain", "{name}"]) == 0
        text = out.getvalue()
        assert text.startswith("{name}\\n  shape          NL x [NB, NH, BS, HS]"), text
        assert "Heads are outer to tokens inside a block." in text, text

        # SGLang's unified components: [NB, NH, BS, HS] under HND, [NB, BS, NH, HS] under NHD.
        kv = [torch.randn(6, 2, 4, 8) for _ in range(3)]
        hnd, reg = kvlayout.normalize_kv_and_discover_format(kv, "sglang", {{"kv_list_layout": "unified", "kv_layout": "HND"}})
        assert hnd is fmt, hnd
        nhd, _ = kvlayout.normalize_kv_and_discover_format(kv, "sglang", {{"kv_list_layout": "unified", "kv_layout": "NHD"}})
        assert nhd is kvlayout.EngineKVFormat.NL_X_NB_BS_NH_HS, nhd
        assert kvlayout.normalize_kv_and_discover_format(kv, "sglang", {{"kv_list_layout": "unified"}})[0] is nhd
        assert (kvlayout.get_num_heads(reg, fmt), kvlayout.get_block_size(reg, fmt)) == (2, 4)

        plan = prepare(reg, fmt)
        shape, dtype = plan.chunk_shape(8)
        assert shape == (1, 3, 8, 16), shape
        chunks = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
        ids = [5, 0, 3, 1]
        original = [t.clone() for t in kv]
        plan.store_blocks(ids, chunks)
        for t in kv:
            t.zero_()
        plan.load_blocks(ids, chunks)
        for t, o in zip(kv, original):
            assert torch.equal(t[ids], o[ids]) and not t[[2, 4]].any()
        # the chunk is token-major: token j of block 5, head h, in row j, columns h*8..h*8+7
        assert torch.equal(chunks[0][0, 1, :4].view(4, 2, 8), original[1][5].transpose(0, 1))
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
