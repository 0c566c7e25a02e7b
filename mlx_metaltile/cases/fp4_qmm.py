"""fp4_qmm: float64 oracle from the formats' definitions, benchmark cases, checked calls."""

from __future__ import annotations

import functools
import importlib

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ..ops._common import clear_plans
from ..ops.fp4_qmm import _choose, _split_k
from ._base import DTYPES, BenchCase, assert_close, grad_case, oracle_and_magnitude, to_f64, verify

OP = "fp4_qmm"


# ---- the oracle, from the format's definition ------------------------------------------

def _e2m1_formula(code: np.ndarray) -> np.ndarray:
    """E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 subnormal."""
    code = code.astype(np.int64)
    sign = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    mag = np.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * np.exp2(e - 1.0))
    return sign * mag


_E2M1_VALUES = _e2m1_formula(np.arange(16))  # the formula once per code: decoding is a lookup


def e2m1_value(code: np.ndarray) -> np.ndarray:
    """The E2M1 value of each 4-bit code (_e2m1_formula's, looked up)."""
    return _E2M1_VALUES[code.astype(np.intp)]


def scale_value(scales: np.ndarray, kind: str) -> np.ndarray:
    if kind == "e8m0":  # 2^(s - 127)
        return np.exp2(scales.astype(np.float64) - 127.0)
    if kind == "e4m3":  # 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF as 480
        b = scales.astype(np.int64)
        e, m = (b >> 3) & 0xF, b & 7
        mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
        return np.where(b & 0x80, -mag, mag)
    return to_f64(scales)


def dequantize64(w, scales, kind: str, group_size: int) -> np.ndarray:
    words = np.array(w).astype(np.uint64)
    n = words.shape[0]
    codes = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint64))) & 0xF
    values = e2m1_value(codes.reshape(n, -1))
    s = np.repeat(scale_value(np.array(scales) if kind in ("e8m0", "e4m3") else scales, kind),
                  group_size, axis=1)
    return values * s


def oracle(x, w, scales, kind, group_size):
    """(out, magnitude): x @ W^T in float64 and the sum of |terms| behind each output."""
    wdq = dequantize64(w, scales, kind, group_size)
    xf = to_f64(x).reshape(-1, wdq.shape[1])
    out = (xf @ wdq.T).reshape(*x.shape[:-1], wdq.shape[0])
    mag = (np.abs(xf) @ np.abs(wdq).T).reshape(out.shape)
    return out, mag


def grad_oracle(x, w, scales, g, kind, group_size):
    """float64 [(dx, magnitude sum |terms|)] of the VJP with cotangent g [..., N]:
    dx = g @ W with W the decoded weights."""
    wdq = dequantize64(w, scales, kind, group_size)
    gf = to_f64(g).reshape(-1, wdq.shape[0])
    return [((gf @ wdq).reshape(x.shape), (np.abs(gf) @ np.abs(wdq)).reshape(x.shape))]


# ---- inputs ---------------------------------------------------------------------------

ALL_CODES = (0x76543210, 0xFEDCBA98)  # the 16 codes, -0 (0x8) included


def make_w(rng, n, k) -> mx.array:
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint64).astype(np.uint32)
    words[0, :2] = ALL_CODES
    words[-1, -2:] = ALL_CODES[::-1]
    return mx.array(words)


def make_scales(rng, n, k, kind, group_size, spread=12) -> mx.array:
    shape = (n, k // group_size)
    if kind == "e8m0":  # exponents over [-spread, spread/2]: many binades in one matrix
        return mx.array((127 + rng.integers(-spread, spread // 2 + 1, size=shape)).astype(np.uint8))
    if kind == "e4m3":  # any finite E4M3 byte, both signs, subnormals included
        b = rng.integers(0, 0x7F, size=shape)
        return mx.array((b | (rng.integers(0, 2, size=shape) << 7)).astype(np.uint8))
    # plain float scales over several binades, both signs
    s = rng.choice((-1.0, 1.0), size=shape) * np.exp2(rng.uniform(-spread, spread / 2, shape))
    return mx.array(s.astype(np.float32)).astype(getattr(mx, kind))


def make_x(rng, lead, k, dtype, scale=1.0) -> mx.array:
    return mx.array((rng.standard_normal((*lead, k)) * scale).astype(np.float32)).astype(dtype)


def make_case(rng, m, n, k, dtype, kind="e8m0", group_size=32, lead=None):
    lead = (m,) if lead is None else lead
    return (make_x(rng, lead, k, dtype), make_w(rng, n, k),
            make_scales(rng, n, k, kind, group_size))


def run_and_check(x, w, scales, kind, group_size, backend, variant=None, expect=None):
    """Run fp4_qmm, prove the expected kernel(s) ran, compare with the float64 oracle."""
    dtype = x.dtype
    n, k = w.shape[0], w.shape[1] * 8
    m = x.size // k
    spec = None if backend == "reference" else _choose(
        backend, m, variant, dtype, fp4_module._scale_mode(scales, group_size), group_size)
    launches = 1
    if spec is not None and spec.variant.startswith("simdgroup") and \
            _split_k(m, n, k)[0] > 1:
        launches = 2  # the tile kernel's float32 partial sums, then fp4_qmm_splitk_sum
    if expect == "qmv" and spec is not None and fp4_module._qmv_wfirst(
            fp4_module._qmv_rows(m, backend), backend):
        expect = "qmv_wfirst"  # the qmv variant's launch plan runs its w-first kernel here
    names = [] if expect is None else [f"fp4_qmm_{expect}"] + (
        ["fp4_qmm_splitk_sum"] if launches == 2 else [])
    before = backends.launch_count(backend=backend)
    before_named = [backends.launch_count(name, backend) for name in names]
    out = mt.fp4_qmm(x, w, scales, group_size=group_size, variant=variant)
    mx.eval(out)
    if backend != "reference":  # prove a kernel ran (never the reference against itself)
        verify(backends.launch_count(backend=backend) == before + launches)
        for name, count in zip(names, before_named, strict=True):
            verify(backends.launch_count(name, backend) == count + 1, name)
    verify(out.dtype == dtype and tuple(out.shape) == (*x.shape[:-1], w.shape[0]))
    want, mag = oracle(x, w, scales, kind, group_size)
    assert_close(out, want, dtype, magnitude=mag,
                 what=f"fp4_qmm[{backend}, {variant or 'auto'}, {kind}/{group_size}]")
    return out


def run_and_check_dx(x, w, scales, g, kind, group_size, backend):
    """The VJP of fp4_qmm w.r.t. x with cotangent ``g``: proves the dx kernel ran once on a
    kernel backend for MLX's modes and at most DX_MAX_M rows, the decode kernel for more
    rows where x's dtype holds the weights (else the composite), compares with the float64
    gradient. Returns dx."""
    dtype = x.dtype
    m = x.size // x.shape[-1]
    mode = fp4_module._scale_mode(scales, group_size)
    on_kernels = backend != "reference"
    kernel = on_kernels and scales.dtype == mx.uint8 and m <= fp4_module.DX_MAX_M
    # more rows where the decoded plan takes x's dtype and the scales: W decoded for the
    # product (the forward too where its plan is the decoded one)
    dx_decoded = (on_kernels and m > fp4_module.DX_MAX_M
                  and fp4_module._decoded_dtype(dtype, mode) is not None)
    forward_decoded = on_kernels and _choose(
        backend, m, None, dtype, mode, group_size) is fp4_module.DECODED_SPEC
    decoded = int(dx_decoded) + int(forward_decoded)
    names = ("fp4_qmm_dx", "fp4_qmm_decoded")
    before = [backends.launch_count(name, backend) for name in names]
    _, (dx,) = mx.vjp(lambda x: mt.fp4_qmm(x, w, scales, group_size=group_size), [x], [g])
    mx.eval(dx)
    for name, count, want in zip(names, before, (int(kernel), decoded), strict=True):
        verify(backends.launch_count(name, backend) == count + want, name)
    verify(dx.dtype == dtype and dx.shape == x.shape)
    ((want, mag),) = grad_oracle(x, w, scales, g, kind, group_size)
    assert_close(dx, want, dtype, magnitude=mag,
                 what=f"fp4_qmm[{backend}] dx {kind}/{group_size}")
    return dx


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend where it can run, so a variant added to
# the registry fails there until it has one here).
def _variant_call(variant, backend, rng):
    """M = 9, N = 64, K = 256 forced onto a variant; the simdgroup kernel splits K in 8 here
    and launches fp4_qmm_splitk_sum after it. qmv at M = 4: its held-x kernel on every
    backend (cuda's plan runs w-first from M = 5: _wfirst_call)."""
    x, w, s = make_case(rng, 4 if variant == "qmv" else 9, 64, 256, mx.bfloat16)
    run_and_check(x, w, s, "e8m0", 32, backend, variant=variant, expect=variant)


fp4_module = importlib.import_module("mlx_metaltile.ops.fp4_qmm")  # the function shadows it


def _wfirst_call(backend, rng):
    """qmv's w-first form (QMV_WFIRST forced, for this call only) at M = 8 (MB 8)."""
    saved = fp4_module.QMV_WFIRST
    fp4_module.QMV_WFIRST = True
    clear_plans()  # plans read QMV_WFIRST once
    try:
        x, w, s = make_case(rng, 8, 64, 256, mx.bfloat16)
        run_and_check(x, w, s, "e8m0", 32, backend, variant="qmv", expect="qmv_wfirst")
    finally:
        fp4_module.QMV_WFIRST = saved
        clear_plans()


def _dx_call(backend, rng):
    """The x-VJP kernel (dx = g @ W) at M = 5, mxfp4, against the float64 gradient."""
    x, w, scales = make_case(rng, 5, 64, 128, mx.bfloat16)
    g = make_x(rng, (5,), 64, mx.bfloat16)
    run_and_check_dx(x, w, scales, g, "e8m0", 32, backend)


VARIANT_CALLS = {
    "dx": _dx_call,
    "qmv": functools.partial(_variant_call, "qmv"),
    "qmv_wfirst": _wfirst_call,
    "simdgroup": functools.partial(_variant_call, "simdgroup"),
    "mpp": functools.partial(_variant_call, "mpp"),
    "decoded": functools.partial(_variant_call, "decoded"),
    "skinny": functools.partial(_variant_call, "skinny"),
    "splitk_sum": functools.partial(_variant_call, "simdgroup"),
}


# ---- benchmarks (mxfp4 weights, as mx.quantize(W, mode="mxfp4") makes them) -----------

def _bench_terms(x, w, scales):
    return oracle(x, w, scales, "e8m0", 32)


def _native(x, w, scales):
    return mx.quantized_matmul(x, w, scales, transpose=True, group_size=32, bits=4,
                               mode="mxfp4")


def bench_cases() -> list[BenchCase]:
    out = []
    for n, k in ((4096, 4096), (14336, 4096)):
        for m in (1, 8, 32, 512):
            for dtype in DTYPES:
                def make(rng, m=m, n=n, k=k, dtype=dtype):
                    wf = mx.array(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
                    w, scales = mx.quantize(wf, mode="mxfp4")[:2]
                    x = mx.array(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
                    return dict(x=x, w=w, scales=scales)
                nbytes = m * k * dtype.size + n * k // 2 + n * k // 32 + m * n * dtype.size
                exact, magnitude = oracle_and_magnitude(_bench_terms)
                out.append(BenchCase(
                    op=OP, label=f"M{m}-N{n}-K{k}", dtype=dtype, make=make,
                    ours=mt.fp4_qmm, native=_native, oracle=exact,
                    nbytes=nbytes, flops=2 * m * n * k, magnitude=magnitude,
                    quick=n == k and m in (1, 32) and dtype == mx.bfloat16))
    return out + grad_bench_cases()


# ---- forward + backward vs MLX's autodiff of quantized_matmul -----------------------------

def _grad_make(rng, m, n, k, dtype):
    wf = mx.array(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
    w, scales = mx.quantize(wf, mode="mxfp4")[:2]
    x, g = (mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            for shape in ((m, k), (m, n)))
    return dict(x=x, w=w, scales=scales, g=g)


def _grad_terms(x, w, scales, g):
    return grad_oracle(x, w, scales, g, "e8m0", 32)


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward w.r.t. x against MLX's autodiff of quantized_matmul (mxfp4), N =
    K = 4096: one decode row and 512 rows of prefill. bytes: the forward's (x, the codes
    and E8M0 scales read, out written) plus the backward's (the codes and scales again, g
    read, dx written: dx = g W needs no x)."""
    out = []
    n = k = 4096
    for m in (1, 512):
        for dtype in DTYPES:
            weights = n * k // 2 + n * k // 32
            out.append(grad_case(
                op=OP, label=f"M{m}-N{n}-K{k}", dtype=dtype,
                make=functools.partial(_grad_make, m=m, n=n, k=k, dtype=dtype),
                ours=mt.fp4_qmm, native=_native, wrt=("x",), grad_oracle=_grad_terms,
                nbytes=2 * weights + 2 * m * k * dtype.size + 2 * m * n * dtype.size,
                flops=2 * 2 * m * n * k, quick=m == 1 and dtype == mx.bfloat16))
    return out
