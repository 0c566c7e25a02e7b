"""moe_route: float64 oracle from the math, mlx-lm's routing, benchmark cases, checked calls."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from ._base import (
    BenchCase,
    assert_close,
    expect_launches,
    grad_case,
    oracle_and_magnitude,
    to_f64,
    verify,
)

OP = "moe_route"


def _rows(logits) -> np.ndarray:
    l64 = to_f64(logits)
    return l64.reshape(-1, l64.shape[-1])


def oracle(logits, k: int, normalize: bool = True):
    """(ids [..., k], scores [..., k], magnitude [..., k]) in float64, from the math: the k
    largest logits, slot 0 the largest, NaN above every number, equal logits by ascending
    index; m = the largest selected logit; scores = exp(l - m) over the sum of exp(l - m)
    over the k selected (normalize) or over all E; NaN where m is not finite.

    magnitude: |score| times 1 + |l_r - m| + the score-weighted mean of |l_j - m| over the
    normalising set: float32 forms l - m rounded (a relative error in exp(l - m) that grows
    with |l - m|), for the selected logit and for each term of the denominator."""
    lead = tuple(logits.shape[:-1])
    flat = _rows(logits)
    n = flat.shape[-1]
    nan = np.isnan(flat)
    index = np.broadcast_to(np.arange(n), flat.shape)
    # lexsort: the last key is the primary one; NaN first, then descending logit (-0 == +0),
    # then ascending index
    order = np.lexsort((index, np.where(nan, 0.0, -flat), ~nan), axis=-1)
    ids = order[:, :k]
    sel = np.take_along_axis(flat, ids, axis=-1)
    m = sel[:, :1]
    finite = np.isfinite(m)
    m = np.where(finite, m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e_sel, e_all = np.exp(sel - m), np.exp(flat - m)
        terms = e_sel if normalize else e_all
        over = terms if normalize else flat
        denom = terms.sum(axis=-1, keepdims=True)
        scores = np.where(finite, e_sel / denom, np.nan)
        spread = np.where(terms > 0, terms * np.abs(over - m), 0.0).sum(-1, keepdims=True)
        growth = 1.0 + np.where(e_sel > 0, np.abs(sel - m), 0.0) + spread / denom
    mag = np.where(finite, np.abs(scores) * growth, np.nan)
    return (ids.reshape(*lead, k), scores.reshape(*lead, k), mag.reshape(*lead, k))


def check(ids, scores, logits, k: int, normalize: bool, what: str) -> None:
    """The op's outputs against the oracle: ids exactly (uint32, the oracle's order),
    scores NaN exactly where the oracle's are, elsewhere within the tolerance table."""
    want_ids, want, mag = oracle(logits, k, normalize)
    shape = (*logits.shape[:-1], k)
    verify(ids.dtype == mx.uint32 and tuple(ids.shape) == shape, (what, ids.dtype, ids.shape))
    verify(scores.dtype == logits.dtype and tuple(scores.shape) == shape, (
        what, scores.dtype, scores.shape))
    got_ids = np.array(ids)
    bad = got_ids != want_ids
    if bad.any():  # the message reads the first difference: built only when there is one
        raise AssertionError(f"{what}: ids differ at {np.argwhere(bad)[0].tolist()}: got "
                             f"{got_ids[bad][:4]}, want {want_ids[bad][:4]}")
    got = to_f64(scores)
    nan = np.isnan(want)
    verify(np.isnan(got[nan]).all(), f"{what}: a row with no finite max must give NaN scores")
    assert_close(got[~nan], want[~nan], logits.dtype, magnitude=mag[~nan], what=what)


def run_and_check(logits, k: int, normalize: bool, backend: str):
    """Run the op on ``backend``, prove one kernel ran, compare with the oracle."""
    with expect_launches(backend, 1):
        ids, scores = mt.moe_route(logits, k, normalize=normalize)
        mx.eval(ids, scores)
    check(ids, scores, logits, k, normalize, f"moe_route[{backend}] k={k} norm={normalize}")
    return ids, scores


def distinct_logits(rng, lead: tuple[int, ...], n: int, dtype: mx.Dtype) -> mx.array:
    """Logits with no two equal in a row after rounding to ``dtype`` (n <= 2048): each row n
    distinct values of ``dtype`` in [-8, 8], drawn without replacement."""
    pool = np.unique(np.array(mx.array(np.linspace(-8.0, 8.0, 60001, dtype=np.float32))
                              .astype(dtype).astype(mx.float32)))
    rows = int(np.prod(lead))
    pick = np.argsort(rng.random((rows, pool.size)), axis=-1)[:, :n]
    return mx.array(pool[pick].reshape(*lead, n)).astype(dtype)


def make_logits(rng, lead: tuple[int, ...], n: int, dtype: mx.Dtype, scale: float = 3.0):
    """Router-like logits: standard normal times ``scale``, rounded to ``dtype`` (ties
    possible in float16 / bfloat16)."""
    x = rng.standard_normal((*lead, n)).astype(np.float32) * scale
    return mx.array(x).astype(dtype)


# ---- mlx-lm's routing (the native composite the op replaces) -------------------------------

def mlx_lm_route(logits, k: int, normalize: bool = True):
    """(ids, scores) as mlx-lm's MoE blocks form them (mlx_lm/models/qwen3_moe.py): a
    precise softmax over all E, argpartition's top k (in no particular order, no gradient),
    take_along_axis, and with
    ``normalize`` (Qwen3-MoE's norm_topk_prob) the division by their sum."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    ids = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, ids, axis=-1)
    if normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return ids, scores


def dense(ids, scores, n: int):
    """The scores scattered to [..., E] (0 at the experts not selected): a form that does
    not depend on the order of the k slots."""
    zeros = mx.zeros((*scores.shape[:-1], n), dtype=scores.dtype)
    ids = mx.stop_gradient(ids.astype(mx.uint32))  # as mlx-lm stops argpartition's
    return mx.put_along_axis(zeros, ids, scores, axis=-1)


def dense_oracle(logits, k: int, normalize: bool):
    """``dense`` of the oracle's ids and scores, and of its magnitudes."""
    ids, scores, mag = oracle(logits, k, normalize)
    n = logits.shape[-1]
    out, out_mag = np.zeros((*scores.shape[:-1], n)), np.zeros((*scores.shape[:-1], n))
    np.put_along_axis(out, ids, scores, axis=-1)
    np.put_along_axis(out_mag, ids, mag, axis=-1)
    return out, out_mag


# One checked call per registered kernel variant (tests/test_registry.py runs them).
def _variant_call(backend, rng):
    run_and_check(make_logits(rng, (3,), 130, mx.bfloat16), 8, True, backend)
    run_and_check(make_logits(rng, (2, 2), 600, mx.float32), 10, False, backend)


VARIANT_CALLS = {"simd_rows": _variant_call}


# ---- gradients -------------------------------------------------------------------------

def grad_oracle(logits, g, k: int, normalize: bool):
    """float64 (dlogits, magnitude) for the scores' cotangent g [..., k], from the math:
    normalize: s = softmax(l[ids]), dl[ids] = s (g - sum(g s)), 0 elsewhere; else p =
    softmax(l) over all E, dl = p (G - sum(g s)), G = g scattered to ids."""
    ids, s, _ = oracle(logits, k, normalize)
    lf = to_f64(logits)
    gf = to_f64(g)
    dot = (gf * s).sum(-1, keepdims=True)
    dot_mag = np.abs(gf * s).sum(-1, keepdims=True)
    if normalize:
        d = np.zeros(lf.shape)
        mag = np.zeros(lf.shape)
        np.put_along_axis(d, ids, s * (gf - dot), axis=-1)
        np.put_along_axis(mag, ids, s * (np.abs(gf) + dot_mag), axis=-1)
        return d, mag
    m = np.max(lf, axis=-1, keepdims=True)
    p = np.exp(lf - m)
    p /= p.sum(-1, keepdims=True)
    big_g = np.zeros(lf.shape)
    np.put_along_axis(big_g, ids, gf, axis=-1)
    return p * (big_g - dot), p * (np.abs(big_g) + dot_mag)


# ---- benchmarks (mlx-lm's routing ops after the router matmul) -----------------------------

SHAPES = (  # label, E, k, normalize (decode: one token; prefill: 512)
    ("qwen3-30b", 128, 8, True),
    ("qwen3-next", 512, 10, True),
    ("gpt-oss", 32, 4, True),
    ("olmoe", 64, 8, False),
)


def ours_dense(logits, k: int, normalize: bool):
    return dense(*mt.moe_route(logits, k, normalize=normalize), logits.shape[-1])


def native_dense(logits, k: int, normalize: bool):
    return dense(*mlx_lm_route(logits, k, normalize), logits.shape[-1])


def bench_cases() -> list[BenchCase]:
    """The router's scores as [tokens, E] (put_along_axis of the k scores, the same one op
    on both sides, so that argpartition's unordered slots compare with ours), on logits
    with no two equal in a row. bytes: logits read, ids and scores written."""
    out = []
    for label, n, k, normalize in SHAPES:
        for tokens in (1, 512):
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                if dtype != mx.bfloat16 and (tokens != 1 or label != "qwen3-30b"):
                    continue

                def make(rng, tokens=tokens, n=n, k=k, normalize=normalize, dtype=dtype):
                    return dict(logits=distinct_logits(rng, (tokens,), n, dtype), k=k,
                                normalize=normalize)

                exact, magnitude = oracle_and_magnitude(lambda **i: dense_oracle(**i)[:2])
                out.append(BenchCase(
                    op=OP, label=f"{label}-E{n}k{k}-{tokens}tok", dtype=dtype, make=make,
                    ours=ours_dense, native=native_dense, oracle=exact, magnitude=magnitude,
                    nbytes=tokens * (n * dtype.size + k * (4 + dtype.size)),
                    flops=tokens * n * (k + 4),
                    quick=tokens == 1 and label == "qwen3-30b" and dtype == mx.bfloat16))
    return out + grad_bench_cases()


def _grad_terms(logits, g, k: int, normalize: bool):
    ids, _, _ = oracle(logits, k, normalize)
    gk = np.take_along_axis(to_f64(g), ids, axis=-1)  # the scatter's VJP
    return [grad_oracle(logits, gk, k, normalize)]


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward of the dense scores w.r.t. the logits, against MLX's autodiff of
    mlx-lm's routing, at the shape without renormalisation: with it, the gradient at the
    experts not selected is exactly 0 in the math (and in ours), where MLX's autodiff of
    mlx-lm's softmax over all E, then divided by the selected ones' sum, leaves rounding
    residue that no bound relative to a zero gradient admits. bytes: logits read, ids and
    scores written, g read, dlogits written."""
    out = []
    dtype, tokens = mx.bfloat16, 512
    for label, n, k, normalize in SHAPES:
        if normalize:
            continue
        def make(rng, n=n, k=k, normalize=normalize):
            g = rng.standard_normal((tokens, n)).astype(np.float32)
            return dict(logits=distinct_logits(rng, (tokens,), n, dtype),
                        g=mx.array(g).astype(dtype), k=k, normalize=normalize)

        out.append(grad_case(
            op=OP, label=f"{label}-E{n}k{k}-{tokens}tok", dtype=dtype, make=make,
            ours=ours_dense, native=native_dense, wrt=("logits",), grad_oracle=_grad_terms,
            nbytes=tokens * (3 * n * dtype.size + k * (4 + dtype.size)),
            flops=tokens * n * (k + 8), quick=True))
    return out
