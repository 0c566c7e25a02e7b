"""Autodiff of the quantized ops: ``mx.custom_function`` wrappers differentiable w.r.t. x.

The quantized weights, scales and biases are constants of these ops: asking for their
gradient raises an ``[op]`` error (MLX raises for the quantized weights of its quantized
matmuls; it differentiates affine scales and biases, these ops do not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import mlx.core as mx


@functools.cache
def _frozen_fn(op: str) -> Callable:
    """Identity on its arrays, with a VJP that raises: MLX calls it only when a gradient
    w.r.t. one of them is asked for. One per op (built once: cheap per call)."""

    @mx.custom_function
    def frozen(*a):
        return tuple(a)

    @frozen.vjp
    def frozen_vjp(primals, cotangents, outputs):
        raise ValueError(f"[{op}] no gradient with respect to the quantized weights, scales "
                         "or biases (constants of the op); differentiate with respect to x, "
                         "or dequantize them and use a float matmul to train them")

    return frozen


def _frozen(op: str, arrays: Sequence[mx.array | None]) -> list[mx.array | None]:
    """The arrays unchanged, through ``_frozen_fn(op)``."""
    out = iter(_frozen_fn(op)(*(a for a in arrays if a is not None)))
    return [None if a is None else next(out) for a in arrays]


def with_x_vjp(op: str, forward: Callable, x_vjp: Callable, x: mx.array,
               quantized: Sequence[mx.array | None]) -> mx.array:
    """``forward(x, *quantized)`` with the VJP ``x_vjp(cotangent, *quantized)`` -> dx;
    None entries of ``quantized`` (fp modes' biases) are passed through as None."""
    quantized = _frozen(op, quantized)
    slots = [a is not None for a in quantized]

    def full(rest):
        it = iter(rest)
        return [next(it) if s else None for s in slots]

    @mx.custom_function
    def fn(x, *rest):
        return forward(x, *full(rest))

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        x, *rest = primals
        return (x_vjp(cotangent, *full(rest)), *(mx.zeros_like(r) for r in rest))

    return fn(x, *(a for a in quantized if a is not None))


def sum_to_shape(a: mx.array, shape: tuple[int, ...]) -> mx.array:
    """Sum ``a`` over the axes that ``shape`` broadcast to (NumPy rules): the adjoint of
    ``mx.broadcast_to(., a.shape)``."""
    extra = a.ndim - len(shape)
    if extra:
        a = mx.sum(a, axis=tuple(range(extra)))
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, a.shape, strict=True)) if s == 1 and t != 1)
    return mx.sum(a, axis=axes, keepdims=True) if axes else a
