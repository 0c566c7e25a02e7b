"""gated_rms_norm: fused kernel vs MLX's rms_norm + gate composite vs the reference.

The ``grad-`` cases time forward + backward (``mx.vjp`` w.r.t. y, z and weight, the gradients
concatenated) against MLX's autodiff of the same native composite; their bytes are stated in
``mlx_metaltile/cases/gated_rms_norm.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROVIDERS, case_ids, get_case, run_case

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases.gated_rms_norm import gated_rms_norm_native
from mlx_metaltile.ops.gated_rms_norm import gated_rms_norm_reference


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", case_ids("gated_rms_norm"))
def test_gated_rms_norm(benchmark, case, provider):
    run_case(benchmark, get_case("gated_rms_norm", case), provider, gated_rms_norm_reference)


# ---- Python overhead of building one call (no eval; kernel cached) -----------------------

class _LazyStandIn:
    """Stands in for a built kernel where none can run: returns one lazy node per output,
    so the timing covers our checks, geometry, cache lookup and launch bookkeeping."""

    def __call__(self, *, inputs, output_shapes, output_dtypes, **kwargs):
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


@pytest.mark.parametrize("provider", ("metaltile", "mlx_native"))
def test_call_overhead(benchmark, monkeypatch, provider):
    benchmark.group = "gated_rms_norm call overhead (no eval)"
    y = mx.zeros((32, 128), dtype=mx.float32)
    z = mx.zeros((32, 128), dtype=mx.bfloat16)
    w = mx.ones((128,), dtype=mx.bfloat16)
    mx.eval(y, z, w)
    if provider == "metaltile":
        backend = backends.resolve_backend()
        if backend == "reference":
            # No kernel backend here: the real call path (backend resolution, checks,
            # geometry, kernel cache lookup) as on metal, around a cached stand-in kernel.
            backend = "metal"
            monkeypatch.setattr(backends, "_default", "metal")
            stand_in = _LazyStandIn()
            for spec in mt.kernels():
                monkeypatch.setitem(backends._kernel_cache, ("metal", spec.name), stand_in)
        benchmark.extra_info["backend"] = backend
        benchmark(mt.gated_rms_norm, y, z, w, 1e-5)
    else:
        benchmark(gated_rms_norm_native, y, z, w, 1e-5)
