"""Gradients of the fused MoE decode ops (expert_glu, expert_down_combine): VJPs against
float64 gradients written from the math (NumPy), out-of-range ids, the quantized constants'
errors, the stream check, and negative controls (a VJP with a dropped term fails)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64

glu = importlib.import_module("mlx_metaltile.ops.expert_glu")
down = importlib.import_module("mlx_metaltile.ops.expert_down_combine")
qmv = importlib.import_module("mlx_metaltile.ops.expert_qmv")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DT_IDS = ("float32", "float16", "bfloat16")
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's SwigluOAI
E, N, K = 4, 33, 64

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


# The experts' quantization: mx.quantize's arguments, also the ops' keywords.
QUANTS = {"affine4": {}, "affine8": dict(bits=8), "mxfp4": dict(mode="mxfp4")}


def _quantize(rng, shape, dtype, quant="affine4"):
    """Experts (affine 4-bit unless ``quant`` says otherwise) and the weights they hold,
    exactly (float64)."""
    wf = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    kw = QUANTS[quant]
    if kw.get("mode") == "mxfp4":
        w, scales = mx.quantize(wf, **kw)
        return (w, scales, None), to_f64(mx.dequantize(w, scales, None, dtype=mx.float32, **kw))
    w, scales, biases = mx.quantize(wf, **kw)
    wd = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), **kw)
    return (w, scales, biases), to_f64(wd)


def _rand(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _act_grads(gate, up, c, activation):
    """float64 (d out/d gate, d out/d up) times the cotangent c. silu: out = g s(g) u;
    swiglu_oai: out = (clip(u, -L, L) + 1) * m s(a m), m = min(g, L) (zero where clamped)."""
    if activation == "silu":
        s = _sigmoid(gate)
        return c * up * s * (1 + gate * (1 - s)), c * gate * s
    m = np.minimum(gate, LIMIT)
    s = _sigmoid(ALPHA * m)
    d_gate = c * (np.clip(up, -LIMIT, LIMIT) + 1) * s * (1 + ALPHA * m * (1 - s))
    return np.where(gate < LIMIT, d_gate, 0.0), np.where(np.abs(up) < LIMIT, c * m * s, 0.0)


def glu_grad_oracle(x, wg, wu, bg, bu, ids, c, activation):
    """float64 (dx, dbias_gate, dbias_up) and their magnitudes for x [T, K] shared by the
    token's k experts or [T, k, K] one per expert (gate = x Wg[e]^T + bg[e], up alike). The magnitude of d gate / d up
    adds their sensitivity to gate and up (the activation's second derivatives, central
    differences of these float64 formulas) times the |terms| behind gate and up: the
    float32 gate and up differ from the exact ones by about accum times that."""
    sub = "tc,tknc->tkn" if x.ndim == 2 else "tkc,tknc->tkn"
    gate = np.einsum(sub, x, wg[ids]) + bg[ids]
    up = np.einsum(sub, x, wu[ids]) + bu[ids]
    g_mag = np.einsum(sub, np.abs(x), np.abs(wg[ids])) + np.abs(bg[ids])
    u_mag = np.einsum(sub, np.abs(x), np.abs(wu[ids])) + np.abs(bu[ids])
    d_gate, d_up = _act_grads(gate, up, c, activation)
    mags = [np.abs(d_gate), np.abs(d_up)]
    for v, v_mag, shift in ((gate, g_mag, (1, 0)), (up, u_mag, (0, 1))):
        h = 1e-5 * np.maximum(1.0, np.abs(v))
        hi = _act_grads(gate + shift[0] * h, up + shift[1] * h, c, activation)
        lo = _act_grads(gate - shift[0] * h, up - shift[1] * h, c, activation)
        for i in range(2):
            mags[i] = mags[i] + np.abs(hi[i] - lo[i]) / (2 * h) * v_mag
    terms = np.concatenate([d_gate[..., None] * wg[ids], d_up[..., None] * wu[ids]], axis=2)
    axes = (1, 2) if x.ndim == 2 else 2  # shared x: summed over the token's k experts too
    dx = terms.sum(axes)
    dx_mag = (np.concatenate([mags[0][..., None] * np.abs(wg[ids]),
                              mags[1][..., None] * np.abs(wu[ids])], axis=2)).sum(axes)
    dbias = []
    for d, mag in zip((d_gate, d_up), mags, strict=True):
        acc, acc_mag = np.zeros((len(wg), N)), np.zeros((len(wg), N))
        np.add.at(acc, ids.reshape(-1), d.reshape(-1, N))
        np.add.at(acc_mag, ids.reshape(-1), mag.reshape(-1, N))
        dbias.append((acc, acc_mag))
    return (dx, dx_mag), *dbias


def _ids(k: int, n_experts: int) -> np.ndarray:
    """k = 3: expert 0 twice in the first token (duplicated ids), the last expert in both;
    k = 4 (decode, 16 experts or more: fewer pairs than experts): first, last twice, one
    between."""
    if k == 4:
        return np.array([[0, n_experts - 1, n_experts - 1, 7]], dtype=np.uint32)
    return np.array([[0, 3, 0], [3, 2, 1]] if k == 3 else [[3], [0]], dtype=np.uint32)


def _glu_inputs(rng, dtype, k, bias, per_expert=False, n_experts=E, quant="affine4"):
    gate, wg = _quantize(rng, (n_experts, N, K), dtype, quant)
    up, wu = _quantize(rng, (n_experts, N, K), dtype, quant)
    ids = _ids(k, n_experts)
    T = ids.shape[0]
    # gate, up ~ N(0, 8): swiglu_oai clamps some of them
    x = _rand(rng, (T, k, K) if per_expert else (T, K), dtype)
    biases = ((_rand(rng, (n_experts, N), dtype), _rand(rng, (n_experts, N), dtype)) if bias
              else ())
    c = _rand(rng, (T, k, N), dtype)
    return gate, up, wg, wu, ids, x, biases, c


def glu_check(rng, dtype, k, activation, bias, per_expert=False, n_experts=E,
              quant="affine4"):
    gate, up, wg, wu, ids, x, biases, c = _glu_inputs(rng, dtype, k, bias, per_expert,
                                                      n_experts, quant)

    def fn(x, *b):
        kw = dict(QUANTS[quant], **(dict(bias_gate=b[0], bias_up=b[1]) if b else {}))
        return mt.expert_glu(x, *gate, *up, mx.array(ids), activation=activation, **kw)

    _, grads = mx.vjp(fn, [x, *biases], [c])
    zero = np.zeros((n_experts, N))
    bg, bu = (to_f64(b) for b in biases) if bias else (zero, zero)
    want = glu_grad_oracle(to_f64(x), wg, wu, bg, bu, ids, to_f64(c), activation)
    assert len(grads) == 1 + len(biases)
    for got, (exact, mag), name in zip(grads, want[:len(grads)],
                                       ("dx", "dbias_gate", "dbias_up")[:len(grads)],
                                       strict=True):
        assert got.dtype == dtype
        assert_close(got, exact, dtype, mag, what=name)
    return grads


@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)],
                         ids=("silu", "swiglu_oai_bias"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_glu_vjp(any_backend, rng, dtype, activation, bias, k):
    before, qmv_before = backends.launch_count(), _qmv_launches()
    dx = glu_check(rng, dtype, k, activation, bias)[0]
    assert np.any(to_f64(dx) != 0)  # no silent zero
    if any_backend != "reference":
        assert backends.launch_count() > before  # the kernel ran forward
    # backward on a kernel backend: gate and up recomputed, then d_gate Wg and d_up Wu
    want = [0, 0] if any_backend == "reference" else [2, 2]
    assert [a - b for a, b in zip(_qmv_launches(), qmv_before, strict=True)] == want


@pytest.mark.parametrize("activation", ("silu", "swiglu_oai"))
def test_expert_glu_vjp_per_expert_x(any_backend, rng, activation):
    """x [T, k, K], one input per selected expert: each gets its own pair's gradient."""
    glu_check(rng, mx.bfloat16, 3, activation, True, per_expert=True)


def test_expert_glu_vjp_clamps_give_zero(rng):
    """swiglu_oai: gate above the limit and up outside [-L, L] pass no gradient. One expert
    of one row of ones makes gate = up = sum(x): at 10 both clamp (zero), at -10 only up
    (gate's term alone), at 3 neither."""
    q = mx.quantize(mx.ones((1, 1, 32)), group_size=32)
    for total in (10.0, -10.0, 3.0):
        x = mx.full((1, 32), total / 32)
        dx = mx.grad(lambda x: mt.expert_glu(x, *q, *q, mx.array([[0]]), group_size=32,
                                             activation="swiglu_oai").sum())(x)
        d_gate, d_up = _act_grads(np.float64(total), np.float64(total), 1.0, "swiglu_oai")
        assert (d_up == 0) == (abs(total) > LIMIT) and (d_gate == 0) == (total > LIMIT)
        want = np.full((1, 32), d_gate + d_up)
        assert_close(dx, want, mx.float32, np.abs(want) * 40, what=f"dx at {total}")
        assert (np.array(dx) == 0).all() == (total > LIMIT)


def down_grad_oracle(h, wd, b, ids, s, c):
    """float64 (dh, dscores, dbias) and their |terms|: out = sum_j s_j (h_j W[e_j]^T + b[e_j])."""
    terms = (s[..., None] * c[:, None, :])[..., None] * wd[ids]  # [T, k, D, N]
    dh, dh_mag = terms.sum(2), np.abs(terms).sum(2)
    y_terms = np.einsum("tkc,tkdc->tkdc", h, wd[ids])
    y = y_terms.sum(-1) + b[ids]
    ds = (c[:, None, :] * y).sum(-1)
    ds_mag = (np.abs(c)[:, None, :] * (np.abs(y_terms).sum(-1) + np.abs(b[ids]))).sum(-1)
    gb = s[..., None] * c[:, None, :]
    db, db_mag = np.zeros(b.shape), np.zeros(b.shape)
    np.add.at(db, ids.reshape(-1), gb.reshape(-1, b.shape[1]))
    np.add.at(db_mag, ids.reshape(-1), np.abs(gb).reshape(-1, b.shape[1]))
    return (dh, dh_mag), (ds, ds_mag), (db, db_mag)


def down_check(rng, dtype, k, bias, scores_f32, n_experts=E, quant="affine4"):
    D = N
    q, wd = _quantize(rng, (n_experts, D, K), dtype, quant)
    ids = _ids(k, n_experts)
    T = ids.shape[0]
    h = _rand(rng, (T, k, K), dtype)
    s = _rand(rng, (T, k), mx.float32 if scores_f32 else dtype)
    b = _rand(rng, (n_experts, D), dtype) if bias else None
    c = _rand(rng, (T, D), dtype)
    primals = [h, s] + ([b] if bias else [])
    _, grads = mx.vjp(lambda h, s, *b: mt.expert_down_combine(
        h, *q, mx.array(ids), s, bias=b[0] if b else None, **QUANTS[quant]), primals, [c])
    want = down_grad_oracle(to_f64(h), wd, to_f64(b) if bias else np.zeros((n_experts, D)), ids,
                            to_f64(s), to_f64(c))
    assert len(grads) == len(primals)
    for got, p, (exact, mag), name in zip(grads, primals, want[:len(grads)],
                                          ("dh", "dscores", "dbias")[:len(grads)],
                                          strict=True):
        assert got.dtype == p.dtype and got.shape == p.shape
        assert_close(got, exact, p.dtype, mag, what=name)
    return grads


@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("scores_f32", (False, True), ids=("scores_same", "scores_f32"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_down_combine_vjp(any_backend, rng, dtype, scores_f32, bias, k):
    before, qmv_before = backends.launch_count(), _qmv_launches()
    for g in down_check(rng, dtype, k, bias, scores_f32):
        assert np.any(to_f64(g) != 0)  # no silent zero
    if any_backend != "reference":
        assert backends.launch_count() > before
    # backward on a kernel backend: one x-VJP launch (g W[e] per pair), nothing recomputed
    want = [0, 0] if any_backend == "reference" else [0, 1]
    assert [a - b for a, b in zip(_qmv_launches(), qmv_before, strict=True)] == want


def _qmv_launches() -> list[int]:
    """Launches of expert_qmv's forward and x-VJP kernels so far (the fused ops' backward
    on a kernel backend)."""
    return [backends.launch_count(name=spec.name) for spec in (qmv.SPEC, qmv.DX_SPEC)]


@pytest.mark.parametrize("quant", ("affine8", "mxfp4"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_fused_vjp_quantizations(any_backend, rng, dtype, quant):
    """Affine 8-bit and mxfp4 experts (4-bit: the tests above): both ops with biases and
    duplicated ids (k = 3), without them at one token's 4 of 32 experts and at k = 1."""
    glu_check(rng, dtype, 3, "swiglu_oai", True, quant=quant)
    glu_check(rng, dtype, 4, "silu", False, n_experts=32, quant=quant)
    down_check(rng, dtype, 3, True, True, quant=quant)
    down_check(rng, dtype, 1, False, False, quant=quant)


def test_fused_vjp_bitwise_reproducible(any_backend, rng):
    """The same backward twice gives the same bits (fixed summation orders, no atomics)."""
    gate, up, _, _, ids, x, biases, c = _glu_inputs(rng, mx.bfloat16, 4, True, n_experts=32)
    h, s = _rand(rng, (1, 4, K), mx.bfloat16), _rand(rng, (1, 4), mx.float32)

    def grads():
        _, gx = mx.vjp(lambda x, bg, bu: mt.expert_glu(x, *gate, *up, mx.array(ids),
                                                       bias_gate=bg, bias_up=bu,
                                                       activation="swiglu_oai"),
                       [x, *biases], [c])
        _, gh = mx.vjp(lambda h, s: mt.expert_down_combine(h, *gate, mx.array(ids), s),
                       [h, s], [c[:, 0]])
        return [np.array(g.astype(mx.float32)) for g in (*gx, *gh)]

    for a, b in zip(grads(), grads(), strict=True):
        assert np.array_equal(a, b, equal_nan=True)


def test_fused_vjp_instantiations_are_declared(launch_recorder, rng):
    """Every kernel the fused ops' backward launches (each dtype, quantization, index
    dtype, x layout, scores and cotangent dtype) is an instantiation its spec declares
    (what the CUDA compile check builds); nothing runs."""
    for dtype in DTYPES:
        for quant, kw in QUANTS.items():
            q, _ = _quantize(rng, (3, 32, 64), dtype, quant)
            for index_dtype in (mx.uint32, mx.int32):
                ids = mx.array([[0, 2, 1], [1, 0, 2]], dtype=index_dtype)
                for x in (mx.zeros((2, 64), dtype), mx.zeros((2, 3, 64), dtype)):
                    mx.vjp(lambda x, ids=ids, q=q, kw=kw: mt.expert_glu(x, *q, *q, ids, **kw),
                           [x], [mx.zeros((2, 3, 32), dtype)])
                for s, c in ((mx.ones((2, 3), dtype), mx.zeros((2, 32), dtype)),
                             (mx.ones((2, 3)), mx.zeros((2, 32)))):
                    mx.vjp(lambda h, s, ids=ids, q=q, kw=kw: mt.expert_down_combine(
                        h, *q, ids, s, **kw), [mx.zeros((2, 3, 64), dtype), s], [c])
    names = {name for name, *_ in launch_recorder.seen}
    assert {qmv.SPEC.name, qmv.DX_SPEC.name} <= names
    launch_recorder.assert_declared()


@pytest.mark.parametrize("per_expert", (False, True), ids=("shared_x", "per_expert_x"))
@pytest.mark.parametrize("activation, bias", [("silu", False), ("swiglu_oai", True)],
                         ids=("silu", "swiglu_oai_bias"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_glu_vjp_decode_few_pairs(any_backend, rng, dtype, activation, bias,
                                         per_expert):
    """One token's 4 experts of 32: the backward gathers the pairs' experts (first, last
    twice) before widening their scales."""
    glu_check(rng, dtype, 4, activation, bias, per_expert, n_experts=32)


@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_expert_down_combine_vjp_decode_few_pairs(any_backend, rng, dtype, bias):
    down_check(rng, dtype, 4, bias, False, n_experts=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_fused_vjp_decode_out_of_range_id_is_nan(any_backend, rng, dtype):
    """At decode (fewer pairs than experts: the gathered backward) a bad id still gives its
    x, h row and score NaN, the rest finite."""
    (gate, _), (down_q, _) = (_quantize(rng, (32, 32, 64), dtype) for _ in range(2))
    ids = mx.array([[0, 31, 32], [31, 5, 0]], dtype=mx.int32)
    x = _rand(rng, (2, 64), dtype)
    dx = mx.grad(lambda x: mt.expert_glu(x, *gate, *gate, ids).astype(mx.float32)[
        :, :, 0].sum())(x)
    assert np.isnan(to_f64(dx)).all(axis=1).tolist() == [True, False]
    h, s = _rand(rng, (2, 3, 64), dtype), _rand(rng, (2, 3), dtype)
    dh, ds = mx.grad(lambda h, s: mt.expert_down_combine(h, *down_q, ids, s).astype(
        mx.float32)[1].sum(), argnums=(0, 1))(h, s)
    assert np.isnan(to_f64(dh)).all(axis=-1).tolist() == [[False, False, True],
                                                          [False, False, False]]
    assert np.isnan(to_f64(ds)).tolist() == [[False, False, True], [False, False, False]]
    assert np.isfinite(to_f64(dh)).sum() == 5 * 64


# ---- out-of-range ids ------------------------------------------------------------------

def test_expert_glu_vjp_out_of_range_id_is_nan(any_backend, rng):
    """A pair with an id outside [0, E) has a NaN output row: its token's x gets a NaN
    gradient, the other tokens' x are unaffected; the biases' gradients stay finite (the
    pair reads no bias row)."""
    gate, _ = _quantize(rng, (2, 32, 64), mx.float32)
    x = _rand(rng, (3, 64), mx.float32)
    b = [_rand(rng, (2, 32), mx.float32) for _ in range(2)]
    ids = mx.array([[0, 1], [1, 2], [-1, 0]], dtype=mx.int32)
    dx, dbg, dbu = mx.grad(lambda x, bg, bu: mt.expert_glu(
        x, *gate, *gate, ids, bias_gate=bg, bias_up=bu)[:, :, 0].sum(), argnums=(0, 1, 2))(
        x, *b)
    assert np.isnan(np.array(dx)).all(axis=1).tolist() == [False, True, True]
    assert np.isfinite(np.array(dbg)).all() and np.isfinite(np.array(dbu)).all()


def test_expert_down_combine_vjp_out_of_range_id_is_nan(any_backend, rng):
    """The pair with the bad id gets a NaN gradient for its h row and its score; the token's
    other pair and the other token get finite ones, the bias a finite one."""
    q, _ = _quantize(rng, (2, 32, 64), mx.float32)
    h, s = _rand(rng, (2, 2, 64), mx.float32), _rand(rng, (2, 2), mx.float32)
    b = _rand(rng, (2, 32), mx.float32)
    ids = mx.array([[0, 2], [1, 0]], dtype=mx.uint32)
    dh, ds, db = mx.grad(lambda h, s, b: mt.expert_down_combine(h, *q, ids, s, bias=b)[1].sum(),
                         argnums=(0, 1, 2))(h, s, b)
    assert np.isnan(np.array(dh)).all(axis=-1).tolist() == [[False, True], [False, False]]
    assert np.isnan(np.array(ds)).tolist() == [[False, True], [False, False]]
    assert np.isfinite(np.array(db)).all()


# ---- refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("argnum", (1, 2, 3), ids=("w", "scales", "biases"))
def test_no_gradient_for_quantized_constants(any_backend, rng, argnum):
    q, _ = _quantize(rng, (2, 32, 64), mx.float32)
    x, ids = _rand(rng, (2, 64), mx.float32), mx.array([[0, 1], [1, 1]], dtype=mx.uint32)
    s = mx.ones((2, 2))
    calls = {
        "expert_glu": lambda x, *a: mt.expert_glu(x, *a, *q, ids).sum(),
        "expert_down_combine": lambda x, *a: mt.expert_down_combine(
            mx.broadcast_to(x[:, None], (2, 2, 64)), *a, ids, s).sum(),
    }
    for op, fn in calls.items():
        with pytest.raises(ValueError, match=rf"\[{op}\] no gradient with respect to the "
                                             "quantized weights"):
            mx.grad(fn, argnums=argnum)(x, *q)
    # the up projection's constants too
    with pytest.raises(ValueError, match=r"\[expert_glu\] no gradient"):
        mx.grad(lambda w: mt.expert_glu(x, *q, w, *q[1:], ids).sum())(q[0])


@pytest.mark.parametrize("op", ("expert_glu", "expert_down_combine"))
def test_stream_must_be_a_stream_or_device(rng, op):
    q, _ = _quantize(rng, (2, 32, 64), mx.float32)
    x, ids = _rand(rng, (1, 2, 64), mx.float32), mx.array([[0, 1]], dtype=mx.uint32)
    for stream in ("gpu", 0):
        with pytest.raises(TypeError, match=rf"\[{op}\] stream must be None, an mx.Stream or "
                                            r"an mx.Device \(mx.cpu, mx.gpu\), got "):
            if op == "expert_glu":
                mt.expert_glu(x[:, 0], *q, *q, ids, stream=stream)
            else:
                mt.expert_down_combine(x, *q, ids, mx.ones((1, 2)), stream=stream)
    with pytest.raises(TypeError, match=rf"\[{op}\] stream must be"):
        if op == "expert_glu":
            glu.expert_glu_reference(x[:, 0], *q, *q, ids, stream="cpu")
        else:
            down.expert_down_combine_reference(x, *q, ids, mx.ones((1, 2)), stream="cpu")


def test_vjp_on_a_stream(any_backend, rng):
    """A stream of its own (mx.cpu; on a GPU backend, whose kernels refuse the CPU, a new GPU
    stream): forward and backward run there and give the default stream's values."""
    other = mx.cpu if any_backend in ("reference", "emulator") else mx.new_stream(mx.gpu)
    gate, up, _, _, ids, x, _, c = _glu_inputs(rng, mx.float32, 3, False)
    grads = [mx.vjp(lambda x, st=st: mt.expert_glu(x, *gate, *up, mx.array(ids), stream=st),
                    [x],
                    [c])[1][0] for st in (None, other)]
    assert mx.array_equal(*grads).item()
    h, s = _rand(rng, (2, 3, K), mx.float32), _rand(rng, (2, 3), mx.float32)
    grads = [mx.vjp(lambda h, s, st=st: mt.expert_down_combine(h, *gate, mx.array(ids), s,
                                                               stream=st),
                    [h, s], [c[:, 0]])[1] for st in (None, other)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(*grads, strict=True))


# ---- negative controls ---------------------------------------------------------------------

def test_expert_glu_negative_control(kernel_backend, monkeypatch, rng):
    """silu's derivative without its second term (sigmoid held constant: the forward value
    is unchanged, the kernel computes it) must fail the harness."""
    real = glu._activate
    monkeypatch.setattr(glu, "_activate", lambda g, u, act: (
        g * mx.stop_gradient(mx.sigmoid(g)) * u if act == "silu" else real(g, u, act)))
    with pytest.raises(AssertionError, match="dx .*out of tolerance"):
        glu_check(rng, mx.float32, 3, "silu", False)


def test_expert_glu_recompute_negative_control(kernel_backend, broken_kernel, rng):
    """gate and up recomputed by expert_qmv's kernel without the affine bias term of its
    weights must fail dx."""
    broken_kernel(qmv.SPEC, ("acc[r] += s * dot + b * x_sum[wi];", "acc[r] += s * dot;"))
    with pytest.raises(AssertionError, match="dx .*out of tolerance"):
        glu_check(rng, mx.float32, 3, "silu", False)


def test_expert_down_combine_negative_control(kernel_backend, broken_kernel, rng):
    """The x-VJP kernel's weights without their affine bias (u = g W[e], behind dh and
    dscores) must fail the harness."""
    broken_kernel(qmv.DX_SPEC, ("float2(metal::fma(s, q0, b), metal::fma(s, q1, b))",
                                "float2(s * q0, s * q1)"))
    with pytest.raises(AssertionError, match="dh .*out of tolerance"):
        down_check(rng, mx.float32, 3, True, True)
