"""The C++ translation unit of one kernel instantiation.

The MSL itself is compiled nearly as written: the runtime header makes the address-space
words empty, gives the MSL types and functions, and ignores ``[[attributes]]``. What changes
is line-preserving: kernel-scope ``threadgroup`` arrays become ``MT_THREADGROUP_ARRAY``
and literal suffixes a C++ compiler does not know (``1.0h``, ``2.0bf``) become macros (both
rewrites shared, in ``_msl/source.py``); the built-ins are read from the runtime's per-thread
ids as ``_msl/builtins.py`` states. ``kernel.cpp`` includes ``header.metal`` and
``body.metal``, so the compiler's messages and the debug line tables name the kernel's own lines.
"""

from __future__ import annotations

import re

from .._msl.builtins import BY_NAME
from .._msl.signature import GeneratedKernel
from .._msl.source import rewrite_literals, rewrite_threadgroup_declarations

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
    args += [BY_NAME[attr].emulator for attr, _ in gen.attributes]
    call = gen.kernel_name + gen.template_def
    cpp.append('extern "C" void mt_kernel_thread(void* const* a, const mt_ids* t) {')
    cpp.append("  (void)a;\n  (void)t;")
    cpp.append(f"  {call}(\n      " + ",\n      ".join(args) + ");")
    cpp.append("}")
    return "\n".join(cpp) + "\n", header, body
