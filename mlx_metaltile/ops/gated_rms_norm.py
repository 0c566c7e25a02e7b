"""gated_rms_norm: ``w * y * rsqrt(mean(y^2) + eps) * silu(z)`` in one kernel.

The post-norm of Gated-DeltaNet layers (Qwen3-Next / Qwen3.5): ``y``, ``z`` and ``weight``
may each be float32, float16 or bfloat16; the output has y's dtype, as mlx-lm's
``Qwen3NextRMSNormGated`` returns its hidden_states' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from .. import backends
from .._registry import Arg, KernelSpec, register, scalars
from ._common import (
    FLOAT_TYPES,
    memo_check,
    memo_plan,
    on_stream,
    require_array,
    require_finite_scalar,
    require_float,
    round_up,
    run_on,
    scalar,
)
from ._grad import shapeless_tracing

OP = "gated_rms_norm"
__all__ = ["gated_rms_norm", "gated_rms_norm_reference"]
N_READS = 4  # elements of a row held by each thread (matches the templates)
MAX_REGISTER_ROW = 1024 * N_READS  # longest row held in registers in one pass
MAX_SIMD_ROW = 32 * N_READS  # longest row one SIMD-group holds
SIMD_ROWS_PER_GROUP = 8
# Per backend, the fewest rows from which rows of MAX_SIMD_ROW < n <= MAX_REGISTER_ROW run
# gated_rms_norm_wide_row.metal and longer rows gated_rms_norm_simd_looped.metal (each
# header says why); a backend absent from a table never runs that kernel (Metal keeps the
# row and looped kernels). Plans read these once (clear_plans()).
WIDE_ROW_MIN_ROWS: dict[str, int] = {"cuda": 128}
WIDE_ROW_ITEMS = 16  # elements per thread of the wide-row kernel (its ITEMS: 16 or 32)
SIMD_LOOPED_MIN_ROWS: dict[str, int] = {"cuda": 1024}
SIMD_LOOPED_ITEMS = 8  # elements per lane and load step of that kernel (its ITEMS: 8 or 16)

_ARGS = (Arg("y", "T", 2), Arg("z", "ZT", 2), Arg("w", "WT", 1))
_OUTPUTS = (Arg("out", "T", 2),)
_EPS = Arg("eps", "float32")


def _bindings():
    """T: y / output dtype (the template's one parameter); ZT, WT: z's and weight's dtypes
    (any float dtype each, read through float())."""
    return ({"T": t, "ZT": zt, "WT": wt}
            for t in FLOAT_TYPES for zt in FLOAT_TYPES for wt in FLOAT_TYPES)


_COMMON = dict(outputs=_OUTPUTS, params=("T",), bindings=_bindings)

SIMD_ROWS_SPEC, REGISTER_SPEC, LOOPED_SPEC, WIDE_ROW_SPEC, SIMD_LOOPED_SPEC = register(
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
        cuda_launch_bounds=(1024, 2),  # the template's header says why
    ),
    KernelSpec(
        op=OP, variant="looped", template="gated_rms_norm_looped.metal",
        inputs=(*_ARGS, *scalars("n_cols"), _EPS), **_COMMON,
        geometry="n > 4096: one threadgroup of 1024 per row, row looped in 4096-chunks; "
                 "grid (1024, rows, 1)",
    ),
    KernelSpec(
        op=OP, variant="wide_row", template="gated_rms_norm_wide_row.metal",
        inputs=(*_ARGS, *scalars("n_cols"), _EPS), outputs=_OUTPUTS,
        params=("T", "ITEMS"),
        bindings=lambda: ({**b, "ITEMS": items} for b in _bindings() for items in (16, 32)),
        geometry="128 < n <= 4096 and rows >= WIDE_ROW_MIN_ROWS[backend]: one threadgroup "
                 "per row, TG = round_up(ceil(n/ITEMS), 32); grid (TG, rows, 1)",
    ),
    KernelSpec(
        op=OP, variant="simd_looped", template="gated_rms_norm_simd_looped.metal",
        inputs=(*_ARGS, *scalars("n_cols", "n_rows"), _EPS), outputs=_OUTPUTS,
        params=("T", "ITEMS"),
        bindings=lambda: ({**b, "ITEMS": items} for b in _bindings() for items in (8, 16)),
        geometry="n > 128 and rows >= SIMD_LOOPED_MIN_ROWS[backend]: one SIMD-group per "
                 "row, 8 rows per threadgroup of (32, 8, 1); grid (32, round_up(rows, 8), 1)",
    ),
)
BACKWARD_SPEC, BACKWARD_SUM_SPEC = register(
    KernelSpec(
        op=OP, variant="backward", template="gated_rms_norm_backward.metal",
        inputs=(*_ARGS, Arg("g", "T", 2), *scalars("n_cols", "n_rows", "rows_per_group"), _EPS),
        outputs=(Arg("dy", "T", 2), Arg("dz", "ZT", 2), Arg("dw_partial", "float32", 2)),
        params=("T", "ZT"), bindings=_bindings,
        geometry="the VJP: TG = min(1024, round_up(ceil(n/4), 32)); grid (TG, groups, 1), "
                 "threadgroup p takes rows_per_group consecutive rows",
    ),
    KernelSpec(
        op=OP, variant="backward_sum", template="gated_rms_norm_backward_sum.metal",
        inputs=(Arg("partial", "float32", 2), *scalars("n_cols", "n_parts")),
        outputs=(Arg("dw", "T", 1),), params=("T",),  # T: weight's dtype
        bindings=lambda: ({"T": t} for t in FLOAT_TYPES),
        geometry="dweight: one thread per column, TG = min(256, round_up(n, 32)); "
                 "grid (round_up(n, TG), 1, 1)",
    ),
)
BACKWARD_SPECS = (BACKWARD_SPEC, BACKWARD_SUM_SPEC)
MAX_DW_PARTIALS = 256  # threadgroups of the backward (rows of dweight's partial sums)


@memo_check
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


def _launcher(n: int, rows: int, eps: float, shape: tuple[int, ...], dtype: mx.Dtype,
              backend: str) -> Callable:
    """The kernel call of y [..., n] (``rows`` rows of ``shape``, in ``dtype``) on
    ``backend``, prepared once: returns ``launch(y, z, weight)``."""
    inputs = {"y": None, "z": None, "w": None, "n_cols": scalar(n, mx.uint32)}
    template = {"T": dtype}
    long_row = n > MAX_REGISTER_ROW
    if n <= MAX_SIMD_ROW or (long_row and rows >= SIMD_LOOPED_MIN_ROWS.get(backend, math.inf)):
        spec = SIMD_ROWS_SPEC
        if long_row:
            spec, template["ITEMS"] = SIMD_LOOPED_SPEC, SIMD_LOOPED_ITEMS
        inputs["n_rows"] = scalar(rows, mx.uint32)
        grid = (32, round_up(rows, SIMD_ROWS_PER_GROUP), 1)
        threadgroup, tg_memory = (32, SIMD_ROWS_PER_GROUP, 1), 0
    else:
        spec, per_thread = (LOOPED_SPEC, None) if long_row else (REGISTER_SPEC, N_READS)
        if not long_row and rows >= WIDE_ROW_MIN_ROWS.get(backend, math.inf):
            spec, per_thread = WIDE_ROW_SPEC, WIDE_ROW_ITEMS
            template["ITEMS"] = per_thread
        tg = 1024 if long_row else round_up(-(-n // per_thread), 32)
        grid, threadgroup, tg_memory = (tg, rows, 1), (tg, 1, 1), 2 * 32 * 4
    inputs["eps"] = scalar(eps, mx.float32)
    prepared = backends.prepare(
        spec, backend, inputs=inputs, template=template,
        outputs={"out": (shape, dtype)}, grid=grid, threadgroup=threadgroup,
        threadgroup_memory=tg_memory,
    )

    def launch(y, z, weight):
        (out,) = prepared(y, z, weight)
        return out

    return launch


def _backward_reference(y, z, weight, g, eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """(dy, dz, dweight) as msl_templates/gated_rms_norm_backward.metal computes them (float32,
    the row scaled by its max |y|), in pure MLX."""
    yf, zf, gf = y.astype(mx.float32), z.astype(mx.float32), g.astype(mx.float32)
    wf = weight.astype(mx.float32)
    n = yf.shape[-1]
    row_max = mx.max(mx.abs(yf), axis=-1, keepdims=True)
    m = mx.where(row_max > 0, row_max, 1.0)
    u = yf / m
    ms = mx.mean(u * u, axis=-1, keepdims=True)
    r = m * mx.sqrt(ms)
    se = math.sqrt(eps)
    t = r / se if se > 0 else mx.zeros_like(r)
    k = mx.where(r >= se, mx.rsqrt(ms) * mx.rsqrt(1.0 + (eps / r) / r),
                 (m / se if se > 0 else m) * mx.rsqrt(1.0 + t * t))  # K = m * rsqrt(..)
    sg = mx.sigmoid(zf)
    s = zf * sg
    a = gf * wf * s
    c = (k * k / n) * mx.sum(a * u, axis=-1, keepdims=True)
    dy = (a - c * u) * (k / m)
    dz = gf * wf * u * k * (sg * (1.0 + zf * (1.0 - sg)))
    dw = mx.sum((gf * u * k * s).reshape(-1, n), axis=0)
    return dy.astype(y.dtype), dz.astype(z.dtype), dw.astype(weight.dtype)


def _launch_backward(y, z, weight, g, n: int, rows: int, eps: float,
                     backend: str) -> tuple[mx.array, mx.array, mx.array]:
    """(dy, dz, dweight) for the cotangent g, from the fused backward kernel."""
    tg = min(1024, round_up(-(-n // N_READS), 32))
    per_group = -(-rows // MAX_DW_PARTIALS)
    groups = -(-rows // per_group)
    dy, dz, partial = backends.launch(
        BACKWARD_SPEC, backend,
        inputs={"y": y, "z": z, "w": weight, "g": g.astype(y.dtype),
                "n_cols": scalar(n, mx.uint32), "n_rows": scalar(rows, mx.uint32),
                "rows_per_group": scalar(per_group, mx.uint32), "eps": scalar(eps, mx.float32)},
        template={"T": y.dtype, "ZT": z.dtype},
        outputs={"dy": (y.shape, y.dtype), "dz": (z.shape, z.dtype),
                 "dw_partial": ((groups, n), mx.float32)},
        grid=(tg, groups, 1), threadgroup=(tg, 1, 1), threadgroup_memory=3 * 32 * 4,
    )
    # The partial sums added in one fixed order (no atomics: the same bits every run).
    tg = min(256, round_up(n, 32))
    (dw,) = backends.launch(
        BACKWARD_SUM_SPEC, backend,
        inputs={"partial": partial, "n_cols": scalar(n, mx.uint32),
                "n_parts": scalar(groups, mx.uint32)},
        template={"T": weight.dtype}, outputs={"dw": ((n,), weight.dtype)},
        grid=(round_up(n, tg), 1, 1), threadgroup=(tg, 1, 1),
    )
    return dy, dz, dw


@memo_plan
def _plan(y, z, weight, eps, backend: str, stream) -> Callable:
    """The call for these arguments' metadata on ``backend`` and ``stream``, built once:
    ``run(y, z, weight)``, the op as an mx.custom_function whose VJP is the fused backward
    kernel on a kernel backend, the same math as a pure-MLX composite on the reference
    backend; both run on the call's stream (the VJP runs later, at backward time). Reads no
    argument array but its shape and dtype."""
    n, rows, eps = _check_gated_rms_norm(y, z, weight, eps)
    on_stream(OP, stream)  # refuses what is not a stream
    shape, dtype = tuple(y.shape), y.dtype
    if rows == 0:
        def empty(y, z, weight):
            with on_stream(OP, stream):
                return mx.zeros(shape, dtype=dtype)
        return empty
    reference = backend == "reference"
    launch = None if reference else _launcher(n, rows, eps, shape, dtype, backend)

    def composite(y, z, weight):
        return _reference(y, z, weight, eps)

    # on the call's stream (MLX may trace it again later)
    op = mx.custom_function(run_on(stream, composite if reference else launch))

    @op.vjp
    def op_vjp(primals, cotangent, output):
        with on_stream(OP, stream):
            if reference:
                return _backward_reference(*primals, cotangent, eps)
            return _launch_backward(*primals, cotangent, n, rows, eps, backend)

    if not reference:
        return run_on(stream, op)

    def run(y, z, weight):
        if shapeless_tracing():  # no custom function (MLX cannot trace
            return _reference(y, z, weight, eps)  # one shapeless): MLX's autodiff
        return op(y, z, weight)

    return run_on(stream, run)


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

    Differentiable with respect to y, z and weight (``mx.grad`` / ``mx.vjp``): on a kernel
    backend through the fused backward kernel (msl_templates/gated_rms_norm_backward.metal),
    with dy in y's dtype, dz in z's and dweight in weight's.

    Reference backend: ``mx.compile(shapeless=True)`` (any rows and leading dims) and
    ``mx.vmap`` (any axis of y, z, weight) work. On metal / cuda MLX 0.32.4 refuses both
    with its own message (custom kernels have no vmap or shape inference there). The
    emulator refuses both (eager). README: "mx.compile(shapeless=True) and mx.vmap".
    """
    return _plan(y, z, weight, eps, backends.resolve_backend(), stream)(y, z, weight)
