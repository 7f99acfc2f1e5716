"""The kvlayout command line (grows with issue 6)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    return 0
