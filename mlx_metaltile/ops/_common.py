"""Checks and small helpers shared by the op modules."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from functools import lru_cache

import mlx.core as mx

from .. import _device
from .._registry import Arg, KernelSpec, grid

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
        value = float(value)
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


# ---- affine-quantized weights (mx.quantize's default mode) ------------------------------

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def require_int_choice(op: str, name: str, value, choices: tuple[int, ...]) -> int:
    """An int (NumPy integers too) among ``choices``, returned as a plain int (a plain int
    keys the template)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"[{op}] {name} must be an int in {choices}, got {type(value).__name__}")
    value = int(value)
    if value not in choices:
        raise ValueError(f"[{op}] {name} must be one of {choices}, got {value}")
    return value


def check_affine_quantized(op: str, x, w, scales, biases, indices, group_size,
                           bits) -> tuple[int, int]:
    """The checks every op over ``mx.quantize``d expert weights makes: array types, x
    float, scales and biases in x's dtype, w packed uint32, uint32/int32 expert ids, bits
    and group_size among the supported ones. Shapes are each op's. Returns (group_size, bits)."""
    for name, arr in (("x", x), ("w", w), ("scales", scales), ("biases", biases),
                      ("indices", indices)):
        require_array(op, name, arr)
    bits = require_int_choice(op, "bits", bits, BITS)
    group_size = require_int_choice(op, "group_size", group_size, GROUP_SIZES)
    if w.dtype != mx.uint32:
        raise TypeError(f"[{op}] w must be uint32 (packed as mx.quantize returns it), "
                        f"got {dtype_name(w.dtype)}")
    require_float(op, "x", x)
    for name, arr in (("scales", scales), ("biases", biases)):
        if arr.dtype != x.dtype:
            raise TypeError(f"[{op}] {name} must have x's dtype {dtype_name(x.dtype)}, "
                            f"got {dtype_name(arr.dtype)}")
    if indices.dtype not in INDEX_TYPES:
        raise TypeError(f"[{op}] indices must be uint32 or int32, "
                        f"got {dtype_name(indices.dtype)}")
    return group_size, bits


# The leading arguments and the template of the kernels over them (T: x's dtype, I: the ids').
AFFINE_INPUTS = (Arg("x", "T", 2), Arg("w", "uint32", 3), Arg("scales", "T", 3),
                 Arg("biases", "T", 3), Arg("indices", "I", 1))
AFFINE_PARAMS = ("T", "BITS", "GROUP_SIZE")
affine_bindings = grid(T=FLOAT_TYPES, BITS=BITS, GROUP_SIZE=GROUP_SIZES, I=INDEX_TYPES)


def variant_reason(spec: KernelSpec, backend: str) -> str | None:
    """None if kernel variant ``spec`` runs on ``backend`` here, else why not."""
    for feature in spec.features:
        reason = _device.unsupported_reason(feature, backend)
        if reason is not None:
            return reason
    if backend not in spec.backends:
        return f"the {backend} backend does not run it"
    return None


def choose_variant(op: str, specs: Mapping[str, KernelSpec], variant, backend: str,
                   auto: Callable[[], str]) -> KernelSpec | None:
    """The kernel an op call runs: ``variant`` forced (checked against ``backend``) or
    ``auto()``'s pick; None on the reference backend, where forcing a variant is refused."""
    if variant is not None and (not isinstance(variant, str) or variant not in specs):
        raise ValueError(f"[{op}] variant must be None or one of {tuple(specs)}, "
                         f"got {variant!r}")
    if backend == "reference":
        if variant is not None:
            raise ValueError(f"[{op}] variant={variant!r} needs a kernel backend (metal, cuda, "
                             "emulator); the reference backend runs the pure-MLX composite")
        return None
    if variant is None:
        return specs[auto()]
    reason = variant_reason(specs[variant], backend)
    if reason is not None:
        raise ValueError(f"[{op}] variant {variant!r} is unavailable on the {backend} backend: "
                         f"{reason}")
    return specs[variant]
