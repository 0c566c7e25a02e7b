"""The kernel registry, the template renderer and the backend controls."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

import mlx_metaltile as mt
from mlx_metaltile import _templates, backends
from mlx_metaltile._registry import TOLERANCES


def test_every_kernel_record_is_complete():
    specs = mt.kernels()
    assert specs, "registry is empty"
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for spec in specs:
        assert spec.op and spec.variant and spec.geometry
        assert set(spec.dtypes) <= set(TOLERANCES), spec.name
        assert set(spec.tolerance) >= set(spec.dtypes), spec.name
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


def test_no_host_sync_fixture_catches_syncs(no_host_sync):
    """The laziness tests rely on this: inside it, each way of syncing raises."""
    a = mx.ones((2,)) + 1
    with no_host_sync():
        for sync in (lambda: mx.eval(a), lambda: mx.async_eval(a), lambda: a.item(),
                     lambda: a.tolist(), lambda: a.__array__()):
            with pytest.raises(AssertionError, match="evaluated its graph"):
                sync()
    assert a.tolist() == [2.0, 2.0]  # and nothing is left patched afterwards


def test_launch_recorder_rejects_an_undeclared_launch(launch_recorder):
    """The instantiation tests rely on this: a launch no instantiation declares fails."""
    mt.gated_rms_norm(mx.ones((2, 8)), mx.ones((2, 8)), mx.ones((8,)))
    launch_recorder.assert_declared()
    name, template, inputs, outputs = launch_recorder.seen[0]
    launch_recorder.seen.append((name, (*template, ("EXTRA", 1)), inputs, outputs))
    with pytest.raises(AssertionError):
        launch_recorder.assert_declared()
