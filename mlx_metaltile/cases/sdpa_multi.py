"""sdpa_multi: float64 oracle from the definition, benchmark cases, checked calls."""

from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ..ops._common import clear_plans
from ..ops.sdpa_multi import (
    BACKWARD_SPECS,
    COMBINE_SPEC,
    MMA_BOUNDED_SPEC,
    MMA_SPEC,
    SPLIT_SPEC,
)
from ._base import DTYPES, BenchCase, assert_close, grad_case, oracle_and_magnitude, to_f64, verify

_ops = importlib.import_module("..ops.sdpa_multi", __package__)  # the module (the package
# exports the function under the same name)

OP = "sdpa_multi"


def full_mask(mask, B, Hq, L, kv_len):
    """A mask of sdpa_multi (None, or rank <= 4, last axis kv_len or L) as a float64 or bool
    [B, Hq, L, kv_len] NumPy array; the block form (last axis L != kv_len) covers the last L
    keys and leaves every key before them visible (True / 0)."""
    if mask is None:
        return None
    m = np.array(mask.astype(mx.float32) if mask.dtype != mx.bool_ else mask)
    m = m.astype(np.float64) if m.dtype != np.bool_ else m
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    if m.shape[-1] == kv_len:
        return np.broadcast_to(m, (B, Hq, L, kv_len))
    full = np.ones((B, Hq, L, kv_len), bool) if m.dtype == np.bool_ else np.zeros(
        (B, Hq, L, kv_len))
    full[..., kv_len - L:] = m
    return full


def sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    """float64 (out, magnitude, p_magnitude) from the definition.

    out[b, h, l] = softmax_j(scale * q[b, h, l] . k[b, h // G, j] + a_j) @ v[b, h // G, j]
    over the visible keys j (j < kv_len; j <= kv_len - L + l when causal), with a_j the
    additive mask (0 without one); a bool mask hides the keys it marks False. MLX's rules
    for rows that see no key: hidden by a bool mask, every key of [0, kv_len) weighs the
    same (MLX scores them the lowest finite float; with a sink they weigh 0); made -inf by
    an additive mask, NaN (0 with a sink).
    ``sinks[h]`` joins the softmax's denominator as exp(sinks[h]) (with the same maximum
    subtracted). ``magnitude`` is the sum of |terms| behind each output for the float32
    accumulation bound: sum_j p_j * |v_j[d]| * (1 + |scale| * sum_d' |q_d' * k_j,d'| +
    |a_j|) (the second factor covers the rounding of the score, which moves p_j), plus
    p_sink * (1 + |sink|) * max_j |v_j[d]| for the sink's rounding. ``p_magnitude``:
    sum_j p_j |v_j[d]|.
    """
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    # query head h = kvh * G + g reads KV head kvh = h // G. np.einsum (its own loops, one
    # thread) rather than BLAS: on a loaded CI machine threaded BLAS is many times slower.
    qg = q.reshape(B, Hkv, G, L, D)
    kk, vv = k[:, :, :kv_len], v[:, :, :kv_len]
    s = scale * np.einsum("bkgld,bkjd->bkglj", qg, kk).reshape(B, Hq, L, kv_len)
    score_mag = abs(scale) * np.einsum("bkgld,bkjd->bkglj", np.abs(qg), np.abs(kk)).reshape(
        B, Hq, L, kv_len)
    if causal:
        visible = np.arange(kv_len)[None, :] <= (kv_len - L + np.arange(L))[:, None]
        s = np.where(visible, s, -np.inf)
    m = full_mask(mask, B, Hq, L, kv_len)
    if m is not None and m.dtype == np.bool_:
        hidden = ~m.any(axis=-1, keepdims=True)
        s = np.where(m, s, -np.inf)
        if sinks is None:  # every key hidden: uniform weights (MLX's rule); a finite
            s = np.where(hidden, 0.0, s)  # sink is above their lowest finite score
    elif m is not None:
        s = s + m
        score_mag = score_mag + np.where(np.isfinite(m), np.abs(m), 0.0)
    top = s.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = to_f64(sinks).reshape(1, Hq, 1, 1)
        top = np.maximum(top, sink)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a row that sees nothing is NaN
        p = np.exp(s - top)
        den = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            p_sink = np.exp(sink - top)
            den = den + p_sink
        p /= den
    p = p.reshape(B, Hkv, G, L, kv_len)
    score_mag = score_mag.reshape(B, Hkv, G, L, kv_len)
    with np.errstate(invalid="ignore"):
        out = [np.einsum("bkglj,bkjd->bkgld", p, vv),
               np.einsum("bkglj,bkjd->bkgld", p * (1.0 + score_mag), np.abs(vv)),
               np.einsum("bkglj,bkjd->bkgld", p, np.abs(vv))]
    out = [x.reshape(B, Hq, L, D) for x in out]
    if sink is not None:
        vmax = np.abs(vv).max(axis=2)[:, :, None, None, :]  # [B, Hkv, 1, 1, D]
        extra = ((p_sink / den) * (1.0 + np.abs(sink))).reshape(B, Hkv, G, L, 1) * vmax
        out[1] = out[1] + extra.reshape(B, Hq, L, D)
    return tuple(out)


def oracle(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    """(out, magnitude) in float64 (see sdpa_multi_terms)."""
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask, sinks)[:2]


def grad_oracle(q, k, v, g, scale, causal, kv_len, mask=None, sinks=None) -> dict:
    """float64 gradients of sdpa_multi from the math, with the cotangent ``g`` [B, Hq, L, D]:
    {"dq", "dk", "dv", "dsinks", "dmask"} -> (exact, magnitude) (dsinks / dmask only where
    given; dk, dv over all S cache rows, 0 from kv_len on; dmask in the mask's shape).

    Per row r (query l of head h) with P the forward's probabilities (sdpa_multi_terms:
    MLX's rules for rows that see nothing), O = P v, Dr = dO_r . O_r:
      dS_rj = P_rj (dO_r . v_j - Dr) where the score depends on q, k (a bool-masked key's
      score is a constant: dS 0), dq_r = scale sum_j dS_rj k_j, dk_j = scale sum_r dS_rj q_r
      (over the G heads sharing the KV head), dv_j = sum_r P_rj dO_r,
      dsinks_h = -sum_{b, l} P_sink Dr, dmask = dS summed over the mask's broadcast axes.
    A row that sees no key and no sink (NaN output) has P = NaN, so NaN gradients follow.
    ``magnitude``: the sum of |terms| behind each gradient, with each P_rj weighted by
    (1 + |score terms of key j| + the row's P-weighted mean of them) for the rounding of the
    scores, which moves P (as sdpa_multi_terms)."""
    q, k, v, g = to_f64(q), to_f64(k), to_f64(v), to_f64(g)
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kk = np.repeat(k[:, :, :kv_len], G, axis=1)
    vv = np.repeat(v[:, :, :kv_len], G, axis=1)
    s = scale * np.einsum("bhld,bhjd->bhlj", q, kk)
    smag = abs(scale) * np.einsum("bhld,bhjd->bhlj", np.abs(q), np.abs(kk))
    live = np.ones(s.shape, bool)
    if causal:
        live &= np.arange(kv_len)[None, :] <= (kv_len - L + np.arange(L))[:, None]
    m = full_mask(mask, B, Hq, L, kv_len)
    hidden = np.zeros((B, Hq, L, 1), bool)
    if m is not None and m.dtype == np.bool_:
        live = live & m
        hidden = ~m.any(axis=-1, keepdims=True)
    elif m is not None:
        s = s + m
        live = live & np.isfinite(m)
        smag = smag + np.where(np.isfinite(m), np.abs(m), 0.0)
    s = np.where(live, s, -np.inf)
    smag = np.where(live, smag, 0.0)
    if sinks is None:  # a row whose keys a bool mask hides all: uniform weights (MLX)
        s = np.where(hidden & (m is not None), 0.0, s)
    top = s.max(axis=-1, keepdims=True)
    sink = None if sinks is None else to_f64(sinks).reshape(1, Hq, 1, 1)
    if sink is not None:
        top = np.maximum(top, sink)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - top)
        den = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            den = den + np.exp(sink - top)
        p = e / den
        nan_row = np.isnan(p).any(axis=-1, keepdims=True)
        c = (p * smag).sum(axis=-1, keepdims=True)  # the row's P-weighted score terms
        w = p * (1.0 + smag + c)  # P with its rounding's reach
        o = np.einsum("bhlj,bhjd->bhld", p, vv)
        d_r = (g * o).sum(axis=-1, keepdims=True)
        gv_abs = np.einsum("bhld,bhjd->bhlj", np.abs(g), np.abs(vv))  # |dO|.|v_j|
        d_mag = (w * gv_abs).sum(axis=-1, keepdims=True)
        dp = np.einsum("bhld,bhjd->bhlj", g, vv)
        ds = np.where(nan_row, np.nan, np.where(live, p * (dp - d_r), 0.0))
        ds_mag = np.where(live, w * (np.abs(dp) + np.abs(d_r)) + p * (gv_abs + d_mag), 0.0)
        ds_mag = np.where(nan_row, 0.0, ds_mag)

    def fold(a):  # [B, Hq, kv_len, D] -> [B, Hkv, S, D]: sum the group's heads, pad to S
        a = a.reshape(B, Hkv, G, kv_len, D).sum(2)
        return np.pad(a, [(0, 0), (0, 0), (0, S - kv_len), (0, 0)])

    with np.errstate(invalid="ignore"):
        out = {
            "dq": (scale * np.einsum("bhlj,bhjd->bhld", ds, kk),
                   abs(scale) * np.einsum("bhlj,bhjd->bhld", ds_mag, np.abs(kk))),
            "dk": (fold(scale * np.einsum("bhlj,bhld->bhjd", ds, q)),
                   fold(abs(scale) * np.einsum("bhlj,bhld->bhjd", ds_mag, np.abs(q)))),
            "dv": (fold(np.einsum("bhlj,bhld->bhjd", p, g)),
                   fold(np.einsum("bhlj,bhld->bhjd", w, np.abs(g)))),
        }
        if sink is not None:
            ps = np.exp(sink - top) / den
            ps_w = ps * (1.0 + np.abs(sink) + c)
            out["dsinks"] = (-(ps * d_r).sum(axis=(0, 2, 3)),
                             np.where(nan_row, 0.0, ps_w * np.abs(d_r) + ps * d_mag
                                      ).sum(axis=(0, 2, 3)))
    if m is not None and m.dtype != np.bool_:
        shape = tuple(mask.shape)
        cols = shape[-1] if shape else 1
        exact, mag = ds, ds_mag
        if cols != kv_len:  # the block form: the mask covers the last L keys
            exact, mag = exact[..., kv_len - L:], mag[..., kv_len - L:]
        full = (1,) * (4 - len(shape)) + shape
        axes = tuple(i for i in range(4) if full[i] == 1 and exact.shape[i] != 1)
        out["dmask"] = tuple(a.sum(axis=axes, keepdims=True).reshape(shape)
                             for a in (exact, mag))
    return out


def make_inputs(rng, B, Hq, Hkv, L, S, D, dtype, qk_scale=1.0):
    def arr(shape, s=1.0):
        return mx.array((rng.standard_normal(shape) * s).astype(np.float32)).astype(dtype)

    return arr((B, Hq, L, D), qk_scale), arr((B, Hkv, S, D), qk_scale), arr((B, Hkv, S, D))


MASK_KINDS = ("bool", "additive", "block", "causal")


def make_mask(rng, kind, bool_shape, additive_shape, L, dtype):
    """(mask, causal) of a mask-kind test: "bool" keeps 60% of keys (``bool_shape``),
    "additive" N(0, 2) logits with 30% -inf in ``dtype`` (``additive_shape``), "block" an
    [L, L] bool block form, "causal" no array and causal=True."""
    mask = None
    if kind == "bool":
        mask = mx.array(rng.random(bool_shape) < 0.6)
    elif kind == "additive":
        m = rng.standard_normal(additive_shape) * 2.0
        m[rng.random(m.shape) < 0.3] = -np.inf
        mask = mx.array(m.astype(np.float32)).astype(dtype)
    elif kind == "block":
        mask = mx.array(rng.random((L, L)) < 0.5)
    elif kind != "causal":
        raise ValueError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")
    return mask, kind == "causal"


def launch_counts(backend):
    """(pass-1 launches: the split kernel's and the MMA kernels', combine launches)."""
    return (backends.launch_count(SPLIT_SPEC.name, backend)
            + backends.launch_count(MMA_SPEC.name, backend)
            + backends.launch_count(MMA_BOUNDED_SPEC.name, backend),
            backends.launch_count(COMBINE_SPEC.name, backend))


def run_and_check(q, k, v, *, scale, causal, kv_len, backend, what="", mask=None,
                  sinks=None):
    """One checked call; ``kv_len`` may be a 0-d mx.array (the oracle reads its value)."""
    before = launch_counts(backend)
    kw = {} if mask is None else {"mask": mask}
    out = mt.sdpa_multi(q, k, v, scale=scale, causal=causal, kv_len=kv_len, sinks=sinks, **kw)
    mx.eval(out)
    if backend != "reference":  # prove both kernels ran (never the reference vs itself)
        verify(launch_counts(backend) == (before[0] + 1, before[1] + 1))
    verify(out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape))
    n = kv_len.item() if isinstance(kv_len, mx.array) else kv_len
    want, magnitude = oracle(q, k, v, scale, causal, k.shape[2] if n is None else n, mask,
                             sinks)
    nan = np.isnan(want)  # rows that see no key and no sink: NaN, as MLX's sdpa gives
    verify(np.isnan(to_f64(out)[nan]).all(), f"sdpa_multi[{backend}]{what}: want NaN rows")
    if nan.any():
        want, magnitude = np.where(nan, 0.0, want), np.where(nan, 0.0, magnitude)
        checked = mx.array(np.where(nan, 0.0, to_f64(out))).astype(q.dtype)
        assert_close(checked, want, q.dtype, magnitude, what=f"sdpa_multi[{backend}]{what}")
        return out
    assert_close(out, want, q.dtype, magnitude, what=f"sdpa_multi[{backend}]{what}")
    return out


def backward_counts(backend) -> tuple[int, ...]:
    """Launches of each of BACKWARD_SPECS (statistics, split dq, dk/dv) on ``backend``."""
    return tuple(backends.launch_count(s.name, backend) for s in BACKWARD_SPECS)


def run_grad_and_check(q, k, v, *, scale, causal, kv_len, backend, rng, what="", mask=None,
                       sinks=None) -> dict:
    """One checked VJP with a random cotangent: gradients w.r.t. q, k, v and the sinks and
    an additive mask where given, against grad_oracle; proves the three backward kernels
    ran once each on a kernel backend. Where the oracle is NaN (a row that sees nothing)
    the gradient must be NaN too. Returns the gradients by name."""
    g = mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    names, primals = ["dq", "dk", "dv"], [q, k, v]
    if sinks is not None:
        names.append("dsinks")
        primals.append(sinks)
    additive = mask is not None and mask.dtype != mx.bool_
    if additive:
        names.append("dmask")
        primals.append(mask)

    def fn(q, k, v, *rest):
        it = iter(rest)
        kw = {"sinks": next(it) if sinks is not None else None}
        if mask is not None:
            kw["mask"] = next(it) if additive else mask
        return mt.sdpa_multi(q, k, v, scale=scale, causal=causal, kv_len=kv_len, **kw)

    before = backward_counts(backend)
    _, grads = mx.vjp(fn, primals, [g])
    mx.eval(grads)
    if backend != "reference":  # the backward kernels ran (never the composite's autodiff)
        ran = tuple(a - b for a, b in zip(backward_counts(backend), before, strict=True))
        verify(ran == (1, 1, 1), (what, ran))  # statistics, split dq, dk/dv: once each
    n = kv_len.item() if isinstance(kv_len, mx.array) else kv_len
    want = grad_oracle(q, k, v, g, scale, causal, k.shape[2] if n is None else n, mask, sinks)
    out = {}
    for name, got, primal in zip(names, grads, primals, strict=True):
        verify(got.dtype == primal.dtype and got.shape == primal.shape, (name, got.dtype))
        exact, mag = want[name]
        nan = np.isnan(exact)
        out[name] = got
        label = f"sdpa_multi[{backend}]{what} {name}"
        verify(np.isnan(to_f64(got)[nan]).all(), f"{label}: want NaN where the oracle is")
        if nan.any():
            exact, mag = np.where(nan, 0.0, exact), np.where(nan, 0.0, mag)
            got = mx.array(np.where(nan, 0.0, to_f64(got))).astype(got.dtype)
        assert_close(got, exact, primal.dtype, mag, what=label)
    return out


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend, so a variant added to the registry
# fails there until it has one here).
def _variant_call(backend, rng):
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 64, mx.bfloat16)
    run_and_check(q, k, v, scale=0.125, causal=True, kv_len=80, backend=backend)


@contextlib.contextmanager
def mma_rows(min_rows: int, path: str | None = None):
    """Inside: the MMA path's MMA_MIN_ROWS is ``min_rows`` (and MMA_MIN_QUERIES 1 when
    ``min_rows`` is 1), and with ``path`` every backend's SPLIT_PATH is ``path`` (the
    plans, which read them once, are forgotten on the way in and out)."""
    clear_plans()
    saved = (dict(_ops.SPLIT_PATH), _ops.MMA_MIN_ROWS, _ops.MMA_MIN_QUERIES)
    _ops.MMA_MIN_ROWS = min_rows
    if min_rows == 1:
        _ops.MMA_MIN_QUERIES = 1
    if path is not None:
        _ops.SPLIT_PATH.update(dict.fromkeys(_ops.SPLIT_PATH, path))
    try:
        yield
    finally:
        _ops.SPLIT_PATH.clear()
        _ops.SPLIT_PATH.update(saved[0])
        _ops.MMA_MIN_ROWS, _ops.MMA_MIN_QUERIES = saved[1:]
        clear_plans()


def _split_call(backend, rng):
    with mma_rows(1 << 30):  # the cuda plan's MMA path off: sdpa_multi.metal
        _variant_call(backend, rng)


def _mma_call(backend, rng):
    with mma_rows(1, "mma"):  # sdpa_multi_mma.metal on every backend
        _variant_call(backend, rng)


def _mma_bounded_call(backend, rng):
    saved = (_ops.MMA_PREFETCH, _ops.MMA_BOUNDED)
    _ops.MMA_PREFETCH, _ops.MMA_BOUNDED = False, True  # PF 0 at D 128: the bounded kernel
    try:
        with mma_rows(1, "mma"):
            q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 128, mx.bfloat16)
            run_and_check(q, k, v, scale=128 ** -0.5, causal=True, kv_len=80, backend=backend)
    finally:
        _ops.MMA_PREFETCH, _ops.MMA_BOUNDED = saved


VARIANT_CALLS = {"split": _split_call, "combine": _variant_call, "split_mma": _mma_call,
                 "split_mma_bounded": _mma_bounded_call}


def _backward_call(backend, rng):
    """The VJP (statistics, split dq, then dk/dv kernels) against the float64 gradients."""
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 64, mx.bfloat16)
    run_grad_and_check(q, k, v, scale=0.125, causal=True, kv_len=80, backend=backend, rng=rng)


@contextlib.contextmanager
def backward_split(chunk: int, backend: str | None = None, n_sg: int | None = None):
    """Inside: the VJP on ``backend`` (every kernel backend when None) splits the keys of
    its dq side (the statistics and split dq kernels) into slices of ``chunk`` keys
    (rounded up to whole key blocks), whatever the backend's plan (BWD_SPLIT_FORCED);
    ``n_sg`` (1, 2, 4 or 8) forces the threadgroups' simdgroups on every backend
    (BWD_SPLIT_SIMDGROUPS), else the plan picks them from G*L."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"[{OP}] the forced slice length must be a positive int, got "
                         f"{chunk!r}")
    if n_sg is not None and n_sg not in _ops.SPLIT_SIMDGROUPS:
        raise ValueError(f"[{OP}] the forced n_sg must be one of {_ops.SPLIT_SIMDGROUPS}, "
                         f"got {n_sg!r}")
    saved = dict(_ops.BWD_SPLIT_FORCED), _ops.BWD_SPLIT_SIMDGROUPS
    names = backends.KERNEL_BACKENDS if backend is None else (backend,)
    _ops.BWD_SPLIT_FORCED.update(dict.fromkeys(names, chunk))
    if n_sg is not None:
        _ops.BWD_SPLIT_SIMDGROUPS = n_sg
    try:
        yield
    finally:
        _ops.BWD_SPLIT_FORCED.clear()
        _ops.BWD_SPLIT_FORCED.update(saved[0])
        _ops.BWD_SPLIT_SIMDGROUPS = saved[1]


@contextlib.contextmanager
def backward_one_slice():
    """Inside: the VJP's dq side takes one slice covering every key on every backend (no
    backend splits, nothing forced), as Metal's plan does."""
    saved = _ops.BWD_SPLIT_BACKENDS, dict(_ops.BWD_SPLIT_FORCED)
    _ops.BWD_SPLIT_BACKENDS = ()
    _ops.BWD_SPLIT_FORCED.clear()
    try:
        yield
    finally:
        _ops.BWD_SPLIT_BACKENDS = saved[0]
        _ops.BWD_SPLIT_FORCED.update(saved[1])


def _backward_one_slice_call(backend, rng):
    """The VJP with one slice (statistics, split dq, dk/dv kernels), on every backend
    (cuda's plan splits this shape)."""
    with backward_one_slice():
        _backward_call(backend, rng)


VARIANT_CALLS["backward_dkv"] = _backward_one_slice_call


def _backward_split_call(backend, rng):
    """The key-split VJP (statistics, split dq, dk/dv kernels): three slices of 32 keys."""
    with backward_split(32, backend):
        _backward_call(backend, rng)


VARIANT_CALLS["backward_stats"] = VARIANT_CALLS["backward_dq_split"] = _backward_split_call


# ---- benchmarks -------------------------------------------------------------------------

def _bench_terms(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask, sinks)[:2]


def _native(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    mask = "causal" if causal else mask
    return mx.fast.scaled_dot_product_attention(
        q, k[:, :, :kv_len], v[:, :, :kv_len], scale=scale, mask=mask, sinks=sinks)


def _masked_bench_cases() -> list[BenchCase]:
    """Masks and sinks against MLX's own sdpa with the same arguments: a verify block with a
    bool tree mask over all keys ([L, kv_len], broadcast over heads), an additive mask per
    head ([1, Hq, L, kv_len]), and gpt-oss-style sinks (64 query heads, 8 KV heads, D 64)
    on causal blocks and decode steps."""
    out = []
    B, slack = 1, 256
    for form, Hq, Hkv, D in (("tree", 32, 8, 128), ("additive", 32, 8, 128),
                             ("sinks", 64, 8, 64)):
        for kv_len in (1024, 4096):
            for L in (1, 8) if form == "sinks" else (8,):
                for dtype in DTYPES:
                    def make(rng, form=form, Hq=Hq, Hkv=Hkv, D=D, kv_len=kv_len, L=L,
                             dtype=dtype):
                        def arr(shape, s=1.0):
                            return mx.array((rng.standard_normal(shape) * s).astype(
                                np.float32)).astype(dtype)
                        S = kv_len + slack
                        kw = dict(q=arr((B, Hq, L, D)), k=arr((B, Hkv, S, D)),
                                  v=arr((B, Hkv, S, D)), scale=D ** -0.5, causal=False,
                                  kv_len=kv_len)
                        tri = np.arange(kv_len)[None, :] <= (kv_len - L + np.arange(L))[:, None]
                        if form == "tree":
                            own = np.eye(L, kv_len, kv_len - L, dtype=bool)  # itself
                            kw["mask"] = mx.array(tri & (rng.random((L, kv_len)) < 0.9) | own)
                        elif form == "additive":
                            m = rng.standard_normal((1, Hq, L, kv_len)).astype(np.float32)
                            kw["mask"] = mx.array(np.where(tri, m, -np.inf)).astype(dtype)
                        else:
                            kw["causal"] = True
                            kw["sinks"] = arr((Hq,), 2.0)
                        return kw
                    exact, magnitude = oracle_and_magnitude(_bench_terms)
                    out.append(BenchCase(
                        op=OP, label=f"{form}-h{Hq}/{Hkv}-d{D}-L{L}-kv{kv_len // 1024}k",
                        dtype=dtype, make=make, ours=mt.sdpa_multi, native=_native,
                        oracle=exact, magnitude=magnitude,
                        nbytes=(2 * B * Hq * L * D + 2 * B * Hkv * kv_len * D) * dtype.size
                        + (L * kv_len if form == "tree" else
                           Hq * L * kv_len * dtype.size if form == "additive" else 0),
                        flops=4 * B * Hq * L * kv_len * D,
                        quick=dtype == mx.float16 and kv_len == 4096 and L == 8))
    return out


def bench_cases() -> list[BenchCase]:
    # Decode (L=1) and verify/denoise blocks against a preallocated cache (256 rows of slack,
    # as a step-allocated KV cache), Llama-style D=128 with GQA 32/8 and 32/4.
    out = []
    D, B, Hq, slack = 128, 1, 32, 256
    for Hkv in (8, 4):
        for kv_len in (1024, 4096, 16384):
            for L in (1, 4, 8, 16, 32):
                for causal in (True, False) if L == 16 else (True,):
                    for dtype in DTYPES:
                        def make(rng, L=L, kv_len=kv_len, Hkv=Hkv, dtype=dtype, causal=causal):
                            def arr(shape):
                                return mx.array(rng.standard_normal(shape, dtype=np.float32)
                                                ).astype(dtype)
                            S = kv_len + slack
                            return dict(q=arr((B, Hq, L, D)), k=arr((B, Hkv, S, D)),
                                        v=arr((B, Hkv, S, D)), scale=D ** -0.5,
                                        causal=causal, kv_len=kv_len)
                        visible = (L * kv_len - L * (L - 1) // 2) if causal else L * kv_len
                        exact, magnitude = oracle_and_magnitude(_bench_terms)
                        out.append(BenchCase(
                            op=OP,
                            label=f"h{Hq}/{Hkv}-L{L}-kv{kv_len // 1024}k"
                                  + ("" if causal else "-full"),
                            dtype=dtype, make=make, ours=mt.sdpa_multi,
                            native=_native, oracle=exact, magnitude=magnitude,
                            nbytes=(2 * B * Hq * L * D + 2 * B * Hkv * kv_len * D) * dtype.size,
                            flops=4 * B * Hq * visible * D,
                            quick=(dtype == mx.float16 and Hkv == 8 and kv_len == 4096
                                   and L in (1, 8))))
    return out + _masked_bench_cases() + grad_bench_cases()


# ---- forward + backward vs MLX's autodiff of its own sdpa ---------------------------------

def _grad_terms(q, k, v, g, scale, causal, kv_len, sinks=None):
    """grad_oracle's (gradient, magnitude) in the order the grad cases differentiate."""
    grads = grad_oracle(q, k, v, g, scale, causal, kv_len, sinks=sinks)
    return [grads[name] for name in ("dq", "dk", "dv", "dsinks") if name in grads]


def grad_bench_cases() -> list[BenchCase]:
    """Forward + backward through the public ``mt.sdpa_multi`` and ``mx.vjp`` (whatever VJP
    it has) against MLX's autodiff of ``mx.fast.scaled_dot_product_attention`` on the cache
    slice, causal, a cache with 256 rows of slack: Llama-style h32/8 D 128 at a decode step
    (L 1) and a 32-query block over 4k keys, w.r.t. q, k, v; gpt-oss-style sinks (h64/8,
    D 64, L 8) w.r.t. q, k, v and the sinks. bytes: the forward's (q and the visible K and V
    read, out written) plus the backward's (q, the visible K and V, and g read; dq written,
    and dk, dv over every cache row: the rows from kv_len on are zeros, written too); with
    sinks, the sinks read twice and their gradient written."""
    out = []
    B, slack, kv_len = 1, 256, 4096
    S = kv_len + slack
    for form, Hq, Hkv, D, L in (("", 32, 8, 128, 1), ("", 32, 8, 128, 32),
                                ("sinks-", 64, 8, 64, 8)):
        for dtype in DTYPES:
            def make(rng, Hq=Hq, Hkv=Hkv, D=D, L=L, dtype=dtype, sinks=bool(form)):
                def arr(shape, s=1.0):
                    return mx.array((rng.standard_normal(shape) * s).astype(np.float32)
                                    ).astype(dtype)
                kw = dict(q=arr((B, Hq, L, D)), k=arr((B, Hkv, S, D)), v=arr((B, Hkv, S, D)),
                          g=arr((B, Hq, L, D)), scale=D ** -0.5, causal=True, kv_len=kv_len)
                if sinks:
                    kw["sinks"] = arr((Hq,), 2.0)
                return kw
            visible = L * kv_len - L * (L - 1) // 2
            nbytes = (B * Hq * L * D * (2 + 3) + B * Hkv * D * (4 * kv_len + 2 * S)
                      + (3 * Hq if form else 0)) * dtype.size
            out.append(grad_case(
                op=OP, label=f"{form}h{Hq}/{Hkv}-d{D}-L{L}-kv{kv_len // 1024}k", dtype=dtype,
                make=make, ours=mt.sdpa_multi, native=_native,
                wrt=("q", "k", "v", "sinks") if form else ("q", "k", "v"),
                grad_oracle=_grad_terms, nbytes=nbytes,
                flops=(4 + 10) * B * Hq * visible * D,
                quick=L == 1 and dtype == mx.float16))
    return out
