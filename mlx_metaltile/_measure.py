"""Measuring one benchmark case: timing samples on rotating input copies, and the error of a
result against the case's float64 oracle under the tolerance table."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cases import bound

ROTATE_BYTES = 512 * 2**20  # bytes moved per rotation: several times any GPU's L2/SLC
COPY_BUDGET = 4 * 2**30  # memory the input copies may take
MAX_COPIES = 64

# Backends whose op call does the work before returning (the emulator runs the kernel when
# the op is called): timing their evaluation alone would time nothing, so they are not timed.
EAGER = {"emulator": "the emulator runs each kernel on the CPU when the op is called: its "
                     "times would be the emulator's, not a kernel's"}


def samples(fn, inputs: list[dict], warmup: int, iters: int, batch: int) -> list[float]:
    """Seconds per call, one per sample: each sample evaluates ``batch`` calls queued together
    (so launch latency overlaps as in model code), cycling through the input copies. Only the
    evaluation is timed: building the lazy graph is Python work a model overlaps with the GPU."""
    return samples_in_turns([fn], inputs, warmup, iters, batch)[0]


def samples_in_turns(fns: list, inputs: list[dict], warmup: int, iters: int,
                     batch: int) -> list[list[float]]:
    """:func:`samples` of each function, taken in turns: each round one sample of each, in
    order on even rounds and in reverse on odd ones, so that a slow spell of the machine
    (another process, a clock change) falls on every side alike instead of on whichever was
    being timed. The input copies rotate across all samples: no sample reads copies the one
    before it has just brought into the cache (where the copies are more than a batch)."""
    for fn in fns:
        for i in range(warmup):
            mx.eval(fn(**inputs[i % len(inputs)]))
    times: list[list[float]] = [[] for _ in fns]
    k = 0
    for r in range(iters):
        for j in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            outs = []
            for _ in range(batch):
                outs.append(fns[j](**inputs[k % len(inputs)]))
                k += 1
            start = time.perf_counter()
            mx.eval(outs)
            times[j].append((time.perf_counter() - start) / batch)
    return times


def copies(inputs: dict, nbytes: int, min_rotate: int, gpu: bool) -> list[dict]:
    """Device copies of one input set, enough that the bytes a rotation touches exceed the
    last-level cache several times over (without exceeding COPY_BUDGET of memory); on a CPU
    backend only ``min_rotate``."""
    in_bytes = sum(v.nbytes for v in inputs.values() if isinstance(v, mx.array))
    wanted = -(-ROTATE_BYTES // max(nbytes, 1))
    fits = max(COPY_BUDGET // max(in_bytes, 1), 1)
    count = max(min_rotate, min(wanted, fits, MAX_COPIES)) if gpu else min_rotate
    out = [inputs]
    for _ in range(count - 1):  # distinct buffers: the cache cannot serve one copy's lines
        out.append({k: (v + 0 if isinstance(v, mx.array) and v.ndim else v)
                    for k, v in inputs.items()})
        mx.eval([v for v in out[-1].values() if isinstance(v, mx.array)])
    return out


@dataclass(frozen=True)
class Error:
    """``abs``: max |got - oracle|; ``rel``: that over the largest magnitude of the case (the
    float64 sum of |terms| behind an output, or |oracle| for an elementwise op); ``ratio``:
    the largest error / tolerance bound over the elements (<= 1 passes); ``ok``: every element
    within its bound (a NaN never is)."""

    abs: float
    rel: float
    ratio: float
    ok: bool


def to_f64(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return np.array(a).astype(np.float64)


def error(case, got: mx.array, inputs: dict) -> Error:
    """``got`` against ``case.oracle`` under the tolerance table's entry for the case's
    dtype."""
    want = case.oracle(**inputs)
    err = np.abs(to_f64(got) - want)
    mag = case.magnitude(**inputs) if case.magnitude is not None else np.abs(want)
    limit = bound(want, case.dtype, mag)
    ok = bool(np.all(err <= limit))
    if not err.size:
        return Error(0.0, 0.0, 0.0, ok)
    top = float(np.nanmax(np.abs(mag))) if np.any(np.isfinite(mag)) else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        worst = np.where(np.isnan(err), np.inf, err / limit)
    abs_err = float(np.max(np.where(np.isnan(err), np.inf, err)))
    return Error(abs_err, abs_err / top if top else float("inf") if abs_err else 0.0,
                 float(np.max(worst)), ok)
