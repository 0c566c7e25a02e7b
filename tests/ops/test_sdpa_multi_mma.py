"""sdpa_multi's MMA path (sdpa_multi_mma.metal: the cuda plan's pass 1 for half / bfloat
blocks of queries), forced on every kernel backend: the float64 oracle over shapes, masks,
sinks and device-side kv_len; the plan; K/V traffic from the emulator's counters; strict
mode; negative controls."""

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
from mlx_metaltile.ops._common import clear_plans

DTYPES = (mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")



@pytest.fixture
def mma_path(monkeypatch):
    """Every backend's plan takes the MMA path for half / bfloat, whatever the row count."""
    for backend in ("metal", "cuda", "emulator"):
        monkeypatch.setitem(op_module.SPLIT_PATH, backend, "mma")
    monkeypatch.setattr(op_module, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(op_module, "MMA_MIN_QUERIES", 1)


def mplan(B, Hq, Hkv, L, D, kv_len, dtype):
    return op_module.mma_plan(B, Hq, Hkv, L, D, kv_len, dtype)


def prefetches(D):
    """The MMA kernel's PF for head dim D under the module's constants."""
    return int(op_module.MMA_PREFETCH and D in op_module.MMA_PREFETCH_DIMS)


def assert_mma_ran(launches, dtype, D):
    """The pass-1 launch was the MMA kernel, with the template the plan gives."""
    split = launches[-2]
    assert split.name == op_module.MMA_SPEC.name
    t = dict(split.template)
    assert t["T"] == dtype and t["D"] == D and t["PT"] == op_module.MMA_TERMS[dtype]
    assert t["PF"] == prefetches(D)


@pytest.fixture(params=(True, False), ids=("prefetch", "staged"))
def staging(request, monkeypatch):
    """MMA_PREFETCH forced each way (PF 1 for MMA_PREFETCH_DIMS, or 0 everywhere)."""
    monkeypatch.setattr(op_module, "MMA_PREFETCH", request.param)
    return request.param


# (B, Hq, Hkv, L, kv_len, S, D, causal): GQA 1 / 4 / 8, L 2..16, rows that are not a
# multiple of 8 or of the tile, 1 to 4 simdgroups, several tiles, kv_len from L to several
# slices (31, 32, 33 and not a multiple of the slice), slack, every head dim.
CASES = [
    (1, 4, 4, 2, 2, 8, 64, True),        # GQA 1, kv_len == L: the first query sees one key
    (1, 8, 2, 3, 31, 40, 96, True),      # GQA 4 x L 3 = 12 rows: two simdgroups, ragged
    (2, 8, 1, 4, 33, 33, 128, False),    # GQA 8 x L 4 = 32 rows, batch 2, 33 keys
    (1, 8, 1, 8, 32, 40, 64, True),      # 64 rows: two full tiles, one key block
    (1, 4, 1, 9, 300, 320, 128, False),  # 36 rows: a tile of 4 rows after a full one; slices
    (1, 4, 4, 16, 150, 160, 256, True),  # D 256, GQA 1 x L 16: two simdgroups, two slices
    (1, 16, 2, 3, 200, 200, 64, True),   # GQA 8 x L 3 = 24 rows, causal over two slices
    (1, 4, 2, 5, 70, 96, 96, False),     # GQA 2 x L 5 = 10 rows, slack
]


def case_id(c):
    B, Hq, Hkv, L, kv_len, S, D, causal = c
    return f"B{B}-h{Hq}x{Hkv}-L{L}-kv{kv_len}of{S}-D{D}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_oracle(kernel_backend, mma_path, poisoned_outputs, launches, rng, case, dtype):
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    run_and_check(q, k, v, scale=1.0 / math.sqrt(D), causal=causal, kv_len=kv_len,
                  backend=kernel_backend)
    assert_mma_ran(launches, dtype, D)
    stats = launches[-2].stats
    if stats is not None:  # the emulator: the geometry the plan gives
        plan = mplan(B, Hq, Hkv, L, D, kv_len, dtype)
        assert stats.grid == plan["grid"] and stats.threadgroup == plan["threadgroup"]


def test_cases_cover_the_mma_plan():
    """The case list reaches 1 to 4 simdgroups, several tiles, a ragged last tile, several
    slices and a kv_len that is not a multiple of the slice."""
    plans = [(mplan(B, Hq, Hkv, L, D, kv, mx.float16), c)
             for c in CASES for B, Hq, Hkv, L, kv, S, D, causal in [c]]
    assert {p["n_simdgroups"] for p, _ in plans} == {1, 2, 3, 4}
    assert any(p["n_tiles"] > 1 and p["rows"] % (8 * p["n_simdgroups"]) for p, _ in plans)
    assert any(p["n_splits"] > 1 and c[4] % p["chunk"] for p, c in plans)
    assert {c[1] // c[2] for _, c in plans} >= {1, 4, 8}


@pytest.mark.parametrize("kind", ("bool", "additive", "block", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_masks_and_sinks(kernel_backend, mma_path, poisoned_outputs, launches, rng, kind,
                         dtype):
    """Masks broadcast in place (bool, additive with -inf, the block form), with and
    without sinks, over two slices."""
    B, Hq, Hkv, L, kv_len, S, D = 2, 8, 2, 3, 150, 160, 64
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    mask, causal = make_mask(rng, kind, (B, 1, L, kv_len), (Hq, L, kv_len), L, dtype)
    sinks = mx.array((rng.standard_normal(Hq) * 3).astype(np.float32)).astype(dtype)
    assert mplan(B, Hq, Hkv, L, D, kv_len, dtype)["n_splits"] > 1
    for s in (None, sinks):
        run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len, mask=mask,
                      sinks=s, backend=kernel_backend, what=f" mma {kind}")
        assert_mma_ran(launches, dtype, D)


@pytest.mark.parametrize("kind", ("bool", "additive"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fully_masked_rows(kernel_backend, mma_path, poisoned_outputs, launches, rng, kind,
                           dtype):
    """Rows whose keys are all masked: bool -> v averaged uniformly; additive -inf -> NaN
    (checked by run_and_check); with sinks -> 0."""
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 96, 64, dtype)
    m = rng.random((4, 4, 70)) < 0.5
    m[1, 2] = False
    m[3, :] = False
    mask = mx.array(m) if kind == "bool" else mx.array(np.where(m, 0.0, -np.inf).astype(
        np.float32)).astype(dtype)
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=70, mask=mask,
                  backend=kernel_backend)
    assert_mma_ran(launches, dtype, 64)
    out = run_and_check(q, k, v, scale=0.125, causal=False, kv_len=70, mask=mask,
                        sinks=mx.array([0.5, -1.0, 2.0, 0.0]).astype(dtype),
                        backend=kernel_backend)
    assert (np.array(out.astype(mx.float32))[0, 3] == 0).all()


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_device_kv_len(kernel_backend, mma_path, poisoned_outputs, launches, rng, causal):
    """A 0-d kv_len gives exactly what the same Python int gives (the grid then covers the
    whole cache: slices past kv_len see no key)."""
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 300, 64, mx.float16)
    for n in (4, 33, 250):
        want = run_and_check(q, k, v, scale=0.125, causal=causal, kv_len=n,
                             backend=kernel_backend)
        got = run_and_check(q, k, v, scale=0.125, causal=causal,
                            kv_len=mx.array(n, mx.int32), backend=kernel_backend)
        assert_mma_ran(launches, mx.float16, 64)
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_slack_and_large_values(kernel_backend, mma_path, poisoned_outputs, launches, rng,
                                dtype):
    """NaN/inf past kv_len is never read; |v| near the dtype's top over several slices
    stays finite: o is kept divided by the running sum."""
    q, k, v = make_inputs(rng, 1, 8, 2, 2, 160, 64, dtype)
    k_np, v_np = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    k_np[:, :, 77:] = np.nan
    v_np[:, :, 77:] = np.inf
    run_and_check(q, mx.array(k_np).astype(dtype), mx.array(v_np).astype(dtype), scale=0.125,
                  causal=True, kv_len=77, backend=kernel_backend, what=" (NaN/inf slack)")
    top = {mx.float16: 6e4, mx.bfloat16: 3e38}[dtype]
    q, k, _ = make_inputs(rng, 1, 2, 2, 4, 400, 64, dtype)
    sign = np.where(rng.random((1, 2, 400, 64)) < 0.5, -1.0, 1.0)
    v = mx.array((sign * top).astype(np.float32)).astype(dtype)
    assert mplan(1, 2, 2, 4, 64, 400, dtype)["n_splits"] > 1
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=400, backend=kernel_backend)
    assert_mma_ran(launches, dtype, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale", (1e38, -1e38, 1e30), ids=lambda s: f"scale{s:g}")
def test_scores_beyond_float32(kernel_backend, mma_path, poisoned_outputs, launches, rng,
                               dtype, scale):
    """scale * q.k beyond float32's range over several slices: one-hot softmax."""
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
               for shape in ((1, 2, 4, 64), (1, 2, 300, 64), (1, 2, 300, 64)))
    assert mplan(1, 2, 2, 4, 64, 300, dtype)["n_splits"] > 1
    before = launch_counts(kernel_backend)
    out = mt.sdpa_multi(q, k, v, scale=scale)
    mx.eval(out)
    assert launch_counts(kernel_backend) == (before[0] + 1, before[1] + 1)
    assert_mma_ran(launches, dtype, 64)
    want, _ = oracle(q, k, v, scale, False, 300)
    magnitude, _ = oracle(q, k, mx.abs(v), scale, False, 300)
    assert_close(out, want, dtype, magnitude, what=f"mma path scale {scale:g}")


def test_launches_are_declared_instantiations(kernel_backend, mma_path, launches, rng):
    """Every MMA template the launcher uses is one the spec declares (the CUDA compile check
    builds exactly those)."""
    declared = {inst.template for inst in instantiations(op_module.MMA_SPEC)}
    for dtype, D in itertools.product(DTYPES, op_module.HEAD_DIMS):
        q, k, v = make_inputs(rng, 1, 4, 1, 2, 40, D, dtype)
        for mask in (None, mx.array(rng.random((2, 40)) < 0.7)):
            run_and_check(q, k, v, scale=0.1, causal=False, kv_len=40, mask=mask,
                          backend=kernel_backend)
    splits = [launch.template for launch in launches if launch.name == op_module.MMA_SPEC.name]
    assert len(splits) == 2 * len(DTYPES) * len(op_module.HEAD_DIMS)
    assert all(t in declared for t in splits)


# The prefetch form's edges (B, Hq, Hkv, L, kv_len, S, D, causal): one block only, ragged
# last blocks (33, 95, 1000 keys), 1 to 4 simdgroups (the slots past the threadgroup's
# threads staged at the store), GQA 1 / 4 / 8, several slices.
PREFETCH_CASES = [
    (1, 4, 4, 2, 20, 24, 128, True),      # GQA 1 x L 2: 1 simdgroup, one block of 20 keys
    (1, 8, 2, 4, 33, 40, 64, False),      # GQA 4 x L 4: 2 simdgroups, a last block of 1 key
    (1, 8, 1, 3, 95, 96, 96, True),       # GQA 8 x L 3: 3 simdgroups, causal, 3 blocks
    (1, 8, 1, 4, 1000, 1000, 128, True),  # GQA 8 x L 4: 4 simdgroups, slices, causal
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=case_id)
def test_prefetch_matches_oracle(kernel_backend, mma_path, monkeypatch, poisoned_outputs,
                                 launches, rng, case, dtype):
    """PF 1 forced: the float64 oracle, with and without sinks."""
    monkeypatch.setattr(op_module, "MMA_PREFETCH", True)
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    sinks = mx.array((rng.standard_normal(Hq) * 2).astype(np.float32)).astype(dtype)
    for s in (None, sinks):
        run_and_check(q, k, v, scale=1.0 / math.sqrt(D), causal=causal, kv_len=kv_len,
                      sinks=s, backend=kernel_backend)
        assert_mma_ran(launches, dtype, D)
        assert dict(launches[-2].template)["PF"] == 1


def test_prefetch_cases_cover_its_edges():
    plans = [mplan(B, Hq, Hkv, L, D, kv, mx.float16)
             for B, Hq, Hkv, L, kv, S, D, causal in PREFETCH_CASES]
    assert {p["n_simdgroups"] for p in plans} == {1, 2, 3, 4}
    assert any(p["n_splits"] > 1 for p in plans)
    assert {c[4] for c in PREFETCH_CASES} >= {33, 95, 1000} and min(
        c[4] for c in PREFETCH_CASES) <= 32
    assert {c[6] for c in PREFETCH_CASES} == set(op_module.MMA_PREFETCH_DIMS)


@pytest.mark.parametrize("mask_kind", ("bool", "additive", "block", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefetch_same_bits_as_staged(kernel_backend, mma_path, monkeypatch, launches, rng,
                                      mask_kind, dtype):
    """Both staging forms sum in the same order: the same bits on the emulator, masks and
    sinks included (GQA 4 x L 3: 2 simdgroups; 150 keys over two slices)."""
    B, Hq, Hkv, L, kv_len, S, D = 1, 8, 2, 3, 150, 160, 128
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    mask, causal = make_mask(rng, mask_kind, (1, Hq, L, kv_len), (L, kv_len), L, dtype)
    sinks = mx.array((rng.standard_normal(Hq) * 2).astype(np.float32)).astype(dtype)
    outs = []
    for prefetch in (True, False):
        monkeypatch.setattr(op_module, "MMA_PREFETCH", prefetch)
        clear_plans()  # the constant takes effect in new plans
        outs.append(run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                                  mask=mask, sinks=sinks, backend=kernel_backend))
        assert dict(launches[-2].template)["PF"] == int(prefetch)
    assert mplan(B, Hq, Hkv, L, D, kv_len, dtype)["n_splits"] > 1
    if kernel_backend == "emulator":
        # the emulator runs the MSL as written; on CUDA the two forms are two kernels whose
        # float operations the compiler may contract into FMAs differently (each is checked
        # against the oracle above there)
        assert np.array_equal(np.array(outs[0].astype(mx.float32)),
                              np.array(outs[1].astype(mx.float32)), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_bounded_kernel(kernel_backend, mma_path, monkeypatch, launches, rng, dtype):
    """MMA_BOUNDED: PF 0 with no mask array at D <= 128 launches MMA_BOUNDED_SPEC (a
    declared instantiation) with the unbounded kernel's bits; a mask array, PF 1 or D 256
    keep MMA_SPEC."""
    monkeypatch.setattr(op_module, "MMA_PREFETCH", False)
    declared = {inst.template for inst in instantiations(op_module.MMA_BOUNDED_SPEC)}
    q, k, v = make_inputs(rng, 1, 8, 2, 3, 150, 128, dtype)
    outs = []
    for bounded in (True, False):
        monkeypatch.setattr(op_module, "MMA_BOUNDED", bounded)
        clear_plans()
        outs.append(run_and_check(q, k, v, scale=128 ** -0.5, causal=True, kv_len=150,
                                  backend=kernel_backend))
        split = launches[-2]
        assert split.name == (op_module.MMA_BOUNDED_SPEC if bounded else op_module.MMA_SPEC).name
        assert not bounded or split.template in declared
    assert np.array_equal(np.array(outs[0].astype(mx.float32)),
                          np.array(outs[1].astype(mx.float32)))
    monkeypatch.setattr(op_module, "MMA_BOUNDED", True)
    clear_plans()
    mask = mx.array(rng.random((3, 150)) < 0.7)
    run_and_check(q, k, v, scale=0.1, causal=False, kv_len=150, mask=mask,
                  backend=kernel_backend)
    assert launches[-2].name == op_module.MMA_SPEC.name
    q, k, v = make_inputs(rng, 1, 4, 2, 2, 40, 256, dtype)
    run_and_check(q, k, v, scale=0.1, causal=False, kv_len=40, backend=kernel_backend)
    assert launches[-2].name == op_module.MMA_SPEC.name
    monkeypatch.setattr(op_module, "MMA_PREFETCH", True)
    clear_plans()
    q, k, v = make_inputs(rng, 1, 4, 2, 2, 40, 64, dtype)
    run_and_check(q, k, v, scale=0.1, causal=False, kv_len=40, backend=kernel_backend)
    assert launches[-2].name == op_module.MMA_SPEC.name


# ---- the plan ----------------------------------------------------------------------------

def test_plan():
    """Non-empty slices of whole 32-key blocks covering [0, kv_len), tiles of 8 rows per
    simdgroup, the dispatch limits."""
    for B, Hq, Hkv, L, kv_len, D, dtype in itertools.product(
            (1, 2, 8), (32, 8), (8, 1), (1, 2, 4, 8, 16), (8, 100, 1024, 16384),
            op_module.HEAD_DIMS, DTYPES):
        if kv_len < L:
            continue
        p = mplan(B, Hq, Hkv, L, D, kv_len, dtype)
        rows, nsg = L * Hq // Hkv, p["n_simdgroups"]
        assert 1 <= nsg <= op_module.MMA_SIMDGROUPS and (nsg == op_module.MMA_SIMDGROUPS
                                                          or 8 * nsg >= rows)
        assert p["n_tiles"] == -(-rows // (8 * nsg))
        n, chunk = p["n_splits"], p["chunk"]
        assert chunk % 32 == 0 and (n - 1) * chunk < kv_len <= n * chunk
        assert 1 <= n <= op_module.MMA_MAX_SPLITS
        assert p["threadgroup"] == (32 * nsg, 1, 1) and p["threadgroup_memory"] <= 32 * 1024
        assert p["grid"] == (32 * nsg * p["n_tiles"], n, B * Hkv)
        assert p["pf"] == int(D in op_module.MMA_PREFETCH_DIMS)


def test_which_path_the_cuda_plan_takes(monkeypatch):
    """cuda: the MMA path for half / bfloat from MMA_MIN_ROWS rows and MMA_MIN_QUERIES
    queries, the vector path otherwise (decode, float32, a huge MMA_MIN_ROWS); the Metal
    and emulator plans stay staged."""
    def path(backend, Hq, Hkv, L, dtype):
        return op_module.split_plan(backend, 1, Hq, Hkv, L, 128, 4096, dtype)["path"]

    assert path("cuda", 32, 8, 8, mx.float16) == "mma"   # 32 rows, L 8
    assert path("cuda", 32, 8, 4, mx.bfloat16) == "mma"  # 16 rows, L 4
    assert path("cuda", 32, 8, 2, mx.float16) == "vector"  # 8 rows
    assert path("cuda", 32, 2, 1, mx.float16) == "vector"  # decode, 16 rows
    assert path("cuda", 32, 8, 8, mx.float32) == "vector"
    assert path("metal", 32, 8, 8, mx.float16) == "staged"
    assert path("emulator", 32, 8, 8, mx.float16) == "staged"
    monkeypatch.setattr(op_module, "MMA_MIN_ROWS", 1 << 30)
    assert path("cuda", 32, 8, 8, mx.float16) == "vector"
    with pytest.raises(ValueError, match=r"^\[sdpa_multi\] the MMA path takes float16"):
        op_module.mma_plan(1, 4, 1, 4, 64, 100, mx.float32)


# ---- device traffic (emulator counters) -------------------------------------------------

def mma_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, itemsize, tile_rows):
    """Bytes of k (or v) the MMA path reads: each tile of tile_rows query rows reads the
    keys its rows see ([0, kv_len), or up to its latest causal query's last key) once, in
    whole 32-key blocks of its slices (a block's rows past the slice's end are not read)."""
    rows = L * (Hq // Hkv)
    keys = 0
    for t0 in range(0, rows, tile_rows):
        last_l = max(r % L for r in range(t0, min(t0 + tile_rows, rows)))
        keys += kv_len - L + last_l + 1 if causal else kv_len
    return B * Hkv * keys * D * itemsize


@pytest.mark.parametrize("case", [
    (2, 8, 2, 4, 150, 200, 64, False),   # 16 rows: K/V once, over two slices
    (1, 32, 8, 8, 300, 320, 128, True),  # 32 rows (GQA 4 x L 8), causal
    (1, 8, 1, 8, 100, 128, 64, True),    # 64 rows: two tiles, causal
], ids=case_id)
def test_cache_is_read_once_per_tile(launches, mma_path, rng, case):
    """From the emulator's counters: each visible K/V byte once per tile of up to 32 rows
    (a causal tile stops at its latest query's last key); q once per slice; partials
    written once per slice."""
    require_backend("emulator")
    B, Hq, Hkv, L, kv_len, S, D, causal = case
    dtype = mx.float16
    plan = mplan(B, Hq, Hkv, L, D, kv_len, dtype)
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with backends.use_backend("emulator"):
        run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                      backend="emulator")
    (name1, split), (name2, combine) = ((launch.name, launch.stats) for launch in launches)
    assert (name1, name2) == (op_module.MMA_SPEC.name, op_module.COMBINE_SPEC.name)
    want = mma_bytes_read(B, Hq, Hkv, L, kv_len, D, causal, dtype.size,
                          8 * plan["n_simdgroups"])
    for name in ("k", "v"):
        assert split.bytes_read[name] == want, (
            f"{name}: read {split.bytes_read[name]} bytes, want {want}")
    assert split.bytes_read["q"] == plan["n_splits"] * q.nbytes
    n_out = B * Hq * L
    assert split.bytes_written["o_part"] == n_out * plan["n_splits"] * D * 4
    assert split.bytes_written["ml_part"] == n_out * plan["n_splits"] * 2 * 4
    assert split.grid == plan["grid"] and split.threadgroup == plan["threadgroup"]
    assert split.threadgroup_memory <= plan["threadgroup_memory"]


def test_negative_control_unguarded_prefetch(launches, mma_path, broken_kernel, rng):
    """A prefetch of the block after the slice's last one (its guard dropped) reads K rows
    that no query of the slice sees: the traffic check must catch it."""
    require_backend("emulator")
    broken_kernel(op_module.MMA_SPEC, ("if (kb + 32u < k_end) {", "if (kb < k_end) {"),
                  ("min(32u, k_end - kb - 32u)", "32u"))
    B, Hq, Hkv, L, kv_len, S, D = 1, 8, 2, 4, 150, 256, 64
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, mx.float16)
    with backends.use_backend("emulator"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=kv_len, backend="emulator")
    split = launches[-2]
    assert split.name == op_module.MMA_SPEC.name and dict(split.template)["PF"] == 1
    want = mma_bytes_read(B, Hq, Hkv, L, kv_len, D, False, 2,
                          8 * mplan(B, Hq, Hkv, L, D, kv_len, mx.float16)["n_simdgroups"])
    assert split.stats.bytes_read["k"] > want


# ---- strict mode and negative controls ---------------------------------------------------

@pytest.mark.parametrize("seed", (1, 2))
def test_emulator_strict_shuffled(mma_path, staging, rng, seed):
    """Strict mode (no read of threadgroup memory before it is written, no race on it) with
    threads and threadgroups in a permuted order, each staging form: the result must not
    change."""
    require_backend("emulator")
    with strict_emulator(seed):
        with backends.use_backend("emulator"):
            # K and V tiles apart (4 simdgroups, then 2: slots staged at the store), one
            # tile for both
            for D, Hq in ((128, 8), (64, 2), (256, 8)):
                q, k, v = make_inputs(rng, 1, Hq, 1, 5, 100, D, mx.bfloat16)
                run_and_check(q, k, v, scale=D ** -0.5, causal=True, kv_len=90,
                              backend="emulator")


@pytest.mark.parametrize("form", ("kv-apart", "kv-shared", "prefetch-k", "prefetch-v"))
def test_negative_control_missing_barrier(mma_path, monkeypatch, broken_kernel, rng, form):
    """Reading a staged K (D 64: K and V apart) or V block (D 256: one tile for both)
    without waiting for all of it must be caught; so must the prefetch form (D 64) reading
    K or V without a barrier after its store."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    staged, D = {
        "kv-apart": (f"nk, 32u, tid, n_threads);\n    }}\n  }}\n  {barrier}\n", 64),
        "kv-shared": (f"nk, 32u, tid, n_threads);\n    {barrier}\n  }}\n", 256),
        # the block's first barrier, after either form's K store
        "prefetch-k": (f"nk, 32u, tid, n_threads);\n    }}\n  }}\n  {barrier}\n", 64),
        "prefetch-v": (f"tid);\n    }}\n    {barrier}\n  }} else if", 64),
    }[form]
    broken_kernel(op_module.MMA_SPEC, (staged, staged.replace(barrier, "", 1)))
    monkeypatch.setattr(op_module, "MMA_PREFETCH", form.startswith("prefetch"))
    q, k, v = make_inputs(rng, 1, 8, 1, 5, 100, D, mx.float16)
    with strict_emulator(1):
        with backends.use_backend("emulator"), pytest.raises((emulator.ThreadgroupRace,
                                                           emulator.UninitializedThreadgroupRead)):
            mx.eval(mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=90))


def test_negative_control_unstaged_slots(mma_path, broken_kernel, rng):
    """PF 1 with 2 simdgroups: dropping the store-time staging of the slots past the
    threadgroup's threads leaves half of each block unwritten: strict mode must catch it."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    broken_kernel(op_module.MMA_SPEC, ("slot < 128u;", "slot < n_threads;"))
    q, k, v = make_inputs(rng, 1, 2, 1, 5, 100, 64, mx.float16)
    assert mplan(1, 2, 1, 5, 64, 90, mx.float16)["n_simdgroups"] == 2
    with strict_emulator(1):
        with backends.use_backend("emulator"), pytest.raises(
                emulator.UninitializedThreadgroupRead):
            mx.eval(mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=90))


@pytest.mark.parametrize("edit", [
    ("of[i].thread_elements()[0] *= keep;", "(void)keep;"),     # o not rescaled
    ("(1.0f / TERM_SCALE)", "1.0f"),                           # half's second term unweighted
    ("kb + uint(j * 8 + e) + fn", "kb + uint(j * 8 + e) + fn + 1u"),  # keys shifted by one
], ids=("no-rescale", "term-weight", "key-shift"))
def test_negative_controls(kernel_backend, mma_path, broken_kernel, rng, edit):
    """An MMA kernel broken in each of these ways must fail the oracle check."""
    broken_kernel(op_module.MMA_SPEC, edit)
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 200, 64, mx.float16)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=True, kv_len=190, backend=kernel_backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_negative_control_one_term(kernel_backend, mma_path, broken_kernel, rng, dtype):
    """Probabilities rounded once to T (the terms after the first dropped) must fail: the
    split of PROBABILITIES IN T is what keeps the MMA path inside the tolerance table."""
    broken_kernel(op_module.MMA_SPEC,
                  ("mt_mma_pair(of[i], pf[0][j], lo, pf[1][j], vf[j]);",
                   "simdgroup_multiply_accumulate(of[i], pf[0][j], vf[j], of[i]);"),
                  ("simdgroup_multiply_accumulate(lo, pf[t][j], vf[j], lo);", "(void)t;"))
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 300, 64, dtype)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=300, backend=kernel_backend)
