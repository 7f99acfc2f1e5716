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


def first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def storage_ptr(value: Any) -> int:
    return int(first_tensor(value).untyped_storage().data_ptr())
