"""Load ``layouts.yaml`` into a checked :class:`Catalog`, every error with its line.

Mappings reject unknown and duplicate keys; every format name is parsed with the YAML's
own vocabulary; cross-entry checks (unique values, names and layouts) run last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvlayout.errors import CatalogError, KVLayoutError
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.parser import parse
from kvlayout.layout.vocabulary import Region, Role, Token, Vocabulary

__all__ = ["Catalog", "Deprecation", "DescriptorField", "Engine", "FormatEntry", "load_catalog"]


@dataclass(frozen=True)
class Deprecation:
    replaced_by: str
    reason: str


@dataclass(frozen=True)
class FormatEntry:
    value: int
    layout: Layout
    backends: tuple[str, ...]
    engines: tuple[str, ...]
    deprecated: Deprecation | None
    line: int
    path: str = "layouts.yaml"

    @property
    def name(self) -> str:
        return str(self.layout)


@dataclass(frozen=True)
class DescriptorField:
    name: str
    meaning: str
    role: Role | None = None
    minimum: int = 0  # the smallest value a usable descriptor may hold


@dataclass(frozen=True)
class Engine:
    """A serving engine: its ``EngineType`` value and the name messages use."""

    value: str
    label: str

    @property
    def member(self) -> str:
        return self.value.upper()


@dataclass(frozen=True)
class Catalog:
    path: str
    vocabulary: Vocabulary
    formats: tuple[FormatEntry, ...]
    descriptor: tuple[DescriptorField, ...]
    engines: tuple[Engine, ...] = ()


class _Reader:
    """Walks a composed YAML node tree, turning nodes into values with line numbers."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, node: yaml.Node, problem: str) -> CatalogError:
        return CatalogError(self.path, node.start_mark.line + 1, problem)

    def mapping(
        self, node: yaml.Node, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
    ) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{what} must be a mapping")
        out: dict[str, yaml.Node] = {}
        allowed = required + optional
        for key_node, value_node in node.value:
            key = key_node.value
            if key in out:
                raise self.error(key_node, f"{what} has the key {key!r} twice")
            if key not in allowed:
                raise self.error(
                    key_node, f"{what} has an unknown key {key!r} (allowed: {', '.join(allowed)})"
                )
            out[key] = value_node
        for key in required:
            if key not in out:
                raise self.error(node, f"{what} is missing the key {key!r}")
        return out

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, f"{what} must be a list")
        return list(node.value)

    def string(self, node: yaml.Node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, f"{what} must be a string")
        return str(node.value)

    def integer(self, node: yaml.Node, what: str) -> int:
        if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:int":
            raise self.error(node, f"{what} must be an integer, got {getattr(node, 'value', node)!r}")
        return int(node.value)

    def boolean(self, node: yaml.Node, what: str) -> bool:
        if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:bool":
            raise self.error(node, f"{what} must be true or false")
        return node.value.lower() in ("true", "yes", "on")

    def strings(self, node: yaml.Node, what: str) -> tuple[str, ...]:
        return tuple(self.string(n, what) for n in self.sequence(node, what))


def _role(r: _Reader, node: yaml.Node, what: str) -> Role:
    name = r.string(node, f"{what} role")
    allowed = [x.value for x in Role if x.declared]
    if name not in allowed:
        derived = " (derived by the algebra, never declared)" if name in (x.value for x in Role) else ""
        raise r.error(node, f"{what} has an unknown role {name!r}{derived} (allowed: {', '.join(allowed)})")
    return Role(name)


def _positive(r: _Reader, node: yaml.Node, what: str) -> int:
    value = r.integer(node, what)
    if value <= 0:
        raise r.error(node, f"{what} must be positive, got {value}")
    return value


def _tokens(r: _Reader, node: yaml.Node) -> Vocabulary:
    if not isinstance(node, yaml.MappingNode):
        raise r.error(node, "tokens must be a mapping of token name to its meaning")
    defined: dict[str, Token] = {}
    seen: set[str] = set()
    for key_node, value_node in node.value:
        name = key_node.value
        if name in seen:
            raise r.error(key_node, f"token {name} is defined twice")
        seen.add(name)
        if not name.isupper() or name == "X" or not name.isalnum():
            raise r.error(key_node, f"token name {name!r} must be upper-case letters and digits, not X")
        what = f"token {name}"
        m = r.mapping(
            value_node,
            what,
            ("meaning",),
            ("role", "literal", "fuses", "region", "label", "keep_label", "choices", "example", "small"),
        )
        role = _role(r, m["role"], what) if "role" in m else None
        fuses: list[Token] = []
        for part_node in r.sequence(m["fuses"], f"{what} fuses") if "fuses" in m else []:
            part = r.string(part_node, f"{what} fuses")
            if part not in defined:
                raise r.error(part_node, f"{what} fuses {part}, which is not defined above it")
            fuses.append(defined[part])
        region = None
        if "region" in m:
            rm = r.mapping(m["region"], f"{what} region", ("rows", "width"), ("dtype",))
            rows = r.string(rm["rows"], f"{what} region rows")
            if rows not in defined or defined[rows].role is not Role.TOKEN:
                raise r.error(
                    rm["rows"], f"{what} region rows must be a token axis defined above it, not {rows}"
                )
            width = r.integer(rm["width"], f"{what} region width")
            if width <= 0:
                raise r.error(rm["width"], f"{what} region width must be positive")
            dtype = r.string(rm["dtype"], f"{what} region dtype") if "dtype" in rm else None
            bits = re.search(r"\d+", dtype) if dtype is not None else None
            if dtype is not None and (not dtype.isidentifier() or bits is None or int(bits.group()) % 8):
                raise r.error(
                    rm["dtype"], f"{what} region dtype must name a dtype of whole bytes, not {dtype!r}"
                )
            region = Region(defined[rows], width, dtype)
        literal = r.integer(m["literal"], f"{what} literal") if "literal" in m else None
        kinds = [k for k, present in (("role", role), ("fuses", fuses), ("region", region)) if present]
        if len(kinds) > 1:
            raise r.error(value_node, f"{what} has {' and '.join(kinds)}; a token is one of them")
        if not kinds and literal is None:
            raise r.error(value_node, f"{what} needs a role, a literal, fuses or a region")
        sized = literal is None and region is None and not fuses
        choices: tuple[int, ...] = ()
        if "choices" in m:
            if not sized:
                raise r.error(
                    m["choices"], f"{what} has choices, but only a sized token (a role, no literal) can"
                )
            choices = tuple(
                _positive(r, n, f"{what} choice") for n in r.sequence(m["choices"], f"{what} choices")
            )
            if not choices or len(set(choices)) != len(choices):
                raise r.error(m["choices"], f"{what} choices must be distinct sizes, at least one")
        examples: dict[str, int] = {}
        for key in ("example", "small"):
            if key in m:
                if literal is not None or region is not None:
                    raise r.error(m[key], f"{what} has a literal size or is a region, so it takes no {key}")
                examples[key] = _positive(r, m[key], f"{what} {key}")
                if choices and examples[key] not in choices:
                    raise r.error(m[key], f"{what} {key} {examples[key]} is not one of its choices")
        defined[name] = Token(
            name=name,
            meaning=" ".join(r.string(m["meaning"], f"{what} meaning").split()),
            role=role,
            literal=literal,
            fuses=tuple(fuses),
            region=region,
            label=r.string(m["label"], f"{what} label") if "label" in m else None,
            keep_label=r.boolean(m["keep_label"], f"{what} keep_label") if "keep_label" in m else False,
            choices=choices,
            example=examples.get("example"),
            small=examples.get("small"),
        )
    return Vocabulary(tuple(defined.values()))


def _engines(r: _Reader, node: yaml.Node) -> tuple[Engine, ...]:
    if not isinstance(node, yaml.MappingNode) or not node.value:
        raise r.error(node, "engines must be a mapping of engine value to its label")
    out: list[Engine] = []
    for key_node, value_node in node.value:
        value = key_node.value
        if not isinstance(value, str) or not value.isidentifier() or value != value.lower():
            raise r.error(key_node, f"engine {value!r} must be a lower-case identifier")
        if any(e.value == value for e in out):
            raise r.error(key_node, f"engine {value} is defined twice")
        m = r.mapping(value_node, f"engine {value}", ("label",))
        out.append(Engine(value, r.string(m["label"], f"engine {value} label")))
    return tuple(out)


def _check_roles(r: _Reader, node: yaml.Node, name: str, layout: Layout) -> None:
    """Every role a spec accessor reads must resolve on the layout's structure."""
    for role in Role:
        problem = algebra.role_problem(layout, role)
        if problem is not None:
            raise r.error(node, f"format {name}: the {role.value} role does not resolve: {problem}")


def _formats(
    r: _Reader, node: yaml.Node, vocabulary: Vocabulary, grammar: Path, engines: tuple[Engine, ...]
) -> tuple[FormatEntry, ...]:
    entries: list[FormatEntry] = []
    by_value: dict[int, FormatEntry] = {}
    by_name: dict[str, FormatEntry] = {}
    for item in r.sequence(node, "formats"):
        m = r.mapping(item, "a format", ("value", "name", "backends", "engines"), ("deprecated",))
        name = r.string(m["name"], "a format name")
        what = f"format {name}"
        value = r.integer(m["value"], f"{what} value")
        if value < 0:
            raise r.error(m["value"], f"{what} value must be non-negative")
        try:
            layout = parse(name, vocabulary, grammar=grammar)
        except KVLayoutError as e:
            raise r.error(m["name"], str(e)) from None
        _check_roles(r, m["name"], name, layout)
        known = [e.value for e in engines]
        for engine_node in r.sequence(m["engines"], f"{what} engines"):
            engine = r.string(engine_node, f"{what} engines")
            if engine not in known:
                raise r.error(
                    engine_node,
                    f"{what} names engine {engine!r}, which is not an engine ({', '.join(known)})",
                )
        deprecated = None
        if "deprecated" in m:
            dm = r.mapping(m["deprecated"], f"{what} deprecated", ("replaced_by", "reason"))
            deprecated = Deprecation(
                r.string(dm["replaced_by"], f"{what} replaced_by"), r.string(dm["reason"], f"{what} reason")
            )
        entry = FormatEntry(
            value=value,
            layout=layout,
            backends=r.strings(m["backends"], f"{what} backends"),
            engines=r.strings(m["engines"], f"{what} engines"),
            deprecated=deprecated,
            line=item.start_mark.line + 1,
            path=r.path,
        )
        if value in by_value:
            prior = by_value[value]
            raise r.error(
                m["value"], f"{what} has value {value}, which {prior.name} at line {prior.line} already has"
            )
        for prior in entries:  # a name is its layout, so this also catches a repeated name
            if prior.layout == layout:
                raise r.error(m["name"], f"{what} has the same layout as {prior.name} at line {prior.line}")
        by_value[value] = by_name[name] = entry
        entries.append(entry)
    for entry in entries:
        if entry.deprecated is not None and entry.deprecated.replaced_by not in by_name:
            raise CatalogError(
                r.path,
                entry.line,
                f"format {entry.name} is replaced by {entry.deprecated.replaced_by}, which is not a format",
            )
    if not entries:
        raise r.error(node, "formats must list at least one format")
    return tuple(sorted(entries, key=lambda e: e.value))


def load_catalog(path: Path, grammar: Path, display_path: str | None = None) -> Catalog:
    """Read and check a layouts YAML, parsing names with ``grammar``; errors name
    ``display_path`` (default: the file name)."""
    shown = display_path or path.name
    r = _Reader(shown)
    try:
        root = yaml.compose(path.read_text())
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else 1
        raise CatalogError(shown, line, f"not valid YAML: {e.problem}") from None
    if root is None:
        raise CatalogError(shown, 1, "the file is empty")
    top = r.mapping(root, "the file", ("tokens", "engines", "formats", "descriptor"))
    vocabulary = _tokens(r, top["tokens"])
    engines = _engines(r, top["engines"])
    formats = _formats(r, top["formats"], vocabulary, grammar, engines)
    descriptor: list[DescriptorField] = []
    for item in r.sequence(top["descriptor"], "descriptor"):
        fm = r.mapping(item, "a descriptor field", ("name", "meaning"), ("role", "minimum"))
        field_name = r.string(fm["name"], "a field name")
        minimum = r.integer(fm["minimum"], f"descriptor field {field_name} minimum") if "minimum" in fm else 0
        if minimum < 0:
            raise r.error(fm["minimum"], f"descriptor field {field_name} minimum must be >= 0")
        role = _role(r, fm["role"], f"descriptor field {field_name}") if "role" in fm else None
        prior = next((f for f in descriptor if role is not None and f.role is role), None)
        if prior is not None and role is not None:
            raise r.error(
                fm["role"], f"descriptor fields {prior.name} and {field_name} both have role {role.value}"
            )
        descriptor.append(
            DescriptorField(field_name, " ".join(r.string(fm["meaning"], "meaning").split()), role, minimum)
        )
    return Catalog(shown, vocabulary, formats, tuple(descriptor), engines)
