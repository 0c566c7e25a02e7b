"""Every registered kernel, translated for MLX's CUDA backend, compiles for sm_90.

No GPU is needed: this catches translation errors in CI. Each kernel template makes one
translation unit with all the instantiations its spec declares
(``instantiations(spec)``), in the exact text MLX's cuda_kernel builds; the units compile in
parallel with nvcc (device code only, -cubin) and, where libnvrtc is found, also with NVRTC
under the options MLX's JIT uses.
"""

from __future__ import annotations

import importlib
import itertools
import time

import mlx.core as mx
import nvcc_check
import pytest

import mlx_metaltile as mt
from mlx_metaltile import _registry

SPECS = tuple(s for s in mt.kernels() if "cuda" in s.backends)
COMPILERS = (
    pytest.param("nvcc", id="nvcc", marks=pytest.mark.skipif(
        nvcc_check.find_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME)")),
    pytest.param("nvrtc", id="nvrtc", marks=pytest.mark.skipif(
        nvcc_check.load_nvrtc() is None, reason=f"libnvrtc not found (set {nvcc_check.NVRTC_ENV})")),
)


def _units() -> tuple[dict[str, str], dict[str, str]]:
    """(unit text by kernel name, why a unit could not be made by kernel name)."""
    units, errors = {}, {}
    for spec in SPECS:
        try:
            units[spec.name] = nvcc_check.spec_unit(spec)
        except Exception as exc:  # noqa: BLE001 - reported by that kernel's test
            errors[spec.name] = f"{type(exc).__name__}: {exc}"
    return units, errors


_results: dict[str, tuple[dict, dict]] = {}


def compile_all(compiler: str, config) -> tuple[dict, dict]:
    """Every kernel's unit compiled once per session with ``compiler`` (in parallel)."""
    if compiler not in _results:
        units, errors = _units()
        start = time.perf_counter()
        if compiler == "nvcc":
            results = nvcc_check.compile_units(units)
            what = f"nvcc -arch={nvcc_check.DEFAULT_ARCH}"
        else:
            results = nvcc_check.nvrtc_compile_units(units)
            what = f"NVRTC {nvcc_check.DEFAULT_ARCH}a (MLX's JIT options)"
        elapsed = time.perf_counter() - start
        slowest = max(results.values(), key=lambda r: r.seconds, default=None)
        report(config, f"[cuda compile] {len(results)} translation units, {what}, "
                       f"{elapsed:.1f} s wall"
                       + (f" (slowest {slowest.unit}: {slowest.seconds:.1f} s)" if slowest else ""))
        _results[compiler] = (results, errors)
    return _results[compiler]


def report(config, line: str) -> None:
    """Print past pytest's output capture (the compile time is worth seeing in CI logs)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_compiles_for_sm90(request, compiler, spec):
    results, errors = compile_all(compiler, request.config)
    if spec.name in errors:
        pytest.fail(f"could not generate the CUDA source of {spec.name}: {errors[spec.name]}")
    result = results[spec.name]
    if not result.ok:
        pytest.fail(f"{compiler} rejected the CUDA translation of {spec.name} "
                    f"({' '.join(result.command)}):\n{result.log[-8000:]}")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_instantiations_cover_the_spec_dtypes(spec):
    instances = _registry.instantiations(spec)
    assert instances, f"{spec.name}: no instantiations"
    seen = {str(v).rsplit(".", 1)[-1] for inst in instances for _, v in inst.template
            if isinstance(v, mx.Dtype)}
    missing = set(spec.dtypes) - seen
    assert not missing, f"{spec.name}: instantiations miss the dtypes {sorted(missing)}"


def test_gated_rms_norm_instantiations_match_its_launches(launch_recorder, rng):
    """The hook describes what the launcher really passes (recorded, nothing runs)."""
    op = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")
    dtypes = (mx.float32, mx.float16, mx.bfloat16)
    for y_dtype, z_dtype, w_dtype in itertools.product(dtypes, repeat=3):
        for n in (100, 5000):
            y = mx.array(rng.standard_normal((3, n))).astype(y_dtype)
            z = mx.array(rng.standard_normal((3, n))).astype(z_dtype)
            op.gated_rms_norm(y, z, mx.ones((n,), dtype=w_dtype))
    assert len(launch_recorder.seen) == 27 * 2
    launch_recorder.assert_declared()
