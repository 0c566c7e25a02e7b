"""The object ``mx.fast.metal_kernel`` returns, as a base class for the executors.

Its argument checks and their messages are MLX's (``[metal_kernel] Must specify at least one
output.``, ``[metal_kernel] Expected `inputs` to have size 2 but got size 1.``), so a misuse
reads the same on every executor. A subclass runs a checked ``Launch`` in ``_run``, and may
make a prepared launch's per-call path cheaper by overriding ``prepare_launch``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import mlx.core as mx

from .capabilities import check_supported
from .signature import template_arg

MAX_THREADS_PER_THREADGROUP = 1024


class Launch(NamedTuple):
    """One call's arguments, checked (a named tuple: made on every launch, 4x cheaper than
    a frozen dataclass)."""

    inputs: list[mx.array]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]]
    init_value: float | None
    verbose: bool
    stream: object


def _as_array(value) -> mx.array:
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (bool, int, float)):
        return mx.array(value)
    raise TypeError(f"[metal_kernel] inputs must be mx.array or Python scalars, "
                    f"got {type(value).__name__}")


def _check_dims(what: str, dims) -> tuple[int, int, int]:
    try:
        values = tuple(int(d) for d in dims)
    except TypeError:
        raise TypeError(f"[metal_kernel] {what} must be a tuple of 3 ints") from None
    if len(values) != 3:
        raise ValueError(f"[metal_kernel] {what} must have 3 entries, got {len(values)}")
    if any(not -(2**31) <= v < 2**31 for v in values):
        # MLX takes them as C ints (its binding refuses larger values); never truncate
        raise TypeError(f"[metal_kernel] {what} entries must fit in a 32-bit int, got {values}")
    return values


def binder(values: Sequence) -> Callable[[Sequence], list]:
    """``bind(given)``: ``values`` with its None entries replaced by ``given``, in order."""
    values = list(values)
    places = [i for i, v in enumerate(values) if v is None]
    if places == list(range(len(places))):  # the usual layout: the per-call entries first
        n, tail = len(places), values[len(places):]

        def bind(given: Sequence) -> list:
            if len(given) != n:
                raise ValueError(f"internal: {n} values to bind, got {len(given)}")
            return [*given, *tail]
    else:
        def bind(given: Sequence) -> list:
            bound = values.copy()
            for i, v in zip(places, given, strict=True):
                bound[i] = v
            return bound
    return bind


class MetalKernel:
    """Callable like the object ``mx.fast.metal_kernel`` returns; ``_run`` executes it."""

    executor = "metal"  # the executor's name, in refusals of MSL features it lacks

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        check_supported(self.executor, name, source, header)
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)
        self.compile_options = compile_options

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None) -> list[mx.array]:
        """Run the kernel (keyword arguments only, as MLX's); returns the outputs."""
        for what, got, want in (("inputs", len(inputs), len(self.input_names)),
                                ("output_shapes", len(output_shapes), len(self.output_names)),
                                ("output_dtypes", len(output_dtypes), len(self.output_names))):
            if got != want:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got "
                                 f"size {got}.")
        grid = _check_dims("grid", grid)
        threadgroup = _check_dims("threadgroup", threadgroup)
        if any(g < 0 for g in grid):
            raise ValueError(f"[metal_kernel] grid must not be negative, got {grid}")
        if any(t < 1 for t in threadgroup):
            raise ValueError(f"[metal_kernel] threadgroup entries must be >= 1, "
                             f"got {threadgroup}")
        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(f"[metal_kernel] Thread group size ({tg_size}) is greater than "
                             f"the maximum allowed threads per threadgroup "
                             f"({MAX_THREADS_PER_THREADGROUP}).")
        template = list(template or [])
        for _, value in template:
            template_arg(value)  # MLX's message for a value of the wrong kind
        for dt in output_dtypes:
            if not isinstance(dt, mx.Dtype):
                raise TypeError(f"[metal_kernel] output_dtypes must be mx.Dtype, got "
                                f"{type(dt).__name__}")
        return self._run(Launch(
            inputs=[_as_array(x) for x in inputs],
            output_shapes=[tuple(int(d) for d in s) for s in output_shapes],
            output_dtypes=list(output_dtypes), grid=grid, threadgroup=threadgroup,
            template=template, init_value=init_value, verbose=bool(verbose), stream=stream))

    def prepare_launch(self, inputs: Sequence[mx.array | None],
                       output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
                       grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                       template: list[tuple[str, object]], init_value: float | None = None,
                       ) -> Callable[[Sequence[mx.array]], list[mx.array]]:
        """``run(arrays)``: runs arguments that ``backends.prepare`` has already checked
        against the kernel's spec and the geometry rules, ``inputs`` with its None entries
        given per call as ``arrays`` (the per-call path of every op). The same ``_run``
        without repeating ``__call__``'s argument checks, which cost more than the launch
        itself on a fast GPU; an executor may precompute more of it."""
        bind = binder(inputs)

        def run(arrays: Sequence[mx.array]) -> list[mx.array]:
            return self._run(Launch(bind(arrays), output_shapes, output_dtypes, grid,
                                    threadgroup, template, init_value, False, None))

        return run

    def _run(self, launch: Launch) -> list[mx.array]:
        raise NotImplementedError
