"""sdpa_multi's backward kernels (the VJP on a kernel backend): gradients w.r.t. q, k, v,
the sinks and an additive mask against float64 gradients written from the math
(mlx_metaltile.cases.sdpa_multi.grad_oracle), with one slice of the keys (every backend)
and with the keys split (slices of SPLIT_CHUNK keys; tiles of 1, 2, 4 and 8 simdgroups as
the plan picks them from G*L and D), the emulator's traffic counters, determinism, results
that do not depend on the tiles' simdgroups nor on the dk/dv kernel's column split (CPS),
the tiles' cap from the threadgroup memory, the kernels in strict mode, the plan's rule
and negative controls per backward kernel."""

from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import require_backend, strict_emulator

from mlx_metaltile import _templates, backends
from mlx_metaltile._registry import instantiations
from mlx_metaltile.cases.sdpa_multi import (
    backward_one_slice,
    backward_split,
    make_inputs,
    run_grad_and_check,
)
from mlx_metaltile.ops._common import clear_plans

sdpa = importlib.import_module("mlx_metaltile.ops.sdpa_multi")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DT_IDS = ("float32", "float16", "bfloat16")

# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


# The dq side's forms: one slice covering every key forced on every backend (cuda's plan
# splits most of these shapes), or the key split forced with slices of SPLIT_CHUNK keys (slices
# that do not divide kv_len, empty ones past kv_len or past a causal tile's last key). The
# reference backend has no kernels to split.
SPLIT_CHUNK = 32
FORMS = (None, SPLIT_CHUNK)
FORM_IDS = ("one_slice", "split")


def split_form(backend, chunk):
    """The context of a test's form: ``backward_one_slice()`` (chunk None), or
    ``backward_split(chunk)`` on a kernel backend."""
    if chunk is None:
        return backward_one_slice()
    if backend == "reference":
        pytest.skip("the reference backend has no backward kernels to split")
    return backward_split(chunk, backend)


def check(backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, causal=False, mask=None,
          sinks=None, what="", chunk=None):
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with split_form(backend, chunk):
        return run_grad_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len,
                                  backend=backend, rng=rng, mask=mask, sinks=sinks,
                                  what=what)


# (Hq, Hkv, L, kv_len, S): kv_len 1, 31, 32, 33 and ragged tails with slack past kv_len,
# GQA ratios 1, 4 and 8, row tiles of 1, 3, 8, 16 queries (G*L up to 128: four row tiles;
# split, tiles of 1, 4 and 8 simdgroups).
SHAPES = [
    (2, 2, 1, 1, 4),
    (4, 1, 1, 31, 40),
    (4, 4, 3, 32, 32),
    (8, 2, 3, 33, 50),
    (8, 1, 8, 33, 40),
    (16, 2, 16, 70, 100),
    (8, 1, 16, 131, 140),
]


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}x{s[1]}-L{s[2]}-kv{s[3]}")
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_shapes(any_backend, rng, dtype, D, shape, causal, chunk):
    Hq, Hkv, L, kv_len, S = shape
    check(any_backend, rng, 1, Hq, Hkv, L, S, D, dtype, kv_len, causal, chunk=chunk)


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_head_dim_256(any_backend, rng, dtype, chunk):
    """D = 256 (float32 stages 16 keys at a time in the dq kernels), batch 2, GQA 4."""
    check(any_backend, rng, 2, 8, 2, 5, 80, 256, dtype, 70, causal=True, chunk=chunk)


# (Hq, Hkv, L, kv_len, S, chunk) for the split form: causal blocks of L > 32 queries (a row
# tile ends before the last key: its late slices see nothing), slices of 64 and 96 keys
# that do not divide kv_len, G*L = 6 and 12 (tiles of 2 and 4 simdgroups).
SPLIT_SHAPES = [
    (1, 1, 64, 70, 80, 32),
    (2, 1, 40, 45, 64, 32),
    (4, 2, 48, 130, 140, 64),
    (8, 2, 3, 200, 210, 96),
    (8, 4, 3, 45, 60, 32),
]


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SPLIT_SHAPES,
                         ids=lambda s: f"h{s[0]}x{s[1]}-L{s[2]}-kv{s[3]}-c{s[5]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_split_slices(kernel_backend, rng, dtype, shape, causal):
    """The key-split form where slices end early or hold nothing: each slice's partial dq is
    written (outputs start as NaN) and the partials sum to the float64 gradient."""
    Hq, Hkv, L, kv_len, S, chunk = shape
    check(kernel_backend, rng, 1, Hq, Hkv, L, S, 64, dtype, kv_len, causal, chunk=chunk)


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("scale", (3.0, -2.0, 1e30))
@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16), ids=("float32", "bfloat16"))
def test_sdpa_vjp_scale_range(any_backend, rng, dtype, scale, chunk):
    """Scales past 1 (scores held in units of a power of two b > 1) and far past float32's
    score range: every backward kernel computes a score in the same order (the same bits),
    so no probability recomputed from the statistics (merged from slices in the split form)
    overflows or drops its row's top key."""
    q, k, v = make_inputs(rng, 1, 4, 2, 3, 40, 64, dtype)
    mask = mx.array(rng.standard_normal((3, 37)).astype(np.float32)).astype(dtype)
    sinks = mx.array([0.5, 1.0, 2.0, 3.0]).astype(dtype)
    with split_form(any_backend, chunk):
        run_grad_and_check(q, k, v, scale=scale, causal=False, kv_len=37,
                           backend=any_backend, rng=rng, mask=mask, sinks=sinks)


def _bool(rng, shape, p=0.6):
    return mx.array(rng.random(shape) < p)


def _additive(rng, shape, dtype, p_inf=0.3):
    m = rng.standard_normal(shape) * 2.0
    m[rng.random(shape) < p_inf] = -np.inf
    return mx.array(m.astype(np.float32)).astype(dtype)


MASK_SHAPES = {
    "full-4d": lambda B, H, L, n: (B, H, L, n),
    "per-query": lambda B, H, L, n: (L, n),  # broadcast over batch and heads
    "per-head": lambda B, H, L, n: (1, H, 1, n),  # broadcast over queries
    "block-4d": lambda B, H, L, n: (B, H, L, L),  # the last L keys only
    "block-2d": lambda B, H, L, n: (L, L),
}


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ("bool", "additive"))
@pytest.mark.parametrize("form", MASK_SHAPES)
def test_sdpa_vjp_masks(any_backend, rng, form, kind, dtype, chunk):
    """Every mask form; an additive mask (with -inf entries) gets its gradient dS summed
    over its broadcast axes."""
    B, Hq, Hkv, L, kv_len, S, D = 2, 8, 2, 4, 45, 64, 64
    shape = MASK_SHAPES[form](B, Hq, L, kv_len)
    mask = _bool(rng, shape) if kind == "bool" else _additive(rng, shape, dtype)
    check(any_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, mask=mask, chunk=chunk)


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("with_mask", (False, True), ids=("sinks", "sinks+additive"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_sinks(any_backend, rng, dtype, with_mask, chunk):
    B, Hq, Hkv, L, kv_len, S, D = 2, 8, 1, 3, 40, 48, 64
    sinks = mx.array(rng.uniform(-1, 3, size=(Hq,)).astype(np.float32)).astype(dtype)
    mask = _additive(rng, (Hq, L, kv_len), dtype) if with_mask else None
    check(any_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, causal=not with_mask,
          mask=mask, sinks=sinks, chunk=chunk)


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("mask_kind", ("causal", "block-bool", "block-additive"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_device_kv_len(any_backend, rng, dtype, mask_kind, chunk):
    """A 0-d kv_len read on device (any array mask is then the block form): cache rows
    past it get zero gradient. Split, the slices cover all S = 90 rows: the third
    ([64, 90)) lies past kv_len and sees no key."""
    B, Hq, Hkv, L, S, D = 1, 8, 2, 4, 90, 64
    kv_len = mx.array(57, dtype=mx.int32)
    mask = (None if mask_kind == "causal" else _bool(rng, (L, L)) if mask_kind == "block-bool"
            else _additive(rng, (1, Hq, L, L), dtype))
    grads = check(any_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len,
                  causal=mask_kind == "causal", mask=mask, chunk=chunk)
    for name in ("dk", "dv"):
        assert not np.any(np.array(grads[name].astype(mx.float32))[:, :, 57:]), name


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("sink", (False, True), ids=("no_sink", "sink"))
@pytest.mark.parametrize("kind", ("bool", "additive"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_fully_masked_rows(any_backend, rng, dtype, kind, sink, chunk):
    """Rows whose keys a mask hides all, as the forward gives them (MLX's rules): bool, a
    uniform average (dv finite, no dq/dk term); additive -inf, NaN without a sink (NaN
    gradients, as the float64 definition) and 0 with one (finite gradients)."""
    B, Hq, Hkv, L, kv_len, S, D = 1, 4, 2, 3, 35, 40, 64
    if kind == "bool":
        m = rng.random((Hq, L, kv_len)) < 0.6
        m[1, 2] = False
        mask = mx.array(m)
    else:
        m = rng.standard_normal((Hq, L, kv_len)).astype(np.float32)
        m[1, 2] = -np.inf
        mask = mx.array(m).astype(dtype)
    sinks = (mx.array(rng.uniform(-1, 1, size=(Hq,)).astype(np.float32)).astype(dtype)
             if sink else None)
    if any_backend == "reference" and kind == "additive" and not sink:
        # MLX's autodiff of the composite: mx.where's VJP multiplies the cotangent by the
        # condition, so the NaN row's cotangent leaks NaN into the k rows past kv_len
        # (documented in the README); the kernels' VJP gives them 0.
        with pytest.raises(AssertionError, match=r"dk .*got np.float64\(nan\), want "
                                                 r"np.float64\(0.0\)"):
            check(any_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, mask=mask,
                  chunk=chunk)
        return
    grads = check(any_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, mask=mask,
                  sinks=sinks, chunk=chunk)
    nan_row = np.isnan(np.array(grads["dq"].astype(mx.float32))[0, 1, 2])
    assert nan_row.all() == (kind == "additive" and not sink)


@pytest.mark.parametrize("L", (1, 3))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_split_more_slices_than_keys(kernel_backend, rng, dtype, L):
    """A device-side kv_len of 3 in a cache of 200 rows: the split form's slices cover all
    200 (seven of 32 keys), six of them past kv_len with no key to see."""
    check(kernel_backend, rng, 1, 8, 2, L, 200, 64, dtype, mx.array(3, dtype=mx.int32),
          causal=L > 1, chunk=SPLIT_CHUNK)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_split_empty_slices_write_zeros(kernel_backend, monkeypatch, rng, dtype):
    """The split dq kernel's partials themselves: a causal block of 64 queries over 70 keys
    in slices of 32 (the first row tile sees keys < 38: its third slice nothing), and a
    device-side kv_len of 40 in a cache of 96 (the third slice lies past kv_len): those
    slices write exact zeros (outputs start as NaN), the others finite values."""
    parts = []
    real_call = backends.Prepared.__call__

    def spy(prepared, *arrays):
        outs = real_call(prepared, *arrays)
        if prepared.spec == sdpa.BWD_DQ_SPLIT_SPEC:
            parts.append(outs[0])
        return outs

    monkeypatch.setattr(backends.Prepared, "__call__", spy)
    check(kernel_backend, rng, 1, 1, 1, 64, 80, 64, dtype, 70, causal=True,
          chunk=SPLIT_CHUNK)
    check(kernel_backend, rng, 1, 4, 2, 2, 96, 64, dtype, mx.array(40, dtype=mx.int32),
          causal=True, chunk=SPLIT_CHUNK)
    causal, past = (np.array(p) for p in parts)
    assert causal.shape == (1, 3, 64, 64) and past.shape == (2, 3, 4, 64)
    assert not causal[0, 2, :32].any() and causal[0, 2, 32:].any()
    assert not past[:, 2].any()
    assert np.isfinite(causal).all() and np.isfinite(past).all()


def test_sdpa_backward_traffic(launches, rng):
    """The emulator's counters for one VJP with one slice (the emulator's plan; B=1,
    Hq=16, Hkv=2, L=5: G*L = 40 rows, two row tiles of 8 simdgroups; kv_len 70 of S 100;
    D 64, bfloat16): the statistics kernel and the split dq kernel each read every K and V
    row below kv_len once per row tile, the dk/dv kernel once; no row at or past kv_len is
    read. q and dO are read once by each of the first two kernels and once per 32-key block
    by the dk/dv kernel; dq's one float32 partial, dk and dv (over all S rows) are written
    once."""
    require_backend("emulator")
    B, Hq, Hkv, L, kv_len, S, D, dtype = 1, 16, 2, 5, 70, 100, 64, mx.bfloat16
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    plan = sdpa.backward_plan("emulator", B, Hq, Hkv, L, D, kv_len, dtype)
    with backends.use_backend("emulator"):
        run_grad_and_check(q, k, v, scale=0.125, causal=False, kv_len=kv_len,
                           backend="emulator", rng=rng)
    stats = {rec.name: rec.stats for rec in launches}
    parts = (stats["sdpa_multi_backward_stats"], stats["sdpa_multi_backward_dq_split"])
    dkv = stats["sdpa_multi_backward_dkv"]
    row = D * 2  # bytes of one K / V / q row
    visible = B * Hkv * kv_len * row
    tiles = 2
    assert plan["n_splits"] == 1 and plan["n_sg"] == 8 and plan["n_tiles"] == tiles
    q_bytes = B * Hq * L * row
    for kernel in parts:
        for name in ("k", "v"):
            assert kernel.bytes_read[name] == tiles * visible, name
        assert kernel.bytes_read["q"] == q_bytes and kernel.bytes_read["dout"] == q_bytes
    for name in ("k", "v"):
        assert dkv.bytes_read[name] == visible, name
    blocks = -(-kv_len // 32)
    assert dkv.bytes_read["q"] == blocks * q_bytes and dkv.bytes_read["dout"] == blocks * q_bytes
    assert parts[1].bytes_written["dq_part"] == B * Hq * L * D * 4
    for name in ("dk", "dv"):
        assert dkv.bytes_written[name] == B * Hkv * S * row, name


@pytest.mark.parametrize("n_sg, tiles", [(None, 2), (1, 10)], ids=("plan", "n_sg1"))
def test_sdpa_backward_split_traffic(launches, rng, n_sg, tiles):
    """The split form's counters (test_sdpa_backward_traffic's problem, slices of 32 keys:
    three, the last one 6 keys long; G*L = 40 rows in tiles of 32 (the plan's 8 simdgroups)
    or of 4 (1 simdgroup forced)): the statistics kernel and the split dq kernel each read
    every K and V row below kv_len once per row tile, nothing at or past kv_len; q and dO
    once per slice."""
    require_backend("emulator")
    B, Hq, Hkv, L, kv_len, S, D, dtype = 1, 16, 2, 5, 70, 100, 64, mx.bfloat16
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with backends.use_backend("emulator"), backward_split(SPLIT_CHUNK, "emulator", n_sg):
        plan = sdpa.backward_plan("emulator", B, Hq, Hkv, L, D, kv_len, dtype)
        run_grad_and_check(q, k, v, scale=0.125, causal=False, kv_len=kv_len,
                           backend="emulator", rng=rng)
    stats = {rec.name: rec.stats for rec in launches}
    parts = (stats["sdpa_multi_backward_stats"], stats["sdpa_multi_backward_dq_split"])
    row = D * 2
    visible = B * Hkv * kv_len * row
    n_splits = 3
    assert plan["n_tiles"] == tiles and plan["n_splits"] == n_splits
    q_bytes = B * Hq * L * row
    for kernel in parts:
        for name in ("k", "v"):
            assert kernel.bytes_read[name] == tiles * visible, name
        assert kernel.bytes_read["q"] == n_splits * q_bytes
        assert kernel.bytes_read["dout"] == n_splits * q_bytes
    assert parts[1].bytes_written["dq_part"] == n_splits * B * Hq * L * D * 4
    assert stats["sdpa_multi_backward_dkv"].bytes_read["k"] == visible


# (B, Hq, Hkv, L, S, D, kv_len, kind) for the dk/dv kernel's column splits: every head dim
# (NSG = D / CPS from 2 to 16 simdgroups), S not a multiple of 32 with ragged kv_len (the
# last key block part past kv_len, part past S), G*L not a multiple of the rows staged at a
# time (RB 16 at D 64, 8 at D 96 and 128, 4 at D 256) and G*L = 1; causal, bool and additive
# masks (full and block forms), sinks, a device-side kv_len.
DKV_COLUMN_CASES = [
    (1, 4, 1, 5, 45, 64, 37, "causal"),  # G*L = 20: a block of 16 rows, then 4
    (1, 2, 2, 1, 40, 96, 33, "additive"),  # G*L = 1
    (2, 6, 2, 3, 70, 128, 66, "bool+sinks"),  # G*L = 9
    (1, 8, 2, 3, 50, 256, 41, "block-additive+sinks"),  # G*L = 12, kv_len on device
    (1, 1, 1, 1, 33, 256, 33, "causal"),  # G*L = 1, one key in the second block
]


@pytest.mark.parametrize("cps", sdpa.BWD_DKV_COLS_CHOICES)
@pytest.mark.parametrize("case", DKV_COLUMN_CASES,
                         ids=lambda c: f"d{c[5]}-h{c[1]}x{c[2]}-L{c[3]}-kv{c[6]}-{c[7]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sdpa_vjp_dkv_columns(kernel_backend, monkeypatch, launches, rng, dtype, case, cps):
    """The dk/dv kernel at each declared CPS (BWD_DKV_COLS forced, new plans): its column
    split over NSG = D / CPS simdgroups against the float64 gradients, and the launch's
    geometry (32 * NSG threads) a declared instantiation."""
    B, Hq, Hkv, L, S, D, kv_len, kind = case
    monkeypatch.setattr(sdpa, "BWD_DKV_COLS", cps)
    clear_plans()  # the constant takes effect in new plans
    mask, causal, sinks = None, kind == "causal", None
    cols = L if kind.startswith("block") else kv_len
    if "additive" in kind:
        mask = _additive(rng, (1, Hq, L, cols), dtype)
    elif "bool" in kind:
        mask = _bool(rng, (L, cols))
    if "sinks" in kind:
        sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(dtype)
    if kind.startswith("block"):
        kv_len = mx.array(kv_len, dtype=mx.int32)
    try:
        check(kernel_backend, rng, B, Hq, Hkv, L, S, D, dtype, kv_len, causal=causal,
              mask=mask, sinks=sinks)
    finally:
        clear_plans()
    (dkv,) = [rec for rec in launches if rec.name == sdpa.BWD_DKV_SPEC.name]
    assert dict(dkv.template)["CPS"] == cps
    declared = {inst.template for inst in instantiations(sdpa.BWD_DKV_SPEC)}
    assert dkv.template in declared


@pytest.mark.parametrize("cps", sdpa.BWD_DKV_COLS_CHOICES)
@pytest.mark.parametrize("seed", (1, 2))
def test_sdpa_backward_dkv_strict_shuffled(monkeypatch, rng, seed, cps):
    """The dk/dv kernel in strict mode (no read of threadgroup memory before it is written,
    no race on it: the staged rows and the score chunks) with threads and
    threadgroups in a permuted order, at each CPS: D 64 (16 rows staged, G*L = 20) and D 256
    (4 rows staged, G*L = 6) with an additive block mask and sinks; the bits do not change
    with the order."""
    require_backend("emulator")
    monkeypatch.setattr(sdpa, "BWD_DKV_COLS", cps)
    clear_plans()
    runs = []
    try:
        for D, Hq, L in ((64, 4, 5), (256, 6, 1)):
            q, k, v = make_inputs(rng, 1, Hq, 1, L, 70, D, mx.bfloat16)
            g = mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
            mask = _additive(rng, (1, Hq, L, L), mx.bfloat16)
            sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(
                mx.bfloat16)
            kw = {"scale": D ** -0.5, "kv_len": mx.array(61, dtype=mx.int32)}

            def fn(q, k, v, m, s, kw=kw):
                return sdpa.sdpa_multi(q, k, v, mask=m, sinks=s, **kw)

            for strict in (False, True):
                with backends.use_backend("emulator"), backward_one_slice(), (
                        strict_emulator(seed) if strict else contextlib.nullcontext()):
                    grads = mx.vjp(fn, [q, k, v, mask, sinks], [g])[1]
                    mx.eval(grads)
                runs.append([np.array(a.astype(mx.float32)) for a in grads])
            with backends.use_backend("emulator"), backward_one_slice(), strict_emulator(seed):
                run_grad_and_check(q, k, v, backend="emulator", rng=rng, mask=mask,
                                   sinks=sinks, causal=False, **kw)
    finally:
        clear_plans()
    for plain, strict in zip(runs[::2], runs[1::2], strict=True):
        for a, b in zip(plain, strict, strict=True):
            assert np.array_equal(a, b, equal_nan=True)


def test_sdpa_backward_dkv_negative_control_barrier(broken_kernel, rng):
    """Reading the score chunks without the barrier after they are written must be caught
    by strict mode."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    written = f"vr + cc * MT_SCORE_CHUNK);\n    }}\n  }}\n  {barrier}\n"
    assert written in _templates.read_text(sdpa.BWD_DKV_SPEC.template)
    broken_kernel(sdpa.BWD_DKV_SPEC, (written, written.replace(barrier, "", 1)))
    q, k, v = make_inputs(rng, 1, 4, 1, 5, 70, 64, mx.float32)
    with strict_emulator(1), backends.use_backend("emulator"), backward_one_slice(), \
            pytest.raises((emulator.ThreadgroupRace, emulator.UninitializedThreadgroupRead)):
        run_grad_and_check(q, k, v, scale=0.125, causal=True, kv_len=61, backend="emulator",
                           rng=rng)


def test_sdpa_backward_dkv_geometry():
    """The dk/dv kernel's threadgroup (32 * D / CPS threads) and threadgroup memory (RB
    rows of q and dO in T, stats, the [D / 16][RB][32] score chunks x 2, whatever CPS)
    within the backends' limits for every head dim, dtype and declared CPS."""
    for cps in sdpa.BWD_DKV_COLS_CHOICES:
        for D in sdpa.HEAD_DIMS:
            for dtype in DTYPES:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(sdpa, "BWD_DKV_COLS", cps)
                    threads, memory = sdpa._bwd_dkv_geometry(D, dtype)
                assert threads == 32 * (D // cps) and threads % 32 == 0 and threads <= 1024
                assert memory <= backends.MAX_THREADGROUP_MEMORY, (cps, D, dtype, memory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdpa, "BWD_DKV_COLS", 8)
        with pytest.raises(ValueError, match=r"\[sdpa_multi\] BWD_DKV_COLS must be one of"):
            sdpa._bwd_dkv_geometry(64, mx.float32)


@pytest.mark.parametrize("case", ("d64-additive+sinks", "d256-causal-device-kv_len",
                                  "d128-scale1e30"))
def test_sdpa_backward_dkv_columns_same_bits(kernel_backend, monkeypatch, rng, case):
    """The dk/dv kernel at CPS 16 and 32 gives the same dq, dk, dv, dsinks and dmask bits:
    every simdgroup writes its 16-column score chunks and every lane sums all D / 16 of
    them in chunk order (common.h's backward score expression), whatever the columns per
    simdgroup."""
    D, dtype = {"d64": (64, mx.float32), "d256": (256, mx.bfloat16),
                "d128": (128, mx.bfloat16)}[case.split("-")[0]]
    Hq, L = 4, 3
    q, k, v = make_inputs(rng, 1, Hq, 2, L, 70, D, dtype)
    g = mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(dtype)
    sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(dtype)
    mask = _additive(rng, (Hq, L, 61), dtype, p_inf=0.1)
    kw = {"scale": D ** -0.5, "kv_len": 61, "mask": mask}
    if "causal" in case:
        kw = {"scale": D ** -0.5, "causal": True, "kv_len": mx.array(45, dtype=mx.int32)}
    elif "1e30" in case:
        kw["scale"] = 1e30

    def fn(q, k, v, s, *m):
        return sdpa.sdpa_multi(q, k, v, sinks=s, **{**kw, **({"mask": m[0]} if m else {})})

    primals = [q, k, v, sinks] + ([mask] if "mask" in kw else [])
    runs = []
    for cps in sdpa.BWD_DKV_COLS_CHOICES:
        monkeypatch.setattr(sdpa, "BWD_DKV_COLS", cps)
        clear_plans()  # the constant takes effect in new plans
        before = backends.launch_count(sdpa.BWD_DKV_SPEC.name, kernel_backend)
        try:
            with backward_one_slice():
                grads = mx.vjp(fn, primals, [g])[1]
                mx.eval(grads)
        finally:
            clear_plans()
        assert backends.launch_count(sdpa.BWD_DKV_SPEC.name, kernel_backend) == before + 1
        runs.append([np.array(a.astype(mx.float32)) for a in grads])
    names = ("dq", "dk", "dv", "dsinks", "dmask")[:len(primals)]
    for name, a, b in zip(names, *runs, strict=True):
        assert np.array_equal(a, b, equal_nan=True), (case, name)
        assert np.isfinite(a).all(), (case, name)


@pytest.mark.parametrize("chunk", FORMS, ids=FORM_IDS)
def test_sdpa_backward_deterministic(kernel_backend, rng, chunk):
    """The same bits on a second run (dk/dv summed in a fixed order, no atomics; split, the
    slices' statistics merged and their dq partials summed in a fixed order)."""
    q, k, v = make_inputs(rng, 1, 8, 1, 8, 70, 64, mx.float32)
    g = mx.array(rng.standard_normal(q.shape).astype(np.float32))
    fn = lambda q, k, v: sdpa.sdpa_multi(q, k, v, scale=0.125, causal=True)  # noqa: E731
    with split_form(kernel_backend, chunk):
        runs = [mx.vjp(fn, [q, k, v], [g])[1] for _ in range(2)]
        mx.eval(runs)
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("form", ("causal+sinks", "additive+sinks", "device-kv_len"))
def test_sdpa_backward_split_simdgroups_same_bits(kernel_backend, rng, form):
    """The split kernels' tiles of 1, 2, 4 and 8 simdgroups (forced; the same slices of 32
    keys) give the same dq, dk, dv and dsinks bits: a row's statistics and dq partials do
    not depend on its tile (G*L = 32 rows: 8 tiles of 4 rows down to one of 32)."""
    B, Hq, Hkv, L, S, D, dtype = 1, 8, 1, 4, 80, 64, mx.float16
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    g = mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(dtype)
    sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(dtype)
    kw = {"scale": 0.125, "causal": form == "causal+sinks", "kv_len": 70}
    if form == "additive+sinks":
        kw["mask"] = _additive(rng, (Hq, L, 70), dtype)
    if form == "device-kv_len":
        kw = {"scale": 0.125, "causal": True, "kv_len": mx.array(45, dtype=mx.int32)}
    fn = lambda q, k, v, s: sdpa.sdpa_multi(q, k, v, sinks=s, **kw)  # noqa: E731
    runs = []
    for n_sg in sdpa.SPLIT_SIMDGROUPS:
        with backward_split(SPLIT_CHUNK, kernel_backend, n_sg):
            grads = mx.vjp(fn, [q, k, v, sinks], [g])[1]
            mx.eval(grads)
        runs.append([np.array(a.astype(mx.float32)) for a in grads])
    for n_sg, run in zip(sdpa.SPLIT_SIMDGROUPS, runs, strict=True):
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), run, runs[-1], strict=True):
            assert np.array_equal(a, b, equal_nan=True), (n_sg, name)


@pytest.mark.parametrize("seed", (1, 2))
def test_sdpa_backward_split_strict_shuffled(rng, seed):
    """The statistics and split dq kernels in strict mode (no read of threadgroup memory
    before it is written, no race on it: the staged K/V block, the rows of a * q and dO,
    p_tile) with the threads' order permuted: the same bits as without. D 64 float16 at
    8 simdgroups with an additive mask and sinks; D 256 float32 at its cap of one (16-key
    blocks: lanes 16-31 own no key), causal with a device-side kv_len."""
    require_backend("emulator")
    cases = ((64, mx.float16, 8, 4, {"kv_len": 61}),
             (256, mx.float32, 4, 3, {"causal": True, "kv_len": mx.array(45, dtype=mx.int32)}))
    for D, dtype, Hq, L, kw in cases:
        q, k, v = make_inputs(rng, 1, Hq, 1, L, 70, D, dtype)
        g = mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(dtype)
        sinks = mx.array(rng.uniform(-1, 2, size=(Hq,)).astype(np.float32)).astype(dtype)
        mask = _additive(rng, (Hq, L, 61), dtype) if "causal" not in kw else None
        fn = lambda q, k, v, s, kw=kw, mask=mask, scale=D ** -0.5: sdpa.sdpa_multi(  # noqa: E731
            q, k, v, scale=scale, sinks=s, mask=mask, **kw)
        runs = []
        for strict in (False, True):
            with backends.use_backend("emulator"), backward_split(SPLIT_CHUNK, "emulator"), (
                    strict_emulator(seed) if strict else contextlib.nullcontext()):
                grads = mx.vjp(fn, [q, k, v, sinks], [g])[1]
                mx.eval(grads)
            runs.append([np.array(a.astype(mx.float32)) for a in grads])
        for a, b in zip(*runs, strict=True):
            assert np.array_equal(a, b, equal_nan=True), (D, dtype)


def test_sdpa_backward_split_negative_control_barrier(broken_kernel, rng):
    """The split dq kernel reading the staged K block without the barrier after it is
    written must be caught by strict mode."""
    require_backend("emulator")
    from mlx_metaltile import emulator

    barrier = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  float s[RS]"
    assert barrier in _templates.read_text(sdpa.BWD_DQ_SPLIT_SPEC.template)
    broken_kernel(sdpa.BWD_DQ_SPLIT_SPEC, (barrier, "  float s[RS]"))
    q, k, v = make_inputs(rng, 1, 8, 1, 4, 70, 64, mx.float16)
    with strict_emulator(1), backends.use_backend("emulator"), \
            backward_split(SPLIT_CHUNK, "emulator"), \
            pytest.raises((emulator.ThreadgroupRace, emulator.UninitializedThreadgroupRead)):
        run_grad_and_check(q, k, v, scale=0.125, causal=False, kv_len=61, backend="emulator",
                           rng=rng)


def test_sdpa_backward_split_simdgroups_covered():
    """The gradient tests' split shapes reach tiles of 1, 2, 4 and 8 simdgroups (the plan's
    rule: the fewest that hold G*L rows, 4 per simdgroup)."""
    rows = [Hq // Hkv * L for Hq, Hkv, L, *_ in (*SHAPES, *SPLIT_SHAPES)]
    picked = {r: sdpa.backward_plan("cuda", 1, r, 1, 1, 64, 4096, mx.float16,
                                    cores=132)["n_sg"] for r in rows}
    assert set(picked.values()) == set(sdpa.SPLIT_SIMDGROUPS)
    for r, n_sg in picked.items():
        assert 4 * n_sg >= r or n_sg == 8, r
        assert n_sg == 1 or 2 * n_sg < r, r


def test_sdpa_backward_split_simdgroup_cap():
    """The split kernels' n_sg cap from the bytes (bwd_split_max_simdgroups): for every
    dtype and head dim, both kernels' threadgroup memory with the tiles declared for n_sg
    fits backends.MAX_THREADGROUP_MEMORY exactly for the n_sg up to the cap (so for every
    n_sg the plan can choose, and for the declared MAX_SG); the registered instantiations
    declare that cap; the plan never passes it, by its own rule or forced to 8. D 64 holds
    8 simdgroups, D 128 in float16 8, in float32 2, D 256 in float16 2, in float32 one."""
    caps = {}
    for dtype in DTYPES:
        for D in sdpa.HEAD_DIMS:
            cap = caps[dtype, D] = sdpa.bwd_split_max_simdgroups(D, dtype)
            for n_sg in sdpa.SPLIT_SIMDGROUPS:
                memory = sdpa.bwd_split_memory(D, dtype, n_sg)
                assert memory[0] < memory[1]  # the split dq kernel adds p_tile
                assert (memory[1] <= backends.MAX_THREADGROUP_MEMORY) == (n_sg <= cap), (
                    dtype, D, n_sg)
            for rows in (1, 5, 8, 16, 17, 32, 128, 4096):
                plan = sdpa.backward_plan("cuda", 1, rows, 1, 1, D, 4096, dtype, cores=132)
                assert 1 <= plan["n_sg"] <= cap, (dtype, D, rows)
                assert plan["n_tiles"] == -(-rows // (4 * plan["n_sg"]))
            with backward_split(SPLIT_CHUNK, "cuda", 8):
                assert sdpa.backward_plan("cuda", 1, 64, 1, 1, D, 100, dtype)["n_sg"] == cap
    assert {D: caps[mx.float16, D] for D in sdpa.HEAD_DIMS} == {64: 8, 96: 8, 128: 8, 256: 2}
    assert {D: caps[mx.float32, D] for D in sdpa.HEAD_DIMS} == {64: 8, 96: 4, 128: 2, 256: 1}
    for spec in (sdpa.BWD_STATS_SPEC, sdpa.BWD_DQ_SPLIT_SPEC):
        declared = {(dict(inst.template)["T"], dict(inst.template)["D"]):
                    dict(inst.template)["MAX_SG"] for inst in instantiations(spec)}
        assert declared == caps, spec.name


@pytest.mark.parametrize("n_sg", (None, 8), ids=("plan", "forced8"))
def test_sdpa_vjp_split_simdgroup_cap(kernel_backend, launches, rng, n_sg):
    """D 256 in float32 (16-key blocks): the split kernels' tiles hold one simdgroup, so
    G*L = 64 rows (8 simdgroups by the rows alone, or forced) run in 16 tiles of 4 rows,
    against the float64 gradients; the launches take MAX_SG 1, threadgroups of 32 threads
    and (on the emulator) exactly the threadgroup memory the wrapper declares."""
    B, Hq, Hkv, L, S, D, kv_len, dtype = 1, 16, 2, 8, 80, 256, 70, mx.float32
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    with backward_split(SPLIT_CHUNK, kernel_backend, n_sg):
        plan = sdpa.backward_plan(kernel_backend, B, Hq, Hkv, L, D, kv_len, dtype)
        run_grad_and_check(q, k, v, scale=D ** -0.5, causal=True, kv_len=kv_len,
                           backend=kernel_backend, rng=rng)
    assert plan["n_sg"] == 1 and plan["n_tiles"] == 16 and plan["kb"] == 16
    memory = sdpa.bwd_split_memory(D, dtype, 1)
    for spec, declared in zip((sdpa.BWD_STATS_SPEC, sdpa.BWD_DQ_SPLIT_SPEC), memory,
                              strict=True):
        (rec,) = [r for r in launches if r.name == spec.name]
        assert dict(rec.template)["MAX_SG"] == 1 and dict(rec.template)["KB"] == 16
        if rec.stats is not None:  # the emulator's counters
            assert rec.stats.threadgroup == (32, 1, 1) and rec.stats.threadgroups == 16 * 2 * 3
            assert rec.stats.threadgroup_memory == declared, spec.name


def test_sdpa_backward_plan():
    """The split is CUDA's (BWD_SPLIT_BACKENDS): a decode step there (B 1, h32/8, L 1, 4096
    keys, D 128: G*L = 4 rows per KV head) gets threadgroups of one simdgroup and many
    slices of whole key blocks; G*L = 32 rows get 8 simdgroups at D 64 (the cap from the
    bytes: test_sdpa_backward_split_simdgroup_cap); Metal and the emulator take one slice
    covering every key, in the same tiles; on cuda a problem of many row tiles, or few
    keys, one slice too. The slices keep the grid's z within CUDA's limit."""
    decode = (1, 32, 8, 1, 128, 4096, mx.float16)
    cuda = sdpa.backward_plan("cuda", *decode, cores=132)
    assert cuda["n_sg"] == 1 and cuda["n_tiles"] == 1
    assert cuda["n_splits"] >= 64  # 16 with the 32-row tiles' rule
    block = sdpa.backward_plan("cuda", 1, 32, 8, 8, 64, 4096, mx.float16, cores=132)
    assert block["n_splits"] > 1 and block["n_sg"] == 8 and block["n_tiles"] == 1
    assert cuda["chunk"] % sdpa.KEY_BLOCK == 0 and cuda["chunk"] >= sdpa.BWD_SPLIT_MIN_KEYS
    assert cuda["n_splits"] * cuda["chunk"] >= 4096 > (cuda["n_splits"] - 1) * cuda["chunk"]
    for backend in ("metal", "emulator"):
        plan = sdpa.backward_plan(backend, *decode)
        assert plan == {"n_splits": 1, "chunk": 4096, "n_sg": 1, "n_tiles": 1, "kb": 32}, (
            backend)
        plan = sdpa.backward_plan(backend, 1, 32, 8, 8, 64, 70, mx.float16)
        assert plan == {"n_splits": 1, "chunk": 96, "n_sg": 8, "n_tiles": 1, "kb": 32}, (
            backend)
    assert sdpa.backward_plan("cuda", 1, 32, 8, 1, 128, sdpa.BWD_SPLIT_MIN_KEYS,
                              mx.float16)["n_splits"] == 1
    assert sdpa.backward_plan("cuda", 64, 32, 8, 32, 128, 4096, mx.float16,
                              cores=132)["n_splits"] == 1
    with backward_split(100, "emulator"):  # forced: whole key blocks
        assert sdpa.backward_plan("emulator", 1, 4, 4, 1, 64, 50, mx.float32) == {
            "n_splits": 1, "chunk": 128, "n_sg": 1, "n_tiles": 1, "kb": 32}
    wide = sdpa.backward_plan("cuda", 1024, 8, 8, 1, 64, 10 ** 6, mx.float16, cores=10 ** 5)
    assert wide["n_splits"] > 1 and 1024 * 8 * wide["n_splits"] <= backends.MAX_GRID_Z
    with backward_split(32, "cuda"), pytest.raises(ValueError, match=r"\[sdpa_multi\] the "
                                                   r"key-split VJP's grid needs"):
        sdpa.backward_plan("cuda", 1, 8, 8, 1, 64, 10 ** 6, mx.float16)


@pytest.mark.parametrize("spec, old, new", [
    (sdpa.BWD_DKV_SPEC, "dvr[c] += p * float(", "dvr[c] += float("),  # dv without P
    (sdpa.BWD_DKV_SPEC, "dkr[c] += ds * float(", "dkr[c] += p * float("),  # dk of P
    (sdpa.BWD_DKV_SPEC, "? p * (dp - d_r)", "? p * dp"),  # dS (the mask's gradient) w/o Dr
    # the split form (slices of 32 keys: two here)
    (sdpa.BWD_STATS_SPEC, "simd_sum(p * dp[rr])", "simd_sum(dp[rr])"),  # u_s without P
    (sdpa.BWD_DQ_SPLIT_SPEC, "l_lane += w * head_parts", "l_lane += head_parts"),  # l merged
    # without the 2^(b (m_s - m)) rescale
    (sdpa.BWD_DQ_SPLIT_SPEC, "u_lane += w * head_parts", "u_lane += head_parts"),  # U too
    (sdpa.BWD_DQ_SPLIT_SPEC, "p * (dp[rr] - dd[rr])", "p * dp[rr]"),  # dS without Dr
    (sdpa.BWD_DQ_SPLIT_SPEC, "-(p_sink / l_f) * dd[rr]", "-p_sink * dd[rr]"),  # dsinks
    # unnormalised
    # the lane-per-key dot products: dP of the staged q rows; a neighbour lane's key
    (sdpa.BWD_STATS_SPEC, "mt_rows4_dot<T, D>(g_rows, 1.0f, key_row, dp);",
     "mt_rows4_dot<T, D>(q_rows, 1.0f, key_row, dp);"),
    (sdpa.BWD_DQ_SPLIT_SPEC, "kv_tile + min(lane, uint(KB) - 1u)",
     "kv_tile + min(lane ^ 1u, uint(KB) - 1u)"),
], ids=("dkv_dv", "dkv_dk", "dkv_dmask", "stats_u", "split_l", "split_u", "split_ds",
        "split_dsinks", "stats_dp_rows", "split_key_lane"))
def test_sdpa_backward_negative_control(kernel_backend, broken_kernel, rng, spec, old, new):
    """One broken term per kernel must fail the harness (the edit must apply)."""
    assert old in _templates.read_text(spec.template)
    broken_kernel(spec, (old, new))
    sinks = mx.array(rng.uniform(-1, 2, size=(4,)).astype(np.float32))
    mask = _additive(rng, (4, 3, 40), mx.float32, p_inf=0.1)
    split = spec in (sdpa.BWD_STATS_SPEC, sdpa.BWD_DQ_SPLIT_SPEC)
    with pytest.raises(AssertionError, match="out of tolerance"):
        check(kernel_backend, rng, 1, 4, 2, 3, 48, 64, mx.float32, 40, mask=mask,
              sinks=sinks, chunk=SPLIT_CHUNK if split else None)
