"""sdpa_multi's vector path (sdpa_multi.metal, VECTOR PATH: the cuda plan's split kernel),
forced on every kernel backend: the float64 oracle over shapes, masks, sinks and device-side
kv_len; K/V traffic from the emulator's counters; the plan; negative controls."""

from __future__ import annotations

import importlib
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from support import dtype_id, require_backend, strict_emulator

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile._registry import instantiations
from mlx_metaltile.cases import assert_close
from mlx_metaltile.cases.sdpa_multi import (
    launch_counts,
    make_inputs,
    make_mask,
    oracle,
    run_and_check,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")



@pytest.fixture
def vector_path(monkeypatch):
    """Every backend's plan takes the vector path until the test ends."""
    for backend in ("metal", "cuda", "emulator"):
        monkeypatch.setitem(op_module.SPLIT_PATH, backend, "vector")


def vplan(B, Hq, Hkv, L, D, kv_len, dtype):
    return op_module.vector_plan(B, Hq, Hkv, L, D, kv_len, dtype)


# (B, Hq, Hkv, L, kv_len, S, D, causal): decode (L 1) and verify blocks (L 2..8), GQA 1..16,
# every head dim and RS, ragged key batches, several row tiles, slack, several slices.
CASES = [
    (1, 4, 4, 1, 37, 37, 64, False),      # MHA decode, RS 4 with one row
    (1, 32, 8, 1, 300, 320, 128, True),   # Llama-style decode, GQA 4
    (1, 16, 2, 1, 520, 520, 128, False),  # GQA 8 decode: RS 8
    (2, 8, 2, 8, 70, 96, 64, True),       # GQA 4 x L 8 = 32 rows: eight RS-4 tiles, batch 2
    (1, 8, 2, 8, 200, 256, 128, True),    # 32 rows at D 128: eight tiles, causal
    (1, 6, 3, 8, 129, 200, 96, True),     # D 96 (scalar loads), GQA 2 x L 8 = 16 rows
    (1, 4, 4, 4, 300, 320, 256, False),   # D 256: RS 4
    (1, 16, 2, 5, 90, 100, 256, True),    # D 256, GQA 8 (RS 4): ten tiles mixing two heads
    (1, 4, 1, 3, 3, 3, 64, True),         # kv_len == L: the first query sees one key
    (1, 16, 1, 2, 100, 100, 64, True),    # GQA 16 x L 2 at D 64: two RS-16 tiles
]


def case_id(c):
    B, Hq, Hkv, L, kv_len, S, D, causal = c
    return f"B{B}-h{Hq}x{Hkv}-L{L}-kv{kv_len}of{S}-D{D}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_oracle(kernel_backend, vector_path, poisoned_outputs, launches, rng, case,
                        dtype):
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    run_and_check(q, k, v, scale=1.0 / math.sqrt(D), causal=causal, kv_len=kv_len,
                  backend=kernel_backend)
    split = launches[0]
    plan = vplan(B, Hq, Hkv, L, D, kv_len, dtype)
    assert dict(split.template)["DC"] == 0 and dict(split.template)["RS"] == plan["rs"]


def test_cases_cover_the_vector_plan():
    """The case list reaches every RS, several tiles, ragged batches and several slices."""
    plans = [vplan(B, Hq, Hkv, L, D, kv, mx.float16) for B, Hq, Hkv, L, kv, S, D, c in CASES]
    assert {p["rs"] for p in plans} == set(op_module.VEC_ROWS)
    assert any(p["n_tiles"] > 2 for p in plans)
    assert any(c[4] % p["keys_per_batch"] for p, c in zip(plans, CASES, strict=True))
    assert any(p["chunk"] < c[4] for p, c in zip(plans, CASES, strict=True))


@pytest.mark.parametrize("kind", ("bool", "additive", "block", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_masks_and_sinks(kernel_backend, vector_path, poisoned_outputs, rng, kind, dtype):
    """Masks broadcast in place (bool, additive with -inf, the block form), with and
    without sinks, at decode and in a verify block."""
    for B, Hq, Hkv, L, kv_len, S, D in ((1, 8, 2, 1, 600, 640, 64), (2, 4, 2, 6, 90, 96, 128)):
        q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
        mask, causal = make_mask(rng, kind, (B, 1, L, kv_len), (Hq, L, kv_len), L, dtype)
        sinks = mx.array((rng.standard_normal(Hq) * 3).astype(np.float32)).astype(dtype)
        for s in (None, sinks):
            run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len, mask=mask,
                          sinks=s, backend=kernel_backend, what=f" vector {kind}")


@pytest.mark.parametrize("kind", ("bool", "additive"))
def test_fully_masked_rows(kernel_backend, vector_path, poisoned_outputs, rng, kind):
    """Rows whose keys are all masked: bool -> v averaged uniformly; additive -inf -> NaN
    (checked by run_and_check); with sinks -> 0."""
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 96, 64, mx.float32)
    m = rng.random((4, 4, 70)) < 0.5
    m[1, 2] = False
    m[3, :] = False
    mask = mx.array(m) if kind == "bool" else mx.array(np.where(m, 0.0, -np.inf).astype(
        np.float32))
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=70, mask=mask,
                  backend=kernel_backend)
    out = run_and_check(q, k, v, scale=0.125, causal=False, kv_len=70, mask=mask,
                        sinks=mx.array([0.5, -1.0, 2.0, 0.0]), backend=kernel_backend)
    assert (np.array(out)[0, 3] == 0).all()


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_device_kv_len(kernel_backend, vector_path, poisoned_outputs, rng, causal):
    """A 0-d kv_len gives exactly what the same Python int gives (the grid then covers the
    whole cache: slices past kv_len see no key)."""
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 400, 64, mx.float16)
    for n in (4, 33, 250, 400):
        want = run_and_check(q, k, v, scale=0.125, causal=causal, kv_len=n,
                             backend=kernel_backend)
        got = run_and_check(q, k, v, scale=0.125, causal=causal,
                            kv_len=mx.array(n, mx.int32), backend=kernel_backend)
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_slack_and_large_values(kernel_backend, vector_path, poisoned_outputs, rng, dtype):
    """NaN/inf past kv_len is never read; |v| near the dtype's top over 2048 keys (several
    slices) stays finite: o is kept divided by the running sum."""
    q, k, v = make_inputs(rng, 1, 8, 2, 2, 160, 64, dtype)
    k_np, v_np = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    k_np[:, :, 77:] = np.nan
    v_np[:, :, 77:] = np.inf
    run_and_check(q, mx.array(k_np).astype(dtype), mx.array(v_np).astype(dtype), scale=0.125,
                  causal=True, kv_len=77, backend=kernel_backend, what=" (NaN/inf slack)")
    top = {mx.float32: 2e35, mx.float16: 6e4, mx.bfloat16: 3e38}[dtype]
    q, k, _ = make_inputs(rng, 1, 2, 2, 4, 2048, 64, dtype)
    sign = np.where(rng.random((1, 2, 2048, 64)) < 0.5, -1.0, 1.0)
    v = mx.array((sign * top).astype(np.float32)).astype(dtype)
    assert vplan(1, 2, 2, 4, 64, 2048, dtype)["n_splits"] > 1
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=2048, backend=kernel_backend)


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("scale", (1e38, -1e38, 1e30), ids=lambda s: f"scale{s:g}")
def test_scores_beyond_float32(kernel_backend, vector_path, poisoned_outputs, monkeypatch, rng,
                               dtype, scale):
    """scale * q.k beyond float32's range over several slices: one-hot softmax."""
    monkeypatch.setattr(op_module, "VEC_MIN_KEYS", 16)
    monkeypatch.setattr(op_module, "MIN_KEYS_PER_ROW", 0)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
               for shape in ((1, 2, 4, 64), (1, 2, 96, 64), (1, 2, 96, 64)))
    assert vplan(1, 2, 2, 4, 64, 96, dtype)["n_splits"] > 1
    before = launch_counts(kernel_backend)
    out = mt.sdpa_multi(q, k, v, scale=scale)
    mx.eval(out)
    assert launch_counts(kernel_backend) == (before[0] + 1, before[1] + 1)
    want, _ = oracle(q, k, v, scale, False, 96)
    magnitude, _ = oracle(q, k, mx.abs(v), scale, False, 96)
    assert_close(out, want, dtype, magnitude, what=f"vector path scale {scale:g}")


def test_launches_are_declared_instantiations(kernel_backend, vector_path, launches, rng):
    """Every vector template the launcher uses is one the spec declares (the CUDA compile
    check builds exactly those)."""
    declared = {inst.template for inst in instantiations(op_module.SPLIT_SPEC)}
    for dtype, D in itertools.product(DTYPES, op_module.HEAD_DIMS):
        for Hq in (2, 8, 16):  # GQA 2, 8, 16: every RS of D
            q, k, v = make_inputs(rng, 1, Hq, 1, 2, 40, D, dtype)
            run_and_check(q, k, v, scale=0.1, causal=False, kv_len=40, backend=kernel_backend)
    splits = [launch.template for launch in launches if launch.name == op_module.SPLIT_SPEC.name]
    assert {dict(t)["RS"] for t in splits} == set(op_module.VEC_ROWS)
    assert all(t in declared and dict(t)["DC"] == 0 for t in splits)


def test_plan():
    """Non-empty slices of whole key batches covering [0, kv_len), one threadgroup of
    VEC_SIMDGROUPS simdgroups per slice and tile of RS rows, the dispatch limits."""
    for B, Hq, Hkv, L, kv_len, D, dtype in itertools.product(
            (1, 2, 8), (32, 8), (8, 1), (1, 4, 8, 16), (8, 100, 1024, 16384),
            op_module.HEAD_DIMS, DTYPES):
        if kv_len < L:
            continue
        p = vplan(B, Hq, Hkv, L, D, kv_len, dtype)
        rows, rs = L * Hq // Hkv, p["rs"]
        assert rs in op_module.VEC_ROWS and rs * D <= 32 * 32 or rs == op_module.VEC_ROWS[0]
        assert p["n_tiles"] == -(-rows // rs) and p["keys_per_batch"] * rs == 32
        if L == 1 and Hq // Hkv <= rs:
            assert p["n_tiles"] == 1  # decode: one tile per KV head
        n, chunk, nsg = p["n_splits"], p["chunk"], p["n_simdgroups"]
        assert chunk % p["keys_per_batch"] == 0 and (n - 1) * chunk < kv_len <= n * chunk
        assert 1 <= n <= op_module.VEC_MAX_SPLITS
        assert p["threadgroup"] == (32 * nsg, 1, 1) and p["threadgroup_memory"] <= 32 * 1024
        assert p["grid"] == (32 * nsg * p["n_tiles"], n, B * Hkv)


# ---- device traffic (emulator counters) -------------------------------------------------

def vector_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, itemsize, rs):
    """Bytes of k (or v) the vector path reads: each tile of rs query rows reads the keys
    its rows see ([0, kv_len), or up to its latest causal query's last key) once."""
    rows = L * (Hq // Hkv)
    keys = 0
    for t0 in range(0, rows, rs):
        last_l = max(r % L for r in range(t0, min(t0 + rs, rows)))
        keys += kv_len - L + last_l + 1 if causal else kv_len
    return B * Hkv * keys * D * itemsize


TRAFFIC_CASES = [
    # (B, Hq, Hkv, L, kv_len, S, D, causal)
    (1, 32, 8, 1, 1000, 1024, 128, False),  # decode, GQA 4 (RS 4): once
    (1, 16, 2, 1, 700, 768, 128, True),     # decode, GQA 8 (RS 8): once
    (1, 16, 1, 1, 150, 200, 64, True),      # decode, GQA 16 (RS 16): once
    (1, 4, 4, 2, 90, 96, 256, False),       # D 256, 2 rows: once
    (2, 8, 2, 4, 150, 200, 64, True),       # 16 rows, RS 4: four tiles, causal
    (1, 8, 2, 8, 300, 320, 128, True),      # 32 rows at D 128: eight tiles, causal
]


@pytest.mark.parametrize("dtype", (mx.float16, mx.float32), ids=dtype_id)
@pytest.mark.parametrize("case", TRAFFIC_CASES, ids=case_id)
def test_cache_is_read_once_per_tile(launches, vector_path, rng, case, dtype):
    """From the emulator's counters: each visible K/V byte once per KV head when the
    L * Hq/Hkv rows fit one tile (decode: RS >= Hq/Hkv), else once per tile of RS rows (a
    causal tile stops at its latest query's last key); q once per slice and simdgroup;
    partials written once per slice."""
    _run_traffic_case(launches, rng, case, dtype)


def _run_traffic_case(launches, rng, case, dtype):
    require_backend("emulator")
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    plan = vplan(B, Hq, Hkv, L, D, kv_len, dtype)
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with backends.use_backend("emulator"):
        run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                      backend="emulator")
    (name1, split), (name2, combine) = ((launch.name, launch.stats) for launch in launches)
    assert (name1, name2) == (op_module.SPLIT_SPEC.name, op_module.COMBINE_SPEC.name)
    ideal = B * Hkv * kv_len * D * dtype.size
    want = vector_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, dtype.size, plan["rs"])
    if L * Hq // Hkv <= plan["rs"]:
        assert want == ideal  # once for all L queries and all Hq/Hkv heads
    for name in ("k", "v"):
        assert split.bytes_read[name] == want, (
            f"{name}: read {split.bytes_read[name]} bytes, want {want} "
            f"({split.bytes_read[name] / ideal:.3f} x the visible cache)")
    assert split.bytes_read["q"] == plan["n_splits"] * plan["n_simdgroups"] * q.nbytes
    n_out = B * Hq * L
    assert split.bytes_written["o_part"] == n_out * plan["n_splits"] * D * 4
    assert split.bytes_written["ml_part"] == n_out * plan["n_splits"] * 2 * 4
    assert split.grid == plan["grid"] and split.threadgroup == plan["threadgroup"]
    assert split.threadgroup_memory <= plan["threadgroup_memory"]
    assert combine.bytes_read["o_part"] == n_out * plan["n_splits"] * D * 4


def test_negative_control_traffic(launches, vector_path, broken_kernel, rng):
    """Causal tiles that read every key of their slice (same results) fail the count."""
    broken_kernel(op_module.SPLIT_SPEC,
                  ("k_end = min(k_end, kvn - L + l_max + 1u);", "(void)l_max;"))
    with pytest.raises(AssertionError, match="k: read"):
        _run_traffic_case(launches, rng, (1, 2, 2, 32, 64, 64, 64, True), mx.float32)


def test_negative_control_reduce_scatter(kernel_backend, vector_path, broken_kernel, rng):
    """A reduction that drops the partner's half of the scores must fail the oracle."""
    broken_kernel(op_module.SPLIT_SPEC, ("sv[i] = keep + mt_shuffle_xor_converged(give, ushort(h));",
                                         "sv[i] = keep + 0.0f * mt_shuffle_xor_converged(give, ushort(h));"))
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 300, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=300, backend=kernel_backend)


def test_negative_control_stale_weights(kernel_backend, vector_path, broken_kernel, rng):
    """Not rescaling the old o when a batch raises the running max must fail."""
    broken_kernel(op_module.SPLIT_SPEC, ("ov[rr][c] *= kr;", "(void)kr;"))
    q, k, v = make_inputs(rng, 1, 4, 2, 2, 300, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=300, backend=kernel_backend)


# ---- the simdgroups' merge through threadgroup memory (emulator strict mode) -------------

@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(vector_path, rng, seed):
    """Strict mode (no read of threadgroup memory before it is written, no race on it) with
    threads and threadgroups in a permuted order: the result must not change."""
    require_backend("emulator")

    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            for B, Hq, Hkv, L, kv_len, S, D, causal in ((1, 8, 2, 8, 200, 256, 64, True),
                                                        (1, 32, 8, 1, 300, 320, 128, False)):
                q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, mx.float16)
                run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                              backend="emulator")


def test_negative_control_missing_merge_barrier(vector_path, broken_kernel, rng):
    """Merging the simdgroups' partials without waiting for all of them must be caught."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    merge = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  for (uint rr = sg; rr < nr;"
    broken_kernel(op_module.SPLIT_SPEC, (merge, "  for (uint rr = sg; rr < nr;"))
    q, k, v = make_inputs(rng, 1, 8, 2, 2, 300, 64, mx.float16)
    with strict_emulator(1):
        with backends.use_backend("emulator"), pytest.raises((emulator.ThreadgroupRace,
                                                           emulator.UninitializedThreadgroupRead)):
            mx.eval(mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=290))
