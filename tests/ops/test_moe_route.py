"""moe_route against a float64 NumPy oracle and mlx-lm's routing, on every backend here."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.moe_route import (
    check,
    distinct_logits,
    grad_oracle,
    make_logits,
    mlx_lm_route,
    oracle,
    run_and_check,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.moe_route")
# (leading shape, E, k): E = 1, k = E, ragged E around 32, the register boundary (512),
# experts re-read from memory (E > 512), k at its maximum, several leading dims
SHAPES = (((1,), 1, 1), ((3,), 7, 7), ((2,), 8, 2), ((5,), 31, 4), ((2, 3), 32, 8),
          ((1, 1, 4), 33, 8), ((4,), 128, 8), ((3,), 130, 32), ((2,), 32, 32),
          ((2,), 512, 10), ((2,), 513, 10), ((3,), 1100, 5), ((), 64, 4))

# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _dname(d):
    return str(d).rsplit(".", 1)[-1]


def _logits(rows, dtype=mx.float32):
    return mx.array(np.array(rows, dtype=np.float32)).astype(dtype)


# ---- correctness ----------------------------------------------------------------------

@pytest.mark.parametrize("lead, n, k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_matches_oracle(any_backend, rng, dtype, normalize, lead, n, k):
    """Random logits (float16 / bfloat16 ones hold ties: the oracle states the tie rule)."""
    run_and_check(make_logits(rng, lead, n, dtype), k, normalize, any_backend)


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_many_rows(any_backend, rng, dtype, normalize):
    """1000 rows: 125 threadgroups of 8 rows, the last one full; 1001: one row alone."""
    for rows in (1000, 1001):
        run_and_check(make_logits(rng, (rows,), 64, dtype), 8, normalize, any_backend)


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_ties(any_backend, dtype, normalize):
    """Equal logits take slots in ascending expert index, across the k boundary too, and
    tied experts get bitwise equal scores."""
    rows = [[2, 5, 5, 1, 5, 0, 5, 5],  # five 5s for k = 4: the first four by index
            [3] * 8,  # all equal: ids 0..k-1, scores 1/k (normalize) or 1/E
            [0, 1, 1, 0, 1, 1, 0, 1],
            [-1, -2, -1, -2, -1, -2, -1, -2]]
    logits = _logits(rows, dtype)
    ids, scores = run_and_check(logits, 4, normalize, any_backend)
    assert np.array(ids).tolist() == [[1, 2, 4, 6], [0, 1, 2, 3], [1, 2, 4, 5], [0, 2, 4, 6]]
    got = np.array(scores.astype(mx.float32))
    assert (got[:3] == got[:3, :1]).all() and (got[3] == got[3, 0]).all()


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_ties_beyond_the_registers(any_backend, dtype, normalize):
    """E = 600: ties between an expert held in registers and ones re-read from memory."""
    x = np.full((2, 600), -1.0, dtype=np.float32)
    x[0, [3, 520, 599, 40]] = 4.0
    x[1, [590, 512, 511, 0]] = 2.0
    ids, _ = run_and_check(_logits(x, dtype), 3, normalize, any_backend)
    assert np.array(ids).tolist() == [[3, 40, 520], [0, 511, 512]]


NAN, INF = float("nan"), float("inf")
EDGE_ROWS = [
    [1, NAN, 3, NAN, 2, 0, 1, 1],  # NaN ranks first (lowest index first): NaN scores
    [1, -INF, 3, -INF, -INF, -INF, -INF, -INF],  # masked experts: selected last, score 0
    [-INF] * 8,  # every expert masked: NaN scores (softmax's 0/0)
    [1, INF, 2, 3, 0, 0, 0, 0],  # +inf max: NaN scores (softmax's inf - inf)
    [-0.0, 0.0, -0.0, 0.0, -1, -2, -3, -4],  # -0 equals +0: ties by index
    [-INF, -INF, 5, -INF, -INF, -INF, -INF, 4],  # fewer finite than k
    [-3e38, 3e38, 0, 1, 2, 3, 4, 5],  # l - m overflows to -inf: exp 0
]


@pytest.mark.parametrize("k", (1, 3, 8))
@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_edge_values(any_backend, dtype, normalize, k):
    rows = np.array(EDGE_ROWS, dtype=np.float32)
    if dtype == mx.float16:
        rows = np.where(np.abs(rows) == 3e38, np.sign(rows) * 6e4, rows)
    ids, scores = run_and_check(_logits(rows, dtype), k, normalize, any_backend)
    got_ids = np.array(ids)
    assert (got_ids < 8).all()
    assert all(len(set(r)) == k for r in got_ids.tolist())
    got = to_f64(scores)
    assert np.isnan(got[[0, 2, 3]]).all() and not np.isnan(got[[1, 4, 5, 6]]).any()


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
def test_nan_beyond_the_registers(any_backend, normalize):
    """A NaN re-read from memory (index 550 of 600) still ranks first."""
    x = np.random.default_rng(0).standard_normal((2, 600)).astype(np.float32)
    x[0, 550] = np.nan
    ids, scores = run_and_check(_logits(x), 4, normalize, any_backend)
    assert int(np.array(ids)[0, 0]) == 550
    got = to_f64(scores)
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("n, k", [(8, 2), (32, 4), (128, 8), (512, 10), (600, 6)])
def test_matches_mlx_lm(any_backend, rng, n, k, normalize):
    """mlx-lm's softmax + argpartition + take_along_axis (+ renormalisation) on float32
    logits without ties: the same set of ids per row, and per id mlx-lm's score within the
    tolerance of the float64 oracle that ours meets (run_and_check)."""
    logits = make_logits(rng, (5,), n, mx.float32)
    ids, _ = run_and_check(logits, k, normalize, any_backend)
    lm_ids, lm_scores = mlx_lm_route(logits, k, normalize)
    ids, lm_ids = np.array(ids), np.array(lm_ids)
    for row, (a, b) in enumerate(zip(ids, lm_ids, strict=True)):
        assert sorted(a.tolist()) == sorted(b.tolist()), row
    _, want, mag = oracle(logits, k, normalize)  # slots in our order (= the oracle's ids)
    # mlx-lm's score of each id, in our slots
    theirs = np.array([[dict(zip(b, sc, strict=True))[i] for i in a] for a, b, sc in
                       zip(ids.tolist(), lm_ids.tolist(), to_f64(lm_scores).tolist(),
                           strict=True)])
    assert_close(theirs, want, mx.float32, magnitude=mag, what="mlx-lm's routing")


def test_distinct_logits_have_no_ties(rng):
    for dtype in DTYPES:
        x = to_f64(distinct_logits(rng, (4,), 2048, dtype))
        assert all(len(set(r)) == 2048 for r in x.tolist())


def test_reference_function(rng):
    """moe_route_reference: the op's contract (checks, empty inputs) as a plain function."""
    logits = make_logits(rng, (2, 3), 40, mx.bfloat16)
    with backends.use_backend("reference"):
        want = mt.moe_route(logits, 5, normalize=False)
    got = mt.ops.moe_route_reference(logits, 5, normalize=False)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    ids, scores = mt.ops.moe_route_reference(mx.zeros((0, 40)), 5)
    assert ids.shape == scores.shape == (0, 5) and ids.dtype == mx.uint32
    with pytest.raises(ValueError, match=r"^\[moe_route\] k must be <= E = 8"):
        mt.ops.moe_route_reference(logits[..., :8], 9)


def test_stream_argument(rng):
    logits = make_logits(rng, (3,), 40, mx.float32)
    got = mt.moe_route(logits, 5, stream=mx.cpu)
    want = mt.moe_route(logits, 5)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(rng, seed):
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    with strict_emulator(seed), backends.use_backend("emulator"):
        run_and_check(make_logits(rng, (9,), 600, mx.bfloat16), 10, False, "emulator")


@pytest.mark.parametrize("n, reads", [(128, 1), (512, 1), (600, None)])
def test_traffic(rng, n, reads):
    """The row read once while it fits the registers (E <= 512); beyond, the experts past
    512 again in each of the k rounds and in the sum over all E; ids and scores written once."""
    if backends.unavailable_reason("emulator") is not None:
        pytest.skip("emulator unavailable")
    from mlx_metaltile import emulator

    rows, k = 3, 6
    with backends.use_backend("emulator"):
        run_and_check(make_logits(rng, (rows,), n, mx.float16), k, False, "emulator")
    stats = emulator.last_launch_stats()
    row_bytes = n * 2 if reads else 512 * 2 + (n - 512) * 2 * (k + 1)
    assert stats.bytes_read["logits"] == rows * row_bytes
    assert stats.bytes_written["ids"] == rows * k * 4
    assert stats.bytes_written["scores"] == rows * k * 2


# ---- gradients -------------------------------------------------------------------------

@pytest.mark.parametrize("lead, n, k", [((2, 3), 40, 8), ((1,), 1, 1), ((4,), 600, 10),
                                        ((3,), 7, 7)], ids=str)
@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_vjp(any_backend, rng, dtype, normalize, lead, n, k):
    logits = make_logits(rng, lead, n, dtype)
    g = mx.array(rng.standard_normal((*lead, k)).astype(np.float32)).astype(dtype)
    _, (dl,) = mx.vjp(lambda x: mt.moe_route(x, k, normalize=normalize)[1], [logits], [g])
    assert dl.dtype == dtype and dl.shape == logits.shape
    want, mag = grad_oracle(logits, g, k, normalize)
    assert_close(dl, want, dtype, mag, what=f"moe_route dlogits[{any_backend}]")


@pytest.mark.parametrize("normalize", (True, False), ids=("norm", "all_e"))
def test_grad_oracle_matches_finite_differences(rng, normalize):
    """The float64 gradient oracle against central differences of the float64 oracle."""
    logits = rng.standard_normal((2, 12))
    g = rng.standard_normal((2, 5))
    want, _ = grad_oracle(logits, g, 5, normalize)

    def f(x):
        return float((g * oracle(x, 5, normalize)[1]).sum())

    h = 1e-6
    for idx in np.ndindex(logits.shape):
        up, down = logits.copy(), logits.copy()
        up[idx] += h
        down[idx] -= h
        assert abs((f(up) - f(down)) / (2 * h) - want[idx]) < 1e-7, idx


def test_vjp_of_both_outputs(any_backend, rng):
    """The ids' cotangent is ignored: the same gradient as through the scores alone."""
    logits = make_logits(rng, (3,), 20, mx.float32)
    g = mx.array(rng.standard_normal((3, 4)).astype(np.float32))
    _, (a,) = mx.vjp(lambda x: mt.moe_route(x, 4)[1], [logits], [g])
    _, (b,) = mx.vjp(lambda x: mt.moe_route(x, 4), [logits],
                     [mx.ones((3, 4), dtype=mx.uint32), g])
    assert mx.array_equal(a, b).item()


def test_gradient_through_gathers_at_the_ids(any_backend, rng):
    """mlx-lm's use: the ids stopped (as it stops argpartition's) index another array inside
    the differentiated function; the gradient w.r.t. the logits is the scores' alone."""
    logits = make_logits(rng, (3,), 20, mx.float32)
    values = mx.array(rng.standard_normal((3, 20)).astype(np.float32))

    def loss(x):
        ids, scores = mt.moe_route(x, 4)
        picked = mx.take_along_axis(values, mx.stop_gradient(ids), axis=-1)
        return (scores * picked).sum()

    got = mx.grad(loss)(logits)
    ids = mt.moe_route(logits, 4)[0]
    g = mx.take_along_axis(values, ids, axis=-1)
    want, mag = grad_oracle(logits, g, 4, True)
    assert_close(got, want, mx.float32, mag, what="moe_route gradient through a gather")


# ---- build once, lazy, empty ----------------------------------------------------------

def test_instantiations_match_the_launches(launch_recorder, rng):
    for dtype in DTYPES:
        for normalize in (True, False):
            mt.moe_route(make_logits(rng, (2,), 16, dtype), 3, normalize=normalize)
    assert len(launch_recorder.seen) == 6
    assert {name for name, *_ in launch_recorder.seen} == {op_module.SPEC.name}
    launch_recorder.assert_declared()


def test_sizes_do_not_rebuild(kernel_backend, rng, launches):
    """rows, E, k and normalize are runtime inputs: one instantiation per dtype."""
    for rows, n, k, normalize in ((1, 8, 2, True), (7, 600, 10, False), (3, 33, 33 - 1, True)):
        run_and_check(make_logits(rng, (rows,), n, mx.bfloat16), k, normalize, kernel_backend)
    assert len(launches) == 3 and len({launch.key for launch in launches}) == 1


def test_kernel_path_is_lazy(monkeypatch, no_host_sync, rng):
    seen = {}

    def fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                    init_value=None):
        seen.update(grid=grid, threadgroup=threadgroup, template=template,
                    shapes=output_shapes, dtypes=output_dtypes)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype
                in zip(output_shapes, output_dtypes, strict=True)]

    logits = make_logits(rng, (2, 3, 3), 128, mx.bfloat16)
    with no_host_sync(), monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: "metal")
        m.setattr(backends, "get_kernel", lambda *a, **k: fake_kernel)
        ids, scores = mt.moe_route(logits, 8)
    assert ids.shape == scores.shape == (2, 3, 3, 8)
    assert ids.dtype == mx.uint32 and scores.dtype == mx.bfloat16
    assert seen["grid"] == (32, 24, 1) and seen["threadgroup"] == (32, 8, 1)
    assert seen["template"] == [("T", mx.bfloat16)]
    assert [tuple(s) for s in seen["shapes"]] == [(18, 8), (18, 8)]


def test_empty_does_not_dispatch(kernel_backend):
    before = backends.launch_count()
    for shape in ((0, 16), (2, 0, 16)):
        ids, scores = mt.moe_route(mx.zeros(shape, dtype=mx.float16), 3)
        assert ids.shape == scores.shape == (*shape[:-1], 3)
        assert ids.dtype == mx.uint32 and scores.dtype == mx.float16
    assert backends.launch_count() == before


# ---- negative controls --------------------------------------------------------------------

@pytest.mark.parametrize("old, new", [
    ("key > best_key", "key >= best_key"),  # ties to the higher index
    ("if (over_k != 0u) {", "if (true) {"),  # always renormalised over the k
    ("if (lane < k) {\n  const size_t out", "if (lane + 1 < k) {\n  const size_t out"),
    ("    return 0xFFFFFFFFu;\n", "    return 0u;\n"),  # NaN ranked below everything
], ids=("ties_to_higher_index", "normalize_ignored", "last_slot_unwritten", "nan_last"))
def test_negative_control_broken_kernel(kernel_backend, broken_kernel, old, new):
    broken_kernel(op_module.SPEC, (old, new))
    rows = np.zeros((2, 70), dtype=np.float32)
    rows[0, [5, 37, 69, 2]] = 4.0  # ties within lane 5 (experts 5, 37, 69) and across lanes
    rows[1, :8] = [0, 1, 2, NAN, 3, 4, 5, 6]
    with pytest.raises(AssertionError):
        for normalize in (True, False):
            run_and_check(_logits(rows), 3, normalize, kernel_backend)


def test_negative_control_reference_always_renormalised(monkeypatch, rng):
    real = op_module._reference
    monkeypatch.setattr(op_module, "_reference", lambda x, k, normalize: real(x, k, True))
    with backends.use_backend("reference"), pytest.raises(AssertionError,
                                                           match="out of tolerance"):
        run_and_check(make_logits(rng, (2,), 16, mx.float32), 4, False, "reference")


def test_negative_control_check_sees_wrong_ids(rng):
    """The check compares ids, not only scores: a swap of two tied slots fails it."""
    logits = _logits([[1, 3, 3, 0]])
    ids, scores = mt.moe_route(logits, 2)
    check(ids, scores, logits, 2, True, "moe_route")
    with pytest.raises(AssertionError, match="ids differ"):
        check(ids[..., ::-1], scores, logits, 2, True, "moe_route")


# ---- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("logits, k, kwargs, exc, match", [
    (mx.zeros((2, 8), mx.int32), 2, {}, TypeError,
     "logits must be float32, float16 or bfloat16, got int32"),
    (np.zeros((2, 8), np.float32), 2, {}, TypeError, "logits must be an mx.array, got ndarray"),
    (mx.array(1.0), 1, {}, ValueError, r"logits must have at least 1 dimension \(\[\.\.\., E\]\)"),
    (mx.zeros((2, 0)), 1, {}, ValueError, "the last axis of logits .* must be >= 1, got 0"),
    (mx.zeros((2, 8)), 0, {}, ValueError, "k must be >= 1, got 0"),
    (mx.zeros((2, 8)), -1, {}, ValueError, "k must be >= 1, got -1"),
    (mx.zeros((2, 8)), 9, {}, ValueError, r"k must be <= E = 8 \(the last axis of logits\), got 9"),
    (mx.zeros((2, 64)), 33, {}, ValueError,
     r"k must be <= 32 \(the largest the kernel serves\), got 33"),
    (mx.zeros((2, 8)), 2.0, {}, TypeError, "k must be an int, got float"),
    (mx.zeros((2, 8)), True, {}, TypeError, "k must be an int, got bool"),
    (mx.zeros((2, 8)), 2, dict(normalize=1), TypeError, "normalize must be a bool"),
    (mx.zeros((2, 8)), 2, dict(stream="gpu"), TypeError, "stream must be None"),
])
def test_bad_input(logits, k, kwargs, exc, match):
    with pytest.raises(exc, match=r"^\[moe_route\] " + match):
        mt.moe_route(logits, k, **kwargs)


def test_numpy_scalars():
    logits = mx.arange(8, dtype=mx.float32)[None]
    a = mt.moe_route(logits, np.int64(3), normalize=np.True_)
    b = mt.moe_route(logits, 3, normalize=True)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
