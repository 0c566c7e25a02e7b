"""What every op's cases module shares: the benchmark case record (forward, and forward +
backward), float64 conversion, the one tolerance check and the checks every quantized op's
call ends with."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import backends
from .._registry import TOLERANCES

DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # the benchmark order
FLOAT32_TINY = 2.0**-126  # float32's smallest normal: float32 arithmetic may flush below it


@dataclass(frozen=True)
class BenchCase:
    """Fresh inputs (``make``) and three callables over them: ours (the public op on the
    selected backend), the native MLX composite it replaces, and a float64 NumPy oracle
    written from the math. ``nbytes`` counts every input read once plus the outputs."""

    op: str
    label: str
    dtype: mx.Dtype
    make: Callable[[np.random.Generator], dict]
    ours: Callable[..., mx.array]
    native: Callable[..., mx.array] | None
    oracle: Callable[..., np.ndarray]
    nbytes: int
    flops: int
    quick: bool = False  # part of the short default run
    # float64 sum of |terms| behind each output, for the tolerance's accumulation term
    # (reductions such as matmuls); None: |oracle| (elementwise ops).
    magnitude: Callable[..., np.ndarray] | None = None
    # A forward + backward case (see grad_case): the inputs differentiated, in the order
    # their gradients are concatenated; () for a forward case.
    wrt: tuple[str, ...] = ()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).rsplit(".", 1)[-1]

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}-{self.dtype_name}"


def to_f64(a) -> np.ndarray:
    """An mx.array (any float dtype, bfloat16 included) or array-like as float64 NumPy."""
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        return np.array(a).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


f64 = to_f64


def verify(condition, message="") -> None:
    """Raise AssertionError(``message``) unless ``condition``: the harness's checks (a kernel
    launched, dtypes and shapes, NaN rows), which fail as ``assert_close`` does. Explicit,
    where an ``assert`` statement would vanish under ``python -O`` and pass every check.
    ``message`` is built before the call: one that reads the failure itself (the first bad
    element) is raised by the caller instead."""
    if not condition:
        raise AssertionError(message)


def assert_close(got, want, dtype, magnitude=None, what: str = "",
                 underflow_scale=None) -> None:
    """|got - want| <= atol + rtol*|want| + accum*magnitude + FLOAT32_TINY*underflow_scale
    elementwise, for ``dtype``'s row of the tolerance table (mlx_metaltile._registry).

    ``magnitude`` is the float64 sum of |terms| behind each output (defaults to |want|);
    ``underflow_scale`` is the factor by which the op multiplies an intermediate that may
    fall below float32's normal range (FLOAT32_TINY; defaults to 0). NaN in ``got`` always
    fails (outputs never written stay poisoned).
    """
    name = str(dtype).rsplit(".", 1)[-1]
    tol = TOLERANCES[name]
    got = to_f64(got)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what} shape {got.shape} != expected {want.shape}")
    limit = bound(want, dtype, magnitude, underflow_scale)
    err = np.abs(got - want)
    bad = ~(err <= limit)  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what} {int(bad.sum())}/{bad.size} elements out of tolerance ({name}: {tol}); "
            f"first at {idx}: got {got[idx]!r}, want {want[idx]!r}, bound {limit[idx]:.3g}; "
            f"max err {np.nanmax(np.where(np.isnan(err), np.inf, err)):.3g}")


def bound(want, dtype, magnitude=None, underflow_scale=None) -> np.ndarray:
    """The elementwise bound on |got - want|: the one tolerance formula (see Tolerance in
    mlx_metaltile._registry), for tests, benchmarks and ``python -m mlx_metaltile bench``."""
    tol = TOLERANCES[str(dtype).rsplit(".", 1)[-1]]
    want = np.asarray(want, dtype=np.float64)
    mag = np.abs(want) if magnitude is None else np.asarray(magnitude, dtype=np.float64)
    out = tol.atol + tol.rtol * np.abs(want) + tol.accum * mag
    if underflow_scale is not None:
        out = out + FLOAT32_TINY * np.asarray(underflow_scale, dtype=np.float64)
    return out


# ---- the checks every quantized op's call ends with -----------------------------------------

@contextlib.contextmanager
def expect_launches(backend: str, count: int = 1, name: str | None = None):
    """Around an op call and its evaluation: assert that it launched ``count`` kernels (of
    ``name``, when given) on ``backend``, the proof that a kernel ran (never the reference
    compared with itself). Nothing is asserted on the reference backend."""
    before = backends.launch_count(name, backend)
    yield
    if backend != "reference":
        verify(backends.launch_count(name, backend) == before + count, name or backend)


def check_rows(out: mx.array, want, magnitude, valid, dtype, what: str) -> None:
    """A quantized op's output against its float64 oracle: ``dtype`` and the oracle's shape,
    NaN wherever ``valid`` is False (an id outside [0, E)), the rest within the tolerance
    table (``valid`` indexes the leading axes of ``want``)."""
    want = np.asarray(want)
    verify(out.dtype == dtype and tuple(out.shape) == want.shape, (
        f"{what}: {out.dtype} {tuple(out.shape)}, expected {dtype} {want.shape}"))
    got = to_f64(out)
    verify(np.isnan(got[~valid]).all(), f"{what}: an out-of-range id must give a NaN row")
    assert_close(got[valid], want[valid], dtype, magnitude=np.asarray(magnitude)[valid],
                 what=what)


# ---- forward + backward cases ------------------------------------------------------------

def fwd_bwd(fn: Callable[..., mx.array], wrt: Sequence[str]) -> Callable[..., mx.array]:
    """``fn`` (keyword inputs -> one array) run forward and backward through ``mx.vjp``,
    with respect to the inputs named ``wrt`` and with the cotangent of its output passed as
    the input ``g``: (**inputs) -> the gradients raveled and concatenated in ``wrt``'s
    order, one array, so one benchmark case times and checks them together."""
    wrt = tuple(wrt)

    def run(*, g, **inputs):
        held = {key: value for key, value in inputs.items() if key not in wrt}

        def primal(*arrays):
            return fn(**held, **dict(zip(wrt, arrays, strict=True)))

        _, grads = mx.vjp(primal, [inputs[key] for key in wrt], [g])
        return mx.concatenate([d.reshape(-1) for d in grads])

    return run


def _shared_evaluation(terms: Callable[..., list]) -> Callable[..., list]:
    """``terms`` evaluated once per input set: the oracle and the magnitude of a case are
    asked for in turn with the same inputs (the last inputs and result are kept: their
    arrays stay alive, so identity marks the same set)."""
    last: list = []

    def call(**inputs):
        values = list(inputs.values())
        if last and len(last[0]) == len(values) and all(
                a is b for a, b in zip(last[0], values, strict=True)):
            return last[1]
        result = terms(**inputs)
        last[:] = [values, result]
        return result

    return call


def oracle_and_magnitude(terms: Callable[..., tuple]) -> tuple[Callable, Callable]:
    """A case's ``oracle`` and ``magnitude`` from one float64 computation ``terms``
    (**inputs) -> (result, magnitude), made once per input set (the error check asks for
    both in turn)."""
    shared = _shared_evaluation(terms)
    return (lambda **inputs: shared(**inputs)[0]), (lambda **inputs: shared(**inputs)[1])


def grad_case(*, op: str, label: str, dtype: mx.Dtype, make: Callable, ours: Callable,
              native: Callable | None, wrt: Sequence[str], grad_oracle: Callable,
              nbytes: int, flops: int, quick: bool = False) -> BenchCase:
    """A forward + backward benchmark case, labelled ``grad-<label>``: ``ours`` and
    ``native`` (the op and the native composite, keyword inputs) through :func:`fwd_bwd`
    w.r.t. ``wrt``; ``make`` gives their inputs plus the cotangent ``g``; ``grad_oracle``
    (**inputs) -> one float64 (gradient, magnitude) per name of ``wrt``, from the math.
    The concatenation of the gradients, paid by both sides, is not counted in ``nbytes``."""
    terms = _shared_evaluation(grad_oracle)

    def oracle(**inputs):
        return np.concatenate([np.ravel(d) for d, _ in terms(**inputs)])

    def magnitude(**inputs):
        return np.concatenate([np.ravel(m) for _, m in terms(**inputs)])

    return BenchCase(op=op, label=f"grad-{label}", dtype=dtype, make=make,
                     ours=fwd_bwd(ours, wrt),
                     native=None if native is None else fwd_bwd(native, wrt),
                     oracle=oracle, magnitude=magnitude, nbytes=nbytes, flops=flops,
                     quick=quick, wrt=tuple(wrt))
