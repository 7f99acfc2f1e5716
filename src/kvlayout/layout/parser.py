"""Format names -> :class:`~kvlayout.layout.ast.Layout`.

Two passes: the Lark grammar (``grammar/kvlayout.lark``, shipped as
``kvlayout/_generated/kvlayout.lark``) checks the syntax; then each word is looked up in
the vocabulary and the words are split into list levels at each ``X``. Names of the
generated formats are answered from the generated table, so Lark is imported only when
``parse`` meets a name it has not seen.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from kvlayout.errors import LayoutSemanticError, LayoutSyntaxError
from kvlayout.layout.ast import REQUIRED_ROLES, Layout
from kvlayout.layout.vocabulary import Token, Vocabulary

if TYPE_CHECKING:
    import lark

__all__ = ["GRAMMAR_PATH", "parse"]

GRAMMAR_PATH = Path(__file__).parent.parent / "_generated" / "kvlayout.lark"


def parse(name: str, vocabulary: Vocabulary | None = None, *, grammar: Path | None = None) -> Layout:
    """Parse a format name; ``str(parse(name)) == name`` for every valid name.

    ``vocabulary`` and ``grammar`` default to the generated ones; the generator passes
    its own (read from ``layouts.yaml`` and ``grammar/kvlayout.lark``). Raises
    :class:`LayoutSyntaxError` for a malformed name and :class:`LayoutSemanticError` for
    tokens that do not describe a layout.
    """
    if not isinstance(name, str):
        raise TypeError(f"a format name is a str, got {type(name).__name__}: {name!r}")
    if vocabulary is None:
        from kvlayout._generated.formats import LAYOUTS_BY_NAME
        from kvlayout._generated.vocabulary import VOCABULARY

        known = LAYOUTS_BY_NAME.get(name)
        if known is not None:
            return known
        vocabulary = VOCABULARY
    return _parse(name, vocabulary, grammar or GRAMMAR_PATH)


@functools.lru_cache(maxsize=512)
def _parse(name: str, vocabulary: Vocabulary, grammar: Path) -> Layout:
    words = _words(name, grammar)
    if words[0][0] == "X":
        raise LayoutSemanticError(name, 0, 1, "X separates list levels; it cannot start a name")
    if words[-1][0] == "X":
        raise LayoutSemanticError(
            name, len(name) - 1, len(name), "X separates list levels; it cannot end a name"
        )
    levels: list[list[tuple[str, int]]] = [[]]
    for word, start in words:
        if word == "X":
            if not levels[-1]:
                raise LayoutSemanticError(name, start, start + 1, "two X with no list level between them")
            levels.append([])
        else:
            levels[-1].append((word, start))
    resolved = [[_lookup(name, vocabulary, w, s) for w, s in level] for level in levels]
    for level, words_of_level in zip(resolved[:-1], levels[:-1], strict=True):
        if len(level) != 1:
            start = words_of_level[0][1]
            end = words_of_level[-1][1] + len(words_of_level[-1][0])
            raise LayoutSemanticError(
                name, start, end, f"a list level is one token, this one has {len(level)}"
            )
    _check_required(name, vocabulary, [t for level in resolved for t in level])
    layout = Layout(lists=tuple(level[0] for level in resolved[:-1]), tensor=tuple(resolved[-1]))
    if str(layout) != name:  # the AST must give the name back exactly
        raise AssertionError(f"{layout} != {name}")
    return layout


def _check_required(name: str, vocabulary: Vocabulary, tokens: list[Token]) -> None:
    """Every layout needs the layer, block, token and element roles; say which tokens of
    the vocabulary would give a missing one."""
    have = {r for t in tokens for r in t.roles}
    for role in REQUIRED_ROLES:
        if role not in have:
            names = [t.name for t in vocabulary.tokens if role in t.roles]
            raise LayoutSemanticError(
                name,
                0,
                len(name),
                f"the name has no {role.value} role (tokens of that role: {', '.join(names)})",
            )


def _lookup(name: str, vocabulary: Vocabulary, word: str, start: int) -> Token:
    token = vocabulary.get(word)
    if token is None:
        known = ", ".join(vocabulary)
        raise LayoutSemanticError(
            name, start, start + len(word), f"unknown token {word!r} (known tokens: {known})"
        )
    return token


@functools.cache
def _grammar(path: Path) -> lark.Lark:
    import lark

    return lark.Lark(path.read_text(), start="name", parser="lalr", propagate_positions=True)


def _words(name: str, grammar: Path) -> list[tuple[str, int]]:
    """The name's words with their start columns (0-based), or a LayoutSyntaxError."""
    import lark

    if not name:
        raise LayoutSyntaxError(name, 0, "the name is empty")
    try:
        tree = _grammar(grammar).parse(name)
    except lark.UnexpectedCharacters as e:
        pos = e.column - 1
        raise LayoutSyntaxError(name, pos, f"unexpected character {name[pos]!r}") from None
    except lark.UnexpectedToken as e:
        if e.token.type == "$END":
            raise LayoutSyntaxError(name, len(name) - 1, "the name ends with '_'") from None
        pos = e.column - 1
        raise LayoutSyntaxError(name, pos, f"'_' must be followed by a token, not {name[pos]!r}") from None
    words: list[tuple[str, int]] = []
    for word in tree.children:
        assert isinstance(word, lark.Tree)
        (leaf,) = word.children
        assert isinstance(leaf, lark.Token) and leaf.start_pos is not None
        words.append((str(leaf), leaf.start_pos))
    return words
