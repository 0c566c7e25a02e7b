"""The CUDA backend: MSL kernel bodies on MLX's CUDA build through ``mx.fast.cuda_kernel``.

``metal_kernel(...)`` takes exactly what ``mx.fast.metal_kernel`` takes and returns a callable
with its call signature and MLX's argument checks (``mlx_metaltile._msl``, the MSL core it
shares with the emulator). The MSL source is translated once (``_translate.py``: the shared
source rewrites, MSL built-ins from CUDA indices, Metal-style scalar and atomic arguments)
and compiled by MLX's CUDA JIT against ``msl_compat.cuh`` (its parts in include/mt_cuda/).
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

from collections.abc import Sequence
from functools import lru_cache

import mlx.core as mx

from .._msl.kernel import Launch, MetalKernel
from ._translate import (
    GRID_INPUT,
    Body,
    compat_header,
    cuda_type,
    grid_is_whole,
    kernel_definition,
    mlx_kernel_name,
    prepass_body,
    translate_body,
    translate_header,
    translation_unit,
    used_builtins,
)

__all__ = [
    "CudaKernel",
    "GRID_INPUT",
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


class CudaKernel(MetalKernel):
    """An MSL kernel on MLX's CUDA backend, called like ``mx.fast.metal_kernel``'s result.

    The argument checks are the base class's (MLX's). One ``mx.fast.cuda_kernel`` object is
    made per call signature (which inputs are 0-d, whether the grid overhangs the blocks);
    MLX then JIT-compiles per template instantiation and caches the module.
    """

    executor = "cuda"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuda_header = translate_header(self.header)
        self.body = prepass_body(self.source)
        self._variants: dict[tuple, tuple[Body, object]] = {}

    def translate(self, scalar_inputs: Sequence[bool], guarded: bool = False) -> Body:
        return translate_body(self.body, self.input_names, self.output_names,
                              scalar_inputs=scalar_inputs, guarded=guarded,
                              atomic_outputs=self.atomic_outputs)

    def _variant(self, scalar_inputs: tuple[bool, ...], guarded: bool):
        key = (scalar_inputs, guarded)
        entry = self._variants.get(key)
        if entry is None:
            body = self.translate(scalar_inputs, guarded)
            suffix = "".join("s" if s else "a" for s in scalar_inputs) + ("_g" if guarded else "")
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

    def _run(self, launch: Launch) -> list[mx.array]:
        inputs = list(launch.inputs)
        guarded = not grid_is_whole(launch.grid, launch.threadgroup)
        _, kernel = self._variant(tuple(x.ndim == 0 for x in inputs), guarded)
        if guarded:
            inputs.append(_grid_array(launch.grid))
        return kernel(inputs=inputs, output_shapes=launch.output_shapes,
                      output_dtypes=launch.output_dtypes, grid=launch.grid,
                      threadgroup=launch.threadgroup, template=launch.template or None,
                      init_value=launch.init_value, verbose=launch.verbose,
                      stream=launch.stream)


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None) -> CudaKernel:
    """``mx.fast.metal_kernel``'s contract, executed by ``mx.fast.cuda_kernel``."""
    return CudaKernel(name, input_names, output_names, source, header,
                      ensure_row_contiguous, atomic_outputs, compile_options)
