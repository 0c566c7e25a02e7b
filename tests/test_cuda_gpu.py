"""The compatibility header's features executed on an NVIDIA GPU, against NumPy.

Runs only where MLX's CUDA backend is available (marker ``cuda``). Inputs are small
multiples of 1/4 wherever sums are checked, so every dtype's results are exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cuda_features import ATOMIC_OUT, EDGE, HEADER, MATRIX, SCALARS, SIMD, Feature
from tolerances import to_f64

from mlx_metaltile import cuda

pytestmark = pytest.mark.cuda

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
NP_OF = {"float32": np.float32, "float16": np.float16}


@pytest.fixture(autouse=True)
def _require_cuda():
    reason = cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def run(feature: Feature, template, inputs, grid, threadgroup, init_value=None, shapes=None):
    kernel = cuda.metal_kernel(f"mt_test_{feature.name}", [n for n, _, _ in feature.inputs],
                               [n for n, _ in feature.outputs], feature.source, feature.header,
                               atomic_outputs=feature.atomic_outputs)
    _, outs = feature.resolve(template)
    results = kernel(inputs=inputs, template=list(template) or None, grid=grid,
                     threadgroup=threadgroup, output_shapes=shapes or [(1,)] * len(outs),
                     output_dtypes=[d for _, d in outs], init_value=init_value)
    mx.eval(results)
    return {name: to_f64(r) for (name, _), r in zip(outs, results, strict=True)}


def quarters(rng, shape, lo=-8, hi=8):
    return (rng.integers(lo, hi, size=shape) / 4.0).astype(np.float32)


def as_dtype(values: np.ndarray, dtype: str) -> mx.array:
    return mx.array(values).astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_simd_functions(rng, dtype):
    n, active = 128, 5
    x = quarters(rng, (n,))
    got = run(SIMD, (("T", DTYPES[dtype]),), [as_dtype(x, dtype), mx.array(active, mx.uint32)],
              grid=(n, 1, 1), threadgroup=(64, 1, 1), shapes=[(n,)] * len(SIMD.outputs))
    for w in range(n // 32):
        v = x[32 * w: 32 * w + 32].astype(np.float64)
        lanes = np.arange(32)
        part = slice(32 * w, 32 * w + 32)
        want = {
            "sum": np.full(32, v.sum()), "mx": np.full(32, v.max()), "mn": np.full(32, v.min()),
            "incl": np.cumsum(v), "excl": np.cumsum(v) - v,
            "down": np.where(lanes + 3 < 32, v[np.minimum(lanes + 3, 31)], v),
            "up": np.where(lanes >= 2, v[np.maximum(lanes - 2, 0)], v),
            "xr": v[lanes ^ 5], "bc": np.full(32, v[7]), "shf": v[(lanes * 3) % 32],
            "qsum": np.repeat(v.reshape(8, 4).sum(1), 4), "qshf": v[lanes ^ 1],
            "partial": np.where(lanes < active, v[:active].sum(), -1.0),
            "first": np.where(lanes < active, v[0], -1.0),
            "ballot": np.full(32, float(sum(1 << i for i in range(32) if v[i] > 0))),
            "anyall": np.full(32, 2.0),
        }
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name][part], expected, err_msg=f"{name} warp {w}")


def _apple_layout():
    lanes = np.arange(32)
    qid = lanes // 4
    rows = (qid & 4) + (lanes // 2) % 4
    cols = (qid & 2) * 2 + (lanes % 2) * 2
    return rows, cols


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_simdgroup_matrix(rng, dtype):
    a, b = quarters(rng, (8, 8)), quarters(rng, (8, 8))
    c = quarters(rng, (8, 8), -40, 40)
    big = quarters(rng, (16, 16))
    got = run(MATRIX, (("T", DTYPES[dtype]),),
              [as_dtype(a, dtype), as_dtype(b, dtype), mx.array(c), as_dtype(big, dtype)],
              grid=(32, 1, 1), threadgroup=(32, 1, 1),
              shapes=[(8, 8)] * 4 + [(64,)])
    a64, b64, c64 = (m.astype(np.float64) for m in (a, b, c))
    np.testing.assert_array_equal(got["D"], a64 @ b64 + c64)
    np.testing.assert_array_equal(got["E"], a64.T @ b64)
    np.testing.assert_array_equal(got["F"], big[4:12, 8:16])
    np.testing.assert_array_equal(got["DT"], (a64 @ b64 + c64).T)
    rows, cols = _apple_layout()
    expected = np.stack([a[rows, cols], a[rows, cols + 1]], axis=1).reshape(-1)
    np.testing.assert_array_equal(got["L"], expected)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scalars_vectors_math(rng, dtype):
    n = 50
    x = np.concatenate([quarters(rng, (n - 2,)), [0.0, -3.5]]).astype(np.float32)
    got = run(SCALARS, (("T", DTYPES[dtype]),), [as_dtype(x, dtype), mx.array(n, mx.uint32)],
              grid=(64, 1, 1), threadgroup=(64, 1, 1), shapes=[(n, 12)])["out"]
    h = to_f64(as_dtype(x, dtype))  # exact in every dtype (quarters)
    f = (h * 2).astype(np.float32)
    v = np.stack([f * 0.5 + 2, h + 3, h + 4, np.full(n, 4.5)], 1).astype(np.float32)
    assert np.allclose(got[:, 0], f) and np.allclose(got[:, 1], 2 * h)
    np.testing.assert_allclose(got[:, 2], v.sum(1), rtol=1e-6)
    np.testing.assert_array_equal(got[:, 3], f)
    np.testing.assert_array_equal(got[:, 4], (h > 0).astype(np.float64))
    np.testing.assert_array_equal(got[:, 5], np.clip(f, -1, 1))
    ff = f.astype(np.float64)
    np.testing.assert_allclose(got[:, 6], np.exp(np.minimum(ff, 10)) + 1 / np.sqrt(np.abs(ff) + 1)
                               + np.exp(-np.abs(ff)), rtol=2e-6)
    np.testing.assert_array_equal(got[:, 7], f.astype(np.float16).view(np.uint16))
    vt = to_f64(as_dtype(v, dtype))
    np.testing.assert_array_equal(got[:, 8], vt[:, 0] + vt[:, 3])
    np.testing.assert_array_equal(got[:, 9], 3.0)
    np.testing.assert_array_equal(got[:, 10], h)
    np.testing.assert_array_equal(got[:, 11], to_f64(as_dtype(f, dtype)) + 1)


def test_atomic_outputs_on_an_overhanging_grid(rng):
    n = 1000  # 4 blocks of 256: the last one is partial, so the grid guard is in play
    x = rng.standard_normal(n).astype(np.float32)
    got = run(ATOMIC_OUT, (), [mx.array(x)], grid=(n, 1, 1), threadgroup=(256, 1, 1),
              init_value=0.0)
    np.testing.assert_allclose(got["total"], [x.astype(np.float64).sum()], rtol=1e-4, atol=1e-4)
    assert int(got["biggest"][0]) == int(np.abs(x).max().view(np.uint32))
    assert got["smallest"][0] == min(0.0, float(x.min()))


@pytest.mark.parametrize("n, tg", [(100, 64), (64, 64), (33, 32), (7, 32)])
def test_edge_threadgroups_are_partial_like_metal(rng, n, tg):
    x = quarters(rng, (n,))
    got = run(EDGE, (), [mx.array(x)], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
              shapes=[(n,)] * 4)
    starts = np.arange(n) // tg * tg
    size = np.minimum(tg, n - starts)
    np.testing.assert_array_equal(got["tptg"], size)
    np.testing.assert_array_equal(got["tpg"], n)
    np.testing.assert_array_equal(got["seen"], size)
    sums = np.array([x[s: s + tg].astype(np.float64).sum() for s in starts])
    np.testing.assert_array_equal(got["gsum"], sums)


@pytest.mark.parametrize("template, width, factor", [
    (HEADER.templates[0], 32, 4.0), (HEADER.templates[1], 64, 1.0)])
def test_header_helpers_and_template_constants(rng, template, width, factor):
    dtype = str(dict(template)["T"]).rsplit(".", 1)[-1]
    x = quarters(rng, (width,))
    got = run(HEADER, template, [as_dtype(x, dtype)], grid=(width, 1, 1),
              threadgroup=(width, 1, 1), shapes=[(width,)])["out"]
    np.testing.assert_array_equal(got, factor * x.astype(np.float64).sum() + 1.0)
