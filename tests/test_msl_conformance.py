"""One MSL conformance suite, run on every executor available, against NumPy.

Executors: ``emulator`` (always in CI), ``cuda`` (MLX's CUDA backend; marker ``cuda``),
``metal`` (``mx.fast.metal_kernel`` itself; marker ``metal``); an absent one skips with its
reason. A feature either works on every executor or is refused by every executor in its
``refused_by`` with one message; a misuse of the kernel object reads the same (MLX's
message) everywhere. Inputs are small multiples of 1/4 wherever sums are checked, so every
dtype's results are exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from msl_features import (
    ATOMIC_OUT,
    CONVERGED,
    EDGE,
    FEATURES,
    HEADER,
    MATRIX,
    MMA,
    PACKED,
    PRODUCT_HELPERS,
    RECONVERGE,
    ROUND2,
    SCALARS,
    SIMD,
    SWIZZLES,
    Feature,
)
from tolerances import TOLERANCES, assert_close, to_f64

from mlx_metaltile import cuda, emulator

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _metal_unavailable() -> str | None:
    metal = getattr(mx, "metal", None)
    return None if metal is not None and metal.is_available() else "no Metal device"


# executor -> (its metal_kernel, why it cannot run here or None)
EXECUTORS = {
    "emulator": (emulator.metal_kernel, emulator.unavailable_reason),
    "cuda": (cuda.metal_kernel, cuda.unavailable_reason),
    "metal": (mx.fast.metal_kernel, _metal_unavailable),
}


@pytest.fixture(params=[pytest.param(name, id=name, marks=[getattr(pytest.mark, name)]
                                     if name != "emulator" else [])
                        for name in EXECUTORS])
def executor(request):
    reason = EXECUTORS[request.param][1]()
    if reason is not None:
        pytest.skip(f"{request.param} executor unavailable: {reason}")
    return request.param


def make(executor: str, feature: Feature):
    return EXECUTORS[executor][0](
        name=f"mt_test_{feature.name}", input_names=[n for n, _, _ in feature.inputs],
        output_names=[n for n, _ in feature.outputs], source=feature.source,
        header=feature.header, atomic_outputs=feature.atomic_outputs)


def run(executor: str, feature: Feature, template, inputs, grid, threadgroup, init_value=None,
        shapes=None):
    kernel = make(executor, feature)
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
def test_simd_functions(executor, rng, dtype):
    n, active = 128, 5
    x = quarters(rng, (n,))
    got = run(executor, SIMD, (("T", DTYPES[dtype]),), [as_dtype(x, dtype), mx.array(active, mx.uint32)],
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
            "anyall": np.full(32, 2.0),
        }
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name][part], expected, err_msg=f"{name} warp {w}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_converged_helpers(executor, rng, dtype):
    """common.h's converged helpers on full SIMD-groups (the CUDA layer's constant-mask
    versions on cuda, the checking ones on the emulator)."""
    n = 128
    x = quarters(rng, (n,))
    got = run(executor, CONVERGED, (("T", DTYPES[dtype]),), [as_dtype(x, dtype)],
              grid=(n, 1, 1), threadgroup=(64, 1, 1), shapes=[(n,)] * len(CONVERGED.outputs))
    lanes = np.arange(32)
    for w in range(n // 32):
        part = slice(32 * w, 32 * w + 32)
        v = x[part].astype(np.float64)
        want = {"sum": np.full(32, v.sum()), "mx": np.full(32, v.max()), "mn": np.full(32, v.min()),
                "shf": v[(lanes * 5 + 3) % 32], "xr": v[lanes ^ 5],
                "bits": (32 * w + 31 - lanes) * 7}
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name][part], expected, err_msg=f"{name} warp {w}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_simd_ballot_after_divergence(executor, rng, dtype):
    n, active = 128, 5
    x = quarters(rng, (n,))
    got = run(executor, SIMD, (("T", DTYPES[dtype]),),
              [as_dtype(x, dtype), mx.array(active, mx.uint32)],
              grid=(n, 1, 1), threadgroup=(64, 1, 1), shapes=[(n,)] * len(SIMD.outputs))
    for w in range(n // 32):
        v = x[32 * w: 32 * w + 32]
        want = np.full(32, float(sum(1 << i for i in range(32) if v[i] > 0)))
        np.testing.assert_array_equal(got["ballot"][32 * w: 32 * w + 32], want,
                                      err_msg=f"warp {w}")


@pytest.mark.parametrize("active", [5, 27])
def test_simd_functions_and_barriers_after_divergence(executor, rng, active):
    """After an if-block some lanes took, every lane meets at the next SIMD-group function,
    whichever lanes took it and whichever function follows (a helper's included)."""
    n = 64
    x = quarters(rng, (n,))
    got = run(executor, RECONVERGE, (), [mx.array(x), mx.array(active, mx.uint32)],
              grid=(n, 1, 1), threadgroup=(n, 1, 1), shapes=[(n,)] * len(RECONVERGE.outputs))
    lanes = np.arange(32)
    for w in range(n // 32):
        part = slice(32 * w, 32 * w + 32)
        v = x[part].astype(np.float64)
        low, high = v[:active].sum(), v[active:].sum()
        want = {
            "sum": np.full(32, v.sum()), "incl": np.cumsum(v), "excl": np.cumsum(v) - v,
            "down": np.where(lanes + 1 < 32, v[np.minimum(lanes + 1, 31)], v),
            "bc": np.full(32, v[31]), "mx": np.full(32, v.max()),
            "qsum": np.repeat(v.reshape(8, 4).sum(1), 4), "helper": np.full(32, v.sum()),
            "nb": x[(np.arange(n) + 1) % n][part],
            "inside": np.where(lanes < active, 5 * low, 4 * high),
        }
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name][part], expected, err_msg=f"{name} warp {w}")


def _fragment_layout(executor: str):
    """(row, first column) of each lane's thread_elements(): MSL leaves the layout to the
    implementation; Metal's (and so the emulator's) is Apple's, the CUDA layer's mma.sync's."""
    lanes = np.arange(32)
    if executor == "cuda":
        return lanes // 4, (lanes % 4) * 2
    qid = lanes // 4
    rows = (qid & 4) + (lanes // 2) % 4
    cols = (qid & 2) * 2 + (lanes % 2) * 2
    return rows, cols


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_simdgroup_matrix(executor, rng, dtype):
    a, b = quarters(rng, (8, 8)), quarters(rng, (8, 8))
    c = quarters(rng, (8, 8), -40, 40)
    big = quarters(rng, (16, 16))
    got = run(executor, MATRIX, (("T", DTYPES[dtype]),),
              [as_dtype(a, dtype), as_dtype(b, dtype), mx.array(c), as_dtype(big, dtype)],
              grid=(32, 1, 1), threadgroup=(32, 1, 1),
              shapes=[(8, 8)] * 4 + [(8, 9), (64,)] + [(32,)] * 3)
    a64, b64, c64 = (m.astype(np.float64) for m in (a, b, c))
    np.testing.assert_array_equal(got["D"], a64 @ b64 + c64)
    np.testing.assert_array_equal(got["E"], a64.T @ b64)
    np.testing.assert_array_equal(got["F"], big[4:12, 8:16])
    np.testing.assert_array_equal(got["DT"], (a64 @ b64 + c64).T)
    np.testing.assert_array_equal(got["G"][:, 1:], big[5:13, 3:11])
    rows, cols = _fragment_layout(executor)
    expected = np.stack([a[rows, cols], a[rows, cols + 1]], axis=1).reshape(-1)
    np.testing.assert_array_equal(got["L"], expected)
    # common.h's helpers name the executor's layout, and its row mates.
    np.testing.assert_array_equal(got["R"], rows)
    np.testing.assert_array_equal(got["CC"], cols)
    xor0, xor1 = int(got["X"][0]) & 0xFF, int(got["X"][0]) >> 8
    lanes = np.arange(32)
    for mask in (xor0, xor1):
        np.testing.assert_array_equal(rows[lanes ^ mask], rows)
    mates = {frozenset(lanes[rows == r]) for r in range(8)}
    assert mates == {frozenset({la, la ^ xor0, la ^ xor1, la ^ xor0 ^ xor1}) for la in lanes}
    # The xor tree over XOR0 then XOR1 adds column pairs (0 + 1) + (2 + 3).
    np.testing.assert_array_equal(cols[lanes ^ xor0] // 4, cols // 4)


def _values(rng, kind: str, dtype: str, shape) -> np.ndarray:
    """Test inputs (float64, exact in ``dtype``): small quarters (every sum exact in float32)
    or full significands of ``dtype`` (float32 accumulation error)."""
    if kind == "quarters":
        return quarters(rng, shape).astype(np.float64)
    return to_f64(as_dtype(rng.standard_normal(shape).astype(np.float32), dtype))


def _accumulator(rng, kind: str) -> np.ndarray:
    """C of a product test: quarters (sums exact in float32) or float32 normals."""
    if kind == "quarters":
        return quarters(rng, (16, 16), -40, 40)
    return rng.standard_normal((16, 16)).astype(np.float32)


def _expect(got, kind, name, want, out_dtype, magnitude):
    """Exact for quarters, else within the tolerance table with float32 accumulation."""
    if kind == "quarters":
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    else:
        assert_close(got[name], want, out_dtype, magnitude, what=name)


# half and bfloat products run on tensor cores on CUDA (sm_80+), float ones on FMAs.
@pytest.mark.parametrize("kind", ["quarters", "wide"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_simdgroup_products(executor, rng, dtype, kind):
    a = _values(rng, kind, dtype, (16, 16))
    b = _values(rng, kind, dtype, (16, 16))
    c = _accumulator(rng, kind)
    got = run(executor, MMA, (("T", DTYPES[dtype]),),
              [as_dtype(a, dtype), as_dtype(b, dtype), mx.array(c)],
              grid=(32, 1, 1), threadgroup=(32, 1, 1), init_value=float("nan"),
              shapes=[(16, 16), (16, 16), (64,), (64,), (8, 8)])

    def rounded(x):  # x rounded to dtype (float64 -> float32 -> dtype)
        return to_f64(as_dtype(x.astype(np.float32), dtype))

    exact = kind == "quarters"
    c64 = c.astype(np.float64)
    mag = np.abs(a) @ np.abs(b)

    def expect(name, want, out_dtype, magnitude):
        _expect(got, kind, name, want, out_dtype, magnitude)

    expect("P", a @ b + c64, "float32", mag + np.abs(c64))
    # Q: two products into a T accumulator, rounded to T after each.
    s1 = a[:, :8] @ b[:8, :]
    r1 = rounded(s1)
    q = rounded(a[:, 8:] @ b[8:, :] + r1)
    if exact:
        np.testing.assert_array_equal(got["Q"], q, err_msg="Q")
    else:  # a float32 sum may round s1 to r1's neighbour: one more unit of r1 in the bound
        tol = TOLERANCES[dtype]
        bound = tol.atol + tol.rtol * (np.abs(q) + np.abs(s1)) + tol.accum * (mag + np.abs(r1))
        err = np.abs(got["Q"] - q)
        assert (err <= bound).all(), f"Q: max err {err.max():.3g}, {int((err > bound).sum())} out"
    rows, cols = _fragment_layout(executor)
    e = a[:8, :8] @ b[:8, :8]
    e_mag = np.abs(a[:8, :8]) @ np.abs(b[:8, :8])

    def lanes(m):  # thread_elements() of every lane: (row, col), (row, col + 1)
        return np.stack([m[rows, cols], m[rows, cols + 1]], axis=1).reshape(-1)

    expect("L", lanes(e), "float32", lanes(e_mag))
    expect("LT", lanes(rounded(e)), dtype, lanes(e_mag))
    marks = np.zeros((8, 8))
    lane3 = np.arange(32) % 3 == 0
    marks[rows[lane3], cols[lane3] + 1] = 1.0
    expect("F", (3 * e + marks).T, "float32", (3 * e_mag + marks).T)


# mt_sg_bmatrix / mt_sg_load_b / mt_mma_pair (common.h): on CUDA a half or bfloat B in the
# tensor cores' layout and a pair as one 16-row product; the same sums everywhere.
@pytest.mark.parametrize("kind", ["quarters", "wide"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_product_helpers(executor, rng, dtype, kind):
    a = _values(rng, kind, dtype, (16, 8))
    b = _values(rng, kind, dtype, (8, 16))
    c = _accumulator(rng, kind)
    w = _values(rng, kind, dtype, (8, 32))
    got = run(executor, PRODUCT_HELPERS, (("T", DTYPES[dtype]),),
              [as_dtype(a, dtype), as_dtype(b, dtype), mx.array(c), as_dtype(w, dtype)],
              grid=(32, 1, 1), threadgroup=(32, 1, 1), init_value=float("nan"),
              shapes=[(16, 16), (16, 16), (8, 16), (16, 16)] + [(8, 32)] * 4)
    blocks_t = np.concatenate([w[:, 8 * m:8 * m + 8].T for m in range(4)], axis=1)
    for name, want in (("WA", w), ("WAT", blocks_t), ("WB", w), ("WBT", blocks_t)):
        np.testing.assert_array_equal(got[name], want, err_msg=name)  # moved, not summed
    c64 = c.astype(np.float64)
    ab, mag = a @ b, np.abs(a) @ np.abs(b)
    q = to_f64(as_dtype((ab).astype(np.float32), dtype))  # A B rounded once to T
    for name, want, out_dtype, magnitude in (
            ("P", ab + c64, "float32", mag + np.abs(c64)), ("Q", q, dtype, mag),
            ("E", ab[:8], "float32", mag[:8]), ("R", ab, "float32", mag)):
        _expect(got, kind, name, want, out_dtype, magnitude)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scalars_vectors_math(executor, rng, dtype):
    n = 50
    x = np.concatenate([quarters(rng, (n - 2,)), [0.0, -3.5]]).astype(np.float32)
    got = run(executor, SCALARS, (("T", DTYPES[dtype]),), [as_dtype(x, dtype), mx.array(n, mx.uint32)],
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


def rounded_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to nearest even in ``dtype`` (NaN stays NaN), as float64."""
    if dtype == "float32":
        return values.astype(np.float64)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(values), np.nan, out)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round2_rounds_pairs_as_scalars(executor, rng, dtype):
    """mt_round2 against NumPy's round to nearest even and the scalar conversion: ties of
    bfloat16 and float16 both ways, values past float16's range, float16 subnormals, signed
    zeros, infinities, NaN, and random values."""
    one = np.float32(1.0).view(np.uint32)
    ties = [one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001, one | 0x80000000 | 0x8000]
    special = np.array(ties, dtype=np.uint32).view(np.float32)
    half_ties = np.float32(1.0) + np.float32(2.0**-11) * np.array([1, 3, -1, -3], np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 70000.0, -1e6,
                      3e-6, -6e-8, 1e-8, 3.4e38, np.float32(2.0**-126)], np.float32)
    x = np.concatenate([special, half_ties, edges,
                        rng.standard_normal(64).astype(np.float32) * 100]).astype(np.float32)
    if x.size % 2:
        x = np.append(x, np.float32(0.5))
    n = x.size // 2
    got = run(executor, ROUND2, (("T", DTYPES[dtype]),), [mx.array(x), mx.array(n, mx.uint32)],
              grid=(64, 1, 1), threadgroup=(64, 1, 1), shapes=[(x.size,), (x.size,)])
    want = rounded_to(x, dtype)
    np.testing.assert_array_equal(got["pair"], want)
    np.testing.assert_array_equal(got["pair"], got["scalar"])
    assert (np.signbit(got["pair"]) == np.signbit(want)).all()


def test_atomic_outputs_on_an_overhanging_grid(executor, rng):
    n = 1000  # 4 blocks of 256: the last one is partial, so the grid guard is in play
    x = rng.standard_normal(n).astype(np.float32)
    got = run(executor, ATOMIC_OUT, (), [mx.array(x)], grid=(n, 1, 1), threadgroup=(256, 1, 1),
              init_value=0.0)
    np.testing.assert_allclose(got["total"], [x.astype(np.float64).sum()], rtol=1e-4, atol=1e-4)
    assert int(got["biggest"][0]) == int(np.abs(x).max().view(np.uint32))
    assert got["smallest"][0] == min(0.0, float(x.min()))


@pytest.mark.parametrize("n, tg", [(100, 64), (64, 64), (33, 32), (7, 32)])
def test_edge_threadgroups_are_partial_like_metal(executor, rng, n, tg):
    x = quarters(rng, (n,))
    got = run(executor, EDGE, (), [mx.array(x)], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
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
def test_header_helpers_and_template_constants(executor, rng, template, width, factor):
    dtype = str(dict(template)["T"]).rsplit(".", 1)[-1]
    x = quarters(rng, (width,))
    got = run(executor, HEADER, template, [as_dtype(x, dtype)], grid=(width, 1, 1),
              threadgroup=(width, 1, 1), shapes=[(width,)])["out"]
    np.testing.assert_array_equal(got, factor * x.astype(np.float64).sum() + 1.0)


def refused(executor: str, feature: Feature) -> bool:
    """Whether this executor refuses the feature (checking that it does, with the message)."""
    if executor not in feature.refused_by:
        return False
    with pytest.raises(ValueError) as info:
        make(executor, feature)
    assert str(info.value) == REFUSALS[executor, feature.name]
    return True


def test_swizzles(executor, rng):
    x = quarters(rng, (4 * 8,))
    if refused(executor, SWIZZLES):
        return
    got = run(executor, SWIZZLES, (), [mx.array(x)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
              shapes=[(4 * 8,)])["out"].reshape(8, 4)
    v = x.astype(np.float64).reshape(8, 4)
    want = np.stack([v[:, 0] + v[:, 3], v[:, 1] + v[:, 2], v[:, 2] + v[:, 1], v[:, 1]], 1)
    np.testing.assert_array_equal(got, want)


def test_packed_vectors(executor, rng):
    x = quarters(rng, (3 * 8,))
    if refused(executor, PACKED):
        return
    got = run(executor, PACKED, (), [mx.array(x)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
              shapes=[(8,)])["out"]
    v = x.astype(np.float64).reshape(8, 3)
    np.testing.assert_array_equal(got, v[:, 0] + 2 * v[:, 1] + 4 * v[:, 2] + 12)


# The one message of each refusal (executor, feature).
REFUSALS = {
    ("cuda", "swizzles"): "[metal_kernel] kernel 'mt_test_swizzles' uses vector swizzles "
                          "(such as .xy), which the cuda executor does not support.",
    ("cuda", "packed_vectors"): "[metal_kernel] kernel 'mt_test_packed_vectors' uses packed "
                                "vector types (such as packed_float3), which the cuda "
                                "executor does not support.",
}


@pytest.mark.parametrize("name", ["cuda"])
def test_refusals_need_no_device(name):
    """The refusals happen when the kernel is made, so they are checked on every machine."""
    for feature in FEATURES:
        if not refused(name, feature):
            make(name, feature)  # accepted


def test_every_feature_has_a_conformance_test():
    tested = (SIMD, CONVERGED, RECONVERGE, MATRIX, MMA, PRODUCT_HELPERS, SCALARS, ATOMIC_OUT, EDGE, HEADER,
              SWIZZLES, PACKED, ROUND2)
    assert sorted(f.name for f in FEATURES) == sorted(f.name for f in tested)


# ---- misuse: MLX's checks and messages, the same on every executor --------------------------

_BODY = "y[0] = x[0];"
_CALL = dict(inputs=[mx.zeros((4,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
             grid=(1, 1, 1), threadgroup=(1, 1, 1))
MISUSES = {
    "no_outputs": ({"output_names": []}, None, ValueError,
                   "[metal_kernel] Must specify at least one output."),
    "inputs": ({}, {"inputs": []}, ValueError,
               "[metal_kernel] Expected `inputs` to have size 1 but got size 0."),
    "output_shapes": ({}, {"output_shapes": [(1,), (2,)]}, ValueError,
                      "[metal_kernel] Expected `output_shapes` to have size 1 but got size 2."),
    "output_dtypes": ({}, {"output_dtypes": [mx.float32] * 2}, ValueError,
                      "[metal_kernel] Expected `output_dtypes` to have size 1 but got size 2."),
    "template": ({}, {"template": [("T", 1.5)]}, ValueError,
                 "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or "
                 "`bool`."),
    "threadgroup_size": ({}, {"threadgroup": (2048, 1, 1)}, ValueError,
                         "[metal_kernel] Thread group size (2048) is greater than the maximum "
                         "allowed threads per threadgroup (1024)."),
}


@pytest.mark.parametrize("case", list(MISUSES))
@pytest.mark.parametrize("name", list(EXECUTORS))
def test_misuse_reads_the_same_everywhere(name, case):
    """Checked before anything runs, so every executor answers here, MLX's own metal_kernel
    too wherever it checks before needing a Metal device."""
    make_kwargs, call_kwargs, error, message = MISUSES[case]
    kwargs = dict(name="k", input_names=["x"], output_names=["y"], source=_BODY)
    with pytest.raises((error, RuntimeError)) as info:
        kernel = EXECUTORS[name][0](**{**kwargs, **make_kwargs})
        kernel(**{**_CALL, **(call_kwargs or {})})
    if name == "metal" and "No Metal back-end" in str(info.value):
        pytest.skip("MLX checks this only with a Metal device")
    assert info.type is error
    assert str(info.value).strip() == message
