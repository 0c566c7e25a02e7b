"""gated_rms_norm against a float64 NumPy oracle, on every backend available here."""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import assert_close
from mlx_metaltile.cases.gated_rms_norm import (
    make_inputs,
    oracle,
    run_and_check,
    wide_kernels_from,
)
from mlx_metaltile.ops._common import clear_plans

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
LENGTHS = (1, 3, 31, 32, 33, 128, 512, 1000, 4096, 4097, 8192)
LEADING = ((), (5,), (2, 3))
op_module = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")


# Every kernel output in this module starts as NaN (conftest.poisoned_outputs).
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


@pytest.mark.parametrize("lead", LEADING, ids=lambda s: "lead" + "x".join(map(str, s)))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("y_f32", (True, False), ids=("y_f32", "y_same"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_matches_oracle(any_backend, rng, dtype, y_f32, n, lead):
    y, z, w = make_inputs(rng, lead, n, dtype, mx.float32 if y_f32 else dtype)
    run_and_check(y, z, w, 1e-5, any_backend)


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
    run_and_check(y, z, w, 1e-6, any_backend)


def _emulator_modules() -> int:
    """Instantiations the emulator compiled for the simd_rows kernel object (one module per
    generated source: a new template argument or input signature is a new one)."""
    spec = op_module.SIMD_ROWS_SPEC
    return len(backends.get_kernel(spec, "emulator")._modules)


EPS_LOOP = (1e-5, 0.0, 1e-6, 0.5, 3.0)
N_ROWS_LOOP = ((64, 3), (100, 7), (128, 1), (33, 16))  # all in the simd_rows variant


def _eps_and_n_loop(backend, rng, launches):
    """Calls over several eps, n and row counts within one variant. Returns (kernel objects
    built, distinct instantiations launches, emulator modules compiled after the first call
    or None on other backends)."""
    y, z, w = make_inputs(rng, (3,), 64, mx.float16, mx.float32)
    run_and_check(y, z, w, EPS_LOOP[0], backend)
    built = backends.built_kernels()
    modules = _emulator_modules() if backend == "emulator" else None
    for eps in EPS_LOOP:
        for n, rows in N_ROWS_LOOP:
            y, z, w = make_inputs(rng, (rows,), n, mx.float16, mx.float32)
            run_and_check(y, z, w, eps, backend)
    assert {launch.name for launch in launches} == {op_module.SIMD_ROWS_SPEC.name}
    assert len(launches) == 1 + len(EPS_LOOP) * len(N_ROWS_LOOP)
    new_built = len(backends.built_kernels()) - len(built)
    new_modules = None if modules is None else _emulator_modules() - modules
    return new_built, len({launch.key for launch in launches}), new_modules


def test_eps_and_n_changes_do_not_rebuild(kernel_backend, rng, launches):
    """eps, n and the row count are runtime inputs: one instantiation serves them all."""
    new_built, instantiations, new_modules = _eps_and_n_loop(kernel_backend, rng, launches)
    assert new_built == 0
    assert instantiations == 1
    if kernel_backend == "emulator":
        assert new_modules == 0


def test_negative_control_eps_as_template_argument(kernel_backend, monkeypatch, rng, launches):
    """A launcher that bakes eps into a template argument makes one instantiation per eps
    value: the counts above must see it."""
    real_prepare = backends.prepare

    def prepare(spec, backend, *, template, **kwargs):
        bits = int(np.array(kwargs["inputs"]["eps"]).view(np.int32))
        spec = replace(spec, params=(*spec.params, "EPS_BITS"))
        return real_prepare(spec, backend, template={**template, "EPS_BITS": bits}, **kwargs)

    monkeypatch.setattr(backends, "prepare", prepare)
    _, instantiations, new_modules = _eps_and_n_loop(kernel_backend, rng, launches)
    assert instantiations == len(EPS_LOOP)
    if kernel_backend == "emulator":
        assert new_modules == len(EPS_LOOP) - 1  # the first eps was compiled before the loop


def test_non_contiguous_inputs(any_backend, rng):
    base_y = mx.array(rng.standard_normal((64, 6)).astype(np.float32))
    y = base_y.T  # transposed: [6, 64], not row-contiguous
    z = mx.array(rng.standard_normal((6, 128)).astype(np.float32)).astype(mx.bfloat16)[:, ::2]
    w = mx.array(rng.uniform(-1, 1, size=(64,)).astype(np.float32)).astype(mx.bfloat16)
    run_and_check(y, z, w, 1e-5, any_backend)


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

@pytest.mark.parametrize("attr, n", [("SIMD_ROWS_SPEC", 100), ("REGISTER_SPEC", 200),
                                     ("LOOPED_SPEC", 5000)])
@pytest.mark.parametrize("old, new", [
    ("mt_silu(", "("),  # silu(z) replaced by z
    ("if (col < n) {", "if (col + 1 < n) {"),  # the last column never written: poison shows
], ids=("without_gate", "leaving_the_last_column"))
def test_negative_control_broken_kernel(kernel_backend, broken_kernel, rng, attr, n, old, new):
    """A kernel broken in each variant: the harness must notice."""
    broken_kernel(getattr(op_module, attr), (old, new))
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-5, kernel_backend)


@pytest.mark.parametrize("attr, n", [("SIMD_ROWS_SPEC", 128), ("REGISTER_SPEC", 1000),
                                     ("LOOPED_SPEC", 4097)])
def test_negative_control_kernel_unscaled_squares(kernel_backend, broken_kernel, rng, attr, n):
    """y^2 summed without scaling the row by its max |y| (sum y^2 overflows float32 from
    |y| ~ 1e18 at these n): rows of |y| ~ 1e20 must notice; ordinary rows do not."""
    broken_kernel(getattr(op_module, attr), ("row_max > 0.0f ? row_max : 1.0f", "1.0f"))
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    run_and_check(y, z, w, 1e-5, kernel_backend)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y * 1e20, z, w, 1e-5, kernel_backend)


def test_negative_control_reference_squaring_in_y_dtype(monkeypatch, rng):
    """A composite that squares y in its own dtype fails the large-magnitude check."""

    def square_in_y_dtype(y, z, w, eps=1e-5):
        inv_rms = mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True).astype(mx.float32) + eps)
        zf = z.astype(mx.float32)
        out = w.astype(mx.float32) * y.astype(mx.float32) * inv_rms * (zf * mx.sigmoid(zf))
        return out.astype(y.dtype)

    monkeypatch.setattr(op_module, "_reference", square_in_y_dtype)
    y, z, w = large_inputs(rng, 128, mx.float16, mx.float16)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-6, "reference")


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
        run_and_check(y, z, w, 1e-5, kernel_backend)
    assert len(seen) == 3 and all(math.isnan(v) for v in seen), seen


def test_negative_control_reference_without_gate(monkeypatch, rng):
    """The oracle harness rejects a composite that forgets the gate."""

    def no_gate(y, z, w, eps=1e-5):
        yf = y.astype(mx.float32)
        return (w * yf * mx.rsqrt(mx.mean(yf * yf, axis=-1, keepdims=True) + eps)).astype(y.dtype)

    monkeypatch.setattr(op_module, "_reference", no_gate)
    y, z, w = make_inputs(rng, (4,), 64, mx.float32, mx.float32)
    with backends.use_backend("reference"), pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-5, "reference")


# ---- the wide_row and simd_looped variants (cuda's plan), forced on every kernel backend --

# (rows, n): n <= 4096 runs wide_row (one and several chunks of 8 per thread, ragged tails,
# a row shorter than one SIMD-group's chunks), longer rows simd_looped (one and several steps,
# a partial last threadgroup of SIMD-groups: rows not a multiple of 8).
WIDE_SHAPES = ((9, 129), (8, 255), (3, 256), (1, 257), (5, 1000), (2, 1001), (2, 4096),
               (3, 4097), (9, 5000), (1, 8192))


def wide_variant(n: int) -> str:
    return "wide_row" if n <= op_module.MAX_REGISTER_ROW else "simd_looped"


@pytest.fixture
def wide(kernel_backend):
    """Rows longer than 128 run the wide_row / simd_looped variants on the kernel backend
    (any row count)."""
    with wide_kernels_from(kernel_backend, 1):
        yield kernel_backend


@pytest.mark.parametrize("rows, n", WIDE_SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("y_f32", (True, False), ids=("y_f32", "y_same"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_wide_matches_oracle(wide, launches, rng, dtype, y_f32, rows, n):
    y, z, w = make_inputs(rng, (rows,), n, dtype, mx.float32 if y_f32 else dtype)
    run_and_check(y, z, w, 1e-5, wide)
    assert [launch.name for launch in launches] == [f"gated_rms_norm_{wide_variant(n)}"]


@pytest.mark.parametrize("n", (300, 4096, 5000))
def test_wide_items_16(wide, launches, monkeypatch, rng, n):
    """Each kernel's other instantiation (ITEMS 16)."""
    monkeypatch.setattr(op_module, "WIDE_ROW_ITEMS", 16)
    monkeypatch.setattr(op_module, "SIMD_LOOPED_ITEMS", 16)
    clear_plans()
    try:
        y, z, w = make_inputs(rng, (9,), n, mx.bfloat16, mx.float32)
        run_and_check(y, z, w, 1e-5, wide)
    finally:
        clear_plans()
    assert [(launch.name, dict(launch.template)["ITEMS"]) for launch in launches] == [
        (f"gated_rms_norm_{wide_variant(n)}", 16)]


@pytest.mark.parametrize("n", (300, 4096, 5000))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_wide_large_magnitudes(wide, rng, dtype, n):
    """Rows from |y| ~ 1e3 to 1e-3 (simd_looped: the lanes' running maxima differ, so their
    sums are rescaled when combined)."""
    y, z, w = large_inputs(rng, n, dtype, dtype)
    run_and_check(y, z, w, 1e-6, wide)


@pytest.mark.parametrize("n", (1000, 5000))
def test_wide_one_large_element(wide, rng, n):
    """One |y| = 1e30 in each row, in a different thread and chunk per row, the rest ~ 1
    (sum y^2 overflows float32; simd_looped: the lane holding it rescales its own sum, the
    others are rescaled when combined)."""
    y, z, w = make_inputs(rng, (6,), n, mx.float32, mx.float32)
    big = np.array(y)
    for r, col in enumerate((0, 31, 32, 255, 256, n - 1)):
        big[r, col] = 1e30 * (-1) ** r
    run_and_check(mx.array(big), z, w, 1e-5, wide)


@pytest.mark.parametrize("n", (1000, 5000), ids=wide_variant)
@pytest.mark.parametrize("old, new, ragged", [
    ("mt_silu(", "(", False),
    ("mt_store8_bounded(out + base, col, n, o", "mt_store8_bounded(out + base, col, n - 1, o",
     True),  # a ragged row's last column left unwritten
    ("mt_load8_bounded(z + base", "mt_load8_bounded(y + base", False),  # z read as y
    ("row_max > 0.0f ? row_max : 1.0f", "1.0f", False),  # squares unscaled: 1e20 overflows
], ids=("without_gate", "leaving_the_last_column", "z_read_as_y", "unscaled_squares"))
def test_wide_negative_controls(wide, broken_kernel, rng, old, new, ragged, n):
    """A kernel broken in each way fails the harness (on rows that show it)."""
    variant = wide_variant(n)
    if old == "mt_silu(" and variant == "wide_row":
        old = "mt_silu_fast("  # its gate (fast::divide)
    broken_kernel(getattr(op_module, f"{variant.upper()}_SPEC"), (old, new))
    n += ragged
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    if old.startswith("row_max"):
        y = y * 1e20
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-5, wide)


def test_simd_looped_negative_control_no_rescale(wide, broken_kernel, rng):
    """simd_looped's running sum not rescaled when the lane's max grows: rows whose first
    elements are small and later ones larger notice."""
    broken_kernel(op_module.SIMD_LOOPED_SPEC, ("s_l *= c * c;", ""))
    n = 5000
    y, z, w = make_inputs(rng, (3,), n, mx.float32, mx.float32)
    y = y * mx.array(np.where(np.arange(n) < 256, 1e-3, 1.0).astype(np.float32))
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_and_check(y, z, w, 1e-5, wide)


@pytest.mark.parametrize("offset", (0, 1, 3, 4))
@pytest.mark.parametrize("n", (256, 1000, 1001, 5000))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_wide_any_element_offset(wide, rng, dtype, n, offset):
    """y, z, w and their rows at any element offset from a buffer's start (slices of a
    larger array; odd n staggers the rows): the 16-byte accesses of the CUDA layer are
    taken only where aligned, element by element elsewhere."""
    rows = 5
    y, z, w = make_inputs(rng, (rows,), n, dtype, dtype)

    def at_offset(a):
        flat = mx.concatenate([mx.zeros((offset,), dtype=a.dtype), a.reshape(-1)])
        return flat[offset:].reshape(a.shape)

    run_and_check(at_offset(y), at_offset(z), at_offset(w), 1e-5, wide)


@pytest.mark.parametrize("n, y_reads", [(1000, 1), (5000, 2)], ids=("wide_row", "simd_looped"))
def test_wide_traffic(wide, launches, rng, n, y_reads):
    """z and w read once per row, out written once, y once (wide_row) or twice (simd_looped:
    the second pass from cache on a GPU): exactly the row's elements, nothing past n."""
    if wide != "emulator":
        pytest.skip("byte counters are the emulator's")
    rows = 3
    y, z, w = make_inputs(rng, (rows,), n, mx.bfloat16, mx.float32)
    run_and_check(y, z, w, 1e-5, wide)
    stats = launches[-1].stats
    assert stats.bytes_read["y"] == y_reads * rows * n * 4
    assert stats.bytes_read["z"] == rows * n * 2
    assert stats.bytes_read["w"] == rows * n * 2
    assert stats.bytes_written["out"] == rows * n * 4 and stats.bytes_read["out"] == 0


def test_cuda_plan_runs_the_wide_kernels(launch_recorder, monkeypatch):
    """cuda's plan: rows of 129 to 4096 run wide_row from WIDE_ROW_MIN_ROWS["cuda"] rows on,
    longer rows simd_looped from SIMD_LOOPED_MIN_ROWS["cuda"] rows on (the looped kernel
    below); Metal runs neither."""
    wide_least = op_module.WIDE_ROW_MIN_ROWS["cuda"]
    looped_least = op_module.SIMD_LOOPED_MIN_ROWS["cuda"]
    for backend, rows, n, want in (
            ("cuda", wide_least, 4096, "wide_row"), ("cuda", wide_least, 129, "wide_row"),
            ("cuda", wide_least - 1, 4096, "row"),
            ("cuda", looped_least, 8192, "simd_looped"),
            ("cuda", looped_least - 1, 4097, "looped"), ("cuda", looped_least, 128, "simd_rows"),
            ("metal", looped_least, 4096, "row"), ("metal", looped_least, 8192, "looped")):
        monkeypatch.setattr(backends, "resolve_backend", lambda name=None, b=backend: b)
        clear_plans()
        launch_recorder.seen.clear()
        y = mx.zeros((rows, n), dtype=mx.bfloat16)
        mx.eval(mt.gated_rms_norm(y, y, mx.ones((n,), dtype=mx.bfloat16)))
        assert [name for name, *_ in launch_recorder.seen] == [f"gated_rms_norm_{want}"], (
            backend, rows, n)
    launch_recorder.assert_declared()
    clear_plans()


# ---- bad input ------------------------------------------------------------------------

def _ok(dtype=mx.float16, n=8, lead=(2,)):
    return (mx.zeros((*lead, n), dtype=mx.float32), mx.zeros((*lead, n), dtype=dtype),
            mx.ones((n,), dtype=dtype))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda y, z, w: (y, z.astype(mx.int32), w.astype(mx.int32)), TypeError, "z must be float32"),
    (lambda y, z, w: (y, z, w.astype(mx.int32)), TypeError, "weight must be float32"),
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

