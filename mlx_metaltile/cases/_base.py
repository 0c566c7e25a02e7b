"""What every op's cases module shares: the benchmark case record, float64 conversion and
the one tolerance check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .._registry import TOLERANCES

DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # the benchmark order
FLOAT32_TINY = 2.0**-126  # float32's smallest normal: float32 arithmetic may flush below it


@dataclass(frozen=True)
class BenchCase:
    """Fresh inputs (``make``) and three callables over them: ours (the public op on the
    selected backend), the native MLX composite it replaces, and a float64 NumPy oracle
    written from the math. ``nbytes`` counts every input read once plus the outputs."""

    op: str
    label: str
    dtype: mx.Dtype
    make: Callable[[np.random.Generator], dict]
    ours: Callable[..., mx.array]
    native: Callable[..., mx.array] | None
    oracle: Callable[..., np.ndarray]
    nbytes: int
    flops: int
    quick: bool = False  # part of the short default run
    # float64 sum of |terms| behind each output, for the tolerance's accumulation term
    # (reductions such as matmuls); None: |oracle| (elementwise ops).
    magnitude: Callable[..., np.ndarray] | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).rsplit(".", 1)[-1]

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}-{self.dtype_name}"


def to_f64(a) -> np.ndarray:
    """An mx.array (any float dtype, bfloat16 included) or array-like as float64 NumPy."""
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        return np.array(a).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


f64 = to_f64


def assert_close(got, want, dtype, magnitude=None, what: str = "",
                 underflow_scale=None) -> None:
    """|got - want| <= atol + rtol*|want| + accum*magnitude + FLOAT32_TINY*underflow_scale
    elementwise, for ``dtype``'s row of the tolerance table (mlx_metaltile._registry).

    ``magnitude`` is the float64 sum of |terms| behind each output (defaults to |want|);
    ``underflow_scale`` is the factor by which the op multiplies an intermediate that may
    fall below float32's normal range (FLOAT32_TINY; defaults to 0). NaN in ``got`` always
    fails (outputs never written stay poisoned).
    """
    name = str(dtype).rsplit(".", 1)[-1]
    tol = TOLERANCES[name]
    got = to_f64(got)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what} shape {got.shape} != expected {want.shape}")
    limit = bound(want, dtype, magnitude, underflow_scale)
    err = np.abs(got - want)
    bad = ~(err <= limit)  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what} {int(bad.sum())}/{bad.size} elements out of tolerance ({name}: {tol}); "
            f"first at {idx}: got {got[idx]!r}, want {want[idx]!r}, bound {limit[idx]:.3g}; "
            f"max err {np.nanmax(np.where(np.isnan(err), np.inf, err)):.3g}")


def bound(want, dtype, magnitude=None, underflow_scale=None) -> np.ndarray:
    """The elementwise bound on |got - want|: the one tolerance formula (see Tolerance in
    mlx_metaltile._registry), for tests, benchmarks and ``python -m mlx_metaltile bench``."""
    tol = TOLERANCES[str(dtype).rsplit(".", 1)[-1]]
    want = np.asarray(want, dtype=np.float64)
    mag = np.abs(want) if magnitude is None else np.asarray(magnitude, dtype=np.float64)
    out = tol.atol + tol.rtol * np.abs(want) + tol.accum * mag
    if underflow_scale is not None:
        out = out + FLOAT32_TINY * np.asarray(underflow_scale, dtype=np.float64)
    return out
