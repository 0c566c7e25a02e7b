"""sdpa_multi's masks, sinks and device-side kv_len against the float64 oracle."""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import numpy as np
import pytest
from support import backend_params, dtype_id, require_backend

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close, to_f64
from mlx_metaltile.cases.sdpa_multi import make_inputs, oracle, run_and_check

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
op_module = importlib.import_module("mlx_metaltile.ops.sdpa_multi")



def bool_mask(rng, shape, p=0.6):
    return mx.array(rng.random(shape) < p)


def additive_mask(rng, shape, dtype, p_inf=0.3):
    m = rng.standard_normal(shape) * 2.0
    m[rng.random(shape) < p_inf] = -np.inf
    return mx.array(m.astype(np.float32)).astype(dtype)


# (B, Hq, Hkv, L, kv_len, S, D, mask shape as a function of (B, Hq, L, kv_len))
MASK_SHAPES = [
    ("full-4d", lambda B, H, L, n: (B, H, L, n)),
    ("per-query", lambda B, H, L, n: (L, n)),           # broadcast over batch and heads
    ("per-head", lambda B, H, L, n: (1, H, 1, n)),      # broadcast over queries
    ("block-4d", lambda B, H, L, n: (B, H, L, L)),      # the last L keys only
    ("block-2d", lambda B, H, L, n: (L, L)),
]
MASK_CASES = [
    (2, 8, 2, 4, 70, 96, 64),     # GQA 4, slack, batch 2
    (1, 4, 4, 1, 300, 320, 128),  # decode, split KV
    (1, 16, 2, 8, 100, 100, 256),  # Qwen3-Next heads
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ("bool", "additive"))
@pytest.mark.parametrize("form, shape_of", MASK_SHAPES, ids=[m[0] for m in MASK_SHAPES])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: f"h{c[1]}x{c[2]}-L{c[3]}-kv{c[4]}")
def test_array_masks(any_backend, poisoned_outputs, rng, case, form, shape_of, kind, dtype):
    B, Hq, Hkv, L, kv_len, S, D = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    shape = shape_of(B, Hq, L, kv_len)
    mask = bool_mask(rng, shape) if kind == "bool" else additive_mask(rng, shape, dtype)
    run_and_check(q, k, v, scale=D ** -0.5, causal=False, kv_len=kv_len, mask=mask,
                  backend=any_backend, what=f" {kind} {form}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("L", range(2, 17))
def test_qwen3_next_verify_blocks(any_backend, poisoned_outputs, rng, L, dtype):
    """Qwen3-Next attention (Hq 16, Hkv 2, D 256): a speculative tree of L tokens verified
    against the cache, its tree mask in the block form [L, L]."""
    kv_len = 40 + L
    q, k, v = make_inputs(rng, 1, 16, 2, L, kv_len + 8, 256, dtype)
    tree = np.tril(rng.random((L, L)) < 0.5) | np.eye(L, dtype=bool)  # ancestors and self
    run_and_check(q, k, v, scale=256 ** -0.5, causal=False, kv_len=kv_len,
                  mask=mx.array(tree), backend=any_backend, what=f" tree L{L}")


@pytest.mark.parametrize("kind", ("bool", "additive"))
def test_fully_masked_rows(any_backend, poisoned_outputs, rng, kind):
    """A row whose keys are all masked: bool -> v averaged uniformly over [0, kv_len);
    additive -inf -> NaN; either with sinks -> 0 (MLX's own sdpa gives the same)."""
    B, Hq, Hkv, L, kv_len, D = 1, 4, 2, 4, 70, 64
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, 96, D, mx.float32)
    m = rng.random((Hq, L, kv_len)) < 0.5
    m[1, 2] = False  # head 1, query 2: nothing visible
    m[3, :] = False  # head 3: every query
    mask = mx.array(m) if kind == "bool" else mx.array(np.where(m, 0.0, -np.inf).astype(
        np.float32))
    out = run_and_check(q, k, v, scale=0.125, causal=False, kv_len=kv_len, mask=mask,
                        backend=any_backend)
    native = mx.fast.scaled_dot_product_attention(
        q, k[:, :, :kv_len], v[:, :, :kv_len], scale=0.125, mask=mask)
    got, nat = to_f64(out), to_f64(native)
    assert np.array_equal(np.isnan(got), np.isnan(nat))
    assert (np.isnan(got[0, 3]).all()) == (kind == "additive")
    fine = ~np.isnan(nat)
    assert np.allclose(got[fine], nat[fine], atol=1e-5)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    out = run_and_check(q, k, v, scale=0.125, causal=False, kv_len=kv_len, mask=mask,
                        sinks=sinks, backend=any_backend, what=" with sinks")
    assert (to_f64(out)[0, 3] == 0).all() and (to_f64(out)[0, 1, 2] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", (None, "causal", "bool", "additive", "block"))
@pytest.mark.parametrize("case", [(1, 8, 2, 1, 600, 640, 64), (2, 4, 4, 8, 90, 90, 128)],
                         ids=("decode-split", "block"))
def test_sinks(any_backend, poisoned_outputs, rng, case, mask, dtype):
    B, Hq, Hkv, L, kv_len, S, D = case
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, S, D, dtype)
    sinks = mx.array((rng.standard_normal(Hq) * 3).astype(np.float32)).astype(dtype)
    causal, m = False, None
    if mask == "causal":
        causal = True
    elif mask == "bool":
        m = bool_mask(rng, (B, 1, L, kv_len))
    elif mask == "additive":
        m = additive_mask(rng, (Hq, L, kv_len), dtype)
    elif mask == "block":
        m = bool_mask(rng, (L, L))
    run_and_check(q, k, v, scale=D ** -0.5, causal=causal, kv_len=kv_len, mask=m,
                  sinks=sinks, backend=any_backend, what=f" sinks, mask {mask}")


@pytest.mark.parametrize("mask", (None, "causal", "block"))
def test_device_kv_len(any_backend, poisoned_outputs, rng, mask):
    """A 0-d integer kv_len gives exactly what the same Python int gives."""
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 400, 64, mx.float16)
    m = bool_mask(rng, (4, 4)) if mask == "block" else None
    causal = mask == "causal"
    for n in (4, 33, 250, 400):
        want = run_and_check(q, k, v, scale=0.125, causal=causal, kv_len=n, mask=m,
                             backend=any_backend)
        for dt in (mx.int32, mx.uint32, mx.int64):
            got = run_and_check(q, k, v, scale=0.125, causal=causal, kv_len=mx.array(n, dt),
                                mask=m, backend=any_backend, what=f" kv_len {dt}")
            assert np.array_equal(np.array(got), np.array(want), equal_nan=True)


def test_device_kv_len_decode_loop_does_not_rebuild(kernel_backend, launches, rng):
    """A decode loop whose kv_len is a device array: one launch geometry, no new kernel."""
    S = 300
    q, k, v = make_inputs(rng, 1, 8, 2, 1, S, 64, mx.float16)
    sinks = mx.zeros((8,), mx.float16)
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=mx.array(5), sinks=sinks,
                  backend=kernel_backend)
    built = backends.built_kernels()
    for n in (6, 31, 32, 33, 97, 299, 300):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=mx.array(n), sinks=sinks,
                      backend=kernel_backend)
    assert backends.built_kernels() == built
    assert len({(launch.name, launch.template) for launch in launches}) == 2
    if kernel_backend == "emulator":  # the grid covers the buffer, whatever kv_len is
        assert {launch.stats.grid for launch in launches
                if launch.name == op_module.SPLIT_SPEC.name} == {
            op_module.plan(1, 8, 2, 1, 64, S, mx.float16)["grid"]}


@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
def test_gqa_ratios_with_masks(any_backend, poisoned_outputs, rng, ratio):
    q, k, v = make_inputs(rng, 1, 8, 8 // ratio, 3, 50, 64, mx.bfloat16)
    mask = bool_mask(rng, (1, 8, 3, 50))
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=50, mask=mask,
                  sinks=mx.arange(8).astype(mx.bfloat16) * 0.5 - 2, backend=any_backend)


def test_mask_causal_string_is_causal(any_backend, rng):
    q, k, v = make_inputs(rng, 1, 4, 2, 8, 40, 64, mx.float32)
    a = mt.sdpa_multi(q, k, v, scale=0.125, mask="causal", kv_len=30)
    b = mt.sdpa_multi(q, k, v, scale=0.125, causal=True, kv_len=30)
    assert np.array_equal(np.array(a), np.array(b))


def test_matches_native_sdpa(rng):
    """The reference against MLX's own sdpa for every mask form and sinks."""
    q, k, v = make_inputs(rng, 2, 8, 2, 4, 60, 64, mx.float32)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    bm = bool_mask(rng, (2, 1, 4, 60))
    am = additive_mask(rng, (8, 4, 60), mx.float32, p_inf=0.1)
    with backends.use_backend("reference"):
        for kw in ({"mask": bm}, {"mask": am}, {"mask": "causal"}, {"sinks": sinks},
                   {"mask": bm, "sinks": sinks}):
            got = mt.sdpa_multi(q, k, v, scale=0.125, **kw)
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, **kw)
            assert np.allclose(np.array(got), np.array(want), atol=1e-5), kw


@pytest.mark.parametrize("backend", backend_params("reference", "metal", "cuda"))
def test_compile_with_device_kv_len(rng, backend):
    """mx.compile traces once; a device-side kv_len (and the mask and sinks, inputs too)
    changes between calls without a new trace. Shapeless on the reference backend; on the
    kernel backends neither MLX's custom-kernel primitive nor the op's custom_function (its
    VJP) can infer output shapes in MLX 0.32, so a decode loop compiles at its cache's
    fixed shape there."""
    require_backend(backend)
    shapeless = backend == "reference"
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 64, mx.float32)
    traces = []

    def step(q, k, v, n, mask, sinks):
        traces.append(1)
        return mt.sdpa_multi(q, k, v, scale=0.125, kv_len=n, mask=mask, sinks=sinks)

    with backends.use_backend(backend):
        compiled = mx.compile(step, shapeless=shapeless)
        for n in (4, 40, 96):
            mask = bool_mask(rng, (4, 4))
            sinks = mx.array(rng.standard_normal(8).astype(np.float32))
            want, magnitude = oracle(q, k, v, 0.125, False, n, mask, sinks)
            assert_close(compiled(q, k, v, mx.array(n), mask, sinks), want, mx.float32,
                         magnitude, what=f"compiled kv_len {n}")
    assert len(traces) == 1
    if shapeless:  # another cache length: MLX refuses, never a wrong result
        q2, k2, v2 = make_inputs(rng, 1, 8, 2, 4, 128, 64, mx.float32)
        with backends.use_backend(backend), pytest.raises(ValueError):
            mx.eval(compiled(q2, k2, v2, mx.array(40), mask, sinks))


@pytest.mark.parametrize("backend", backend_params("metal", "cuda"))
def test_shapeless_compile_of_a_kernel_is_refused_by_mlx(rng, backend):
    """The limit above, stated: a shapeless trace of a kernel launch raises, never runs."""
    require_backend(backend)
    q, k, v = make_inputs(rng, 1, 8, 2, 4, 96, 64, mx.float32)
    with backends.use_backend(backend):
        compiled = mx.compile(lambda q, k, v: mt.sdpa_multi(q, k, v, scale=0.125),
                              shapeless=True)
        with pytest.raises(ValueError, match="cannot infer output shapes"):
            mx.eval(compiled(q, k, v))


def test_emulator_refuses_compile(rng):
    require_backend("emulator")
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 64, 64, mx.float32)
    with backends.use_backend("emulator"), pytest.raises(
            ValueError, match=r"^\[sdpa_multi\] the emulator backend runs kernels eagerly"):
        mx.compile(lambda a: mt.sdpa_multi(a, k, v, scale=0.125))(q)


# ---- negative controls ------------------------------------------------------------------

def test_negative_control_mask_ignored(kernel_backend, broken_kernel, rng):
    broken_kernel(op_module.SPLIT_SPEC, ("sc = bool(mv) ? sc : -FLT_MAX;", "(void)mv;"))
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 40, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                      mask=bool_mask(rng, (4, 40)), backend=kernel_backend)


def test_negative_control_additive_ignored(kernel_backend, broken_kernel, rng):
    broken_kernel(op_module.SPLIT_SPEC, ("sc += float(mv) * mask_unit;", "(void)mv;"))
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 40, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                      mask=additive_mask(rng, (4, 40), mx.float32, p_inf=0.0),
                      backend=kernel_backend)


def test_negative_control_block_offset(kernel_backend, broken_kernel, rng):
    """Reading the block mask from key 0 rather than from the last L keys must fail (the
    emulator also sees the reads past the [L, L] mask)."""
    broken_kernel(op_module.SPLIT_SPEC, ("mask_block != 0u ? kvn - L : 0u", "0u"))
    q, k, v = make_inputs(rng, 1, 4, 2, 4, 40, 64, mx.float32)
    errors = (AssertionError,)
    if kernel_backend == "emulator":
        from mlx_metaltile.emulator import OutOfBoundsAccess
        errors += (OutOfBoundsAccess,)
    with pytest.raises(errors):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                      mask=bool_mask(rng, (4, 4), p=0.3), backend=kernel_backend)


def test_negative_control_sink_dropped(kernel_backend, broken_kernel, rng):
    broken_kernel(op_module.COMBINE_SPEC, ("if (has_sinks != 0u) {\n  w_sum +=",
                                           "if (false) {\n  w_sum +="))
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 40, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance|want NaN"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                      sinks=mx.array([3.0, 2.0, 4.0, 1.0]), backend=kernel_backend)


def test_negative_control_device_kv_len_ignored(kernel_backend, broken_kernel, rng):
    """A kernel that reads the whole buffer instead of the device-side kv_len must fail."""
    broken_kernel(op_module.SPLIT_SPEC, ("max(min(kv_len, kv_rows), L)", "kv_rows"))
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 300, 64, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=mx.array(100),
                      backend=kernel_backend)


def test_negative_control_reference_drops_sink(monkeypatch, rng):
    real = op_module._reference
    monkeypatch.setattr(op_module, "_reference",
                        lambda q, k, v, p: real(q, k, v, dataclasses.replace(p, sinks=None)))
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 40, 64, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tol"):
        run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                      sinks=mx.array([3.0, 2.0, 4.0, 1.0]), backend="reference")


# ---- bad input ------------------------------------------------------------------------

def _ok(dtype=mx.float16):
    return (mx.zeros((1, 8, 4, 64), dtype=dtype), mx.zeros((1, 2, 16, 64), dtype=dtype),
            mx.zeros((1, 2, 16, 64), dtype=dtype))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"mask": mx.zeros((4, 15), mx.bool_)}, ValueError,
     r"mask must broadcast to \[1, 8, 4, 16\] \(or \[..., 4\]: the block form\), got shape \(4, 15\)"),
    ({"mask": mx.zeros((2, 8, 4, 16), mx.bool_)}, ValueError,
     r"mask must broadcast to .* got shape \(2, 8, 4, 16\)"),
    ({"mask": mx.zeros((3, 4, 16), mx.bool_)}, ValueError, "mask must broadcast"),
    ({"mask": mx.zeros((1, 1, 1, 4, 16), mx.bool_)}, ValueError, "mask must broadcast"),
    ({"mask": mx.zeros((4, 16), mx.float32)}, TypeError,
     "mask must be bool or an additive mask whose dtype promotes to q's dtype float16, got float32"),
    ({"mask": mx.zeros((4, 16), mx.bfloat16)}, TypeError, "mask must be bool or .* got bfloat16"),
    ({"mask": np.zeros((4, 16), bool)}, TypeError, "mask must be an mx.array, got ndarray"),
    ({"mask": "sliding"}, ValueError, "a string mask must be 'causal', got 'sliding'"),
    ({"mask": "causal", "causal": True}, ValueError, "pass either causal=True or mask=, not both"),
    ({"mask": mx.ones((4, 16), mx.bool_), "causal": True}, ValueError, "pass either .* not both"),
    ({"sinks": mx.zeros((2,), mx.float16)}, ValueError, r"sinks must have shape \(Hq,\) = \(8,\), got \(2,\)"),
    ({"sinks": mx.zeros((1, 8), mx.float16)}, ValueError, r"sinks must have shape .* got \(1, 8\)"),
    ({"sinks": mx.zeros((8,), mx.float32)}, TypeError,
     "sinks' dtype must promote to q's dtype float16, got float32"),
    ({"sinks": [0.0] * 8}, TypeError, "sinks must be an mx.array, got list"),
    ({"kv_len": mx.array(8.0)}, TypeError,
     "kv_len as an mx.array must have an integer dtype, got float32"),
    ({"kv_len": mx.array([8])}, ValueError, r"kv_len as an mx.array must be 0-d, got shape \(1,\)"),
    ({"kv_len": 8.0}, TypeError, "kv_len must be a Python int, a 0-d integer mx.array or None"),
    ({"kv_len": mx.array(8), "mask": mx.ones((4, 8), mx.bool_)}, ValueError,
     r"mask must broadcast to \[1, 8, 4, kv_len\]"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=r"^\[sdpa_multi\] " + match):
        mt.sdpa_multi(*_ok(), scale=0.125, **kwargs)


def test_native_refuses_what_we_refuse():
    """The dtype rules are MLX's: its own sdpa refuses the same mask and sinks dtypes."""
    q, k, v = _ok()
    for kw in ({"mask": mx.zeros((4, 16), mx.float32)}, {"sinks": mx.zeros((8,), mx.float32)}):
        with pytest.raises(ValueError, match="promote"):
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, **kw)


def test_oracle_matches_native(rng):
    """The float64 oracle's rules (fully masked rows, sinks) are MLX's own."""
    q, k, v = make_inputs(rng, 1, 2, 1, 3, 5, 64, mx.float32)
    m = np.array([[True] * 5, [False] * 5, [True, False, True, False, True]])
    for mask in (mx.array(m), mx.array(np.where(m, 0.0, -np.inf).astype(np.float32))):
        for sinks in (None, mx.array([0.5, -1.0])):
            want, _ = oracle(q, k, v, 0.1, False, 5, mask, sinks)
            nat = to_f64(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask,
                                                              sinks=sinks))
            assert np.array_equal(np.isnan(want), np.isnan(nat))
            fine = ~np.isnan(want)
            assert_close(nat[fine], want[fine], mx.float32, np.abs(want[fine]) * 10)


@pytest.mark.parametrize("shape", [(4, 40), (1, 8, 1, 40), (4, 4)], ids=str)
def test_mask_is_read_in_place(kernel_backend, launches, rng, shape):
    """The kernel gets the mask at its own size (broadcast axes of size 1, the block form
    [L, L]), never a materialised [B, Hq, L, kv_len]."""
    q, k, v = make_inputs(rng, 2, 8, 2, 4, 48, 64, mx.float16)
    run_and_check(q, k, v, scale=0.125, causal=False, kv_len=40,
                  mask=bool_mask(rng, shape), backend=kernel_backend)
    # pass 1 is the split kernel, or the MMA kernel where the cuda plan takes it (G*L = 16)
    specs = {s.name: s for s in (op_module.SPLIT_SPEC, op_module.MMA_SPEC)}
    split = next(launch for launch in launches if launch.name in specs)
    names = [arg.name for arg in specs[split.name].inputs]
    mask = split.inputs[names.index("mask")]
    assert mask.size == np.prod(shape) and mask.ndim == 4
    if kernel_backend == "emulator":
        # one element per (query row, masked key): the block form reads only its L columns
        assert split.stats.bytes_read["mask"] == 2 * 8 * 4 * shape[-1]
