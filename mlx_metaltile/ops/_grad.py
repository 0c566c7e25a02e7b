"""Autodiff of the quantized ops: ``mx.custom_function`` wrappers differentiable w.r.t. x.

The quantized weights, scales and biases are constants of these ops: asking for their
gradient raises an ``[op]`` error (MLX raises for the quantized weights of its quantized
matmuls; it differentiates affine scales and biases, these ops do not).

Under ``mx.vmap`` MLX maps every primitive of a custom function's forward graph before it
reaches the function's own vmap rule, so a rule there cannot route around a primitive that
has no vmap (a custom kernel, ``gather_qmm``). The constants' wrapper is the first node of
an op's graph instead: it refuses a mapped constant, and where the reference composite
cannot be mapped it also takes the op's other inputs (through ``stop_gradient``: no gradient
flows into it), so that its vmap rule runs before any of the op's primitives and refuses
with an ``[op]`` error. (On a kernel backend MLX's own error for the custom kernel stands:
watching the inputs there costs about 6 us a call.)

MLX cannot trace a custom function under ``mx.compile(shapeless=True)``: inside such a trace
(``shapeless_tracing``) the reference backend's ops are their plain composites instead.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence

import mlx.core as mx


def shapeless_tracing() -> bool:
    """Whether an ``mx.compile(..., shapeless=True)`` trace is running. MLX 0.32 offers no
    query; inside such a trace it builds the divisor of ``mx.mean`` as a NumberOfElements
    node instead of a constant (tests/ops/test_transforms.py checks this stays true)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, mx.mean(_PROBE))
    return "NumberOfElements" in dot.getvalue()


_PROBE = mx.zeros((1,))


@functools.cache
def _frozen_fn(op: str, names: tuple[str, ...], present: tuple[bool, ...],
               unmapped: str | None) -> Callable:
    """A node over the arrays ``names`` that are ``present`` (more inputs after them only
    make it a node of the vmap) whose one output is the first of them unchanged, with a VJP
    that raises: MLX calls it when a gradient w.r.t. any of its inputs is asked for (the
    op takes that output in place of the first array and the others directly: each of them
    reaches the op's output through this node too). One output, not one per array: MLX's
    custom function costs about 2 us per output. Under ``mx.vmap`` it refuses a mapped one
    of them, then ``unmapped`` (why the op cannot be mapped on this backend) if given. One
    per (op, names, None pattern, reason): cheap per call."""
    if len(names) != len(present):  # unnamed by the caller: by position
        names = tuple(f"quantized input {i}" for i in range(len(present)))
    names = tuple(n for n, p in zip(names, present, strict=True) if p)

    @mx.custom_function
    def frozen(*a):
        return (a[0],)

    @frozen.vjp
    def frozen_vjp(primals, cotangents, outputs):
        raise ValueError(f"[{op}] no gradient with respect to the quantized weights, scales "
                         "or biases (constants of the op); differentiate with respect to x, "
                         "or dequantize them and use a float matmul to train them")

    @frozen.vmap
    def frozen_vmap(inputs, axes):
        for name, axis in zip(names, axes, strict=False):  # then the watched inputs
            if axis is not None:
                raise ValueError(f"[{op}] mx.vmap over {name} is not supported (axis {axis}): "
                                 "the quantized weights, scales and biases must be shared by "
                                 "every mapped call; map over the other inputs, or call the "
                                 "op once per weight set")
        if unmapped is not None:
            raise ValueError(f"[{op}] mx.vmap is not supported here: {unmapped}")
        return (inputs[0],), (None,)

    return frozen


_NAMES = ("w", "scales", "biases")


def _frozen(op: str, arrays: Sequence[mx.array | None], names: tuple[str, ...] = _NAMES,
            watched: Sequence[mx.array | None] = (),
            unmapped: str | None = None) -> list[mx.array | None]:
    """The arrays unchanged, the first one through ``_frozen_fn``'s node (which takes them
    all: pass the result on, not the arrays); ``names`` name them in its messages;
    ``unmapped`` as ``_frozen_fn``'s. ``watched``: the op's other inputs, taken only with
    ``unmapped`` (then a mapped input makes the node refuse first). Without it the node
    joins a vmap only for a mapped constant: MLX would still map the primitives after an
    unmapped output of a vmap rule, and MLX 0.32's expand_dims and squeeze refuse that."""
    given = [a for a in arrays if a is not None]
    fn = _frozen_fn(op, names, tuple(a is not None for a in arrays), unmapped)
    first = given[0]
    if unmapped is not None:
        given += [mx.stop_gradient(a) for a in watched if a is not None]
    (frozen,) = fn(*given)
    return [frozen if a is first else a for a in arrays]


GATHER_QMM_REASON = ("its reference composite is mx.gather_qmm, which MLX (0.32) cannot "
                     "map (GatherQMM::vmap NYI); pass the mapped axis as a leading "
                     "dimension of x and indices")


def refuse_shapeless(op: str) -> None:
    """The expert ops' composite cannot follow a shapeless trace: raise saying so."""
    raise ValueError(
        f"[{op}] mx.compile(shapeless=True) is not supported on the reference backend: its "
        "composite is mx.gather_qmm, whose default lhs_indices MLX (0.32) fixes at the trace "
        "(another batch raises [broadcast_shapes], a batch of 1 would broadcast to the traced "
        "one); compile without shapeless=True (one trace per shape)")


def with_x_vjp(op: str, forward: Callable, x_vjp: Callable, x: mx.array,
               quantized: Sequence[mx.array | None], *, names: tuple[str, ...] = _NAMES,
               watched: Sequence[mx.array | None] = (), unmapped: str | None = None,
               plain: bool = False) -> mx.array:
    """``forward(x, *quantized, *watched)`` with the VJP
    ``x_vjp(cotangent, *quantized, *watched)`` -> dx; None entries of ``quantized`` (fp
    modes' biases) are passed through as None. ``watched``: the op's other arrays (ids),
    inputs of the custom function (MLX's default vmap of it re-traces ``forward`` with
    them), not differentiated. ``names`` and ``unmapped``: as ``_frozen``'s. ``plain``:
    ``forward`` alone, no custom function (a shapeless trace of the reference backend:
    MLX's autodiff of the composite)."""
    if plain:
        return forward(x, *quantized, *watched)
    call = x_vjp_function(op, forward, x_vjp, tuple(a is not None for a in quantized),
                          names=names, unmapped=unmapped)
    return call(x, quantized, watched)


def x_vjp_function(op: str, forward: Callable, x_vjp: Callable, present: tuple[bool, ...], *,
                   names: tuple[str, ...] = _NAMES, unmapped: str | None = None) -> Callable:
    """``with_x_vjp``'s custom function built once (an op's plan holds it; ``forward`` and
    ``x_vjp`` must take every array they read as an argument): returns
    ``call(x, quantized, watched)``, which is ``with_x_vjp(op, forward, x_vjp, x, quantized,
    watched=watched, names=names, unmapped=unmapped)`` for the quantized arrays whose None
    pattern is ``present``."""
    frozen = _frozen_fn(op, names, present, unmapped)
    all_present = all(present)

    def full(rest):
        if all_present:
            return rest
        it = iter(rest)
        return [next(it) if s else None for s in present] + list(it)

    @mx.custom_function
    def fn(x, *rest):
        return forward(x, *full(rest))

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        x, *rest = primals
        return (x_vjp(cotangent, *full(rest)), *(mx.zeros_like(r) for r in rest))

    def call(x, quantized, watched=()):
        given = [a for a in quantized if a is not None]
        rest = given[1:]
        if unmapped is not None:
            given += [mx.stop_gradient(a) for a in (x, *watched) if a is not None]
        return fn(x, *frozen(*given), *rest, *watched)

    def call_all(x, quantized, watched=()):  # every constant given, none watched
        (first,) = frozen(*quantized)
        return fn(x, first, *quantized[1:], *watched)

    return call_all if all_present and unmapped is None else call


def sum_to_shape(a: mx.array, shape: tuple[int, ...]) -> mx.array:
    """Sum ``a`` over the axes that ``shape`` broadcast to (NumPy rules): the adjoint of
    ``mx.broadcast_to(., a.shape)``."""
    extra = a.ndim - len(shape)
    if extra:
        a = mx.sum(a, axis=tuple(range(extra)))
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, a.shape, strict=True)) if s == 1 and t != 1)
    return mx.sum(a, axis=axes, keepdims=True) if axes else a
