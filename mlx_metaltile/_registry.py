"""The kernel registry: one record per kernel variant, its signature stated as data.

Tests, benchmarks, the README table and ``python -m mlx_metaltile kernels`` iterate over
it, so a new kernel is covered by registering its record in its op module (importing the
module registers it; ``mlx_metaltile/ops/__init__.py`` imports every op).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

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
    test adds 2^-126 times that factor (``scale``; see mlx_metaltile.cases.check).
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
class Arg:
    """One kernel input or output.

    ``dtype`` is the rule for its element type: a concrete dtype name ("uint32",
    "float32") or the name of a type variable (a template parameter such as "T", or a free
    variable such as "I" for an index dtype) bound by each of the kernel's instantiations.
    ``ndim`` is its rank (0: a scalar, a 0-d array passed by reference in Metal).
    """

    name: str
    dtype: str
    ndim: int = 0


def scalars(*names: str, dtype: str = "uint32") -> tuple[Arg, ...]:
    """Scalar (0-d) inputs of one dtype, in order."""
    return tuple(Arg(name, dtype, 0) for name in names)


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


# The values a kernel's type variables and template parameters take: one mapping per
# instantiation the launcher can make (a product of choices, see ``grid``).
Bindings = Callable[[], Iterable[Mapping[str, Any]]]


def grid(**choices: Iterable) -> Bindings:
    """Every combination of the given choices (name -> values), as instantiation bindings."""
    names = tuple(choices)
    values = tuple(tuple(v) for v in choices.values())
    return lambda: (dict(zip(names, combo, strict=True)) for combo in itertools.product(*values))


@dataclass(frozen=True)
class KernelSpec:
    """A kernel variant: its template file, its signature and the instantiations it takes.

    ``inputs`` / ``outputs`` are the kernel's arguments in order; ``params`` names its
    template parameters in the order MLX instantiates them; ``bindings`` yields the values
    of every template parameter and type variable for each instantiation the launcher can
    make (``instantiations(spec)`` builds them; the CUDA compile check compiles them all).
    """

    op: str
    variant: str
    template: str  # file name in msl_templates/
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    params: tuple[str, ...]  # template parameters, in the order MLX instantiates them
    bindings: Bindings
    geometry: str  # the rule the launcher follows, in words
    dtypes: tuple[str, ...] = FLOAT_DTYPES  # activation / output dtypes it is instantiated for
    backends: tuple[str, ...] = ("metal", "cuda", "emulator")
    features: tuple[str, ...] = ()  # GPU features it needs (mlx_metaltile._device)
    atomic_outputs: bool = False
    notes: str = ""
    # cuda only: (most threads per threadgroup it is launched with, threadgroups that should
    # fit on an SM at once), CUDA's __launch_bounds__, which caps the registers per thread;
    # the Metal compiler never sees it
    cuda_launch_bounds: tuple[int, int] | None = None

    @functools.cached_property
    def name(self) -> str:  # computed once: every launch looks kernels up by it
        return f"{self.op}_{self.variant}"

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.inputs)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.outputs)


def _dtype(rule: str, binding: Mapping[str, Any]) -> mx.Dtype:
    value = binding[rule] if rule in binding else getattr(mx, rule)
    if not isinstance(value, mx.Dtype):
        raise TypeError(f"[mlx_metaltile] dtype rule {rule!r} binds {value!r}, not an mx.Dtype")
    return value


def instance(spec: KernelSpec, binding: Mapping[str, Any]) -> KernelInstance:
    """The instantiation of ``spec`` that ``binding`` names."""
    return KernelInstance(
        template=tuple((name, binding[name]) for name in spec.params),
        inputs=tuple((a.name, _dtype(a.dtype, binding), a.ndim) for a in spec.inputs),
        outputs=tuple((a.name, _dtype(a.dtype, binding)) for a in spec.outputs),
        atomic_outputs=spec.atomic_outputs,
    )


def instantiations(spec: KernelSpec) -> tuple[KernelInstance, ...]:
    """Every instantiation of ``spec`` its launcher can make (distinct, in order)."""
    return tuple(dict.fromkeys(instance(spec, b) for b in spec.bindings()))


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
