"""Hypothesis strategies for testing code against every KV cache layout.

For people who test their own kernels and connectors (and for kvlayout's own tests)::

    from hypothesis import given
    from kvlayout.testing import registrations

    @given(registrations())
    def test_my_connector_reads_every_layout(case):
        fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
        assert my_block_count(kv, fmt) == case.nb

- :func:`registrations` draws a :class:`RegistrationCase`: real tensors shaped, strided
  and nested the way an engine registers them, its hints, and the format and geometry
  detection must find (``engine``, ``fmt``, ``nl``, ``nb``, ``bs``, ``nh``, ``hs``,
  ``dtype``, ``leaves`` in pointer-table order).
- :func:`layout_names`, :func:`layouts`, :func:`sizes_for`, :func:`coords_for`: names,
  parsed layouts, sizes and coordinates for the layout algebra.
- :mod:`kvlayout.testing.vllm` (needs vLLM): vLLM 0.33's own spec objects and
  registrations for hybrid models, allocated as vLLM allocates them.

Needs ``hypothesis`` (not a dependency of kvlayout itself). It uses the package's public
names and the layout algebra; the layers below it must not import it (only the demo,
a tool, and the tests do).
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as e:  # pragma: no cover - hypothesis is a test dependency
    raise ImportError("kvlayout.testing needs hypothesis (pip install hypothesis)") from e

from kvlayout.testing.registrations import CASES, RegistrationCase, registrations
from kvlayout.testing.strategies import coords_for, layout_names, layouts, sizes_for

__all__ = ["CASES", "RegistrationCase", "coords_for", "layout_names", "layouts", "registrations", "sizes_for"]
