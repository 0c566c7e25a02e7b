"""The kernels and the references keep the range of the math: inputs of any magnitude whose
float64 result is finite in float32 give that result, never a silent 0, inf or NaN.

Each op is checked against a float64 oracle written from the math, on the reference and on
every kernel backend here (the emulator in CI), with poisoned outputs; a magnitude sweep per
op and backend counts the outputs that come back 0 / inf / NaN where the float64 result is
a normal float32 (goal: none).
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import backend_params, require_backend

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import FLOAT32_TINY, assert_close, to_f64
from mlx_metaltile.ops._common import variant_reason

FLT_MAX = float(np.finfo(np.float32).max)
ALL_BACKENDS = ("reference", "emulator", "metal", "cuda")
grms = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")
sdpa = importlib.import_module("mlx_metaltile.ops.sdpa_multi")
fp4 = importlib.import_module("mlx_metaltile.ops.fp4_qmm")
moe = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")

# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def silent(got, want, magnitude=None) -> tuple[int, int]:
    """(outputs that are 0, inf or NaN where the float64 result is a normal float32, such
    outputs in all). For a sum, ``magnitude`` (the sum of |terms|) must be finite in float32
    too: a float32 accumulation whose terms overflow is beyond what any kernel promises."""
    got, want = to_f64(got), np.asarray(want, dtype=np.float64)
    normal = (np.abs(want) >= FLOAT32_TINY) & (np.abs(want) <= FLT_MAX)
    if magnitude is not None:
        normal &= np.asarray(magnitude) <= FLT_MAX
    bad = normal & ((got == 0) | ~np.isfinite(got))
    return int(bad.sum()), int(normal.sum())


def require_variant(module, variant, backend) -> None:
    """Skip an mpp variant the backend cannot run here."""
    reason = variant_reason(module.MPP_SPEC, backend) if variant == "mpp" else None
    if reason is not None:
        pytest.skip(f"mpp on {backend}: {reason}")


def launched(backend, before) -> None:
    """A kernel ran on a kernel backend (never the reference compared with itself)."""
    if backend != "reference":
        assert backends.launch_count(backend=backend) > before


# ---- gated_rms_norm --------------------------------------------------------------------

def grms_oracle(y, z, w, eps):
    """(out, magnitude, underflow_scale) in float64: out = w y rsqrt(mean(y^2) + eps) silu(z);
    the error scales as tests/ops/test_gated_rms_norm.py states them (|want| (1 + |z|), and
    |w y rsqrt(.) z| for a gate below float32's normal range)."""
    y, z, w = to_f64(y), to_f64(z), to_f64(w)
    with np.errstate(all="ignore"):
        inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
        out = w * y * inv_rms * (z / (1.0 + np.exp(-z)))
    return out, np.abs(out) * (1.0 + np.abs(z)), np.abs(w * y * inv_rms * z)


def grms_inputs(rng, rows, n, magnitude, dtype=mx.float32):
    """y uniform in [-magnitude, magnitude] (float32, the widest y), z and w ordinary."""
    y = rng.uniform(-1, 1, size=(rows, n)) * magnitude
    y[:, 0] = magnitude  # every row reaches the magnitude
    z = rng.standard_normal((rows, n)) * 3.0
    w = rng.uniform(-2, 2, size=(n,))
    return (mx.array(y.astype(np.float32)), mx.array(z.astype(np.float32)).astype(dtype),
            mx.array(w.astype(np.float32)).astype(dtype))


GRMS_N = (100, 1000, 5000)  # simd_rows, row, looped
GRMS_MAGNITUDES = (1e-40, 1e-38, 1e-30, 1e-10, 1.0, 1e10, 1e17, 1e20, 1e30, 1e36)


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("n", GRMS_N)
@pytest.mark.parametrize("eps", (0.0, 1e-5, 1e30))
@pytest.mark.parametrize("magnitude", GRMS_MAGNITUDES, ids=lambda m: f"y{m:g}")
def test_gated_rms_norm_any_magnitude(backend, rng, n, eps, magnitude):
    """Rows of |y| from subnormal to 1e36 (sum y^2 overflowing float32 from 1e18, underflowing
    below 1e-23), with eps 0, small and huge: the float64 result within the tolerance table."""
    require_backend(backend)
    y, z, w = grms_inputs(rng, 3, n, magnitude)
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        out = mt.gated_rms_norm(y, z, w, eps=eps)
        mx.eval(out)
        launched(backend, before)
    want, mag, under = grms_oracle(y, z, w, eps)
    assert_close(out, want, mx.float32, magnitude=mag, underflow_scale=under,
                 what=f"gated_rms_norm[{backend}] |y| {magnitude:g} eps {eps:g}")


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
@pytest.mark.parametrize("n", GRMS_N)
def test_gated_rms_norm_large_y_in_z_dtype(backend, rng, dtype, n):
    """y in z's dtype at the top of its range (bfloat16 1e37, float16 6e4): the squares
    would overflow float32 (bfloat16) or the dtype; the normalised output is O(1)."""
    require_backend(backend)
    top = 1e37 if dtype == mx.bfloat16 else 6e4
    y, z, w = grms_inputs(rng, 2, n, top, dtype)
    y = y.astype(dtype)
    with backends.use_backend(backend):
        out = mt.gated_rms_norm(y, z, w, eps=1e-5)
        mx.eval(out)
    want, mag, under = grms_oracle(y, z, w, 1e-5)
    assert_close(out, want, dtype, magnitude=mag, underflow_scale=under,
                 what=f"gated_rms_norm[{backend}] {dtype}")


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("n", GRMS_N)
def test_gated_rms_norm_zero_row(backend, rng, n):
    """An all-zero row: 0 with eps > 0; NaN with eps = 0 (the math's 0/0, as
    mx.fast.rms_norm gives), on every backend; the other rows are unaffected."""
    require_backend(backend)
    y, z, w = grms_inputs(rng, 2, n, 1.0)
    y = mx.concatenate([mx.zeros((1, n)), y[1:]])
    with backends.use_backend(backend):
        pos = to_f64(mt.gated_rms_norm(y, z, w, eps=1e-5))
        zero_eps = to_f64(mt.gated_rms_norm(y, z, w, eps=0.0))
    assert (pos[0] == 0).all()
    assert np.isnan(zero_eps[0]).all()
    want, mag, under = grms_oracle(y[1:], z[1:], w, 0.0)
    assert_close(zero_eps[1:], want, mx.float32, magnitude=mag, underflow_scale=under)
    assert np.isnan(to_f64(mx.fast.rms_norm(mx.zeros((1, n)), None, 0.0))).all()


@pytest.mark.parametrize("huge", (10**400, -(10**400)))
def test_huge_int_scalars_are_op_errors(huge):
    """An int beyond float's range is an [op] ValueError, not a bare OverflowError."""
    y = mx.ones((2, 64))
    with pytest.raises(ValueError, match=r"^\[gated_rms_norm\] eps must be finite"):
        mt.gated_rms_norm(y, y, mx.ones((64,)), eps=huge)
    q = mx.ones((1, 1, 1, 64))
    with pytest.raises(ValueError, match=r"^\[sdpa_multi\] scale must be finite"):
        mt.sdpa_multi(q, q, q, scale=huge)


def test_negative_control_silent_counts():
    """The sweep's counter sees a zero, an inf and a NaN where the math is a normal float."""
    assert silent([0.0, np.inf, np.nan, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1e-300]) == (3, 4)
    assert silent([np.inf, np.inf], [1.0, 1.0], [1.0, 1e39]) == (1, 1)


# ---- sdpa_multi ------------------------------------------------------------------------

def sdpa_oracle(q, k, v, scale):
    """(out, magnitude) in float64: softmax_j(scale q.k_j) @ v (no mask, Hq = Hkv);
    magnitude = sum_j p_j |v_j| (1 + |scale| sum_d |q_d k_jd|), the accumulation bound."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    s = scale * np.einsum("bhld,bhjd->bhlj", q, k)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    score_mag = abs(scale) * np.einsum("bhld,bhjd->bhlj", np.abs(q), np.abs(k))
    return (np.einsum("bhlj,bhjd->bhld", p, v),
            np.einsum("bhlj,bhjd->bhld", p * (1.0 + score_mag), np.abs(v)))


def sdpa_inputs(rng, kv_len, v_magnitude, dtype=mx.float32, L=4, D=64):
    def arr(shape, s):
        return mx.array((rng.standard_normal(shape) * s).astype(np.float32)).astype(dtype)
    v = rng.uniform(0.5, 1.0, size=(1, 2, kv_len, D)) * v_magnitude  # one sign: no cancelling
    return (arr((1, 2, L, D), 0.3), arr((1, 2, kv_len, D), 0.3),
            mx.array(v.astype(np.float32)).astype(dtype))


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("kv_len", (32, 2048))
@pytest.mark.parametrize("v_magnitude", (2e35, 3e38, 1e-30), ids=lambda m: f"v{m:g}")
def test_sdpa_multi_large_values(backend, rng, kv_len, v_magnitude):
    """kv_len * |v| beyond float32's max (2048 x 2e35): the output, a convex combination of
    v rows, is finite; the split kernel and the combine (several KV slices at 2048) keep
    their accumulators below max |v|."""
    require_backend(backend)
    q, k, v = sdpa_inputs(rng, kv_len, v_magnitude)
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        out = mt.sdpa_multi(q, k, v, scale=0.125)
        mx.eval(out)
        launched(backend, before)
    if backend != "reference" and kv_len == 2048:
        assert sdpa.plan(1, 2, 2, 4, 64, kv_len, mx.float32)["n_splits"] > 1
    want, mag = sdpa_oracle(q, k, v, 0.125)
    assert_close(out, want, mx.float32, mag, what=f"sdpa_multi[{backend}] |v| {v_magnitude:g}")


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
def test_sdpa_multi_large_values_low_precision(backend, rng, dtype):
    """v at the top of float16's / bfloat16's range over 2048 keys."""
    require_backend(backend)
    top = 6e4 if dtype == mx.float16 else 3e38
    q, k, v = sdpa_inputs(rng, 2048, top, dtype)
    with backends.use_backend(backend):
        out = mt.sdpa_multi(q, k, v, scale=0.125)
        mx.eval(out)
    want, mag = sdpa_oracle(q, k, v, 0.125)
    assert_close(out, want, dtype, mag, what=f"sdpa_multi[{backend}] {dtype}")


@pytest.mark.parametrize("backend", backend_params(*ALL_BACKENDS))
@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=("float32", "bfloat16"))
@pytest.mark.parametrize("scale", (1e38, -1e38, 2.3e38, 1e30), ids=lambda s: f"scale{s:g}")
def test_sdpa_multi_scores_beyond_float32(backend, monkeypatch, rng, dtype, scale):
    """scale up to the limit with ordinary q, k: scale * q.k beyond float32's range, but the
    softmax is exactly one-hot (score gaps of ~1e28 and more), so the output is v of the
    best key; over several KV slices (the combine merges maxima of such scores)."""
    require_backend(backend)
    monkeypatch.setattr(sdpa, "MIN_SPLIT_BLOCKS", 1)  # 32-key slices
    monkeypatch.setattr(sdpa, "MIN_KEYS_PER_ROW", 0)
    monkeypatch.setattr(sdpa, "TARGET_THREADS", 1 << 30)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
               for shape in ((1, 2, 4, 64), (1, 2, 96, 64), (1, 2, 96, 64)))
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        out = mt.sdpa_multi(q, k, v, scale=scale)
        mx.eval(out)
        launched(backend, before)
    if backend != "reference":
        assert sdpa.plan(1, 2, 2, 4, 64, 96, dtype)["n_splits"] == 3
    want, _ = sdpa_oracle(q, k, v, scale)
    magnitude, _ = sdpa_oracle(q, k, mx.abs(v), scale)  # one-hot: no score rounding term
    assert_close(out, want, dtype, magnitude, what=f"sdpa_multi[{backend}] scale {scale:g}")


# ---- fp4_qmm ---------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def fp4_inputs(rng, M, N, K, scale_byte, x_magnitude):
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    w = np.zeros((N, K // 8), np.uint32)
    for j in range(8):
        w |= codes[:, j::8] << (4 * j)
    scales = np.full((N, K // 32), scale_byte, np.uint8)
    x = (rng.standard_normal((M, K)) * x_magnitude).astype(np.float32)
    wdq = E2M1[codes] * 2.0 ** (np.repeat(scales.astype(np.float64), 32, axis=1) - 127)
    return (mx.array(x), mx.array(w), mx.array(scales), x.astype(np.float64) @ wdq.T,
            np.abs(x.astype(np.float64)) @ np.abs(wdq).T)


FP4_RUNS = [("reference", None), ("emulator", "qmv"), ("emulator", "simdgroup"),
            ("emulator", "mpp"), ("metal", None), ("cuda", None)]


def fp4_run(backend, variant, x, w, scales):
    require_backend(backend)
    require_variant(fp4, variant, backend)
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        out = mt.fp4_qmm(x, w, scales, group_size=32, variant=variant)
        mx.eval(out)
        launched(backend, before)
    return out


@pytest.mark.parametrize("backend, variant", [pytest.param(*r, id=f"{r[0]}-{r[1]}",
                                                           marks=backend_params(r[0])[0].marks)
                                              for r in FP4_RUNS])
@pytest.mark.parametrize("M", (4, 40))
@pytest.mark.parametrize("scale_byte, x_magnitude", [(254, 1e-3), (253, 1e-2), (252, 0.01),
                                                     (1, 1e30), (127, 1.0)])
def test_fp4_qmm_extreme_e8m0_scales(backend, variant, rng, M, scale_byte, x_magnitude):
    """E8M0 scales up to 2^127 (code * scale overflows float32 for 6 * 2^127) with results
    below float32's max: every variant gives the float64 result."""
    x, w, scales, want, mag = fp4_inputs(rng, M, 64, 128, scale_byte, x_magnitude)
    assert np.abs(want).max() < FLT_MAX / 2
    out = fp4_run(backend, variant, x, w, scales)
    assert_close(out, want, mx.float32, mag, what=f"fp4_qmm[{backend}/{variant}] s={scale_byte}")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=backend_params(b)[0].marks)
                                     for b in ("reference", "emulator", "metal", "cuda")])
@pytest.mark.parametrize("scale_byte, g_magnitude", [(254, 1e-3), (253, 1e-2), (1, 1e30),
                                                     (127, 1.0)])
def test_fp4_qmm_vjp_extreme_e8m0_scales(backend, rng, scale_byte, g_magnitude):
    """The x-VJP dx = g @ W with E8M0 scales up to 2^127 and dx below float32's max: the
    float64 gradient (the dx kernel's weights stay finite, as the forward's)."""
    require_backend(backend)
    _, w, scales, _, _ = fp4_inputs(rng, 1, 64, 128, scale_byte, 1.0)
    wdq = E2M1[_fp4_codes(w)] * 2.0 ** (np.repeat(np.array(scales).astype(np.float64), 32,
                                                   axis=1) - 127)
    x = mx.zeros((5, 128))
    g = (rng.standard_normal((5, 64)) * g_magnitude).astype(np.float32)
    want, mag = g.astype(np.float64) @ wdq, np.abs(g.astype(np.float64)) @ np.abs(wdq)
    assert np.abs(want).max() < FLT_MAX / 2
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        _, (dx,) = mx.vjp(lambda x: mt.fp4_qmm(x, w, scales, group_size=32), [x], [mx.array(g)])
        mx.eval(dx)
        launched(backend, before)
    assert_close(dx, want, mx.float32, mag, what=f"fp4_qmm vjp[{backend}] s={scale_byte}")


def _fp4_codes(w: mx.array) -> np.ndarray:
    words = np.array(w)
    return np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(
        words.shape[0], -1)


# ---- moe_gather_qmm --------------------------------------------------------------------

def moe_inputs(rng, M, N, K, w_magnitude, x_magnitude, E=3, bits=8, gs=32):
    """bfloat16 x and weights W = bf16(scale * q) (bias 0: one rounding, exact in float64)."""
    codes = rng.integers(0, 2**bits, size=(E, N, K))
    per_word = 32 // bits
    w = np.zeros((E, N, K // per_word), np.uint32)
    for i in range(per_word):
        w |= (codes[..., i::per_word].astype(np.uint32) << (bits * i))
    scales = mx.array((rng.uniform(0.5, 1, size=(E, N, K // gs)) * w_magnitude / 2**bits)
                      .astype(np.float32)).astype(mx.bfloat16)
    biases = mx.zeros(scales.shape, dtype=mx.bfloat16)
    x = mx.array((rng.standard_normal((M, K)) * x_magnitude).astype(np.float32))
    x = x.astype(mx.bfloat16)
    ids = np.sort(rng.integers(0, E, size=M))
    s = np.repeat(to_f64(scales), gs, axis=-1)
    wd = to_f64(mx.array((s * codes).astype(np.float32)).astype(mx.bfloat16))
    xf = to_f64(x)
    want = np.einsum("mnk,mk->mn", wd[ids], xf)
    mag = np.einsum("mnk,mk->mn", np.abs(wd[ids]), np.abs(xf))
    return (x, mx.array(w), scales, biases, mx.array(ids, dtype=mx.uint32)), want, mag


MOE_RUNS = [("reference", None), ("emulator", "simdgroup"), ("emulator", "mpp"),
            ("metal", None), ("cuda", None)]


def moe_run(backend, variant, case):
    require_backend(backend)
    require_variant(moe, variant, backend)
    with backends.use_backend(backend):
        before = backends.launch_count(backend=backend)
        out = mt.moe_gather_qmm(*case, group_size=32, bits=8, variant=variant)
        mx.eval(out)
        launched(backend, before)
    return out


@pytest.mark.parametrize("backend, variant", [pytest.param(*r, id=f"{r[0]}-{r[1]}",
                                                           marks=backend_params(r[0])[0].marks)
                                              for r in MOE_RUNS])
@pytest.mark.parametrize("w_magnitude, x_magnitude", [(1e6, 1.0), (1e30, 1e-3), (1.0, 1e-7),
                                                      (1e-6, 1e-30), (1.0, 1e20)])
def test_moe_gather_qmm_bfloat16_range(backend, variant, rng, w_magnitude, x_magnitude):
    """bfloat16 weights beyond half's +-65504 and activations below half's normal range:
    every variant gives the float64 result of the bfloat16 inputs."""
    case, want, mag = moe_inputs(rng, 10, 32, 64, w_magnitude, x_magnitude)
    out = moe_run(backend, variant, case)
    assert_close(out, want, mx.bfloat16, mag, what=f"moe_gather_qmm[{backend}/{variant}]")


# ---- the magnitude sweep ---------------------------------------------------------------

def sweep_gated_rms_norm(backend, rng):
    bad = total = 0
    for n in GRMS_N:
        for e in range(-44, 39, 4):
            for eps in (0.0, 1e-5):
                y, z, w = grms_inputs(rng, 2, n, 10.0**e)
                with backends.use_backend(backend):
                    out = mt.gated_rms_norm(y, z, w, eps=eps)
                b, t = silent(out, grms_oracle(y, z, w, eps)[0])
                bad, total = bad + b, total + t
    return bad, total


def sweep_sdpa_multi(backend, rng):
    bad = total = 0
    for e in range(-36, 39, 6):  # |v|, over 2048 keys
        q, k, v = sdpa_inputs(rng, 2048, 10.0**e)
        with backends.use_backend(backend):
            out = mt.sdpa_multi(q, k, v, scale=0.125)
        b, t = silent(out, sdpa_oracle(q, k, v, 0.125)[0])
        bad, total = bad + b, total + t
    for e in range(-30, 39, 4):  # scale, with ordinary q and k
        q, k, v = sdpa_inputs(rng, 96, 1.0)
        scale = 2.3 * 10.0**e if e == 38 else 10.0**e
        with backends.use_backend(backend):
            out = mt.sdpa_multi(q, k, v, scale=scale)
        b, t = silent(out, sdpa_oracle(q, k, v, scale)[0])
        bad, total = bad + b, total + t
    return bad, total


def sweep_fp4_qmm(backend, rng, variant):
    bad = total = 0
    for byte in (1, 40, 127, 200, 250, 252, 253, 254):
        for x_mag in (1e-3, 1.0, 1e3):
            x, w, scales, want, mag = fp4_inputs(rng, 40, 32, 64, byte, x_mag)
            with backends.use_backend(backend):
                out = mt.fp4_qmm(x, w, scales, group_size=32, variant=variant)
            b, t = silent(out, want, mag)
            bad, total = bad + b, total + t
    return bad, total


def sweep_moe_gather_qmm(backend, rng, variant):
    bad = total = 0
    for w_e in range(-30, 31, 10):
        for x_e in (-20, -7, 0, 5):
            case, want, mag = moe_inputs(rng, 10, 32, 64, 10.0**w_e, 10.0**x_e)
            with backends.use_backend(backend):
                out = mt.moe_gather_qmm(*case, group_size=32, bits=8, variant=variant)
            b, t = silent(out, want, mag)
            bad, total = bad + b, total + t
    return bad, total


def sweep_moe_route(backend, rng):
    """Router logits of magnitude 1e-38 (subnormal differences) to 1e38 (differences beyond
    float32's range: exp(l - m) is 0 in float32 as in float64), both modes, each call also
    within the tolerance table of the oracle."""
    from mlx_metaltile.cases import moe_route as route_cases

    bad = total = 0
    for e in range(-38, 39, 4):
        logits = mx.array((rng.uniform(-1, 1, (3, 40)) * 10.0**e).astype(np.float32))
        for normalize in (True, False):
            before = backends.launch_count(backend=backend)
            with backends.use_backend(backend):
                ids, scores = mt.moe_route(logits, 4, normalize=normalize)
                mx.eval(ids, scores)
            launched(backend, before)
            route_cases.check(ids, scores, logits, 4, normalize,
                              f"moe_route[{backend}] |logits| 1e{e}")
            b, t = silent(scores, route_cases.oracle(logits, 4, normalize)[1])
            bad, total = bad + b, total + t
    return bad, total


SWEEPS = {
    "gated_rms_norm": [(b, None) for b in ALL_BACKENDS],
    "sdpa_multi": [(b, None) for b in ALL_BACKENDS],
    "fp4_qmm": FP4_RUNS,
    "moe_gather_qmm": MOE_RUNS,
    "moe_route": [(b, None) for b in ALL_BACKENDS],
}


def sweep(op, backend, variant, rng):
    """(silent 0 / inf / NaN outputs, outputs whose float64 result is a normal float32)."""
    if op in ("gated_rms_norm", "sdpa_multi", "moe_route"):
        return globals()[f"sweep_{op}"](backend, rng)
    return globals()[f"sweep_{op}"](backend, rng, variant)


@pytest.mark.parametrize("op, backend, variant", [
    pytest.param(op, b, v, id=f"{op}-{b}-{v}", marks=backend_params(b)[0].marks)
    for op, runs in SWEEPS.items() for b, v in runs])
def test_magnitude_sweep_has_no_silent_failures(op, backend, variant, rng):
    require_backend(backend)
    require_variant(moe if op == "moe_gather_qmm" else fp4, variant, backend)
    bad, total = sweep(op, backend, variant, rng)
    assert total > 0
    assert bad == 0, f"{op}[{backend}/{variant}]: {bad}/{total} silent 0/inf/NaN outputs"
