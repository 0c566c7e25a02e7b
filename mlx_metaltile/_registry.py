"""The kernel registry: one record per kernel variant.

Tests, benchmarks, the README table and ``python -m mlx_metaltile kernels`` iterate over
it, so a new kernel is covered by registering its record in its op module.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Tolerance:
    """|got - want| <= atol + rtol * |want| + accum * magnitude (+ 2^-126 * scale), elementwise.

    ``rtol`` is two half-ulps of the output dtype: one rounding of a float32 result, plus
    the float32 result itself rounding the other way. ``accum`` covers float32 evaluation
    and accumulation, relative to ``magnitude`` = the float64 sum of |terms| behind each
    output (for an elementwise op, |want| times the op's own growth of float32 error).
    ``atol`` is the bottom of the output's range (float32 and bfloat16: the smallest normal
    2^-126, which float32 arithmetic may flush to zero; float16: its smallest subnormal).
    Where an op multiplies an intermediate that may fall below float32's normal range, the
    test adds 2^-126 times that factor (``scale``; see tests/tolerances.py).
    """

    rtol: float
    atol: float
    accum: float = 2e-6


# The one tolerance table (per output dtype). Kernels compute in float32 and round once.
# rtol = 2^-(p-1) for a p-bit significand; atol as in Tolerance's docstring.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=2.0**-23, atol=2.0**-126),
    "float16": Tolerance(rtol=2.0**-10, atol=2.0**-24),
    "bfloat16": Tolerance(rtol=2.0**-7, atol=2.0**-126),
}


@dataclass(frozen=True)
class KernelSpec:
    op: str
    variant: str
    template: str  # file name in msl_templates/
    dtypes: tuple[str, ...]  # activation / output dtypes the kernel is instantiated for
    geometry: str  # the rule the launcher follows, in words
    backends: tuple[str, ...] = ("metal", "cuda", "emulator")
    tolerance: dict[str, Tolerance] = field(default_factory=lambda: dict(TOLERANCES))
    notes: str = ""

    @functools.cached_property
    def name(self) -> str:  # computed once: every launch looks kernels up by it
        return f"{self.op}_{self.variant}"


@dataclass(frozen=True)
class KernelInstance:
    """One instantiation of a kernel variant, as its launcher makes it.

    Enough to generate the kernel's source on any backend without running it (the CUDA
    compile check uses it): template arguments, and the dtype and rank of every input and
    output (rank 0 = a 0-d array, passed by reference in Metal).
    """

    template: tuple[tuple[str, Any], ...]  # (name, mx.Dtype | int | bool)
    inputs: tuple[tuple[str, Any, int], ...]  # (name, mx.Dtype, ndim)
    outputs: tuple[tuple[str, Any], ...]  # (name, mx.Dtype)
    atomic_outputs: bool = False


_REGISTRY: dict[str, KernelSpec] = {}


def register(*specs: KernelSpec) -> tuple[KernelSpec, ...]:
    for spec in specs:
        if spec.name in _REGISTRY and _REGISTRY[spec.name] != spec:
            raise ValueError(f"[mlx_metaltile] kernel {spec.name} registered twice")
        _REGISTRY[spec.name] = spec
    return specs


def kernels() -> tuple[KernelSpec, ...]:
    """Every registered kernel variant, in registration order."""
    return tuple(_REGISTRY.values())


def get_spec(name: str) -> KernelSpec:
    return _REGISTRY[name]


def instantiations(spec: KernelSpec) -> tuple[KernelInstance, ...]:
    """The instantiations of ``spec`` its launcher can make.

    Each op module (``mlx_metaltile.ops.<op>``) provides them through a module-level hook
    ``instantiations(spec) -> Sequence[KernelInstance]`` covering every dtype in
    ``spec.dtypes`` (and every other template argument that changes the code).
    """
    module = importlib.import_module(f"mlx_metaltile.ops.{spec.op}")
    hook = getattr(module, "instantiations", None)
    if hook is None:
        raise LookupError(f"[{spec.op}] mlx_metaltile.ops.{spec.op} has no "
                          "instantiations(spec) hook (see mlx_metaltile._registry)")
    return tuple(hook(spec))
