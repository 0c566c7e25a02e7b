"""The C++ translation unit of one kernel instantiation.

The MSL itself is compiled nearly as written: the runtime header makes the address-space
words empty, gives the MSL types and functions, and ignores ``[[attributes]]``. What changes
is line-preserving: kernel-scope ``threadgroup`` arrays become ``MT_THREADGROUP_ARRAY``
(the shared pre-pass) and literal suffixes a C++ compiler does not know (``1.0h``,
``2.0bf``) become casts. ``kernel.cpp`` includes ``header.metal`` and ``body.metal``, so the
compiler's messages and the debug line tables name the kernel's own lines.
"""

from __future__ import annotations

import re

from .._msl_signature import GeneratedKernel
from .._msl_source import rewrite_threadgroup_declarations

_HALF_LITERAL = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(h|H|bf|BF)\b")


def rewrite_literals(source: str) -> str:
    def replace(m: re.Match) -> str:
        number = m.group(1)
        macro = "MT_HALF_LITERAL" if m.group(2) in ("h", "H") else "MT_BFLOAT_LITERAL"
        return f"{macro}({number}{'f' if '.' in number or 'e' in number.lower() else ''})"

    return _HALF_LITERAL.sub(replace, source)


# How each built-in attribute is read from the runtime's per-thread ids (mt_ids).
_UINT3 = "uint3(t->{0}[0], t->{0}[1], t->{0}[2])"
_ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": "t->dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup": "t->dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": _UINT3.format("dispatch_threads_per_threadgroup"),
    "grid_origin": "uint3(0u, 0u, 0u)",
    "grid_size": _UINT3.format("threads_per_grid"),
    "quadgroup_index_in_threadgroup": "t->quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup": "t->quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup": "t->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "t->simdgroups_per_threadgroup",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "t->thread_index_in_quadgroup",
    "thread_index_in_simdgroup": "t->thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "t->thread_index_in_threadgroup",
    "thread_position_in_grid": _UINT3.format("thread_position_in_grid"),
    "thread_position_in_threadgroup": _UINT3.format("thread_position_in_threadgroup"),
    "threadgroup_position_in_grid": _UINT3.format("threadgroup_position_in_grid"),
    "threadgroups_per_grid": _UINT3.format("threadgroups_per_grid"),
    "threads_per_grid": _UINT3.format("threads_per_grid"),
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": _UINT3.format("threads_per_threadgroup"),
}


# A kernel that includes Metal 4 headers is compiled as MSL 4.0 (what MLX uses on macOS 26):
# it sees __METAL_VERSION__ 400 and the emulator's <metal_tensor> / MetalPerformancePrimitives
# subset. Every other kernel keeps the default version of the runtime headers.
_METAL4_INCLUDE = re.compile(r"^\s*#\s*include\s*<(?:metal_tensor|MetalPerformancePrimitives/)",
                             re.M)


def translate(gen: GeneratedKernel) -> tuple[str, str, str]:
    """(kernel.cpp, header.metal, body.metal) for one generated kernel."""
    header = rewrite_literals(gen.header)
    body = rewrite_literals(rewrite_threadgroup_declarations(gen.body))
    lines = [f"  {p.msl_type} {p.name} [[buffer({p.buffer})]]" for p in gen.params]
    lines += [f"  {typ} {attr} [[{attr}]]" for attr, typ in gen.attributes]
    cpp = []
    if _METAL4_INCLUDE.search(header):
        cpp += ["#undef __METAL_VERSION__", "#define __METAL_VERSION__ 400"]
    cpp.append('#include "header.metal"')
    if gen.template_params:
        cpp.append("template <" + ", ".join(f"{k} {n}" for k, n in gen.template_params) + ">")
    cpp.append(f"[[kernel]] void {gen.kernel_name}(")
    cpp.append(",\n".join(lines) + ") {")
    cpp.append('#include "body.metal"')
    cpp.append("}")
    args = []
    for i, p in enumerate(gen.params):
        if p.by_reference:
            args.append(f"*({p.msl_type[:-1]}*)a[{i}]")
        else:
            args.append(f"({p.msl_type})a[{i}]")
    args += [_ATTRIBUTE_VALUES[attr] for attr, _ in gen.attributes]
    call = gen.kernel_name + gen.template_def
    cpp.append('extern "C" void mt_kernel_thread(void* const* a, const mt_ids* t) {')
    cpp.append("  (void)a;\n  (void)t;")
    cpp.append(f"  {call}(\n      " + ",\n      ".join(args) + ");")
    cpp.append("}")
    return "\n".join(cpp) + "\n", header, body
