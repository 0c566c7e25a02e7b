"""sdpa_multi: float64 oracle from the definition, benchmark cases, checked calls."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ..ops.sdpa_multi import COMBINE_SPEC, SPLIT_SPEC
from ._base import DTYPES, BenchCase, assert_close, grad_case, to_f64

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
    v = to_f64(v)
    B, Hq, L, D = q.shape
    Hkv = v.shape[1]
    G = Hq // Hkv
    vv = v[:, :, :kv_len]
    p, score_mag, p_sink = probabilities(q, k, scale, causal, kv_len, mask, sinks)
    p = p.reshape(B, Hkv, G, L, kv_len)
    score_mag = score_mag.reshape(B, Hkv, G, L, kv_len)
    with np.errstate(invalid="ignore"):
        out = [np.einsum("bkglj,bkjd->bkgld", p, vv),
               np.einsum("bkglj,bkjd->bkgld", p * (1.0 + score_mag), np.abs(vv)),
               np.einsum("bkglj,bkjd->bkgld", p, np.abs(vv))]
    out = [x.reshape(B, Hq, L, D) for x in out]
    if p_sink is not None:
        sink = to_f64(sinks).reshape(1, Hq, 1, 1)
        vmax = np.abs(vv).max(axis=2)[:, :, None, None, :]  # [B, Hkv, 1, 1, D]
        extra = (p_sink * (1.0 + np.abs(sink))).reshape(B, Hkv, G, L, 1) * vmax
        out[1] = out[1] + extra.reshape(B, Hq, L, D)
    return tuple(out)


def probabilities(q, k, scale, causal, kv_len, mask=None, sinks=None):
    """float64 (p, score magnitude, p_sink) of the definition (see sdpa_multi_terms): the
    softmax weights p [B, Hq, L, kv_len] of the visible keys, the sum of |terms| behind each
    score (|scale| * sum_d |q_d k_j,d| + |a_j|), and the sink's weight [B, Hq, L, 1] (None
    without sinks)."""
    q, k = to_f64(q), to_f64(k)
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    # query head h = kvh * G + g reads KV head kvh = h // G. np.einsum (its own loops, one
    # thread) rather than BLAS: on a loaded CI machine threaded BLAS is many times slower.
    qg = q.reshape(B, Hkv, G, L, D)
    kk = k[:, :, :kv_len]
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
    sink = p_sink = None
    if sinks is not None:
        sink = to_f64(sinks).reshape(1, Hq, 1, 1)
        top = np.maximum(top, sink)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a row that sees nothing is NaN
        p = np.exp(s - top)
        den = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            p_sink = np.exp(sink - top)
            den = den + p_sink
            p_sink = p_sink / den
        p /= den
    return p, score_mag, p_sink


def oracle(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    """(out, magnitude) in float64 (see sdpa_multi_terms)."""
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask, sinks)[:2]


def make_inputs(rng, B, Hq, Hkv, L, S, D, dtype, qk_scale=1.0):
    def arr(shape, s=1.0):
        return mx.array((rng.standard_normal(shape) * s).astype(np.float32)).astype(dtype)

    return arr((B, Hq, L, D), qk_scale), arr((B, Hkv, S, D), qk_scale), arr((B, Hkv, S, D))


def launch_counts(backend):
    return (backends.launch_count(SPLIT_SPEC.name, backend),
            backends.launch_count(COMBINE_SPEC.name, backend))


def run_and_check(q, k, v, *, scale, causal, kv_len, backend, what="", mask=None,
                  sinks=None):
    """One checked call; ``kv_len`` may be a 0-d mx.array (the oracle reads its value)."""
    before = launch_counts(backend)
    kw = {} if mask is None else {"mask": mask}
    out = mt.sdpa_multi(q, k, v, scale=scale, causal=causal, kv_len=kv_len, sinks=sinks, **kw)
    mx.eval(out)
    if backend != "reference":  # prove both kernels ran (never the reference vs itself)
        assert launch_counts(backend) == (before[0] + 1, before[1] + 1)
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    n = kv_len.item() if isinstance(kv_len, mx.array) else kv_len
    want, magnitude = oracle(q, k, v, scale, causal, k.shape[2] if n is None else n, mask,
                             sinks)
    nan = np.isnan(want)  # rows that see no key and no sink: NaN, as MLX's sdpa gives
    assert np.isnan(to_f64(out)[nan]).all(), f"sdpa_multi[{backend}]{what}: want NaN rows"
    if nan.any():
        want, magnitude = np.where(nan, 0.0, want), np.where(nan, 0.0, magnitude)
        checked = mx.array(np.where(nan, 0.0, to_f64(out))).astype(q.dtype)
        assert_close(checked, want, q.dtype, magnitude, what=f"sdpa_multi[{backend}]{what}")
        return out
    assert_close(out, want, q.dtype, magnitude, what=f"sdpa_multi[{backend}]{what}")
    return out


# One checked call per registered kernel variant (tests/test_registry.py runs them for
# every registered variant on each kernel backend, so a variant added to the registry
# fails there until it has one here).
def _variant_call(backend, rng):
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 64, mx.bfloat16)
    run_and_check(q, k, v, scale=0.125, causal=True, kv_len=80, backend=backend)


VARIANT_CALLS = {"split": _variant_call, "combine": _variant_call}  # one call runs both


# ---- benchmarks -------------------------------------------------------------------------

def _bench_oracle(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask, sinks)[0]


def _bench_magnitude(q, k, v, scale, causal, kv_len, mask=None, sinks=None):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len, mask, sinks)[1]


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
                    out.append(BenchCase(
                        op=OP, label=f"{form}-h{Hq}/{Hkv}-d{D}-L{L}-kv{kv_len // 1024}k",
                        dtype=dtype, make=make, ours=mt.sdpa_multi, native=_native,
                        oracle=_bench_oracle, magnitude=_bench_magnitude,
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
                        out.append(BenchCase(
                            op=OP,
                            label=f"h{Hq}/{Hkv}-L{L}-kv{kv_len // 1024}k"
                                  + ("" if causal else "-full"),
                            dtype=dtype, make=make, ours=mt.sdpa_multi,
                            native=_native, oracle=_bench_oracle,
                            magnitude=_bench_magnitude,
                            nbytes=(2 * B * Hq * L * D + 2 * B * Hkv * kv_len * D) * dtype.size,
                            flops=4 * B * Hq * visible * D,
                            quick=(dtype == mx.float16 and Hkv == 8 and kv_len == 4096
                                   and L in (1, 8))))
    return out + _masked_bench_cases() + grad_bench_cases()


# ---- forward + backward vs MLX's autodiff of its own sdpa ---------------------------------

def grad_terms(q, k, v, g, scale, causal, kv_len, sinks=None):
    """float64 [(dq, magnitude), (dk, ..), (dv, ..)] (+ [(dsinks, ..)]) of the VJP with
    cotangent g [B, Hq, L, D], from the definition (no mask). With p_lj the softmax weights
    and out_l = sum_j p_lj v_j: dv_j = sum_l p_lj g_l; ds_lj = p_lj (g_l . v_j - g_l . out_l);
    dq_l = scale sum_j ds_lj k_j; dk_j = scale sum_l ds_lj q_l (k_j, v_j summed over the G
    query heads that read them); dsinks[h] = -sum_l p_sink,l g_l . out_l; the cache rows
    from kv_len on get 0.

    Magnitudes: the sums of |terms|, each p_lj carrying the relative error of its rounded
    score (1 + its score magnitude, as in sdpa_multi_terms), and ds_lj the errors of
    g_l . v_j and g_l . out_l (their sums of |terms|) besides p_lj's.
    """
    q, k, v, g = (to_f64(a) for a in (q, k, v, g))
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    p, score_mag, p_sink = probabilities(q, k, scale, causal, kv_len, sinks=sinks)
    p, score_mag = (a.reshape(B, Hkv, G, L, kv_len) for a in (p, score_mag))
    qg, gg = q.reshape(B, Hkv, G, L, D), g.reshape(B, Hkv, G, L, D)
    kk, vv = k[:, :, :kv_len], v[:, :, :kv_len]
    rows, cols = "bkglj,bkjd->bkgld", "bkglj,bkgld->bkjd"  # sum over keys / over queries
    pe = p * (1.0 + score_mag)  # p with its error scale
    out = np.einsum(rows, p, vv)
    gv = np.einsum("bkgld,bkjd->bkglj", gg, vv)
    gv_mag = np.einsum("bkgld,bkjd->bkglj", np.abs(gg), np.abs(vv))
    delta = (gg * out).sum(axis=-1, keepdims=True)  # g_l . out_l
    delta_mag = (p * gv_mag + pe * np.abs(gv)).sum(axis=-1, keepdims=True)
    ds = p * (gv - delta)
    ds_mag = p * (gv_mag + delta_mag) + pe * np.abs(gv - delta)
    pad = [(0, 0), (0, 0), (0, S - kv_len), (0, 0)]
    grads = [(scale * np.einsum(rows, ds, kk).reshape(q.shape),
              abs(scale) * np.einsum(rows, ds_mag, np.abs(kk)).reshape(q.shape)),
             (np.pad(scale * np.einsum(cols, ds, qg), pad),
              np.pad(abs(scale) * np.einsum(cols, ds_mag, np.abs(qg)), pad)),
             (np.pad(np.einsum(cols, p, gg), pad), np.pad(np.einsum(cols, pe, np.abs(gg)), pad))]
    if p_sink is not None:
        ps = p_sink.reshape(B, Hkv, G, L, 1)
        sink = to_f64(sinks).reshape(1, Hkv, G, 1, 1)
        # p_sink's own error: its score's (1 + |sink|) and the denominator's (sum_j p_j e_j)
        ps_err = ps * (1.0 + np.abs(sink) + pe.sum(axis=-1, keepdims=True))
        grads.append(((-ps * delta).sum(axis=(0, 3, 4)).reshape(Hq),
                      (ps * delta_mag + ps_err * np.abs(delta)).sum(axis=(0, 3, 4)).reshape(Hq)))
    return grads


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
                grad_oracle=grad_terms, nbytes=nbytes,
                flops=(4 + 10) * B * Hq * visible * D,
                quick=L == 1 and dtype == mx.float16))
    return out
