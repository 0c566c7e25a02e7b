"""Each op's test material, one module per op (``mlx_metaltile.cases.<op>``): its float64
oracle written from the math, the magnitude of its float32 error, its benchmark cases and
one checked call per kernel variant. The op tests (tests/ops), the pytest benchmarks
(bench/) and ``python -m mlx_metaltile bench`` all read them from here.

A cases module states ``OP``, ``bench_cases() -> list[BenchCase]`` and ``VARIANT_CALLS``
(variant -> ``call(backend, rng)``, a checked call that launches that kernel). Its bench
cases include forward + backward ones (``grad_case``: labels ``grad-...``, ``--shape grad``
selects them), timed against MLX's autodiff of the same native composite. Every module
of this package not starting with ``_`` is one, found without being listed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

from ._base import (
    DTYPES,
    FLOAT32_TINY,
    BenchCase,
    assert_close,
    bound,
    check_rows,
    expect_launches,
    f64,
    fwd_bwd,
    grad_case,
    to_f64,
)

__all__ = ["DTYPES", "FLOAT32_TINY", "BenchCase", "assert_close", "bound", "cases",
           "check_rows", "expect_launches", "f64", "fwd_bwd", "grad_case", "modules",
           "to_f64", "variant_calls"]


@functools.cache
def modules() -> dict[str, ModuleType]:
    """op name -> its cases module, every one in this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found[module.OP] = module
    return found


@functools.cache
def _all_cases() -> tuple[BenchCase, ...]:
    return tuple(c for module in modules().values() for c in module.bench_cases())


def cases(op: str | None = None, quick: bool = False) -> list[BenchCase]:
    """The benchmark cases of ``op`` (every op when None); ``quick``: the short default run."""
    return [c for c in _all_cases() if (op is None or c.op == op) and (c.quick or not quick)]


def variant_calls(op: str) -> dict[str, Callable] | None:
    """variant -> checked call of ``op``'s cases module, or None if ``op`` has none."""
    module = modules().get(op)
    return None if module is None else module.VARIANT_CALLS
