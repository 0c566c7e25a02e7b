"""Checks and small helpers shared by the op modules."""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)
INDEX_TYPES = (mx.uint32, mx.int32)
_FLOAT_SET = frozenset(FLOAT_TYPES)  # one hash instead of up to three comparisons


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def require_array(op: str, name: str, value) -> mx.array:
    if not isinstance(value, mx.array):
        raise TypeError(f"[{op}] {name} must be an mx.array, got {type(value).__name__}")
    return value


def require_float(op: str, name: str, arr: mx.array) -> mx.Dtype:
    """Check that ``arr`` is float32/float16/bfloat16; return its dtype."""
    dtype = arr.dtype
    if dtype not in _FLOAT_SET:
        raise TypeError(f"[{op}] {name} must be float32, float16 or bfloat16, "
                        f"got {dtype_name(dtype)}")
    return dtype


def require_ndim(op: str, name: str, arr: mx.array, ndim: int) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"[{op}] {name} must have {ndim} dimensions, got {arr.ndim} "
                         f"(shape {tuple(arr.shape)})")


def require_finite_scalar(op: str, name: str, value, *, minimum: float | None = None) -> float:
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"[{op}] {name} must be a Python float, got {type(value).__name__}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range (e.g. 10**400)
            raise ValueError(f"[{op}] {name} must be finite, got an int of "
                             f"{value.bit_length()} bits (beyond float's range)") from None
    if not math.isfinite(value):
        raise ValueError(f"[{op}] {name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"[{op}] {name} must be >= {minimum}, got {value}")
    return value


@lru_cache(maxsize=4096)
def scalar(value, dtype: mx.Dtype) -> mx.array:
    """A cached 0-d array for a runtime kernel input (no per-call allocation in a loop)."""
    return mx.array(value, dtype=dtype)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
