"""The package is laid out like its layers: a static read of every module's imports
(imports inside functions count, ``if TYPE_CHECKING:`` blocks do not) finds no cycle and
no arrow from a lower layer to a higher one, in the order docs/architecture.md states;
every sub-package says what its layer knows; the top level stays small; and the public
import paths keep working."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import kvlayout
from tests import ROOT

PACKAGE = ROOT / "src" / "kvlayout"
COMPILED = ("kvlayout._native", "kvlayout._cuda")  # the C++ extensions: no Python imports

# The generated modules belong to the layer of what they hold (docs/architecture.md says so).
GENERATED_LAYERS = {
    "kvlayout._generated.vocabulary": "layout",
    "kvlayout._generated.formats": "layout",
    "kvlayout._generated.engines": "types",
    "kvlayout._generated": "catalog",
    "kvlayout._generated.descriptors": "catalog",
    "kvlayout._generated.specs": "catalog",
    "kvlayout._generated.predicates": "catalog",
}

# Every other module belongs to the layer of its sub-package or top-level module.
LAYER_OF_PREFIX = {
    "kvlayout.errors": "errors",
    "kvlayout.layout": "layout",
    "kvlayout.types": "types",
    "kvlayout.catalog": "catalog",
    "kvlayout.registration": "registration",
    "kvlayout.detection": "detection",
    "kvlayout.facade": "facade",
    "kvlayout.layer_groups": "facade",  # LMCache's layer-group manager, beside its API
    "kvlayout.transfer": "transfer",
    "kvlayout._native": "transfer",
    "kvlayout._cuda": "transfer",
    "kvlayout.integrations": "integrations",
    "kvlayout.testing": "testing",
    "kvlayout.tools": "tools",
    "kvlayout.__main__": "tools",
}

LAYER_PACKAGES = (
    "layout",
    "catalog",
    "registration",
    "detection",
    "transfer",
    "integrations",
    "testing",
    "tools",
)


# -- reading the imports ----------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``, at any depth, except those a TYPE_CHECKING guard hides."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:  # the ``else:`` of the guard runs
                yield from _import_nodes_of(other)
            continue
        yield from _import_nodes_of(child)


def _import_nodes_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _import_nodes(node)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvlayout modules ``name`` imports: ``from a import b`` is ``a.b`` when that is a
    module, else ``a``; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        found.update(t for t in targets if t == "kvlayout" or t.startswith("kvlayout."))
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules) | set(COMPILED)
    graph = {name: imports_of(name, path, known) for name, path in modules.items()}
    for name in COMPILED:
        graph[name] = set()
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def layer_of(module: str) -> str:
    if module in GENERATED_LAYERS:
        return GENERATED_LAYERS[module]
    if module == "kvlayout":
        return "kvlayout"
    for prefix, layer in LAYER_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to docs/architecture.md and this test")


def documented_ranks() -> list[tuple[str, ...]]:
    """The layer order of docs/architecture.md, lowest first: ``a <- b`` means b may
    import a and a never imports b; ``b | c`` are layers that never import each other."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    lines = [line for line in re.findall(r"^\s*(\S.*<-.*)$", text, flags=re.M) if "`" not in line]
    assert len(lines) == 1, f"docs/architecture.md states the layer order in one `<-` line, found {lines}"
    return [tuple(part.strip() for part in rank.split("|")) for rank in lines[0].split("<-")]


# -- the checks -------------------------------------------------------------------------


def test_the_import_reader_sees_what_it_must(tmp_path: Path) -> None:
    """Imports in functions and the else of a guard count; TYPE_CHECKING and relative
    imports resolve as Python would (a check of the reader the layer checks rely on)."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "import kvlayout.errors\n"
        "from . import sibling\n"
        "from .other import thing\n"
        "if TYPE_CHECKING:\n    from kvlayout.hidden import X\nelse:\n    import kvlayout.shown\n"
        "def f():\n    from kvlayout.lazy import g\n"
    )
    path = tmp_path / "kvlayout" / "pkg" / "mod.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    known = {"kvlayout.pkg.sibling"}
    assert imports_of("kvlayout.pkg.mod", path, known) == {
        "kvlayout.errors",
        "kvlayout.pkg.sibling",
        "kvlayout.pkg.other",
        "kvlayout.shown",
        "kvlayout.lazy",
    }
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layers_are_the_documented_ones() -> None:
    ranks = documented_ranks()
    layers = {layer for rank in ranks for layer in rank}
    named = {*LAYER_OF_PREFIX.values(), *GENERATED_LAYERS.values(), "kvlayout"}
    assert layers == named, f"docs/architecture.md names {sorted(layers)}, the package {sorted(named)}"


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    rank = {layer: i for i, layers in enumerate(documented_ranks()) for layer in layers}
    wrong = []
    for module, targets in sorted(import_graph().items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if there != here and rank[there] >= rank[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, "imports against the layer order of docs/architecture.md:\n" + "\n".join(wrong)


def test_codegen_imports_only_the_layout_layer() -> None:
    """codegen runs when the generated modules are missing: it imports kvlayout's layout
    layer and errors only, and the layout package's __init__ imports nothing."""
    known = set(source_modules())
    wrong = []
    for path in sorted((ROOT / "codegen").glob("*.py")):
        for target in sorted(imports_of(f"codegen.{path.stem}", path, known)):
            if target.startswith("kvlayout._generated") or layer_of(target) not in ("layout", "errors"):
                wrong.append(f"codegen/{path.name} imports {target}")
    assert not wrong, "\n".join(wrong)
    assert not import_graph()["kvlayout.layout"]


def test_every_sub_package_says_what_it_knows() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        where = init.relative_to(ROOT)
        assert doc, f"{where} has no docstring"
        if init.parent.parent == PACKAGE and init.parent.name in LAYER_PACKAGES:
            assert "must not" in doc, f"{where} does not say what its layer must not know"


# kvlayout.transfer.nixl's modules, in the order its docstring says they import downward.
NIXL_MODULES = [
    "sides",
    "regions",
    "direct",
    "copies",
    "plans",
    "peer_staging",
    "prepped",
    "holds",
    "posting",
    "calibration",
]


def test_the_nixl_modules_import_downward_in_the_documented_order() -> None:
    graph = import_graph()
    package = "kvlayout.transfer.nixl"
    found = sorted(m.rpartition(".")[2] for m in graph if m.startswith(package + "."))
    assert found == sorted(NIXL_MODULES), f"{package} holds {found}; its docstring lists {NIXL_MODULES}"
    for i, name in enumerate(NIXL_MODULES):
        upward = {m for m in graph[f"{package}.{name}"] if m.rpartition(".")[2] in NIXL_MODULES[i:]}
        assert not upward, f"{package}.{name} imports {sorted(upward)}, which come after it"
    assert all(f"``{m}``" in (importlib.import_module(package).__doc__ or "") for m in NIXL_MODULES)


def test_the_top_level_holds_at_most_four_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 4, f"src/kvlayout/ holds {top}; a module belongs in its layer's folder"


def test_the_tests_mirror_the_package() -> None:
    for name in LAYER_PACKAGES:
        if name != "testing":  # kvlayout.testing is tested by every folder that uses it
            assert (ROOT / "tests" / name).is_dir(), f"tests/{name}/ is missing"
    for engine in ("vllm", "sglang", "atom", "trtllm", "max"):
        assert (ROOT / "tests" / "integrations" / engine).is_dir()


# -- public paths -------------------------------------------------------------------------


@pytest.mark.parametrize("name", kvlayout.__all__)
def test_every_public_name_imports_from_the_package(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from kvlayout import {name}", namespace)
    assert namespace[name] is getattr(kvlayout, name)


# What each public module exports (those before the package was split into layers, and since).
PUBLIC_MODULES = {
    "kvlayout.transfer": ["TransferError", "TransferPlan", "chunk_shape", "load_blocks", "prepare", "store_blocks"],
    "kvlayout.testing": ["CASES", "RegistrationCase", "coords_for", "layout_names", "layouts", "registrations", "sizes_for"],
    "kvlayout.detection": ["DetectionError", "normalize_and_discover_per_layer_formats", "normalize_kv_and_discover_format"],
    "kvlayout.integrations.vllm": [
        "KV_CACHE_GROUP_EDITS", "OPAQUE_PAGE_DTYPE", "OPAQUE_PAGE_FORMAT", "BlockGranularityError", "GroupProblem",
        "KVCacheGroupEdit", "KVCacheGroupEditError", "MambaStateListEdit", "MambaStateRowsEdit", "SpecKind",
        "SubpagedAttentionEdit", "SubpagedMLAEdit", "UnsupportedKVCacheGroupsError", "apply_kv_cache_group_edits",
        "check_block_granularity", "declares_slot_compression", "find_kv_cache_group_edit",
        "find_unsupported_kv_cache_groups", "spec_kind", "validate_kv_cache_groups",
    ],
    "kvlayout.integrations.sglang": ["MAMBA_TYPES", "MambaPoolError", "mamba_state_pools"],
    "kvlayout.integrations.atom": ["IndexerPagesError", "ShuffledPoolError", "indexer_pages", "shuffled_kv_pools"],
    "kvlayout.integrations.trtllm": ["KvCacheLayoutError", "MambaStateError", "kv_cache_layout_pools", "mamba_state_pools"],
    "kvlayout.integrations.max": ["RecurrentStateError", "recurrent_state_pages"],
    "kvlayout.transfer.nixl": [  # before it was split into modules
        "DEFAULT_COST", "CostModel", "Descriptors", "Estimate", "LocalSide", "MapSide", "NixlError",
        "NixlMap", "NixlTimeoutError", "PeerStaging", "Plan", "Prepped", "PreppedList",
        "RefusedDescriptorError", "Registered", "Stage", "StageNotifs", "Staging", "Transfer",
        "TransferResult", "calibrate", "copy_byte_runs", "descriptors", "estimate", "local_side",
        "make_agent", "plan", "prep_lists", "prepare_transfer", "register", "stage", "stage_notif", "transfer",
        "unstage", "wait"
    ],
}  # fmt: skip


@pytest.mark.parametrize(("module", "names"), PUBLIC_MODULES.items())
def test_public_module_paths_keep_their_names(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    missing = [n for n in names if not hasattr(imported, n)]
    assert not missing, f"{module} no longer exports {missing}"
    assert set(names) <= set(imported.__all__)


def test_python_m_kvlayout_and_the_console_script_run() -> None:
    for argv in (
        [sys.executable, "-m", "kvlayout", "--version"],
        [str(Path(sys.executable).parent / "kvlayout"), "--version"],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"{argv}: {done.stderr}"
        assert done.stdout.strip().endswith(kvlayout.__version__)
