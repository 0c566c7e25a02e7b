"""The CUDA backend: MSL kernel bodies on MLX's CUDA build through ``mx.fast.cuda_kernel``.

``metal_kernel(...)`` takes exactly what ``mx.fast.metal_kernel`` takes and returns a callable
with its call signature and MLX's argument checks (``mlx_metaltile._msl``, the MSL core it
shares with the emulator). The MSL source is translated once (``_translate.py``: the shared
source rewrites, MSL built-ins from CUDA indices, Metal-style scalar and atomic arguments)
and compiled by MLX's CUDA JIT against ``msl_compat.cuh`` (its parts in include/mt_cuda/), the
kernel's translated helpers coming from a cached file (``_helpers.py``), both by path.
Swizzles and packed vectors are refused when the kernel is made (``_msl/capabilities.py``).

Where it differs from Metal (by construction, documented in msl_compat.cuh and the README):
  * a grid that is not a whole number of threadgroups launches whole CUDA blocks; the extra
    threads return before the body, so a barrier after that point relies on exited threads
    not being waited for (true of NVIDIA GPUs since Volta, and checked on the GPU by
    tests/test_cuda_gpu.py), and in such an edge block of a 2-D/3-D threadgroup the linear
    indices (thread_index_in_threadgroup, SIMD lanes) follow the requested size;
  * simdgroup_matrix products of half or bfloat matrices run on tensor cores (mma.sync,
    sm_80+), float ones on warp shuffles and float FMAs (not TF32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import mlx.core as mx

from .._msl.constants import PACKABLE, known_bits, packed_form
from .._msl.kernel import Launch, MetalKernel, binder
from ._helpers import helpers_header
from ._helpers import restore as restore_helpers
from ._translate import (
    GRID_INPUT,
    PACKED_INPUT,
    Body,
    compat_header,
    compat_include,
    cuda_type,
    grid_is_whole,
    kernel_definition,
    launch_bounds_directive,
    mlx_kernel_name,
    prepass_body,
    translate_body,
    translate_header,
    translate_helpers,
    translation_unit,
    used_builtins,
)

__all__ = [
    "CudaKernel",
    "GRID_INPUT",
    "PACKED_INPUT",
    "Body",
    "compat_header",
    "cuda_type",
    "grid_is_whole",
    "kernel_definition",
    "metal_kernel",
    "mlx_kernel_name",
    "prepass_body",
    "translate_body",
    "translate_header",
    "translation_unit",
    "unavailable_reason",
    "used_builtins",
]


def unavailable_reason() -> str | None:
    """None if MLX's CUDA backend can run here, else why not."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not hasattr(mx.fast, "cuda_kernel"):
        return "this MLX build has no CUDA support (mx.cuda / mx.fast.cuda_kernel missing)"
    try:
        available = bool(cuda.is_available())
    except Exception as exc:  # noqa: BLE001 - any failure means no usable device
        return f"mx.cuda.is_available() failed: {exc}"
    if not available:
        return "no CUDA device (mx.cuda.is_available() is False)"
    return None


@lru_cache(maxsize=1024)
def _grid_array(grid: tuple[int, int, int]) -> mx.array:
    """Metal's grid as a uint32[3] kernel input (cached: no allocation per call in a loop)."""
    return mx.array(grid, dtype=mx.uint32)


_PACKED_SLOTS = 4  # the packed scalars' array holds at least 16 bytes (_msl/constants.py)


@lru_cache(maxsize=4096)
def _packed_array(bits: tuple[int, ...]) -> mx.array:
    """The packed scalars of a launch as a uint32 input (cached: made once per value set)."""
    return mx.array(list(bits) + [0] * (_PACKED_SLOTS - len(bits)), dtype=mx.uint32)


class CudaKernel(MetalKernel):
    """An MSL kernel on MLX's CUDA backend, called like ``mx.fast.metal_kernel``'s result.

    The argument checks are the base class's (MLX's). One ``mx.fast.cuda_kernel`` object is
    made per call signature (which inputs are arrays, 0-d arrays or packed scalars, whether
    the grid overhangs the blocks); MLX then JIT-compiles per template instantiation and
    caches the module. A 0-d uint32/int32/float32 input made by ``_msl.constants.scalar``
    (its value known to the host) comes packed with the launch's others in one uint32 array
    of at least 16 bytes (``PACKED_INPUT``); any other 0-d input as the 0-d array it is.
    """

    executor = "cuda"

    def __init__(self, *args, launch_bounds: tuple[int, int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.helpers = helpers_header(translate_helpers(self.header))
        self.cuda_header = compat_include() + self.helpers
        self.max_threads = 1024
        if launch_bounds:  # KernelSpec.cuda_launch_bounds
            self.cuda_header += launch_bounds_directive(*launch_bounds)
            self.max_threads = launch_bounds[0]
        self.body = prepass_body(self.source)
        self._variants: dict[tuple, tuple[Body, object]] = {}

    def translate(self, scalar_inputs: Sequence[bool], guarded: bool = False,
                  packed_types: Sequence[str | None] | None = None) -> Body:
        return translate_body(self.body, self.input_names, self.output_names,
                              scalar_inputs=scalar_inputs, guarded=guarded,
                              atomic_outputs=self.atomic_outputs, packed_types=packed_types)

    def _variant(self, kinds: tuple[str, ...], guarded: bool):
        """``kinds[i]``: "a" (an array), "s" (a 0-d array) or the MSL type of a packed
        scalar ("uint", "int", "float")."""
        key = (kinds, guarded)
        entry = self._variants.get(key)
        if entry is None:
            restore_helpers(self.helpers)
            body = self.translate([k != "a" for k in kinds], guarded,
                                  [None if k in ("a", "s") else k for k in kinds])
            suffix = "".join(k[0] if k in ("a", "s") else "p" + k[0] for k in kinds) + (
                "_g" if guarded else "")
            kernel = mx.fast.cuda_kernel(
                name=f"{self.name}_{suffix}" if suffix else self.name,
                input_names=list(body.input_names),
                output_names=list(body.output_names),
                source=body.source,
                header=self.cuda_header,
                ensure_row_contiguous=self.ensure_row_contiguous,
            )
            entry = self._variants[key] = (body, kernel)
        return entry

    def _check_threads(self, threadgroup: tuple[int, int, int]) -> None:
        threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if threads > self.max_threads:
            raise ValueError(f"[cuda] kernel {self.name}: a threadgroup of {threads} threads, "
                             f"above its launch bounds' {self.max_threads}")

    def _run(self, launch: Launch) -> list[mx.array]:
        self._check_threads(launch.threadgroup)
        inputs, kinds, bits = [], [], []
        for x in launch.inputs:
            kind = _kind(x)
            kinds.append(kind)
            if kind in _PASSED:
                inputs.append(x)
            else:
                bits.append(known_bits(x))
        guarded = not grid_is_whole(launch.grid, launch.threadgroup)
        _, kernel = self._variant(tuple(kinds), guarded)
        if bits:
            inputs.append(_packed_array(tuple(bits)))
        if guarded:
            inputs.append(_grid_array(launch.grid))
        return kernel(inputs=inputs, output_shapes=launch.output_shapes,
                      output_dtypes=launch.output_dtypes, grid=launch.grid,
                      threadgroup=launch.threadgroup, template=launch.template or None,
                      init_value=launch.init_value, verbose=launch.verbose,
                      stream=launch.stream)

    def prepare_launch(self, inputs: Sequence[mx.array | None],
                       output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
                       grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                       template: list[tuple[str, object]], init_value: float | None = None,
                       ) -> Callable[[Sequence[mx.array]], list[mx.array]]:
        """``_run``'s launch with the constant inputs' kinds and packed bits, the grid's
        guard and the call's options worked out once: per call only the arrays given
        (``inputs``' None entries) are examined."""
        self._check_threads(threadgroup)
        restore_helpers(self.helpers)
        return _PreparedLaunch(self, inputs, dict(
            output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
            threadgroup=threadgroup, template=template or None, init_value=init_value,
            verbose=False, stream=None))


_PASSED = ("a", "s")  # the kinds of input passed as themselves (the others come packed)


def _kind(x: mx.array) -> str:
    """How ``x`` reaches the kernel (``CudaKernel._variant``'s kinds): "a" an array, "s" a
    0-d array, else packed: the MSL type of a scalar whose bits the host knows."""
    if x.ndim:
        return "a"
    return "s" if known_bits(x) is None else PACKABLE[x.dtype]


# Layouts a prepared launch keeps (the latest): each host-known scalar value given per call
# has its own (a decode step's layers share their kv_len, a new one each token).
_LAYOUTS = 64


class _PreparedLaunch:
    """``CudaKernel.prepare_launch``'s ``run(arrays)``. The kernel object, the inputs passed
    and the packed scalars depend on the forms of the arrays given: "a" an array, "s" a 0-d
    array passed as itself, or a host-known scalar's (MSL type, bits), packed
    (``_msl.constants.packed_form``). Each forms' layout, its packed array made, is made
    once: per call the forms are read and the inputs bound."""

    __slots__ = ("_kernel", "_inputs", "_kinds", "_options", "_guarded", "_layouts")

    def __init__(self, kernel: CudaKernel, inputs: Sequence[mx.array | None], options: dict):
        self._kernel, self._inputs, self._options = kernel, list(inputs), options
        self._kinds = [None if x is None else _kind(x) for x in inputs]  # None: per call
        self._guarded = not grid_is_whole(options["grid"], options["threadgroup"])
        self._layouts: dict[tuple, tuple[Callable, Callable]] = {}

    def __call__(self, arrays: Sequence[mx.array]) -> list[mx.array]:
        forms = tuple(["a" if x.ndim else packed_form(x) or "s" for x in arrays])
        layout = self._layouts.get(forms)
        if layout is None:
            layout = self._layout(forms)
        kernel, bind = layout
        return kernel(inputs=bind(arrays), **self._options)

    def _layout(self, forms: tuple) -> tuple[Callable, Callable]:
        """(the MLX kernel object, ``bind(arrays)``: its inputs) for arrays of ``forms``:
        ``_run``'s inputs, the packed array made now; remembered."""
        given = [f if f in _PASSED else f[0] for f in forms]
        kinds = binder(self._kinds)(given)
        _, kernel = self._kernel._variant(tuple(kinds), self._guarded)
        given_bits = iter([f[1] for f in forms if f not in _PASSED])
        bits = [next(given_bits) if x is None else known_bits(x)
                for x, k in zip(self._inputs, kinds, strict=True) if k not in _PASSED]
        # the inputs passed (None: one given per call), the packed scalars, the grid
        inputs = [x for x, k in zip(self._inputs, kinds, strict=True) if k in _PASSED]
        inputs += [_packed_array(tuple(bits))] if bits else []
        inputs += [_grid_array(self._options["grid"])] if self._guarded else []
        passed_given = [j for j, f in enumerate(forms) if f in _PASSED]
        places = [i for i, x in enumerate(inputs) if x is None]
        n = len(places)
        if passed_given == places == list(range(n)):  # the usual case: those given first
            tail = inputs[n:]

            def bind(arrays: Sequence[mx.array]) -> list[mx.array]:
                return [*arrays[:n], *tail]
        else:
            bind_inputs = binder(inputs)

            def bind(arrays: Sequence[mx.array]) -> list[mx.array]:
                return bind_inputs([arrays[j] for j in passed_given])

        if len(self._layouts) >= _LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)), None)
        layout = self._layouts[forms] = (kernel, bind)
        return layout


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None,
                 launch_bounds: tuple[int, int] | None = None) -> CudaKernel:
    """``mx.fast.metal_kernel``'s contract, executed by ``mx.fast.cuda_kernel``;
    ``launch_bounds``: ``KernelSpec.cuda_launch_bounds``."""
    return CudaKernel(name, input_names, output_names, source, header,
                      ensure_row_contiguous, atomic_outputs, compile_options,
                      launch_bounds=launch_bounds)
