"""MSL kernel source -> the header and body that ``mx.fast.cuda_kernel`` compiles.

MLX's CUDA JIT (``mlx/backend/cuda/custom_kernel.cpp``) builds one translation unit per
kernel: its device utils, our ``header``, then ``namespace mlx::core::cu { __global__ void
custom_kernel_<name>(<params>) { <template lines> <body> } }`` where

  * each input is ``const <ctype>* name`` (0-d arrays too), followed by
    ``const __grid_constant__ Shape name_shape`` / ``Strides name_strides`` / ``int name_ndim``
    when the body mentions them (and the input is not 0-d); each output is ``<ctype>* name``;
  * template arguments become ``constexpr int N = ..;``, ``constexpr bool B = ..;`` and
    ``using T = <ctype>;`` lines at the top of the body;
  * no attribute parameters exist, and the launch is ``ceil(grid / threadgroup)`` blocks of
    ``min(threadgroup, grid)`` threads (so threads past the grid exist when the grid is not a
    multiple of the threadgroup).

The MSL body expects Metal's signature instead: 0-d inputs as references, ``device atomic<T>*``
outputs with ``atomic_outputs``, and the built-ins (``thread_position_in_grid`` ...) as
parameters. The body prelude written here supplies those from CUDA's indices; the header
(``msl_compat.cuh``) supplies the MSL library.

Everything here is pure text processing: the same functions feed the runtime path and the
nvcc compile check, which needs no GPU.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from .._msl.builtins import BUILTINS, SIMD_WIDTH
from .._msl.dtypes import cuda_type, type_string
from .._msl.source import rewrite_literals, rewrite_threadgroup_declarations

# The text MLX's cuda_kernel puts in front of every kernel's header.
MLX_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'

GRID_INPUT = "mt_grid"  # uint32[3]: Metal's grid (threads), passed only when blocks overhang it
# uint32[>= 4]: the bits of the scalar inputs the host knows, in input order (see
# _msl/constants.py for why they do not come as 0-d arrays)
PACKED_INPUT = "mt_scalars"


_PART_INCLUDE = re.compile(r'^#include "(include/mt_cuda/\w+\.cuh)"$', re.M)


def _read(relative: str) -> str:
    return resources.files(__package__).joinpath(relative).read_text(encoding="utf-8")


@cache
def compat_header() -> str:
    """The text of msl_compat.cuh with its parts (include/mt_cuda/*.cuh) inlined."""
    return _PART_INCLUDE.sub(lambda m: _read(m.group(1)), _read("msl_compat.cuh"))


@cache
def compat_include() -> str:
    """How a kernel's header pulls in msl_compat.cuh.

    MLX hashes the whole kernel source on every launch (its JIT module key), so ~45 KB of
    header text inlined in each kernel cost several microseconds per call. An #include of
    the installed files by absolute path keeps the source small (each part by its own path:
    a JIT compiler need not resolve includes relative to the including file); the digest of
    the whole text is written next to it so that MLX's on-disk PTX cache (keyed by that
    hash) never outlives a changed header. Inlined where the package is not a plain folder
    on disk.
    """
    folder = Path(__file__).resolve().parent
    parts = [folder / part for part in _PART_INCLUDE.findall(_read("msl_compat.cuh"))]
    text = compat_header()
    if not all(p.is_file() for p in parts) or any(c in str(folder) for c in '"\n\\'):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return (f"// msl_compat.cuh sha256:{digest}\n"
            + "".join(f'#include "{p}"\n' for p in parts))


# ---- source rewrites shared by header and body -------------------------------------------

_METAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.M)
_CLANG_UNROLL = re.compile(r"#[ \t]*pragma[ \t]+clang[ \t]+loop[ \t]+unroll\(full\)")
_CLANG_UNROLL_OP = re.compile(r'_Pragma\(\s*"clang loop unroll\(full\)"\s*\)')
_COMMENT_LINE = re.compile(r"^[ \t]*//.*\n", re.M)
# Program-scope `constant` declarations (at column 0) become CUDA constant memory.
_PROGRAM_CONSTANT = re.compile(r"^((?:static[ \t]+)?)constant\b", re.M)


# MSL address spaces on pointers and references: CUDA pointers are generic.
_ADDRESS_SPACE = re.compile(r"\b(?:device|constant|thread|threadgroup|threadgroup_imageblock)\b[ \t]*")


def _common_rewrites(text: str) -> str:
    text = _METAL_INCLUDE.sub("", text)
    text = _CLANG_UNROLL.sub("#pragma unroll", text)
    text = _CLANG_UNROLL_OP.sub('_Pragma("unroll")', text)
    return rewrite_literals(text)


def translate_header(msl_header: str) -> str:
    """The ``header`` argument for cuda_kernel, written out: the compat library plus the MSL
    helpers (``translate_helpers``). At run time the helpers come from a file
    (``_helpers.py``); the text compiled is the same."""
    return compat_include() + translate_helpers(msl_header)


def translate_helpers(msl_header: str) -> str:
    """The MSL helpers of a kernel's header (the template's and those it includes), for CUDA.

    The helpers go inside ``namespace mlx::core::cu`` (where the kernel lives, so they see
    the MSL names), and their ``inline`` functions are marked ``__device__``: NVRTC, which
    MLX runs with --device-as-default-execution-space, needs nothing, while nvcc (the CI
    check) has no such option.
    """
    helpers = _PRAGMA_ONCE.sub("", _common_rewrites(msl_header))
    helpers = _ADDRESS_SPACE.sub("", _PROGRAM_CONSTANT.sub(r"\1__constant__", helpers))
    helpers = _COMMENT_LINE.sub("", helpers)  # the template's documentation: not compiled
    return (
        "\nnamespace mlx::core::cu {\n#define inline __device__ inline\n"
        + "// ---- MSL helpers of the kernel template ----\n"
        + helpers.strip("\n")
        + "\n#undef inline\n}  // namespace mlx::core::cu\n\n"
    )


def launch_bounds_directive(max_threads: int, min_blocks: int) -> str:
    """Header lines giving the kernel MLX declares after the header CUDA's
    ``__launch_bounds__(max_threads, min_blocks)``: MLX writes the ``__global__``
    declaration itself, so ``__global__`` is redefined to carry the attribute (one kernel
    per translation unit: it reaches that kernel only). A launch with a larger threadgroup
    would fail on the device: the executor refuses it first."""
    if not (0 < max_threads <= 1024 and max_threads % 32 == 0 and 0 < min_blocks <= 32):
        raise ValueError(f"[cuda] launch bounds ({max_threads}, {min_blocks}): expected a "
                         "multiple of 32 up to 1024 threads and 1 to 32 blocks per SM")
    return ("#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({max_threads}, {min_blocks})\n")


# ---- the body: built-ins, scalar inputs, atomic outputs, overhanging blocks ---------------

_AXES = "xyz"


def _uint3(parts: Iterable[str]) -> str:
    return "uint3(" + ", ".join(parts) + ")"


def _builtin_fields(guarded: bool) -> dict[str, str]:
    """The CUDA expressions the built-in table's templates are written in.

    ``guarded``: the grid is an input (blocks overhang Metal's grid)."""
    if guarded:
        grid = [f"{GRID_INPUT}[{i}]" for i in range(3)]
        # Edge threadgroups are partial in Metal: their size is what is left of the grid.
        tptg = [f"min(blockDim.{a}, {GRID_INPUT}[{i}] - blockIdx.{a} * blockDim.{a})"
                for i, a in enumerate(_AXES)]
    else:
        grid = [f"gridDim.{a} * blockDim.{a}" for a in _AXES]
        tptg = [f"blockDim.{a}" for a in _AXES]
    return {
        "position": _uint3(f"(blockIdx.{a} * blockDim.{a} + threadIdx.{a})" for a in _AXES),
        "thread_idx": _uint3(f"threadIdx.{a}" for a in _AXES),
        "block_idx": _uint3(f"blockIdx.{a}" for a in _AXES),
        "grid_dim": _uint3(f"gridDim.{a}" for a in _AXES),
        "block_dim": _uint3(f"blockDim.{a}" for a in _AXES),
        "grid": _uint3(grid),
        "tptg": _uint3(tptg),
        "linear": "((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x)",
        "size": "(" + " * ".join(f"({t})" for t in tptg) + ")",
        "dispatch_size": "(blockDim.x * blockDim.y * blockDim.z)",
        "width": str(SIMD_WIDTH),
        "width_minus_1": str(SIMD_WIDTH - 1),
    }


def _builtins(guarded: bool) -> dict[str, tuple[str, str]]:
    """MSL attribute name -> (type, CUDA expression)."""
    fields = _builtin_fields(guarded)
    return {b.name: (b.type, b.cuda.format(**fields)) for b in BUILTINS}


BUILTIN_NAMES = tuple(b.name for b in BUILTINS)


def used_builtins(body: str) -> list[str]:
    """The MSL built-in attributes the body refers to, in the table's order."""
    return [name for name in BUILTIN_NAMES if re.search(rf"\b{name}\b", body)]


def scalar_input_name(name: str) -> str:
    return f"mt_scalar_{name}"


def atomic_output_name(name: str) -> str:
    return f"mt_atomic_{name}"


@dataclass(frozen=True)
class Body:
    """What cuda_kernel is built from for one call signature."""

    source: str
    input_names: tuple[str, ...]  # as the CUDA signature names them (grid input last)
    output_names: tuple[str, ...]


def prepass_body(msl_body: str) -> str:
    """The call-independent rewrites of an MSL body (done once per kernel)."""
    return _ADDRESS_SPACE.sub("", _common_rewrites(rewrite_threadgroup_declarations(msl_body)))


def translate_body(body: str, input_names: Sequence[str], output_names: Sequence[str], *,
                   scalar_inputs: Sequence[bool], guarded: bool = False,
                   atomic_outputs: bool = False,
                   packed_types: Sequence[str | None] | None = None) -> Body:
    """Wrap a pre-passed MSL body (``prepass_body``) for cuda_kernel.

    ``scalar_inputs[i]``: input i is 0-d (Metal passes it by reference). ``packed_types[i]``
    (None: none packed): the MSL type ("uint", "int" or "float") of a 0-d input whose bits
    come in slot j of the uint32 input ``PACKED_INPUT`` (j counts the packed inputs before
    it) instead of as an input of its own. ``guarded``: the grid is not a whole number of
    threadgroups, so the grid comes in as a uint32[3] input and threads past it return
    before the body (see ``grid_is_whole``).
    """
    packed_types = packed_types or [None] * len(input_names)
    if not len(scalar_inputs) == len(packed_types) == len(input_names):
        raise ValueError("[cuda] scalar_inputs and packed_types must have one entry per input")
    if any(t is not None and not s for s, t in zip(scalar_inputs, packed_types, strict=True)):
        raise ValueError("[cuda] only scalar (0-d) inputs can be packed")
    prelude = []
    builtins = _builtins(guarded)
    if guarded:
        outside = " || ".join(
            f"blockIdx.{a} * blockDim.{a} + threadIdx.{a} >= {GRID_INPUT}[{i}]"
            for i, a in enumerate(_AXES))
        prelude.append(f"if ({outside}) return;  // past Metal's grid")
    for name in used_builtins(body):
        type_, expr = builtins[name]
        prelude.append(f"const {type_} {name} = {expr};")

    cuda_inputs = []
    slot = 0
    for name, is_scalar, packed in zip(input_names, scalar_inputs, packed_types, strict=True):
        if packed is not None:
            prelude.append(f"const {packed} {name} = mt_unpack_scalar<{packed}>"
                           f"({PACKED_INPUT}[{slot}]);")
            slot += 1
        elif is_scalar:
            cuda_inputs.append(scalar_input_name(name))
            prelude.append(f"const auto& {name} = *{scalar_input_name(name)};")
        else:
            cuda_inputs.append(name)
    if slot:
        cuda_inputs.append(PACKED_INPUT)
    if guarded:
        cuda_inputs.append(GRID_INPUT)

    cuda_outputs = []
    for name in output_names:
        if atomic_outputs:
            cuda_outputs.append(atomic_output_name(name))
            prelude.append(f"auto* const {name} = mt_as_atomic({atomic_output_name(name)});")
        else:
            cuda_outputs.append(name)

    source = "// ---- MSL built-ins and Metal-style arguments ----\n"
    source += "\n".join(prelude) + "\n// ---- kernel body ----\n" + body
    return Body(source, tuple(cuda_inputs), tuple(cuda_outputs))


def grid_is_whole(grid: Sequence[int], threadgroup: Sequence[int]) -> bool:
    """True if MLX's CUDA launch covers exactly Metal's grid (no thread past it).

    MLX launches ceil(g / t) blocks of min(t, g) threads per axis.
    """
    return all(g <= t or g % t == 0 for g, t in zip(grid, threadgroup, strict=True))


# ---- the translation unit as MLX builds it ----------------------------------------------

def _template_hash(template: Sequence[tuple[str, object]]) -> str:
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append("_" + type_string(value))
    return "".join(parts)


def mlx_kernel_name(name: str, template: Sequence[tuple[str, object]] = ()) -> str:
    """The function name MLX gives a custom kernel (``custom_kernel_<name><template hash>``)."""
    return f"custom_kernel_{name}{_template_hash(template)}"


def _template_line(name: str, value) -> str:
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {'true' if value else 'false'};\n"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};\n"
    return f"  using {name} = {cuda_type(value)};\n"


def kernel_definition(function_name: str, source: str,
                      inputs: Sequence[tuple[str, object, int]],
                      outputs: Sequence[tuple[str, object]],
                      template: Sequence[tuple[str, object]] = ()) -> str:
    """The ``namespace mlx::core::cu { __global__ ... }`` part MLX writes after the header.

    ``inputs``: (CUDA parameter name, dtype, ndim); ``outputs``: (name, dtype).
    """
    if not outputs:
        raise ValueError("[cuda] a kernel needs at least one output")
    text = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {function_name}(\n"
    for name, dtype, ndim in inputs:
        text += f"    const {cuda_type(dtype)}* {name},\n"
        if ndim > 0:
            if f"{name}_shape" in source:
                text += f"    const __grid_constant__ Shape {name}_shape,\n"
            if f"{name}_strides" in source:
                text += f"    const __grid_constant__ Strides {name}_strides,\n"
            if f"{name}_ndim" in source:
                text += f"    const __grid_constant__ int {name}_ndim,\n"
    for i, (name, dtype) in enumerate(outputs):
        text += f"    {cuda_type(dtype)}* {name}"
        text += ",\n" if i < len(outputs) - 1 else ") {\n"
    if template:
        text += "".join(_template_line(n, v) for n, v in template) + "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"


def translation_unit(header: str, definitions: Sequence[str]) -> str:
    """MLX's whole program text: its default header, ``header``, then the kernels.

    One definition gives exactly what MLX compiles for one kernel; several (instantiations
    of one template, sharing its header) make one unit for a faster compile check.
    """
    return MLX_DEFAULT_HEADER + header + "".join(definitions)
