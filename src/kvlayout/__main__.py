"""``python -m kvlayout``: the command line (see kvlayout.tools.cli)."""

from kvlayout.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
