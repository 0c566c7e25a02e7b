"""backends.prepare's Prepared launch: what it reads per call (the kernel object a template
override swaps in, the default device, the launch counters), on the GPU backends' paths
with stand-in kernel objects (no GPU needed)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

from mlx_metaltile import backends
from mlx_metaltile._msl.constants import scalar

op_module = importlib.import_module("mlx_metaltile.ops.gated_rms_norm")
SPEC = op_module.SIMD_ROWS_SPEC
ROWS, N = 8, 64


class _Made:
    """Stands in for a kernel factory (``mx.fast.metal_kernel`` / ``cuda_kernel``): every
    kernel object it makes records (its name, its source) per call and returns zeros."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, name, source, **_):
        def call(*, output_shapes, output_dtypes, **__):
            self.calls.append((name, source))
            return [mx.zeros(s, dtype=d)
                    for s, d in zip(output_shapes, output_dtypes, strict=True)]
        call.name, call.source = name, source  # as the cuda executor's kernel objects
        return call


@pytest.fixture(params=("metal", "cuda"))
def stand_in(request, monkeypatch):
    """(backend, the factory's record): metal's kernel objects, or the MLX kernels under
    the cuda executor, stand-ins; the kernels built here are forgotten afterwards."""
    made = _Made()
    monkeypatch.setattr(backends, "_kernel_cache", {})
    if request.param == "metal":
        monkeypatch.setattr(mx.fast, "metal_kernel", made)
    else:
        monkeypatch.setattr(mx.fast, "cuda_kernel", made)
    return request.param, made


def _prepared(backend: str) -> backends.Prepared:
    return backends.prepare(
        SPEC, backend,
        inputs={"y": None, "z": None, "w": None, "n_cols": scalar(N, mx.uint32),
                "n_rows": scalar(ROWS, mx.uint32), "eps": scalar(1e-5, mx.float32)},
        template={"T": mx.float32}, outputs={"out": ((ROWS, N), mx.float32)},
        grid=(32, ROWS, 1), threadgroup=(32, 8, 1))


def _arrays():
    return mx.ones((ROWS, N)), mx.ones((ROWS, N)), mx.ones((N,))


def test_template_override_takes_effect_per_call(stand_in):
    """One Prepared launches the overridden kernel while the override holds, the real one
    before and after, each launch counted."""
    backend, made = stand_in
    launch, arrays = _prepared(backend), _arrays()
    before = backends.launch_count(SPEC.name, backend)
    launch(*arrays)
    with backends.template_override(SPEC, ("mt_silu(", "(")):
        launch(*arrays)
        launch(*arrays)
    launch(*arrays)
    assert backends.launch_count(SPEC.name, backend) == before + 4
    names = [name for name, _ in made.calls]
    assert len(names) == 4 and names[0] == names[3] != names[1] == names[2]
    assert "_override" in names[1] and "_override" not in names[0]
    assert [("mt_silu(" in source) for _, source in made.calls] == [True, False, False, True]


def test_template_override_reaches_every_spec_of_the_template(stand_in):
    """expert_qmv.metal builds two specs (expert_qmv's own, moe_gather_qmm's GEMV rows). An
    override through one builds the other's kernel from the edited text too, even where it
    was built before; afterwards the kernel built before is launched again, nothing of the
    override left behind."""
    qmv = importlib.import_module("mlx_metaltile.ops.expert_qmv")
    gemv_spec = importlib.import_module("mlx_metaltile.ops.moe_gather_qmm").GEMV_SPEC
    assert gemv_spec.template == qmv.SPEC.template
    backend, _ = stand_in
    before = backends.get_kernel(gemv_spec, backend)
    edit = ("constexpr bool PLAIN_SHUFFLES = ROUND && MODE == 0 && BITS == 4;",
            "constexpr bool PLAIN_SHUFFLES = true;")
    with backends.template_override(qmv.SPEC, edit):
        inside = backends.get_kernel(gemv_spec, backend)
    after = backends.get_kernel(gemv_spec, backend)
    assert inside is not before and after is before
    assert "_override" in inside.name and "PLAIN_SHUFFLES = true" in inside.source
    assert "_override" not in after.name and "PLAIN_SHUFFLES = true" not in after.source


def test_cpu_default_device_is_refused_while_a_gpu_exists(stand_in, monkeypatch):
    """A launch that has run is still refused, by the op's name and the way out, once the
    default device is the CPU on a machine with a GPU (MLX would refuse it less clearly)."""
    backend, made = stand_in
    launch, arrays = _prepared(backend), _arrays()
    launch(*arrays)  # no GPU here: the check lets a stand-in through
    monkeypatch.setattr(backends, "_gpu_available", lambda: True)
    count = backends.launch_count(SPEC.name, backend)
    with mx.stream(mx.cpu), pytest.raises(ValueError, match=(
            rf"^\[gated_rms_norm\] the {backend} backend runs kernels on the GPU, got a stream "
            r"on Device\(cpu, 0\); pass a GPU stream or device, or use the reference backend "
            r"for the CPU$")):
        launch(*arrays)
    assert backends.launch_count(SPEC.name, backend) == count and len(made.calls) == 1
