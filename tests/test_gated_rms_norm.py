"""gated_rms_norm against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import functools
import importlib
import math
import zlib
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from tolerances import assert_close, to_f64

import mlx_metaltile as mt
from mlx_metaltile import _templates, backends

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
LENGTHS = (1, 3, 31, 32, 33, 128, 512, 1000, 4096, 4097, 8192)
LEADING = ((), (5,), (2, 3))
op_module = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")


def oracle(y, z, w, eps):
    """out = w * y * rsqrt(mean(y^2) + eps) * silu(z), in float64."""
    y, z, w = to_f64(y), to_f64(z), to_f64(w)
    inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    with np.errstate(over="ignore"):
        silu = z / (1.0 + np.exp(-z))
    return w * y * inv_rms * silu


def float32_error_scales(y, z, w, eps, want):
    """How float32 evaluation error scales, per output: (magnitude, underflow_scale) of
    tolerances.assert_close.

    magnitude: |want| times 1 + |z|, since exp(-z) in float32 starts from -z rounded to
    float32 (a relative error that grows with |z|). underflow_scale: |w * y * inv_rms * z|,
    which multiplies sigmoid(z); below z ~ -87 sigmoid(z) is under float32's normal range
    (a float32 exp(-z) overflows, and the gate comes out as 0).
    """
    y, z, w = to_f64(y), to_f64(z), to_f64(w)
    inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    return np.abs(want) * (1.0 + np.abs(z)), np.abs(w * y * inv_rms * z)


def make_inputs(rng, lead, n, dtype, y_dtype):
    shape = (*lead, n)
    # Row magnitudes spread over [1e-3, 1] (large ones: large_inputs).
    row_scale = 10.0 ** rng.uniform(-3, 0, size=(*lead, 1))
    y = mx.array((rng.standard_normal(shape) * row_scale).astype(np.float32)).astype(y_dtype)
    z = mx.array((rng.standard_normal(shape) * 4.0).astype(np.float32)).astype(dtype)
    w = mx.array(rng.uniform(-2, 2, size=(n,)).astype(np.float32)).astype(dtype)
    return y, z, w


# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def run_and_check(y, z, w, eps, dtype, backend):
    before = backends.launch_count(backend=backend)
    out = mt.gated_rms_norm(y, z, w, eps=eps)
    mx.eval(out)
    if backend != "reference":  # prove a kernel ran (never the reference compared with itself)
        assert backends.launch_count(backend=backend) == before + 1
    assert out.dtype == dtype and tuple(out.shape) == tuple(z.shape)
    want = oracle(y, z, w, eps)
    magnitude, underflow_scale = float32_error_scales(y, z, w, eps, want)
    assert_close(out, want, dtype, magnitude=magnitude, underflow_scale=underflow_scale,
                 what=f"gated_rms_norm[{backend}]")


# One checked call per registered kernel variant of this op (tests/test_registry.py runs
# them for every registered variant on each kernel backend, so a variant added to the
# registry fails there until it has one here).
VARIANT_N = {"simd_rows": 100, "row": 1000, "looped": 5000}  # n that selects each


def _variant_call(n, backend, rng):
    y, z, w = make_inputs(rng, (3,), n, mx.bfloat16, mx.float32)
    run_and_check(y, z, w, 1e-5, mx.bfloat16, backend)


VARIANT_CALLS = {v: functools.partial(_variant_call, n) for v, n in VARIANT_N.items()}


@pytest.mark.parametrize("lead", LEADING, ids=lambda s: "lead" + "x".join(map(str, s)))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("y_f32", (True, False), ids=("y_f32", "y_same"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_matches_oracle(any_backend, rng, dtype, y_f32, n, lead):
    y, z, w = make_inputs(rng, lead, n, dtype, mx.float32 if y_f32 else dtype)
    run_and_check(y, z, w, 1e-5, dtype, any_backend)


def large_inputs(rng, n, dtype, y_dtype):
    """Rows of |y| up to 1e3 (squares up to 1e6, overflowing float16 if squared in it), down
    to 1e-3, and gates up to 1e3 in magnitude (saturated silu)."""
    row_scale = np.array([1e3, 3e2, 1.0, 1e-3])[:, None]
    y = mx.array((rng.uniform(-1, 1, size=(4, n)) * row_scale).astype(np.float32))
    z = mx.array(rng.uniform(-1e3, 1e3, size=(4, n)).astype(np.float32))
    w = mx.array(rng.uniform(-2, 2, size=(n,)).astype(np.float32))
    return y.astype(y_dtype), z.astype(dtype), w.astype(dtype)


@pytest.mark.parametrize("n", (128, 1000, 4097))  # one per kernel variant
@pytest.mark.parametrize("y_f32", (True, False), ids=("y_f32", "y_same"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_large_magnitudes(any_backend, rng, dtype, y_f32, n):
    """Values up to 1e3, y in float32 and in z's dtype: squares are summed in float32."""
    y, z, w = large_inputs(rng, n, dtype, mx.float32 if y_f32 else dtype)
    run_and_check(y, z, w, 1e-6, dtype, any_backend)


@pytest.fixture
def launched(monkeypatch):
    """Records each gated_rms_norm launch as an instantiation key: (kernel name, template
    arguments, (dtype, ndim) of every input): what makes a new compiled kernel."""
    records = []
    real_launch = backends.launch

    def spy(spec, backend, **kwargs):
        records.append((spec.name, tuple(kwargs["template"]),
                        tuple((a.dtype, a.ndim) for a in kwargs["inputs"])))
        return real_launch(spec, backend, **kwargs)

    monkeypatch.setattr(backends, "launch", spy)
    return records


def _emulator_modules() -> int:
    """Instantiations the emulator compiled for the simd_rows kernel object (one module per
    generated source: a new template argument or input signature is a new one)."""
    spec = op_module.SIMD_ROWS_SPEC
    return len(backends.get_kernel(spec, "emulator", op_module._SIMD_ROWS_INPUTS,
                                   op_module._OUTPUTS)._modules)


EPS_LOOP = (1e-5, 0.0, 1e-6, 0.5, 3.0)
N_ROWS_LOOP = ((64, 3), (100, 7), (128, 1), (33, 16))  # all in the simd_rows variant


def _eps_and_n_loop(backend, rng, launched):
    """Calls over several eps, n and row counts within one variant. Returns (kernel objects
    built, distinct instantiations launched, emulator modules compiled after the first call
    or None on other backends)."""
    y, z, w = make_inputs(rng, (3,), 64, mx.float16, mx.float32)
    run_and_check(y, z, w, EPS_LOOP[0], mx.float16, backend)
    built = backends.built_kernels()
    modules = _emulator_modules() if backend == "emulator" else None
    for eps in EPS_LOOP:
        for n, rows in N_ROWS_LOOP:
            y, z, w = make_inputs(rng, (rows,), n, mx.float16, mx.float32)
            run_and_check(y, z, w, eps, mx.float16, backend)
    assert {name for name, *_ in launched} == {op_module.SIMD_ROWS_SPEC.name}
    assert len(launched) == 1 + len(EPS_LOOP) * len(N_ROWS_LOOP)
    new_built = len(backends.built_kernels()) - len(built)
    new_modules = None if modules is None else _emulator_modules() - modules
    return new_built, len(set(launched)), new_modules


def test_eps_and_n_changes_do_not_rebuild(kernel_backend, rng, launched):
    """eps, n and the row count are runtime inputs: one instantiation serves them all."""
    new_built, instantiations, new_modules = _eps_and_n_loop(kernel_backend, rng, launched)
    assert new_built == 0
    assert instantiations == 1
    if kernel_backend == "emulator":
        assert new_modules == 0


def test_negative_control_eps_as_template_argument(kernel_backend, monkeypatch, rng, launched):
    """A launcher that bakes eps into a template argument makes one instantiation per eps
    value: the counts above must see it."""
    real_launch, real_template = op_module._launch, op_module._template

    def launch(y, z, weight, n, rows, eps, backend):
        bits = int(np.array(eps, dtype=np.float32).view(np.int32))
        with monkeypatch.context() as m:
            m.setattr(op_module, "_template",
                      lambda zt, yt: (*real_template(zt, yt), ("EPS_BITS", bits)))
            return real_launch(y, z, weight, n, rows, eps, backend)

    monkeypatch.setattr(op_module, "_launch", launch)
    _, instantiations, new_modules = _eps_and_n_loop(kernel_backend, rng, launched)
    assert instantiations == len(EPS_LOOP)
    if kernel_backend == "emulator":
        assert new_modules == len(EPS_LOOP) - 1  # the first eps was compiled before the loop


def test_non_contiguous_inputs(any_backend, rng):
    base_y = mx.array(rng.standard_normal((64, 6)).astype(np.float32))
    y = base_y.T  # transposed: [6, 64], not row-contiguous
    z = mx.array(rng.standard_normal((6, 128)).astype(np.float32)).astype(mx.bfloat16)[:, ::2]
    w = mx.array(rng.uniform(-1, 1, size=(64,)).astype(np.float32)).astype(mx.bfloat16)
    run_and_check(y, z, w, 1e-5, mx.bfloat16, any_backend)


def test_empty_rows_do_not_dispatch(kernel_backend):
    before = backends.launch_count()
    z = mx.zeros((0, 16), dtype=mx.float16)
    out = mt.gated_rms_norm(z, z, mx.ones((16,), dtype=mx.float16))
    assert out.shape == (0, 16) and out.dtype == mx.float16
    assert backends.launch_count() == before


def test_op_is_lazy_and_compiles(no_host_sync, rng):
    """No evaluation inside the op; it traces under mx.compile (reference backend here)."""
    y, z, w = make_inputs(rng, (2, 3), 96, mx.float32, mx.float32)


    with no_host_sync():
        out = mt.gated_rms_norm(y, z, w)
    expected = oracle(y, z, w, 1e-5)
    assert_close(out, expected, mx.float32)
    compiled = mx.compile(lambda a, b, c: mt.gated_rms_norm(a, b, c, eps=1e-5))
    assert_close(compiled(y, z, w), expected, mx.float32)


# ---- negative controls: a deliberately wrong variant must fail the harness ----------------

def _broken_template(monkeypatch, spec, old: str, new: str):
    """Register a copy of ``spec`` whose template has ``old`` replaced by ``new``."""
    text = _templates.read_text(spec.template)
    assert old in text
    # A name of its own per patch: kernels are cached per (backend, variant name), and a
    # kernel built by another control must never stand in for this one.
    tag = f"broken{zlib.crc32((old + new).encode()):08x}"
    fake_name = spec.template.replace(".metal", f"_{tag}.metal")
    real_read = _templates.read_text

    def read_text(name):
        return text.replace(old, new) if name == fake_name else real_read(name)

    monkeypatch.setattr(_templates, "read_text", read_text)
    _templates.render.cache_clear()
    broken = replace(spec, variant=f"{spec.variant}_{tag}", template=fake_name)
    return broken


@pytest.mark.parametrize("attr, n", [("SIMD_ROWS_SPEC", 100), ("REGISTER_SPEC", 200),
                                     ("LOOPED_SPEC", 5000)])
@pytest.mark.parametrize("old, new", [
    ("mt_silu(", "("),  # silu(z) replaced by z
    ("if (col < n) {", "if (col + 1 < n) {"),  # the last column never written: poison shows
], ids=("without_gate", "leaving_the_last_column"))
def test_negative_control_broken_kernel(kernel_backend, monkeypatch, rng, attr, n, old, new):
    """A kernel broken in each variant: the harness must notice."""
    spec = getattr(op_module, attr)
    broken = _broken_template(monkeypatch, spec, old, new)
    monkeypatch.setattr(op_module, attr, broken)
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    try:
        with pytest.raises(AssertionError, match="out of tolerance"):
            run_and_check(y, z, w, 1e-5, mx.float32, kernel_backend)
    finally:
        _templates.render.cache_clear()


@pytest.mark.parametrize("attr, n", [("SIMD_ROWS_SPEC", 128), ("REGISTER_SPEC", 1000),
                                     ("LOOPED_SPEC", 4097)])
def test_negative_control_kernel_unscaled_squares(kernel_backend, monkeypatch, rng, attr, n):
    """y^2 summed without scaling the row by its max |y| (sum y^2 overflows float32 from
    |y| ~ 1e18 at these n): rows of |y| ~ 1e20 must notice; ordinary rows do not."""
    spec = getattr(op_module, attr)
    broken = _broken_template(monkeypatch, spec, "row_max > 0.0f ? row_max : 1.0f", "1.0f")
    monkeypatch.setattr(op_module, attr, broken)
    try:
        y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
        run_and_check(y, z, w, 1e-5, mx.float32, kernel_backend)
        with pytest.raises(AssertionError, match="out of tolerance"):
            run_and_check(y * 1e20, z, w, 1e-5, mx.float32, kernel_backend)
    finally:
        _templates.render.cache_clear()


def test_negative_control_reference_squaring_in_y_dtype(monkeypatch, rng):
    """A composite that squares y in its own dtype fails the large-magnitude check."""

    def square_in_y_dtype(y, z, w, eps=1e-5):
        inv_rms = mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True).astype(mx.float32) + eps)
        zf = z.astype(mx.float32)
        out = w.astype(mx.float32) * y.astype(mx.float32) * inv_rms * (zf * mx.sigmoid(zf))
        return out.astype(z.dtype)

    monkeypatch.setattr(op_module, "gated_rms_norm_reference", square_in_y_dtype)
    y, z, w = large_inputs(rng, 128, mx.float16, mx.float16)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-6, mx.float16, "reference")


def test_kernel_outputs_start_poisoned(kernel_backend, monkeypatch, rng):
    """The poisoned_outputs fixture reaches the kernel object on this backend."""
    seen = []
    real_get_kernel = backends.get_kernel

    def get_kernel(*args, **kwargs):
        kernel = real_get_kernel(*args, **kwargs)

        def call(**launch_kwargs):
            seen.append(launch_kwargs.get("init_value"))
            return kernel(**launch_kwargs)
        return call

    monkeypatch.setattr(backends, "get_kernel", get_kernel)
    for n in (100, 1000, 5000):  # every variant
        y, z, w = make_inputs(rng, (2,), n, mx.float32, mx.float32)
        run_and_check(y, z, w, 1e-5, mx.float32, kernel_backend)
    assert len(seen) == 3 and all(math.isnan(v) for v in seen), seen


def test_negative_control_reference_without_gate(monkeypatch, rng):
    """The oracle harness rejects a composite that forgets the gate."""

    def no_gate(y, z, w, eps=1e-5):
        yf = y.astype(mx.float32)
        return (w * yf * mx.rsqrt(mx.mean(yf * yf, axis=-1, keepdims=True) + eps)).astype(z.dtype)

    monkeypatch.setattr(op_module, "gated_rms_norm_reference", no_gate)
    y, z, w = make_inputs(rng, (4,), 64, mx.float32, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-5, mx.float32, "reference")


# ---- bad input ------------------------------------------------------------------------

def _ok(dtype=mx.float16, n=8, lead=(2,)):
    return (mx.zeros((*lead, n), dtype=mx.float32), mx.zeros((*lead, n), dtype=dtype),
            mx.ones((n,), dtype=dtype))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda y, z, w: (y, z.astype(mx.int32), w.astype(mx.int32)), TypeError, "z must be float32"),
    (lambda y, z, w: (y, z, w.astype(mx.float32)), TypeError, "weight must have z's dtype"),
    (lambda y, z, w: (y.astype(mx.bfloat16), z, w), TypeError, "y must be float32 or z's dtype"),
    (lambda y, z, w: (y.astype(mx.int32), z, w), TypeError, "y must be float32"),
    (lambda y, z, w: (y[:, :4], z, w), ValueError, "y and z must have the same shape"),
    (lambda y, z, w: (y, z, w[:4]), ValueError, r"weight must have shape \(8,\)"),
    (lambda y, z, w: (y, z, w.reshape(2, 4)), ValueError, "weight must have shape"),
    (lambda y, z, w: (y[0, 0], z[0, 0], w), ValueError, "z must have at least 1 dimension"),
    (lambda y, z, w: (y.tolist(), z, w), TypeError, "y must be an mx.array"),
])
def test_bad_input(mutate, exc, match):
    y, z, w = mutate(*_ok())
    with pytest.raises(exc, match=r"^\[gated_rms_norm\] " + match):
        mt.gated_rms_norm(y, z, w)


@pytest.mark.parametrize("eps, exc", [
    (-1e-5, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    ("1e-5", TypeError), (True, TypeError),
])
def test_bad_eps(eps, exc):
    with pytest.raises(exc, match=r"^\[gated_rms_norm\] eps"):
        mt.gated_rms_norm(*_ok(), eps=eps)


def test_zero_length_rows_rejected():
    y, z, w = _ok(n=0)
    with pytest.raises(ValueError, match=r"^\[gated_rms_norm\] the last axis \(n\) must be >= 1"):
        mt.gated_rms_norm(y, z, w)
