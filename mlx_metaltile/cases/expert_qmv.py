"""expert_qmv: float64 oracle from the math, benchmark cases, checked calls."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from . import _mxfp4
from ._base import (
    BenchCase,
    check_rows,
    expect_launches,
    grad_case,
    oracle_and_magnitude,
    to_f64,
    verify,
)

OP = "expert_qmv"
ROW_BLOCK = 1024  # output rows dequantized at a time (the experts of big models are large)


# ---- oracle (from the math: dequantize, then matmul, in float64) --------------------------

def dequantize_f64(w, scales, biases, group_size, bits):
    """W[..., n, k] = scale[..., n, k // gs] * q[..., n, k] + bias[..., n, k // gs], float64."""
    words = np.asarray(w).astype(np.uint64)
    pack = 32 // bits
    shifts = (np.arange(pack, dtype=np.uint64) * bits)
    q = (words[..., None] >> shifts) & np.uint64((1 << bits) - 1)  # [..., K/pack, pack]
    q = q.reshape(*words.shape[:-1], -1).astype(np.float64)
    s = np.repeat(np.asarray(scales), group_size, axis=-1)
    b = np.repeat(np.asarray(biases), group_size, axis=-1)
    return s * q + b


def oracle(x, w, scales, biases, indices, group_size, bits):
    """(expected [..., k, N] with NaN rows for ids outside [0, E), magnitude sum |x * W|,
    valid ids). Only the experts used are dequantized, ROW_BLOCK rows at a time."""
    n_experts, n_out = w.shape[:2]
    ids = np.array(indices).astype(np.int64)
    xs = to_f64(x)
    k = ids.shape[-1]
    n_in = xs.shape[-1]
    if xs.ndim != ids.ndim + 1:  # shared: one activation per token (any other rank)
        xs = xs[..., None, :]
    lead = np.broadcast_shapes(xs.shape[:-2], ids.shape[:-1])
    xs = np.broadcast_to(xs, (*lead, xs.shape[-2], n_in))
    xs = np.broadcast_to(xs, (*lead, k, n_in))
    ids = np.broadcast_to(ids, (*lead, k))
    valid = (ids >= 0) & (ids < n_experts)
    want = np.full((*lead, k, n_out), np.nan)
    mag = np.zeros_like(want)
    wn, s, b = np.asarray(w), to_f64(scales), to_f64(biases)
    for e in np.unique(ids[valid]):
        sel = ids == e
        xe = xs[sel]  # [pairs, K]
        for r in range(0, n_out, ROW_BLOCK):
            rows = slice(r, r + ROW_BLOCK)
            wd = dequantize_f64(wn[e, rows], s[e, rows], b[e, rows], group_size, bits)
            want[sel, rows] = xe @ wd.T
            mag[sel, rows] = np.abs(xe) @ np.abs(wd).T
    return want, mag, valid


def grad_oracle(x, w, scales, biases, indices, g, group_size, bits, mode="affine"):
    """float64 [(dx, magnitude sum |terms|)] of the VJP with cotangent g [..., k, N]:
    dx = g_j @ W[e_j] per pair, summed over the token's k experts for a shared x; NaN
    for a pair with an id outside [0, E)."""
    from .expert_glu import back_project  # (expert_glu builds on this module)

    dx, mag = back_project(to_f64(g), w, scales, biases, indices, mode, group_size, bits)
    if to_f64(x).ndim != np.ndim(indices) + 1:  # one x shared by the token's k experts
        dx, mag = dx.sum(axis=-2), mag.sum(axis=-2)
    return [(dx, mag)]


def make_weights(rng, n_experts, n_out, n_in, dtype, group_size, bits, scale=1.0):
    wf = rng.standard_normal((n_experts, n_out, n_in)).astype(np.float32) * scale
    w, s, b = mx.quantize(mx.array(wf).astype(dtype), group_size=group_size, bits=bits)
    return w, s, b


def make_packed(rng, n_experts, n_out, n_in, dtype, group_size, bits):
    """Random packed words (every q value equally likely) and signed scales and biases."""
    w = rng.integers(0, 2**32, size=(n_experts, n_out, n_in * bits // 32), dtype=np.uint32)
    g = (n_experts, n_out, n_in // group_size)
    s = rng.standard_normal(g).astype(np.float32) / (1 << bits)
    b = rng.standard_normal(g).astype(np.float32) * 0.5
    return mx.array(w), mx.array(s).astype(dtype), mx.array(b).astype(dtype)


def make_x(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def run_and_check(x, w, s, b, ids, group_size, bits, backend, *, launches=1):
    with expect_launches(backend, launches):
        out = mt.expert_qmv(x, w, s, b, ids, group_size=group_size, bits=bits)
        mx.eval(out)
    want, mag, valid = oracle(x, w, s, b, ids, group_size, bits)
    check_rows(out, want, mag, valid, x.dtype, f"expert_qmv[{backend}]")
    return out


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend, so a variant added to the registry
# fails there until it has one here).
def _variant_call(backend, rng):
    w, s, b = make_packed(rng, 6, 13, 128, mx.bfloat16, 64, 4)
    ids = mx.array([[0, 5], [2, 2]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, 128), mx.bfloat16), w, s, b, ids, 64, 4, backend)


def run_and_check_dx(x, w, s, b, ids, g, group_size, bits, backend, mode="affine"):
    """The x-VJP with cotangent g against grad_oracle; on a kernel backend the dx kernel
    runs once (never the composite)."""
    from mlx_metaltile import backends
    from mlx_metaltile.ops.expert_qmv import DX_SPEC

    before = backends.launch_count(DX_SPEC.name, backend)
    _, (dx,) = mx.vjp(lambda x: mt.expert_qmv(x, w, s, b, ids, group_size=group_size,
                                              bits=bits, mode=mode), [x], [g])
    mx.eval(dx)
    if backend != "reference":
        verify(backends.launch_count(DX_SPEC.name, backend) == before + 1, DX_SPEC.name)
    ((want, mag),) = grad_oracle(x, w, s, b, ids, g, group_size, bits, mode)
    valid = ~np.isnan(want).any(axis=-1)
    check_rows(dx, want, mag, valid, x.dtype, f"expert_qmv dx[{backend}]")
    return dx


def _dx_call(backend, rng):
    w, s, b = make_packed(rng, 6, 13, 128, mx.bfloat16, 64, 4)
    ids = mx.array([[0, 5], [2, 2]], dtype=mx.uint32)
    g = make_x(rng, (2, 2, 13), mx.bfloat16)
    run_and_check_dx(make_x(rng, (2, 128), mx.bfloat16), w, s, b, ids, g, 64, 4, backend)


VARIANT_CALLS = {"simd_rows": _variant_call, "dx": _dx_call}


# ---- benchmarks (one decode token) ------------------------------------------------------

def _ours(x, w, scales, biases, indices, host_ids, group_size, bits):
    return mt.expert_qmv(x, w, scales, biases, indices, group_size=group_size, bits=bits)


def _native(x, w, scales, biases, indices, host_ids, group_size, bits):
    # What mlx-lm's SwitchLinear does: gather_qmm over device-resident ids.
    xq = x[..., None, None, :] if x.ndim == indices.ndim else x[..., None, :]
    y = mx.gather_qmm(xq, w, scales, biases, rhs_indices=indices, transpose=True,
                      group_size=group_size, bits=bits)
    return mx.squeeze(y, axis=-2)


def host_loop(x, w, scales, biases, indices, host_ids, group_size, bits):
    """One mx.quantized_matmul per (token, expert), with the ids already on the host."""
    shared = x.ndim == indices.ndim
    rows = []
    for t, token_ids in enumerate(host_ids):
        for j, e in enumerate(token_ids):
            xt = x[t] if shared else x[t, j]
            rows.append(mx.quantized_matmul(xt, w[e], scales[e], biases[e], transpose=True,
                                            group_size=group_size, bits=bits))
    return mx.stack(rows).reshape(*indices.shape, -1)


def _bench_terms(x, w, scales, biases, indices, host_ids, group_size, bits):
    return oracle(x, w, scales, biases, indices, group_size, bits)[:2]


# Decode shapes (one token): (model, E, k, K, N, x shared by the k experts?)
SHAPES = (
    ("qwen3moe-up", 128, 8, 2048, 768, True),  # Qwen3-30B-A3B gate/up projection
    ("qwen3moe-down", 128, 8, 768, 2048, False),
    ("qwen3next-up", 512, 10, 2048, 512, True),  # Qwen3-Next-80B-A3B
    ("qwen3next-down", 512, 10, 512, 2048, False),
    ("mixtral-up", 8, 2, 4096, 14336, True),  # Mixtral-8x7B
    ("mixtral-down", 8, 2, 14336, 4096, False),
)


def _bench_make(rng, *, e, k, n_in, n_out, shared, bits, dtype, group_size):
    groups = (e, n_out, n_in // group_size)
    ids = np.stack([rng.choice(e, size=k, replace=False)])  # one token
    x_shape = (1, n_in) if shared else (1, k, n_in)
    return dict(
        x=mx.array(rng.standard_normal(x_shape, dtype=np.float32)).astype(dtype),
        w=mx.array(rng.integers(0, 2**32, size=(e, n_out, n_in * bits // 32),
                                dtype=np.uint32)),
        scales=mx.array(rng.standard_normal(groups, dtype=np.float32)
                        / (1 << bits)).astype(dtype),
        biases=mx.array(rng.standard_normal(groups, dtype=np.float32)
                        * 0.5).astype(dtype),
        indices=mx.array(ids.astype(np.uint32)),
        host_ids=ids.tolist(), group_size=group_size, bits=bits)


def bench_cases() -> list[BenchCase]:
    out = []
    group_size = 64
    for label, n_experts, k, n_in, n_out, shared in SHAPES:
        for bits in (4, 8):
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                # 8-bit and float32 on one shape only
                if (bits == 8 and dtype != mx.bfloat16) or (dtype == mx.float32 and bits != 4):
                    continue
                if (bits == 8 or dtype == mx.float32) and label != "qwen3moe-up":
                    continue

                make = partial(_bench_make, e=n_experts, k=k, n_in=n_in, n_out=n_out,
                               shared=shared, bits=bits, dtype=dtype, group_size=group_size)
                pairs, ds = k, dtype.size
                nbytes = (pairs * n_out * (n_in * bits // 8 + 2 * (n_in // group_size) * ds)
                          + (1 if shared else k) * n_in * ds + pairs * n_out * ds)
                exact, magnitude = oracle_and_magnitude(_bench_terms)
                out.append(BenchCase(
                    op=OP, label=f"{label}-E{n_experts}k{k}-{bits}b", dtype=dtype,
                    make=make, ours=_ours, native=_native,
                    oracle=exact, magnitude=magnitude, nbytes=nbytes,
                    flops=2 * pairs * n_out * n_in,
                    quick=label == "qwen3moe-up" and bits == 4 and dtype == mx.bfloat16))
    return out + _mxfp4_cases() + grad_bench_cases()


def _mxfp4_native(x, w, scales, indices):
    y = mx.gather_qmm(x[..., None, None, :], w, scales, None, rhs_indices=indices,
                      transpose=True, mode="mxfp4")  # what mlx-lm's QuantizedSwitchLinear runs
    return mx.squeeze(y, axis=-2)


def _mxfp4_cases(dtype=mx.bfloat16) -> list[BenchCase]:
    """gpt-oss-20b's mxfp4 experts at decode: 1 and 4 tokens, each routed to top_k experts."""
    E, top_k, n, k = (_mxfp4.GPT_OSS_20B[key] for key in ("E", "top_k", "n", "k"))
    out = []
    for tokens in (1, 4):
        ids = _mxfp4.routing(tokens, E, top_k, seed=tokens)
        touched = len(np.unique(ids))
        nbytes = (tokens * k * dtype.size + touched * n * (k // 2 + k // 32)
                  + ids.size * 4 + ids.size * n * dtype.size)
        exact, magnitude = oracle_and_magnitude(partial(_mxfp4.product_terms, rounded=False))
        out.append(BenchCase(
            op=OP, label=f"gpt-oss-20b-mxfp4-T{tokens}-k{top_k}-N{n}-K{k}-E{E}",
            dtype=dtype, make=partial(_mxfp4.make, rows_x=(tokens,), ids=ids, dtype=dtype, E=E,
                                      n=n, k=k),
            ours=partial(mt.expert_qmv, biases=None, mode="mxfp4", group_size=32, bits=4),
            native=_mxfp4_native, oracle=exact, magnitude=magnitude,
            nbytes=nbytes, flops=2 * ids.size * n * k, quick=tokens == 1))
    return out


# ---- forward + backward vs MLX's autodiff of gather_qmm -----------------------------------

def _grad_terms(x, w, scales, indices, g, biases=None, host_ids=None, group_size=32, bits=4):
    mode = "affine" if biases is not None else "mxfp4"  # the mxfp4 cases: no biases
    return grad_oracle(x, w, scales, biases, indices, g, group_size, bits, mode)


def _with_cotangent(make, n_out):
    """``make`` whose inputs gain g: a cotangent of the output [..., k, N], x's dtype."""
    def make_g(rng):
        inputs = make(rng)
        g = rng.standard_normal((*inputs["indices"].shape, n_out), dtype=np.float32)
        return dict(inputs, g=mx.array(g).astype(inputs["x"].dtype))
    return make_g


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward w.r.t. x against MLX's autodiff of gather_qmm: one decode token
    of Qwen3-30B-A3B's up projection (x shared by the k experts) and down projection (one
    x per expert), and 4 tokens of gpt-oss-20b's mxfp4 experts. bytes: the forward's (the
    selected experts' weights, scales and biases, x, the ids read, out written) plus the
    backward's (the same weights and ids again, g read, dx written: dx = g W needs no x)."""
    out = []
    group_size, bits = 64, 4
    for label, e, k, n_in, n_out, shared in SHAPES:
        if label not in ("qwen3moe-up", "qwen3moe-down"):
            continue
        for dtype in (mx.bfloat16, mx.float32) if shared else (mx.bfloat16,):
            make = partial(_bench_make, e=e, k=k, n_in=n_in, n_out=n_out, shared=shared,
                           bits=bits, dtype=dtype, group_size=group_size)
            ds = dtype.size
            weights = k * n_out * (n_in * bits // 8 + 2 * (n_in // group_size) * ds)
            x_size = (1 if shared else k) * n_in * ds
            out.append(grad_case(
                op=OP, label=f"{label}-E{e}k{k}-{bits}b", dtype=dtype,
                make=_with_cotangent(make, n_out), ours=_ours, native=_native,
                wrt=("x",), grad_oracle=_grad_terms,
                nbytes=2 * weights + 2 * x_size + 2 * k * n_out * ds + 2 * k * 4,
                flops=2 * 2 * k * n_out * n_in, quick=shared and dtype == mx.bfloat16))
    dtype, ds = mx.bfloat16, mx.bfloat16.size
    E, top_k, n, k_in = (_mxfp4.GPT_OSS_20B[key] for key in ("E", "top_k", "n", "k"))
    tokens = 4
    ids = _mxfp4.routing(tokens, E, top_k, seed=tokens)
    touched = len(np.unique(ids))
    out.append(grad_case(
        op=OP, label=f"gpt-oss-20b-mxfp4-T{tokens}-k{top_k}-N{n}-K{k_in}-E{E}", dtype=dtype,
        make=_with_cotangent(partial(_mxfp4.make, rows_x=(tokens,), ids=ids, dtype=dtype,
                                     E=E, n=n, k=k_in), n),
        ours=partial(mt.expert_qmv, biases=None, mode="mxfp4", group_size=32, bits=4),
        native=_mxfp4_native, wrt=("x",), grad_oracle=_grad_terms,
        nbytes=(2 * touched * n * (k_in // 2 + k_in // 32) + 2 * tokens * k_in * ds
                + 2 * ids.size * n * ds + 2 * ids.size * 4),
        flops=2 * 2 * ids.size * n * k_in))
    return out
