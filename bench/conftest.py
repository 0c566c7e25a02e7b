"""Shared pieces of the pytest-benchmark suites (run: pytest bench/ --benchmark-only)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_metaltile import _device, backends
from mlx_metaltile._registry import TOLERANCES

PROVIDERS = ("metaltile", "mlx_native", "reference")
ROTATE = 3  # input copies cycled through so caches do not flatter


def provider_fn(case, provider, reference_fn):
    if provider == "metaltile":
        backend = backends.resolve_backend()
        if backend not in ("metal", "cuda"):
            pytest.skip(f"no GPU kernel backend here (auto resolves to {backend})")
        return case.ours
    if provider == "mlx_native":
        if case.native is None:
            pytest.skip("no native MLX equivalent")
        return case.native
    return reference_fn


def run_case(benchmark, case, provider, reference_fn):
    """Check once against the oracle, then time ``provider`` on rotating inputs."""
    fn = provider_fn(case, provider, reference_fn)
    rng = np.random.default_rng(0)
    inputs = [case.make(rng) for _ in range(ROTATE)]
    got = fn(**inputs[0])
    want = case.oracle(**inputs[0])
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    tol = TOLERANCES[case.dtype_name]
    # Native composites may round intermediates to the model dtype: allow them 4x the bound.
    slack = 4.0 if provider == "mlx_native" else 1.0
    mag = case.magnitude(**inputs[0]) if case.magnitude is not None else np.abs(want)
    # Native composites may round products or partial sums of a reduction to the model dtype:
    # their rounding term scales with the reduction's magnitude, not with |want|.
    rounded = mag if provider == "mlx_native" else np.abs(want)
    bound = slack * (tol.atol + tol.rtol * rounded + tol.accum * mag)
    assert np.all(np.abs(got - want) <= bound), f"{provider} is wrong for {case.id}"
    cycle = itertools.cycle(inputs)
    benchmark.extra_info.update(bytes=case.nbytes, flops=case.flops, op=case.op,
                                shape=case.label, dtype=case.dtype_name, provider=provider,
                                device=_device.device_name())
    benchmark.pedantic(lambda: mx.eval(fn(**next(cycle))), rounds=20, iterations=1,
                       warmup_rounds=3)
