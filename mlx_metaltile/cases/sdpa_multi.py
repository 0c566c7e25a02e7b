"""sdpa_multi: float64 oracle from the definition, benchmark cases, checked calls."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from .. import backends
from ..ops.sdpa_multi import COMBINE_SPEC, SPLIT_SPEC
from ._base import DTYPES, BenchCase, assert_close, to_f64

OP = "sdpa_multi"


def sdpa_multi_terms(q, k, v, scale, causal, kv_len):
    """float64 (out, magnitude, p_magnitude) from the definition.

    out[b, h, l] = softmax_j(scale * q[b, h, l] . k[b, h // G, j]) @ v[b, h // G, j] over the
    visible keys j (j < kv_len; j <= kv_len - L + l when causal). ``magnitude`` is the sum
    of |terms| behind each output for the float32 accumulation bound:
    sum_j p_j * |v_j[d]| * (1 + |scale| * sum_d' |q_d' * k_j,d'|) (the second factor covers
    the rounding of the score, which moves p_j). ``p_magnitude``: sum_j p_j |v_j[d]|.
    """
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    # query head h = kvh * G + g reads KV head kvh = h // G. np.einsum (its own loops, one
    # thread) rather than BLAS: on a loaded CI machine threaded BLAS is many times slower.
    qg = q.reshape(B, Hkv, G, L, D)
    kk, vv = k[:, :, :kv_len], v[:, :, :kv_len]
    s = scale * np.einsum("bkgld,bkjd->bkglj", qg, kk)
    if causal:
        visible = np.arange(kv_len)[None, :] <= (kv_len - L + np.arange(L))[:, None]
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    score_mag = abs(scale) * np.einsum("bkgld,bkjd->bkglj", np.abs(qg), np.abs(kk))
    out = (np.einsum("bkglj,bkjd->bkgld", p, vv),
           np.einsum("bkglj,bkjd->bkgld", p * (1.0 + score_mag), np.abs(vv)),
           np.einsum("bkglj,bkjd->bkgld", p, np.abs(vv)))
    return tuple(x.reshape(B, Hq, L, D) for x in out)


def oracle(q, k, v, scale, causal, kv_len):
    """(out, magnitude) in float64 (see sdpa_multi_terms)."""
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len)[:2]


def make_inputs(rng, B, Hq, Hkv, L, S, D, dtype, qk_scale=1.0):
    def arr(shape, s=1.0):
        return mx.array((rng.standard_normal(shape) * s).astype(np.float32)).astype(dtype)

    return arr((B, Hq, L, D), qk_scale), arr((B, Hkv, S, D), qk_scale), arr((B, Hkv, S, D))


def launch_counts(backend):
    return (backends.launch_count(SPLIT_SPEC.name, backend),
            backends.launch_count(COMBINE_SPEC.name, backend))


def run_and_check(q, k, v, *, scale, causal, kv_len, backend, what=""):
    before = launch_counts(backend)
    out = mt.sdpa_multi(q, k, v, scale=scale, causal=causal, kv_len=kv_len)
    mx.eval(out)
    if backend != "reference":  # prove both kernels ran (never the reference vs itself)
        assert launch_counts(backend) == (before[0] + 1, before[1] + 1)
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    want, magnitude = oracle(q, k, v, scale, causal, kv_len)
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

def _bench_oracle(q, k, v, scale, causal, kv_len):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len)[0]


def _bench_magnitude(q, k, v, scale, causal, kv_len):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len)[1]


def _native(q, k, v, scale, causal, kv_len):
    return mx.fast.scaled_dot_product_attention(
        q, k[:, :, :kv_len], v[:, :, :kv_len], scale=scale, mask="causal" if causal else None)


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
    return out
