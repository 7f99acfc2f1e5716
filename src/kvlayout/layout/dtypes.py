"""Element types by name, without torch: what a description may name, what the command
line takes, and how many bytes an element of each holds (the one table of them)."""

from __future__ import annotations

__all__ = ["DTYPE_SIZES", "SHORT_NAMES", "same_bytes"]

DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "uint8": 1, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
}  # fmt: skip
"""torch's dtype names (without ``torch.``) and their sizes in bytes."""

SHORT_NAMES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "uint8": "uint8", "int8": "int8",
}  # fmt: skip
"""The command line's dtype names, each for one of :data:`DTYPE_SIZES`."""


def same_bytes(a: str, b: str) -> bool:
    """Whether elements of dtypes ``a`` and ``b`` (names of :data:`DTYPE_SIZES`) are the
    same bytes, so a map may move one into the other: the same dtype, or an fp8 one and
    uint8, the dtype vLLM and SGLang register fp8 caches as (their kernels view the bytes
    as fp8; which fp8 is the engines' configuration, as on one engine)."""
    pair = {a, b}
    return a == b or ("uint8" in pair and any(d.startswith("float8") for d in pair))
