"""Benchmark cases shared by ``python -m mlx_metaltile bench`` and the pytest-benchmark suites.

Each case builds fresh inputs, and names three callables over them: ours (the public op on
the selected backend), the native MLX composite it replaces, and a float64 NumPy oracle
written from the math. ``nbytes`` counts every input read once plus the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlx_metaltile as mt


@dataclass(frozen=True)
class BenchCase:
    op: str
    label: str
    dtype: mx.Dtype
    make: Callable[[np.random.Generator], dict]
    ours: Callable[..., mx.array]
    native: Callable[..., mx.array] | None
    oracle: Callable[..., np.ndarray]
    nbytes: int
    flops: int
    quick: bool = False  # part of the short default run
    # float64 sum of |terms| behind each output, for the tolerance's accumulation term
    # (reductions such as matmuls); None: |oracle| (elementwise ops).
    magnitude: Callable[..., np.ndarray] | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).rsplit(".", 1)[-1]

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}-{self.dtype_name}"


def f64(a) -> np.ndarray:
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        return np.array(a).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_CASES: list[BenchCase] = []


# ---- gated_rms_norm ------------------------------------------------------------------

def _gated_rms_norm_oracle(y, z, weight, eps=1e-5):
    y, z, w = f64(y), f64(z), f64(weight)
    with np.errstate(over="ignore"):
        silu = z / (1.0 + np.exp(-z))
    return w * y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * silu


def _gated_rms_norm_magnitude(y, z, weight, eps=1e-5):
    # float32 error grows with |z| (exp(-z) starts from -z rounded to float32), as in the tests
    return np.abs(_gated_rms_norm_oracle(y, z, weight, eps)) * (1.0 + np.abs(f64(z)))


@partial(mx.compile, shapeless=True)
def _precise_swiglu(h, gate, x):
    # The gate of mlx-lm's Qwen3-Next gated norm (mlx_lm/models/qwen3_next.py, since its
    # change "Ensure normalization does not promote to fp32"; before it, the model dtype's
    # swiglu(gate, x) = nn.silu(gate) * x, also compiled and shapeless).
    gate = nn.silu(gate.astype(mx.float32))
    x = x.astype(mx.float32)
    return (gate * x).astype(h.dtype)


def gated_rms_norm_native(y, z, weight, eps=1e-5):
    """What mlx-lm's Qwen3NextRMSNormGated computes: ``mx.fast.rms_norm`` of the hidden
    states, then a compiled (shapeless) float32 silu gate rounded to their dtype.

    In mlx-lm the hidden states reach the norm in the model dtype: the Gated-DeltaNet
    recurrence returns its float32 result cast to the input dtype (``y.astype(q.dtype)`` in
    mlx_lm/models/gated_delta.py). A float32 ``y`` is cast here the same way, so the native
    side of a "yf32" case pays that cast as a kernel of its own (mlx-lm's fused recurrence
    kernel writes the model dtype directly), and its result has z's dtype, as ours does.
    """
    h = y.astype(z.dtype)
    return _precise_swiglu(h, z, mx.fast.rms_norm(h, weight, eps))


def _gated_rms_norm_cases():
    shapes = [(4096, 128, True), (16384, 128, False), (1, 2048, True), (32, 2048, False),
              (4096, 2048, False), (1, 4096, False), (32, 4096, True), (4096, 4096, False)]
    for rows, n, quick in shapes:
        for dtype in DTYPES:
            for y_dtype in (mx.float32, dtype) if dtype != mx.float32 else (mx.float32,):
                def make(rng, rows=rows, n=n, dtype=dtype, y_dtype=y_dtype):
                    return dict(
                        y=mx.array(rng.standard_normal((rows, n), dtype=np.float32)).astype(y_dtype),
                        z=mx.array(rng.standard_normal((rows, n), dtype=np.float32)).astype(dtype),
                        weight=mx.array(rng.uniform(-2, 2, n).astype(np.float32)).astype(dtype))
                y_tag = "yf32" if y_dtype == mx.float32 and dtype != mx.float32 else "y=T"
                nbytes = rows * n * (y_dtype.size + 2 * dtype.size) + n * dtype.size
                _CASES.append(BenchCase(
                    op="gated_rms_norm", label=f"{rows}x{n}-{y_tag}", dtype=dtype, make=make,
                    ours=mt.gated_rms_norm, native=gated_rms_norm_native,
                    oracle=_gated_rms_norm_oracle, magnitude=_gated_rms_norm_magnitude,
                    nbytes=nbytes, flops=8 * rows * n,
                    quick=quick and dtype == mx.float16))


_gated_rms_norm_cases()


# ---- fp4_qmm -------------------------------------------------------------------------

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _mxfp4_weights64(w, scales) -> np.ndarray:
    """[N, K] float64: E2M1 code * 2^(s - 127), from the mxfp4 definition."""
    words = np.array(w)
    n = words.shape[0]
    codes = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    values = _E2M1[codes.reshape(n, -1)].reshape(n, -1, 32)
    s = np.exp2(np.array(scales).astype(np.float32) - 127.0)
    return (values * s[:, :, None]).reshape(n, -1).astype(np.float64)


def _fp4_qmm_oracle(x, w, scales):
    return f64(x) @ _mxfp4_weights64(w, scales).T


def _fp4_qmm_magnitude(x, w, scales):
    return np.abs(f64(x)) @ np.abs(_mxfp4_weights64(w, scales)).T


def _fp4_qmm_native(x, w, scales):
    return mx.quantized_matmul(x, w, scales, transpose=True, group_size=32, bits=4,
                               mode="mxfp4")


def _fp4_qmm_cases():
    for n, k in ((4096, 4096), (14336, 4096)):
        for m in (1, 8, 32, 512):
            for dtype in DTYPES:
                def make(rng, m=m, n=n, k=k, dtype=dtype):
                    wf = mx.array(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
                    w, scales = mx.quantize(wf, mode="mxfp4")[:2]
                    x = mx.array(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
                    return dict(x=x, w=w, scales=scales)
                nbytes = m * k * dtype.size + n * k // 2 + n * k // 32 + m * n * dtype.size
                _CASES.append(BenchCase(
                    op="fp4_qmm", label=f"M{m}-N{n}-K{k}", dtype=dtype, make=make,
                    ours=mt.fp4_qmm, native=_fp4_qmm_native, oracle=_fp4_qmm_oracle,
                    nbytes=nbytes, flops=2 * m * n * k, magnitude=_fp4_qmm_magnitude,
                    quick=n == k and m in (1, 32) and dtype == mx.bfloat16))


_fp4_qmm_cases()


# ---- moe_gather_qmm -----------------------------------------------------------------

def _moe_unpack(w: np.ndarray, bits: int) -> np.ndarray:
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    codes = (w.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*w.shape[:-1], w.shape[-1] * per_word).astype(np.float64)


def _moe_round(values: np.ndarray, dtype) -> np.ndarray:
    if dtype == mx.float32:
        return values.astype(np.float32).astype(np.float64)
    if dtype == mx.float16:
        return values.astype(np.float16).astype(np.float64)
    mant, expo = np.frexp(values)  # bfloat16: 8 significant bits, ties to even
    return np.ldexp(np.rint(mant * 256.0) / 256.0, expo)


def _moe_products(x, w, scales, biases, indices, *, group_size, bits, absolute=False):
    """out[m] = T(scale * q + bias)[e_m] @ x[m] in float64 (T = x's dtype); with
    ``absolute``, the same over |terms| (the magnitude of each sum)."""
    xf, ids, wn = f64(x), np.array(indices).astype(np.int64), np.array(w)
    s, b = f64(scales), f64(biases)
    out = np.full((xf.shape[0], wn.shape[1]), np.nan)
    for e in np.unique(ids):
        if 0 <= e < wn.shape[0]:
            wd = (_moe_unpack(wn[e], bits) * np.repeat(s[e], group_size, axis=-1)
                  + np.repeat(b[e], group_size, axis=-1))
            rows = ids == e
            wt = _moe_round(wd, x.dtype)
            out[rows] = np.abs(xf[rows]) @ np.abs(wt).T if absolute else xf[rows] @ wt.T
    return out


def _moe_oracle(x, w, scales, biases, indices, *, group_size, bits):
    return _moe_products(x, w, scales, biases, indices, group_size=group_size, bits=bits)


def _moe_magnitude(x, w, scales, biases, indices, *, group_size, bits):
    return _moe_products(x, w, scales, biases, indices, group_size=group_size, bits=bits,
                         absolute=True)


def _moe_native(x, w, scales, biases, indices, *, group_size, bits):
    # MLX's own call for sorted MoE rows (x as [M, 1, K]): per-pair matvecs unless every
    # expert has >= 4 rows on average, then its tiled kernel.
    out = mx.gather_qmm(x[:, None, :], w, scales, biases, rhs_indices=indices, transpose=True,
                        group_size=group_size, bits=bits, sorted_indices=True)
    return out.reshape(x.shape[0], w.shape[1])


def _moe_routing(tokens: int, n_experts: int, top_k: int, seed: int) -> np.ndarray:
    """Sorted expert ids of ``tokens`` tokens, each routed to ``top_k`` distinct experts."""
    rng = np.random.default_rng(seed)
    ids = [rng.choice(n_experts, size=top_k, replace=False) for _ in range(tokens)]
    return np.sort(np.concatenate(ids)).astype(np.uint32)


def _moe_gather_qmm_cases():
    import itertools
    from functools import partial

    E, top_k, group_size = 128, 8, 64
    for n, k in ((768, 2048), (2048, 768)):
        for rows in (8, 32, 128, 1024):
            for bits, dtype in itertools.product((4, 8), (mx.bfloat16, mx.float32)):
                if dtype == mx.float32 and not (bits == 4 and n == 768 and rows in (8, 128)):
                    continue  # float32: a few cases (MLX's CPU gather_qmm is exact only there)
                ids = _moe_routing(rows // top_k, E, top_k, seed=rows * 7 + n)

                def make(rng, n=n, k=k, bits=bits, ids=ids, dtype=dtype):
                    # Positive data: no cancellation, so the relative check of the suite holds.
                    m = ids.shape[0]
                    words = rng.integers(0, 2**32, size=(E, n, k * bits // 32), dtype=np.uint64)
                    shape = (E, n, k // group_size)
                    return dict(
                        x=mx.array(rng.uniform(0.5, 1.0, (m, k)).astype(np.float32)).astype(dtype),
                        w=mx.array(words.astype(np.uint32)),
                        scales=mx.array(rng.uniform(0.5, 1.0, shape).astype(np.float32)
                                        / (1 << bits)).astype(dtype),
                        biases=mx.array(rng.uniform(0.0, 0.5, shape).astype(np.float32)).astype(dtype),
                        indices=mx.array(ids))

                touched = len(np.unique(ids))
                w_bytes = touched * n * (k * bits // 8 + 2 * (k // group_size) * dtype.size)
                nbytes = rows * k * dtype.size + w_bytes + rows * 4 + rows * n * dtype.size
                kw = dict(group_size=group_size, bits=bits)
                _CASES.append(BenchCase(
                    op="moe_gather_qmm", label=f"M{rows}-N{n}-K{k}-E{E}-b{bits}", dtype=dtype,
                    make=make, ours=partial(mt.moe_gather_qmm, **kw),
                    native=partial(_moe_native, **kw), oracle=partial(_moe_oracle, **kw),
                    magnitude=partial(_moe_magnitude, **kw),
                    nbytes=nbytes, flops=2 * rows * n * k,
                    quick=rows in (8, 128) and n == 768 and bits == 4 and dtype == mx.bfloat16))


_moe_gather_qmm_cases()


# ---- expert_qmv ------------------------------------------------------------------------

def _expert_qmv_ours(x, w, scales, biases, indices, host_ids, group_size, bits):
    return mt.expert_qmv(x, w, scales, biases, indices, group_size=group_size, bits=bits)


def _expert_qmv_native(x, w, scales, biases, indices, host_ids, group_size, bits):
    # What mlx-lm's SwitchLinear does: gather_qmm over device-resident ids.
    xq = x[..., None, None, :] if x.ndim == indices.ndim else x[..., None, :]
    y = mx.gather_qmm(xq, w, scales, biases, rhs_indices=indices, transpose=True,
                      group_size=group_size, bits=bits)
    return mx.squeeze(y, axis=-2)


def _expert_qmv_host_loop(x, w, scales, biases, indices, host_ids, group_size, bits):
    """One mx.quantized_matmul per (token, expert), with the ids already on the host."""
    shared = x.ndim == indices.ndim
    rows = []
    for t, token_ids in enumerate(host_ids):
        for j, e in enumerate(token_ids):
            xt = x[t] if shared else x[t, j]
            rows.append(mx.quantized_matmul(xt, w[e], scales[e], biases[e], transpose=True,
                                            group_size=group_size, bits=bits))
    return mx.stack(rows).reshape(*indices.shape, -1)


_ORACLE_MEMO: dict = {}


def _expert_qmv_exact(x, w, scales, biases, indices, host_ids, group_size, bits):
    """(sum_k x W, sum_k |x W|) in float64, dequantizing the selected experts in row blocks."""
    key = (id(x), id(w), id(indices))
    hit = _ORACLE_MEMO.get("key")
    if hit is not None and hit[0] == key:
        return hit[2]
    shifts = np.arange(32 // bits, dtype=np.uint64) * bits
    xs = f64(x)
    if xs.ndim == indices.ndim:
        xs = xs[..., None, :]
    n_out, n_in = w.shape[1], xs.shape[-1]
    want = np.zeros((*indices.shape, n_out))
    mag = np.zeros_like(want)
    s_all, b_all = scales, biases
    for t, token_ids in enumerate(host_ids):
        for j, e in enumerate(token_ids):
            xv = xs[t, 0 if xs.shape[1] == 1 else j]
            words = np.array(w[e]).astype(np.uint64)
            s = f64(s_all[e])
            b = f64(b_all[e])
            for r in range(0, n_out, 1024):
                q = (words[r:r + 1024, :, None] >> shifts) & np.uint64((1 << bits) - 1)
                q = q.reshape(q.shape[0], n_in).astype(np.float64)
                wd = (np.repeat(s[r:r + 1024], group_size, axis=-1) * q
                      + np.repeat(b[r:r + 1024], group_size, axis=-1))
                want[t, j, r:r + 1024] = wd @ xv
                mag[t, j, r:r + 1024] = np.abs(wd) @ np.abs(xv)
    _ORACLE_MEMO["key"] = (key, (x, w, indices), (want, mag))  # arrays kept: ids stay unique
    return want, mag


def _expert_qmv_oracle(**inputs):
    return _expert_qmv_exact(**inputs)[0]


def _expert_qmv_magnitude(**inputs):
    return _expert_qmv_exact(**inputs)[1]


# Decode shapes (one token): (model, E, k, K, N, x shared by the k experts?)
EXPERT_QMV_SHAPES = (
    ("qwen3moe-up", 128, 8, 2048, 768, True),  # Qwen3-30B-A3B gate/up projection
    ("qwen3moe-down", 128, 8, 768, 2048, False),
    ("qwen3next-up", 512, 10, 2048, 512, True),  # Qwen3-Next-80B-A3B
    ("qwen3next-down", 512, 10, 512, 2048, False),
    ("mixtral-up", 8, 2, 4096, 14336, True),  # Mixtral-8x7B
    ("mixtral-down", 8, 2, 14336, 4096, False),
)


def _expert_qmv_cases():
    group_size = 64
    for label, n_experts, k, n_in, n_out, shared in EXPERT_QMV_SHAPES:
        for bits in (4, 8):
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                # 8-bit and float32 on one shape only
                if (bits == 8 and dtype != mx.bfloat16) or (dtype == mx.float32 and bits != 4):
                    continue
                if (bits == 8 or dtype == mx.float32) and label != "qwen3moe-up":
                    continue

                def make(rng, e=n_experts, k=k, n_in=n_in, n_out=n_out, shared=shared,
                         bits=bits, dtype=dtype):
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

                pairs, ds = k, dtype.size
                nbytes = (pairs * n_out * (n_in * bits // 8 + 2 * (n_in // group_size) * ds)
                          + (1 if shared else k) * n_in * ds + pairs * n_out * ds)
                _CASES.append(BenchCase(
                    op="expert_qmv", label=f"{label}-E{n_experts}k{k}-{bits}b", dtype=dtype,
                    make=make, ours=_expert_qmv_ours, native=_expert_qmv_native,
                    oracle=_expert_qmv_oracle, magnitude=_expert_qmv_magnitude, nbytes=nbytes,
                    flops=2 * pairs * n_out * n_in,
                    quick=label == "qwen3moe-up" and bits == 4 and dtype == mx.bfloat16))


_expert_qmv_cases()

# ---- sdpa_multi -----------------------------------------------------------------------

def sdpa_multi_terms(q, k, v, scale, causal, kv_len):
    """float64 (out, magnitude, p_magnitude): the softmax attention of the definition;
    sum_j p_j (1 + |scale| sum_d |q_d k_jd|) |v_j| (float32 error of a score grows with the
    magnitude of its dot product, and each p_j carries it into the output); sum_j p_j |v_j|.
    Query head h = kvh * G + g reads KV head kvh (einsum over the groups: no repeated K/V)."""
    q, k, v = f64(q), f64(k), f64(v)
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, L, D)
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


def _sdpa_multi_oracle(q, k, v, scale, causal, kv_len):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len)[0]


def _sdpa_multi_magnitude(q, k, v, scale, causal, kv_len):
    return sdpa_multi_terms(q, k, v, scale, causal, kv_len)[1]


def _sdpa_multi_native(q, k, v, scale, causal, kv_len):
    return mx.fast.scaled_dot_product_attention(
        q, k[:, :, :kv_len], v[:, :, :kv_len], scale=scale, mask="causal" if causal else None)


def _sdpa_multi_cases():
    # Decode (L=1) and verify/denoise blocks against a preallocated cache (256 rows of slack,
    # as a step-allocated KV cache), Llama-style D=128 with GQA 32/8 and 32/4.
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
                        _CASES.append(BenchCase(
                            op="sdpa_multi",
                            label=f"h{Hq}/{Hkv}-L{L}-kv{kv_len // 1024}k"
                                  + ("" if causal else "-full"),
                            dtype=dtype, make=make, ours=mt.sdpa_multi,
                            native=_sdpa_multi_native, oracle=_sdpa_multi_oracle,
                            magnitude=_sdpa_multi_magnitude,
                            nbytes=(2 * B * Hq * L * D + 2 * B * Hkv * kv_len * D) * dtype.size,
                            flops=4 * B * Hq * visible * D,
                            quick=(dtype == mx.float16 and Hkv == 8 and kv_len == 4096
                                   and L in (1, 8))))


_sdpa_multi_cases()



def cases(op: str | None = None, quick: bool = False) -> list[BenchCase]:
    return [c for c in _CASES if (op is None or c.op == op) and (c.quick or not quick)]
