"""Which executor runs a kernel, and the one place where kernels are built and launched.

Backends:
  metal     ``mx.fast.metal_kernel`` on Apple GPUs (the product)
  cuda      the same MSL bodies on MLX's CUDA build, through ``mlx_metaltile.cuda``
  emulator  the same MSL bodies on the CPU, through ``mlx_metaltile.emulator`` (eager)
  reference pure-MLX composites of native ops (any device; the fallback of ``auto``)
  auto      metal if available, else cuda, else reference (the default)

``auto`` only chooses; it never catches a failing kernel to fall back on the reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx

from . import _templates
from ._msl.kernel import MetalKernel, binder
from ._msl.source import compact
from ._registry import _REGISTRY, KernelSpec
from ._templates import render

BACKENDS = ("auto", "metal", "cuda", "emulator", "reference")
KERNEL_BACKENDS = ("metal", "cuda", "emulator")
GPU_BACKENDS = ("metal", "cuda")

MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024
SIMD_WIDTH = 32
# Threadgroups along a grid's y or z axis, at most (CUDA's gridDim.y and .z; Metal allows
# more): ops that split work over z keep within it, and prepare refuses more on cuda.
MAX_GRID_Z = 65535

_default = "auto"
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mlx_metaltile_backend", default=None
)
_kernel_cache: dict[tuple[str, str], Callable] = {}
_launches: Counter = Counter()


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine."""


def _check_name(name: str) -> None:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"[mlx_metaltile] backend must be one of {BACKENDS}, got {name!r}")


@functools.cache
def _gpu_available() -> bool:
    return bool(mx.is_available(mx.gpu))


@functools.cache
def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - very old MLX without mx.metal
        return False


def _module(name: str):
    """The emulator / cuda layer module, or None while it is not built or cannot run here."""
    try:
        mod = importlib.import_module(f"mlx_metaltile.{name}")
    except ImportError:
        return None
    return mod


def unavailable_reason(name: str) -> str | None:
    """None if ``name`` can run here, else why not."""
    _check_name(name)
    if name in ("auto", "reference"):
        return None
    if name == "metal":
        return None if _metal_available() else "no Metal device (mx.metal.is_available() is False)"
    mod = _module(name)
    if mod is None or not hasattr(mod, "metal_kernel"):
        return f"the {name} backend is not part of this build of mlx_metaltile"
    return mod.unavailable_reason()


def available_backends() -> dict[str, str | None]:
    """Each backend -> None if it can run here, else the reason it cannot."""
    return {name: unavailable_reason(name) for name in BACKENDS}


def _require(name: str) -> None:
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"[mlx_metaltile] backend {name!r} is unavailable: {reason}")


def set_backend(name: str) -> None:
    """Select the backend for every later op call (process-wide default)."""
    global _default
    _check_name(name)
    _require(name)
    _default = name


def get_backend() -> str:
    """The selected backend name (possibly 'auto')."""
    return _override.get() or _default


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Run the enclosed op calls on ``name`` (context-local, nests)."""
    _check_name(name)
    _require(name)
    token = _override.set(name)
    try:
        yield name
    finally:
        _override.reset(token)


def resolve_backend(name: str | None = None) -> str:
    """The concrete backend an op call runs on now."""
    name = name or _override.get() or _default
    return _auto_choice() if name == "auto" else name


@functools.cache
def _auto_choice() -> str:
    """What ``auto`` means in this process (devices do not come and go while it runs)."""
    if _metal_available():
        return "metal"
    if unavailable_reason("cuda") is None:
        return "cuda"
    return "reference"


def _factory(backend: str) -> Callable:
    if backend == "metal":
        return mx.fast.metal_kernel
    mod = _module(backend)
    if mod is None:
        _require(backend)
    return mod.metal_kernel


def get_kernel(spec: KernelSpec, backend: str) -> Callable:
    """The kernel object of ``spec`` on ``backend``, built once and cached.

    Template arguments (dtypes, head_dim, bits, ...) are given per call and instantiated by
    the backend, so one object per (backend, variant) is all that is ever built.
    """
    key = (backend, spec.name)
    kernel = _kernel_cache.get(key)
    if kernel is None:
        if backend not in spec.backends:
            raise BackendUnavailableError(
                f"[{spec.op}] variant {spec.variant!r} does not run on the {backend} backend")
        header, body = kernel_text(spec, backend)
        extra = ({"launch_bounds": spec.cuda_launch_bounds}
                 if backend == "cuda" and spec.cuda_launch_bounds else {})
        kernel = _factory(backend)(
            name=f"mt_{spec.name}{_templates.override_tag(spec.template)}",
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=body,
            header=header,
            ensure_row_contiguous=True,
            atomic_outputs=spec.atomic_outputs,
            **extra,
        )
        _kernel_cache[key] = kernel
    return kernel


def kernel_text(spec: KernelSpec, backend: str) -> tuple[str, str]:
    """(header, body) of ``spec``'s kernel as ``backend`` builds it: on the GPU backends
    without the template's comments and indentation (``compact``: MLX hashes the whole
    source per launch), on the emulator as written (its messages quote the lines)."""
    tpl = render(spec.template)
    if backend in GPU_BACKENDS:
        return compact(tpl.header), compact(tpl.body)
    return tpl.header, tpl.body


@contextlib.contextmanager
def override_template(filename: str, *edits: tuple[str, str],
                      kept: dict | None = None) -> Iterator[None]:
    """Inside: every kernel of template ``filename`` (of each spec built from it: several
    may share one) is built from its text with each (old, new) edit applied (each ``old``
    must occur in it); the kernels of it built before are set aside, those built inside
    forgotten at the end, and the set-aside ones launched again. The seam of the negative
    controls and of A/B timings of a template's variants. (``_templates.override`` alone
    changes the text only: a kernel built before it would still be launched.) ``kept``: a
    dict the caller holds for these same edits; the kernels built inside are moved into it
    at the end and launched again the next time it is passed (an A/B timing's variant then
    launches the same kernel objects call after call, as the unedited side does)."""
    def built_from_file(key) -> bool:
        spec = _REGISTRY.get(key[1])
        return spec is not None and spec.template == filename

    with _templates.override(filename, *edits):
        saved = {key: _kernel_cache.pop(key) for key in list(_kernel_cache)
                 if built_from_file(key)}
        _kernel_cache.update(kept or {})
        try:
            yield
        finally:
            for key in [key for key in _kernel_cache if built_from_file(key)]:
                kernel = _kernel_cache.pop(key)
                if kept is not None:
                    kept[key] = kernel
            _kernel_cache.update(saved)


@contextlib.contextmanager
def template_override(spec: KernelSpec, *edits: tuple[str, str]) -> Iterator[KernelSpec]:
    """``override_template`` of ``spec``'s template: inside, ``spec``'s kernels (and those of
    any spec sharing its template) are built with the edits; outside, the real ones again.
    The op keeps launching ``spec`` itself (same name, same launch counters)."""
    with override_template(spec.template, *edits):
        yield spec


def built_kernels() -> tuple[tuple[str, str], ...]:
    """(backend, kernel name) of every kernel object built so far in this process."""
    return tuple(_kernel_cache)


def launch_count(name: str | None = None, backend: str | None = None) -> int:
    """How many times kernels were launched (optionally one kernel / one backend)."""
    return sum(n for (b, k), n in _launches.items()
               if (name is None or k == name) and (backend is None or b == backend))


@functools.lru_cache(maxsize=4096)
def _geometry_checked(op: str, grid: tuple[int, ...], threadgroup: tuple[int, ...],
                      threadgroup_memory: int) -> None:
    """check_geometry, remembered per geometry: a decode loop repeats a few shapes."""
    check_geometry(op, grid, threadgroup, threadgroup_memory)


def check_geometry(op: str, grid: Sequence[int], threadgroup: Sequence[int],
                   threadgroup_memory: int = 0) -> None:
    """Refuse a dispatch that would be illegal (or freeze a Mac) before it is made."""
    if len(grid) != 3 or len(threadgroup) != 3:
        raise ValueError(f"[{op}] internal: grid and threadgroup must have 3 entries")
    gx, gy, gz = grid
    tx, ty, tz = threadgroup
    if gx < 1 or gy < 1 or gz < 1 or tx < 1 or ty < 1 or tz < 1:
        raise ValueError(f"[{op}] internal: empty dispatch grid={tuple(grid)} "
                         f"threadgroup={tuple(threadgroup)}")
    threads = tx * ty * tz
    if threads > MAX_THREADS_PER_THREADGROUP or threads % SIMD_WIDTH:
        raise ValueError(f"[{op}] internal: threadgroup of {threads} threads; expected a "
                         f"multiple of {SIMD_WIDTH} and at most {MAX_THREADS_PER_THREADGROUP}")
    if gx >= 2**32 or gy >= 2**32 or gz >= 2**32:
        raise ValueError(f"[{op}] problem too large: grid {tuple(grid)} exceeds 2^32-1 threads "
                         "in one dimension")
    if threadgroup_memory > MAX_THREADGROUP_MEMORY:
        raise ValueError(f"[{op}] internal: {threadgroup_memory} bytes of threadgroup memory; "
                         f"at most {MAX_THREADGROUP_MEMORY}")


def check_cuda_grid(op: str, grid: Sequence[int], threadgroup: Sequence[int]) -> None:
    """Refuse a grid that CUDA cannot launch: more than MAX_GRID_Z threadgroups along y or z
    (CUDA's gridDim.y / .z; x may hold 2^31 - 1). Metal has no such limit, so an op's shape
    that fits Metal's grid may not fit here: the message says which axis and by how much."""
    for i, axis in ((1, "y"), (2, "z")):
        blocks = -(-int(grid[i]) // int(threadgroup[i]))
        if blocks > MAX_GRID_Z:
            raise ValueError(
                f"[{op}] problem too large for one launch on cuda: {blocks} threadgroups "
                f"along the grid's {axis} axis, at most {MAX_GRID_Z} (CUDA's gridDim.{axis}; "
                f"grid {tuple(grid)}, threadgroup {tuple(threadgroup)}); split the call "
                "into smaller ones (fewer rows, tokens or heads per call)")


_TRACING_MESSAGE = "during function transformations"  # MLX's eval refusal under compile/vmap


def _raise_if_traced(op: str, backend: str, err: Exception) -> None:
    """Turn MLX's refusal to evaluate inside ``mx.compile`` / ``mx.vmap`` into an ``[op]``
    error: the emulator runs each kernel eagerly on the CPU, so its inputs must be concrete
    arrays. (``mx.grad`` / ``mx.vjp`` / ``mx.value_and_grad`` evaluate eagerly and work.)"""
    if backend == "emulator" and _TRACING_MESSAGE in str(err):
        raise ValueError(
            f"[{op}] the emulator backend runs kernels eagerly on the CPU and cannot be "
            "traced by mx.compile or mx.vmap; call the op outside the transform, or run the "
            "transformed function under use_backend('reference') (or on metal / cuda)"
        ) from None


def launch(spec: KernelSpec, backend: str, *, inputs: Mapping[str, mx.array],
           template: Mapping[str, Any], outputs: Mapping[str, tuple[Sequence[int], mx.Dtype]],
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
           threadgroup_memory: int = 0, init_value: float | None = None) -> list[mx.array]:
    """Check the arguments against ``spec`` and the geometry, then dispatch the cached
    kernel once. ``inputs``, ``template`` and ``outputs`` (name -> (shape, dtype)) are keyed
    by the spec's names, in its order (the order the kernel takes them)."""
    return prepare(spec, backend, inputs=dict.fromkeys(inputs), template=template,
                   outputs=outputs, grid=grid, threadgroup=threadgroup,
                   threadgroup_memory=threadgroup_memory,
                   init_value=init_value)(*inputs.values())


def prepare(spec: KernelSpec, backend: str, *, inputs: Mapping[str, mx.array | None],
            template: Mapping[str, Any], outputs: Mapping[str, tuple[Sequence[int], mx.Dtype]],
            grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
            threadgroup_memory: int = 0, init_value: float | None = None) -> Prepared:
    """``launch``'s checks, made once: the returned ``Prepared`` dispatches with only the
    arrays that change between calls. ``inputs`` maps each of the spec's inputs to a
    constant array (a runtime scalar, say) or to None, an input given per call; the rest
    as ``launch``'s."""
    if tuple(inputs) != spec.input_names or tuple(template) != spec.params \
            or tuple(outputs) != spec.output_names:
        raise ValueError(
            f"[{spec.op}] internal: kernel {spec.name} takes inputs {spec.input_names}, "
            f"template parameters {spec.params} and outputs {spec.output_names}; got "
            f"{tuple(inputs)}, {tuple(template)} and {tuple(outputs)}")
    grid, threadgroup = tuple(grid), tuple(threadgroup)
    _geometry_checked(spec.op, grid, threadgroup, threadgroup_memory)
    if backend == "cuda":
        check_cuda_grid(spec.op, grid, threadgroup)
    return Prepared(spec, backend, dict(inputs), dict(template), grid, threadgroup,
                    [tuple(map(int, o[0])) for o in outputs.values()],
                    [o[1] for o in outputs.values()], init_value)


_GPU = mx.Device(mx.gpu)


class Prepared:
    """One kernel launch with its checks made: called with the arrays of the inputs that
    ``prepare`` left None, in order, it dispatches the cached kernel once. What may change
    between calls is read per call: the stream's device, the kernel object (a template
    override swaps it), the launch counters. What is fixed is worked out once per kernel
    object: an executor's ``prepare_launch`` (the cuda one packs the constant scalars)."""

    __slots__ = ("spec", "backend", "template", "_inputs", "_bind", "_key", "_gpu",
                 "_template", "_grid", "_threadgroup", "_shapes", "_dtypes", "_init_value",
                 "_kernel", "_run")

    def __init__(self, spec: KernelSpec, backend: str, inputs: dict[str, mx.array | None],
                 template: dict[str, Any], grid: tuple[int, int, int],
                 threadgroup: tuple[int, int, int], shapes: list[tuple[int, ...]],
                 dtypes: list[mx.Dtype], init_value: float | None):
        self.spec, self.backend, self.template = spec, backend, template
        self._inputs = list(inputs.values())
        self._bind = binder(self._inputs)
        self._key = (backend, spec.name)
        self._gpu = backend in GPU_BACKENDS
        self._template = list(template.items())
        self._grid, self._threadgroup = grid, threadgroup
        self._shapes, self._dtypes, self._init_value = shapes, dtypes, init_value
        self._kernel = self._run = None  # the kernel object last launched, and its launch

    def bind(self, arrays: Sequence[mx.array]) -> list[mx.array]:
        """Every input of the kernel, in its order: the constants and ``arrays``."""
        return self._bind(arrays)

    def _launcher(self, kernel: Callable) -> Callable[[Sequence[mx.array]], list[mx.array]]:
        """``run(arrays)`` of ``kernel``: an executor's prepared launch (emulator, cuda:
        checked above, run directly), else the MLX kernel object's call (metal)."""
        if isinstance(kernel, MetalKernel):
            return kernel.prepare_launch(self._inputs, self._shapes, self._dtypes, self._grid,
                                         self._threadgroup, self._template, self._init_value)
        bind, template, grid, threadgroup = self._bind, self._template, self._grid, \
            self._threadgroup
        shapes, dtypes, init_value = self._shapes, self._dtypes, self._init_value

        def run(arrays: Sequence[mx.array]) -> list[mx.array]:
            return kernel(inputs=bind(arrays), template=template, grid=grid,
                          threadgroup=threadgroup, output_shapes=shapes, output_dtypes=dtypes,
                          init_value=init_value)

        return run

    def __call__(self, *arrays: mx.array) -> list[mx.array]:
        if self._gpu and mx.default_device() != _GPU and _gpu_available():
            # MLX's own refusal ("[custom_kernel] Only supports the GPU") names neither the
            # op nor the way out (without a GPU only stand-in kernels get here: tests of the
            # path)
            raise ValueError(f"[{self.spec.op}] the {self.backend} backend runs kernels on "
                             f"the GPU, got a stream on {mx.default_device()}; pass a GPU "
                             "stream or device, or use the reference backend for the CPU")
        kernel = _kernel_cache.get(self._key)
        if kernel is None or kernel is not self._kernel:
            kernel = get_kernel(self.spec, self.backend)
            self._run, self._kernel = self._launcher(kernel), kernel
        _launches[self._key] += 1
        try:
            return self._run(arrays)
        except (ValueError, RuntimeError) as err:
            _raise_if_traced(self.spec.op, self.backend, err)
            raise
