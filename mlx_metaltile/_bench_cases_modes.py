"""Benchmark cases of the fp4 quantization modes: gpt-oss-20b's mxfp4 experts in expert_qmv
and moe_gather_qmm against MLX's ``mx.gather_qmm(mode="mxfp4")``.

``mxfp4_cases()`` returns the BenchCase records (not yet registered in the shared list).
Their inputs are x, w, scales, indices (no biases, no host ids); ``ours`` carries mode,
group_size and bits as keywords, which a suite's reference provider passes on.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

import mlx_metaltile as mt

from ._bench_cases import BenchCase, f64

GPT_OSS_20B = dict(E=32, top_k=4, n=2880, k=2880)  # experts, router top-k, N = K = hidden
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _dequant_mxfp4(w, scales) -> np.ndarray:
    """float64 [N, K] from one expert's words (code j at bits [4j, 4j + 4)) and E8M0 scales."""
    b = np.ascontiguousarray(np.array(w), dtype="<u4").view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    s = 2.0 ** (np.array(scales).astype(np.float64) - 127)
    return _E2M1[codes] * np.repeat(s, 32, axis=-1)


def _round_to(values: np.ndarray, dtype) -> np.ndarray:
    return f64(mx.array(values.astype(np.float32)).astype(dtype))  # exact in float32


def _products(x, w, scales, indices, *, rounded, absolute):
    """Each (row, id) of x against its expert's weights in float64 (NaN for a bad id);
    ``rounded``: each weight rounded to x's dtype first (moe_gather_qmm's contract)."""
    xs, ids = f64(x), np.array(indices).astype(np.int64)
    if xs.ndim == ids.ndim:  # expert_qmv, one activation per token: [T, K] -> [T, 1, K]
        xs = xs[..., None, :]
    xs = np.broadcast_to(xs, (*ids.shape, xs.shape[-1]))
    out = np.full((*ids.shape, w.shape[1]), np.nan)
    for e in np.unique(ids):
        wd = _dequant_mxfp4(w[int(e)], scales[int(e)])
        if rounded:
            wd = _round_to(wd, x.dtype)
        at = ids == e
        out[at] = np.abs(xs[at]) @ np.abs(wd).T if absolute else xs[at] @ wd.T
    return out


def _routing(tokens: int, n_experts: int, top_k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_experts, size=top_k, replace=False) for _ in range(tokens)])


def _make(rng, *, rows_x, ids, dtype, E, n, k):
    w = rng.integers(0, 2**32, size=(E, n, k // 8), dtype=np.uint32)
    s = rng.integers(121, 128, size=(E, n, k // 32)).astype(np.uint8)  # 2^-6 .. 1
    x = rng.uniform(0.5, 1.0, (*rows_x, k)).astype(np.float32)
    return dict(x=mx.array(x).astype(dtype), w=mx.array(w), scales=mx.array(s),
                indices=mx.array(ids.astype(np.uint32)))


def _qmv_native(x, w, scales, indices):
    y = mx.gather_qmm(x[..., None, None, :], w, scales, None, rhs_indices=indices,
                      transpose=True, mode="mxfp4")  # what mlx-lm's QuantizedSwitchLinear runs
    return mx.squeeze(y, axis=-2)


def _gqmm_native(x, w, scales, indices):
    y = mx.gather_qmm(x[:, None, :], w, scales, None, rhs_indices=indices, transpose=True,
                      mode="mxfp4", sorted_indices=True)
    return y.reshape(x.shape[0], w.shape[1])


def mxfp4_cases(dtype=mx.bfloat16) -> list[BenchCase]:
    E, top_k, n, k = (GPT_OSS_20B[key] for key in ("E", "top_k", "n", "k"))
    cases = []
    # expert_qmv: decode, 1 and 4 tokens, each routed to top_k experts.
    for tokens in (1, 4):
        ids = _routing(tokens, E, top_k, seed=tokens)
        touched = len(np.unique(ids))
        nbytes = (tokens * k * dtype.size + touched * n * (k // 2 + k // 32)
                  + ids.size * 4 + ids.size * n * dtype.size)
        cases.append(BenchCase(
            op="expert_qmv", label=f"gpt-oss-20b-mxfp4-T{tokens}-k{top_k}-N{n}-K{k}-E{E}",
            dtype=dtype, make=partial(_make, rows_x=(tokens,), ids=ids, dtype=dtype, E=E, n=n,
                                      k=k),
            ours=partial(mt.expert_qmv, biases=None, mode="mxfp4", group_size=32, bits=4), native=_qmv_native,
            oracle=partial(_products, rounded=False, absolute=False),
            magnitude=partial(_products, rounded=False, absolute=True),
            nbytes=nbytes, flops=2 * ids.size * n * k, quick=tokens == 1))
    # moe_gather_qmm: expert-sorted rows of tokens x top_k (verification blocks, prefill).
    for rows in (8, 32, 128):
        ids = np.sort(_routing(rows // top_k, E, top_k, seed=rows).reshape(-1))
        touched = len(np.unique(ids))
        nbytes = (rows * k * dtype.size + touched * n * (k // 2 + k // 32) + rows * 4
                  + rows * n * dtype.size)
        cases.append(BenchCase(
            op="moe_gather_qmm", label=f"gpt-oss-20b-mxfp4-M{rows}-N{n}-K{k}-E{E}",
            dtype=dtype, make=partial(_make, rows_x=(rows,), ids=ids, dtype=dtype, E=E, n=n,
                                      k=k),
            ours=partial(mt.moe_gather_qmm, biases=None, mode="mxfp4", group_size=32,
                         bits=4), native=_gqmm_native,
            oracle=partial(_products, rounded=True, absolute=False),
            magnitude=partial(_products, rounded=True, absolute=True),
            nbytes=nbytes, flops=2 * rows * n * k, quick=rows == 32))
    return cases
