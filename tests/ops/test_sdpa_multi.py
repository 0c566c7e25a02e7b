"""sdpa_multi against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from support import backend_params, dtype_id, require_backend, strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile._registry import instantiations
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.sdpa_multi import launch_counts, make_inputs, oracle, run_and_check
from mlx_metaltile.ops._common import clear_plans

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")



# (B, Hq, Hkv, L, kv_len, S, D, causal): L in {1, 8, 16, 33}, GQA 1/2/4/8, with and
# without slack (S > kv_len), D 64/96/128/256, row tiles that are ragged or several, KV
# ranges split over several threadgroups, causal blocks whose first query sees one key.
CASES = [
    (1, 4, 4, 1, 37, 37, 64, False),     # GQA 1 decode, one ragged key block
    (1, 4, 2, 1, 300, 320, 128, True),   # GQA 2 decode, slack, split KV
    (2, 8, 2, 8, 70, 96, 64, True),      # GQA 4 block, batch 2, slack
    (1, 8, 1, 8, 65, 65, 128, False),    # GQA 8: 64 rows -> two row tiles
    (1, 2, 2, 16, 16, 40, 64, True),     # kv_len == L: the first query sees a single key
    (1, 4, 1, 33, 50, 50, 64, True),     # 132 rows -> 5 row tiles, the last ragged
    (1, 2, 1, 33, 33, 33, 256, True),    # D 256, kv_len == L, two row tiles
    (1, 4, 4, 16, 300, 320, 256, False),  # D 256, split KV, slack
    (1, 6, 3, 8, 129, 200, 96, True),    # D 96, GQA 2
    (1, 16, 2, 1, 520, 520, 128, False),  # GQA 8 decode, split KV
    (1, 2, 2, 8, 700, 768, 128, True),   # causal block over 5 KV slices, slack
    (1, 8, 2, 16, 200, 256, 128, False),  # GQA 4 x L 16: two row tiles, full, slack
    (2, 8, 2, 16, 100, 100, 64, True),   # GQA 4 x L 16 causal: tiles mix two query heads
    (1, 8, 1, 33, 90, 100, 64, False),   # GQA 8 x L 33: 264 rows -> 9 tiles, full, slack
]


def case_id(c):
    B, Hq, Hkv, L, kv_len, S, D, causal = c
    return f"B{B}-h{Hq}x{Hkv}-L{L}-kv{kv_len}of{S}-D{D}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_oracle(any_backend, poisoned_outputs, rng, case, dtype):
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    run_and_check(q, k, v, scale=1.0 / math.sqrt(D), causal=causal, kv_len=kv_len,
                  backend=any_backend)


def test_cases_cover_split_kv_and_tiles():
    """The case list exercises several slices and several row tiles (guards the plan)."""
    plans = [op_module.plan(B, Hq, Hkv, L, D, kv, mx.float16)
             for B, Hq, Hkv, L, kv, S, D, causal in CASES]
    assert any(p["n_splits"] > 1 for p in plans)
    assert any(p["n_splits"] > 1 and c[3] > 1 and c[-1]  # a causal block, several slices
               for p, c in zip(plans, CASES, strict=True))
    assert any(p["n_tiles"] > 1 for p in plans)
    assert any(p["rows"] % op_module.ROW_TILE for p in plans if p["n_tiles"] > 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_one_block_slices(any_backend, poisoned_outputs, monkeypatch, rng, dtype):
    """Slices of 32 keys: with kv_len close to L, early causal queries see no key at all in
    the later slices (empty partials), and the last slice holds a single key."""
    monkeypatch.setattr(op_module, "MIN_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(op_module, "MIN_KEYS_PER_ROW", 0)
    monkeypatch.setattr(op_module, "TARGET_THREADS", 1 << 30)
    for L, kv_len in ((33, 33), (40, 97)):
        plan = op_module.plan(1, 4, 2, L, 64, kv_len, dtype)
        assert plan["chunk"] == 32 and plan["n_splits"] == -(-kv_len // 32)
        q, k, v = make_inputs(rng, 1, 4, 2, L, kv_len + 8, 64, dtype)
        run_and_check(q, k, v, scale=0.125, causal=True, kv_len=kv_len, backend=any_backend)


# Every dtype, causal and full, at both cache lengths: kv_len 4104 is the one real-model
# shape that splits the KV range (8 slices of 544 keys) under one full 32-row tile. Each
# 4104 case takes 5 to 11 s of CPU through the emulator on a loaded 2-core machine.
REAL_MODEL = [(kv_len, dtype, causal) for kv_len in (28, 4104) for dtype in DTYPES
              for causal in (False, True)]


@pytest.mark.parametrize(
    "kv_len, dtype, causal", REAL_MODEL,
    ids=lambda x: dtype_id(x) if isinstance(x, mx.Dtype) else (
        ("causal" if x else "full") if isinstance(x, bool) else f"kv{x}"))
def test_real_model_shape(any_backend, poisoned_outputs, rng, kv_len, dtype, causal):
    """A Llama-3-8B-style layer: B=1, Hq=32, Hkv=8, D=128, a block of L=8 queries."""
    plan = op_module.plan(1, 32, 8, 8, 128, kv_len, dtype)
    assert plan["n_tiles"] == 1 and plan["rows"] == 32
    assert (plan["n_splits"] > 1) == (kv_len > 28)
    q, k, v = make_inputs(rng, 1, 32, 8, 8, kv_len + 24, 128, dtype)
    run_and_check(q, k, v, scale=128 ** -0.5, causal=causal, kv_len=kv_len,
                  backend=any_backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_first_causal_query_sees_one_key(any_backend, poisoned_outputs, rng, dtype):
    """kv_len == L: query 0 attends key 0 alone, so its output is v[0] (its weight is 1)."""
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 8, 64, dtype)
    out = run_and_check(q, k, v, scale=0.125, causal=True, kv_len=8, backend=any_backend)
    want = np.repeat(to_f64(v)[:, :, 0], 2, axis=1)
    assert_close(to_f64(out)[:, :, 0], want, dtype, what="first causal query")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_large_scores(any_backend, poisoned_outputs, rng, dtype, causal):
    """Scores in the thousands (q, k ~ 30): softmax must subtract its running max."""
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 96, 64, dtype, qk_scale=30.0)
    out = run_and_check(q, k, v, scale=1.0, causal=causal, kv_len=90, backend=any_backend)
    assert not np.isnan(to_f64(out)).any()


HUGE_SCORES = [
    # (scale, lo, hi): k[..., 0] takes integer values in [lo, hi] and q = e_0, so the
    # scores are scale * k[..., 0]. Every visible score at most -7e29, i.e. at most -1e30
    # times log2(e) in the kernel's base 2, where a finite stand-in for -inf such as -1e30
    # would beat them all:
    (-1e30, 1, 4), (1e29, -8, -7), (-1e38, 1, 1),
    # and scores as large (the maximum must still be subtracted):
    (1e30, 1, 4), (-1e38, -1, -1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale, lo, hi", [
    pytest.param(*c, id=f"scale{c[0]:g}-k{c[1]}to{c[2]}") for c in HUGE_SCORES])
def test_huge_finite_scores(any_backend, poisoned_outputs, monkeypatch, rng, dtype, scale, lo, hi):
    """Scores of magnitude 1.4e29 to 1.4e38, either sign, all finite in float32.

    q = e_0 and k[:, :, j, 0] an integer in [lo, hi], so every score scale * k_j0 is
    computed without an error that could reorder keys: keys of equal k_j0 score exactly the
    same, other keys differ by at least |scale|, so the softmax is uniform over the keys of
    largest score and exactly 0 elsewhere. The causal block with kv_len = L has a first
    query that sees one key, and 32-key slices leave the early rows' later slices empty:
    the merge must ignore them whatever the visible scores are.
    """
    monkeypatch.setattr(op_module, "MIN_SPLIT_BLOCKS", 1)  # 32-key slices
    monkeypatch.setattr(op_module, "MIN_KEYS_PER_ROW", 0)
    monkeypatch.setattr(op_module, "TARGET_THREADS", 1 << 30)
    B, Hq, Hkv, L, D = 1, 4, 2, 40, 64
    for kv_len, causal in ((L, True), (L, False), (97, True), (97, False)):
        q_np = np.zeros((B, Hq, L, D), np.float32)
        q_np[..., 0] = 1.0
        k_np = rng.standard_normal((B, Hkv, kv_len + 8, D)).astype(np.float32)
        k_np[..., 0] = rng.integers(lo, hi + 1, size=k_np.shape[:-1])
        v = mx.array(rng.standard_normal((B, Hkv, kv_len + 8, D)).astype(np.float32))
        q, k, v = mx.array(q_np).astype(dtype), mx.array(k_np).astype(dtype), v.astype(dtype)
        # scores are exact, so the float32 accumulation bound needs only sum_j p_j |v_j|
        want, _ = oracle(q, k, v, scale, causal, kv_len)
        magnitude, _ = oracle(q, k, mx.abs(v), scale, causal, kv_len)
        before = launch_counts(any_backend)
        out = mt.sdpa_multi(q, k, v, scale=scale, causal=causal, kv_len=kv_len)
        mx.eval(out)
        if any_backend != "reference":  # both kernels ran, over several KV slices
            assert launch_counts(any_backend) == (before[0] + 1, before[1] + 1)
            assert op_module.plan(B, Hq, Hkv, L, D, kv_len, dtype)["n_splits"] > 1
        assert_close(out, want, dtype, magnitude,
                     what=f"sdpa_multi[{any_backend}] scale {scale:g} kv_len {kv_len} "
                          f"{'causal' if causal else 'full'}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_combine_of_empty_and_extreme_slices(kernel_backend, poisoned_outputs, rng, dtype):
    """The combine pass alone, on hand-made partials (m, lsum, o) of 3 slices per row:
    every slice empty (m = -inf, and no sink: the row is NaN, as MLX's sdpa gives for a
    row an additive mask hides entirely); empty slices next to
    maxima near -FLT_MAX, equal or 3 apart; maxima whose difference overflows to -inf."""
    inf, big = math.inf, 3e38
    ml = np.array([
        [(-inf, 0.0), (-inf, 0.0), (-inf, 0.0)],
        [(-big, 2.0), (-inf, 0.0), (-big, 1.0)],
        [(-inf, 0.0), (5.0, 1.5), (2.0, 1.0)],
        [(big, 1.0), (-big, 1.0), (-inf, 0.0)],
    ], np.float32)
    n_rows, n_splits, D = ml.shape[0], ml.shape[1], 64
    o = rng.standard_normal((n_rows, n_splits, D)).astype(np.float32)
    o[ml[..., 1] == 0] = 0.0  # an empty slice writes o = 0
    m = ml[..., 0].astype(np.float64)
    m_max = m.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):  # -inf - -inf in the all-empty row, masked here
        w = np.where(m == -inf, 0.0, np.exp2(m - m_max))
    w = w * ml[..., 1]  # o of a slice is its softmax @ v, already divided by its lsum
    num = np.einsum("rs,rsd->rd", w, o.astype(np.float64))
    den = w.sum(axis=1)[:, None]
    want = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    magnitude = np.divide(np.einsum("rs,rsd->rd", w, np.abs(o)), den,
                          out=np.zeros_like(num), where=den > 0)
    assert (want[0] == 0).all() and np.isfinite(want).all()  # row 0 is checked for NaN
    before = backends.launch_count(op_module.COMBINE_SPEC.name, kernel_backend)
    (out,) = backends.launch(
        op_module.COMBINE_SPEC, kernel_backend,
        inputs={"o_part": mx.array(o), "ml_part": mx.array(ml),
                "n_rows": mx.array(n_rows, dtype=mx.uint32),
                "n_splits": mx.array(n_splits, dtype=mx.uint32),
                "scale": mx.array(0.5),  # below 1: the maxima are the base-2 scores as given
                "n_q": mx.array(1, dtype=mx.uint32), "n_heads": mx.array(1, dtype=mx.uint32),
                "has_sinks": mx.array(0, dtype=mx.uint32), "sinks": mx.zeros((1,))},
        template={"T": dtype, "D": D}, outputs={"out": ((n_rows, D), dtype)},
        grid=(32 * op_module.COMBINE_ROWS, 1, 1),
        threadgroup=(32 * op_module.COMBINE_ROWS, 1, 1), init_value=float("nan"))
    mx.eval(out)
    assert backends.launch_count(op_module.COMBINE_SPEC.name, kernel_backend) == before + 1
    assert np.isnan(to_f64(out)[0]).all()
    assert_close(out[1:], want[1:], dtype, magnitude[1:],
                 what=f"sdpa_multi combine[{kernel_backend}]")


@pytest.mark.parametrize("n_splits", (1, 8, 9, 33, 100, 128))
def test_combine_of_many_slices(kernel_backend, poisoned_outputs, rng, n_splits):
    """The combine pass alone, on random partials of up to COMBINE_MAX_SPLITS slices: one,
    one batch of o loads, a ragged batch, slices held by up to 4 lanes' registers each;
    a third of the slices empty, maxima spread over 40 units, a sink on odd heads."""
    n_rows, D, heads = 6, 96, 2
    m = rng.uniform(-20.0, 20.0, (n_rows, n_splits)).astype(np.float32)
    lsum = rng.uniform(0.5, 30.0, (n_rows, n_splits)).astype(np.float32)
    empty = rng.random((n_rows, n_splits)) < 1 / 3
    empty[:, 0] = False  # every row sees a key
    m[empty], lsum[empty] = -np.inf, 0.0
    o = rng.standard_normal((n_rows, n_splits, D)).astype(np.float32)
    o[empty] = 0.0
    sinks = np.array([-np.inf, 3.0], np.float32)  # head 0 none, head 1 a sink of 3
    sink = sinks[np.arange(n_rows) % heads].astype(np.float64)[:, None]
    m64 = m.astype(np.float64)
    m_max = np.maximum(m64.max(axis=1, keepdims=True), sink)  # scale 0.5: units as given
    w = np.where(empty, 0.0, np.exp2(m64 - m_max)) * lsum
    den = w.sum(axis=1, keepdims=True) + np.exp2(sink - m_max)
    want = np.einsum("rs,rsd->rd", w, o.astype(np.float64)) / den
    magnitude = np.einsum("rs,rsd->rd", w, np.abs(o.astype(np.float64))) / den
    ml = np.stack([m, lsum], axis=-1)
    sink_logits = np.where(np.isinf(sinks), -1e30, sinks / 1.4426950408889634)
    before = backends.launch_count(op_module.COMBINE_SPEC.name, kernel_backend)
    (out,) = backends.launch(
        op_module.COMBINE_SPEC, kernel_backend,
        inputs={"o_part": mx.array(o), "ml_part": mx.array(ml),
                "n_rows": mx.array(n_rows, dtype=mx.uint32),
                "n_splits": mx.array(n_splits, dtype=mx.uint32), "scale": mx.array(0.5),
                "n_q": mx.array(1, dtype=mx.uint32), "n_heads": mx.array(heads, dtype=mx.uint32),
                "has_sinks": mx.array(1, dtype=mx.uint32),
                "sinks": mx.array(sink_logits.astype(np.float32))},
        template={"T": mx.float32, "D": D}, outputs={"out": ((n_rows, D), mx.float32)},
        grid=(32 * op_module.COMBINE_ROWS * 2, 1, 1),
        threadgroup=(32 * op_module.COMBINE_ROWS, 1, 1), init_value=float("nan"))
    mx.eval(out)
    assert backends.launch_count(op_module.COMBINE_SPEC.name, kernel_backend) == before + 1
    assert_close(out, want, mx.float32, magnitude,
                 what=f"sdpa_multi combine[{kernel_backend}] {n_splits} slices")


def test_split_plan_past_the_combine_refused(kernel_backend, monkeypatch, rng):
    """A plan constant set past what the combine kernel merges raises at planning time
    instead of merging part of the slices."""
    monkeypatch.setattr(op_module, "MAX_SPLITS", 4 * op_module.COMBINE_MAX_SPLITS)
    monkeypatch.setattr(op_module, "VEC_MAX_SPLITS", 4 * op_module.COMBINE_MAX_SPLITS)
    monkeypatch.setattr(op_module, "TARGET_THREADS", 10**9)
    monkeypatch.setattr(op_module, "VEC_SIMDGROUPS_PER_CORE", 10**6)
    clear_plans()
    try:
        q, k, v = make_inputs(rng, 1, 4, 2, 1, 64 * 1024, 64, mx.float16)
        with mt.use_backend(kernel_backend), pytest.raises(
                ValueError, match=r"^\[sdpa_multi\] the split plan has \d+ KV slices; the "
                                  r"combine kernel merges at most 128"):
            mt.sdpa_multi(q, k, v, scale=0.125)
    finally:
        clear_plans()


@pytest.mark.parametrize("scale", (0.0, -0.3), ids=("zero", "negative"))
def test_zero_and_negative_scale(any_backend, poisoned_outputs, rng, scale):
    """scale 0: every visible key weighs the same; a negative scale flips the scores."""
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 80, 64, mx.float32)
    run_and_check(q, k, v, scale=scale, causal=True, kv_len=70, backend=any_backend)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_slack_rows_are_never_read(any_backend, poisoned_outputs, rng, causal):
    """Cache rows past kv_len hold NaN/inf: the result must not see them."""
    q, k, v = make_inputs(rng, 1, 8, 2, 8, 160, 64, mx.float16)
    kv_len = 77
    k_np, v_np = np.array(k), np.array(v)
    k_np[:, :, kv_len:] = np.nan
    v_np[:, :, kv_len:] = np.inf
    run_and_check(q, mx.array(k_np), mx.array(v_np), scale=0.125, causal=causal,
                  kv_len=kv_len, backend=any_backend, what=" (NaN/inf in the slack)")


@pytest.mark.parametrize("dtype", (mx.float32, mx.float16), ids=dtype_id)
def test_non_contiguous_inputs(any_backend, poisoned_outputs, rng, dtype):
    """q transposed from [B, L, H, D]; k, v sliced out of a larger preallocated cache;
    then k, v transposed from a [B, S, H, D] cache and q a strided slice."""
    B, Hq, L, D = 2, 8, 8, 64  # 4 KV heads

    def arr(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = arr((B, L, Hq, D)).transpose(0, 2, 1, 3)
    big = arr((2, B, 6, 256, D))
    k, v = big[0, :, 1:5, :100], big[1, :, 2:6, :100]
    run_and_check(q, k, v, scale=0.125, causal=True, kv_len=90, backend=any_backend)
    q = arr((B, Hq, 2 * L, D))[:, :, ::2]
    k, v = (arr((B, 120, 4, D)).transpose(0, 2, 1, 3) for _ in range(2))
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=77, backend=any_backend)


def _emulator_instantiations():
    """Distinct instantiations the emulator compiled for the two sdpa_multi kernel objects."""
    total = 0
    for spec in (op_module.SPLIT_SPEC, op_module.COMBINE_SPEC):
        kernel = backends.get_kernel(spec, "emulator")
        total += len(kernel._modules)  # one compiled module per generated source
    return total


def test_host_known_kv_len_reaches_the_kernel_as_itself(launches, rng):
    """A 0-d uint32 kv_len made by _msl.constants.scalar (what the patched attention passes)
    is the split kernel's kv_len input itself, its bits still known to the host (the cuda
    executor packs such scalars; a copy would be a 0-d array in MLX's slow managed pool and
    one more dispatch); an int32 one is converted."""
    from mlx_metaltile._msl.constants import known_bits, scalar

    q, k, v = make_inputs(rng, 1, 4, 2, 1, 64, 64, mx.float32)
    names = [a.name for a in op_module.SPLIT_SPEC.inputs]
    with backends.use_backend("emulator"):
        for kv_len, known in ((scalar(40, mx.uint32), 40), (mx.array(41, dtype=mx.int32), None)):
            mx.eval(mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=kv_len))
            passed = launches[-2].inputs[names.index("kv_len")]
            assert (passed is kv_len) == (known is not None)
            assert known_bits(passed) == known and passed.dtype == mx.uint32


def test_device_kv_len_decode_loop_builds_no_custom_function(launches, rng, monkeypatch):
    """A decode loop passing a 0-d kv_len (growing) reuses its plan's one custom function:
    the kv_len is a primal, not closed over. The kernels ran and match MLX's sdpa, and the
    VJP through that primal gives MLX's gradients and a zero cotangent for kv_len."""
    from mlx_metaltile._msl.constants import scalar
    from mlx_metaltile.ops._common import clear_plans

    built = []
    real = mx.custom_function

    def counting(fn):
        built.append(fn)
        return real(fn)

    monkeypatch.setattr(mx, "custom_function", counting)
    clear_plans()
    S = 96
    q, k, v = make_inputs(rng, 1, 4, 2, 1, S, 64, mx.float32)
    kf, vf = (mx.repeat(a, 2, axis=1) for a in (k, v))
    with backends.use_backend("emulator"):
        for n in range(40, 46):
            got = mt.sdpa_multi(q, k, v, scale=0.125, kv_len=scalar(n, mx.uint32))
            want = mx.fast.scaled_dot_product_attention(q, kf[:, :, :n], vf[:, :, :n],
                                                        scale=0.125)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), n
        assert len(built) == 1
        assert len(launches) == 12  # split and combine per call

        n = scalar(44, mx.uint32)
        ct = mx.array(rng.standard_normal(q.shape).astype(np.float32))
        (_, grads) = mx.vjp(lambda q, k, v, n: mt.sdpa_multi(q, k, v, scale=0.125, kv_len=n),
                            [q, k, v, n], [ct])
        assert any(launch.name.endswith("backward_dq_split") for launch in launches)
    (_, want) = mx.vjp(lambda q, k, v: mx.fast.scaled_dot_product_attention(
        q, mx.repeat(k, 2, axis=1)[:, :, :44], mx.repeat(v, 2, axis=1)[:, :, :44],
        scale=0.125), [q, k, v], [ct])
    for g, w in zip(grads[:3], want, strict=True):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-5).item()
    assert grads[3].item() == 0 and grads[3].dtype == mx.uint32
    assert len(built) == 1


# The common call's fields (sdpa_multi's own plan key): one changed at a time from the base.
_COMMON_BASE = dict(B=1, Hq=4, Hkv=2, L=1, S=64, D=64, dtype=mx.float32, scale=0.125,
                    causal=False, kv_dtype=mx.uint32, mask=None)
_COMMON_VARIATIONS = ({}, {"B": 2}, {"Hq": 8}, {"Hkv": 4}, {"L": 4}, {"S": 96}, {"D": 128},
                      {"dtype": mx.float16}, {"scale": 0.25}, {"causal": True},
                      {"kv_dtype": mx.int32}, {"L": 4, "mask": "causal"})


def _common_call(rng, **fields):
    """(q, k, v, keyword arguments) of a common call (_COMMON_BASE with ``fields``)."""
    from mlx_metaltile._msl.constants import scalar

    c = {**_COMMON_BASE, **fields}
    q, k, v = make_inputs(rng, c["B"], c["Hq"], c["Hkv"], c["L"], c["S"], c["D"], c["dtype"])
    kv_len = (scalar(40, mx.uint32) if c["kv_dtype"] == mx.uint32
              else mx.array(40, dtype=c["kv_dtype"]))
    kw = {"scale": c["scale"], "causal": c["causal"], "kv_len": kv_len}
    return q, k, v, kw if c["mask"] is None else {**kw, "mask": c["mask"]}


def _check_common_call(q, k, v, kw, backend):
    """One common call, checked against the float64 oracle (mask "causal" as causal);
    on a kernel backend both kernels must have run."""
    before = launch_counts(backend)
    out = mt.sdpa_multi(q, k, v, **kw)
    mx.eval(out)
    if backend != "reference":
        assert launch_counts(backend) == (before[0] + 1, before[1] + 1)
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    want, magnitude = oracle(q, k, v, kw["scale"], kw["causal"] or "mask" in kw,
                             kw["kv_len"].item())
    assert_close(out, want, q.dtype, magnitude, what=f"sdpa_multi[{backend}]")


def test_common_call_plan_per_metadata(kernel_backend, launches, rng):
    """The common call (a 0-d kv_len, no mask array, no sinks, the default stream) finds
    its plan by sdpa_multi's own key: a call differing in any one field gets a plan of its
    own (a field the key missed would reuse a stale plan), each the one _plan builds, and
    computes with its own arguments (both kernels ran; the float64 oracle). The reference
    backend's plan is another."""
    plans = op_module._COMMON_PLANS
    assert not plans
    for i, fields in enumerate(_COMMON_VARIATIONS):
        _check_common_call(*_common_call(rng, **fields), kernel_backend)
        assert len(plans) == i + 1, fields
    with backends.use_backend("reference"):
        _check_common_call(*_common_call(rng), "reference")
    assert len(plans) == len(_COMMON_VARIATIONS) + 1
    assert ({id(run) for run in plans.values()}
            == {id(run) for run in op_module._plan.memory.values()})
    n = len(launches)
    _check_common_call(*_common_call(rng), kernel_backend)  # the base again: its plan
    assert len(plans) == len(_COMMON_VARIATIONS) + 1 and len(launches) == n + 2


def test_common_call_plan_keeps_no_argument_alive(kernel_backend, rng):
    """The common call's remembered plan holds none of its arguments (forward and VJP)."""
    import gc
    import weakref

    q, k, v, _ = _common_call(rng)
    args = (q, k, v, mx.array(40, dtype=mx.uint32))  # a kv_len made here, not a constant
    refs = [weakref.ref(a) for a in args]

    def loss(q, k, v, kv_len):
        return mt.sdpa_multi(q, k, v, scale=0.125, kv_len=kv_len).sum()

    mx.eval(mx.grad(loss, argnums=(0, 1, 2))(*args))
    mx.eval(loss(*args))
    assert len(op_module._COMMON_PLANS) == 1
    del q, k, v, args
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("fields, change, exc, match", [
    ({}, lambda q, k, v, kw: (q.astype(mx.float16), k, v, kw), TypeError,
     "k must have q's dtype float16, got float32"),
    ({}, lambda q, k, v, kw: (q, k.astype(mx.float16), v, kw), TypeError,
     "k must have q's dtype float32, got float16"),
    ({}, lambda q, k, v, kw: (q, k[:, :, :32], v, kw), ValueError,
     "k and v must have the same shape"),
    ({}, lambda q, k, v, kw: (q, k, v.astype(mx.float16), kw), TypeError,
     "v must have q's dtype float32, got float16"),
    ({}, lambda q, k, v, kw: (q, k, v[:, :, :32], kw), ValueError,
     "k and v must have the same shape"),
    ({}, lambda q, k, v, kw: (q, k, v, {**kw, "kv_len": kw["kv_len"].reshape(1)}),
     ValueError, r"kv_len as an mx.array must be 0-d, got shape \(1,\)"),
    ({}, lambda q, k, v, kw: (q, k, v, {**kw, "kv_len": mx.array(40.0)}), TypeError,
     "kv_len as an mx.array must have an integer dtype, got float32"),
    ({}, lambda q, k, v, kw: (q, k, v, {**kw, "mask": "full"}), ValueError,
     "a string mask must be 'causal', got 'full'"),
    ({"mask": "causal"}, lambda q, k, v, kw: (q, k, v, {**kw, "causal": True}), ValueError,
     "pass either causal=True or mask=, not both"),
    ({}, lambda q, k, v, kw: (q, k, v, {**kw, "scale": 1e39}), ValueError,
     r"scale must satisfy \|scale\| <= "),
], ids=("q-dtype", "k-dtype", "k-shape", "v-dtype", "v-shape", "kv_len-shape", "kv_len-dtype", "mask-string",
        "mask-and-causal", "scale"))
def test_common_call_checks_every_call(rng, fields, change, exc, match):
    """A call that would be refused is refused after a valid common call remembered its
    plan (a field sdpa_multi's own key missed would find that plan and skip the checks)."""
    q, k, v, kw = _common_call(rng, **fields)
    mx.eval(mt.sdpa_multi(q, k, v, **kw))
    assert op_module._COMMON_PLANS
    q, k, v, kw = change(q, k, v, kw)
    with pytest.raises(exc, match=r"^\[sdpa_multi\] " + match):
        mt.sdpa_multi(q, k, v, **kw)


@pytest.mark.parametrize("fields", ({}, {"L": 4, "causal": True}, {"L": 4, "mask": "causal"}),
                         ids=("decode", "verify-causal", "verify-mask"))
def test_common_call_matches_the_general_path(kernel_backend, launches, rng, fields):
    """The common call's own plan gives the general path's results bitwise (that path
    taken here by an explicit stream): forward, and the gradients of q, k and v through
    the backward kernels."""
    q, k, v, kw = _common_call(rng, **fields)
    stream = mx.default_stream(mx.default_device())

    def loss(q, k, v, **extra):
        return (mt.sdpa_multi(q, k, v, **kw, **extra) * v[:, :1, :1]).sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1, 2))
    common = grad(q, k, v)
    assert len(op_module._COMMON_PLANS) == 1
    mx.eval(common)
    n = len(launches)
    general = grad(q, k, v, stream=stream)
    mx.eval(general)
    assert len(op_module._COMMON_PLANS) == 1  # the general path: _plan alone
    names = [launch.name.rsplit("_", 1)[-1] for launch in launches]
    # the forward's split and combine kernels, the dq side (statistics, split dq), dk/dv
    assert names[:n] == names[n:] and {"combine", "dkv", "stats", "split"} <= set(names)
    for got, want in zip([common[0], *common[1]], [general[0], *general[1]], strict=True):
        assert mx.array_equal(got, want, equal_nan=True).item()


def test_kv_len_l_and_batch_do_not_rebuild(kernel_backend, launches, rng, monkeypatch):
    """A decode/verify loop (growing kv_len, then other L and B) builds no new kernel (on
    one path: the cuda plan's MMA path, which it takes from MMA_MIN_ROWS rows, is off
    here; tests/ops/test_sdpa_multi_mma.py covers it)."""
    monkeypatch.setattr(op_module, "MMA_MIN_ROWS", 1 << 30)
    S = 700
    q, k, v = make_inputs(rng, 1, 8, 2, 4, S, 64, mx.float16)
    run_and_check(q, k, v, scale=0.125, causal=True, kv_len=4, backend=kernel_backend)
    built = backends.built_kernels()
    inst = _emulator_instantiations() if kernel_backend == "emulator" else None
    for kv_len in (5, 31, 32, 33, 64, 97, 300, 650):  # 1 to several KV slices
        run_and_check(q, k, v, scale=0.125, causal=True, kv_len=kv_len, backend=kernel_backend)
    for B, L in ((1, 1), (2, 8), (3, 16)):
        q2, k2, v2 = make_inputs(rng, B, 8, 2, L, S, 64, mx.float16)
        run_and_check(q2, k2, v2, scale=0.3, causal=False, kv_len=120, backend=kernel_backend)
    assert backends.built_kernels() == built
    assert len({(launch.name, launch.template) for launch in launches}) == 2
    assert len({op_module.plan(1, 8, 2, 4, 64, n, mx.float16)["n_splits"]
                for n in (4, 650)}) == 2  # the loop did change the launch geometry
    if kernel_backend == "emulator":
        assert _emulator_instantiations() == inst


def test_launches_are_declared_instantiations(kernel_backend, launches, rng):
    """Every template the launcher uses is one that ``instantiations`` declares (the CUDA
    compile check builds exactly those)."""
    declared = {spec.name: {inst.template for inst in instantiations(spec)}
                for spec in (op_module.SPLIT_SPEC, op_module.COMBINE_SPEC)}
    for dtype in DTYPES:
        for D in op_module.HEAD_DIMS:
            q, k, v = make_inputs(rng, 1, 2, 1, 1, 40, D, dtype)
            run_and_check(q, k, v, scale=0.1, causal=False, kv_len=40, backend=kernel_backend)
    assert len(launches) == 2 * len(DTYPES) * len(op_module.HEAD_DIMS)
    for name, template in ((launch.name, launch.template) for launch in launches):
        assert template in declared[name], (name, template)


# ---- device traffic (emulator counters) -------------------------------------------------

TRAFFIC_CASES = [
    # (B, Hq, Hkv, L, kv_len, S, D, causal, one_block_slices)
    (2, 8, 2, 4, 150, 200, 64, False, True),    # 16 rows: K/V once, over 5 slices
    (1, 32, 8, 8, 300, 320, 128, True, False),  # 32 rows (real-model GQA 4 x L 8), causal
    (1, 8, 1, 1, 1000, 1024, 128, False, False),  # decode, GQA 8, planner's own slices
    (1, 4, 4, 16, 90, 96, 256, False, False),   # D 256 (staged in one or two chunks)
    (1, 8, 1, 8, 100, 128, 64, False, False),   # 64 rows: two row tiles -> twice
    (1, 4, 1, 33, 200, 200, 64, True, True),    # 132 rows: 5 tiles, causal, 7 slices
]


@pytest.mark.parametrize("seed", (1, 2))
@pytest.mark.parametrize("case, dtype", [
    ((1, 4, 1, 33, 70, 80, 64, True), mx.float16),     # 5 row tiles, causal, 3 slices
    ((1, 4, 4, 16, 100, 128, 256, False), mx.float32),  # D 256 staged in two column halves
], ids=("tiles-causal", "D256-halves"))
def test_emulator_strict_shuffled(monkeypatch, rng, case, dtype, seed):
    """Strict mode (no read of threadgroup memory before it is written, no race on it) with
    the threads and threadgroups run in a permuted order: the result must not change."""
    require_backend("emulator")

    monkeypatch.setattr(op_module, "MIN_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(op_module, "MIN_KEYS_PER_ROW", 0)
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    assert op_module.plan(B, Hq, Hkv, L, D, kv_len, dtype)["n_splits"] > 1
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                          backend="emulator")


def test_negative_control_missing_barrier(broken_kernel, rng):
    """Reading the staged keys without waiting for the whole block to be staged must be
    caught by strict mode (the harness above can fail)."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    staged = ("tid, n_threads);\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
              "    if (nr > 0u) {\n      for (int i = 0; i < LPC")
    broken_kernel(op_module.SPLIT_SPEC,
                  (staged, staged.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")))
    q, k, v = make_inputs(rng, 1, 4, 1, 33, 80, 64, mx.float16)
    with strict_emulator(1):
        with backends.use_backend("emulator"), pytest.raises((emulator.ThreadgroupRace,
                                                           emulator.UninitializedThreadgroupRead)):
            mx.eval(mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=70))


def cache_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, itemsize):
    """Bytes of k (or of v) a tiling into row tiles of 32 must read, from the math: row tile
    t holds query rows r = g * L + l (32 t <= r < 32 (t + 1)); it needs the union of their
    visible keys, [0, kv_len) for full attention and [0, kv_len - L + max l + 1) causal."""
    rows = L * (Hq // Hkv)
    keys = 0
    for t0 in range(0, rows, 32):
        last_l = max(r % L for r in range(t0, min(t0 + 32, rows)))
        keys += kv_len - L + last_l + 1 if causal else kv_len
    return B * Hkv * keys * D * itemsize


def _run_traffic_case(launches, monkeypatch, rng, case, dtype):
    """One emulator run of ``case``; checks its per-buffer device traffic."""
    require_backend("emulator")
    B, Hq, Hkv, L, kv_len, S, D, causal, one_block = case
    if one_block:
        monkeypatch.setattr(op_module, "MIN_SPLIT_BLOCKS", 1)
        monkeypatch.setattr(op_module, "MIN_KEYS_PER_ROW", 0)
        monkeypatch.setattr(op_module, "TARGET_THREADS", 1 << 30)
    plan = op_module.plan(B, Hq, Hkv, L, D, kv_len, dtype)
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with backends.use_backend("emulator"):
        run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                      backend="emulator")
    (name1, split), (name2, combine) = ((launch.name, launch.stats) for launch in launches)
    assert (name1, name2) == (op_module.SPLIT_SPEC.name, op_module.COMBINE_SPEC.name)
    ideal = B * Hkv * kv_len * D * dtype.size  # the visible cache of k (or v), once
    rows = L * Hq // Hkv
    tiles = -(-rows // 32)
    assert tiles == plan["n_tiles"]
    want = cache_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, dtype.size)
    assert ideal <= want <= tiles * ideal  # the bound, with R = 32
    if rows <= 32:
        assert want == ideal  # once for all L queries and all Hq/Hkv heads
    for name in ("k", "v"):
        assert split.bytes_read[name] == want, (
            f"{name}: read {split.bytes_read[name]} bytes, want {want} "
            f"({split.bytes_read[name] / ideal:.3f} x the visible cache)")
    assert split.bytes_read["q"] == plan["n_splits"] * q.nbytes
    n_out = B * Hq * L
    assert split.bytes_written["o_part"] == n_out * plan["n_splits"] * D * 4
    assert split.bytes_written["ml_part"] == n_out * plan["n_splits"] * 2 * 4
    assert split.grid == plan["grid"] and split.threadgroup == plan["threadgroup"]
    assert split.threadgroup_memory <= plan["threadgroup_memory"] <= 32 * 1024
    assert combine.bytes_read["o_part"] == n_out * plan["n_splits"] * D * 4
    assert combine.bytes_written["out"] == q.nbytes


@pytest.mark.parametrize("dtype", (mx.float16, mx.float32), ids=dtype_id)
@pytest.mark.parametrize("case", TRAFFIC_CASES, ids=lambda c: case_id(c[:-1]))
def test_cache_is_read_once_per_row_tile(launches, monkeypatch, rng, case, dtype):
    """Bytes the split kernel reads from k and v, from the emulator's counters: the visible
    cache (kv_len rows of every KV head) exactly once when L * Hq/Hkv <= 32, else once per
    row tile of 32 query rows (a causal tile stops at the last key its rows see), so never
    more than ceil(L * Hq/Hkv / 32) times; q once per KV slice; partials written once."""
    _run_traffic_case(launches, monkeypatch, rng, case, dtype)


def test_negative_control_traffic(launches, broken_kernel, monkeypatch, rng):
    """A split kernel whose causal tiles read the whole cache (same results, more bytes)
    must fail the traffic check."""
    broken_kernel(op_module.SPLIT_SPEC,
                  ("k_end = min(k_end, kvn - L + l_max + 1u);", "(void)l_max;"))
    with pytest.raises(AssertionError, match="k: read"):
        _run_traffic_case(launches, monkeypatch, rng, (1, 2, 2, 64, 64, 64, 64, True, True),
                          mx.float32)


def test_plan_meets_the_traffic_bound_and_limits():
    """Over many shapes: the slices partition [0, kv_len) into non-empty runs of whole 32-key
    blocks (so no key is read twice by one row tile), one row tile per 32 query rows, and the
    dispatch limits hold."""
    for B, Hq, Hkv, L, kv_len, D, dtype in itertools.product(
            (1, 2, 8), (32, 8), (8, 1), (1, 4, 8, 16, 33, 64), (64, 100, 1024, 4104, 16384),
            op_module.HEAD_DIMS, DTYPES):
        if kv_len < L:
            continue
        p = op_module.plan(B, Hq, Hkv, L, D, kv_len, dtype)
        rows = L * Hq // Hkv
        assert p["n_tiles"] == -(-rows // 32) and p["rows"] == rows
        chunk, n = p["chunk"], p["n_splits"]
        assert chunk % 32 == 0 and 1 <= n <= op_module.MAX_SPLITS
        assert (n - 1) * chunk < kv_len <= n * chunk  # every slice non-empty, all keys covered
        if n > 1:  # slices long enough that q re-reads and partials stay small next to K/V
            assert chunk >= max(32 * op_module.MIN_SPLIT_BLOCKS,
                                op_module.MIN_KEYS_PER_ROW * min(rows, 32))
        threads = p["threadgroup"][0]
        assert threads % 32 == 0 and threads <= 1024 and p["threadgroup"][1:] == (1, 1)
        assert threads == 32 * 32 // p["rs"]  # one simdgroup per RS rows of the 32-row tile
        assert p["grid"] == (threads * n, p["n_tiles"], B * Hkv)
        assert p["threadgroup_memory"] <= 32 * 1024
        assert p["dc"] % 32 == 0 and D % p["dc"] == 0 and 32 * p["dc"] * dtype.size <= 16384


def test_empty_does_not_dispatch(any_backend):
    """Zero batch, zero query heads or zero queries: an empty result of q's shape and dtype,
    no kernel launched."""
    before = backends.launch_count()
    for B, Hq, L, S in ((0, 4, 4, 8), (2, 0, 4, 8), (2, 4, 0, 8), (2, 4, 0, 0)):
        q = mx.zeros((B, Hq, L, 64), dtype=mx.float16)
        k = mx.zeros((B, 2, S, 64), dtype=mx.float16)
        out = mt.sdpa_multi(q, k, k, scale=1.0)
        assert out.shape == q.shape and out.dtype == mx.float16
        mx.eval(out)
    assert backends.launch_count() == before


@pytest.mark.parametrize("backend", backend_params("reference", "metal", "cuda"))
def test_op_is_lazy_and_compiles(no_host_sync, rng, backend):
    """No evaluation inside the op (the emulator, eager by design, is left out); it traces
    under mx.compile, and a compiled call gives the oracle's result."""
    require_backend(backend)
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 40, 64, mx.float32)


    with backends.use_backend(backend):
        with no_host_sync():
            out = mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=30)
        want, magnitude = oracle(q, k, v, 0.125, True, 30)
        assert_close(out, want, mx.float32, magnitude)
        compiled = mx.compile(lambda a, b, c: mt.sdpa_multi(a, b, c, scale=0.125, causal=True,
                                                            kv_len=30))
        assert_close(compiled(q, k, v), want, mx.float32, magnitude)
        assert_close(compiled(q, k, v * 2), 2 * want, mx.float32, 2 * magnitude)


def test_kernel_path_is_lazy(monkeypatch, no_host_sync, rng):
    """The launcher (plan, runtime scalars, geometry, both launches) syncs nothing either:
    the kernels are replaced by a stand-in that returns lazy outputs, as on a Mac."""
    seen = []

    def fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                    init_value=None):
        outs = [mx.zeros(shape, dtype=dtype) for shape, dtype
                in zip(output_shapes, output_dtypes, strict=True)]
        seen.append(dict(inputs=inputs, grid=grid, threadgroup=threadgroup,
                         template=template, output_shapes=output_shapes, outputs=outs))
        return outs

    q, k, v = make_inputs(rng, 1, 8, 2, 8, 1024, 128, mx.bfloat16)
    with no_host_sync(), monkeypatch.context() as m:
        m.setattr(backends, "resolve_backend", lambda name=None: "metal")
        m.setattr(backends, "get_kernel", lambda *a, **kw: fake_kernel)
        q, k, v = q * 2, k + 1, v[:, :, ::-1]  # lazy inputs, one of them non-contiguous
        out = mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=1000)
    assert out.shape == q.shape and out.dtype == mx.bfloat16
    plan = op_module.plan(1, 8, 2, 8, 128, 1000, mx.bfloat16)
    assert plan["n_splits"] > 1
    split, combine = seen
    assert split["grid"] == plan["grid"] and split["threadgroup"] == plan["threadgroup"]
    assert split["template"] == [("T", mx.bfloat16), ("D", 128), ("RS", plan["rs"]),
                                 ("DC", plan["dc"]), ("MASK_KIND", 0)]
    assert split["output_shapes"] == [(8 * 8, plan["n_splits"], 128),
                                      (8 * 8, plan["n_splits"], 2)]
    assert combine["grid"] == (32 * op_module.COMBINE_ROWS * (8 * 8 // 4), 1, 1)
    assert combine["template"] == [("T", mx.bfloat16), ("D", 128)]
    # the partials feed the combine pass
    assert all(a is b for a, b in zip(combine["inputs"][:2], split["outputs"], strict=True))


# ---- negative controls: a deliberately wrong variant must fail the harness ----------------

def test_negative_control_causal_off_by_one(kernel_backend, broken_kernel, rng):
    """Letting each causal query see one key too many must fail the oracle check."""
    broken_kernel(op_module.SPLIT_SPEC, ("kvn - L + r % L + 1u", "kvn - L + r % L + 2u"))
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 40, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=True, kv_len=30, backend=kernel_backend)


def test_negative_control_combine_without_rescale(kernel_backend, broken_kernel, rng):
    """Merging KV slices without rescaling by 2^(m_s - M) must fail the oracle check."""
    broken_kernel(op_module.COMBINE_SPEC, ("exp2(unit * (m_s - m_max))", "1.0f"))
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 600, 64, mx.float32)
    assert op_module.plan(1, 4, 2, 1, 64, 600, mx.float32)["n_splits"] > 1
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=600, backend=kernel_backend)


def test_negative_control_unwritten_row(kernel_backend, poisoned_outputs, broken_kernel, rng):
    """A combine pass that never writes the last output row must fail (the poisoned
    outputs are what catches it)."""
    broken_kernel(op_module.COMBINE_SPEC, ("if (row >= n_rows)", "if (row + 1u >= n_rows)"))
    q, k, v = make_inputs(rng, 1, 4, 2, 3, 40, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40, backend=kernel_backend)


def test_negative_control_reference_off_by_one(monkeypatch, rng):
    """The oracle harness rejects a composite whose causal bound is off by one."""
    real = op_module._reference

    def shifted(q, k, v, p):
        # each query sees one key fewer at the end: the block is treated as one step earlier
        return real(q, k, v, dataclasses.replace(p, kv_len=p.kv_len - 1))

    monkeypatch.setattr(op_module, "_reference", shifted)
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 40, 64, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tol"):
        run_and_check(q, k, v, scale=0.125, causal=True, kv_len=30, backend="reference")


# ---- bad input ------------------------------------------------------------------------

def _ok(dtype=mx.float16):
    return (mx.zeros((1, 8, 4, 64), dtype=dtype), mx.zeros((1, 2, 16, 64), dtype=dtype),
            mx.zeros((1, 2, 16, 64), dtype=dtype))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[0], v), ValueError, "k must have 4 dimensions"),
    (lambda q, k, v: (q, k, v[..., None]), ValueError, "v must have 4 dimensions"),
    (lambda q, k, v: (q, k, v[:, :, :8]), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:, :1], v), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (mx.concatenate([q, q]), k, v), ValueError, "k and v must have q's batch size 2, got 1"),
    (lambda q, k, v: (q[:, :7], k, v), ValueError, r"q's heads \(7\) must be a multiple"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), ValueError,
     r"head dim must be one of \(64, 96, 128, 256\), got 32"),
    (lambda q, k, v: (q[..., :32], k, v), ValueError, "k and v must have q's head dim 32, got 64"),
    (lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]), ValueError, "k and v must have at least 1 head"),
    (lambda q, k, v: (q, k.astype(mx.float32), v), TypeError, "k must have q's dtype float16"),
    (lambda q, k, v: (q, k, v.astype(mx.bfloat16)), TypeError, "v must have q's dtype"),
    (lambda q, k, v: (q.astype(mx.int32), k, v), TypeError, "q must be float32"),
    (lambda q, k, v: (q.astype(mx.int32), k.astype(mx.int32), v.astype(mx.int32)), TypeError,
     "q must be float32, float16 or bfloat16, got int32"),
    (lambda q, k, v: (q, k.astype(mx.int8), v), TypeError, "k must have q's dtype float16, got int8"),
    (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError,
     r"the cache must hold at least the L=4 queries' rows \(k and v with S >= 4 rows\), got S=3"),
    (lambda q, k, v: (q[:, :, :, :0], k[..., :0], v[..., :0]), ValueError, "head dim must be one of"),
    (lambda q, k, v: (np.zeros((1, 8, 4, 64)), k, v), TypeError, "q must be an mx.array"),
])
def test_bad_input(mutate, exc, match):
    q, k, v = mutate(*_ok())
    with pytest.raises(exc, match=r"^\[sdpa_multi\] " + match):
        mt.sdpa_multi(q, k, v, scale=1.0)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"kv_len": 3}, ValueError, r"kv_len must satisfy L <= kv_len <= S, i.e. 4 <= kv_len <= 16, got 3"),
    ({"kv_len": 17}, ValueError, r"kv_len must satisfy .* got 17"),
    ({"kv_len": -1}, ValueError, "kv_len"),
    ({"kv_len": 8.0}, TypeError, "kv_len must be a Python int"),
    ({"kv_len": True}, TypeError, "kv_len must be a Python int"),
    ({"kv_len": "8"}, TypeError, "kv_len must be a Python int"),
    ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ({"scale": float("inf")}, ValueError, "scale must be finite"),
    ({"scale": "0.1"}, TypeError, "scale must be a Python or NumPy real number"),
    ({"scale": -2.4e38}, ValueError, r"scale must satisfy \|scale\| <= 2.359e\+38 .* got -2.4e\+38"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
])
def test_bad_arguments(kwargs, exc, match):
    args = {"scale": 0.125, **kwargs}
    with pytest.raises(exc, match=r"^\[sdpa_multi\] " + match):
        mt.sdpa_multi(*_ok(), **args)


def test_scale_is_required():
    with pytest.raises(TypeError):
        mt.sdpa_multi(*_ok())  # keyword-only, no default
