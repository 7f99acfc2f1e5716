"""Format names: the round trip, and the exact errors for malformed or meaningless names."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given

import kvlayout
from kvlayout import EngineKVFormat, KVLayoutError, LayoutSemanticError, LayoutSyntaxError, parse
from kvlayout.testing.strategies import layout_names


@pytest.mark.parametrize("fmt", list(EngineKVFormat), ids=lambda f: f.name)
def test_every_format_name_round_trips(fmt: EngineKVFormat) -> None:
    layout = parse(fmt.name)
    assert str(layout) == fmt.name
    assert layout == kvlayout.layout_of(fmt)
    assert hash(layout) == hash(kvlayout.layout_of(fmt))


@given(layout_names())
def test_generated_names_round_trip(name: str) -> None:
    try:
        layout = parse(name)
    except LayoutSemanticError:
        return  # the strategy can produce names without meaning; they must fail cleanly
    assert str(layout) == name
    assert parse(str(layout)) == layout


def test_layouts_are_frozen() -> None:
    layout = parse("NL_X_NB_BS_HS")
    with pytest.raises(AttributeError):
        layout.lists = ()  # type: ignore[misc]


def test_known_names_do_not_import_lark() -> None:
    was_loaded = "lark" in sys.modules
    parse("NL_X_TWO_NB_BS_NH_HS")
    assert was_loaded or "lark" not in sys.modules


SYNTAX_ERRORS = {
    "NL_X_nb": "invalid format name 'NL_X_nb': unexpected character 'n' at column 6\n  NL_X_nb\n       ^\n",
    "NL__NB": "invalid format name 'NL__NB': '_' must be followed by a token, not '_' at column 4\n  NL__NB\n     ^\n",
    "NL_X_NB_": "invalid format name 'NL_X_NB_': the name ends with '_' at column 8\n  NL_X_NB_\n         ^\n",
    "NL X": "invalid format name 'NL X': unexpected character ' ' at column 3\n  NL X\n    ^\n",
    "": "invalid format name '': the name is empty\n",
}


@pytest.mark.parametrize("name", list(SYNTAX_ERRORS))
def test_syntax_errors_point_at_the_column(name: str) -> None:
    with pytest.raises(LayoutSyntaxError) as info:
        parse(name)
    assert str(info.value).startswith(SYNTAX_ERRORS[name])
    assert str(info.value).endswith("a name is upper-case tokens joined by '_', with X between list levels")


SEMANTIC_ERRORS = {
    "X_NB_BS_HS": ("X separates list levels; it cannot start a name", "^"),
    "NL_X_NB_BS_HS_X": ("X separates list levels; it cannot end a name", "              ^"),
    "NL_X_X_NB_BS_HS": ("two X with no list level between them", "     ^"),
    "NL_X_FOO_BS_HS": (
        "unknown token 'FOO' (known tokens: NL, TWO, NB, BS, NBBS, NH, HS, CS, ONE, NP, BSV, BSS, BSK, BSV4, BSS4, KV)",
        "     ^^^",
    ),
    "NL_X_NB_NB_BS_HS": ("NB appears twice", "        ^^"),
    "NL_X_NB_NBBS_HS": ("NBBS fuses NB, which the name already has", "        ^^^^"),
    "NL_X_NBBS_BS_HS": ("BS is already folded into NBBS", "          ^^"),
    "NL_X_TWO_NB_BS_NH_CS": ("CS fuses TWO, which the name already has", "                  ^^"),
    "NL_TWO_X_NB_BS_HS": ("a list level is one token, this one has 2", "^^^^^^"),
    "NB_X_NL_BS_HS": ("NB cannot be a list level (only layer, K/V or plane tokens can)", "^^"),
    "NL_X_NB_HS": (
        "the name has no token role (tokens of that role: BS, NBBS, BSV, BSS, BSK, BSV4, BSS4)",
        "^^^^^^^^^^",
    ),
    "NB_BS_HS": ("the name has no layer role (tokens of that role: NL)", "^^^^^^^^"),
    "NL_X_NB_BSV_HS_BSS": ("regions must be the last axes of the tensor", "        ^^^"),
}


@pytest.mark.parametrize("name", list(SEMANTIC_ERRORS))
def test_semantic_errors_name_the_token(name: str) -> None:
    problem, caret = SEMANTIC_ERRORS[name]
    with pytest.raises(LayoutSemanticError) as info:
        parse(name)
    assert str(info.value) == f"format name {name!r}: {problem}\n  {name}\n  {caret}"


def test_errors_are_value_errors() -> None:
    assert issubclass(LayoutSyntaxError, KVLayoutError)
    assert issubclass(LayoutSemanticError, KVLayoutError)
    assert issubclass(KVLayoutError, ValueError)


def test_non_string_names_are_type_errors() -> None:
    with pytest.raises(TypeError, match=re.escape("a format name is a str, got int: 3")):
        parse(3)  # type: ignore[arg-type]
