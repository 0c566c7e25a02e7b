"""Gradients of every op: VJPs against float64 gradients written from the math (NumPy;
expert_glu / expert_down_combine: test_grad_moe_fused.py, moe_route: test_moe_route.py),
the fused gated_rms_norm backward kernel's negative controls, the quantized constants'
errors, the emulator's refusal of mx.compile / mx.vmap, and an SGD step of a small model
through every op equal on the reference and kernel backends."""

from __future__ import annotations

import functools
import importlib

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.gated_rms_norm import grad_oracle, make_inputs

gated = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DT_IDS = ("float32", "float16", "bfloat16")

# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _f64(a: mx.array) -> np.ndarray:
    return to_f64(a)


# ---- gated_rms_norm ------------------------------------------------------------------

def gated_check(y, z, w, eps, dtype, rng, backend):
    # the cotangent in the output's dtype (y's)
    g = mx.array(rng.standard_normal(z.shape).astype(np.float32)).astype(y.dtype)
    before = [backends.launch_count(name=s.name) for s in gated.BACKWARD_SPECS]
    _, (dy, dz, dw) = mx.vjp(lambda *a: mt.gated_rms_norm(*a, eps=eps), [y, z, w], [g])
    mx.eval(dy, dz, dw)
    if backend != "reference":  # the fused backward kernel (and dweight's sum) ran
        assert [backends.launch_count(name=s.name) for s in gated.BACKWARD_SPECS] == \
            [b + 1 for b in before]
    assert (dy.dtype, dz.dtype, dw.dtype) == (y.dtype, z.dtype, w.dtype)
    want = grad_oracle(y, z, w, g, eps)
    for got, (exact, mag), name in zip((dy, dz, dw), want, ("dy", "dz", "dw"), strict=True):
        assert_close(got.reshape(exact.shape), exact, got.dtype, mag, what=name)


@pytest.mark.parametrize("lead", ((1,), (5,), (2, 3)), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", (1, 31, 32, 33, 129, 1000, 4097))
@pytest.mark.parametrize("y_f32", (True, False), ids=("y_f32", "y_same"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_gated_rms_norm_vjp(any_backend, rng, dtype, y_f32, n, lead):
    y, z, w = make_inputs(rng, lead, n, dtype, mx.float32 if y_f32 else dtype)
    gated_check(y, z, w, 1e-5, dtype, rng, any_backend)


@pytest.mark.parametrize("y_dt, z_dt, w_dt", [(mx.float16, mx.bfloat16, mx.float32),
                                               (mx.bfloat16, mx.float32, mx.float16),
                                               (mx.float32, mx.float16, mx.bfloat16)],
                         ids=("y16-zbf-w32", "ybf-z32-w16", "y32-z16-wbf"))
@pytest.mark.parametrize("n", (33, 1000))
def test_gated_rms_norm_vjp_mixed_dtypes(any_backend, rng, y_dt, z_dt, w_dt, n):
    """y, z, weight each in its own float dtype: dy in y's, dz in z's, dweight in weight's."""
    y, z, w = make_inputs(rng, (3,), n, z_dt, y_dt)
    gated_check(y, z, w.astype(w_dt), 1e-5, z_dt, rng, any_backend)


@pytest.mark.parametrize("row_scale", (1e30, 1e-30, 0.0))
def test_gated_rms_norm_vjp_range(any_backend, rng, row_scale):
    """Rows whose mean(y^2) over- or underflows float32, and an all-zero row (eps > 0)."""
    y, z, w = make_inputs(rng, (4,), 300, mx.float32, mx.float32)
    y = y / mx.max(mx.abs(y)) * row_scale
    gated_check(y, z, w, 1e-6 if row_scale else 1e-5, mx.float32, rng, any_backend)


def test_gated_rms_norm_dweight_many_rows_deterministic(kernel_backend, rng):
    """More rows than threadgroups (several rows per dweight partial): right, and the same
    bits on a second run."""
    y, z, w = make_inputs(rng, (700,), 40, mx.float32, mx.float32)
    gated_check(y, z, w, 1e-5, mx.float32, rng, kernel_backend)
    g = mx.ones(z.shape)
    runs = [mx.vjp(mt.gated_rms_norm, [y, z, w], [g])[1][2] for _ in range(2)]
    assert np.array_equal(np.array(runs[0]), np.array(runs[1]))


@pytest.mark.parametrize("n, passes", [(1000, 1), (5000, 3)], ids=("one_chunk", "chunked"))
def test_gated_rms_norm_backward_traffic(launches, rng, n, passes):
    """The emulator's counters: a row of n <= 4096 is read once (y, z, weight, g) and dy, dz
    written once; longer rows are read three times; dweight's partials written once by the
    first kernel and read once by the second."""
    from support import require_backend
    require_backend("emulator")
    rows, dtype = 5, mx.bfloat16
    y, z, w = make_inputs(rng, (rows,), n, dtype, mx.float32)
    g = mx.ones(z.shape, dtype=y.dtype)  # the output's dtype
    with backends.use_backend("emulator"):
        mx.eval(mx.vjp(mt.gated_rms_norm, [y, z, w], [g])[1])
    stats = {rec.name: rec.stats for rec in launches}
    bwd, total = stats["gated_rms_norm_backward"], stats["gated_rms_norm_backward_sum"]
    for name in ("y", "g"):
        assert bwd.bytes_read[name] == passes * rows * n * 4, name
    for name in ("z", "w"):  # weight: each row's threadgroup reads it with the row
        assert bwd.bytes_read[name] == passes * rows * n * 2, name
    assert bwd.bytes_written["dy"] == rows * n * 4 and bwd.bytes_written["dz"] == rows * n * 2
    assert bwd.bytes_written["dw_partial"] == rows * n * 4  # one row per threadgroup here
    assert total.bytes_read["partial"] == rows * n * 4 and total.bytes_written["dw"] == n * 2


@pytest.mark.parametrize("n", (200, 5000), ids=("one_chunk", "chunked"))
@pytest.mark.parametrize("old, new", [
    ("(a - c_u * u) * k_row", "a * k_row"),  # dy without the normalisation's term
    ("(sg * (1.0f + zv[j] * (1.0f - sg)))", "sg"),  # dz without silu's second term
    ("const float dw_term = gv[j] * u * K * s;", "const float dw_term = gv[j] * u * K;"),
], ids=("dy_term", "dz_term", "dw_gate"))
def test_gated_rms_norm_backward_negative_control(kernel_backend, broken_kernel, rng, n,
                                                  old, new):
    broken_kernel(gated.BACKWARD_SPEC, (old, new))
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        gated_check(y, z, w, 1e-5, mx.float32, rng, kernel_backend)


def test_gated_rms_norm_backward_sum_negative_control(kernel_backend, broken_kernel, rng):
    """dweight's fixed-order sum leaving out the last partial: the harness must notice."""
    broken_kernel(gated.BACKWARD_SUM_SPEC, ("p < n_parts", "p + 1 < n_parts"))
    y, z, w = make_inputs(rng, (700,), 40, mx.float32, mx.float32)
    with pytest.raises(AssertionError, match="dw .*out of tolerance"):
        gated_check(y, z, w, 1e-5, mx.float32, rng, kernel_backend)


# ---- quantized ops: dx ---------------------------------------------------------------

def _decode(w, scales, biases, mode) -> np.ndarray:
    """The weights W the quantized arrays hold, exactly (float64)."""
    if mode == "affine":  # W = scale * q + bias (mx.dequantize rounds to the scales' dtype)
        wd = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32))
    else:
        wd = mx.dequantize(w, scales, None, mode=mode, dtype=mx.float32)
    return _f64(wd)


def _quantize(rng, shape, dtype, mode):
    wf = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = mx.quantize(wf, mode=mode)
    w, scales = q[0], q[1]
    biases = q[2] if mode == "affine" else None
    return w, scales, biases, _decode(w, scales, biases, mode)


@pytest.mark.parametrize("mode", ("affine", "mxfp4", "nvfp4", "mxfp8"))
@pytest.mark.parametrize("per_expert", (False, True), ids=("shared_x", "per_expert_x"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_qmv_vjp(any_backend, rng, dtype, per_expert, mode):
    E, N, K, k = 4, 33, 64, 3
    w, scales, biases, wd = _quantize(rng, (E, N, K), dtype, mode)
    ids = np.array([[0, 3, 1], [3, 2, 0]], dtype=np.uint32)  # first and last experts
    x = mx.array(rng.standard_normal((2, k, K) if per_expert else (2, K)).astype(np.float32))
    x = x.astype(dtype)
    g = mx.array(rng.standard_normal((2, k, N)).astype(np.float32)).astype(dtype)
    _, (dx,) = mx.vjp(lambda x: mt.expert_qmv(x, w, scales, biases, mx.array(ids), mode=mode),
                      [x], [g])
    terms = np.einsum("tkn,tknc->tknc", _f64(g), wd[ids])  # g[t, k, n] * W[e, n, c]
    want, mag = terms.sum(2), np.abs(terms).sum(2)
    if not per_expert:
        want, mag = want.sum(1), mag.sum(1)
    assert_close(dx, want, dtype, mag, what="dx")


def test_expert_qmv_vjp_out_of_range_id_is_nan(any_backend, rng):
    """A pair with an id outside [0, E) has a NaN output row; its x gets a NaN gradient,
    the other tokens' x are unaffected."""
    w, scales, biases, _ = _quantize(rng, (2, 32, 64), mx.float32, "affine")
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    ids = mx.array([[0], [2], [1]], dtype=mx.int32)
    dx = mx.grad(lambda x: mt.expert_qmv(x, w, scales, biases, ids)[:, 0, 0].sum())(x)
    nan = np.isnan(np.array(dx)).all(axis=1)
    assert nan.tolist() == [False, True, False]


@pytest.mark.parametrize("mode", ("affine", "mxfp4", "nvfp4", "mxfp8"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_qmv_vjp_runs_the_dx_kernel(kernel_backend, rng, dtype, mode):
    """On a kernel backend the VJP is one launch of the dx kernel (float32 weights, N
    ragged against its 32-row blocks, shared and per-expert x, out-of-range ids)."""
    from mlx_metaltile.cases.expert_qmv import run_and_check_dx

    E, N, K = 5, 45, 128
    w, scales, biases, _ = _quantize(rng, (E, N, K), dtype, mode)
    ids = mx.array([[0, 4, 9], [3, 3, 1]], dtype=mx.uint32)
    g = mx.array(rng.standard_normal((2, 3, N)).astype(np.float32)).astype(dtype)
    for x_shape in ((2, K), (2, 3, K)):
        x = mx.array(rng.standard_normal(x_shape).astype(np.float32)).astype(dtype)
        gs, bits = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4),
                    "mxfp8": (32, 8)}[mode]  # mx.quantize's defaults
        dx = run_and_check_dx(x, w, scales, biases, ids, g, gs, bits, kernel_backend, mode)
        assert dx.dtype == dtype


def qmv_rounding_case(dtype):
    """Weight rows 3 (1 + 2^-p) and 3 + 2^-(p-2) (8-bit affine codes 3; p = 10 float16,
    7 bfloat16): g = (1, -1) gives dx = -2^-p with the float32 weights expert_qmv
    multiplies by, 0 had they been rounded to T (a tie rounded to even)."""
    p = {mx.float16: 10, mx.bfloat16: 7}[dtype]
    E, N, K = 1, 32, 32
    w = mx.array(np.full((E, N, K // 4), 0x03030303, dtype=np.uint32))
    scales, biases = np.ones((E, N, 1)), np.zeros((E, N, 1))
    scales[0, 0, 0] = 1 + 2.0**-p
    biases[0, 1, 0] = 2.0**-(p - 2)
    gv = np.zeros((1, 1, N))
    gv[0, 0, :2] = (1.0, -1.0)
    s, b, g = (mx.array(a.astype(np.float32)).astype(dtype) for a in (scales, biases, gv))
    x = mx.zeros((1, K), dtype=dtype)
    return x, w, s, b, mx.array([[0]], dtype=mx.uint32), g


@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
def test_expert_qmv_vjp_float32_weights(kernel_backend, broken_kernel, rng, dtype):
    """The dx kernel multiplies by expert_qmv's float32 weights: right as launched, and a
    kernel that rounds them to T (moe_gather_qmm's weights) fails the harness."""
    from mlx_metaltile.cases.expert_qmv import run_and_check_dx
    from mlx_metaltile.ops.expert_qmv import DX_SPEC

    x, w, s, b, ids, g = qmv_rounding_case(dtype)
    dx = run_and_check_dx(x, w, s, b, ids, g, 32, 8, kernel_backend)
    assert (_f64(dx) != 0).all()
    broken_kernel(DX_SPEC, ("return ROUND ? mt_round2<T>(v) : v;", "return mt_round2<T>(v);"))
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check_dx(x, w, s, b, ids, g, 32, 8, kernel_backend)


# Decode: far fewer (token, expert) pairs than experts. The backward then gathers the
# pairs' experts before widening their scales (expert_qmv._f32_experts): first, last and
# duplicated ids, and an out-of-range one (NaN for its x, the others exact).
DECODE_IDS = np.array([[0, 15, 15, 7], [16, 3, 0, 15]], dtype=np.int32)  # E = 16, 8 pairs


@pytest.mark.parametrize("mode", ("affine", "mxfp4"))
@pytest.mark.parametrize("per_expert", (False, True), ids=("shared_x", "per_expert_x"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_qmv_vjp_decode_few_pairs(any_backend, rng, dtype, per_expert, mode):
    E, N, K = 16, 33, 64
    w, scales, biases, wd = _quantize(rng, (E, N, K), dtype, mode)
    T, k = DECODE_IDS.shape
    x = mx.array(rng.standard_normal((T, k, K) if per_expert else (T, K)).astype(np.float32))
    x = x.astype(dtype)
    g = mx.array(rng.standard_normal((T, k, N)).astype(np.float32)).astype(dtype)
    _, (dx,) = mx.vjp(lambda x: mt.expert_qmv(x, w, scales, biases, mx.array(DECODE_IDS),
                                              mode=mode), [x], [g])
    valid = DECODE_IDS < E
    terms = np.einsum("tkn,tknc->tknc", _f64(g), wd[np.where(valid, DECODE_IDS, 0)])
    want, mag = terms.sum(2), np.abs(terms).sum(2)
    if not per_expert:  # the token with the bad id: all of its x
        want, mag, valid = want.sum(1), mag.sum(1), valid.all(1)
    got = _f64(dx)
    assert dx.dtype == dtype and np.isnan(got[~valid]).all()
    assert_close(got[valid], want[valid], dtype, mag[valid], what="dx")


@pytest.mark.parametrize("per_expert", (False, True), ids=("shared_x", "per_expert_x"))
@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
def test_expert_qmv_vjp_gathered_equals_whole_stack(rng, dtype, per_expert):
    """The decode backward (the pairs' experts gathered, then widened) gives exactly the
    dx of the whole stack widened (the products are the same per pair; on the CPU)."""
    qmv = importlib.import_module("mlx_metaltile.ops.expert_qmv")
    E, N, K = 16, 32, 128
    w, scales, biases, _ = _quantize(rng, (E, N, K), dtype, "affine")
    T, k = DECODE_IDS.shape
    x = mx.zeros((T, k, K) if per_expert else (T, K), dtype=dtype)
    g = mx.array(rng.standard_normal((T, k, N)).astype(np.float32))
    ids = mx.array(DECODE_IDS)
    info = qmv._check_expert_qmv(x, w, scales, biases, ids, None, None, "affine")
    with mx.stream(mx.cpu):
        gathered = qmv._f32_experts(w, scales, biases, ids, info)
        assert gathered[0].shape[0] == T * k  # the pairs' experts only
        valid = ids < E
        whole = (w, scales.astype(mx.float32), biases.astype(mx.float32),
                 mx.where(valid, ids, 0).astype(mx.uint32), valid & (ids >= 0))
        got, want = (qmv._x_vjp(g, None, None, None, None, x.shape, mx.float32, info, e)
                     for e in (gathered, whole))
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True)
        assert np.isnan(np.array(got)).any() and not np.isnan(np.array(got)).all()


@pytest.mark.parametrize("mode", ("affine", "mxfp4"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_moe_gather_qmm_vjp_decode_few_rows(any_backend, rng, dtype, mode):
    """Fewer rows than experts (the rows' experts' rounded weights; float32: MLX's
    gather_qmm) with first, last, duplicated and out-of-range ids."""
    E, N, K = 16, 32, 64
    w, scales, biases, _ = _quantize(rng, (E, N, K), dtype, mode)
    wd = _f64(mx.array(_decode(w, scales, biases, mode), dtype=mx.float32).astype(dtype))
    ids = DECODE_IDS.reshape(-1)
    valid = ids < E
    x = mx.array(rng.standard_normal((ids.size, K)).astype(np.float32)).astype(dtype)
    g = mx.array(rng.standard_normal((ids.size, N)).astype(np.float32)).astype(dtype)
    _, (dx,) = mx.vjp(lambda x: mt.moe_gather_qmm(x, w, scales, biases, mx.array(ids),
                                                  mode=mode), [x], [g])
    terms = _f64(g)[:, :, None] * wd[np.where(valid, ids, 0)]
    got = _f64(dx)
    assert dx.dtype == dtype and np.isnan(got[~valid]).all()
    assert_close(got[valid], terms.sum(1)[valid], dtype, np.abs(terms).sum(1)[valid],
                 what="dx")


@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16), ids=("float16", "bfloat16"))
def test_moe_gather_qmm_vjp_rows_equal_whole_stack(rng, dtype):
    """The rows' experts' rounded weights (fewer rows than experts) and the whole stack's
    (as many rows as experts or more) give the rows the same dx (on the CPU)."""
    mgq = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm")
    E, N, K = 16, 32, 128
    w, scales, biases, _ = _quantize(rng, (E, N, K), dtype, "affine")
    ids = mx.array(DECODE_IDS.reshape(-1))
    g = mx.array(rng.standard_normal((ids.size, N)).astype(np.float32)).astype(dtype)
    reps = -(-E // ids.size)  # the same rows repeated: at least E of them
    with mx.stream(mx.cpu):
        few, many = (mgq._x_vjp(mx.tile(g, (r, 1)), w, scales, biases, mx.tile(ids, r), E,
                                64, 4, "affine", dtype)[:ids.size] for r in (1, reps))
        assert np.array_equal(_f64(few), _f64(many), equal_nan=True)
        assert np.isnan(_f64(few)).any() and not np.isnan(_f64(few)).all()


@pytest.mark.parametrize("M", (1, 5))
@pytest.mark.parametrize("mode", ("affine", "mxfp4"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_moe_gather_qmm_vjp(any_backend, rng, dtype, mode, M):
    E, N, K = 3, 32, 64
    w, scales, biases, _ = _quantize(rng, (E, N, K), dtype, mode)
    # The forward multiplies by each weight rounded to x's dtype: so does the gradient.
    wd = _f64(mx.array(_decode(w, scales, biases, mode), dtype=mx.float32).astype(dtype))
    ids = np.array([2, 0, 2, 1, 0][:M], dtype=np.uint32)  # last and first experts
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    g = mx.array(rng.standard_normal((M, N)).astype(np.float32)).astype(dtype)
    _, (dx,) = mx.vjp(lambda x: mt.moe_gather_qmm(x, w, scales, biases, mx.array(ids),
                                                  mode=mode), [x], [g])
    terms = _f64(g)[:, :, None] * wd[ids]
    assert_close(dx, terms.sum(1), dtype, np.abs(terms).sum(1), what="dx")


def test_moe_gather_qmm_vjp_out_of_range_id_is_nan(any_backend, rng):
    w, scales, biases, _ = _quantize(rng, (2, 32, 64), mx.float32, "affine")
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    ids = mx.array([1, -1, 0], dtype=mx.int32)
    dx = mx.grad(lambda x: mt.moe_gather_qmm(x, w, scales, biases, ids)[:, 0].sum())(x)
    assert np.isnan(np.array(dx)).all(axis=1).tolist() == [False, True, False]


@pytest.mark.parametrize("m", (1, 33))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_fp4_qmm_vjp(kernel_backend, rng, dtype, m):
    w, scales, _, wd = _quantize(rng, (64, 64), dtype, "mxfp4")
    x = mx.array(rng.standard_normal((m, 64)).astype(np.float32)).astype(dtype)
    g = mx.array(rng.standard_normal((m, 64)).astype(np.float32)).astype(dtype)
    _, (dx,) = mx.vjp(lambda x: mt.fp4_qmm(x, w, scales), [x], [g])
    terms = _f64(g)[:, :, None] * wd[None]
    assert_close(dx, terms.sum(1), dtype, np.abs(terms).sum(1), what="dx")


@pytest.mark.parametrize("argnum", (1, 2, 3), ids=("w", "scales", "biases"))
def test_no_gradient_for_quantized_constants(any_backend, rng, argnum):
    w, scales, biases, _ = _quantize(rng, (2, 32, 64), mx.float32, "affine")
    x = mx.array(rng.standard_normal((4, 64)).astype(np.float32))
    ids = mx.array([0, 1, 1, 0], dtype=mx.uint32)
    calls = {
        "expert_qmv": lambda *a: mt.expert_qmv(*a, ids[:, None]).sum(),
        "moe_gather_qmm": lambda *a: mt.moe_gather_qmm(*a, ids).sum(),
    }
    for op, fn in calls.items():
        with pytest.raises(ValueError, match=rf"\[{op}\] no gradient with respect to the "
                                             "quantized weights"):
            mx.grad(fn, argnums=argnum)(x, w, scales, biases)
    wf, sf = mx.quantize(mx.ones((32, 64)), mode="mxfp4")
    with pytest.raises(ValueError, match=r"\[fp4_qmm\] no gradient"):
        mx.grad(lambda s: mt.fp4_qmm(x, wf, s).sum())(sf)


# ---- sdpa_multi ----------------------------------------------------------------------

def sdpa_grad_oracle(q, k, v, g, scale, causal, kv_len):
    """float64 (dq, dk, dv) of softmax(scale q k^T) v over keys [0, kv_len), GQA heads."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    kk = np.repeat(k[:, :, :kv_len], G, axis=1)
    vv = np.repeat(v[:, :, :kv_len], G, axis=1)
    s = scale * q @ kk.swapaxes(-1, -2)
    if causal:
        s = np.where(np.arange(kv_len)[None] <= np.arange(kv_len - L, kv_len)[:, None], s,
                     -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = g @ vv.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * ds @ kk
    dk = scale * ds.swapaxes(-1, -2) @ q
    dv = p.swapaxes(-1, -2) @ g
    fold = lambda a: a.reshape(B, k.shape[1], G, kv_len, D).sum(2)  # noqa: E731
    pad = [(0, 0), (0, 0), (0, k.shape[2] - kv_len), (0, 0)]
    return dq, np.pad(fold(dk), pad), np.pad(fold(dv), pad)


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("Hq, Hkv, L, kv_len", [(2, 2, 1, 33), (4, 1, 3, 31), (6, 2, 5, 40)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_multi_vjp(any_backend, rng, dtype, Hq, Hkv, L, kv_len, causal):
    S, D = kv_len + 3, 64
    q, k, v, g = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                  for s in ((1, Hq, L, D), (1, Hkv, S, D), (1, Hkv, S, D), (1, Hq, L, D)))
    scale = D ** -0.5
    _, grads = mx.vjp(lambda q, k, v: mt.sdpa_multi(q, k, v, scale=scale, causal=causal,
                                                    kv_len=kv_len), [q, k, v], [g])
    want = sdpa_grad_oracle(*map(_f64, (q, k, v, g)), scale, causal, kv_len)
    for got, exact, name in zip(grads, want, ("dq", "dk", "dv"), strict=True):
        # magnitude: the float32 softmax and its sums, a few ulps of the largest entry
        mag = np.full(exact.shape, np.abs(exact).max() * 4)
        assert_close(got, exact, dtype, mag, what=name)
        assert not np.any(np.array(got.astype(mx.float32))[:, :, kv_len:]) or name == "dq"


def sdpa_sinks_mask_oracle(q, k, v, g, scale, sinks, mask):
    """float64 ((dsinks, |terms|), (dmask, |terms|)) of softmax over the scores
    scale q k^T + mask and the head's sink (the sink joins the denominator only), GQA heads;
    mask [L, S] broadcast over batch and heads. d out / d s_j = p_j (v_j - out), and the
    sink's value is 0: dL/dsink = -p_sink g.out."""
    G = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = scale * q @ kk.swapaxes(-1, -2) + mask
    sink = sinks.reshape(1, -1, 1, 1)
    top = np.maximum(s.max(-1, keepdims=True), sink)
    e, es = np.exp(s - top), np.exp(sink - top)
    den = e.sum(-1, keepdims=True) + es
    p, ps = e / den, es / den
    go = (g * (p @ vv)).sum(-1, keepdims=True)  # g.out per query row
    gv = g @ vv.swapaxes(-1, -2)  # g.v_j
    dsinks = -(ps * go).sum(axis=(0, 2, 3))
    dsinks_mag = (ps * np.abs(g) @ np.abs(vv).swapaxes(-1, -2) * p).sum(axis=(0, 2, 3))
    dmask = (p * (gv - go)).sum(axis=(0, 1))
    dmask_mag = (p * (np.abs(gv) + np.abs(go))).sum(axis=(0, 1))
    return (dsinks, dsinks_mag), (dmask, dmask_mag)


@pytest.mark.parametrize("Hq, Hkv, L, S", [(2, 2, 1, 33), (4, 1, 3, 40)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_multi_vjp_sinks_mask(any_backend, rng, dtype, Hq, Hkv, L, S):
    """Gradients w.r.t. the sinks and an additive mask (broadcast over batch and heads)."""
    D = 64
    q, k, v, g = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                  for s in ((2, Hq, L, D), (2, Hkv, S, D), (2, Hkv, S, D), (2, Hq, L, D)))
    sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(dtype)
    mask = mx.array(rng.uniform(-2, 1, size=(L, S)).astype(np.float32)).astype(dtype)
    scale = D ** -0.5
    _, (dsinks, dmask) = mx.vjp(
        lambda s, m: mt.sdpa_multi(q, k, v, scale=scale, sinks=s, mask=m), [sinks, mask], [g])
    assert (dsinks.shape, dmask.shape) == (sinks.shape, mask.shape)
    want = sdpa_sinks_mask_oracle(*map(_f64, (q, k, v, g)), scale, _f64(sinks), _f64(mask))
    for got, (exact, mag), name in zip((dsinks, dmask), want, ("dsinks", "dmask"), strict=True):
        # magnitude: the float32 softmax and its sums, a few ulps of the largest term
        assert_close(got, exact, dtype, (mag + np.abs(exact).max()) * 4, what=name)


# ---- transforms ----------------------------------------------------------------------

def test_emulator_refuses_compile_and_vmap(rng):
    from support import require_backend
    require_backend("emulator")
    y, z, w = make_inputs(rng, (3,), 16, mx.float32, mx.float32)
    with backends.use_backend("emulator"):
        for transform in (mx.compile, mx.vmap):
            fn = transform(lambda y, z: mt.gated_rms_norm(y, z, w))
            with pytest.raises(ValueError, match=r"\[gated_rms_norm\] the emulator backend "
                                                 "runs kernels eagerly"):
                mx.eval(fn(y, z))


# ---- a training step through every op -------------------------------------------------

def _model_params(rng):
    p = {name: mx.array(rng.standard_normal(shape).astype(np.float32) * 0.5)
         for name, shape in (("x", (4, 64)), ("gz", (4, 64)), ("w", (64,)), ("q", (1, 2, 4, 64)))}
    return p


def _model_consts(rng):
    wq, sq, bq = mx.quantize(mx.array(rng.standard_normal((3, 32, 64)).astype(np.float32)
                                      * 0.2))
    wf, sf = mx.quantize(mx.array(rng.standard_normal((64, 64)).astype(np.float32) * 0.2),
                         mode="mxfp4")
    kv = mx.array(rng.standard_normal((2, 1, 2, 12, 64)).astype(np.float32))
    return wq, sq, bq, wf, sf, kv


def _loss(p, consts):
    wq, sq, bq, wf, sf, kv = consts
    ids = mx.array([0, 2, 2, 1], dtype=mx.uint32)
    h = mt.gated_rms_norm(p["x"], p["gz"], p["w"])
    h = mt.fp4_qmm(h, wf, sf)
    a = mt.moe_gather_qmm(h, wq, sq, bq, ids)
    b = mt.expert_qmv(h, wq, sq, bq, ids[:, None])[:, 0]
    att = mt.sdpa_multi(p["q"], kv[0], kv[1], scale=0.125, kv_len=10, causal=True)
    _, scores = mt.moe_route(h[:, :16], 3, normalize=False)  # a router over 16 experts
    return ((a * b - 0.5) ** 2).mean() + (att ** 2).mean() + (h ** 2).mean() + \
        ((scores - 0.25) ** 2).mean()


LR = 0.05


def _sgd(p, consts, steps):
    losses = []
    for _ in range(steps):
        loss, grads = mx.value_and_grad(_loss)(p, consts)
        p = {k: p[k] - LR * grads[k] for k in p}
        mx.eval(loss, p)
        losses.append(loss.item())
    return losses, p, grads


def test_sgd_step_matches_reference(kernel_backend, rng):
    """One SGD step: the parameters equal the reference backend's within the float32 row of
    the tolerance table, the magnitude being |p| + lr * K * max|grad| (K = 64, the longest
    sum behind a gradient); the 5-step loop moves the loss as on the reference."""
    p, consts = _model_params(rng), _model_consts(rng)
    with backends.use_backend("reference"):
        ref_losses, ref_p, ref_grads = _sgd(p, consts, 1)
    losses, new_p, grads = _sgd(p, consts, 1)
    for name in p:
        assert np.any(np.array(grads[name]) != 0), name  # no silent zero
        mag = np.abs(np.array(p[name], np.float64)) + LR * 64 * np.abs(np.array(ref_grads[name])).max()
        assert_close(new_p[name], np.array(ref_p[name]), mx.float32, mag, what=name)
    with backends.use_backend("reference"):
        ref_losses = _sgd(p, consts, 5)[0]
    losses = _sgd(p, consts, 5)[0]
    assert ref_losses[-1] < ref_losses[0]  # the loop trains (by 0.008 to 0.02 here) ...
    assert_close(mx.array(losses), np.array(ref_losses), mx.float32, np.array(ref_losses) * 64,
                 what="losses")  # ... on the kernel backend as on the reference


def test_compiled_function_keeps_the_backend_of_its_trace(rng):
    """mx.compile caches the traced graph per input shapes/dtypes: the backend chosen when
    it was traced sticks (documented in the README); a new trace takes the current one."""
    from support import require_backend
    require_backend("emulator")
    y, z, w = make_inputs(rng, (3,), 16, mx.float32, mx.float32)
    fn = mx.compile(lambda y: mt.gated_rms_norm(y, z, w))
    with backends.use_backend("reference"):
        want = fn(y)
    with backends.use_backend("emulator"):
        before = backends.launch_count()
        got = fn(y)  # the cached reference graph: no kernel launch
        assert backends.launch_count() == before
        assert np.array_equal(np.array(got), np.array(want))
        with pytest.raises(ValueError, match="runs kernels eagerly"):
            mx.eval(mx.compile(lambda y: mt.gated_rms_norm(y, z, w))(y))


def test_dx_instantiations_cover_the_expert_qmv_launches(launch_recorder, rng):
    """Every expert_qmv dx launch (each dtype, mode, index dtype, x layout) is an
    instantiation its spec declares (what the CUDA compile check builds); nothing runs."""
    from mlx_metaltile.ops.expert_qmv import DX_SPEC

    for dtype in DTYPES:
        for mode in ("affine", "mxfp4", "nvfp4", "mxfp8"):
            w, scales, biases, _ = _quantize(rng, (3, 32, 64), dtype, mode)
            g = mx.zeros((2, 3, 32), dtype=dtype)
            for index_dtype in (mx.uint32, mx.int32):
                ids = mx.array([[0, 2, 1], [1, 0, 2]], dtype=index_dtype)
                for x in (mx.zeros((2, 64), dtype), mx.zeros((2, 3, 64), dtype)):
                    forward = functools.partial(mt.expert_qmv, w=w, scales=scales,
                                                biases=biases, indices=ids, mode=mode)
                    mx.vjp(forward, [x], [g])
    names = [name for name, *_ in launch_recorder.seen]
    assert names.count(DX_SPEC.name) == 3 * 4 * 2 * 2
    launch_recorder.assert_declared()
