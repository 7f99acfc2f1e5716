"""Modular MAX integration: what MAX hands its transfer paths beyond the KV buffer
``kvlayout.detect(values, "max", hints)`` reads.

:func:`recurrent_state_pages` reads a ``RecurrentStateBuffer`` (a hybrid model's
recurrent state pool: each state leaf's ``[num_blocks, bytes_per_page]`` uint8 pages a
device, which ``to_memory()`` hands MAX's transfer engine and host tier whole) as one
registration a leaf, whole pages by MAX's block ids. MAX is not imported: its objects are
read structurally.
"""

from kvlayout.integrations.max.states import RecurrentStateError, recurrent_state_pages

__all__ = ["RecurrentStateError", "recurrent_state_pages"]
