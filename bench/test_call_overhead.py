"""Python cost of building one op call (checks, geometry, kernel cache, launch bookkeeping;
no evaluation), ours vs the native composite, one decode-sized case per op.

In decode, mlx-lm builds the next token's graph while the GPU runs the current one, so an op
whose graph takes longer to build than its kernel takes to run makes the model CPU-bound.
On a GPU kernel backend the real kernels are built and called (not evaluated); where none
exists (reference backend) the real call path runs as on ``metal`` around a cached stand-in
kernel object, whose own ``mx.zeros`` is part of the figure.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import backends
from mlx_metaltile.cases import cases

# One decode-sized case per op (label substring, dtype): the calls a decode step makes.
DECODE_CASES = {
    "gated_rms_norm": "1x4096-y=T",
    "sdpa_multi": "h32/8-L1-kv4k",
    "expert_qmv": "qwen3moe-up-E128k8-4b",
    "expert_glu": "qwen3-30b",
    "expert_down_combine": "qwen3-30b",
    "fp4_qmm": "M1-N4096",
    "moe_gather_qmm": "M8-N768-K2048-E128-b4",
    "moe_route": "qwen3-30b-E128k8-1tok",
}


def _case(op: str):
    label = DECODE_CASES[op]
    return next(c for c in cases(op) if label in c.label and c.dtype_name != "float32")


class _LazyStandIn:
    """Stands in for a built kernel where none can run: one lazy node per output."""

    def __call__(self, *, inputs, output_shapes, output_dtypes, **kwargs):
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


@pytest.mark.parametrize("provider", ("metaltile", "mlx_native"))
@pytest.mark.parametrize("op", sorted(DECODE_CASES))
def test_call_overhead(benchmark, monkeypatch, op, provider):
    case = _case(op)
    benchmark.group = f"call overhead (no eval): {case.id}"
    inputs = case.make(np.random.default_rng(0))
    mx.eval([v for v in inputs.values() if isinstance(v, mx.array)])
    if provider == "mlx_native":
        benchmark(lambda: case.native(**inputs))
        return
    backend = backends.resolve_backend()
    if backend == "reference":
        backend = "metal"
        monkeypatch.setattr(backends, "_default", "metal")
        for spec in mt.kernels():
            monkeypatch.setitem(backends._kernel_cache, ("metal", spec.name), _LazyStandIn())
    elif backend == "emulator":
        pytest.skip("the emulator runs each kernel when the op is called: not a build cost")
    benchmark.extra_info["backend"] = backend
    benchmark(lambda: case.ours(**inputs))
