"""Comparison helpers over the one tolerance table (mlx_metaltile._registry.TOLERANCES)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_metaltile._registry import TOLERANCES, Tolerance

__all__ = ["FLOAT32_TINY", "TOLERANCES", "Tolerance", "assert_close", "to_f64"]

FLOAT32_TINY = 2.0**-126  # float32's smallest normal: float32 arithmetic may flush below it


def to_f64(a) -> np.ndarray:
    """An mx.array (any float dtype, bfloat16 included) or array-like as float64 NumPy."""
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        return np.array(a).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


def assert_close(got, want, dtype, magnitude=None, what: str = "",
                 underflow_scale=None) -> None:
    """|got - want| <= atol + rtol*|want| + accum*magnitude + FLOAT32_TINY*underflow_scale
    elementwise, for ``dtype``'s row of the table.

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
    mag = np.abs(want) if magnitude is None else np.asarray(magnitude, dtype=np.float64)
    bound = tol.atol + tol.rtol * np.abs(want) + tol.accum * mag
    if underflow_scale is not None:
        bound = bound + FLOAT32_TINY * np.asarray(underflow_scale, dtype=np.float64)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what} {int(bad.sum())}/{bad.size} elements out of tolerance ({name}: {tol}); "
            f"first at {idx}: got {got[idx]!r}, want {want[idx]!r}, bound {bound[idx]:.3g}; "
            f"max err {np.nanmax(np.where(np.isnan(err), np.inf, err)):.3g}")
