"""Helpers for the emulator's own tests: build and run a kernel body in one call."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_metaltile import emulator as em

requires_emulator = pytest.mark.skipif(em.unavailable_reason() is not None,
                                       reason=f"emulator unavailable: {em.unavailable_reason()}")
_names = itertools.count()


def run(source: str, inputs: dict, outputs: dict, grid, threadgroup, *, template=(),
        header: str = "", init_value=None, ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False, name: str | None = None):
    """Run ``source`` once; outputs maps name -> (shape, dtype). Returns NumPy arrays (float64
    for floating outputs, so bfloat16 comes back as its value)."""
    kernel = em.metal_kernel(name=name or f"t{next(_names)}", input_names=list(inputs),
                             output_names=list(outputs), source=source, header=header,
                             ensure_row_contiguous=ensure_row_contiguous,
                             atomic_outputs=atomic_outputs)
    arrays = [v if isinstance(v, mx.array) else mx.array(v) for v in inputs.values()]
    result = kernel(inputs=arrays, template=list(template), grid=grid, threadgroup=threadgroup,
                    output_shapes=[s for s, _ in outputs.values()],
                    output_dtypes=[d for _, d in outputs.values()], init_value=init_value)
    return [to_numpy(r) for r in result]


def to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.float16, mx.bfloat16, mx.float32):
        return np.array(a.astype(mx.float32)).astype(np.float64)
    return np.array(a)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32 (the oracle)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = r.astype(np.uint32).view(np.float32)
    return np.where(nan, np.float32(np.nan), out)
