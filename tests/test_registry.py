"""The kernel registry, the template renderer and the backend controls."""

from __future__ import annotations

import pickle
import re
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import support
from support import require_backend

import mlx_metaltile as mt
from mlx_metaltile import _registry, _templates, backends, cases
from mlx_metaltile._msl.source import compact
from mlx_metaltile._registry import TOLERANCES
from mlx_metaltile.ops._common import variant_reason


def test_every_kernel_record_is_complete():
    specs = mt.kernels()
    assert specs, "registry is empty"
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for spec in specs:
        assert spec.op and spec.variant and spec.geometry
        assert set(spec.dtypes) <= set(TOLERANCES), spec.name
        assert set(spec.backends) <= set(backends.KERNEL_BACKENDS), spec.name
        assert callable(getattr(mt, spec.op)), f"{spec.op} is not exported"


@pytest.mark.parametrize("spec", mt.kernels(), ids=lambda s: s.name)
def test_template_renders_with_header_comment(spec):
    tpl = _templates.render(spec.template)
    text = _templates.read_text(spec.template)
    head = text.split(_templates.BODY_MARKER, 1)[0]
    assert head.lstrip().startswith("//"), "a template starts with its comment block"
    assert "DISPATCH INVARIANTS" in head
    assert tpl.body.strip(), "empty body"
    # local includes are inlined; system headers (<metal_tensor>, ...) stay as includes
    assert '#include "' not in tpl.header, "local includes are inlined"
    # threadgroup arrays belong at kernel scope (in the body), never in the header helpers
    assert not re.search(r"^\s*threadgroup\s+[^*&;]+\s+\w+\s*\[", tpl.header, re.M)


def test_compact_drops_comments_and_indentation_line_for_line():
    text = ('  #define K 4  // four\n'
            '\tfloat x = 1.0f; /* a block\n   over two lines */ float y = 2.0f;\n'
            '    const char* s = "a // kept"; char c = \'/\'; // gone "quoted"\n'
            '// a whole comment line with an apostrophe\'s\n'
            '  return;  \n')
    assert compact(text) == ('#define K 4\n'
                             'float x = 1.0f;\n'
                             'float y = 2.0f;\n'
                             'const char* s = "a // kept"; char c = \'/\';\n'
                             '\n'
                             'return;\n')


@pytest.mark.parametrize("spec", mt.kernels(), ids=lambda s: s.name)
def test_gpu_backends_build_the_compacted_template(spec):
    """Metal and cuda get the template without comments (MLX hashes the source per launch),
    on the same lines; the emulator gets it as written (its messages quote lines)."""
    tpl = _templates.render(spec.template)
    assert backends.kernel_text(spec, "emulator") == (tpl.header, tpl.body)
    for backend in backends.GPU_BACKENDS:
        header, body = backends.kernel_text(spec, backend)
        assert (header, body) == (compact(tpl.header), compact(tpl.body))
        assert header.count("\n") == tpl.header.count("\n")
        assert body.count("\n") == tpl.body.count("\n")
        assert "//" not in header + body and len(body) < len(tpl.body)


def test_every_template_file_is_registered_or_included():
    used = {s.template for s in mt.kernels()}
    for name in _templates.list_templates():
        if name.endswith(".metal"):
            assert name in used, f"{name} is not registered"


def test_backend_controls():
    assert mt.get_backend() == "auto"
    with mt.use_backend("reference"):
        assert mt.get_backend() == "reference"
        assert backends.resolve_backend() == "reference"
    assert mt.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        mt.set_backend("opencl")
    for name, reason in mt.available_backends().items():
        if reason is not None:
            with pytest.raises(backends.BackendUnavailableError, match=name):
                mt.set_backend(name)
            with pytest.raises(backends.BackendUnavailableError):
                with mt.use_backend(name):
                    pass
    assert mt.get_backend() == "auto"


def test_auto_resolves_to_an_available_backend():
    resolved = backends.resolve_backend("auto")
    assert backends.unavailable_reason(resolved) is None
    if mx.metal.is_available():
        assert resolved == "metal"


@pytest.mark.parametrize("grid, tg, mem, match", [
    ((32, 1, 1), (48, 1, 1), 0, "multiple of 32"),
    ((32, 1, 1), (2048, 1, 1), 0, "at most 1024"),
    ((32, 1, 1), (32, 1, 1), 40000, "threadgroup memory"),
    ((0, 1, 1), (32, 1, 1), 0, "empty dispatch"),
    ((2**32, 1, 1), (32, 1, 1), 0, "exceeds 2\\^32-1"),
])
def test_geometry_guard(grid, tg, mem, match):
    with pytest.raises(ValueError, match=r"^\[op\] .*" + match):
        backends.check_geometry("op", grid, tg, mem)


@pytest.mark.parametrize("grid, tg, ok", [
    ((32, 65535, 1), (32, 1, 1), True), ((32, 1, 65535), (32, 1, 1), True),
    ((32, 8 * 65535, 1), (32, 8, 1), True), ((32, 65536, 1), (32, 1, 1), False),
    ((32, 8 * 65535 + 1, 1), (32, 8, 1), False), ((32, 1, 65536), (32, 1, 1), False),
    ((32 * 2**20, 1, 1), (32, 1, 1), True)])
def test_cuda_grid_guard(grid, tg, ok):
    """CUDA launches at most 65535 threadgroups along y and z (x far more); Metal's grid has
    no such limit, so the check is cuda's alone."""
    if ok:
        backends.check_cuda_grid("op", grid, tg)
        return
    axis = "y" if grid[1] // tg[1] > 1 else "z"
    with pytest.raises(ValueError, match=rf"^\[op\] problem too large for one launch on "
                                         rf"cuda: \d+ threadgroups along the grid's {axis} "
                                         r"axis, at most 65535"):
        backends.check_cuda_grid("op", grid, tg)


def test_cuda_grid_guard_at_the_op(monkeypatch, rng):
    """An op call whose grid CUDA cannot launch is refused when it is built (here
    gated_rms_norm's SIMD-rows kernel at 8 * 65535 + 8 rows: 65536 threadgroups along y),
    naming the op; at 8 * 65535 rows it is built (the call is recorded, not run)."""
    from mlx_metaltile.ops._common import clear_plans

    monkeypatch.setattr(backends, "resolve_backend", lambda name=None: "cuda")
    monkeypatch.setattr(backends.Prepared, "__call__",
                        lambda self, *arrays: [mx.zeros(s, d) for s, d in
                                               zip(self._shapes, self._dtypes, strict=True)])
    clear_plans()
    try:
        w = mx.ones((128,))
        mt.gated_rms_norm(mx.zeros((8 * 65535, 128)), mx.zeros((8 * 65535, 128)), w)
        y = mx.zeros((8 * 65535 + 8, 128))
        with pytest.raises(ValueError, match=r"^\[gated_rms_norm\] problem too large for "
                                             r"one launch on cuda: 65536 threadgroups"):
            mt.gated_rms_norm(y, y, w)
    finally:
        clear_plans()


HOST_READS = {  # each way of reading an array on the host, applied to a lazy 0-d int32 array
    "eval": lambda a: mx.eval(a),
    "async_eval": lambda a: (mx.async_eval(a), mx.synchronize()),
    "item": lambda a: a.item(),
    "tolist": lambda a: a.tolist(),
    "__array__": lambda a: a.__array__(),
    "np.array": lambda a: np.array(a),  # looked up at call time: the fixture patches them
    "np.asarray": lambda a: np.asarray(a),
    "np.asanyarray": lambda a: np.asanyarray(a),
    "np.ascontiguousarray": lambda a: np.ascontiguousarray(a),
    "__bool__": lambda a: 1 if a else 0,
    "__int__": int,
    "__float__": float,
    "__index__": lambda a: [0, 1, 2][a],
    "__complex__": complex,
    "__repr__": repr,
    "__str__": str,
    "__format__": lambda a: f"{a:}",
    "__dlpack__": np.from_dlpack,
    "__getstate__": pickle.dumps,
}


def test_no_host_sync_fixture_lists_every_sync():
    """The fixture forbids exactly the mx.array methods and NumPy readers exercised here."""
    names = {n.split(".")[-1] for n in HOST_READS}
    assert set(support.SYNC_METHODS) | set(support.NUMPY_READERS) | {"eval", "async_eval"} \
        == names


@pytest.mark.parametrize("how", HOST_READS)
def test_no_host_sync_fixture_catches_syncs(no_host_sync, how):
    """The laziness tests rely on this: each of these reads evaluates a lazy graph in MLX
    (the peak memory shows its 16 MiB temporary), and inside the fixture it raises."""
    read = HOST_READS[how]

    def lazy():
        return (mx.ones((1 << 22,)) * 2).sum().astype(mx.int32) - (1 << 23) + 1

    mx.reset_peak_memory()
    read(lazy())
    assert mx.get_peak_memory() >= 4 << 22, f"{how} did not evaluate the graph"
    a = lazy()
    with no_host_sync():
        with pytest.raises(AssertionError, match="evaluated its graph"):
            read(a)
    assert a.item() == 1 and repr(a) == "array(1, dtype=int32)"  # nothing left patched
    assert np.asarray(np.zeros(2)).shape == (2,)


def test_launch_recorder_rejects_an_undeclared_launch(launch_recorder):
    """The instantiation tests rely on this: a launch no instantiation declares fails."""
    mt.gated_rms_norm(mx.ones((2, 8)), mx.ones((2, 8)), mx.ones((8,)))
    launch_recorder.assert_declared()
    name, template, inputs, outputs = launch_recorder.seen[0]
    launch_recorder.seen.append((name, (*template, ("EXTRA", 1)), inputs, outputs))
    with pytest.raises(AssertionError):
        launch_recorder.assert_declared()


# ---- every registered kernel is benchmarked and launched by its op's tests ----------------

def check_bench_cases(specs) -> None:
    """Each op of ``specs`` has benchmark cases (what `python -m mlx_metaltile bench` and
    bench/ run)."""
    missing = sorted({s.op for s in specs if not cases.cases(s.op)})
    assert not missing, f"registered ops without benchmark cases: {missing}"


def check_variant_is_launched(spec, backend: str, rng) -> None:
    """mlx_metaltile/cases/<op>.py has a checked call for ``spec`` (VARIANT_CALLS), and that
    call launches this very kernel on ``backend``."""
    calls = cases.variant_calls(spec.op)
    if calls is None:
        raise AssertionError(f"{spec.name}: no mlx_metaltile/cases/{spec.op}.py")
    assert spec.variant in calls, (
        f"{spec.name}: mlx_metaltile/cases/{spec.op}.py has no "
        f"VARIANT_CALLS[{spec.variant!r}], so no test launches this variant")
    before = backends.launch_count(spec.name, backend)
    calls[spec.variant](backend, rng)
    assert backends.launch_count(spec.name, backend) > before, (
        f"{spec.name}: VARIANT_CALLS[{spec.variant!r}] of mlx_metaltile/cases/{spec.op}.py "
        f"launched other kernels, not this one, on {backend}")


def test_every_registered_op_has_benchmark_cases():
    check_bench_cases(mt.kernels())


@pytest.mark.parametrize("spec", mt.kernels(), ids=lambda s: s.name)
def test_every_registered_variant_is_launched_by_its_op_tests(kernel_backend, poisoned_outputs,
                                                             rng, spec):
    reason = variant_reason(spec, kernel_backend)
    if reason is not None:
        pytest.skip(f"{spec.name} does not run on {kernel_backend} here: {reason}")
    check_variant_is_launched(spec, kernel_backend, rng)


def test_coverage_checks_fail_for_an_uncovered_registration(monkeypatch, rng):
    """A kernel registered with no test call, a test call that launches another kernel, and
    an op with neither tests nor benchmark cases: each is caught."""
    require_backend("emulator")
    real = _registry.get_spec("gated_rms_norm_simd_rows")
    fake = replace(real, variant="fake", template="gated_rms_norm_fake.metal")
    other_op = replace(real, op="no_such_op", template="no_such_op.metal")
    for spec in (fake, other_op):
        monkeypatch.setitem(_registry._REGISTRY, spec.name, spec)
    assert fake in mt.kernels() and other_op in mt.kernels()

    with pytest.raises(AssertionError, match=r"\['no_such_op'\]"):
        check_bench_cases(mt.kernels())
    with pytest.raises(AssertionError,
                       match="no_such_op_simd_rows: no mlx_metaltile/cases/no_such_op.py"):
        check_variant_is_launched(other_op, "emulator", rng)
    with backends.use_backend("emulator"):
        with pytest.raises(AssertionError, match=r"has no VARIANT_CALLS\['fake'\]"):
            check_variant_is_launched(fake, "emulator", rng)
        # a call for the new variant that still launches the old kernel
        calls = cases.variant_calls("gated_rms_norm")
        monkeypatch.setitem(calls, "fake", calls["simd_rows"])
        with pytest.raises(AssertionError, match="launched other kernels, not this one"):
            check_variant_is_launched(fake, "emulator", rng)
        check_variant_is_launched(real, "emulator", rng)  # and the real one passes
