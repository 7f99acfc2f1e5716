"""A scratch checkout for tests that change layouts.yaml: the sources copied to a temporary
directory, regenerated from an edited catalog, the native extension compiled against the
generated headers, and Python run there as a user of that checkout would run it."""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nanobind  # type: ignore[import-untyped]

from codegen.__main__ import generate
from tests import ROOT

YAML = ROOT / "layouts.yaml"


@dataclass
class Scratch:
    root: Path

    @property
    def yaml(self) -> Path:
        return self.root / "layouts.yaml"

    def python(self, script: str) -> subprocess.CompletedProcess[str]:
        """Run ``script`` importing this checkout's kvlayout (not the installed one)."""
        bootstrap = (
            "import sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            f"sys.path[:0] = [{str(self.root / 'src')!r}, {str(self.root)!r}]\n"
        )
        return subprocess.run(
            [sys.executable, "-c", bootstrap + textwrap.dedent(script)],
            cwd=self.root,
            capture_output=True,
            text=True,
            check=False,
        )


def checkout(tmp_path: Path, yaml_text: str) -> Scratch:
    """The sources under ``tmp_path`` with ``yaml_text`` as layouts.yaml (not generated yet)."""
    root = tmp_path / "checkout"
    for rel in ("grammar", "codegen", "csrc", "src/kvlayout"):
        shutil.copytree(
            ROOT / rel, root / rel, ignore=shutil.ignore_patterns("_generated", "__pycache__", "*.so")
        )
    (root / "layouts.yaml").write_text(yaml_text)
    return Scratch(root)


def regenerate(scratch: Scratch) -> int:
    """``make codegen`` in the scratch checkout (its exit code; errors go to stderr)."""
    return generate(scratch.yaml, scratch.root / "grammar" / "kvlayout.lark", scratch.root, check=False)


def build_native(scratch: Scratch) -> None:
    """Compile ``kvlayout._native`` from the scratch checkout's sources and headers."""
    include = Path(nanobind.include_dir())
    flags = [
        "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-I{include}", f"-I{include.parent / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{scratch.root / 'csrc' / 'include'}", f"-I{scratch.root / 'csrc'}",
    ]  # fmt: skip
    built = sorted(glob.glob(str(ROOT / "build" / "*" / "libnanobind-static.a")))
    support = (
        [built[-1]]
        if built
        else [str(include.parent / "src" / "nb_combined.cpp"), "-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS"]
    )
    target = scratch.root / "src" / "kvlayout" / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            "g++",
            *flags,
            str(scratch.root / "csrc" / "bindings.cpp"),
            *support,
            "-o",
            str(target),
            "-lpthread",
        ],
        check=True,
        capture_output=True,
    )
