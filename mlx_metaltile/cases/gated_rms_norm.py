"""gated_rms_norm: float64 oracle, float32 error scales, benchmark cases, checked calls."""

from __future__ import annotations

import contextlib
import functools
import importlib
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ._base import DTYPES, BenchCase, assert_close, grad_case, to_f64, verify

OP = "gated_rms_norm"


def oracle(y, z, weight, eps=1e-5):
    """out = w * y * rsqrt(mean(y^2) + eps) * silu(z), in float64."""
    y, z, w = to_f64(y), to_f64(z), to_f64(weight)
    inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    with np.errstate(over="ignore"):
        silu = z / (1.0 + np.exp(-z))
    return w * y * inv_rms * silu


def float32_error_scales(y, z, w, eps, want):
    """How float32 evaluation error scales, per output: (magnitude, underflow_scale) of
    assert_close.

    magnitude: |want| times 1 + |z|, since exp(-z) in float32 starts from -z rounded to
    float32 (a relative error that grows with |z|). underflow_scale: |w * y * inv_rms * z|,
    which multiplies sigmoid(z); below z ~ -87 sigmoid(z) is under float32's normal range
    (a float32 exp(-z) overflows, and the gate comes out as 0).
    """
    y, z, w = to_f64(y), to_f64(z), to_f64(w)
    inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    return np.abs(want) * (1.0 + np.abs(z)), np.abs(w * y * inv_rms * z)


def magnitude(y, z, weight, eps=1e-5):
    return float32_error_scales(y, z, weight, eps, oracle(y, z, weight, eps))[0]


def make_inputs(rng, lead, n, dtype, y_dtype):
    shape = (*lead, n)
    # Row magnitudes spread over [1e-3, 1] (large ones: the tests' large_inputs).
    row_scale = 10.0 ** rng.uniform(-3, 0, size=(*lead, 1))
    y = mx.array((rng.standard_normal(shape) * row_scale).astype(np.float32)).astype(y_dtype)
    z = mx.array((rng.standard_normal(shape) * 4.0).astype(np.float32)).astype(dtype)
    w = mx.array(rng.uniform(-2, 2, size=(n,)).astype(np.float32)).astype(dtype)
    return y, z, w


def run_and_check(y, z, w, eps, backend):
    """Run the op on ``backend``, prove one kernel ran, compare with the oracle (the
    output in y's dtype)."""
    before = backends.launch_count(backend=backend)
    out = mt.gated_rms_norm(y, z, w, eps=eps)
    mx.eval(out)
    if backend != "reference":  # prove a kernel ran (never the reference compared with itself)
        verify(backends.launch_count(backend=backend) == before + 1)
    dtype = y.dtype
    verify(out.dtype == dtype and tuple(out.shape) == tuple(z.shape))
    want = oracle(y, z, w, eps)
    mag, underflow_scale = float32_error_scales(y, z, w, eps, want)
    assert_close(out, want, dtype, magnitude=mag, underflow_scale=underflow_scale,
                 what=f"gated_rms_norm[{backend}]")


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend, so a variant added to the registry
# fails there until it has one here).
VARIANT_N = {"simd_rows": 100, "row": 1000, "looped": 5000}  # n that selects each


def _variant_call(n, backend, rng):
    y, z, w = make_inputs(rng, (3,), n, mx.bfloat16, mx.float32)
    run_and_check(y, z, w, 1e-5, backend)


VARIANT_CALLS = {v: functools.partial(_variant_call, n) for v, n in VARIANT_N.items()}


@contextlib.contextmanager
def wide_kernels_from(backend: str, rows: int):
    """On ``backend``, from ``rows`` rows, rows of 129 to 4096 run the wide_row variant and
    longer ones the simd_looped variant (cuda's plan), within the block."""
    from ..ops._common import clear_plans

    op_module = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")
    with (mt.nn.backend_entry(op_module.WIDE_ROW_MIN_ROWS, backend, rows),
          mt.nn.backend_entry(op_module.SIMD_LOOPED_MIN_ROWS, backend, rows)):
        clear_plans()  # plans read the tables once
        try:
            yield
        finally:
            clear_plans()


def _wide_call(n, backend, rng):
    with wide_kernels_from(backend, 1):
        _variant_call(n, backend, rng)


VARIANT_CALLS["wide_row"] = functools.partial(_wide_call, 1000)
VARIANT_CALLS["simd_looped"] = functools.partial(_wide_call, 5000)


def _backward_call(backend, rng):
    """The VJP (fused backward kernel, then dweight's sum) against the float64 gradients."""
    y, z, w = make_inputs(rng, (300,), 70, mx.bfloat16, mx.float32)
    g = mx.array(rng.standard_normal(z.shape).astype(np.float32)).astype(mx.bfloat16)
    _, grads = mx.vjp(mt.gated_rms_norm, [y, z, w], [g])
    for got, (want, mag), name in zip(grads, grad_oracle(y, z, w, g), ("dy", "dz", "dw"),
                                      strict=True):
        assert_close(got.reshape(want.shape), want, got.dtype, mag,
                     what=f"gated_rms_norm {name}[{backend}]")


VARIANT_CALLS["backward"] = VARIANT_CALLS["backward_sum"] = _backward_call


# ---- benchmarks -------------------------------------------------------------------------

@partial(mx.compile, shapeless=True)
def _precise_swiglu(h, gate, x):
    # The gate of mlx-lm's Qwen3-Next gated norm (mlx_lm/models/qwen3_next.py, since its
    # change "Ensure normalization does not promote to fp32"; before it, the model dtype's
    # swiglu(gate, x) = nn.silu(gate) * x, also compiled and shapeless).
    gate = nn.silu(gate.astype(mx.float32))
    x = x.astype(mx.float32)
    return (gate * x).astype(h.dtype)


def gated_rms_norm_native(y, z, weight, eps=1e-5):
    """What mlx-lm's Qwen3NextRMSNormGated computes: ``mx.fast.rms_norm`` of the hidden
    states, then a compiled (shapeless) float32 silu gate rounded to their dtype.

    In mlx-lm the hidden states reach the norm in the model dtype: the Gated-DeltaNet
    recurrence returns its float32 result cast to the input dtype (``y.astype(q.dtype)`` in
    mlx_lm/models/gated_delta.py). A float32 ``y`` is cast here the same way, so the native
    side of a "yf32" case pays that cast as a kernel of its own (mlx-lm's fused recurrence
    kernel writes the model dtype directly); its result has z's dtype, ours y's (float32).
    """
    h = y.astype(z.dtype)
    return _precise_swiglu(h, z, mx.fast.rms_norm(h, weight, eps))


# ---- gradients -------------------------------------------------------------------------

def grad_oracle(y, z, weight, g, eps=1e-5):
    """float64 ((dy, |terms|), (dz, |terms|), (dweight, |terms|)) of the VJP with cotangent
    g, from the math: out = w y k silu(z), k = (mean(y^2) + eps)^-1/2 over the last axis."""
    y, z, w, g = (to_f64(a) for a in (y, z, weight, g))
    n = y.shape[-1]
    y, z, g = (a.reshape(-1, n) for a in (y, z, g))
    k = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    sg = 1.0 / (1.0 + np.exp(-z))
    s = z * sg
    a = g * w * s
    dy = k * a - k**3 / n * y * np.sum(a * y, axis=-1, keepdims=True)
    dy_mag = np.abs(k * a) + k**3 / n * np.abs(y) * np.sum(np.abs(a * y), axis=-1,
                                                           keepdims=True)
    dz = g * w * y * k * sg * (1.0 + z * (1.0 - sg))  # silu'(z) = sg + z sg (1 - sg)
    dz_mag = np.abs(g * w * y * k) * sg * (1.0 + np.abs(z) * (1.0 - sg))
    terms = g * y * k * s
    return (dy, dy_mag), (dz, dz_mag), (terms.sum(0), np.abs(terms).sum(0))


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward (mx.vjp w.r.t. y, z, weight) against MLX's autodiff of the native
    composite. bytes: the forward's (y, z, weight read, out written) plus the backward's
    (y, z, weight, g read, dy, dz, dweight written)."""
    out = []
    # 16384 x 128: Qwen3-Next's per-head norm over 512 tokens of 32 heads (a fine-tune).
    for rows, n, quick in [(32, 2048, True), (4096, 2048, False), (4096, 4096, False),
                           (16384, 128, False)]:
        for dtype in DTYPES:
            def make(rng, rows=rows, n=n, dtype=dtype):
                a = [mx.array(rng.standard_normal((rows, n), dtype=np.float32)).astype(dtype)
                     for _ in range(3)]
                return dict(y=a[0], z=a[1], g=a[2],
                            weight=mx.array(rng.uniform(-2, 2, n).astype(np.float32))
                            .astype(dtype))
            out.append(grad_case(
                op=OP, label=f"{rows}x{n}", dtype=dtype, make=make,
                ours=mt.gated_rms_norm, native=gated_rms_norm_native,
                wrt=("y", "z", "weight"), grad_oracle=grad_oracle,
                nbytes=(3 + 5) * rows * n * dtype.size + 3 * n * dtype.size,
                flops=30 * rows * n, quick=quick and dtype == mx.float16))
    return out


def bench_cases() -> list[BenchCase]:
    out = []
    shapes = [(4096, 128, True), (16384, 128, False), (1, 2048, True), (32, 2048, False),
              (4096, 2048, False), (1, 4096, False), (32, 4096, True), (4096, 4096, False),
              (32, 8192, False)]  # n > 4096: the looped variant
    for rows, n, quick in shapes:
        for dtype in DTYPES:
            for y_dtype in (mx.float32, dtype) if dtype != mx.float32 else (mx.float32,):
                def make(rng, rows=rows, n=n, dtype=dtype, y_dtype=y_dtype):
                    return dict(
                        y=mx.array(rng.standard_normal((rows, n), dtype=np.float32)).astype(y_dtype),
                        z=mx.array(rng.standard_normal((rows, n), dtype=np.float32)).astype(dtype),
                        weight=mx.array(rng.uniform(-2, 2, n).astype(np.float32)).astype(dtype))
                y_tag = "yf32" if y_dtype == mx.float32 and dtype != mx.float32 else "y=T"
                # y read and the output (y's dtype) written, z read, the weight
                nbytes = rows * n * (2 * y_dtype.size + dtype.size) + n * dtype.size
                out.append(BenchCase(
                    op=OP, label=f"{rows}x{n}-{y_tag}", dtype=dtype, make=make,
                    ours=mt.gated_rms_norm, native=gated_rms_norm_native,
                    oracle=oracle, magnitude=magnitude,
                    nbytes=nbytes, flops=8 * rows * n,
                    quick=quick and dtype == mx.float16))
    return out + grad_bench_cases()
