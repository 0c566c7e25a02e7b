"""expert_glu: float64 oracle from the math (every quantization mode), benchmark cases,
checked calls."""

from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from ._base import BenchCase, check_rows, expect_launches, grad_case, oracle_and_magnitude, to_f64
from .expert_qmv import dequantize_f64
from .fp4_qmm import e2m1_value

OP = "expert_glu"
ALPHA, LIMIT = 1.702, 7.0  # mlx-lm's SwigluOAI
ACT_SLOPE = 1.1  # max |d/dg (g * sigmoid(a g))| over g, any a > 0 (silu's and gpt-oss's gate)


# ---- oracle ---------------------------------------------------------------------------

def _e4m3(b: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> float64 (bias 7, subnormals m * 2^-9; 0x7F / 0xFF read as +-480)."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(b & 0x80, -v, v)


def dequantize(w, scales, biases, mode: str, group_size: int, bits: int) -> np.ndarray:
    """W [..., N, K] in float64 from mx.quantize's arrays for ``mode``."""
    if mode == "affine":
        return dequantize_f64(w, to_f64(scales), to_f64(biases), group_size, bits)
    codes = np.ascontiguousarray(np.array(w), dtype="<u4").view(np.uint8)
    if mode == "mxfp8":
        q = _e4m3(codes)
    else:  # fp4: code 2i at the low nibble of byte i
        q = e2m1_value(np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
            *codes.shape[:-1], -1))
    s = np.array(scales)
    s = 2.0 ** (s.astype(np.float64) - 127) if mode in ("mxfp4", "mxfp8") else _e4m3(s)
    return q * np.repeat(s, group_size, axis=-1)


def project(x, w, scales, biases, bias, indices, mode, group_size, bits):
    """Each token's k projections in float64: (value, magnitude sum |terms|) [..., k, N],
    NaN for an id outside [0, E). x [..., K] (shared) or [..., k, K] (per expert)."""
    n_experts, n_out = w.shape[:2]
    ids = np.array(indices).astype(np.int64)
    xs = to_f64(x)
    if xs.ndim != ids.ndim + 1:
        xs = xs[..., None, :]
    lead = np.broadcast_shapes(xs.shape[:-2], ids.shape[:-1])
    k = ids.shape[-1]
    xs = np.broadcast_to(xs, (*lead, k, xs.shape[-1]))
    ids = np.broadcast_to(ids, (*lead, k))
    valid = (ids >= 0) & (ids < n_experts)
    val = np.full((*lead, k, n_out), np.nan)
    mag = np.full_like(val, np.nan)
    bias = None if bias is None else to_f64(bias)
    for e in np.unique(ids[valid]):
        at = ids == e
        wd = dequantize(np.array(w[int(e)]), scales[int(e)],
                        None if biases is None else biases[int(e)], mode, group_size, bits)
        val[at] = xs[at] @ wd.T
        mag[at] = np.abs(xs[at]) @ np.abs(wd).T
        if bias is not None:
            val[at] += bias[e]
            mag[at] += np.abs(bias[e])
    return val, mag, valid


def back_project(d, w, scales, biases, indices, mode, group_size, bits):
    """The transposed products d_j @ W[e_j] in float64, (value, magnitude sum |terms|)
    [..., k, K] per pair, NaN for an id outside [0, E): the gradient a projection of
    :func:`project` passes back to its input. d: ``[..., k, N]`` (the ids' shape, N)."""
    n_experts = w.shape[0]
    d = np.asarray(d, dtype=np.float64)
    ids = np.broadcast_to(np.array(indices).astype(np.int64), d.shape[:-1])
    valid = (ids >= 0) & (ids < n_experts)
    val = np.full((*ids.shape, w.shape[-1] * 32 // bits), np.nan)
    mag = np.full_like(val, np.nan)
    for e in np.unique(ids[valid]):
        at = ids == e
        wd = dequantize(np.array(w[int(e)]), scales[int(e)],
                        None if biases is None else biases[int(e)], mode, group_size, bits)
        val[at] = d[at] @ wd
        mag[at] = np.abs(d[at]) @ np.abs(wd)
    return val, mag


def scatter_rows(d, indices, n_experts):
    """sum over the pairs naming expert e of their rows d [..., k, N]: the gradient of an
    expert bias [E, N] gathered by ``indices`` (a pair with an id outside [0, E) adds
    nothing), with the same sum of |d| as its magnitude."""
    ids = np.array(indices).astype(np.int64)
    d = np.asarray(d, dtype=np.float64)
    ids = np.broadcast_to(ids, d.shape[:-1])
    valid = (ids >= 0) & (ids < n_experts)
    acc, acc_mag = np.zeros((n_experts, d.shape[-1])), np.zeros((n_experts, d.shape[-1]))
    np.add.at(acc, ids[valid], d[valid])
    np.add.at(acc_mag, ids[valid], np.abs(d[valid]))
    return acc, acc_mag


def activate(g, u, activation: str):
    """(act(g, u), |d/dg| bound, |d/du|) in float64, as mlx-lm's SwiGLU / SwigluOAI."""
    with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0 gives g / inf = -0, exact
        return _activate(g, u, activation)


def _activate(g, u, activation: str):
    if activation == "silu":
        a = g / (1 + np.exp(-g))
        return a * u, ACT_SLOPE * np.abs(u), np.abs(a)
    gc, uc = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    a = gc / (1 + np.exp(-ALPHA * gc))
    return (uc + 1) * a, ACT_SLOPE * np.abs(uc + 1), np.abs(a)


def activation_grads(g, u, c, activation: str):
    """float64 (c * d act / d gate, c * d act / d up) at gate g, up u. silu: act = g s(g) u;
    swiglu_oai: act = (clip(u, -L, L) + 1) m s(a m), m = min(g, L): zero slope where
    clamped (s the logistic sigmoid)."""
    with np.errstate(over="ignore"):
        if activation == "silu":
            s = 1.0 / (1.0 + np.exp(-g))
            return c * u * s * (1 + g * (1 - s)), c * g * s
        m = np.minimum(g, LIMIT)
        s = 1.0 / (1.0 + np.exp(-ALPHA * m))
        d_gate = c * (np.clip(u, -LIMIT, LIMIT) + 1) * s * (1 + ALPHA * m * (1 - s))
        return (np.where(g < LIMIT, d_gate, 0.0),
                np.where(np.abs(u) < LIMIT, c * m * s, 0.0))


def grad_oracle(x, gate, up, indices, g, activation, mode, group_size, bits, bias_gate=None,
                bias_up=None):
    """float64 [(dx, magnitude)] (+ [(dbias_gate, ..), (dbias_up, ..)] with expert biases)
    of the VJP with cotangent g [..., k, N]; ``gate`` / ``up``: (w, scales, biases).

    d gate and d up are the activation's slopes times g at the exact gate and up; their
    magnitude adds their sensitivity to gate and up (the activation's second derivatives,
    central differences of these float64 formulas) times the |terms| behind gate and up,
    which a float32 evaluation misses by about accum times that. dx = d gate W_gate +
    d up W_up per pair (summed over the token's k experts for a shared x)."""
    gv, gm, _ = project(x, *gate, bias_gate, indices, mode, group_size, bits)
    uv, um, _ = project(x, *up, bias_up, indices, mode, group_size, bits)
    c = to_f64(g)
    d = activation_grads(gv, uv, c, activation)
    mags = [np.abs(d[0]), np.abs(d[1])]
    for v, v_mag, shift in ((gv, gm, (1, 0)), (uv, um, (0, 1))):
        h = 1e-5 * np.maximum(1.0, np.abs(v))
        hi = activation_grads(gv + shift[0] * h, uv + shift[1] * h, c, activation)
        lo = activation_grads(gv - shift[0] * h, uv - shift[1] * h, c, activation)
        for i in range(2):
            mags[i] = mags[i] + np.abs(hi[i] - lo[i]) / (2 * h) * v_mag
    dx, dx_mag = 0.0, 0.0
    for di, mi, (w, s, b) in zip(d, mags, (gate, up), strict=True):
        dx = dx + back_project(di, w, s, b, indices, mode, group_size, bits)[0]
        dx_mag = dx_mag + back_project(mi, w, s, b, indices, mode, group_size, bits)[1]
    if to_f64(x).ndim != np.ndim(indices) + 1:  # one x shared by the token's k experts
        dx, dx_mag = dx.sum(axis=-2), dx_mag.sum(axis=-2)
    out = [(dx, dx_mag)]
    if bias_gate is not None:
        out += [(scatter_rows(di, indices, gate[0].shape[0])[0],
                 scatter_rows(mi, indices, gate[0].shape[0])[1])
                for di, mi in zip(d, mags, strict=True)]
    return out


def oracle(x, gate, up, indices, activation, mode, group_size, bits):
    """(expected [..., k, N], magnitude, valid). ``gate`` / ``up``: (w, scales, biases,
    bias). The magnitude carries the float32 errors of g and u through the activation (its
    slopes) plus |want| for the activation's own float32 evaluation."""
    g, mg, valid = project(x, *gate, indices, mode, group_size, bits)
    u, mu, _ = project(x, *up, indices, mode, group_size, bits)
    want, dg, du = activate(g, u, activation)
    return want, dg * mg + du * mu + np.abs(want), valid


def run_and_check(x, gate, up, indices, backend, *, activation="silu", mode="affine",
                  group_size=None, bits=None, launches=1, kernel=None):
    """mt.expert_glu against the oracle; ``gate`` / ``up`` are (w, scales, biases, bias);
    ``kernel``: the kernel name that must have run (None: any)."""
    from mlx_metaltile.ops._common import DEFAULTS

    gs, nb = DEFAULTS[mode]
    group_size, bits = group_size or gs, bits or nb
    with expect_launches(backend, launches, kernel):
        out = mt.expert_glu(x, *gate[:3], *up[:3], indices, bias_gate=gate[3], bias_up=up[3],
                            activation=activation, mode=mode, group_size=group_size,
                            bits=bits)
        mx.eval(out)
    want, mag, valid = oracle(x, gate, up, indices, activation, mode, group_size, bits)
    check_rows(out, want, mag, valid, x.dtype, f"expert_glu[{backend}]")
    return out


# ---- inputs ---------------------------------------------------------------------------

def make_experts(rng, n_experts, n_out, n_in, dtype, mode="affine", group_size=64, bits=4,
                 bias=False, scale=1.0):
    """(w, scales, biases, bias) of random experts quantized by mx.quantize."""
    wf = mx.array(rng.standard_normal((n_experts, n_out, n_in)).astype(np.float32) * scale)
    if mode == "affine":
        w, s, b = mx.quantize(wf.astype(dtype), group_size=group_size, bits=bits)
    else:
        w, s = mx.quantize(wf, mode=mode)
        b = None
    bb = None
    if bias:
        bb = mx.array(rng.standard_normal((n_experts, n_out)).astype(np.float32)).astype(dtype)
    return w, s, b, bb


def make_x(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


@contextlib.contextmanager
def sharing(backend: str, min_tokens: int | None):
    """Inside: the op's plans take the sharing form on ``backend`` from ``min_tokens`` tokens
    (None: never); outside, SHARE_MIN_TOKENS as it was (plans rebuilt both times)."""
    ops = importlib.import_module("mlx_metaltile.ops.expert_glu")
    from mlx_metaltile.ops._common import clear_plans

    table = ops.SHARE_MIN_TOKENS
    had, old = backend in table, table.get(backend)
    if min_tokens is None:
        table.pop(backend, None)
    else:
        table[backend] = min_tokens
    clear_plans()
    try:
        yield
    finally:
        if had:
            table[backend] = old
        else:
            table.pop(backend, None)
        clear_plans()


def _variant_call(backend, rng):
    """One token (duplicated ids in it): the broadcast walk, SHARE 0."""
    gate = make_experts(rng, 6, 13, 128, mx.bfloat16, bias=True)
    up = make_experts(rng, 6, 13, 128, mx.bfloat16, bias=True)
    ids = mx.array([[0, 5, 2, 2]], dtype=mx.uint32)
    run_and_check(make_x(rng, (1, 128), mx.bfloat16), gate, up, ids, backend,
                  kernel="expert_glu_simd_rows")


def _shared_variant_call(backend, rng):
    """Three tokens naming experts 0 and 5 twice each, 2 twice in one token: SHARE 1."""
    gate = make_experts(rng, 6, 13, 128, mx.bfloat16, bias=True)
    up = make_experts(rng, 6, 13, 128, mx.bfloat16, bias=True)
    ids = mx.array([[0, 5], [2, 2], [5, 0]], dtype=mx.uint32)
    with sharing(backend, 2):
        run_and_check(make_x(rng, (3, 128), mx.bfloat16), gate, up, ids, backend,
                      kernel="expert_glu_shared_rows")


VARIANT_CALLS = {"simd_rows": _variant_call, "shared_rows": _shared_variant_call}


# ---- benchmarks (one decode token) vs mlx-lm's SwitchGLU composite -------------------------

# (model, E, k, hidden D, expert width N, mode, activation, per-expert biases)
SHAPES = (
    ("qwen3-30b-a3b", 128, 8, 2048, 768, "affine", "silu", False),
    ("qwen3-next-80b-a3b", 512, 10, 2048, 512, "affine", "silu", False),
    ("gpt-oss-20b", 32, 4, 2880, 2880, "mxfp4", "swiglu_oai", True),
)


def bench_make(rng, *, E, k, n_in, n_out, mode, bias, dtype, tokens=1):
    """Packed words with every code equally likely, scales keeping values O(1)."""
    gs, bits = {"affine": (64, 4), "mxfp4": (32, 4)}[mode]
    def experts(n, kk):
        w = mx.array(rng.integers(0, 2**32, size=(E, n, kk * bits // 32), dtype=np.uint32))
        g = (E, n, kk // gs)
        if mode == "affine":
            s = mx.array(rng.standard_normal(g, dtype=np.float32) / (4 << bits)).astype(dtype)
            b = mx.array(rng.standard_normal(g, dtype=np.float32) * 0.1).astype(dtype)
        else:
            s, b = mx.array(rng.integers(118, 124, size=g).astype(np.uint8)), None
        bb = (mx.array(rng.standard_normal((E, n), dtype=np.float32)).astype(dtype)
              if bias else None)
        return w, s, b, bb
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(tokens)])
    return experts, mx.array(ids.astype(np.uint32))


def _ours(x, gate, up, indices, activation, mode):
    return mt.expert_glu(x, *gate[:3], *up[:3], indices, bias_gate=gate[3], bias_up=up[3],
                         activation=activation, mode=mode)


def switch_linear(x, w, scales, biases, bias, indices, mode):
    """mlx-lm's QuantizedSwitchLinear at decode: gather_qmm, then the bias rows."""
    gs, bits = {"affine": (64, 4), "mxfp4": (32, 4)}[mode]
    y = mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True,
                      group_size=gs, bits=bits, mode=mode)
    return y if bias is None else y + mx.expand_dims(bias[indices], -2)


def native_activation(activation):
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    return SwiGLU() if activation == "silu" else SwigluOAI()


def _native(x, gate, up, indices, activation, mode):
    # mlx-lm's SwitchGLU at decode: up, gate, activation (x as [..., 1, 1, D])
    xe = mx.expand_dims(x, (-2, -3))
    u = switch_linear(xe, *up, indices, mode)
    g = switch_linear(xe, *gate, indices, mode)
    return native_activation(activation)(u, g).squeeze(-2)


def _bench_terms(x, gate, up, indices, activation, mode):
    gs = {"affine": 64, "mxfp4": 32}[mode]
    return oracle(x, gate, up, indices, activation, mode, gs, 4)[:2]


def bench_cases() -> list[BenchCase]:
    out = []
    dtype = mx.bfloat16
    for label, E, k, D, N, mode, act, bias in SHAPES:
        def make(rng, E=E, k=k, D=D, N=N, mode=mode, act=act, bias=bias):
            experts, ids = bench_make(rng, E=E, k=k, n_in=D, n_out=N, mode=mode, bias=bias,
                                      dtype=dtype)
            x = mx.array(rng.standard_normal((1, D), dtype=np.float32)).astype(dtype)
            return dict(x=x, gate=experts(N, D), up=experts(N, D), indices=ids,
                        activation=act, mode=mode)

        gs = {"affine": 64, "mxfp4": 32}[mode]
        sb = 2 if mode == "affine" else 1
        per_expert = N * (D // 2 + (D // gs) * sb * (2 if mode == "affine" else 1))
        nbytes = (2 * k * per_expert + D * dtype.size + k * N * dtype.size
                  + (2 * k * N * dtype.size if bias else 0))
        exact, magnitude = oracle_and_magnitude(_bench_terms)
        out.append(BenchCase(op=OP, label=f"{label}-E{E}k{k}-{D}to{N}-{mode}", dtype=dtype,
                             make=make, ours=_ours, native=_native, oracle=exact,
                             magnitude=magnitude, nbytes=nbytes,
                             flops=2 * 2 * k * N * D, quick=label == "qwen3-30b-a3b"))
    return out + grad_bench_cases()


# ---- forward + backward vs MLX's autodiff of the SwitchGLU composite ----------------------

GROUP_SIZES = {"affine": 64, "mxfp4": 32}  # the benchmarks' group size per mode (4 bits)


def _grad_ours(x, gate, up, indices, activation, mode, bias_gate=None, bias_up=None):
    return _ours(x, (*gate, bias_gate), (*up, bias_up), indices, activation, mode)


def _grad_native(x, gate, up, indices, activation, mode, bias_gate=None, bias_up=None):
    return _native(x, (*gate, bias_gate), (*up, bias_up), indices, activation, mode)


def _grad_terms(x, gate, up, indices, g, activation, mode, bias_gate=None, bias_up=None):
    return grad_oracle(x, gate, up, indices, g, activation, mode, GROUP_SIZES[mode], 4,
                       bias_gate, bias_up)


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward at one decode token, w.r.t. x (and the expert biases where the
    model has them: gpt-oss), against MLX's autodiff of mlx-lm's SwitchGLU composite.
    bytes: the forward's (the k selected experts' gate and up weights, x, the bias rows
    read, out written) plus the backward's (the same weights, x and bias rows read again to
    recompute gate and up, g read, dx and the whole [E, N] bias gradients written)."""
    out = []
    dtype = mx.bfloat16
    ds = dtype.size
    for label, E, k, D, N, mode, act, bias in SHAPES:
        if label not in ("qwen3-30b-a3b", "gpt-oss-20b"):
            continue

        def make(rng, E=E, k=k, D=D, N=N, mode=mode, act=act, bias=bias):
            experts, ids = bench_make(rng, E=E, k=k, n_in=D, n_out=N, mode=mode, bias=bias,
                                      dtype=dtype)
            gate, up = experts(N, D), experts(N, D)
            inputs = dict(x=make_x(rng, (1, D), dtype), gate=gate[:3], up=up[:3], indices=ids,
                          activation=act, mode=mode, g=make_x(rng, (1, k, N), dtype))
            if bias:
                inputs.update(bias_gate=gate[3], bias_up=up[3])
            return inputs

        sb = 2 if mode == "affine" else 1
        per_expert = N * (D // 2 + (D // GROUP_SIZES[mode]) * sb * (2 if mode == "affine" else 1))
        nbytes = (4 * k * per_expert + 3 * D * ds + 2 * k * N * ds
                  + ((4 * k * N + 2 * E * N) * ds if bias else 0))
        out.append(grad_case(
            op=OP, label=f"{label}-E{E}k{k}-{D}to{N}-{mode}", dtype=dtype, make=make,
            ours=_grad_ours, native=_grad_native,
            wrt=("x", "bias_gate", "bias_up") if bias else ("x",), grad_oracle=_grad_terms,
            nbytes=nbytes, flops=4 * 2 * k * N * D, quick=label == "qwen3-30b-a3b"))
    return out

