"""expert_down_combine: float64 oracle from the math, benchmark cases, checked calls."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from ._base import BenchCase, check_rows, expect_launches, grad_case, oracle_and_magnitude, to_f64
from .expert_glu import (
    SHAPES,
    back_project,
    bench_make,
    make_experts,
    make_x,
    project,
    scatter_rows,
    switch_linear,
)

OP = "expert_down_combine"


def oracle(h, down, indices, scores, mode, group_size, bits):
    """(expected [..., D], magnitude sum_j |score_j| * sum |terms|, valid token rows):
    out = sum_j score_j * (h_j @ W[e_j]^T + bias[e_j]); a token with any id outside
    [0, E) is NaN. ``down``: (w, scales, biases, bias)."""
    y, mag, valid = project(h, *down, indices, mode, group_size, bits)  # [..., k, D]
    s = to_f64(scores)[..., None]
    ok = valid.all(axis=-1)
    want = np.where(ok[..., None], np.nansum(s * y, axis=-2), np.nan)
    return want, np.nansum(np.abs(s) * mag, axis=-2), ok


def grad_oracle(h, down, indices, scores, g, mode, group_size, bits):
    """float64 [(dh, magnitude), (dscores, ..)] (+ [(dbias, ..)] with an expert bias) of the
    VJP with cotangent g [..., D]; ``down``: (w, scales, biases, bias). dh_j = s_j g W[e_j],
    dscores_j = g . y_j (y_j = h_j W[e_j]^T + bias[e_j]), dbias[e] = the sum of s_j g over
    the pairs naming e."""
    c = to_f64(g)[..., None, :]  # [..., 1, D]
    sc = to_f64(scores)[..., None] * c  # [..., k, D]
    dh, dh_mag = back_project(sc, *down[:3], indices, mode, group_size, bits)
    y, y_mag, _ = project(h, *down, indices, mode, group_size, bits)
    out = [(dh, dh_mag), ((c * y).sum(axis=-1), (np.abs(c) * y_mag).sum(axis=-1))]
    if down[3] is not None:
        out.append(scatter_rows(sc, indices, down[0].shape[0]))
    return out


def run_and_check(h, down, indices, scores, backend, *, mode="affine", group_size=None,
                  bits=None, launches=1):
    from mlx_metaltile.ops._common import DEFAULTS

    gs, nb = DEFAULTS[mode]
    group_size, bits = group_size or gs, bits or nb
    with expect_launches(backend, launches):
        out = mt.expert_down_combine(h, *down[:3], indices, scores, bias=down[3], mode=mode,
                                     group_size=group_size, bits=bits)
        mx.eval(out)
    # ok: the token rows whose ids are all in range (one bad id makes the token's row NaN)
    want, mag, ok = oracle(h, down, indices, scores, mode, group_size, bits)
    check_rows(out, want, mag, ok, h.dtype, f"expert_down_combine[{backend}]")
    return out


def make_scores(rng, shape, dtype=mx.float32):
    """Router weights: softmax over k of random logits (positive, summing to 1)."""
    z = rng.standard_normal(shape)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    return mx.array(p.astype(np.float32)).astype(dtype)


def _variant_call(backend, rng):
    down = make_experts(rng, 6, 13, 128, mx.bfloat16, bias=True)
    ids = mx.array([[0, 5], [2, 2]], dtype=mx.uint32)
    run_and_check(make_x(rng, (2, 2, 128), mx.bfloat16), down, ids,
                  make_scores(rng, (2, 2), mx.bfloat16), backend)


VARIANT_CALLS = {"simd_rows": _variant_call}


# ---- benchmarks (one decode token) vs mlx-lm's down projection + score sum ----------------

def _ours(h, down, indices, scores, mode):
    return mt.expert_down_combine(h, *down[:3], indices, scores, bias=down[3], mode=mode)


def _native(h, down, indices, scores, mode):
    # mlx-lm: SwitchGLU's down_proj on [..., k, 1, N], squeeze, then the MoE block's
    # (y * scores[..., None]).sum(axis=-2)
    y = switch_linear(mx.expand_dims(h, -2), *down, indices, mode).squeeze(-2)
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def _gs(mode):
    return {"affine": 64, "mxfp4": 32}[mode]


def _bench_terms(h, down, indices, scores, mode):
    return oracle(h, down, indices, scores, mode, _gs(mode), 4)[:2]


def bench_cases() -> list[BenchCase]:
    """One decode token (per token), and 4 tokens (verify; the token-block form, each
    distinct expert read once: its bytes count the expected distinct experts of 4 tokens'
    random routing, E (1 - (1 - k / E)^4), against 4 k pairs)."""
    out = []
    dtype = mx.bfloat16
    for (label, E, k, D, N, mode, _act, bias), tokens in itertools.product(SHAPES, (1, 4)):
        def make(rng, E=E, k=k, D=D, N=N, mode=mode, bias=bias, tokens=tokens):
            experts, ids = bench_make(rng, E=E, k=k, n_in=N, n_out=D, mode=mode, bias=bias,
                                      dtype=dtype, tokens=tokens)
            h = mx.array(rng.standard_normal((tokens, k, N), dtype=np.float32)).astype(dtype)
            return dict(h=h, down=experts(D, N), indices=ids,
                        scores=make_scores(rng, (tokens, k), dtype), mode=mode)

        sb = 2 if mode == "affine" else 1
        per_expert = D * (N // 2 + (N // _gs(mode)) * sb * (2 if mode == "affine" else 1))
        experts = k if tokens == 1 else E * (1 - (1 - k / E) ** tokens)
        nbytes = int(experts * per_expert + tokens * (k * N + D) * dtype.size
                     + (experts * D * dtype.size if bias else 0))
        suffix = "" if tokens == 1 else f"-{tokens}tok"
        exact, magnitude = oracle_and_magnitude(_bench_terms)
        out.append(BenchCase(op=OP, label=f"{label}-E{E}k{k}-{N}to{D}-{mode}{suffix}",
                             dtype=dtype, make=make, ours=_ours, native=_native,
                             oracle=exact, magnitude=magnitude, nbytes=nbytes,
                             flops=2 * tokens * k * N * D,
                             quick=label == "qwen3-30b-a3b" and tokens == 1))
    return out + grad_bench_cases()


# ---- forward + backward vs MLX's autodiff of mlx-lm's down projection + score sum ---------

def _grad_ours(h, down, indices, scores, mode, bias=None):
    return _ours(h, (*down, bias), indices, scores, mode)


def _grad_native(h, down, indices, scores, mode, bias=None):
    return _native(h, (*down, bias), indices, scores, mode)


def _grad_terms(h, down, indices, scores, g, mode, bias=None):
    return grad_oracle(h, (*down, bias), indices, scores, g, mode, _gs(mode), 4)


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward at one decode token, w.r.t. h and the scores (and the expert bias
    where the model has one: gpt-oss), against MLX's autodiff of mlx-lm's composite.
    bytes: the forward's (the k selected experts' weights, h, the scores, the bias rows
    read, out written) plus the backward's (the same weights, h, scores and bias rows read
    again to recompute y, g read, dh, dscores and the whole [E, D] bias gradient written)."""
    out = []
    dtype = mx.bfloat16
    ds = dtype.size
    for label, E, k, D, N, mode, _act, bias in SHAPES:
        if label not in ("qwen3-30b-a3b", "gpt-oss-20b"):
            continue

        def make(rng, E=E, k=k, D=D, N=N, mode=mode, bias=bias):
            experts, ids = bench_make(rng, E=E, k=k, n_in=N, n_out=D, mode=mode, bias=bias,
                                      dtype=dtype)
            down = experts(D, N)
            inputs = dict(h=make_x(rng, (1, k, N), dtype), down=down[:3], indices=ids,
                          scores=make_scores(rng, (1, k), dtype), mode=mode,
                          g=make_x(rng, (1, D), dtype))
            if bias:
                inputs["bias"] = down[3]
            return inputs

        sb = 2 if mode == "affine" else 1
        per_expert = D * (N // 2 + (N // _gs(mode)) * sb * (2 if mode == "affine" else 1))
        nbytes = (2 * k * per_expert + 3 * k * N * ds + 3 * k * ds + 2 * D * ds
                  + ((2 * k * D + E * D) * ds if bias else 0))
        out.append(grad_case(
            op=OP, label=f"{label}-E{E}k{k}-{N}to{D}-{mode}", dtype=dtype, make=make,
            ours=_grad_ours, native=_grad_native,
            wrt=("h", "scores", "bias") if bias else ("h", "scores"),
            grad_oracle=_grad_terms, nbytes=nbytes, flops=3 * 2 * k * N * D,
            quick=label == "qwen3-30b-a3b"))
    return out


# ---- one MoE block at decode: expert_glu + expert_down_combine vs mlx-lm ------------------

def block_oracle(x, gate, up, down, indices, scores, activation, mode):
    """(expected [..., D], magnitude) of sum_j s_j * down_j(act(gate_j(x), up_j(x))) in
    float64. The magnitude adds, through |W_down|, the error of the [..., k, N] hidden rows
    as expert_glu returns them (its float32 error, then one rounding to x's dtype)."""
    from .._registry import TOLERANCES
    from .expert_glu import oracle as glu_oracle

    gs, bits = _gs(mode), 4
    h, mag_h, _ = glu_oracle(x, gate, up, indices, activation, mode, gs, bits)
    want, mag, _ = oracle(h, down, indices, scores, mode, gs, bits)
    tol = TOLERANCES[str(x.dtype).rsplit(".", 1)[-1]]
    h_err = tol.rtol * np.abs(h) + tol.accum * mag_h
    spread = oracle(h_err, (*down[:3], None), indices, np.abs(to_f64(scores)), mode, gs,
                    bits)[1]
    return want, mag + spread / tol.accum


def _block_ours(x, gate, up, down, indices, scores, activation, mode):
    h = mt.expert_glu(x, *gate[:3], *up[:3], indices, bias_gate=gate[3], bias_up=up[3],
                      activation=activation, mode=mode)
    return mt.expert_down_combine(h, *down[:3], indices, scores, bias=down[3], mode=mode)


def _block_native(x, gate, up, down, indices, scores, activation, mode):
    from .expert_glu import native_activation

    # mlx-lm's SwitchGLU at decode (x as [..., 1, 1, D]), then the block's score sum
    xe = mx.expand_dims(x, (-2, -3))
    h = native_activation(activation)(switch_linear(xe, *up, indices, mode),
                                      switch_linear(xe, *gate, indices, mode))
    y = switch_linear(h, *down, indices, mode).squeeze(-2)
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def block_cases() -> list[BenchCase]:
    """One MoE block at decode (one token), the shapes of SHAPES. Not in bench_cases (the op
    is two): bench/test_expert_down_combine.py times them."""
    out = []
    dtype = mx.bfloat16
    for label, E, k, D, N, mode, act, bias in SHAPES:
        def make(rng, E=E, k=k, D=D, N=N, mode=mode, act=act, bias=bias):
            experts, ids = bench_make(rng, E=E, k=k, n_in=D, n_out=N, mode=mode, bias=bias,
                                      dtype=dtype)
            down = bench_make(rng, E=E, k=k, n_in=N, n_out=D, mode=mode, bias=bias,
                              dtype=dtype)[0](D, N)
            x = mx.array(rng.standard_normal((1, D), dtype=np.float32)).astype(dtype)
            return dict(x=x, gate=experts(N, D), up=experts(N, D), down=down, indices=ids,
                        scores=make_scores(rng, (1, k), dtype), activation=act, mode=mode)

        sb = (2 * 2 if mode == "affine" else 1)  # scale (+ bias) bytes per group
        weights = 3 * k * N * D * (1 / 2 + sb / _gs(mode))
        nbytes = int(weights + 2 * D * dtype.size + (3 * k * N * dtype.size if bias else 0))
        exact, magnitude = oracle_and_magnitude(lambda **i: block_oracle(**i)[:2])
        out.append(BenchCase(op="moe_block", label=f"{label}-E{E}k{k}-{D}x{N}-{mode}",
                             dtype=dtype, make=make, ours=_block_ours, native=_block_native,
                             oracle=exact, magnitude=magnitude, nbytes=nbytes,
                             flops=3 * 2 * k * N * D, quick=label == "qwen3-30b-a3b"))
    return out
