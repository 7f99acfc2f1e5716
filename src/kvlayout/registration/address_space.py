"""Where memory can be: the bounds every check of a caller's or a peer's addresses uses.

A peer's description, a staging buffer a peer names, the spans a local copy may touch
and a prepped list's unit are all refused by the same rule: memory starts past the null
page and ends by 2**57, which no host (5-level paging) or device address reaches."""

from __future__ import annotations

import numpy as np

NULL_PAGE = 4096  # no mapping starts below it
MAX_END = 2**57  # no address reaches it
MAX_END_TEXT = "2**57"  # how messages name MAX_END


def unownable(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which ``(start, bytes)`` spans no process can own: in the null page, of a negative
    size, or past :data:`MAX_END`; compared without a sum, which would wrap in uint64."""
    return (  # type: ignore[no-any-return]
        (starts < NULL_PAGE)
        | (sizes < 0)
        | (starts > MAX_END)
        | (sizes > MAX_END - np.minimum(starts, MAX_END))
    )
