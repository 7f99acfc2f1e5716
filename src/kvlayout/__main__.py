"""``python -m kvlayout``: the command line (see kvlayout.cli)."""

from kvlayout.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
