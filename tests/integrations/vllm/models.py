"""The vLLM models and registrations the tests use: re-exported from
:mod:`kvlayout.testing.vllm` (one copy, shared with ``kvlayout demo``), plus
test-only helpers.

Importing this module skips the importing test module when vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# Before the import below: without vLLM the importing test module is skipped, not errored.
pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")

from kvlayout.testing.vllm import *  # noqa: F403  (one copy: the package's)
from kvlayout.transfer import block_map
from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side


def stored_then_loaded(group: Any, saved: list[int], loaded: list[int], rows: int) -> torch.Tensor:
    """A request's first ``rows`` rows stored from blocks ``saved`` into a chunk and loaded
    back into blocks ``loaded`` of the same group, by block maps; the chunk."""
    shape, dtype = chunk_shape_for(group, rows)
    assert shape[2] == rows
    chunk = torch.zeros(shape, dtype=dtype)
    block_map(group, chunk_side(group, chunk), saved, [0], num_tokens=rows).copy()
    block_map(chunk_side(group, chunk), group, [0], loaded, num_tokens=rows).copy()
    return chunk


def first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def storage_ptr(value: Any) -> int:
    return int(first_tensor(value).untyped_storage().data_ptr())
