"""``python -m codegen [--check]``: regenerate (or check) every file made from layouts.yaml.

Load and check the catalog, render every declared output, then write the ones that
changed, or, with ``--check``, fail with a diff when any is stale. It imports no
generated module, so it runs even when the generated files are missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codegen.catalog import load_catalog
from codegen.outputs import render_outputs
from codegen.writer import check_outputs, write_outputs
from kvlayout.errors import KVLayoutError

ROOT = Path(__file__).resolve().parent.parent


def generate(yaml_path: Path, grammar_path: Path, root: Path, *, check: bool) -> int:
    """Render every output; write them (or check them). Returns a process exit code."""
    shown = _shown(yaml_path)
    try:
        catalog = load_catalog(yaml_path, grammar_path, shown)
    except KVLayoutError as e:
        print(f"codegen: {e}", file=sys.stderr)
        return 1
    sources = f"{shown}, {_shown(grammar_path)}"
    outputs = render_outputs(catalog, grammar_path.read_text(), sources)
    if check:
        problems = check_outputs(root, outputs)
        if problems:
            print("\n\n".join(problems), file=sys.stderr)
            print("\ngenerated files are stale: run `make codegen`", file=sys.stderr)
            return 1
        print(f"codegen: {len(outputs)} generated files are up to date")
        return 0
    changed = write_outputs(root, outputs)
    print(f"codegen: wrote {len(changed)} of {len(outputs)} files" + "".join(f"\n  {c}" for c in changed))
    return 0


def _shown(path: Path) -> str:
    """A path as headers and errors show it: repository-relative when inside the repo."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail with a diff if a generated file is stale")
    ap.add_argument("--yaml", type=Path, default=ROOT / "layouts.yaml", help="the catalog to read")
    ap.add_argument("--grammar", type=Path, default=ROOT / "grammar" / "kvlayout.lark")
    ap.add_argument("--root", type=Path, default=ROOT, help="where generated paths are rooted")
    args = ap.parse_args(argv)
    return generate(args.yaml, args.grammar, args.root, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
