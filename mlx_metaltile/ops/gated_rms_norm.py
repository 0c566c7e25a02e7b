"""gated_rms_norm: ``w * y * rsqrt(mean(y^2) + eps) * silu(z)`` in one kernel.

The post-norm of Gated-DeltaNet layers (Qwen3-Next / Qwen3.5): ``y``, ``z`` and ``weight``
may each be float32, float16 or bfloat16; the output has y's dtype, as mlx-lm's
``Qwen3NextRMSNormGated`` returns its hidden_states' dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    FLOAT_TYPES,
    on_stream,
    require_array,
    require_finite_scalar,
    require_float,
    round_up,
    scalar,
)

OP = "gated_rms_norm"
__all__ = ["gated_rms_norm", "gated_rms_norm_reference"]
N_READS = 4  # elements of a row held by each thread (matches the templates)
MAX_REGISTER_ROW = 1024 * N_READS  # longest row held in registers in one pass
MAX_SIMD_ROW = 32 * N_READS  # longest row one SIMD-group holds
SIMD_ROWS_PER_GROUP = 8

_ARGS = (Arg("y", "T", 2), Arg("z", "ZT", 2), Arg("w", "WT", 1))
_OUTPUTS = (Arg("out", "T", 2),)
_EPS = Arg("eps", "float32")


def _bindings():
    """T: y / output dtype (the template's one parameter); ZT, WT: z's and weight's dtypes
    (any float dtype each, read through float())."""
    return ({"T": t, "ZT": zt, "WT": wt}
            for t in FLOAT_TYPES for zt in FLOAT_TYPES for wt in FLOAT_TYPES)


_COMMON = dict(outputs=_OUTPUTS, params=("T",), bindings=_bindings)

SIMD_ROWS_SPEC, REGISTER_SPEC, LOOPED_SPEC = register(
    KernelSpec(
        op=OP, variant="simd_rows", template="gated_rms_norm_simd_rows.metal",
        inputs=(*_ARGS, *scalars("n_cols", "n_rows"), _EPS), **_COMMON,
        geometry="n <= 128: one SIMD-group per row, 8 rows per threadgroup of (32, 8, 1); "
                 "grid (32, round_up(rows, 8), 1)",
    ),
    KernelSpec(
        op=OP, variant="row", template="gated_rms_norm.metal",
        inputs=(*_ARGS, *scalars("n_cols"), _EPS), **_COMMON,
        geometry="128 < n <= 4096: one threadgroup per row, TG = round_up(ceil(n/4), 32); "
                 "grid (TG, rows, 1)",
    ),
    KernelSpec(
        op=OP, variant="looped", template="gated_rms_norm_looped.metal",
        inputs=(*_ARGS, *scalars("n_cols"), _EPS), **_COMMON,
        geometry="n > 4096: one threadgroup of 1024 per row, row looped in 4096-chunks; "
                 "grid (1024, rows, 1)",
    ),
)


def _check_gated_rms_norm(y, z, weight, eps) -> tuple[int, int, float]:
    """Validate the inputs; return (n, rows, eps)."""
    if not (isinstance(y, mx.array) and isinstance(z, mx.array)
            and isinstance(weight, mx.array)):
        for name, arr in (("y", y), ("z", z), ("weight", weight)):
            require_array(OP, name, arr)
    for name, arr in (("y", y), ("z", z), ("weight", weight)):
        require_float(OP, name, arr)
    shape = z.shape
    if not shape:
        raise ValueError(f"[{OP}] z must have at least 1 dimension, got 0")
    if y.shape != shape:
        raise ValueError(f"[{OP}] y and z must have the same shape, got y {tuple(y.shape)} "
                         f"and z {tuple(shape)}")
    n = shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"[{OP}] weight must have shape ({n},) (the last axis of z), "
                         f"got {tuple(weight.shape)}")
    if n < 1:
        raise ValueError(f"[{OP}] the last axis (n) must be >= 1, got {n}")
    if n >= 2**31:
        raise ValueError(f"[{OP}] the last axis (n) must be < 2^31, got {n}")
    eps = require_finite_scalar(OP, "eps", eps, minimum=0.0)
    return n, math.prod(shape[:-1]), eps


def gated_rms_norm_reference(y: mx.array, z: mx.array, weight: mx.array,
                             eps: float = 1e-5) -> mx.array:
    """Pure-MLX composite of the same math (float32 inside, rounded once), scaled by the
    row's max |y| as the kernels are (msl_templates/common.h, mt_rms_factor), so any row
    whose RMS is a finite float32 is right; an all-zero row with eps = 0 gives NaN (0/0)."""
    _, _, eps = _check_gated_rms_norm(y, z, weight, eps)
    return _reference(y, z, weight, eps)


def _reference(y, z, weight, eps: float) -> mx.array:
    yf = y.astype(mx.float32)
    zf = z.astype(mx.float32)
    row_max = mx.max(mx.abs(yf), axis=-1, keepdims=True)
    m = mx.where(row_max > 0, row_max, 1.0)
    u = yf / m
    ms = mx.mean(u * u, axis=-1, keepdims=True)  # in [1/n, 1]
    r = m * mx.sqrt(ms)  # the row's RMS
    se = math.sqrt(eps)
    t = r / se if se > 0 else mx.zeros_like(r)
    k = mx.where(r >= se, mx.rsqrt(ms) * mx.rsqrt(1.0 + (eps / r) / r),
                 (m / se if se > 0 else m) * mx.rsqrt(1.0 + t * t))
    out = weight.astype(mx.float32) * u * k * (zf * mx.sigmoid(zf))
    return out.astype(y.dtype)


def _launch(y, z, weight, n: int, rows: int, eps: float, backend: str) -> mx.array:
    inputs = {"y": y, "z": z, "w": weight, "n_cols": scalar(n, mx.uint32)}
    if n <= MAX_SIMD_ROW:
        spec = SIMD_ROWS_SPEC
        inputs["n_rows"] = scalar(rows, mx.uint32)
        grid = (32, round_up(rows, SIMD_ROWS_PER_GROUP), 1)
        threadgroup, tg_memory = (32, SIMD_ROWS_PER_GROUP, 1), 0
    else:
        tg = round_up(-(-n // N_READS), 32) if n <= MAX_REGISTER_ROW else 1024
        spec = REGISTER_SPEC if n <= MAX_REGISTER_ROW else LOOPED_SPEC
        grid, threadgroup, tg_memory = (tg, rows, 1), (tg, 1, 1), 2 * 32 * 4
    inputs["eps"] = scalar(eps, mx.float32)
    (out,) = backends.launch(
        spec, backend, inputs=inputs, template={"T": y.dtype},
        outputs={"out": (y.shape, y.dtype)}, grid=grid, threadgroup=threadgroup,
        threadgroup_memory=tg_memory,
    )
    return out


def gated_rms_norm(y: mx.array, z: mx.array, weight: mx.array, eps: float = 1e-5, *,
                   stream=None) -> mx.array:
    """``weight * y * rsqrt(mean(y^2, -1) + eps) * silu(z)`` over the last axis, fused.

    Args:
      y: ``[..., n]`` float32/float16/bfloat16 (the normalised input); sets the output
        dtype (as mlx-lm's ``Qwen3NextRMSNormGated`` returns its hidden_states' dtype).
      z: ``[..., n]`` float32/float16/bfloat16 (the gate), any of them.
      weight: ``[n]`` float32/float16/bfloat16, any of them (as ``mx.fast.rms_norm``).
      eps: finite, >= 0, a Python or NumPy number; a runtime input (changing it does not
        rebuild the kernel). With eps = 0 an all-zero row gives NaN (the math's 0/0, as
        mx.fast.rms_norm).
      stream: MLX's StreamOrDevice (None, an mx.Stream, an mx.Device, mx.cpu / mx.gpu):
        where the composite's ops or the kernel run.

    Returns: an array of y's shape and dtype, computed in float32 and rounded once. Each row
    is scaled by its max |y| before squaring, so any row whose RMS is a finite float32 (from
    subnormal y to |y| near float32's max) is normalised right.
    """
    n, rows, eps = _check_gated_rms_norm(y, z, weight, eps)
    with on_stream(OP, stream):
        if rows == 0:
            return mx.zeros(y.shape, dtype=y.dtype)
        backend = backends.resolve_backend()
        if backend == "reference":
            return _reference(y, z, weight, eps)
        return _launch(y, z, weight, n, rows, eps, backend)
