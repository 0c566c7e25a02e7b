"""The kernel registry: one record per kernel variant.

Tests, benchmarks, the README table and ``python -m mlx_metaltile kernels`` iterate over
it, so a new kernel is covered by registering its record in its op module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Tolerance:
    """|got - want| <= atol + rtol * |want| + accum * magnitude, elementwise.

    ``rtol`` covers one rounding of the output to its dtype; ``accum`` covers float32
    accumulation, relative to ``magnitude`` = the float64 sum of |terms| behind each output
    (for an elementwise op it is |want| itself).
    """

    rtol: float
    atol: float
    accum: float = 2e-6


# The one tolerance table (per output dtype). Kernels compute in float32 and round once.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1e-5, atol=1e-6),
    "float16": Tolerance(rtol=1e-3, atol=1e-5),  # 2 half-ulps of binary16 (2^-11 each)
    "bfloat16": Tolerance(rtol=8e-3, atol=1e-4),  # 2 half-ulps of bfloat16 (2^-8 each)
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

    @property
    def name(self) -> str:
        return f"{self.op}_{self.variant}"


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
