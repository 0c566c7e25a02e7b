"""The kernel source that ``mx.fast.metal_kernel`` builds around a body, reproduced.

Shared by the executors that run MSL bodies without Metal (emulator, CUDA layer): they must
see exactly the signature MLX generates, so that any body written for MLX works unchanged.
Facts mirrored from MLX's ``metal_kernel`` (mlx/backend/common/metal_kernel.cpp); the
built-ins and dtype spellings come from ``builtins.py`` and ``dtypes.py``:

* inputs with fewer than 8 elements go to the ``constant`` address space, others to
  ``device``; 0-d inputs are passed by reference (``const constant float& eps``);
* ``<name>_shape`` (``const constant int*``), ``<name>_strides`` (``const constant
  int64_t*``) and ``<name>_ndim`` (``const constant int&``) follow an input (not a 0-d one)
  only when the body mentions them (plain substring search, as MLX does);
* the built-in attributes (20 of them) are parameters only when the body mentions them;
* outputs are ``device T*`` (``device atomic<T>*`` with ``atomic_outputs``);
* template arguments: dtypes become ``typename`` parameters, ints ``int``, bools ``bool``
  (instantiated as 1/0); the kernel name encodes template values, input dtypes and kinds.

MLX writes a stray ``) {`` when there are several outputs, shape parameters and no
attributes; here the parameter list is always well formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .builtins import METAL_ATTRIBUTES
from .dtypes import type_string

MAX_CONSTANT_ARRAY_SIZE = 8


@dataclass(frozen=True)
class InputInfo:
    """What the signature needs to know of an input array."""

    dtype: mx.Dtype
    ndim: int
    size: int


@dataclass(frozen=True)
class Param:
    """One buffer parameter of the generated kernel, in buffer-index order."""

    name: str
    msl_type: str  # e.g. "const device float*", "const constant int&"
    kind: str  # "input", "shape", "strides", "ndim" or "output"
    index: int  # which input / output it belongs to
    buffer: int  # [[buffer(i)]]

    @property
    def by_reference(self) -> bool:
        return self.msl_type.endswith("&")


@dataclass(frozen=True)
class GeneratedKernel:
    kernel_name: str
    source: str  # the full MSL source MLX compiles (utils header excluded)
    header: str
    body: str
    template_params: tuple[tuple[str, str], ...]  # (parameter kind, name): "typename T"
    template_values: tuple[str, ...]  # instantiation text per parameter ("float", "4", "1")
    params: tuple[Param, ...]
    attributes: tuple[tuple[str, str], ...]  # (name, type) of the built-ins used

    @property
    def template_def(self) -> str:
        return "<" + ", ".join(self.template_values) + ">" if self.template_values else ""


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Per input: whether the body mentions <name>_shape, <name>_strides, <name>_ndim."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
            for n in input_names]


def used_attributes(source: str) -> list[tuple[str, str]]:
    return [(name, typ) for name, typ in METAL_ATTRIBUTES if name in source]


def template_arg(value) -> tuple[str, str]:
    """(parameter kind, instantiation text) of one template argument value."""
    if isinstance(value, bool):
        return "bool", "1" if value else "0"
    if isinstance(value, int):
        if not -(2**31) <= value < 2**31:
            raise ValueError(f"[metal_kernel] template argument {value} does not fit in an int")
        return "int", str(value)
    if isinstance(value, mx.Dtype):
        return "typename", type_string(value)
    raise ValueError("[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, "
                     "`int` or `bool`.")


def kernel_name(name: str, template_values: Sequence[str], inputs: Sequence[InputInfo],
                output_dtypes: Sequence[mx.Dtype]) -> str:
    """The function name MLX gives one instantiation (it encodes everything that changes
    the generated source)."""
    out = f"custom_kernel_{name}"
    if template_values:
        out += "__" + "_".join(template_values)
    for info in inputs:
        out += "_" + type_string(info.dtype)
        if info.ndim == 0:
            out += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for dtype in output_dtypes:
        out += "_" + type_string(dtype)
    return out


def generate(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
             header: str, inputs: Sequence[InputInfo], output_dtypes: Sequence[mx.Dtype],
             template: Sequence[tuple[str, object]] = (),
             atomic_outputs: bool = False) -> GeneratedKernel:
    """The kernel MLX would compile for this call."""
    targs = [(tname, *template_arg(value)) for tname, value in template]
    template_values = tuple(text for _, _, text in targs)
    kname = kernel_name(name, template_values, inputs, output_dtypes)

    params: list[Param] = []
    buffer = 0
    for i, (iname, info) in enumerate(zip(input_names, inputs, strict=True)):
        space = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        params.append(Param(iname, f"const {space} {type_string(info.dtype)}{ref}", "input", i,
                            buffer))
        buffer += 1
        if info.ndim > 0:
            has_shape, has_strides, has_ndim = shape_infos(source, [iname])[0]
            for flag, kind, typ in ((has_shape, "shape", "const constant int*"),
                                    (has_strides, "strides", "const constant int64_t*"),
                                    (has_ndim, "ndim", "const constant int&")):
                if flag:
                    params.append(Param(f"{iname}_{kind}", typ, kind, i, buffer))
                    buffer += 1
    for i, (oname, dtype) in enumerate(zip(output_names, output_dtypes, strict=True)):
        typ = type_string(dtype)
        if atomic_outputs:
            typ = f"atomic<{typ}>"
        params.append(Param(oname, f"device {typ}*", "output", i, buffer))
        buffer += 1
    attributes = used_attributes(source)

    lines = [f"  {p.msl_type} {p.name} [[buffer({p.buffer})]]" for p in params]
    lines += [f"  {typ} {attr} [[{attr}]]" for attr, typ in attributes]
    text = header
    if targs:
        text += "template <" + ", ".join(f"{kind} {tname}" for tname, kind, _ in targs) + ">\n"
    text += f"[[kernel]] void {kname}(\n" + ",\n".join(lines) + ") {\n" + source + "\n}\n"
    if targs:
        inst = f"{kname}<{', '.join(template_values)}>"
        text += (f"\ntemplate [[host_name(\"{kname}\")]] [[kernel]] decltype({inst}) "
                 f"{inst};\n")
    return GeneratedKernel(
        kernel_name=kname, source=text, header=header, body=source,
        template_params=tuple((kind, tname) for tname, kind, _ in targs),
        template_values=template_values, params=tuple(params),
        attributes=tuple(attributes))
