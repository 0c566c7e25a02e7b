"""Shared pieces of the pytest-benchmark suites (run: pytest bench/ --benchmark-only).

Each benchmark case is one pytest-benchmark group, named like ``gated_rms_norm[4096x4096-y=T-bf16]``,
so its providers are timed side by side (and pytest-benchmark's ratios compare them):
  metaltile   our kernel on the GPU kernel backend (metal or cuda; skipped without one)
  mlx_native  the native MLX op(s) the kernel replaces
  reference   our pure-MLX reference composite
  emulator    our kernel on the CPU emulator, for correctness-only runs where no GPU exists.
              It runs the kernel eagerly on the CPU, so its time is the emulator's, not a
              kernel's: it gets a group of its own (suffix ``emulator: not a kernel timing``),
              no GB/s, and covers the short subset of cases only.
Parameters are the cases' short ids (strings), so ``--benchmark-json`` serialises them.
A forward + backward case (label ``grad-...``) runs every provider through ``mx.vjp``, its
gradients concatenated; its ``reference`` is the public op on the reference backend (the
composite and the VJP it is given there).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

import mlx_metaltile as mt
from mlx_metaltile import _device, backends
from mlx_metaltile.cases import bound, cases

PROVIDERS = ("metaltile", "mlx_native", "reference", "emulator")
ROTATE = 3  # input copies cycled through so caches do not flatter
SHORT_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
NOT_A_KERNEL_TIMING = "emulator: not a kernel timing"


def short_id(case) -> str:
    return f"{case.label}-{SHORT_DTYPE[case.dtype_name]}"


def group_name(case) -> str:
    return f"{case.op}[{short_id(case)}]"


def case_ids(op: str) -> list[str]:
    return [short_id(c) for c in cases(op)]


def get_case(op: str, case_id: str):
    return {short_id(c): c for c in cases(op)}[case_id]


def _on(backend: str, fn):
    def call(**inputs):
        with mt.use_backend(backend):
            return fn(**inputs)
    return call


def provider_fn(case, provider, reference_fn):
    """(callable, the backend it runs on) for ``provider``, or a skip saying why not."""
    if provider == "metaltile":
        backend = backends.resolve_backend()
        if backend not in ("metal", "cuda"):
            pytest.skip(f"no GPU kernel backend here (auto resolves to {backend}); the "
                        "emulator provider checks the kernels without one")
        return case.ours, backend
    if provider == "emulator":
        reason = backends.unavailable_reason("emulator")
        if reason is not None:
            pytest.skip(f"emulator unavailable: {reason}")
        if not case.quick:
            pytest.skip("the emulator provider runs the short subset of cases only")
        return _on("emulator", case.ours), "emulator"
    device = "mlx-" + str(mx.default_device().type).rsplit(".", 1)[-1]  # mlx-cpu / mlx-gpu
    if provider == "mlx_native":
        if case.native is None:
            pytest.skip("no native MLX equivalent")
        return case.native, device
    if case.wrt:
        return _on("reference", case.ours), device
    return reference_fn, device


def default_check(case, provider, got, inputs) -> None:
    want = case.oracle(**inputs)
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    # Native composites may round intermediates to the model dtype: allow them 4x the bound.
    slack = 4.0 if provider == "mlx_native" else 1.0
    mag = case.magnitude(**inputs) if case.magnitude is not None else np.abs(want)
    # Native composites may round products or partial sums of a reduction to the model dtype:
    # their rounding term scales with the reduction's magnitude, not with |want|.
    rounded = mag if provider == "mlx_native" else want
    limit = slack * bound(rounded, case.dtype, mag)
    assert np.all(np.abs(got - want) <= limit), f"{provider} is wrong for {case.id}"


def run_case(benchmark, case, provider, reference_fn, check=default_check,
             provider_name=None):
    """Check once against the oracle, then time ``provider`` on rotating inputs, in the
    case's group (the emulator in a group of its own: its time is not a kernel's)."""
    fn, runs_on = provider_fn(case, provider, reference_fn)
    rng = np.random.default_rng(0)
    inputs = [case.make(rng) for _ in range(ROTATE if provider != "emulator" else 1)]
    check(case, provider, fn(**inputs[0]), inputs[0])
    cycle = itertools.cycle(inputs)
    emulated = provider == "emulator"
    benchmark.group = group_name(case) + (f" ({NOT_A_KERNEL_TIMING})" if emulated else "")
    benchmark.extra_info.update(
        case=group_name(case), op=case.op, shape=case.label, dtype=case.dtype_name,
        provider=provider_name or provider, backend=runs_on, device=_device.device_name(),
        mlx_version=mx.__version__, package_version=mt.__version__, bytes=case.nbytes,
        flops=case.flops)
    if emulated:
        benchmark.extra_info["note"] = ("the emulator runs the kernel on the CPU when the op "
                                        "is called: the time is the emulator's (correctness "
                                        "only)")
    benchmark.pedantic(lambda: mx.eval(fn(**next(cycle))), rounds=3 if emulated else 20,
                       iterations=1, warmup_rounds=0 if emulated else 3)
    if not emulated:  # bytes the case moves over the median time of one call
        benchmark.extra_info["gbps"] = case.nbytes / benchmark.stats.stats.median / 1e9
