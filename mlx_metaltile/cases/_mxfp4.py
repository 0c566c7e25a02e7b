"""gpt-oss-20b's mxfp4 experts (biases None, E8M0 scales), shared by the mxfp4 benchmark
cases of expert_qmv and moe_gather_qmm: their inputs, routing and float64 oracle.

The cases' inputs are x, w, scales, indices (no biases, no host ids); ``ours`` carries mode,
group_size and bits as keywords, which a suite's reference provider passes on.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ._base import f64
from .fp4_qmm import e2m1_value

GPT_OSS_20B = dict(E=32, top_k=4, n=2880, k=2880)  # experts, router top-k, N = K = hidden


def _dequant_mxfp4(w, scales) -> np.ndarray:
    """float64 [N, K] from one expert's words (code j at bits [4j, 4j + 4)) and E8M0 scales."""
    b = np.ascontiguousarray(np.array(w), dtype="<u4").view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    s = 2.0 ** (np.array(scales).astype(np.float64) - 127)
    return e2m1_value(codes) * np.repeat(s, 32, axis=-1)


def _round_to(values: np.ndarray, dtype) -> np.ndarray:
    return f64(mx.array(values.astype(np.float32)).astype(dtype))  # exact in float32


def product_terms(x, w, scales, indices, *, rounded):
    """(products, magnitudes): each (row, id) of x against its expert's weights in float64,
    and the sums of |terms| behind them (NaN for a bad id); ``rounded``: each weight rounded
    to x's dtype first (moe_gather_qmm's contract)."""
    xs, ids = f64(x), np.array(indices).astype(np.int64)
    if xs.ndim == ids.ndim:  # expert_qmv, one activation per token: [T, K] -> [T, 1, K]
        xs = xs[..., None, :]
    xs = np.broadcast_to(xs, (*ids.shape, xs.shape[-1]))
    out = np.full((*ids.shape, w.shape[1]), np.nan)
    mag = out.copy()
    for e in np.unique(ids):
        wd = _dequant_mxfp4(w[int(e)], scales[int(e)])
        if rounded:
            wd = _round_to(wd, x.dtype)
        at = ids == e
        out[at] = xs[at] @ wd.T
        mag[at] = np.abs(xs[at]) @ np.abs(wd).T
    return out, mag


def routing(tokens: int, n_experts: int, top_k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_experts, size=top_k, replace=False) for _ in range(tokens)])


def make(rng, *, rows_x, ids, dtype, E, n, k):
    w = rng.integers(0, 2**32, size=(E, n, k // 8), dtype=np.uint32)
    s = rng.integers(121, 128, size=(E, n, k // 32)).astype(np.uint8)  # 2^-6 .. 1
    x = rng.uniform(0.5, 1.0, (*rows_x, k)).astype(np.float32)
    return dict(x=mx.array(x).astype(dtype), w=mx.array(w), scales=mx.array(s),
                indices=mx.array(ids.astype(np.uint32)))
