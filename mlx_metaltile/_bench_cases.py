"""Benchmark cases shared by ``python -m mlx_metaltile bench`` and the pytest-benchmark suites.

Each case builds fresh inputs, and names three callables over them: ours (the public op on
the selected backend), the native MLX composite it replaces, and a float64 NumPy oracle
written from the math. ``nbytes`` counts every input read once plus the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
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


def _gated_rms_norm_native(y, z, weight, eps=1e-5):
    # As mlx-lm's Qwen3-Next gated norm: fast rms_norm in the model dtype, then the gate.
    return mx.fast.rms_norm(y.astype(z.dtype), weight, eps) * (z * mx.sigmoid(z))


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
                    ours=mt.gated_rms_norm, native=_gated_rms_norm_native,
                    oracle=_gated_rms_norm_oracle, nbytes=nbytes, flops=8 * rows * n,
                    quick=quick and dtype == mx.float16))


_gated_rms_norm_cases()


# ---- sdpa_multi -----------------------------------------------------------------------

def _sdpa_multi_oracle(q, k, v, scale, causal, kv_len):
    q, k, v = f64(q), f64(k), f64(v)
    L, G = q.shape[2], q.shape[1] // k.shape[1]
    kk = np.repeat(k[:, :, :kv_len], G, axis=1)
    s = scale * (q @ kk.swapaxes(-1, -2))
    if causal:
        visible = np.arange(kv_len)[None, :] <= (kv_len - L + np.arange(L))[:, None]
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ np.repeat(v[:, :, :kv_len], G, axis=1)


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
                            nbytes=(2 * B * Hq * L * D + 2 * B * Hkv * kv_len * D) * dtype.size,
                            flops=4 * B * Hq * visible * D,
                            quick=(dtype == mx.float16 and Hkv == 8 and kv_len == 4096
                                   and L in (1, 8))))


_sdpa_multi_cases()


def cases(op: str | None = None, quick: bool = False) -> list[BenchCase]:
    return [c for c in _CASES if (op is None or c.op == op) and (c.quick or not quick)]
