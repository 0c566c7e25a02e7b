"""Every registered kernel variant run once on one kernel backend against its float64 oracle
(``python -m mlx_metaltile check``).

Which variant a call runs is the launcher's choice, so the launch counters say which kernels
a benchmark case ran: for each op, variants that a ``variant=`` argument selects are asked
for by name, then one case per shape runs, from the smallest, until every variant has
launched. A
variant that no case launches is reported ``unchecked``, never ``pass``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import _measure, _registry, _show, backends

MAX_CASES = 16  # shapes tried per op (smallest first) before a variant is left unchecked


@dataclass(frozen=True)
class VariantResult:
    kernel: str
    status: str  # "pass", "FAIL", "unchecked", "n/a" (does not run on this backend)
    case: str = ""
    error: _measure.Error | None = None
    tolerance: _registry.Tolerance | None = None
    detail: str = ""


def _takes_variant(fn) -> bool:
    try:
        return "variant" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _launched(names, backend: str, before: dict[str, int]) -> list[str]:
    return [n for n in names if backends.launch_count(n, backend) > before[n]]


def check_variants(backend: str, cases=None,
                   progress: Callable[[str], None] = lambda text: None) -> list[VariantResult]:
    """One result per registered variant, in registration order."""
    if cases is None:
        from .cases import cases
    specs = _registry.kernels()
    results: dict[str, VariantResult] = {}
    for s in specs:
        if backend not in s.backends:
            results[s.name] = VariantResult(s.name, "n/a", detail=f"runs on {s.backends}")
    for op in dict.fromkeys(s.op for s in specs):
        pending = {s.name: s for s in specs if s.op == op and s.name not in results}
        runnable = tuple(pending)  # the op's kernels on this backend, checked or not
        by_shape = {}  # each shape's cases, cheapest dtype first; smallest shapes first
        for c in sorted(cases(op), key=lambda c: c.nbytes):
            by_shape.setdefault(c.label, []).append(c)
        shapes = list(by_shape.values())[:MAX_CASES]
        # asked for by name first (no case picks the mpp variants by default), then as the
        # launcher chooses. A variant asked for by name may refuse a dtype (fp4_qmm's
        # decoded takes only the dtypes that hold its weights): the shape's next dtype then.
        wanted = [s.variant for s in pending.values()] + [None]
        for variant in wanted:
            name = f"{op}_{variant}"
            for shape_cases in shapes:
                if not pending or (variant is not None and name not in pending):
                    break
                if variant is not None and not _takes_variant(shape_cases[0].ours):
                    break
                for case in shape_cases if variant is not None else shape_cases[:1]:
                    fn = case.ours if variant is None else functools.partial(
                        case.ours, variant=variant)
                    progress(f"{op} {variant or ''} {case.id} ...")
                    if _run(case, fn, backend, pending, results, runnable):
                        break  # not refused: this shape is done
        for name in pending:
            results[name] = VariantResult(name, "unchecked", detail="no benchmark case "
                                          f"launches it on {backend} (tried "
                                          f"{len(shapes)} shapes)")
    return [results[s.name] for s in specs]


def _run(case, fn, backend, pending, results, runnable=()) -> bool:
    """Run one case; False where the call was refused (a ValueError before any pending kernel
    launched), True otherwise. A crash is a failure of the kernels the call launched, checked
    already or not (``runnable``: the op's kernels on this backend); only when it launched
    none is it laid to the pending ones."""
    rng = np.random.default_rng(0)
    inputs = case.make(rng)
    before = {n: backends.launch_count(n, backend) for n in {*pending, *runnable}}
    try:
        with backends.use_backend(backend):
            out = fn(**inputs)
            mx.eval(out)
    except ValueError as exc:
        if not _launched(pending, backend, before):  # refused: this variant cannot take it
            return False
        for n in _launched(pending, backend, before):
            results[n] = VariantResult(n, "FAIL", case.id, detail=f"{type(exc).__name__}: "
                                       f"{exc}")
            del pending[n]
        return True
    except Exception as exc:  # a crashing kernel is a failure of what it launched
        names = _launched(list(before), backend, before) or list(pending)
        for n in names:
            results[n] = VariantResult(n, "FAIL", case.id, detail=f"{type(exc).__name__}: "
                                       f"{exc}")
            pending.pop(n, None)
        return True
    for n in _launched(pending, backend, before):
        tol = _registry.TOLERANCES[case.dtype_name]
        err = _measure.error(case, out, inputs)
        results[n] = VariantResult(n, "pass" if err.ok else "FAIL", case.id, err, tol)
        del pending[n]
    return True


def table(results: list[VariantResult]) -> _show.Table:
    rows = []
    for r in results:
        e, t = r.error, r.tolerance
        rows.append((r.kernel, r.status, r.case or "-",
                     "-" if e is None else f"{e.abs:.2e}",
                     "-" if e is None else f"{e.rel:.1e}",
                     "-" if e is None else f"{e.ratio:.3f}",
                     "-" if t is None else f"rtol {t.rtol:.1e} + accum {t.accum:.0e}",
                     r.detail))
    return _show.Table(("kernel", "result", "case", "abs err", "rel err", "err/tol",
                        "tolerance", "note"), rows,
                       right=(False, False, False, True, True, True, False, False))
