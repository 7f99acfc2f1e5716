"""The tools layer: the ``kvlayout`` command and what it shows.

``cli`` (the console script and ``python -m kvlayout``), ``explain`` (a format's
offsets, term by term), ``picture`` (a block as SVG), ``demo`` (the walkthrough) and
``shapes`` (registration shapes written as text, for ``kvlayout detect --shape``),
``registrations`` (the registrations ``detect`` and ``plan`` build from those, and
``detect``) and ``plan_command`` (``plan``).

Tools use every layer, read-only, through the same functions a library user calls. They
must not be imported by any other layer, and must not hold layout facts of their own.
"""
